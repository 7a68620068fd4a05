"""Running totals that do not wrap: each an int32 pair, counting past 2**31.

JAX has no int64 without `jax_enable_x64`, and a plain int32 total of
lookups wraps after about two billion (131,000 steps of 16,384 ids). So a
total is `high * 2**30 + low`, `low` kept below `2**30` by carrying into
`high`: exact to `2**61`, as long as one step adds less than `2**30`.
"""

import numpy as np
from keras import ops

_BITS = 30
_LOW = np.int32((1 << _BITS) - 1)


def add(totals, amounts):
    """Adds `amounts` (`{index: int32 scalar, at least 0}`) to `totals` (an int32 `[K, 2]`
    variable), in one update (a step's totals together: one write, not one each)."""
    position = ops.arange(totals.shape[0], dtype="int32")
    step = sum(ops.where(ops.equal(position, i), ops.cast(a, "int32"), 0)
               for i, a in amounts.items())
    low = totals.value[:, 1] + step
    high = totals.value[:, 0] + ops.right_shift(low, _BITS)
    totals.assign(ops.stack([high, ops.bitwise_and(low, _LOW)], axis=1))


def read(totals):
    """The totals as Python ints (NumPy)."""
    pairs = np.asarray(ops.convert_to_numpy(totals.value)).astype(np.int64)
    return [int(h) * (1 << _BITS) + int(lo) for h, lo in pairs]
