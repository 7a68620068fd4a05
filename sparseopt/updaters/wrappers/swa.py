"""Stochastic weight averaging of tables, exact at sparse cost (`swa_period`).

SWA (Izmailov et al., 2018; TF Addons' `SWA` wrapper) keeps an average of
snapshots of the weights: after the update of every step `t` (1-based) with
`t - 1 >= start` and `(t - 1 - start) % period == 0`, with `k` snapshots so
far,

    average <- (k average + w) / (k + 1)

Every row takes part in every snapshot, touched or not. But a lazy rule
changes a row only on the steps that touch it, so between two of its changes
every snapshot sees the same row: per row it suffices to keep the average of
the snapshots up to its last change and their number (`swa_count`, int32).
When the row next changes, the snapshots it missed are added at once:

    average <- (c average + (K - c) w) / K        (K snapshots so far, c counted)

then this step's snapshot, if any, of the new row. The table's average at
any step is the same catch-up over every row (`DispatchOptimizer.
table_swa_average`; at the end of `fit` the table takes it). Exact for any
rule that moves a row only when touched: refused with `lazy=False` (rows
move while untouched).
"""

from keras import ops

from sparseopt.updaters.core.slots import SlotSpec
from sparseopt.updaters.wrappers.catch_up import without

AVERAGE_SLOT = "swa_average"
COUNT_SLOT = "swa_count"


def snapshots(steps, start, period):
    """Snapshots taken in the first `steps` steps (an int tensor, any shape)."""
    after = ops.cast(steps, "int32") - 1 - start
    return ops.where(after >= 0, after // period + 1, 0)


def caught_up(average, count, rows, total):
    """The average over `total` snapshots of rows that were `rows` since their `count`-th.

    Args:
        average: `[U, D]` the rows' averages over their first `count` snapshots.
        count: int `[U]`.
        rows: `[U, D]` the rows as they have been since.
        total: int scalar or `[U]`, the snapshots taken so far.
    """
    c = ops.cast(count, "float32")[:, None]
    k = ops.broadcast_to(ops.cast(total, "float32"), ops.shape(count))[:, None]
    # (c average + (k - c) rows) / k, written so that a row with no snapshot
    # counted yet (c = 0, average 0) averages to itself exactly.
    missed = (k - c) / ops.maximum(k, 1.0)
    return ops.where(k > c, average + (rows - average) * missed, average)


def step(average, count, rows, new_rows, step_, start, period):
    """A changed row's average and count after step `step_` (1-based).

    Args:
        average, count: the rows' slots before the step.
        rows: `[U, D]` the rows before the step; `new_rows` after it.
        step_: int scalar.
        start, period: the schedule (Python ints).

    Returns:
        `(average, count)` after the step's snapshot, if it takes one.
    """
    before = snapshots(step_ - 1, start, period)
    average = caught_up(average, count, rows, before)
    taken = snapshots(step_, start, period) > before
    k = ops.cast(before, "float32")
    average = ops.where(taken, average + (new_rows - average) / (k + 1.0), average)
    total = before + ops.cast(taken, "int32")
    return average, ops.full(ops.shape(count), total, "int32")


def table_average(table, average, count, steps_done, start, period):
    """The whole table's SWA average after `steps_done` steps (the table where none
    was taken yet)."""
    total = snapshots(steps_done, start, period)
    return ops.where(total > 0, caught_up(average, count, table, total), table)


def check(owner, start, period):
    """`(start, period)` as ints, or None when `period` is None; raises naming `owner`."""
    if period is None:
        return None
    if isinstance(period, bool) or not isinstance(period, int) or period < 1:
        raise ValueError(f"{owner}: `swa_period` must be a positive int, got {period!r}.")
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ValueError(f"{owner}: `swa_start` must be an int >= 0, got {start!r}.")
    return int(start), int(period)


AVERAGE = SlotSpec(AVERAGE_SLOT)
COUNT = SlotSpec(COUNT_SLOT, rowwise=True, initial_value=0, dtype="int32")


class WeightAverage:
    """Stochastic weight averaging of each row (`swa_period`, `swa_start`).

    Args:
        start, period: the schedule (module docstring).
    """

    slots = (AVERAGE, COUNT)
    tracks_rows = False
    keeps_window = False

    def __init__(self, start, period):
        self.start, self.period = start, period

    def check(self, updater):
        moves_untouched = not updater.lazy and not updater.dense_in_rule
        if moves_untouched or updater.ema_momentum is not None:
            raise ValueError(
                f"{type(updater).__name__}: `swa_period` with "
                f"{'lazy=False' if moves_untouched else 'ema_momentum'} is not supported: "
                + ("rows that move while untouched give every snapshot a different value, "
                   "which has no closed form here. Use lazy=True with swa_period."
                   if moves_untouched else "both would give the table their average at the "
                   "end of `fit`. Use one or the other."))

    def around(self, updater, rule):
        """`rule`, then each changed row's average brought up to this step's snapshot."""
        def run(rows, state, grads, hp):
            new_rows, new_state = rule(rows, without(state, (AVERAGE_SLOT, COUNT_SLOT)),
                                       grads, hp)
            average, count = step(state[AVERAGE_SLOT], state[COUNT_SLOT], rows, new_rows,
                                  hp.step, self.start, self.period)
            return new_rows, {**new_state, AVERAGE_SLOT: average, COUNT_SLOT: count}

        return run

    def average(self, updater, storage, steps_done, hp):
        """The table's SWA average after `steps_done` steps (float32 `[V, D]`)."""
        return table_average(storage.values(), storage.state_values(AVERAGE_SLOT),
                             storage.state_values(COUNT_SLOT), steps_done, self.start,
                             self.period)

    def end_of_fit(self, updater, storage, steps_done, hp):
        """The table takes its average; every row's record then counts all the snapshots
        taken (the rows are their averages from here on)."""
        average = self.average(updater, storage, steps_done, hp)
        storage.assign_values(average, steps_done)
        storage.assign_state(AVERAGE_SLOT, average, steps_done, rounded=False)
        storage.assign_state(
            COUNT_SLOT, ops.full(storage.slots[COUNT_SLOT].shape,
                                 snapshots(steps_done, self.start, self.period), "int32"),
            steps_done, rounded=False)
