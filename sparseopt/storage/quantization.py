"""Row-wise int8 values: the arithmetic of 8-bit tables (`SparseEmbedding(dtype="int8")`).

Each row is stored as int8 codes and one float32 scale, in the format of
Keras' own int8 `Embedding` (`Embedding.quantize("int8")`): the scale is
`127 / (max |row| + 1e-7)`, a row reads back as `codes / scale`, and codes
stay in `[-127, 127]`. So a trained table's weights load into a quantized
`keras.layers.Embedding` for serving unchanged.

Writes round `row * scale` to an integer stochastically (up with probability
its fractional part), so that the expected value read back is the float32
row: updates much smaller than a code's step (`max |row| / 127`) still
move the row on average, as stochastic rounding does for 16-bit tables
(`sparseopt.precision`). Initial values (and `stochastic_rounding=False`)
round to nearest, as Keras does.

Small pure functions of `keras.ops`; no variables here.
"""

from keras import ops

from sparseopt.storage import precision

CODE_MAX = 127
# Keras' `abs_max_quantize` epsilon (`keras.config.epsilon()` by default):
# the same scale for the same row.
EPSILON = 1e-7


def row_scale(rows):
    """float32 `[U]`: each row's scale, `127 / (max |row| + 1e-7)`.

    Args:
        rows: float32 `[U, D]`.
    """
    return CODE_MAX / (ops.max(ops.abs(rows), axis=-1) + EPSILON)


def quantize(rows, bits=None):
    """`(codes, scale)` of float32 `rows` `[U, D]`: int8 `[U, D]` and float32 `[U]`.

    Args:
        rows: float32 `[U, D]`, finite.
        bits: uint32 `[U, D]` random bits (`sparseopt.precision.random_bits`)
            for stochastic rounding; None rounds to nearest (half to even).
    """
    rows = ops.cast(rows, "float32")
    scale = row_scale(rows)
    scaled = rows * ops.expand_dims(scale, -1)
    if bits is None:
        rounded = ops.round(scaled)
    else:
        # floor(x + u), u uniform in [0, 1): x rounded up with probability
        # equal to its fractional part, so E[code] = x.
        rounded = ops.floor(scaled + precision.uniform(bits))
    codes = ops.clip(rounded, -CODE_MAX, CODE_MAX)
    return ops.cast(codes, "int8"), scale


def dequantize(codes, scale):
    """float32 rows `codes / scale` (codes `[..., D]`, scale `[...]`), as Keras reads them."""
    return ops.cast(codes, "float32") / ops.expand_dims(ops.cast(scale, "float32"), -1)


def where_changed(values, read, old, new):
    """`(codes, scale)`: `new` for the rows whose float32 `values` differ from what the table
    reads for them now (`read`), `old` for the others: a row written again unchanged keeps
    its codes and scale bit for bit (requantized, they could change).

    Args:
        values: float32 `[M, D]`, the rows' new values.
        read: float32 `[M, D]`, what the table reads for them now (`dequantize(*old)`).
        old: `(codes, scale)` the rows have.
        new: `(codes, scale)` of `values`.
    """
    changed = ops.any(ops.not_equal(values, read), axis=-1)
    return (ops.where(ops.expand_dims(changed, -1), new[0], old[0]),
            ops.where(changed, new[1], old[1]))
