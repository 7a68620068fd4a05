"""TensorFlow plumbing: a custom-gradient tap, tf.unique dedup, scatter_update.

The tap keeps the row gradients away from Keras' dense-gradient path (where
`LossScaleOptimizer` and friends would turn `IndexedSlices` into a dense
table) and hands them to the optimizer as `(ids, grads)`.
"""

import tensorflow as tf


def tap(rows, probe, ids, on_backward):
    @tf.custom_gradient
    def _tap(rows, probe):
        def grad(g):
            on_backward(ids, g)
            finite = tf.reduce_all(tf.math.is_finite(g))
            marker = tf.where(finite, tf.constant(1.0, probe.dtype), tf.constant(float("nan"), probe.dtype))
            return None, marker

        return tf.identity(rows), grad

    return _tap(rows, probe)


def dedup(ids, grads, num_rows):
    """Returns `(unique_ids, summed_grads)` of the valid ids only."""
    ids = tf.cast(ids, tf.int64)
    valid = (ids >= 0) & (ids < num_rows)
    ids = tf.boolean_mask(ids, valid)
    grads = tf.boolean_mask(grads, valid)
    uniq, inverse = tf.unique(ids)
    summed = tf.math.unsorted_segment_sum(grads, inverse, tf.size(uniq))
    return uniq, summed


def read_rows(table, ids):
    """Forward lookup of valid `ids` in a Keras variable (no gradient to it).

    Gathers from the resource directly: reading the whole variable would hold
    a second reference to its buffer and make the later in-place scatter copy
    the table first.
    """
    return tf.stop_gradient(tf.gather(table.value, ids))


def gather(value, ids):
    return tf.gather(value, ids)


def scatter(variable, ids, rows):
    var = variable.value
    var.scatter_update(tf.IndexedSlices(tf.cast(rows, var.dtype), ids))
