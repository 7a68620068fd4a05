"""TensorFlow: host calls from a traced step, for tables kept in files (`sparseopt.disk`).

Both are stateful `tf.numpy_function`s: a `tf.function` runs every stateful
op, in program order (automatic control dependencies), so a step's reads
and writes happen as its code calls them. They cannot be compiled by XLA:
a layer whose table is on disk says so (`supports_jit = False`), so that
Keras' `jit_compile="auto"` leaves the step to TensorFlow.
"""

import numpy as np
import tensorflow as tf

HOST_CALLS_COMPILE = False  # (XLA cannot compile a numpy_function)


def host_read(fn, args, outputs):
    """`fn(*arrays)` on the host: a tuple of tensors of `outputs`' `(shape, dtype)`s.

    Args:
        fn: NumPy arrays in, a tuple of NumPy arrays out; writes nothing.
        args: its tensor arguments.
        outputs: `[(shape, dtype)]` of its results (dimensions may be None).
    """
    dtypes = [tf.as_dtype(dtype) for _, dtype in outputs]
    if len(dtypes) == 1:
        # One result asked for as one: eagerly, TF splits a one-element list of results
        # along its first axis (a `[8, 3, 2]` result came back as eight `[3, 2]` ones).
        out = [tf.numpy_function(lambda *a: fn(*a)[0], list(args), dtypes[0],
                                 stateful=True)]
    else:
        out = tf.numpy_function(lambda *a: list(fn(*a)), list(args), dtypes, stateful=True)
    for value, (shape, _) in zip(out, outputs):
        value.set_shape(shape)
    return tuple(out)


def host_write(fn, args):
    """`fn(*arrays)` on the host, for its effect, in order with every host call.

    Args:
        fn: NumPy arrays in; its result is ignored.
        args: its tensor arguments.
    """
    def run(*arrays):
        fn(*arrays)
        return np.zeros((), np.int32)

    tf.numpy_function(run, list(args), tf.int32, stateful=True)
