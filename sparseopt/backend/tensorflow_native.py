"""TensorFlow: the native ops' calls (`sparseopt.native`), where they replace the pure path.

`dedup` is `tensorflow.py`'s `dedup` as one op (`tf_ops.cc`) on the workspace
variable: the same distinct ids, sums and workspace entries, with no
`[ids, width]` buffers and no slicing. Its distinct ids come in the order of
their last occurrence; the pure path's come in the order its scatter's
landing writes give, which TensorFlow's parallel scatter does not fix (the
per-row results are the same either way). `number_ids` numbers a table on
disk's step ids by the host library's code as an op (`tf_ops.cc`), where a
`tf.numpy_function` host call did.
"""

import tensorflow as tf

from sparseopt import compat, native
from sparseopt.records import BagGrads, Distinct


def applies(record):
    """Whether the native dedup runs for `record`: the op switched on and built, not
    inside an XLA cluster (a custom op does not compile there), no GPU (the op is a
    CPU kernel), float32 gradients of rank 2."""
    grads = record.grads.values if isinstance(record.grads, BagGrads) else record.grads
    return (native.enabled("tf_dedup") and not compat.in_xla_context()
            and not tf.config.list_logical_devices("GPU")
            and grads.dtype == tf.float32 and grads.shape.rank == 2)


def dedup(record, num_rows, space):
    """`tensorflow.dedup` by the native op, on `space` (the replica's workspace
    `tf.Variable`)."""
    ids = tf.cast(record.ids, tf.int64)
    grads = record.grads
    if isinstance(grads, BagGrads):
        rows, bag, weight, bags = (grads.values, tf.cast(grads.bag, tf.int32),
                                   tf.cast(grads.weight, tf.float32), True)
    else:
        rows, bag, weight, bags = grads, tf.zeros([0], tf.int32), tf.zeros([0], tf.float32), False
    uniq, summed, count = native.tf_ops().sparseopt_dedup_sum(
        space.handle, ids, rows, bag, weight, num_rows=int(num_rows), bags=bags)
    return Distinct(uniq, summed, count)


def number_ids(ids, num_rows):
    """A table on disk's step ids numbered by the native op (`tf_ops.cc`'s
    `SparseoptNumberIds`: the host library's numbering, in the step, with no
    `tf.numpy_function`), or None where it does not run: the op off or not built, inside
    an XLA cluster (a custom op does not compile there), or with a GPU (a CPU kernel).

    Args:
        ids, num_rows: as for `jax_native.number_ids`, which gives the same results.
    """
    if not (native.enabled("tf_disk_number") and not compat.in_xla_context()
            and not tf.config.list_logical_devices("GPU")):
        return None
    ids = tf.reshape(tf.cast(ids, tf.int32), [-1])
    return tuple(native.tf_ops().sparseopt_number_ids(ids, num_rows=int(num_rows)))
