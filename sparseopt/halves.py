"""Int32 values kept in float32 arrays, exactly: as two 16-bit halves.

Where a step may write only float arrays a user never differentiates (JAX's
stateless optimizer step writes trainable and optimizer variables only), an
int8 table's write buffer and an open vocabulary's hand-over hold their ids
and steps this way: float32 holds every 16-bit integer exactly.
"""

import numpy as np
from keras import ops


def split_halves(x):
    """int32 `x` as two float32 arrays, its upper and lower 16 bits (exact in float32)."""
    x = ops.cast(x, "int32")
    return [ops.cast(ops.bitwise_and(ops.right_shift(x, 16), 0xFFFF), "float32"),
            ops.cast(ops.bitwise_and(x, 0xFFFF), "float32")]


def join_halves(upper, lower):
    """The int32 values whose halves `split_halves` gave."""
    u32 = "uint32"
    joined = ops.bitwise_or(ops.left_shift(ops.cast(upper, u32), np.uint32(16)),
                            ops.cast(lower, u32))
    return ops.cast(joined, "int32")


def encode_step(step):
    """float32 `[2]`: an int32 scalar step as two 16-bit halves (`decode_step`)."""
    return ops.stack(split_halves(step))


def decode_step(values):
    """The int32 scalar step of an `encode_step`d array."""
    return join_halves(values[0], values[1])
