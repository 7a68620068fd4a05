"""Lazy sparse Adamax, in the form of `keras.optimizers.Adamax`."""

import keras
from keras import ops

from sparseopt.updaters.adam import keras_betas, set_betas
from sparseopt.updaters.core.base import SlotSpec, Updater


@keras.saving.register_keras_serializable(package="sparseopt")
class Adamax(Updater):
    """Lazy Adamax: Adam with the infinity norm in place of the second moment.

    On each touched row, with `t` the optimizer's step (1-based, global):

        m <- beta_1 m + (1 - beta_1) g
        u <- max(beta_2 u, |g|)
        w <- w - lr m / ((1 - beta_1^t) (u + epsilon))

    Keras' arithmetic on the touched rows; untouched rows and their state do
    not change (dense Adamax also decays their `m` and `u` and moves them).

    Args:
        learning_rate: float or `LearningRateSchedule`.
        beta_1: decay of the first moment, in `[0, 1)`.
        beta_2: decay of the infinity norm, in `[0, 1)`.
        epsilon: added to `u`, `>= 0`.
        name: optional name.
        **options: options every updater takes (e.g. `clipvalue`).

    Reference: Kingma and Ba, 2015, "Adam: A Method for Stochastic
    Optimization", section 7.1.
    """

    keras_optimizer = keras.optimizers.Adamax
    test_configs = {
        "default": {},
        "betas": {"beta_1": 0.5, "beta_2": 0.9, "epsilon": 1e-3},
    }

    def __init__(self, learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-7,
                 name=None, **options):
        super().__init__(learning_rate, name=name, **options)
        # (beta_1 = 0 still reads `m`, this step's gradient: not fixed.)
        set_betas(self, beta_1, beta_2, epsilon, beta_1_fixed=False)
        self.slots = (SlotSpec("momentum"), SlotSpec("norm"))

    def update(self, rows, state, grads, hp):
        learning_rate, step = hp.learning_rate, hp.step
        t = ops.cast(step, "float32")
        b1, b2 = hp.beta_1, hp.beta_2
        m = b1 * state["momentum"] + (1 - b1) * grads
        u = ops.maximum(b2 * state["norm"], ops.abs(grads))
        step_size = learning_rate / (1 - ops.power(b1, t))
        return (rows - step_size * m / (u + hp.epsilon),
                {"momentum": m, "norm": u})

    def to_keras(self):
        return keras.optimizers.Adamax(self.learning_rate, beta_1=self.beta_1,
                                       beta_2=self.beta_2, epsilon=self.epsilon)

    @classmethod
    def from_keras(cls, learning_rate, config, where=""):
        return cls(learning_rate, **keras_betas(config))
