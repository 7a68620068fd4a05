"""TensorFlow plumbing: a custom-gradient tap, dedup, in-place scatter.

The tap keeps the row gradients away from Keras' dense-gradient path (where
`LossScaleOptimizer` and friends would turn `IndexedSlices` into a dense
table) and hands them to the optimizer as `(ids, grads)`, i.e. the two halves
of the lookup's `tf.IndexedSlices`.
"""

import tensorflow as tf
from sparseopt import compat, row_grads
from sparseopt.backend import tensorflow_kernels


def tap(rows, probe, ids, on_backward, aux=None):
    @tf.custom_gradient
    def _tap(rows, probe):
        def grad(g):
            on_backward(ids, g, aux)
            finite = tf.reduce_all(tf.math.is_finite(g))
            marker = tf.where(finite, tf.constant(1.0, probe.dtype), tf.constant(float("nan"), probe.dtype))
            return None, marker

        return tf.identity(rows), grad

    return _tap(rows, probe)


# Keras' TF train step differentiates `model.trainable_weights` only: a
# lookup's probe must be a weight of its layer to get its gradient. (Nor can
# the table's own gradient carry the marker: a `tf.custom_gradient` that
# reads a variable reads all of it.)
PROBE_IS_WEIGHT = True


# TF copies an initial value into its variable anyway: tables are drawn whole.
fill_in_blocks = None

# tf.unique already hashes; dedup needs no workspace.
WORKSPACE = False


def dedup(ids, grads, num_rows, workspace=None):
    """Returns `(unique_ids, summed_grads, count)` of the valid ids only.

    The number of ids stays static until the very end, so the XLA-compiled
    sum below compiles once per batch shape whatever the mix of bad ids.
    """
    uniq, inverse = tf.unique(tf.cast(ids, tf.int64))
    if isinstance(grads, row_grads.BagGrads):  # expanded inside the compiled sum
        summed = _bag_segment_sum(grads.values, grads.bag, grads.weight, inverse)
    else:
        summed = _segment_sum(grads, inverse)
    summed = summed[: tf.size(uniq)]
    valid = tf.cast((uniq >= 0) & (uniq < num_rows), tf.int32)
    # Not boolean_mask (nor where + gather): inside an XLA cluster, on the
    # dynamically sized output of Unique, they return the first k entries
    # instead of the selected ones (216 of 300 random batches wrong, measured
    # with TF 2.21). dynamic_partition selects correctly in both modes.
    uniq, summed = tf.dynamic_partition(uniq, valid, 2)[1], tf.dynamic_partition(summed, valid, 2)[1]
    return uniq, summed, tf.size(uniq)


def for_distinct_rows(update, variables, uniq, summed, count):
    """`update(variables, uniq, summed)`: `dedup`'s result is exactly the distinct ids."""
    update(variables, uniq, summed)


def split_by_table(uniq, summed, offsets, sizes):
    """Each table's part of a group's `dedup`: `[(ids, grads, count), ...]`.

    One `dynamic_partition` by table (which, unlike slicing at computed
    bounds, also compiles inside an XLA cluster).
    """
    starts = tf.constant(offsets[:-1], uniq.dtype)
    table = tf.searchsorted(starts[1:], uniq, side="right")
    local = uniq - tf.gather(starts, table)
    ids = tf.dynamic_partition(local, table, len(sizes))
    grads = tf.dynamic_partition(summed, table, len(sizes))
    return [(i, g, tf.size(i)) for i, g in zip(ids, grads)]


def materialize(values):
    return values


@tf.function(jit_compile=True, reduce_retracing=True, autograph=False)
def _segment_sum(grads, segments):
    # TF's CPU UnsortedSegmentSum kernel is single-threaded: 1.0 ms for 16k x 32
    # (measured) against 0.4 ms once XLA compiles it. The segment count is the
    # static upper bound `len(grads)`; the caller slices off the unused tail.
    return tf.math.unsorted_segment_sum(grads, segments, tf.shape(grads)[0])


@tf.function(jit_compile=True, reduce_retracing=True, autograph=False)
def _bag_segment_sum(values, bag, weight, segments):
    rows = tf.gather(values, bag) * weight[:, None]
    return tf.math.unsorted_segment_sum(rows, segments, tf.shape(bag)[0])


# The gradient of a gather is `tf.IndexedSlices`: ids and row gradients.
SPARSE_GRADIENTS = True


def gradient_slices(grad):
    """`(ids, row_grads)` of a sparse gradient, or None for a dense one."""
    if isinstance(grad, tf.IndexedSlices):
        return grad.indices, grad.values
    return None


def has_int64():
    return True


def row_shards(variable):
    return None  # tables are never split over devices on TF (strategies are refused)


on_row_shards = None


def replicas_running_alone():
    return tf.distribute.get_strategy().num_replicas_in_sync


def outside_trace():
    return tf.init_scope()


def trace_token(value=None):
    """What identifies the trace being built now (its graph); None when eager."""
    if tf.executing_eagerly():
        return None
    return tf.compat.v1.get_default_graph()


def read_rows(table, ids):
    """Forward lookup of valid `ids` in a Keras variable (no gradient to it).

    Gathers from the resource directly: reading the whole variable would hold
    a second reference to its buffer and make the later in-place scatter copy
    the table first.
    """
    return tf.stop_gradient(tf.gather(table.value, ids))


def read_pooled(table, ids, weight, dtype):
    """`sum_l weight[..., l] * table[ids[..., l]]`, in `dtype` (no gradient to `table`)."""
    rows = tf.cast(read_rows(table, ids), dtype)
    return tf.reduce_sum(rows * tf.expand_dims(weight, -1), axis=-2)


def gather_from_resource(variable, ids):
    """Rows of a Keras variable by `ResourceGather`; the gradient is `IndexedSlices`."""
    return tf.gather(variable.value, ids)


def gather(value, ids):
    return tf.gather(value, ids)


def scatter(variable, ids, rows):
    var = variable.value
    var.scatter_update(tf.IndexedSlices(tf.cast(rows, var.dtype), ids))


def fused_apply(updater, table, slots, ids, grads, learning_rate, finite):
    """Applies `updater` with TensorFlow's own sparse-apply kernel, if one fits.

    Args:
        updater: the `Updater`.
        table: the Keras table variable.
        slots: dict slot name -> Keras state variable.
        ids: unique valid row ids.
        grads: their summed gradients.
        learning_rate: scalar tensor.
        finite: boolean scalar; the kernel runs only when it is true.

    Returns:
        `False` when no kernel computes exactly the updater's rule, or inside
        an XLA cluster (`jit_compile=True`), where TF has no sparse-apply
        kernels; the caller then applies the rule itself.
    """
    if compat.in_xla_context():
        return False
    kernel = tensorflow_kernels.kernel_for(updater)
    if kernel is None:
        return False
    var = table.value
    handles = {name: slot.value.handle for name, slot in slots.items()}
    grads = tf.cast(grads, var.dtype)
    learning_rate = tf.cast(learning_rate, var.dtype)

    def run():
        kernel(updater, var.handle, handles, ids, grads, learning_rate)
        return tf.constant(True)

    tf.cond(finite, run, lambda: tf.constant(False))
    return True
