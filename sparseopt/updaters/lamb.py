"""Lazy sparse LAMB with a trust ratio per row, in the form of `keras.optimizers.Lamb`."""

import keras
from keras import ops

from sparseopt.updaters.adam import keras_betas, moments, set_betas
from sparseopt.updaters.core.base import SlotSpec, Updater


def trust_ratio(rows, update):
    """Per row, `||w|| / ||update||` where both are positive, else 1 (`[U, 1]`)."""
    w_norm = ops.sqrt(ops.sum(ops.square(rows), axis=-1, keepdims=True))
    u_norm = ops.sqrt(ops.sum(ops.square(update), axis=-1, keepdims=True))
    both = ops.logical_and(ops.greater(w_norm, 0), ops.greater(u_norm, 0))
    return ops.where(both, w_norm / ops.where(both, u_norm, 1.0), 1.0)


@keras.saving.register_keras_serializable(package="sparseopt")
class Lamb(Updater):
    """Lazy LAMB: Adam's step scaled per row by the row's norm over the step's norm.

    On each touched row, with `t` the optimizer's step (1-based, global):

        m <- beta_1 m + (1 - beta_1) g
        v <- beta_2 v + (1 - beta_2) g^2
        r  = (m / (1 - beta_1^t)) / (sqrt(v / (1 - beta_2^t)) + epsilon)
        w <- w - lr (||w|| / ||r||) r         (ratio 1 where either norm is 0)

    The trust ratio is taken **per row** (each embedding row is its own
    "layer", as FBGEMM's LAMB for embedding tables does): Keras' `Lamb` takes
    it over the whole variable, which on a table would read every row every
    step. So `keras.optimizers.Lamb` converts to this rule and back, and on a
    table it means each row's ratio; it equals Keras' `Lamb` applied to each
    row as a variable of its own. Weight decay, where set (`weight_decay`
    option), is decoupled and applied before the rule, as Keras' `Lamb`
    applies its own (FBGEMM adds `lambda w` inside `r` instead).

    Args:
        learning_rate: float or `LearningRateSchedule`.
        beta_1: decay of the first moment, in `[0, 1)`.
        beta_2: decay of the second moment, in `[0, 1)`.
        epsilon: added to the root of `v`, `>= 0`.
        name: optional name.
        **options: options every updater takes (e.g. `weight_decay`).

    Reference: You et al., 2020, "Large Batch Optimization for Deep
    Learning: Training BERT in 76 minutes".
    """

    keras_optimizer = keras.optimizers.Lamb
    test_configs = {
        "default": {},
        "betas": {"beta_1": 0.5, "beta_2": 0.9, "epsilon": 1e-3},
    }

    def __init__(self, learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-7,
                 name=None, **options):
        super().__init__(learning_rate, name=name, **options)
        set_betas(self, beta_1, beta_2, epsilon, beta_1_fixed=False)
        self.slots = (SlotSpec("momentum"), SlotSpec("velocity"))

    def update(self, rows, state, grads, hp):
        learning_rate, step = hp.learning_rate, hp.step
        t = ops.cast(step, "float32")
        b1, b2 = hp.beta_1, hp.beta_2
        m, v = moments(state, grads, b1, b2)
        r = (m / (1 - ops.power(b1, t))) / (ops.sqrt(v / (1 - ops.power(b2, t)))
                                            + hp.epsilon)
        return rows - learning_rate * trust_ratio(rows, r) * r, {"momentum": m, "velocity": v}

    def to_keras(self):
        return keras.optimizers.Lamb(self.learning_rate, beta_1=self.beta_1,
                                     beta_2=self.beta_2, epsilon=self.epsilon)

    @classmethod
    def from_keras(cls, learning_rate, config, where=""):
        return cls(learning_rate, **keras_betas(config))
