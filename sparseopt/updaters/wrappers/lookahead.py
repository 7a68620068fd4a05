"""Lookahead for tables (`lookahead_period`), exact at sparse cost: the rule's side.

Lookahead (Zhang et al., 2019; TF Addons' `Lookahead` wrapper) keeps a slow
copy of the weights. The rule updates the fast weights (the table) every
step; after the update of every step `t` (1-based) with `t % k == 0`, every
row is synced:

    slow <- slow + alpha (fast - slow);   fast <- slow

A row the rule did not change since the last sync has `fast == slow`, and
its sync changes nothing. So only the rows changed in the window need a
sync: the trainer lists them as they change (`sparseopt.engine.lookahead_window`)
and syncs that list at the end of the window.

The slow copy is kept as an offset from the row, `slow - fast`
(`lookahead_offset`), which starts at 0: a clean row's offset is 0, and a
row an open vocabulary gives to a new id starts clean (its slot reset to 0)
with no other bookkeeping. The rule moves the row and the offset the other
way; the sync folds the offset back in.
"""

from keras import ops

from sparseopt.updaters.core.slots import SlotSpec
from sparseopt.updaters.wrappers.catch_up import without

OFFSET_SLOT = "lookahead_offset"


def offset_after(offset, rows, new_rows):
    """The offset once the rule moved `rows` to `new_rows` (the slow copy stays)."""
    return offset + (rows - new_rows)


def synced(rows, offset, step_size):
    """The rows after a sync: `slow + alpha (fast - slow)`, with `slow = rows + offset`."""
    slow = rows + offset
    return slow + step_size * (rows - slow)


def window(step, period):
    """The 0-based window (between two syncs) that step `step` (1-based) belongs to."""
    return (ops.cast(step, "int32") - 1) // period


def syncs_at(step, period):
    """Whether step `step` (1-based) ends a window (a boolean scalar)."""
    return ops.equal(ops.mod(ops.cast(step, "int32"), period), 0)


def check(owner, period, step_size):
    """`(period, step_size)` as `(int, float)`, or None when `period` is None.

    Args:
        owner: the updater's class name, for messages.
        period: `lookahead_period`, the steps between syncs (TF Addons' `sync_period`).
        step_size: `lookahead_step_size`, alpha (TF Addons' `slow_step_size`).
    """
    if period is None:
        return None
    if isinstance(period, bool) or not isinstance(period, int) or period < 1:
        raise ValueError(f"{owner}: `lookahead_period` must be a positive int, got "
                         f"{period!r}.")
    if (isinstance(step_size, bool) or not isinstance(step_size, (int, float))
            or not 0 < step_size <= 1):
        raise ValueError(f"{owner}: `lookahead_step_size` must be a number in (0, 1], got "
                         f"{step_size!r}.")
    return int(period), float(step_size)


OFFSET = SlotSpec(OFFSET_SLOT)


class Lookahead:
    """Lookahead of each row (`lookahead_period`, `lookahead_step_size`).

    The rule's side is here (the offset slot, its move with the rule, the
    sync's arithmetic, what is refused); the list of rows changed in the
    current window and the sync that ends it are the table's trainer's
    (`keeps_window`: `sparseopt.engine.lookahead_window`, which reads and
    writes rows through the table's row storage).

    Args:
        period: the steps between syncs.
        step_size: alpha, how far the slow copy moves towards the fast one.
    """

    slots = (OFFSET,)
    tracks_rows = False
    keeps_window = True

    def __init__(self, period, step_size):
        self.period, self.step_size = period, step_size

    def check(self, updater):
        owner = type(updater).__name__
        if not updater.lazy and not updater.dense_in_rule:
            raise ValueError(
                f"{owner}: `lookahead_period` with lazy=False is not supported: rows that "
                "move while untouched would need a sync of every row every window "
                "(whole-table work). Use lazy=True with lookahead_period.")
        if updater.ema_momentum is not None or updater.swa is not None:
            other = "ema_momentum" if updater.ema_momentum is not None else "swa_period"
            raise ValueError(
                f"{owner}: `lookahead_period` with `{other}` is not supported: the "
                f"{'moving' if other == 'ema_momentum' else 'weight'} average follows rows "
                "that change only when touched, and the sync also changes rows the step did "
                "not touch. Use one or the other.")
        derived = [s.name for s in updater.rule_slots if s.from_table is not None]
        if derived:
            raise ValueError(
                f"{owner}: `lookahead_period` is not supported with state kept from the "
                f"whole table's values {derived} (lazy=False): the sync changes rows outside "
                "the rule, which that state would not see. Use lazy=True with "
                "lookahead_period.")

    def check_storage(self, updater, table, kind):
        """Refuses a kind of row storage that cannot sync: one whose step sees only the
        rows its lookups read (int8 in memory: `RowStorage.reads_any_row`), where a sync
        inside a step of rows changed earlier in the window has no way in.

        Args:
            updater: the table's `Updater`; `table`: its path, for the message.
            kind: the table's `RowStorage` class.
        """
        if not kind.reads_any_row:
            raise ValueError(
                f"Table '{table}' (int8): {type(updater).__name__} with lookahead_period is "
                "not supported on int8 tables: its sync reads and writes, inside a step, rows "
                "changed earlier in the window, and an int8 table's step sees only the rows "
                "its lookups read in that step (syncing them would need a write buffer for "
                "every row of the window). Leave it out, or store the table in bfloat16 (half "
                "the memory of float32).")

    def around(self, updater, rule):
        """`rule`, then each changed row's offset from its slow copy moved the other way."""
        def run(rows, state, grads, hp):
            new_rows, new_state = rule(rows, without(state, (OFFSET_SLOT,)), grads, hp)
            return new_rows, {**new_state,
                              OFFSET_SLOT: offset_after(state[OFFSET_SLOT], rows, new_rows)}

        return run

    def end_of_fit(self, updater, storage, steps_done, hp):
        """Nothing: the table holds the fast weights, as TF Addons' Lookahead leaves them."""
