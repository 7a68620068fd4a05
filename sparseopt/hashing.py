"""murmur3's 32-bit finalizer: the one hash behind rounding bits, id placement and dedup.

Backend-free (`keras.ops` on uint32 tensors), so that backend modules can use
it too without importing the rest of the library.
"""

import numpy as np
from keras import ops

M1, M2 = 0x85EBCA6B, 0xC2B2AE35  # murmur3's finalizer constants


def mix32(x):
    """murmur3's 32-bit finalizer on a uint32 tensor."""
    x = ops.bitwise_xor(x, ops.right_shift(x, 16)) * np.uint32(M1)
    x = ops.bitwise_xor(x, ops.right_shift(x, 13)) * np.uint32(M2)
    return ops.bitwise_xor(x, ops.right_shift(x, 16))
