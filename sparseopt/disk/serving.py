"""A table on disk in an exported model (`model.export`): its rows as one variable.

A SavedModel serves without sparseopt, its host calls or the table's folder,
so an export holds the table's rows themselves: every row as it is when the
export runs, read through the cache (rows trained so far, and rows never
written as the initializer draws them: what the table itself would read).

The variable is made for one export and lives as long as Keras' export
archive: `SparseEmbedding.variables` adds it while the archive reads the
layer's variables, the lookup reads it while the archive traces the model,
and it is dropped when the archive is. Training never sees it.
"""

import weakref

import keras
import numpy as np

from sparseopt import backend


def available_memory():
    """Bytes of memory this machine can give now without swapping (Linux's
    `MemAvailable`, which counts the page cache a table's files fill), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# The rows are held up to three times while an export runs: as read, as the
# variable, and (JAX) as TensorFlow's copy of it in the archive.
COPIES = 3


class ExportedRows:
    """The variable of a table's rows made for the export under way (one per lookup).

    Args:
        table: the layer's `sparseopt.disk.table.DiskTable`.
        owner: the layer's name, for errors.
    """

    def __init__(self, table, owner):
        self.table, self.owner = table, owner
        self.variable = None
        self._archive = None  # a weak reference to the archive it was made for

    def made_for(self, archive):
        """The variable for `archive`, made now if this export has none yet.

        Raises:
            ValueError: the rows would take more than a third of the memory
                available (`COPIES`).
        """
        if self._archive is None or self._archive() is not archive:
            self.clear()
            self.variable = rows_variable(self.table, self.owner)
            self._archive = weakref.ref(archive)
            weakref.finalize(archive, self.clear)
        return self.variable

    def read_by(self, archive):
        """The variable made for `archive`, for the lookup to read while it traces.

        Raises:
            ValueError: none was made: the archive traced the model without
                reading the layer's variables first.
        """
        if self._archive is None or self._archive() is not archive:
            raise ValueError(
                f"SparseEmbedding '{self.owner}': an export traced its table on disk "
                f"('{self.table.path}') before reading the layer's variables, so it holds no "
                "rows of it. With `keras.export.ExportArchive`, call `track(model)` (or "
                "`track(layer)`) before `add_endpoint`; `model.export` does.")
        return self.variable

    def clear(self):
        self.variable, self._archive = None, None


def rows_variable(table, owner):
    """A Keras variable holding every row of `table`, as stored now.

    Trainable, so that Keras' JAX export does not write it back after each
    call it serves (it does so for non-trainable state); nothing trains it.
    """
    rows, width = table.shape
    need = rows * width * (4 if table.int8 else np.dtype(table.dtype).itemsize)
    free = available_memory()
    if free is not None and COPIES * need > free:
        raise ValueError(
            f"SparseEmbedding '{owner}': `model.export` writes every row of its table on disk "
            f"('{table.path}') into the exported model, as one variable: {need / 1e9:.2f} GB "
            f"for {rows:,} rows, held up to {COPIES} times while the export runs, more than "
            f"the memory available now ({free / 1e9:.2f} GB). Serving a table larger than "
            "memory from its files is not supported yet: export on a machine with that much "
            "memory available.")
    with backend.outside_trace():
        values = table.rows_read()  # (an int8 table's as its layer reads them: float32)
    dtype = "float32" if table.int8 else table.dtype
    return keras.Variable(values, dtype=dtype, trainable=True,
                          name=f"{table.path.replace('/', '_')}_for_serving")
