"""The option combinations `DispatchOptimizer` refuses, each with the fix.

Called when the optimizer is built, before any step: every refusal is a
`ValueError` that names the tables (or variable) and says what to change.
"""

from sparseopt import backend


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
                f"{opt.gradient_accumulation_steps}` on {opt.name} is not supported "
                f"with sparse tables {tables}: accumulating their updates would "
                "need table-sized buffers. Remove it and use a larger batch "
                "(or accumulate in a custom train_step)."
            )


def install_options(names, scaled, optimizers):
    """What keras-rs SparseCore variables (installed as computed) cannot follow.

    Args:
        names: the installed variables' paths.
        scaled: whether the loss is scaled (`loss_scale_factor` or a wrapping
            `LossScaleOptimizer`).
        optimizers: the Keras optimizers of the dense variables.
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
