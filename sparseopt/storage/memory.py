"""Rows in memory: the table and its state are variables, float32 or 16-bit.

Reads gather the rows (and their per-row state) into float32; writes round
16-bit values as the table's settings say (`precision.Rounding`: stochastic
rounding keyed by seed, table, variable, step, row and column, or to
nearest) and scatter them in place.
"""

from keras import ops

from sparseopt import backend
from sparseopt.storage.rows import RowStorage, as_computed


class InMemory(RowStorage):
    """The table and every slot as variables in memory (float32, bfloat16 or float16)."""

    _PLAIN = True

    def read(self, ids, context=None):
        return self._read_rows(ids, context), {
            n: as_computed(backend.gather(self.slots[n].value, ids)) for n in self.per_row}

    def write(self, ids, rows, state, step, count=None, keep=None, row_stream=0,
              rounded=True):
        # Every entry is written where `keep` is None: a dedup's padding ids are
        # past the table (the scatter drops them), and a skipped step hands back
        # the rows as read (branch-free: only touched rows), so `count` changes
        # nothing here.
        put = _writer(keep)
        if rows is not None:
            self._write_rows(put, ids, rows, step, count, row_stream, rounded)
        for name, value in state.items():
            var = self.slots[name]
            put(var, ids, self._stored(value, var, ids, step, self.streams[name], rounded))

    def values(self):
        return ops.cast(self.table.value, "float32")

    def assign_values(self, values, step):
        ids = ops.arange(self.table.shape[0], dtype="int32")
        self.table.assign(self._stored(values, self.table, ids, step, 0, True))

    # -- the rows' part (what another kind of rows changes) ------------------

    def _read_rows(self, ids, context):
        return ops.cast(backend.gather(self.table.value, ids), "float32")

    def _write_rows(self, put, ids, rows, step, count, stream, rounded):
        put(self.table, ids, self._stored(rows, self.table, ids, step, stream, rounded))

    def _stored(self, values, var, ids, step, stream, rounded):
        """`values` as `var` keeps them: rounded as a step's writes (16-bit), or cast."""
        if rounded:
            values = self.rounding.stored(values, var.dtype, step, ids, stream)
        return ops.cast(values, var.dtype)


def _writer(keep):
    """A scatter of all entries, or (where `keep` is given) of those it keeps."""
    if keep is None:
        return backend.scatter

    def put(variable, ids, values):
        backend.scatter_where(variable, ids, values, keep)
    return put
