"""`DispatchOptimizer`: dense variables to a Keras optimizer, tables to updaters.

The class is assembled from its parts, one module each: `controls.py` (the
settings a user changes), `routes.py` (building: where each variable goes, the
tables' trainers), `steps.py` (applying a step), `checkpoints.py` (what a file
holds), `end_of_fit.py` (whole-table work between steps). Here: what it takes
(and takes over from the wrapped optimizer) and its config.
"""

import keras

from sparseopt import backend
from sparseopt.optimizer import checks
from sparseopt.optimizer.checkpoints import Checkpoints
from sparseopt.optimizer.controls import Controls
from sparseopt.optimizer.end_of_fit import EndOfFit
from sparseopt.optimizer.routes import Routes
from sparseopt.optimizer.steps import Steps


@keras.saving.register_keras_serializable(package="sparseopt")
class DispatchOptimizer(Controls, Routes, Steps, Checkpoints, EndOfFit,
                        keras.optimizers.Optimizer):
    """Routes each variable to the optimizer or sparse updater meant for it.

    When built, it collects the updaters that layers declare in
    `variable_path_to_optimizer_map` (and those given in `optimizer_map`).
    Declared tables are updated in place on their touched rows only; every
    other variable goes to `optimizer` (or to the Keras optimizer that
    `optimizer_map` names for it), which creates slots for those variables
    only.

    Loss scaling (`loss_scale_factor`, `keras.optimizers.LossScaleOptimizer`)
    reaches the tables: they see the true gradient, and a step skipped for
    non-finite gradients leaves them untouched. `global_clipnorm` is one norm
    over the dense gradients and the tables' (`sparseopt.clipping`). Keras'
    learning-rate callbacks reach the tables in proportion (each updater's
    `follow_learning_rate`), and every updater hyperparameter can change
    between steps (`sparseopt.updaters.core.hyperparameters`).
    `exclude_from_weight_decay` applies to the dense optimizers and to the
    tables' `weight_decay`. The wrapped optimizer's `clipnorm`, `clipvalue`,
    `weight_decay` and `use_ema` act on dense variables only (each updater
    has its own).

    With `group_tables=True`, tables with the same width, dtype and updater
    configuration are updated together (`sparseopt.engine.group.TableGroup`:
    one dedup pass for all of them), with the results, state and checkpoints
    of updating each alone.

    Under a `keras.distribution` (JAX), each table's state is split like the
    table, and a table split by rows is updated on each shard, in place (see
    `sparseopt.distribution`). Under a TensorFlow `MirroredStrategy`, every
    replica gathers the row gradients of all replicas and applies the same
    update to its own copy of each table; other TF strategies are refused.

    Args:
        optimizer: the Keras optimizer (instance or name) for dense variables.
        optimizer_map: optional dict from variable path (exact, else a regex
            matched with `re.fullmatch`, as in `keras.optimizers.OptimizerMap`)
            to a Keras optimizer or a `sparseopt.updaters.Updater`. It overrides
            what layers declare.
        group_tables: update tables that share width, dtype and updater
            configuration in one dedup pass (same results). Off by default:
            on CPU it is slower today at production shapes (one large dedup
            is costlier than many small ones; see docs/design.md).
        name: optional name.
        global_clipnorm: clip all gradients, dense and tables', by one
            norm over all of them (Keras' `global_clipnorm` on the same model
            trained densely). A `global_clipnorm` on `optimizer` means the
            same (it is moved here).
        gradient_accumulation_steps: apply the mean gradient of this many
            micro-batches once (Keras' `gradient_accumulation_steps`, tables
            included, `sparseopt.accumulation`). On `optimizer` it means the
            same (it is moved here).
        accumulation_ids_per_step: `{table path: ids per step}`, the size of
            each table's accumulation buffers. Found from the first batch
            when built, and kept in the config (a loaded model rebuilds its
            buffers from it); give it only to build without a batch.
        loss_scale_factor: as Keras optimizers' (default: `optimizer`'s).
        learning_rate_reference: the wrapped rate tables' rates are in
            proportion to (`learning_rate_scale`); default: the wrapped
            optimizer's rate now. Kept in the config, so an optimizer made
            from it (a clone, a loaded model) keeps the proportion.
    """

    def __init__(self, optimizer, optimizer_map=None, group_tables=False, name=None,
                 accumulation_ids_per_step=None, learning_rate_reference=None, **kwargs):
        optimizer = keras.optimizers.get(optimizer)
        if isinstance(optimizer, (DispatchOptimizer, keras.optimizers.LossScaleOptimizer)):
            raise ValueError(
                "DispatchOptimizer: wrap a plain Keras optimizer. To scale the loss, "
                "wrap the DispatchOptimizer instead: "
                "`LossScaleOptimizer(DispatchOptimizer(Adam()))`."
            )
        checks.dispatch_arguments(kwargs)
        if optimizer.global_clipnorm:
            # One norm over everything, taken here (the wrapped optimizer
            # would clip the dense gradients by their own norm only).
            given = kwargs.get("global_clipnorm")
            if given and given != optimizer.global_clipnorm:
                raise ValueError(
                    f"DispatchOptimizer: global_clipnorm={given} and the wrapped "
                    f"optimizer's global_clipnorm={optimizer.global_clipnorm} differ; set one.")
            kwargs["global_clipnorm"] = optimizer.global_clipnorm
            optimizer.global_clipnorm = None
        if optimizer.gradient_accumulation_steps:
            # Accumulated here, tables and dense variables alike (`sparseopt.accumulation`).
            given = kwargs.get("gradient_accumulation_steps")
            if given and given != optimizer.gradient_accumulation_steps:
                raise ValueError(
                    f"DispatchOptimizer: gradient_accumulation_steps={given} and the "
                    "wrapped optimizer's gradient_accumulation_steps="
                    f"{optimizer.gradient_accumulation_steps} differ; set one.")
            kwargs["gradient_accumulation_steps"] = optimizer.gradient_accumulation_steps
            optimizer.gradient_accumulation_steps = None
        loss_scale_factor = kwargs.pop("loss_scale_factor", optimizer.loss_scale_factor)
        # The rate the user gave: tables follow the wrapped rate in proportion
        # to it (`learning_rate_scale`). Read now, not when built: a rate set
        # between compile and fit, or by a callback before the first step
        # (TensorFlow builds inside that step), is a change tables must see.
        given_rate = (_constant_rate(optimizer) if learning_rate_reference is None
                      else float(learning_rate_reference))
        super().__init__(learning_rate=0.0, name=name, **kwargs)
        self._given_rate = given_rate
        self._default_optimizer = optimizer
        self._accumulator = None  # gradient accumulation's buffers, once built
        self.accumulation_ids_per_step = dict(accumulation_ids_per_step or {})
        self.group_tables = bool(group_tables)
        self._optimizer_map = {}
        for key, value in (optimizer_map or {}).items():
            if isinstance(value, dict):
                value = keras.saving.deserialize_keras_object(value)
            checks.assigned(value, f"optimizer_map['{key}']")
            self._optimizer_map[key] = value
        # Each Keras optimizer once, however many entries name it: it builds
        # slots for the union of its variables and steps them once per step.
        self._dense_optimizers = [optimizer]
        for value in self._optimizer_map.values():
            self._add_dense_optimizer(value)
        # One loss scale for everything, as MultiOptimizer does.
        self.loss_scale_factor = loss_scale_factor

    @staticmethod
    def of(model_or_optimizer):
        """The `DispatchOptimizer` that trains a model, through any loss-scaling wrapper.

        Under `mixed_float16` Keras wraps the compiled optimizer in a
        `keras.optimizers.LossScaleOptimizer`, so `model.optimizer` has no
        `skipped_steps()`, `table_state()`, ...: this finds ours either way
        (`model.optimizer.inner_optimizer` is the same object).

        Args:
            model_or_optimizer: a compiled `keras.Model`, a `DispatchOptimizer`,
                or a `LossScaleOptimizer` wrapping one.

        Raises:
            ValueError: no `DispatchOptimizer` trains it.
        """
        optimizer = model_or_optimizer
        if isinstance(optimizer, keras.Model):
            optimizer = optimizer.optimizer
        inner = getattr(optimizer, "inner_optimizer", optimizer)
        if not isinstance(inner, DispatchOptimizer):
            raise ValueError(
                f"DispatchOptimizer.of: {model_or_optimizer!r} is not trained by a "
                f"sparseopt.DispatchOptimizer (found {optimizer!r}). Compile with "
                "`optimizer=sparseopt.DispatchOptimizer(<your Keras optimizer>)`.")
        return inner

    def get_config(self):
        extra = {k: getattr(self, k) for k in ("global_clipnorm", "gradient_accumulation_steps",
                                               "accumulation_ids_per_step") if getattr(self, k)}
        if self._given_rate is not None:
            extra["learning_rate_reference"] = self._given_rate
        return {
            **extra,
            "name": self.name,
            "group_tables": self.group_tables,
            "optimizer": keras.saving.serialize_keras_object(self._default_optimizer),
            "optimizer_map": {
                k: keras.saving.serialize_keras_object(v)
                for k, v in self._optimizer_map.items()
            },
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        config["optimizer"] = keras.saving.deserialize_keras_object(
            config["optimizer"], custom_objects=custom_objects
        )
        return cls(**config)


def _constant_rate(optimizer):
    """The constant learning rate of a Keras optimizer now (a float), or None for a schedule.

    Args:
        optimizer: a Keras optimizer.
    """
    rate = optimizer.learning_rate
    if not isinstance(rate, keras.Variable):
        return None
    with backend.outside_trace():
        return float(rate.numpy())  # (a mirrored variable's `.value` is per replica)
