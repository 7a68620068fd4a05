"""The option combinations `DispatchOptimizer` refuses, each with the fix.

Called when the optimizer is built, before any step: every refusal is a
`ValueError` that names the tables (or variable) and says what to change.
"""

import keras

from sparseopt import backend
from sparseopt.updaters import Updater


def assigned(value, owner):
    """What `owner` assigns a variable is a Keras optimizer or an updater, not a wrapper.

    Args:
        value: the assigned optimizer or updater.
        owner: who assigned it, for the message (an `optimizer_map` entry, a
            layer, a variable's `optimizer` attribute).
    """
    if not isinstance(value, (Updater, keras.optimizers.Optimizer)):
        raise TypeError(
            f"DispatchOptimizer: {owner} must be a Keras optimizer or a sparseopt "
            f"updater, got {value!r}.")
    wrappers = (keras.optimizers.LossScaleOptimizer, keras.optimizers.MultiOptimizer)
    if isinstance(value, wrappers) or hasattr(value, "table_trainers"):
        raise ValueError(
            f"DispatchOptimizer: {owner} assigns {type(value).__name__} '{value.name}', "
            "which wraps other optimizers; assign the plain Keras optimizer (or an "
            "updater) and wrap the DispatchOptimizer itself instead.")


# Keras optimizer arguments a DispatchOptimizer does not take, and where they go.
_ELSEWHERE = {
    "weight_decay": "the wrapped Keras optimizer (dense variables) and each table's updater "
                    "(`weight_decay=`, decoupled like Keras')",
    "clipnorm": "the wrapped Keras optimizer (per dense variable) and each table's updater "
                "(`clipnorm=`, per row), or use `global_clipnorm` here (one norm over "
                "everything)",
    "clipvalue": "the wrapped Keras optimizer and each table's updater (`clipvalue=`, the same "
                 "clip)",
    "use_ema": "the wrapped Keras optimizer (dense variables) and each table's updater "
               "(`ema_momentum=`)",
    "ema_momentum": "the wrapped Keras optimizer and each table's updater (`ema_momentum=`)",
    "ema_overwrite_frequency": "the wrapped Keras optimizer (dense variables only)",
}


def dispatch_arguments(kwargs):
    """Refuses the Keras optimizer arguments that `DispatchOptimizer` does not take.

    Each acts on variables one optimizer owns: it goes on the wrapped Keras
    optimizer or on the updaters, never silently nowhere.

    Args:
        kwargs: the keyword arguments given to `DispatchOptimizer`.
    """
    for name in kwargs:
        if name in _ELSEWHERE and kwargs[name] not in (None, False):
            raise ValueError(
                f"DispatchOptimizer: `{name}` is not an argument of the DispatchOptimizer; "
                f"set it on {_ELSEWHERE[name]}.")


def table(var, updater, lookup, owner):
    """A table given a sparse updater: read sparsely, no regularizer, no constraint.

    Args:
        var: the table variable.
        updater: its updater.
        lookup: its `SparseLookup`, or None if none reads it.
        owner: who assigned the updater, for the message.
    """
    if lookup is None:
        raise ValueError(
            f"DispatchOptimizer: {owner} assigns updater {updater!r} to "
            f"'{var.path}', but that variable is not read through "
            "sparseopt.ops.SparseLookup, so its gradient would be dense and the "
            "update would cost the whole table. Read it with "
            "`sparseopt.ops.SparseLookup(layer, variable)` (as "
            "sparseopt.layers.SparseEmbedding does), or give it a Keras optimizer."
        )
    # Both act on the whole table every step: a regularizer's dense
    # gradient would never reach the updater, a constraint would cost V.
    if getattr(var, "regularizer", None) is not None:
        raise ValueError(
            f"DispatchOptimizer: table '{var.path}' has a regularizer "
            f"({var.regularizer!r}); its gradient is dense and a sparse updater "
            "never sees it. Remove it and regularize in the updater instead "
            "(e.g. `sparseopt.updaters.Ftrl(..., l2_regularization_strength=...)`), "
            "or regularize only the looked-up rows in the loss."
        )
    if getattr(var, "constraint", None) is not None:
        raise ValueError(
            f"DispatchOptimizer: table '{var.path}' has a constraint "
            f"({var.constraint!r}); applying it after each step would touch every "
            "row. Remove it, or constrain the looked-up rows in the layer's call "
            "(e.g. normalize them)."
        )


def dense_options(optimizers, tables):
    """Options of the dense Keras optimizers that sparse tables cannot follow.

    Args:
        optimizers: the Keras optimizers of the dense variables.
        tables: the sparse tables' paths.
    """
    for opt in optimizers:
        if opt.gradient_accumulation_steps:
            raise ValueError(
                f"DispatchOptimizer: `gradient_accumulation_steps="
                f"{opt.gradient_accumulation_steps}` on {opt.name} (a Keras optimizer of "
                f"`optimizer_map`) would accumulate its variables alone, out of step with "
                f"the sparse tables {tables}. Set it on the DispatchOptimizer (or the "
                "optimizer it wraps): everything then accumulates together."
            )


def install_options(names, scaled, optimizers):
    """What keras-rs SparseCore variables (installed as computed) cannot follow.

    Args:
        names: the installed variables' paths.
        scaled: whether the loss is scaled (`loss_scale_factor` or a wrapping
            `LossScaleOptimizer`).
        optimizers: the `DispatchOptimizer` and the Keras optimizers of the
            dense variables.
    """
    shown = names[:4] + (["..."] if len(names) > 4 else [])
    if scaled:
        raise ValueError(
            f"DispatchOptimizer: loss scaling is not supported with keras-rs "
            f"SparseCore tables {shown}: their lookup's backward pass computes "
            "the updated tables from the scaled gradient, so every table update "
            "would be scaled too. Remove `loss_scale_factor` / the "
            "LossScaleOptimizer (SparseCore tables are float32), or place these "
            "tables with `placement='default_device'`."
        )
    for opt in optimizers:
        if opt.gradient_accumulation_steps:
            raise ValueError(
                f"DispatchOptimizer: `gradient_accumulation_steps="
                f"{opt.gradient_accumulation_steps}` is not supported with keras-rs "
                f"SparseCore tables {shown}: each step's backward pass already "
                "applies the table update; accumulating would mix tables. Remove "
                "it and use a larger batch."
            )
    if optimizers and optimizers[0].global_clipnorm:
        raise ValueError(
            f"DispatchOptimizer: `global_clipnorm={optimizers[0].global_clipnorm}` (one norm "
            f"over every gradient) is not supported with keras-rs SparseCore tables {shown}: "
            "their backward pass applies their update, which the optimizer never sees to "
            "clip. Use `clipnorm` on the wrapped optimizer (dense variables only), or place "
            "these tables with `placement='default_device'`.")


def replicas(tables):
    """Refuses TF strategies whose replicas sparseopt cannot keep in step.

    `tf.distribute.MirroredStrategy` is supported: its replicas gather each
    other's row gradients and apply the same update to their own copies.

    Args:
        tables: the sparse tables' paths.
    """
    found = backend.replica_strategy()
    if found is None:
        return
    name, count, supported = found
    if not supported:
        raise ValueError(
            f"DispatchOptimizer: the sparse tables {tables} would be trained by "
            f"{count} replicas of tf.distribute.{name}, which sparseopt does not "
            "support: its replicas would each write their own copy of each table. "
            "Use tf.distribute.MirroredStrategy (the local devices of one machine), "
            "train on one device, or shard the tables on JAX with keras.distribution "
            "(see sparseopt.distribution.row_sharded)."
        )
