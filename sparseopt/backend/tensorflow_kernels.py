"""TensorFlow's fused sparse-apply kernels, for the rules they match exactly.

Each entry maps a kernel name that an updater gives (`Updater.tf_kernel`) to
a function that runs the TF kernel on unique ids. An updater whose rule no
kernel computes exactly names none; sparseopt then applies the rule written
with `keras.ops`. All kernels update the rows of the table and of its
state in place, once per id: callers must pass unique ids.
"""

import tensorflow as tf


def _sgd(updater, var, slots, ids, grads, values):
    tf.raw_ops.ResourceScatterSub(resource=var, indices=ids,
                                  updates=values["learning_rate"] * grads)


def _adagrad(updater, var, slots, ids, grads, values):
    # ApplyAdagradV2 divides by sqrt(acc) + epsilon; Adagrad.tf_kernel names it
    # only for epsilon == 0 (fixed once built), where that is the Keras form exactly.
    lr = values["learning_rate"]
    tf.raw_ops.ResourceSparseApplyAdagradV2(
        var=var, accum=slots["accumulator"], lr=lr, epsilon=tf.zeros_like(lr),
        grad=grads, indices=ids)


def _ftrl(updater, var, slots, ids, grads, values):
    # TF's kernel has no beta; Keras' Ftrl folds it into l2 the same way.
    lr = values["learning_rate"]
    l2 = values["l2_regularization_strength"] + values["beta"] / (2.0 * lr)
    tf.raw_ops.ResourceSparseApplyFtrl(
        var=var, accum=slots["accumulator"], linear=slots["linear"], grad=grads,
        indices=ids, lr=lr, l1=values["l1_regularization_strength"], l2=l2,
        lr_power=values["learning_rate_power"],
        multiply_linear_by_lr=updater.multiply_linear_by_learning_rate)


def _keras_momentum(updater, var, slots, ids, grads, values):
    # m <- momentum * m - lr * g; w <- w + m (nesterov: w + momentum * m - lr * g).
    tf.raw_ops.ResourceSparseApplyKerasMomentum(
        var=var, accum=slots["momentum"], lr=values["learning_rate"], grad=grads,
        indices=ids, momentum=values["momentum"], use_nesterov=updater.nesterov)


_KERNELS = {"sgd": _sgd, "adagrad": _adagrad, "ftrl": _ftrl, "keras_momentum": _keras_momentum}


def kernel_for(updater):
    """The kernel function for `updater`, or `None` if no TF kernel matches it.

    The updater says which kernel computes exactly its whole step
    (`fused_kernel`: none where an option is set).
    """
    return _KERNELS.get(updater.fused_kernel())
