"""A table on disk in an exported model (`model.export`): its rows as one variable.

A SavedModel serves without sparseopt, its host calls or the table's folder,
so an export holds the table's rows themselves: every row as it is when the
export runs, read through the cache (rows trained so far, and rows never
written as the initializer draws them: what the table itself would read).
The variable exists for the export only (`SparseEmbedding.variables` adds it
while Keras' export reads the layer's variables, and the lookup reads it
while Keras traces the model for the export); training never sees it.
"""

import os

import keras
import numpy as np

from sparseopt import backend


def available_memory():
    """Bytes of memory this machine has free now (Linux: `SC_AVPHYS_PAGES`), or None."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def rows_for_export(table, owner):
    """A non-trainable Keras variable holding every row of `table`, as stored now.

    Args:
        table: the layer's `sparseopt.disk.table.DiskTable`.
        owner: the layer's name, for errors.

    Raises:
        ValueError: the rows would take more than half of the memory free
            now (they are held twice while the variable is made).
    """
    rows, width = table.shape
    need = rows * width * np.dtype(table.dtype).itemsize
    free = available_memory()
    if free is not None and need > free // 2:
        raise ValueError(
            f"SparseEmbedding '{owner}': `model.export` writes every row of its table on disk "
            f"('{table.path}') into the exported model, as one variable: {need / 1e9:.2f} GB "
            f"for {rows:,} rows, more than half of the memory free now ({free / 1e9:.2f} GB). "
            "Serving a table larger than memory from its files is not supported yet: export "
            "on a machine with that much memory free.")
    with backend.outside_trace():
        values = table.numpy()
    return keras.Variable(values, dtype=table.dtype, trainable=False,
                          name=f"{table.path.replace('/', '_')}_for_serving")
