"""TensorFlow's fused sparse-apply kernels, for the rules they match exactly.

Each entry maps a kernel name that an updater gives (`Updater.tf_kernel`) to
a function that runs the TF kernel on unique ids, with the fixed arguments
the updater gives beside the name (its settings: the kernels read nothing
from the updater itself). An updater whose rule no
kernel computes exactly names none; sparseopt then applies the rule written
with `keras.ops`. All kernels update the rows of the table and of its
state in place, once per id: callers must pass unique ids.
"""

import functools

import tensorflow as tf


def _sgd(var, slots, ids, grads, values):
    tf.raw_ops.ResourceScatterSub(resource=var, indices=ids,
                                  updates=values["learning_rate"] * grads)


def _adagrad(var, slots, ids, grads, values):
    # ApplyAdagradV2 divides by sqrt(acc) + epsilon; Adagrad.tf_kernel names it
    # only for epsilon == 0 (fixed once built), where that is the Keras form exactly.
    lr = values["learning_rate"]
    tf.raw_ops.ResourceSparseApplyAdagradV2(
        var=var, accum=slots["accumulator"], lr=lr, epsilon=tf.zeros_like(lr),
        grad=grads, indices=ids)


def _ftrl(var, slots, ids, grads, values, multiply_linear_by_lr=False):
    # TF's kernel has no beta; Keras' Ftrl folds it into l2 the same way.
    lr = values["learning_rate"]
    l2 = values["l2_regularization_strength"] + values["beta"] / (2.0 * lr)
    tf.raw_ops.ResourceSparseApplyFtrl(
        var=var, accum=slots["accumulator"], linear=slots["linear"], grad=grads,
        indices=ids, lr=lr, l1=values["l1_regularization_strength"], l2=l2,
        lr_power=values["learning_rate_power"],
        multiply_linear_by_lr=multiply_linear_by_lr)


def _keras_momentum(var, slots, ids, grads, values, use_nesterov=False):
    # m <- momentum * m - lr * g; w <- w + m (nesterov: w + momentum * m - lr * g).
    tf.raw_ops.ResourceSparseApplyKerasMomentum(
        var=var, accum=slots["momentum"], lr=values["learning_rate"], grad=grads,
        indices=ids, momentum=values["momentum"], use_nesterov=use_nesterov)


_KERNELS = {"sgd": _sgd, "adagrad": _adagrad, "ftrl": _ftrl, "keras_momentum": _keras_momentum}


def kernel_for(updater):
    """The kernel for `updater` as `run(var, slots, ids, grads, values)`, or `None`.

    The updater says which kernel computes exactly its whole step
    (`fused_kernel`: none where an option is set), by name or as
    `(name, {fixed argument: value})`.
    """
    spec = updater.fused_kernel()
    name, fixed = (spec, {}) if spec is None or isinstance(spec, str) else spec
    if name not in _KERNELS:
        return None
    return functools.partial(_KERNELS[name], **fixed)
