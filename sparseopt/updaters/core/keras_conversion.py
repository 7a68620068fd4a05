"""Converting between sparseopt updaters and the Keras optimizers that name table rules.

keras-rs' `TableConfig(optimizer=...)` names each table's rule with a Keras
optimizer (SGD with or without momentum, Adagrad, Adam, FTRL, and any other
Keras optimizer; Adam is its default). These functions map such an optimizer to the sparseopt updater with
the same rule and hyperparameters, and back. `clipvalue` carries over (on the
summed row gradient it means what Keras means); settings with no sparse,
per-row meaning are refused with what to change, never dropped.
"""

import numbers

import keras

from sparseopt import compat
from sparseopt.updaters.core.base import STORAGE_DEFAULTS, registry

# Options of keras.optimizers.Optimizer that a per-table sparse rule cannot honour.
_UNSUPPORTED_BASE = {
    "clipnorm": "clip the norm of the whole table's gradient (set the updater's own "
                "`clipnorm`, which clips each row's)",
    "global_clipnorm": "clip the table's gradient",
    "weight_decay": "decay every row each step (set the updater's own `weight_decay` "
                    "option, which decays the rows a step touches)",
    "ema_overwrite_frequency": "overwrite the table with its average every few steps (keep "
                               "`use_ema`, without `ema_overwrite_frequency`)",
    "loss_scale_factor": "scale one table's loss (set it on the model's optimizer)",
    "gradient_accumulation_steps": "accumulate table-sized gradients",
}
# Keras optimizers with no per-row rule here: why, and the nearest that has one.
def _keras_and_ours(name):
    return f"keras.optimizers.{name} (sparseopt.updaters.{name})"


_NEAREST = {
    "Adadelta": ("its step is scaled by a running average of its own past updates, which "
                 "no table rule keeps yet", _keras_and_ours("RMSprop")),
    "Muon": ("it orthogonalizes the whole 2-D update, every row at once",
             _keras_and_ours("Adam")),
    "ScheduleFreeAdamW": ("its averaging moves every row every step", _keras_and_ours("Adam")),
}
# The Keras optimizers keras-rs converts to a SparseCore spec itself.
_KERAS_RS_CONVERTS = (keras.optimizers.SGD, keras.optimizers.Adagrad, keras.optimizers.Adam,
                      keras.optimizers.Ftrl)
# Options with the same meaning on a table's summed row gradients.
_CARRIED_OVER = ("clipvalue",)


def from_keras_optimizer(optimizer, table=None):
    """The sparseopt updater with `optimizer`'s rule and hyperparameters.

    Args:
        optimizer: a `keras.optimizers.SGD`, `Adagrad`, `Adam`, `Ftrl`,
            `RMSprop`, `Adamax`, `Nadam`, `Lion`, `Lamb` or `Adafactor` (instance, or name
            such as `"adagrad"`), as in keras-rs' `TableConfig.optimizer`.
        table: optional table name, for error messages.

    Returns:
        A `sparseopt.updaters.SGD`, `Adagrad`, `Adam` (lazy: touched rows
        only) or `Ftrl`.

    Raises:
        ValueError: for an optimizer or a setting without a sparse equivalent
            (Adadelta, Muon, AMSGrad, a whole-table `clipnorm`, dense
            weight decay, ...), naming the nearest rule that has one.
    """
    where = f" for table '{table}'" if table else ""
    optimizer = keras.optimizers.get(optimizer)
    config = optimizer.get_config()
    name = type(optimizer).__name__
    if name in _NEAREST:
        why, nearest = _NEAREST[name]
        raise ValueError(
            f"sparseopt: {name}{where} has no sparse, per-row equivalent: {why}. The "
            f"nearest rule is {nearest}.")
    for option, what in _UNSUPPORTED_BASE.items():
        value = config.get(option)
        if value not in (None, False, 0, 0.0):
            raise ValueError(
                f"sparseopt: `{option}={value!r}` on {type(optimizer).__name__}{where} "
                f"is not supported: a sparse table update cannot {what}. Remove it."
            )
    lr = _learning_rate(config["learning_rate"], where)
    carried = {k: config[k] for k in _CARRIED_OVER if config.get(k) is not None}
    if config.get("use_ema"):  # Keras' moving average: the updater's, at sparse cost
        carried["ema_momentum"] = config["ema_momentum"]
    for entry in registry(shipped_only=True).values():
        if entry.keras_optimizer is not None and isinstance(optimizer, entry.keras_optimizer):
            updater = entry.from_keras(lr, config, where)
            if carried:
                updater = entry.from_config({**updater.get_config(), **carried})
            return updater
    # Simplest first (fewest state slots): "SGD, Lion, Adagrad, ...".
    known = sorted((e for e in registry(shipped_only=True).values() if e.keras_optimizer),
                   key=lambda e: (len(e().slots), e.__name__))
    names = [e.keras_optimizer.__name__ for e in known]
    raise ValueError(
        f"sparseopt: {name}{where} has no sparse, per-row "
        f"equivalent here (sparseopt trains tables with {', '.join(registry(True))}). "
        f"Choose keras.optimizers.{', '.join(names[:-1])} or {names[-1]} for this table."
    )


def to_keras_optimizer(updater):
    """The Keras optimizer with `updater`'s rule and hyperparameters.

    This is what keras-rs' `TableConfig(optimizer=...)` accepts.

    Args:
        updater: a `sparseopt.updaters.Updater` whose entry has a Keras
            equivalent (`SGD`, `Adagrad`, `Adam`, `Ftrl`, `RMSprop`, `Adamax`,
            `Nadam`, `Lion`, `Lamb`).

    Returns:
        The `keras.optimizers` optimizer of the same name.

    Raises:
        ValueError: for updaters Keras has no optimizer for (`RowwiseAdagrad`,
            `PartialRowwiseAdam`, `AdagradMomentum`, custom updaters), for
            FTRL with `multiply_linear_by_learning_rate=True`, and for options
            a Keras optimizer cannot express (all but `clipvalue`).
    """
    if updater.scheduled:
        raise ValueError(
            f"sparseopt: {type(updater).__name__} with schedules for {updater.scheduled} has "
            "no Keras optimizer equivalent (Keras schedules the learning rate only); use "
            "constants to convert it.")
    optimizer = updater.to_keras()  # first: "has no Keras optimizer" says the most
    storage = _storage_settings(updater)
    if storage:
        raise ValueError(
            f"sparseopt: {type(updater).__name__} storage settings {storage} have no Keras "
            "optimizer equivalent (Keras keeps state in the variable's dtype and rounds to "
            "nearest; a Keras optimizer on a keras-rs table converts back with the defaults: "
            "float32 state, stochastic rounding, seed 0); remove them to convert it.")
    if updater.swa is not None:
        raise ValueError(
            f"sparseopt: {type(updater).__name__}(swa_period=...) has no Keras optimizer "
            "equivalent (Keras has no stochastic weight averaging); remove swa_period to "
            "convert it.")
    if updater.lookahead is not None:
        raise ValueError(
            f"sparseopt: {type(updater).__name__}(lookahead_period=...) has no Keras "
            "optimizer equivalent (Keras has no Lookahead); remove lookahead_period to "
            "convert it.")
    others = sorted(k for k, v in updater.options.items()
                    if k not in _CARRIED_OVER or not isinstance(v, float))
    if others:
        raise ValueError(
            f"sparseopt: {type(updater).__name__} options {others} have no Keras optimizer "
            "equivalent (Keras clips and decays whole variables, not rows, and takes "
            "constant clip values); remove them to convert it."
        )
    extra = dict(updater.options)
    if updater.ema_momentum is not None:
        extra.update(use_ema=True, ema_momentum=updater.ema_momentum)
    if not updater.lazy and not updater.dense_in_rule:
        raise ValueError(
            f"sparseopt: {type(updater).__name__}(lazy=False) has no Keras optimizer "
            "equivalent to convert to (a Keras optimizer on a keras-rs table is converted "
            "back to a lazy updater); remove lazy=False to convert it.")
    if extra:
        optimizer = type(optimizer).from_config({**optimizer.get_config(), **extra})
    return optimizer


def _storage_settings(updater):
    """`["state_dtype='bfloat16'", ...]`: the storage settings not at their defaults."""
    return [f"{k}={getattr(updater, k)!r}" for k, default in STORAGE_DEFAULTS.items()
            if getattr(updater, k) != default]


def _learning_rate(value, where):
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, keras.optimizers.schedules.LearningRateSchedule):
        return value
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
    from that `TableConfig.optimizer`. `AdagradMomentum`, which SparseCore has
    and Keras does not, maps to jax-tpu-embedding's `AdagradMomentumOptimizerSpec`
    field by field (the learning rate through keras-rs' own conversion), `LaProp`
    to `LaPropOptimizerSpec` and `FrequencyAwareAdagrad` to `F2AOptimizerSpec`.

    Args:
        updater: a `sparseopt.updaters.SGD` (without momentum), `Adagrad`
            (with the default `epsilon=1e-7`: SparseCore's Adagrad has none),
            `Adam`, `Ftrl`, `AdagradMomentum`, `LaProp` or `FrequencyAwareAdagrad`,
            lazy, without options or
            `ema_momentum`. SparseCore's Adam scales `epsilon` by
            `sqrt(1 - beta_2^t)`; keras-rs maps Keras' Adam to it all the
            same, and so does this.

    Returns:
        A `jax_tpu_embedding` `OptimizerSpec`.

    Raises:
        ImportError: where jax-tpu-embedding is not installed.
        ValueError: for settings SparseCore does not support, and for any
            option (`clipvalue`, `weight_decay`, ...), `lazy=False`,
            `ema_momentum`, `swa_period` or `lookahead_period`, and for rules
            SparseCore lacks.
    """
    extras = sorted(updater.options) + updater.scheduled + (
        ["lazy=False"] if not updater.lazy else []) + (
        ["ema_momentum"] if updater.ema_momentum is not None else []) + (
        ["swa_period"] if updater.swa is not None else []) + (
        ["lookahead_period"] if updater.lookahead is not None else [])
    storage = _storage_settings(updater)
    if storage:
        raise ValueError(
            f"sparseopt: {type(updater).__name__} storage settings {storage}: SparseCore "
            "stores tables and optimizer state in float32 only (nothing to round); remove "
            "them to convert it.")
    if extras:
        raise ValueError(
            f"sparseopt: {type(updater).__name__} settings {extras} have no SparseCore "
            "optimizer spec field here (keras-rs' conversion would drop them); remove them "
            "to convert it.")
    entry = type(updater).sparsecore_spec
    keras_class = type(updater).keras_optimizer
    if entry is None and keras_class is not None and keras_class not in _KERAS_RS_CONVERTS:
        raise ValueError(
            f"sparseopt: {type(updater).__name__} has no SparseCore optimizer spec "
            "(jax-tpu-embedding has SGD, Adagrad, Adam, FTRL, AdagradMomentum, LaProp and "
            "F2A); train this table with one of those on SparseCore, or off it.")
    if entry is not None:
        return getattr(_jte_specs(), entry.spec)(
            learning_rate=_jte_conversion().keras_to_jte_learning_rate(updater.learning_rate),
            **{field: getattr(updater, name) for name, field in entry.fields.items()},
            **entry.fixed)
    return _jte_conversion().keras_to_jte_optimizer(to_keras_optimizer(updater))


def from_sparsecore_spec(spec):
    """The sparseopt updater with a jax-tpu-embedding optimizer spec's rule.

    Args:
        spec: a `jax_tpu_embedding` SGD, Adagrad, Adam, FTRL, AdagradMomentum,
            LaProp or F2A `OptimizerSpec`.

    Returns:
        A `sparseopt.updaters.SGD`, `Adagrad`, `Adam`, `Ftrl`, `AdagradMomentum`,
        `LaProp` or `FrequencyAwareAdagrad`.

    Raises:
        ValueError: for specs with no sparseopt rule (custom ones) and settings
            the updater cannot take.
    """
    for updater_class, entry in _direct_specs():
        if isinstance(spec, getattr(_jte_specs(), entry.spec)):
            other = {k: getattr(spec, k, v) for k, v in entry.fixed.items()
                     if getattr(spec, k, v) != v}
            if other:
                raise ValueError(
                    f"sparseopt: {entry.spec} with {other} has no sparseopt equivalent "
                    f"({entry.why}); use {entry.fixed}.")
            lr = _learning_rate(
                _jte_conversion().jte_to_keras_learning_rate(spec.learning_rate), "")
            return updater_class(lr, **{name: getattr(spec, field)
                                        for name, field in entry.fields.items()})
    return from_keras_optimizer(_jte_conversion().jte_to_keras_optimizer(spec))


def _direct_specs():
    """`[(updater class, its SparseCoreSpec)]`: the rules that map to a spec of their own."""
    return [(cls, cls.sparsecore_spec) for cls in registry().values()
            if cls.sparsecore_spec is not None]


def _jte_specs():
    try:
        from jax_tpu_embedding.sparsecore.lib.nn import embedding_spec
    except ImportError as e:
        raise ImportError(
            "sparseopt: SparseCore optimizer specs need jax-tpu-embedding "
            "(`pip install 'sparseopt[keras-rs,sparsecore]'`, Linux x86-64)."
        ) from e
    return embedding_spec


def _jte_conversion():
    try:
        return compat.sparsecore_config_conversion()
    except ImportError as e:
        raise ImportError(
            "sparseopt: SparseCore optimizer specs need keras-rs and jax-tpu-embedding "
            "(`pip install 'sparseopt[keras-rs,sparsecore]'`, Linux x86-64)."
        ) from e
