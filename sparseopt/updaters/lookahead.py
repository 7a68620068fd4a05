"""Lookahead for tables (`lookahead_period`), exact at sparse cost: the rule's side.

Lookahead (Zhang et al., 2019; TF Addons' `Lookahead` wrapper) keeps a slow
copy of the weights. The rule updates the fast weights (the table) every
step; after the update of every step `t` (1-based) with `t % k == 0`, every
row is synced:

    slow <- slow + alpha (fast - slow);   fast <- slow

A row the rule did not change since the last sync has `fast == slow`, and
its sync changes nothing. So only the rows changed in the window need a
sync: the trainer lists them as they change (`sparseopt.lookahead_window`)
and syncs that list at the end of the window.

The slow copy is kept as an offset from the row, `slow - fast`
(`lookahead_offset`), which starts at 0: a clean row's offset is 0, and a
row an open vocabulary gives to a new id starts clean (its slot reset to 0)
with no other bookkeeping. The rule moves the row and the offset the other
way; the sync folds the offset back in.
"""

from keras import ops

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
