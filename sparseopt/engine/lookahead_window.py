"""Lookahead's window: the rows of a table changed since its last sync, and the sync.

The rule keeps each row's offset from its slow copy
(`sparseopt.updaters.wrappers.lookahead`). A row the rule did not change since the
last sync has offset 0 and needs no sync, so this keeps, per table, the
rows changed in the current window, and the step that ends the window syncs
those rows only:

- `window`: int32 `[V]`, the window in which each row was last listed
  (-1: never);
- `rows`: int32 `[V]`, the list: its first `count` entries are the rows
  changed in the current window, each once (a row is listed at most once
  per window, so `V` entries always suffice);
- `count`: int32 scalar.

A step appends the distinct rows it changed that the window has not listed
yet (one cumulative sum over the step's distinct rows); the sync reads the
list's rows, folds their offsets in and empties the list. Work follows the
step's distinct rows, and the sync's the rows changed in the window. The
state is 8 bytes per row besides the offset, saved with the table.

These are the trainer's variables, not the updater's slots: an open
vocabulary resets a reused row's slots (its offset to 0: a clean row) but
must not touch the list, whose entries are positions, not rows.
"""

from keras import ops

from sparseopt import backend
from sparseopt.distribution import layout_like, replicated_beside
from sparseopt.updaters.wrappers import lookahead


def _minus_one(shape, dtype=None):
    return ops.full(shape, -1, dtype=dtype)


class LookaheadWindow:
    """The changed rows of one table's current Lookahead window.

    Args:
        period: the steps between syncs.
        step_size: alpha, how far the slow copy moves towards the fast one.
    """

    def __init__(self, period, step_size):
        self.period, self.step_size = period, step_size
        self.window = self.rows = self.count = None

    def build(self, optimizer, table, prefix):
        """Creates the variables with `optimizer.add_variable`, named after the table."""
        num_rows = table.shape[0]
        self.window = optimizer.add_variable(
            shape=(num_rows,), dtype="int32", initializer=_minus_one,
            layout=layout_like(table, 1), name=f"{prefix}_lookahead_window")
        self.rows = optimizer.add_variable(
            shape=(num_rows,), dtype="int32", initializer="zeros",
            layout=layout_like(table, 1), name=f"{prefix}_lookahead_rows")
        self.count = optimizer.add_variable(
            shape=(), dtype="int32", initializer="zeros", layout=replicated_beside(table, 0),
            name=f"{prefix}_lookahead_count")

    @property
    def variables(self):
        """What a checkpoint holds of the window."""
        return [self.window, self.rows, self.count]

    def record(self, distinct, applied, step, num_rows):
        """Lists the rows a step changed that this window has not listed yet.

        Args:
            distinct: the step's `Distinct` rows over the whole table.
            applied: boolean scalar, whether the step changed them (a skipped
                step changed nothing).
            step: int scalar, the 1-based update count.
            num_rows: the table's rows.
        """
        ids = ops.cast(distinct.ids, "int32")
        current = lookahead.window(step, self.period)
        position = ops.arange(ops.shape(ids)[0], dtype="int32")
        valid = ops.logical_and(ops.less(position, distinct.count),
                                ops.logical_and(ops.greater_equal(ids, 0),
                                                ops.less(ids, num_rows)))
        listed = ops.equal(backend.gather(self.window.value, ids), current)
        new = ops.logical_and(ops.logical_and(valid, applied), ops.logical_not(listed))
        added = ops.cast(new, "int32")
        at = self.count.value + ops.cumsum(added) - 1
        backend.scatter_where(self.rows, at, ids, new)
        backend.scatter_where(self.window, ids, ops.full(ops.shape(ids), current, "int32"),
                              new)
        self.count.assign(self.count.value + ops.sum(added))

    def sync(self, storage, offset, step, row_stream):
        """Syncs the listed rows (`slow + alpha (fast - slow)` into both) and empties the list.

        Args:
            storage: the table's `RowStorage`.
            offset: the name of its `lookahead_offset` slot.
            step: int scalar, the 1-based update count (a multiple of the period).
            row_stream: the rounding stream of the sync's row writes (16-bit tables).
        """
        current = lookahead.window(step, self.period)
        window = self.window.value

        def update(variables, uniq):
            view = storage.over(variables)
            # Entries past `count` (the list's older contents) are not rows of
            # this window unless listed again in it: left alone. A row synced
            # twice is not changed the second time (its offset is 0 by then).
            # (Every entry is a row: `record` lists valid ids only.)
            keep = ops.equal(backend.gather(window, uniq), current)
            rows, state = view.read(uniq)
            moved = state[offset]
            new_rows = lookahead.synced(rows, moved, self.step_size)
            # The offsets' zeros computed from the offsets read: a write that
            # did not depend on that read could be ordered before it, and XLA
            # copies the whole slot to allow that. (Offsets are finite: a step
            # with non-finite gradients changes nothing.)
            zeros = moved * 0.0
            view.write(uniq, new_rows, {}, step, keep=keep, row_stream=row_stream)
            view.write(uniq, None, {offset: zeros}, step, keep=keep, rounded=False)

        backend.for_listed_rows(update, storage.variables(), self.rows.value, self.count.value)
        self.count.assign(ops.zeros((), "int32"))
