"""An int8 table on disk: its codes and each row's scale, two columns of its files.

The format is Keras' int8 `Embedding`'s, as for an int8 table in memory
(`sparseopt.storage.quantization`): a row is int8 codes and a float32 scale,
and reads back as `codes / scale`. A row never written reads as the
initializer's row quantized to nearest, which is how an int8 table in
memory starts. The step quantizes the rows it writes on the device, with
stochastic rounding where the storage asks for it (`storage.int8.quantized`,
the in-memory table's own function), and the files keep what it wrote.

The host twin of `quantization.quantize` (to nearest) below does the same
float32 operations in the same order, so it gives the same bits
(tests/test_disk_int8.py checks it against the Keras one). Rows are read
back (`codes / scale`) by Keras' own `quantization.dequantize`, in the step
and for an export alike.
"""

import numpy as np

from sparseopt.disk.row_files import Column
from sparseopt.storage import quantization

SCALE = "scale"  # the column of each row's scale


def quantize_nearest(rows):
    """NumPy `(codes, scale)` of float32 `rows` `[M, D]`, rounded to nearest (half to even).

    Args:
        rows: float32 `[M, D]`, finite.
    """
    rows = np.asarray(rows, np.float32)
    scale = np.float32(quantization.CODE_MAX) / (
        np.max(np.abs(rows), axis=-1) + np.float32(quantization.EPSILON))
    scaled = rows * scale[:, None]
    codes = np.clip(np.rint(scaled), -quantization.CODE_MAX, quantization.CODE_MAX)
    return codes.astype(np.int8), scale.astype(np.float32)


def columns(initial, width):
    """`{"rows": codes, SCALE: scale}` columns of an int8 table whose unwritten rows are
    `initial`'s (`sparseopt.disk.initial_rows.InitialRows`), quantized to nearest.

    Args:
        initial: float32 rows of int64 ids `[M]`, `[M, width]`.
        width: the row width.
    """
    return {"rows": Column((width,), "int8", lambda ids: quantize_nearest(initial(ids))[0]),
            SCALE: Column((), "float32", lambda ids: quantize_nearest(initial(ids))[1])}
