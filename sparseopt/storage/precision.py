"""How updated values are stored: 16-bit tables and state, stochastic rounding.

Rules compute in float32 on the gathered rows; what is written back is
converted to the variable's dtype here. A 16-bit value (bfloat16, float16)
rounded to nearest loses every update smaller than half its spacing (about
0.2% of the value in bfloat16), so rows whose updates are small next to their
values stop learning. Stochastic rounding writes the neighbour above or below
with the probabilities that make the written value's expectation the float32
value: small updates survive on average.

The random bits are a hash of `(seed, stream, step, row, column)` (murmur3's
32-bit finalizer, chained), not a random generator's state: the same seed
gives the same result on either backend, under any sharding or table
grouping (rows are keyed by their global id), and a run resumed from a
checkpoint rounds exactly as the uninterrupted one did. docs/semantics.md
gives the formulas.

Values beyond the 16-bit type's largest finite value are written as that
value (saturated), never as inf.
"""

import dataclasses

import keras
import numpy as np
from keras import ops

from sparseopt import backend
from sparseopt.storage.dtypes import HALF_DTYPES, LARGEST
from sparseopt.hashing import M1, M2, mix32


_GOLDEN = 0x9E3779B9


@dataclasses.dataclass(frozen=True)
class Rounding:
    """How one table's trainer writes 16-bit values.

    Args:
        stochastic: stochastic rounding (True) or round to nearest.
        seed: int, the updater's `rounding_seed`.
        table_index: the table's position among the optimizer's tables,
            so that tables sharing a seed draw different bits.
        row_offset: added to the ids written, to key bits by global row
            (a shard's first row; 0 otherwise).
    """

    stochastic: bool = True
    seed: int = 0
    table_index: int = 0
    row_offset: object = 0

    def at_offset(self, row_offset):
        """The same rounding for a shard whose local row 0 is `row_offset`."""
        return dataclasses.replace(self, row_offset=row_offset)

    def stored(self, values, dtype, step, ids, variable_index=0):
        """`values` (float32 `[U, D]` or `[U]` rows `ids`) converted to `dtype` for writing.

        Args:
            values: the new float32 rows.
            dtype: the variable's dtype.
            step: scalar int tensor, the 1-based update count.
            ids: int `[U]` local row ids of `values`.
            variable_index: 0 for the table, `1 + i` for its `i`-th state slot.
        """
        dtype = _name(dtype)
        if dtype not in HALF_DTYPES:
            return values
        limit = LARGEST[dtype]
        values = ops.clip(ops.cast(values, "float32"), -limit, limit)
        if not self.stochastic:
            return ops.cast(values, dtype)
        ids = ops.cast(ids, "int32") + ops.cast(self.row_offset, "int32")
        width = 1 if len(values.shape) == 1 else values.shape[1]
        bits = random_bits(stream_key(self.seed, self.table_index, variable_index), step,
                           ids, width)
        if len(values.shape) == 1:
            bits = ops.reshape(bits, (-1,))
        return ops.cast(stochastic_round(values, dtype, bits), dtype)


def stream_key(seed, table_index, variable_index):
    """The uint32 key of one variable's bits: a Python int."""
    base = _mix_int((int(seed) + _GOLDEN) & 0xFFFFFFFF)
    return _mix_int(base ^ ((table_index << 8 | variable_index) & 0xFFFFFFFF))


def random_bits(key, step, ids, width):
    """uint32 `[U, width]` random bits for rows `ids` at `step` (docs/semantics.md's hash).

    Args:
        key: `stream_key(...)`.
        step: scalar int tensor.
        ids: int32 `[U]` global row ids.
        width: the number of columns.
    """
    u32 = "uint32"
    at_step = mix32(ops.bitwise_xor(np.uint32(key), ops.cast(step, u32)))
    per_row = mix32(ops.bitwise_xor(at_step, ops.cast(ids, u32)))
    column = ops.cast(ops.arange(width, dtype="int32"), u32) * np.uint32(_GOLDEN)
    return mix32(ops.expand_dims(per_row, 1) + ops.expand_dims(column, 0))


def uniform(bits):
    """float32 in [0, 1) from uint32 random bits (their top 24: exact in float32)."""
    return ops.cast(ops.right_shift(bits, 8), "float32") * 2.0**-24


def stochastic_round(values, dtype, bits):
    """float32 `values` rounded to the neighbouring `dtype` values, unbiased.

    bfloat16 keeps float32's top 16 bits: adding 16 random bits to the
    discarded ones and truncating rounds the magnitude up with probability
    (discarded part) / (spacing). float16 does the same with 13 bits for its
    normal range; below it (subnormals, spacing 2^-24) in fixed point.

    Args:
        values: float32, within `dtype`'s finite range.
        dtype: `"bfloat16"` or `"float16"`.
        bits: uint32 random bits, one per value.

    Returns:
        float32 values, each exactly representable in `dtype`.
    """
    raw = backend.bitcast(values, "uint32")
    if dtype == "bfloat16":
        return backend.bitcast(ops.bitwise_and(raw + ops.right_shift(bits, 16),
                                               np.uint32(0xFFFF0000)), "float32")
    magnitude = ops.abs(values)
    normal = backend.bitcast(
        ops.bitwise_and(backend.bitcast(magnitude, "uint32") + ops.right_shift(bits, 19),
                        np.uint32(0xFFFFE000)), "float32")
    fixed = magnitude * 2.0**24
    low = ops.floor(fixed)
    draw = uniform(bits)
    subnormal = (low + ops.cast(draw < fixed - low, "float32")) * 2.0**-24
    rounded = ops.where(magnitude >= 2.0**-14, normal, subnormal)
    return ops.where(values < 0, -rounded, rounded)


def _mix_int(x):
    x = ((x ^ (x >> 16)) * M1) & 0xFFFFFFFF
    x = ((x ^ (x >> 13)) * M2) & 0xFFFFFFFF
    return x ^ (x >> 16)


def _name(dtype):
    return keras.backend.standardize_dtype(dtype)
