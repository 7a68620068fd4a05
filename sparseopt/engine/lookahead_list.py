"""Lookahead's window for a table whose rows are not arrays of the step: a bounded list.

The same window as `lookahead_window.LookaheadWindow` (the rows changed
since the last sync, synced when the window ends: `slow + alpha (fast -
slow)` into both, the offset slot emptied), for a kind of row storage that
keeps no entry per table row in memory (`RowStorage.lookahead_per_row`
False: a table on disk, whose rows may outnumber memory). In place of one
int32 per row (which window listed it) and a list of `V` entries, the list
holds every row changed by each step of the window, repeats included: a
window of `period` steps changes at most `period` times a step's ids, so
`capacity` entries always suffice, and memory follows the steps' ids, not
the table. The sync sorts the list once (its repeats and its unused
entries left out) and reads and writes those rows through the storage
(a table on disk: its host calls, the cache's counts untouched).

A row's sync does not depend on which entry lists it or in what order rows
are synced, so the rows end as `LookaheadWindow` leaves them, bit for bit.
The list is optimizer state (saved with the table's other state): a run
resumed mid-window syncs what the window changed before the save.
"""

from keras import ops

from sparseopt import backend
from sparseopt.updaters.wrappers import lookahead


class LookaheadList:
    """The rows of one table changed in the current Lookahead window, as a bounded list.

    Args:
        period: the steps between syncs.
        step_size: alpha, how far the slow copy moves towards the fast one.
    """

    def __init__(self, period, step_size):
        self.period, self.step_size = period, step_size
        self.rows = self.count = None
        self.table = None

    def build(self, optimizer, table, prefix, ids_per_step):
        """Creates the list with `optimizer.add_variable`, named after the table.

        Args:
            optimizer: the `DispatchOptimizer`.
            table: the table (its path and shape).
            prefix: the names' prefix (the table's).
            ids_per_step: the ids one step looks up in the table (a step changes at
                most that many rows).
        """
        self.table = table
        self.capacity = max(1, int(self.period * ids_per_step))
        self.rows = optimizer.add_variable(
            shape=(self.capacity,), dtype="int32", initializer="zeros",
            name=f"{prefix}_lookahead_list")
        self.count = optimizer.add_variable(
            shape=(), dtype="int32", initializer="zeros", name=f"{prefix}_lookahead_count")

    @property
    def variables(self):
        """What a checkpoint holds of the window."""
        return [self.rows, self.count]

    def record(self, distinct, applied, step, num_rows):
        """Lists the rows a step changed (if `applied`).

        Args:
            distinct: the step's `Distinct` rows over the whole table.
            applied: boolean scalar, whether the step changed them.
            step: int scalar, the 1-based update count (unused: the list is emptied
                by the sync, not by window).
            num_rows: the table's rows.
        """
        ids = ops.cast(distinct.ids, "int32")
        size = ids.shape[0]
        message = (
            f"Table '{self.table.path}': its Lookahead list holds {self.capacity} rows "
            f"(lookahead_period {self.period} times the {self.capacity // self.period} ids "
            "a step looked up when the optimizer was built), which this window's steps "
            "outgrow. Build the optimizer on batches of the size you train on.")
        if size is not None and self.period * size > self.capacity:  # (JAX: static shapes)
            raise ValueError(message)
        position = ops.arange(ops.shape(ids)[0], dtype="int32")
        valid = ops.logical_and(ops.less(position, distinct.count),
                                ops.logical_and(ops.greater_equal(ids, 0),
                                                ops.less(ids, num_rows)))
        new = ops.logical_and(valid, applied)
        added = ops.cast(new, "int32")
        # (A window's steps add at most `period` times a step's ids: room, checked above
        # where shapes are static, and here, when the step runs, where they are not.)
        total = self.capacity - backend.at_least_zero(
            self.capacity - (self.count.value + ops.sum(added)), message)
        at = self.count.value + ops.cumsum(added) - 1
        backend.scatter_where(self.rows, at, ids, new)
        self.count.assign(total)

    def sync(self, storage, offset, step, row_stream):
        """Syncs the listed rows (`slow + alpha (fast - slow)` into both) and empties the list.

        Args:
            storage: the table's `RowStorage` (`read_any`, `write`).
            offset: the name of its `lookahead_offset` slot.
            step: int scalar, the 1-based update count (a multiple of the period).
            row_stream: the rounding stream of the sync's row writes (16-bit tables).
        """
        num_rows = self.table.shape[0]
        listed = ops.where(ops.less(ops.arange(self.capacity, dtype="int32"), self.count.value),
                           self.rows.value, num_rows)
        ids = ops.sort(listed)  # (entries past the count sort last, past the table)
        first = ops.concatenate([ops.ones((1,), "bool"), ops.not_equal(ids[1:], ids[:-1])])
        keep = ops.logical_and(first, ops.less(ids, num_rows))
        rows, state = storage.read_any(ids, (offset,))
        moved = state[offset]
        new_rows = lookahead.synced(rows, moved, self.step_size)
        zeros = moved * 0.0  # (from the offsets read: see `LookaheadWindow.sync`)
        storage.write(ids, new_rows, {}, step, keep=keep, row_stream=row_stream)
        storage.write(ids, None, {offset: zeros}, step, keep=keep, rounded=False)
        self.count.assign(ops.zeros((), "int32"))
