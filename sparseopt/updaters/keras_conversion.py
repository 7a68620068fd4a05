"""Converting between sparseopt updaters and the Keras optimizers that name table rules.

keras-rs' `TableConfig(optimizer=...)` names each table's rule with a Keras
optimizer (SGD, Adagrad, FTRL; Adam is its default). These functions map
such an optimizer to the sparseopt updater with the same rule and
hyperparameters, and back. Settings with no sparse, per-row meaning are
refused with what to change, never dropped.
"""

import keras

from sparseopt.updaters.adagrad import Adagrad
from sparseopt.updaters.ftrl import Ftrl
from sparseopt.updaters.sgd import SGD

# Options of keras.optimizers.Optimizer that a per-table sparse rule cannot honour.
_UNSUPPORTED_BASE = {
    "clipnorm": "clip the table's gradient",
    "clipvalue": "clip the table's gradient",
    "global_clipnorm": "clip the table's gradient",
    "weight_decay": "decay every row each step (use FTRL's l2_regularization_strength)",
    "use_ema": "average every row each step",
    "loss_scale_factor": "scale one table's loss (set it on the model's optimizer)",
    "gradient_accumulation_steps": "accumulate table-sized gradients",
}


def from_keras_optimizer(optimizer, table=None):
    """The sparseopt updater with `optimizer`'s rule and hyperparameters.

    Args:
        optimizer: a `keras.optimizers.SGD`, `Adagrad` or `Ftrl` (instance, or
            name such as `"adagrad"`), as in keras-rs' `TableConfig.optimizer`.
        table: optional table name, for error messages.

    Returns:
        A `sparseopt.updaters.SGD`, `Adagrad` or `Ftrl`.

    Raises:
        ValueError: for an optimizer or a setting without a sparse equivalent
            (Adam, momentum, clipping, weight decay, EMA, ...).
    """
    where = f" for table '{table}'" if table else ""
    optimizer = keras.optimizers.get(optimizer)
    config = optimizer.get_config()
    for option, what in _UNSUPPORTED_BASE.items():
        value = config.get(option)
        if value not in (None, False, 0, 0.0):
            raise ValueError(
                f"sparseopt: `{option}={value!r}` on {type(optimizer).__name__}{where} "
                f"is not supported: a sparse table update cannot {what}. Remove it."
            )
    lr = _learning_rate(config["learning_rate"], where)
    if isinstance(optimizer, keras.optimizers.SGD):
        if config.get("momentum") or config.get("nesterov"):
            raise ValueError(
                f"sparseopt: SGD momentum/nesterov{where} is not supported for tables "
                "(momentum would have to decay every row each step). Use "
                "keras.optimizers.SGD(learning_rate) or Adagrad."
            )
        return SGD(lr)
    if isinstance(optimizer, keras.optimizers.Adagrad):
        return Adagrad(lr, initial_accumulator_value=config["initial_accumulator_value"],
                       epsilon=config["epsilon"])
    if isinstance(optimizer, keras.optimizers.Ftrl):
        if config.get("l2_shrinkage_regularization_strength"):
            raise ValueError(
                f"sparseopt: Ftrl `l2_shrinkage_regularization_strength`{where} is not "
                "supported; use `l2_regularization_strength`."
            )
        return Ftrl(lr, learning_rate_power=config["learning_rate_power"],
                    l1_regularization_strength=config["l1_regularization_strength"],
                    l2_regularization_strength=config["l2_regularization_strength"],
                    beta=config["beta"],
                    initial_accumulator_value=config["initial_accumulator_value"])
    raise ValueError(
        f"sparseopt: {type(optimizer).__name__}{where} has no sparse, per-row "
        "equivalent here (sparseopt trains tables with SGD, Adagrad, row-wise Adagrad "
        "and FTRL). Choose keras.optimizers.SGD, Adagrad or Ftrl for this table."
    )


def to_keras_optimizer(updater):
    """The Keras optimizer with `updater`'s rule and hyperparameters.

    This is what keras-rs' `TableConfig(optimizer=...)` accepts.

    Args:
        updater: a `sparseopt.updaters.SGD`, `Adagrad` or `Ftrl`.

    Returns:
        A `keras.optimizers.SGD`, `Adagrad` or `Ftrl`.

    Raises:
        ValueError: for updaters Keras has no optimizer for (`RowwiseAdagrad`,
            custom updaters) and for FTRL with
            `multiply_linear_by_learning_rate=True`.
    """
    lr = updater.learning_rate
    if type(updater) is SGD:
        return keras.optimizers.SGD(lr)
    if type(updater) is Adagrad:
        return keras.optimizers.Adagrad(
            lr, initial_accumulator_value=updater.initial_accumulator_value,
            epsilon=updater.epsilon)
    if type(updater) is Ftrl:
        if updater.multiply_linear_by_learning_rate:
            raise ValueError(
                "sparseopt: Ftrl(multiply_linear_by_learning_rate=True) has no Keras "
                "optimizer equivalent; use the default (False) to convert it."
            )
        return keras.optimizers.Ftrl(
            lr, learning_rate_power=updater.learning_rate_power,
            initial_accumulator_value=updater.initial_accumulator_value,
            l1_regularization_strength=updater.l1_regularization_strength,
            l2_regularization_strength=updater.l2_regularization_strength,
            beta=updater.beta)
    raise ValueError(
        f"sparseopt: {type(updater).__name__} has no Keras optimizer equivalent (Keras "
        "and keras-rs TableConfig know SGD, Adagrad, Adam and FTRL); keep it on a "
        "sparseopt.layers.SparseEmbedding table."
    )


def _learning_rate(value, where):
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, dict):  # a serialized LearningRateSchedule, or a function
        try:
            schedule = keras.saving.deserialize_keras_object(value)
        except (ValueError, TypeError):
            schedule = None
        if isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule):
            return schedule
    raise ValueError(f"sparseopt: unsupported learning rate {value!r}{where}; use a float "
                     "or a keras.optimizers.schedules.LearningRateSchedule.")


def to_sparsecore_spec(updater):
    """The jax-tpu-embedding optimizer spec (SparseCore) with `updater`'s rule.

    Converts through `to_keras_optimizer` and then keras-rs' own
    `keras_to_jte_optimizer`, so the spec is exactly what keras-rs would build
    from that `TableConfig.optimizer`.

    Args:
        updater: a `sparseopt.updaters.SGD`, `Adagrad` (with the default
            `epsilon=1e-7`: SparseCore's Adagrad has none) or `Ftrl`.

    Returns:
        A `jax_tpu_embedding` `OptimizerSpec`.

    Raises:
        ImportError: where jax-tpu-embedding is not installed.
        ValueError: for settings SparseCore does not support.
    """
    return _jte_conversion().keras_to_jte_optimizer(to_keras_optimizer(updater))


def from_sparsecore_spec(spec):
    """The sparseopt updater with a jax-tpu-embedding optimizer spec's rule.

    Args:
        spec: a `jax_tpu_embedding` SGD, Adagrad or FTRL `OptimizerSpec`.

    Returns:
        A `sparseopt.updaters.SGD`, `Adagrad` or `Ftrl`.
    """
    return from_keras_optimizer(_jte_conversion().jte_to_keras_optimizer(spec))


def _jte_conversion():
    try:
        from keras_rs.src.layers.embedding.jax import config_conversion
    except ImportError as e:
        raise ImportError(
            "sparseopt: SparseCore optimizer specs need keras-rs and jax-tpu-embedding "
            "(`pip install 'sparseopt[keras-rs,sparsecore]'`, Linux x86-64)."
        ) from e
    return config_conversion
