"""The values a row starts from when it is given to a new key.

Drawn from the table's initializer, with bits hashed from `(seed, step,
row, column)` (`sparseopt.precision.random_bits`), not a generator's state:
reproducible, the same on either backend, and a resumed run draws what the
uninterrupted one did.
"""

import math

import keras
from keras import ops

from sparseopt.storage import precision

# Initializers whose per-row draw is defined here (each value independent of
# the table's shape).
SUPPORTED = (keras.initializers.RandomUniform, keras.initializers.RandomNormal,
             keras.initializers.Zeros, keras.initializers.Ones, keras.initializers.Constant)


def check(initializer, layer_name):
    """Refuses an initializer whose values new rows cannot be drawn from."""
    if not isinstance(initializer, SUPPORTED):
        raise ValueError(
            f"Layer '{layer_name}': an open-vocabulary table draws each row given to a new "
            f"id from its `embeddings_initializer`; {type(initializer).__name__} is not "
            "supported there. Use RandomUniform, RandomNormal, Zeros, Ones or Constant.")


def initial_rows(initializer, rows, width, step, seed):
    """float32 `[A, width]` first values of rows `rows` (int32 `[A]`) at `step`.

    Args:
        initializer: one of `SUPPORTED`.
        rows: the rows given to new keys.
        width: the table's width.
        step: int32 scalar, the layer's step.
        seed: int, the layer's vocabulary seed.
    """
    shape = (ops.shape(rows)[0], width)
    if isinstance(initializer, keras.initializers.Zeros):
        return ops.zeros(shape, "float32")
    if isinstance(initializer, (keras.initializers.Ones, keras.initializers.Constant)):
        value = 1.0 if isinstance(initializer, keras.initializers.Ones) else initializer.value
        return ops.full(shape, float(value), "float32")
    first = precision.random_bits(precision.stream_key(seed, 255, 0), step, rows, width)
    if isinstance(initializer, keras.initializers.RandomUniform):
        low, high = float(initializer.minval), float(initializer.maxval)
        return low + (high - low) * precision.uniform(first)
    second = precision.random_bits(precision.stream_key(seed, 255, 1), step, rows, width)
    # Box-Muller: u1 in (0, 1], so the log is finite.
    u1 = 1.0 - precision.uniform(first)
    normal = ops.sqrt(-2.0 * ops.log(u1)) * ops.cos(2.0 * math.pi * precision.uniform(second))
    return float(initializer.mean) + float(initializer.stddev) * normal
