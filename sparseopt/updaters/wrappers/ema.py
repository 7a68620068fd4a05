"""`ema_momentum`: an exponential moving average of each row, at sparse cost.

As Keras' `use_ema=True` does for a dense variable: after each step,
`average <- m average + (1 - m) w` (`m = 0` on the optimizer's first step),
and at the end of `fit` the table takes its average.

The average is kept as an offset `e = average - row` (`ema_offset`), with the
step that last updated the row (`last_step`, shared with `lazy=False`, which
never goes with it). While a row does not change, each step only multiplies
`e` by `m`: exact, so `e` starts at 0 and untouched rows need nothing until
they are touched (`e` decays by `m^k` over the `k` steps missed). On a step
that changes the row from `w` to `w'`: `average' = m (w + e) + (1 - m) w'`, so
`e' = m (w + e - w')`.
"""

from keras import ops

from sparseopt.updaters.core.slots import SlotSpec
from sparseopt.updaters.wrappers.catch_up import (
    EMA_OFFSET_SLOT, LAST_STEP, LAST_STEP_SLOT, catch_up_whole, power, refuse_whole_state,
    without)

EMA_OFFSET = SlotSpec(EMA_OFFSET_SLOT)


class MovingAverage:
    """The moving average of each row (`ema_momentum=m`).

    Args:
        momentum: `m`, in `[0, 1)`.
    """

    slots = (LAST_STEP, EMA_OFFSET)
    tracks_rows = True
    keeps_window = False

    def __init__(self, momentum):
        self.momentum = momentum

    def check(self, updater):
        refuse_whole_state(updater)
        if not updater.lazy:
            raise ValueError(
                f"{type(updater).__name__}: `ema_momentum` with lazy=False is not supported: "
                "the moving average of a row that moves while untouched has no exact closed "
                "form here. Use one or the other.")

    def around(self, updater, rule):
        """`rule`, then each touched row's average moved along."""
        def step(rows, state, grads, hp):
            now = ops.cast(hp.step, "int32")
            last = state[LAST_STEP_SLOT]
            offset = self._decayed(state, now - 1)
            new_rows, new_state = rule(rows, without(state, (LAST_STEP_SLOT, EMA_OFFSET_SLOT)),
                                       grads, hp)
            m = ops.where(now == 1, 0.0, self.momentum)
            return new_rows, {**new_state,
                              LAST_STEP_SLOT: ops.full(ops.shape(last), now, "int32"),
                              EMA_OFFSET_SLOT: m * (rows + offset - new_rows)}

        return step

    def caught_up(self, updater, rows, state, steps_done, hp):
        """`(rows, state)` of the whole table at step `steps_done`: every row's offset
        decayed over the steps it missed (the rows themselves do not move)."""
        last = state[LAST_STEP_SLOT]
        return rows, {**without(state, (LAST_STEP_SLOT, EMA_OFFSET_SLOT)),
                      LAST_STEP_SLOT: ops.full(ops.shape(last), steps_done, "int32"),
                      EMA_OFFSET_SLOT: self._decayed(state, ops.cast(steps_done, "int32"))}

    def _decayed(self, state, until):
        """Each row's offset decayed over its steps after its last one up to step `until`."""
        missed = ops.maximum(until - state[LAST_STEP_SLOT], 0)
        return state[EMA_OFFSET_SLOT] * power(self.momentum, missed)[:, None]

    def average(self, updater, storage, steps_done, hp):
        """The table's moving average at `steps_done` (float32 `[V, D]`, nothing written)."""
        # (Only the two slots the average reads: the rule's own pass through untouched.)
        state = {n: storage.state_values(n) for n in (LAST_STEP_SLOT, EMA_OFFSET_SLOT)}
        rows, state = self.caught_up(updater, storage.values(), state, steps_done, hp)
        return rows + state[EMA_OFFSET_SLOT]

    def end_of_fit(self, updater, storage, steps_done, hp):
        """The table takes its average (as Keras' `use_ema` at the end of `fit`); the
        average stays what it was (its offset from the new rows is 0)."""
        catch_up_whole(self, updater, storage, steps_done, hp)
        storage.assign_values(storage.values() + storage.state_values(EMA_OFFSET_SLOT),
                              steps_done)
        storage.assign_state(EMA_OFFSET_SLOT,
                             ops.zeros(storage.slots[EMA_OFFSET_SLOT].shape, "float32"),
                             steps_done, rounded=False)
