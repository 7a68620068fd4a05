"""FTRL-Proximal, as TensorFlow's `ApplyFtrl` / the TPU embedding API."""

import keras
from keras import ops

from sparseopt.updaters.core.base import SlotSpec, Updater


@keras.saving.register_keras_serializable(package="sparseopt")
class Ftrl(Updater):
    """Sparse FTRL-Proximal with `accumulator` (n) and `linear` (z) slots.

    With `p = -learning_rate_power`, on each touched row:

        n' = n + g^2
        z' = z + g - (n'^p - n^p) / lr * w
        w' = 0 if |z'| <= l1 else (sign(z') l1 - z') / ((n'^p + beta) / lr + 2 l2)

    With `multiply_linear_by_learning_rate=True` the linear slot stores
    `lr * z` (TF's `multiply_linear_by_lr`), which keeps it meaningful when the
    learning rate changes over time:

        z' = z + lr g - (n'^p - n^p) w
        w' = 0 if |z'| <= lr l1 else (sign(z') lr l1 - z') / (n'^p + beta + 2 lr l2)

    Untouched rows are left alone (dense FTRL would recompute them from `z`).

    Args:
        learning_rate: float or `LearningRateSchedule`.
        learning_rate_power: `<= 0`; `-0.5` gives the usual `sqrt`.
        l1_regularization_strength: `>= 0`.
        l2_regularization_strength: `>= 0`.
        beta: `>= 0`, as in TF/Keras FTRL.
        initial_accumulator_value: starting value of `n` (`> 0` unless
            `learning_rate_power == 0`).
        multiply_linear_by_learning_rate: see above.
        name: optional name.
        **options: options every updater takes (e.g. `clipvalue`).

    Reference: McMahan et al., 2013, "Ad Click Prediction: a View from the
    Trenches".
    """

    keras_optimizer = keras.optimizers.Ftrl
    test_configs = {
        "default": {},
        "l1_l2_beta": {"l1_regularization_strength": 0.002, "l2_regularization_strength": 0.05,
                       "beta": 0.3},
        "linear_by_lr": {"l1_regularization_strength": 0.002,
                         "l2_regularization_strength": 0.05, "beta": 0.3,
                         "multiply_linear_by_learning_rate": True},
        "power": {"learning_rate_power": -0.3, "l1_regularization_strength": 0.001,
                  "initial_accumulator_value": 0.2},
        "l1_l2": {"l1_regularization_strength": 0.01, "l2_regularization_strength": 0.01},
    }

    def __init__(self, learning_rate=0.001, learning_rate_power=-0.5,
                 l1_regularization_strength=0.0, l2_regularization_strength=0.0,
                 beta=0.0, initial_accumulator_value=0.1,
                 multiply_linear_by_learning_rate=False, name=None, **options):
        super().__init__(learning_rate, name=name, **options)
        # -0.5 takes a square root instead of a power; 0 allows a zero
        # initial accumulator: each is a kind of step, not a value to change into.
        self.hyperparameter("learning_rate_power", learning_rate_power, lambda v: v <= 0, "<= 0",
                            fixed=lambda v: (v == -0.5, v == 0))
        self.hyperparameter("l1_regularization_strength", l1_regularization_strength,
                            lambda v: v >= 0, ">= 0")
        self.hyperparameter("l2_regularization_strength", l2_regularization_strength,
                            lambda v: v >= 0, ">= 0")
        self.hyperparameter("beta", beta, lambda v: v >= 0, ">= 0")
        self.hyperparameter("initial_accumulator_value", initial_accumulator_value,
                            lambda v: v >= 0, ">= 0", state=False)
        if initial_accumulator_value == 0 and self.learning_rate_power != 0:
            raise ValueError(
                "Ftrl: `initial_accumulator_value=0` with a negative "
                "`learning_rate_power` divides by zero on the first step; use a "
                "positive value such as 0.1."
            )
        self.multiply_linear_by_learning_rate = bool(multiply_linear_by_learning_rate)
        self.slots = (
            SlotSpec("accumulator", False, self.initial_accumulator_value),
            SlotSpec("linear", False, 0.0),
        )

    def _power(self, n, hp):
        if self.learning_rate_power == -0.5:  # a constant -0.5: the usual root
            return ops.sqrt(n)
        return ops.power(n, -hp.learning_rate_power)

    def update(self, rows, state, grads, hp):
        lr = hp.learning_rate
        l1 = hp.l1_regularization_strength
        l2 = hp.l2_regularization_strength
        beta = hp.beta
        n, z = state["accumulator"], state["linear"]
        n_new = n + ops.square(grads)
        delta = self._power(n_new, hp) - self._power(n, hp)
        if self.multiply_linear_by_learning_rate:
            z_new = z + lr * grads - delta * rows
            threshold = lr * l1
            denom = self._power(n_new, hp) + beta + 2.0 * lr * l2
        else:
            z_new = z + grads - delta / lr * rows
            threshold = l1
            denom = (self._power(n_new, hp) + beta) / lr + 2.0 * l2
        # clip(z, -t, t) - z is 0 inside the band and sign(z) t - z outside.
        rows = (ops.clip(z_new, -threshold, threshold) - z_new) / denom
        return rows, {"accumulator": n_new, "linear": z_new}

    def tf_kernel(self):
        # TF's kernel takes beta folded into l2, as Keras' Ftrl does.
        return "ftrl", {"multiply_linear_by_lr": self.multiply_linear_by_learning_rate}

    def to_keras(self):
        if self.multiply_linear_by_learning_rate:
            raise ValueError(
                "sparseopt: Ftrl(multiply_linear_by_learning_rate=True) has no Keras "
                "optimizer equivalent; use the default (False) to convert it."
            )
        return keras.optimizers.Ftrl(
            self.learning_rate, learning_rate_power=self.learning_rate_power,
            initial_accumulator_value=self.initial_accumulator_value,
            l1_regularization_strength=self.l1_regularization_strength,
            l2_regularization_strength=self.l2_regularization_strength, beta=self.beta)

    @classmethod
    def from_keras(cls, learning_rate, config, where=""):
        if config.get("l2_shrinkage_regularization_strength"):
            raise ValueError(
                f"sparseopt: Ftrl `l2_shrinkage_regularization_strength`{where} is not "
                "supported; use `l2_regularization_strength`."
            )
        return cls(learning_rate, learning_rate_power=config["learning_rate_power"],
                   l1_regularization_strength=config["l1_regularization_strength"],
                   l2_regularization_strength=config["l2_regularization_strength"],
                   beta=config["beta"],
                   initial_accumulator_value=config["initial_accumulator_value"])

    def get_config(self):
        return {**super().get_config(),
                "multiply_linear_by_learning_rate": self.multiply_linear_by_learning_rate}
