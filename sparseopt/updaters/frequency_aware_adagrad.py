"""Frequency-aware Adagrad (F2A), as SparseCore's (jax-tpu-embedding) `F2AOptimizerSpec`."""

import keras
from keras import ops

from sparseopt.updaters.core.base import SlotSpec, SparseCoreSpec, Updater


@keras.saving.register_keras_serializable(package="sparseopt")
class FrequencyAwareAdagrad(Updater):
    """Adagrad whose step grows for rows seen rarely (SparseCore's F2A).

    Each row counts the steps that touched it (`local_step`). On each touched
    row, with `s` the optimizer's iteration (0-based, the same for every row):

        n    <- n + 1                                   (local_step)
        f    = min((max(s, 1) / n)^rho, max_lr_multiplier)
        acc  <- acc + g^2
        w    <- w - lr (f g / sqrt(acc) + l1 sign(w) + l2 w)

    A row touched on every step has `f` close to 1 (plain Adagrad); a row
    touched once in a thousand steps gets up to `1000^rho` times the step.
    The count is one int32 per row (SparseCore keeps a float per entry).

    Args:
        learning_rate: float or `LearningRateSchedule`.
        rho: `>= 0`, how strongly rarity boosts the step (0: Adagrad without epsilon).
        initial_accumulator_value: starting value of `acc` (`> 0`).
        l1_regularization_strength: `>= 0`.
        l2_regularization_strength: `>= 0`.
        max_lr_multiplier: `>= 1`, the cap on `f`.
        name: optional name.
        **options: options every updater takes (e.g. `clipvalue`).
    """

    sparsecore_spec = SparseCoreSpec(
        "F2AOptimizerSpec",
        {"rho": "rho", "initial_accumulator_value": "initial_accumulator_value",
         "l1_regularization_strength": "l1_regularization_strength",
         "l2_regularization_strength": "l2_regularization_strength",
         "max_lr_multiplier": "max_lr_multiplier"},
        {"initial_local_step_value": 0.0}, "each row's count starts at 0")
    test_configs = {
        "default": {},
        "boost": {"rho": 0.8, "initial_accumulator_value": 0.05,
                  "l1_regularization_strength": 0.001, "l2_regularization_strength": 0.01,
                  "max_lr_multiplier": 4.0},
    }

    def __init__(self, learning_rate=0.01, rho=0.5, initial_accumulator_value=0.1,
                 l1_regularization_strength=0.0, l2_regularization_strength=0.0,
                 max_lr_multiplier=1e6, name=None, **options):
        super().__init__(learning_rate, name=name, **options)
        self.hyperparameter("rho", rho, lambda v: v >= 0, ">= 0")
        self.hyperparameter("l1_regularization_strength", l1_regularization_strength,
                            lambda v: v >= 0, ">= 0")
        self.hyperparameter("l2_regularization_strength", l2_regularization_strength,
                            lambda v: v >= 0, ">= 0")
        self.hyperparameter("max_lr_multiplier", max_lr_multiplier, lambda v: v >= 1, ">= 1")
        self.hyperparameter("initial_accumulator_value", initial_accumulator_value,
                            lambda v: v > 0, "> 0 (it divides the first step)", state=False)
        self.slots = (SlotSpec("accumulator", False, self.initial_accumulator_value),
                      SlotSpec("local_step", rowwise=True, initial_value=0, dtype="int32"))

    def update(self, rows, state, grads, hp):
        learning_rate, step = hp.learning_rate, hp.step
        seen = state["local_step"] + 1
        iteration = ops.maximum(ops.cast(step, "float32") - 1.0, 1.0)
        boost = ops.minimum(ops.power(iteration / ops.cast(seen, "float32"),
                                      hp.rho),
                            hp.max_lr_multiplier)
        acc = state["accumulator"] + ops.square(grads)
        direction = (boost[:, None] * grads * ops.rsqrt(acc)
                     + hp.l1_regularization_strength * ops.sign(rows)
                     + hp.l2_regularization_strength * rows)
        return rows - learning_rate * direction, {"accumulator": acc, "local_step": seen}
