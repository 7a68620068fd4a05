"""Rows on disk: a step reads and writes its distinct rows through the table's cache.

The kind of a table given `storage=OnDisk(...)`: its rows and every
per-row slot are columns of its files (`sparseopt.disk.table.DiskTable`,
which its layer holds instead of a variable); whole slots (a column's or
the table's) are optimizer variables as for any table. A step starts from
the rows its lookups read and their per-row state, which a training call's
lookup reads with them (both already in the compiled step: `RowGrads.read`,
`RowGrads.state`; a step whose lookups did not read the state reads it from
the cache), the rule runs in the compiled step as for rows in memory, and
the new values (16-bit ones rounded by the same bits, an int8 table's
quantized as the int8 kind quantizes them) are written back to the cache:
the same values as the in-memory kinds', bit for bit.

Rows an open vocabulary gives to new ids start afresh through the same
write (`start`): their first values and every per-row slot's start, in the
same host write as a step's. Whole-table work between steps (the end of
`fit`'s catch-up and averages) runs part by part (`each_part`,
`disk_parts.py`); Lookahead's sync reads the rows its window changed
(`read_any`, `sparseopt.engine.lookahead_list`). What is refused for now,
naming the table (`check`): Lookahead on an int8 table (as in memory), a
whole slot started from the table.
"""

from keras import ops

from sparseopt import backend
from sparseopt.disk.int8_columns import SCALE
from sparseopt.disk.table import ROWS, DiskTable
from sparseopt.storage import quantization
from sparseopt.storage.disk_parts import RowsPart
from sparseopt.storage.int8 import quantized
from sparseopt.storage.rows import RowStorage


class DiskRows(RowStorage):
    """A table's rows and per-row state in its files, read and written through its cache."""

    # Host calls read and write all of a step's distinct rows at once (never
    # inside a loop over chunks, which would call the host chunk by chunk).
    at_once = True
    # The step's rows are those its lookups read (`RowGrads.read`), already on
    # the device, with their per-row state where a training lookup read it too
    # (`RowGrads.state`; else it crosses from the host for the rule).
    reads_lookups = True
    # ... and reads any other rows through its host calls too (Lookahead's sync),
    # where keeping an entry per table row in memory is what it avoids.
    reads_any_row = True
    lookahead_per_row = False
    groups = False  # (a group's step carries its tables' variables)
    uses_workspace = False  # (one entry per row: memory in proportion to the table)

    @classmethod
    def check(cls, updater, table, vocabulary):
        """Raises where a table on disk cannot be trained as configured (yet).

        Args:
            updater: the table's `Updater`.
            table: the table (a `DiskTable` where its layer put it on disk).
            vocabulary: its open vocabulary, or None.
        """
        where = _named(table)
        if not isinstance(table, DiskTable):
            raise ValueError(f"{where}: only a `sparseopt.layers.SparseEmbedding` keeps its "
                             "table on disk; this table is a variable in memory.")
        if updater.lookahead is not None and table.int8:
            raise ValueError(
                f"{where} (int8): {type(updater).__name__} with lookahead_period is not "
                "supported on int8 tables, on disk as in memory. Leave it out, or store the "
                "table in bfloat16 (half the memory of float32).")
        if any(s.from_table is not None for s in updater.slots):
            raise ValueError(f"{where}: {type(updater).__name__} starts its state from every "
                             "row of the table, which a table on disk does not support yet.")
        if backend.replica_strategy() is not None:
            raise ValueError(f"{where}: a table on disk under a distribution strategy "
                             "(each replica a copy of the table) is not supported yet; train "
                             "it on one device.")

    def build(self, optimizer, prefix, initializer_of, layout_of):
        # Per-row slots are columns of the table's files (made with the table);
        # whole slots are variables.
        for spec in self.specs:
            if spec.per_row:
                self._check_column(spec)
                continue
            shape = spec.shape(self.table.shape)
            self.slots[spec.name] = optimizer.add_variable(
                shape=shape, initializer=initializer_of(spec),
                dtype=spec.dtype_for(self.settings.state_dtype), name=f"{prefix}_{spec.name}")

    def _check_column(self, spec):
        column = self.table.columns.get(spec.name)
        dtype = spec.dtype_for(self.settings.state_dtype)
        if column is None or column.dtype != dtype \
                or column.tail != spec.shape(self.table.shape)[1:]:
            raise ValueError(
                f"{_named(self.table)}: its files have no column for "
                f"the updater's slot '{spec.name}' ({dtype}); the table's layer made them for "
                "another updater. Train it with the updater its layer was given.")

    @property
    def numbering(self):
        # The host, which reads the step's rows anyway, numbers its ids in one pass
        # (where the host library is on; else the device's hash, to the same numbers).
        return self.table.number

    @property
    def per_row(self):
        return sorted(spec.name for spec in self.specs if spec.per_row)

    def variables(self):
        return []  # (nothing in the step's arrays: the rows are on the host)

    def over(self, variables, row_offset=None):
        raise ValueError(f"{_named(self.table)}: a table on disk is "
                         "not split over devices.")

    def read(self, ids, context=None):
        if context is None or context.record.read is None:
            raise ValueError(f"{_named(self.table)}: its step has no rows read by its "
                             "lookup; it can only be trained from `SparseLookup` calls.")
        if context.finds(ids):
            # (The per-row state a training lookup read with the rows; else from the
            # host, which serves it from the lookup's read of the cache.)
            state = context.state_read(ids, self.per_row)
            if state is None:
                found = self.table.read(ids, self.per_row) if self.per_row else ()
                state = dict(zip(self.per_row, found))
            return context.rows_read(ids), state
        # A chunk of the step's rows (a whole slot's sums over more than a chunk):
        # from the host, which serves them from the lookup's read.
        if self.table.int8:
            state = self.table.read(ids, self.per_row) if self.per_row else ()
            return self.table.read_rows(ids, lookup=False), dict(zip(self.per_row, state))
        values = self.table.read(ids, [ROWS, *self.per_row])
        return values[0], dict(zip(self.per_row, values[1:]))

    def read_any(self, ids, names):
        """`(rows, {slot: values})` of any rows `ids` (not only the step's lookups'), from
        the host, without counting them as lookups; ids outside the table read zeros.

        Args:
            ids: int `[M]`.
            names: the per-row slots to read.
        """
        values = self.table.read(ids, [ROWS, *names], counted=False)
        return values[0], dict(zip(names, values[1:]))

    def write(self, ids, rows, state, step, count=None, keep=None, row_stream=0,
              rounded=True):
        values = {}
        if rows is not None and self.table.int8:
            # Codes and scale, quantized as an int8 table in memory writes them: a
            # step's with its rounding, a row's fresh start (`rounded` False) to nearest.
            values[ROWS], values[SCALE] = (quantized(rows, ids, step, self.rounding) if rounded
                                           else quantization.quantize(rows))
        elif rows is not None:
            values[ROWS] = self.stored(rows, ROWS, ids, step, row_stream, rounded)
        for name, value in state.items():
            values[name] = self.stored(value, name, ids, step, self.streams[name], rounded)
        self.table.write(ids, values, count, keep)

    def stored(self, values, column, ids, step, stream, rounded):
        """`values` as column `column` keeps them (rounded as a step's 16-bit writes)."""
        dtype = self.table.columns[column].dtype
        if rounded:
            values = self.rounding.stored(values, dtype, step, ids, stream)
        return ops.cast(values, dtype)

    def slot_layout(self, name):
        column = self.table.columns.get(name)  # (per-row slots are columns of the files)
        return None if column is None else (column.dtype, column.tail)

    ends_fit = True

    def end_of_fit(self):
        self.table.flush()  # (the cache's rows into the files, the files to disk)

    def each_part(self, work, writes=True):
        """Whole-table work part by part (`disk_parts.RowsPart`, `DiskTable.each_part`): the
        table may be larger than memory. The work is row by row, so the parts give what
        the whole table would.

        Args:
            work, writes: as for `RowStorage.each_part`.
        """
        def part(ids, stored):
            rows = RowsPart(self, ids, stored)
            work(rows)
            return rows.written()

        self.table.each_part(part, writes=writes)

    def values(self):
        raise ValueError(f"{_named(self.table)}: whole-table work "
                         "(every row at once) is not supported on disk.")

    def assign_values(self, values, step):
        self.values()

    def assign_state(self, name, values, step, rounded=True):
        self.values()

    def state_values(self, name):
        if name in self.per_row:
            self.values()
        return super().state_values(name)


def _named(table):
    """How messages name a table on disk."""
    return f"Table '{table.path}' (storage=OnDisk)"
