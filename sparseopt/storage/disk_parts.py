"""Whole-table work on a table on disk, part by part: `RowsPart`.

What works on every row at once between steps (the end of `fit`'s catch-up
of `lazy=False` rows, the moving and weight averages of `ema_momentum` and
`swa_*`, `DispatchOptimizer.catch_up_tables()`) is written against a
`RowStorage` whose `values()` is the whole table. A table on disk is larger
than memory, so its kind (`DiskRows.each_part`) hands that work one part of
the table at a time: a `RowsPart` is the same interface over a range of rows
(their values and per-row state read from the files, the cache written into
them first), and what the work assigns is written back to the files. The
work is row by row (each row's result depends on its own values and state),
so running it part by part gives what it gives on the whole table; the
values are rounded as the in-memory kinds round them (16-bit by the same
bits, keyed by row and column; int8 by the same quantization).
"""

import numpy as np
from keras import ops

from sparseopt.disk.int8_columns import SCALE
from sparseopt.disk.table import ROWS
from sparseopt.storage import quantization
from sparseopt.storage.int8 import quantized
from sparseopt.storage.rows import as_computed


class _Shape:
    """What whole-table work reads of a per-row slot besides its values: its shape."""

    def __init__(self, shape):
        self.shape = shape


class RowsPart:
    """Rows `ids` of a table on disk, as whole-table work reads and assigns a table.

    Args:
        storage: the table's `sparseopt.storage.disk_rows.DiskRows`.
        ids: int64 `[n]`, the part's rows (consecutive).
        stored: `{column: values [n, *tail]}` of those rows as stored.
    """

    def __init__(self, storage, ids, stored):
        self.storage, self.table = storage, storage.table
        self.ids = ops.convert_to_tensor(ids.astype(np.int32))
        self.stored = dict(stored)
        self.changed = set()
        self.slots = {}
        for spec in storage.specs:
            if spec.per_row:
                self.slots[spec.name] = _Shape((ids.size,) + self.table.columns[spec.name].tail)
            else:
                self.slots[spec.name] = storage.slots[spec.name]

    def values(self):
        """float32 `[n, D]`: the part's rows (an int8 table's `codes / scale`)."""
        if self.table.int8:
            return quantization.dequantize(self.stored[ROWS], self.stored[SCALE])
        return ops.cast(self.stored[ROWS], "float32")

    def state_values(self, name):
        """Slot `name` of the part's rows (a whole slot: all of it), as rules compute."""
        if name not in self.stored:
            return self.storage.state_values(name)
        return as_computed(ops.convert_to_tensor(self.stored[name]))

    def assign_values(self, values, step):
        """Writes the part's rows, rounded as a step's writes are (an int8 table's quantized
        as its step quantizes them)."""
        if self.table.int8:
            # (Rows unchanged keep their codes and scale, as an int8 table in memory's.)
            codes, scale = quantization.where_changed(
                values, self.values(), (self.stored[ROWS], self.stored[SCALE]),
                quantized(values, self.ids, step, self.storage.rounding))
            self._keep(ROWS, codes)
            self._keep(SCALE, scale)
            return
        self._keep(ROWS, self.storage.stored(values, ROWS, self.ids, step, 0, True))

    def assign_state(self, name, values, step, rounded=True):
        """Writes slot `name` of the part's rows: rounded as a step's writes are, or
        (`rounded` False) as given, cast to its dtype."""
        if name not in self.stored:
            raise ValueError(f"Table '{self.table.path}' (storage=OnDisk): whole-table work "
                             f"assigned its whole slot '{name}' part by part.")
        self._keep(name, self.storage.stored(values, name, self.ids, step,
                                              self.storage.streams[name], rounded))

    def _keep(self, name, values):
        dtype = self.table.columns[name].dtype
        self.stored[name] = np.asarray(ops.convert_to_numpy(values)).astype(dtype, copy=False)
        self.changed.add(name)

    def written(self):
        """`{column: values}` of every column, or None where the work assigned nothing."""
        return self.stored if self.changed else None
