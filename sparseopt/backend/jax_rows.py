"""JAX rows of arrays: gather and in-place scatter (16-bit floats as their bits), and
the out-of-range ids that pad a dedup's result."""

import jax
import jax.numpy as jnp
import numpy as np


def padding_ids(num_rows, n):
    """Out-of-range ids for the `n` non-row entries of `dedup`'s result.

    Distinct (`num_rows + i`), so that the scatter can promise unique
    indices, when they fit in int32. They must: a wrapped-around negative id
    would be taken by `.at[]` as counting from the end, i.e. a real row. Near
    2**31 rows every entry gets the single id `num_rows` instead, and the
    scatter makes no uniqueness promise.
    """
    if distinct_padding(num_rows, n):
        return num_rows + jnp.arange(n, dtype=jnp.int32)
    return jnp.full((n,), num_rows, jnp.int32)


def distinct_padding(num_rows, n):
    return num_rows + n <= np.iinfo(np.int32).max


def gather(value, ids):
    """`value[ids]`, ids clamped (the pure path of `backend.gather`)."""
    return gather_rows(value, ids, mode="clip")


def gather_rows(value, ids, mode=None):
    """`value[ids]` (rows); 16-bit floats gathered as their bits (see `_as_bits`)."""
    return _as_stored(jnp.take(_as_bits(value), ids, axis=0, mode=mode), value.dtype)


def bitcast(values, dtype):
    return jax.lax.bitcast_convert_type(values, dtype)


def set_rows(value, ids, rows, unique=False):
    """`value` with `value[ids] = rows` (ids past the end dropped): the pure path."""
    new = _as_bits(value).at[ids].set(_as_bits(rows.astype(value.dtype)), mode="drop",
                                      unique_indices=unique)
    return _as_stored(new, value.dtype)


def min_rows(value, ids, values):
    """`value` with `value[ids] = min(value[ids], values)` (ids past the end dropped)."""
    return value.at[ids].min(values.astype(value.dtype), mode="drop")


# XLA:CPU has no bfloat16 scatter: it converts the whole table to float32 and
# back around it, every step (2M x 8 rows: 22 ms and 64 MB, against 0.03 ms
# in float32; float16 is native). Scattering the bits as uint16 halves that,
# but the bitcast of the whole table is still a copy (5 ms, 32 MB): on CPU a
# bfloat16 table costs one copy of itself per step (docs/semantics.md). GPUs
# scatter bfloat16 natively, in place.
def bits_on_this_platform(dtype):
    return dtype == jnp.bfloat16 and jax.default_backend() == "cpu"


def _as_bits(value):
    if bits_on_this_platform(value.dtype):
        return jax.lax.bitcast_convert_type(value, jnp.uint16)
    return value


def _as_stored(bits, dtype):
    return jax.lax.bitcast_convert_type(bits, dtype) if bits_on_this_platform(dtype) else bits


class Held:
    """A value used as a variable (`value`, `shape`, `dtype`, `assign`): one device's
    block inside `shard_map`, or a chunk loop's carry."""

    def __init__(self, value):
        self.value = value

    @property
    def shape(self):
        return self.value.shape

    @property
    def dtype(self):
        return self.value.dtype

    def assign(self, value):
        self.value = value
