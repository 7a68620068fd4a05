"""`global_clipnorm` over everything a step updates: dense gradients and tables' rows.

Keras' `global_clipnorm` scales all of an optimizer's gradients by
`min(1, c / norm)`, with `norm` the L2 norm of all of them together. For a
model with sparse tables, "all of them" includes each table's gradient: the
dense `[V, D]` array a dense optimizer would see, whose norm is that of the
step's distinct rows, each row's gradients summed (the rows no id touched
are zero). `DispatchOptimizer` gathers one squared norm per dense gradient
and per table (after the table's dedup, so no work follows the vocabulary),
takes Keras' factor of their sum, and multiplies every gradient by it.
"""

from keras import ops


def squared_norm(gradient, loss_scale=None):
    """The squared L2 norm of one dense gradient, unscaled by `loss_scale` if given.

    Args:
        gradient: a dense gradient (a `tf.IndexedSlices` is made dense first,
            as Keras' own clipping does).
        loss_scale: the loss scale the gradient still carries, or None.
    """
    gradient = ops.cast(ops.convert_to_tensor(gradient), "float32")
    if loss_scale is not None:
        gradient = gradient / loss_scale
    return ops.sum(ops.square(gradient))


def scaled(gradient, factor):
    """`gradient * factor`, keeping a sparse (`tf.IndexedSlices`) gradient sparse."""
    if hasattr(gradient, "indices") and hasattr(gradient, "values"):
        return type(gradient)(gradient.values * factor, gradient.indices,
                              gradient.dense_shape)
    return gradient * ops.cast(factor, gradient.dtype)


def factor(squared_norms, clip_norm):
    """Keras' `clip_by_global_norm` factor for the summed `squared_norms`.

    `clip_norm * min(1 / norm, 1 / clip_norm)`: 1 (to float rounding) where
    the norm is within `clip_norm`, NaN where it is not finite (then every
    table skips the step, as for any non-finite gradient).

    Args:
        squared_norms: list of scalar tensors.
        clip_norm: the `global_clipnorm`, a positive float.
    """
    norm = ops.sqrt(ops.sum(ops.stack([ops.cast(s, "float32") for s in squared_norms])))
    scale = clip_norm * ops.minimum(1.0 / norm, 1.0 / clip_norm)
    return scale + (norm - norm)
