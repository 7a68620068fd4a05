"""Initializing large tables block by block, so that memory peaks at one table.

Keras draws a random table in one piece. On JAX (XLA:CPU) the random-bit
generator's temporaries make that peak at about 4x the table (measured: 4.96
GB to draw a 1.22 GB `RandomUniform` table), which caps the largest table
a machine can hold at a quarter of its memory; on TensorFlow about 3x (the
draw's temporaries, then the copy into the variable: 3.6 GB over the process
for a 1.19 GB table). Drawn in blocks of rows and written into the table in
place, the peak is the table plus one block's temporaries: on JAX the
initializer writes the blocks into one preallocated array (`blockwise`); on
TensorFlow, which copies whatever an initializer returns, the table is
created as zeros and the blocks written into the variable (`add_table`).
"""

import keras

from sparseopt import backend

# Below this many elements the one-piece draw is cheap (64 MB of float32).
MIN_ELEMENTS = 1 << 24
BLOCK_ROWS = 1 << 18
# Initializers whose values do not depend on the shape they are asked for
# (the variance-scaling family's do, through fan-in/fan-out).
ELEMENTWISE = (keras.initializers.RandomUniform, keras.initializers.RandomNormal,
               keras.initializers.TruncatedNormal)


def add_table(add_weight, shape, initializer, **kwargs):
    """`add_weight(shape=shape, initializer=initializer, **kwargs)`, large tables by blocks.

    A large table with a `RandomUniform`, `RandomNormal` or `TruncatedNormal`
    initializer, outside a `keras.distribution`, is drawn by blocks of rows:
    on JAX by `blockwise(initializer)`; on TensorFlow (eager, outside a
    `tf.distribute` strategy) created as zeros and written block by block,
    in place. The blocks are the same draws on both paths (`for_block`).
    Anything else is `add_weight` as called.

    Args:
        add_weight: the layer's `add_weight`.
        shape: the table's shape.
        initializer: a Keras initializer instance.
        **kwargs: more arguments of `add_weight` (name, dtype, autocast...).
    """
    shape = tuple(shape)
    if not _by_blocks(initializer, shape):
        return add_weight(shape=shape, initializer=initializer, **kwargs)
    if backend.FILLS_IN_BLOCKS:
        return add_weight(shape=shape, initializer=blockwise(initializer), **kwargs)
    if not backend.fills_variables_in_blocks():
        return add_weight(shape=shape, initializer=initializer, **kwargs)
    table = add_weight(shape=shape, initializer="zeros", **kwargs)
    for i, start in enumerate(range(0, shape[0], BLOCK_ROWS)):
        rows = min(BLOCK_ROWS, shape[0] - start)
        block = for_block(initializer, i)((rows,) + shape[1:], dtype=table.dtype)
        backend.write_rows(table, start, block)
    return table


def _by_blocks(initializer, shape):
    elements = 1
    for dim in shape:
        elements *= dim
    return (isinstance(initializer, ELEMENTWISE) and elements >= MIN_ELEMENTS
            and keras.distribution.distribution() is None)


def blockwise(initializer, block_rows=None):
    """Returns `initializer` drawing large tables by blocks of rows, where it can.

    Applies to `RandomUniform`, `RandomNormal` and `TruncatedNormal` on a
    backend that can write a block into a table in place (JAX), outside a
    `keras.distribution` (which places tables itself); otherwise returns
    `initializer` unchanged. Each block draws its own random numbers: with an
    integer seed the values are deterministic, but not the same as one draw
    of the whole table.

    Args:
        initializer: a Keras initializer instance.
        block_rows: rows per block (default `BLOCK_ROWS`, read when called).
    """
    if not isinstance(initializer, ELEMENTWISE) or not backend.FILLS_IN_BLOCKS:
        return initializer
    return _Blockwise(initializer, block_rows or BLOCK_ROWS)


class _Blockwise(keras.initializers.Initializer):
    """`initializer`, drawn by blocks of rows for large tables.

    An `Initializer` object, not a function: Keras jits `initializer.__call__`
    to create large sharded variables on their devices.
    """

    def __init__(self, initializer, block_rows):
        self.initializer = initializer
        self.block_rows = block_rows

    def __call__(self, shape, dtype=None):
        shape = tuple(shape)
        if not _by_blocks(self.initializer, shape):
            return self.initializer(shape, dtype=dtype)
        return backend.fill_in_blocks(
            lambda i, block_shape: for_block(self.initializer, i)(block_shape, dtype=dtype),
            shape, dtype, self.block_rows)

    def get_config(self):
        return self.initializer.get_config()


def for_block(initializer, index):
    """`initializer` with a seed of its own for block `index`.

    A Keras random initializer with an integer seed (Keras gives one even
    when none is passed) returns the same values on every call, so each
    block derives its own seed from it.
    """
    if not isinstance(initializer.seed, int):
        return initializer  # a SeedGenerator draws fresh numbers per call
    config = initializer.get_config()
    config["seed"] = (initializer.seed * 1_000_003 + index) % (2**31 - 1)
    return type(initializer).from_config(config)
