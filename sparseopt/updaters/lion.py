"""Lazy sparse Lion, in the form of `keras.optimizers.Lion`."""

import keras
from keras import ops

from sparseopt.updaters.core.base import SlotSpec, Updater


@keras.saving.register_keras_serializable(package="sparseopt")
class Lion(Updater):
    """Lazy Lion: each entry moves by the learning rate, in the direction of a sign.

    On each touched row (Keras' arithmetic):

        w <- w - lr sign(beta_1 m + (1 - beta_1) g)
        m <- beta_2 m + (1 - beta_2) g

    One slot, the momentum `m` (4 bytes an entry). Untouched rows and their
    momentum do not change (dense Lion keeps moving every row by the sign of
    its momentum). Lion's steps are all of size `lr`: use a learning rate
    3-10x smaller than Adam's.

    Args:
        learning_rate: float or `LearningRateSchedule`.
        beta_1: weight of the momentum in the step's sign, in `[0, 1]`.
        beta_2: decay of the momentum, in `[0, 1)`.
        name: optional name.
        **options: options every updater takes (e.g. `weight_decay`).

    Reference: Chen et al., 2023, "Symbolic Discovery of Optimization
    Algorithms".
    """

    keras_optimizer = keras.optimizers.Lion
    test_configs = {
        "default": {},
        "betas": {"beta_1": 0.5, "beta_2": 0.9},
    }

    def __init__(self, learning_rate=0.001, beta_1=0.9, beta_2=0.99, name=None, **options):
        super().__init__(learning_rate, name=name, **options)
        self.hyperparameter("beta_1", beta_1, lambda v: 0 <= v <= 1, "in [0, 1]")
        self.hyperparameter("beta_2", beta_2, lambda v: 0 <= v < 1, "in [0, 1)")
        self.slots = (SlotSpec("momentum"),)

    def update(self, rows, state, grads, hp):
        learning_rate = hp.learning_rate
        b1, b2 = hp.beta_1, hp.beta_2
        m = state["momentum"]
        direction = ops.sign(b1 * m + (1 - b1) * grads)
        return rows - learning_rate * direction, {"momentum": b2 * m + (1 - b2) * grads}

    def to_keras(self):
        return keras.optimizers.Lion(self.learning_rate, beta_1=self.beta_1, beta_2=self.beta_2)

    @classmethod
    def from_keras(cls, learning_rate, config, where=""):
        return cls(learning_rate, beta_1=config["beta_1"], beta_2=config["beta_2"])
