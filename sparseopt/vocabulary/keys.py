"""Raw ids as keys: any 64-bit value, carried as two int32 halves, and its hash.

JAX without `jax_enable_x64` has no int64 arrays (Keras would truncate them
to int32 silently), so a key travels as `(high, low)` int32 halves on both
backends. Inputs:

- int32 ids: each value is its own key (negative values too); its high half
  is its sign (`-1` or `0`), so the int32 id `k` and the int64 id `k` are
  one key;
- int64 ids (TensorFlow): split in the graph;
- int32 pairs `[..., 2]` (`(high, low)` in the last axis, `key_halves=True`
  on the layer), made from int64 NumPy ids with `split_int64`: the way to
  feed 64-bit ids on JAX.
"""

import numpy as np
from keras import ops

from sparseopt.hashing import mix32

_GOLDEN = np.uint32(0x9E3779B9)


def split_int64(ids):
    """int64 NumPy ids as int32 `[..., 2]` `(high, low)` halves (the layer's
    `key_halves=True` input)."""
    ids = np.asarray(ids, dtype=np.int64)
    high = (ids >> 32).astype(np.int32)
    low = (ids & 0xFFFFFFFF).astype(np.uint32).view(np.int32)
    return np.stack([high, low], axis=-1)


def join_int64(halves):
    """The int64 NumPy ids of int32 `(high, low)` halves `[..., 2]` (inverse of `split_int64`)."""
    halves = np.asarray(halves)
    high = halves[..., 0].astype(np.int64)
    low = halves[..., 1].astype(np.int32).view(np.uint32).astype(np.int64)
    return (high << 32) | low


def halves(ids, paired):
    """`(high, low)` int32 tensors of the keys `ids`, flattened.

    Args:
        ids: int32 or int64 ids of any shape, or int32 `[..., 2]` halves.
        paired: whether `ids` are halves (the last axis).
    """
    if paired:
        flat = ops.reshape(ops.cast(ids, "int32"), (-1, 2))
        return flat[:, 0], flat[:, 1]
    flat = ops.reshape(ids, (-1,))
    if "64" in str(flat.dtype):
        return ops.cast(ops.right_shift(flat, 32), "int32"), ops.cast(flat, "int32")
    flat = ops.cast(flat, "int32")
    return ops.right_shift(flat, 31), flat


def key_shape(ids, paired):
    """The shape of the keys `ids` (without the halves axis; dynamic where unknown)."""
    shape = tuple(ops.shape(ids))
    return shape[:-1] if paired else shape


def hashed(high, low, seed):
    """A uint32 hash of each key: murmur3's finalizer over both halves and `seed`."""
    u32 = "uint32"
    start = mix32(ops.cast(high, u32) + np.uint32((int(seed) * 0x9E3779B1) & 0xFFFFFFFF))
    return mix32(ops.bitwise_xor(start * _GOLDEN, ops.cast(low, u32)))


def home_rows(high, low, seed, capacity):
    """Each key's first candidate row: its hash modulo `capacity` (int32)."""
    return ops.cast(hashed(high, low, seed) % np.uint32(capacity), "int32")
