"""Lazy sparse Nadam, in the form of `keras.optimizers.Nadam`."""

import keras
from keras import ops

from sparseopt.updaters.adam import keras_betas, moments, set_betas
from sparseopt.updaters.core.base import SlotSpec, Updater


# 0.5 * 0.96^k is below float32's resolution of 1 from k = 400 on: the
# product's factors past that are 1.
_TERMS = 512


def momentum_schedule(beta_1, t):
    """Nadam's momentum at step `t`: `beta_1 (1 - 0.5 * 0.96^t)` (Keras' form)."""
    return beta_1 * (1.0 - 0.5 * ops.power(0.96, t))


def momentum_product(beta_1, t):
    """`u_1 ... u_t`, as a function of the step (Keras keeps it as a running product).

    `beta_1^t` times the product of `1 - 0.5 * 0.96^k` over `k <= t`, the
    latter a sum of logs over at most `_TERMS` steps: a function of `t`
    alone, so a step the table skips (non-finite gradients) still counts,
    as the step count `t` does.
    """
    k = ops.arange(1, _TERMS + 1, dtype="float32")
    logs = ops.where(k <= t, ops.log1p(-0.5 * ops.power(0.96, k)), 0.0)
    return ops.power(beta_1, t) * ops.exp(ops.sum(logs))


@keras.saving.register_keras_serializable(package="sparseopt")
class Nadam(Updater):
    """Lazy Nadam: Adam with Nesterov momentum and Keras' momentum schedule.

    With `t` the optimizer's step (1-based, global), `u_t = beta_1 (1 - 0.5 * 0.96^t)`
    and `P_t = u_1 ... u_t` (a function of `t`: Keras keeps it as a running
    product), on each touched row:

        m <- beta_1 m + (1 - beta_1) g
        v <- beta_2 v + (1 - beta_2) g^2
        m_hat = u_{t+1} m / (1 - P_t u_{t+1}) + (1 - u_t) g / (1 - P_t)
        w <- w - lr m_hat / (sqrt(v / (1 - beta_2^t)) + epsilon)

    Keras' arithmetic on the touched rows; untouched rows and their moments
    do not change (dense Nadam also decays and applies them). `beta_1` is
    fixed once built (Keras' `Nadam` takes a constant too): the product of
    every step's momentum is computed from it.

    Args:
        learning_rate: float or `LearningRateSchedule`.
        beta_1: decay of the first moment, in `[0, 1)`.
        beta_2: decay of the second moment, in `[0, 1)`.
        epsilon: added to the root of `v`, `>= 0`.
        name: optional name.
        **options: options every updater takes (e.g. `clipvalue`).

    Reference: Dozat, 2016, "Incorporating Nesterov Momentum into Adam".
    """

    keras_optimizer = keras.optimizers.Nadam
    test_configs = {
        "default": {},
        "betas": {"beta_1": 0.5, "beta_2": 0.9, "epsilon": 1e-3},
    }

    def __init__(self, learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-7,
                 name=None, **options):
        super().__init__(learning_rate, name=name, **options)
        # beta_1 fixed: `P_t` is computed from it (a changed one would rewrite the past).
        set_betas(self, beta_1, beta_2, epsilon, beta_1_fixed=True, beta_1_schedule=False)
        self.slots = (SlotSpec("momentum"), SlotSpec("velocity"))

    def update(self, rows, state, grads, hp):
        learning_rate, step = hp.learning_rate, hp.step
        t = ops.cast(step, "float32")
        b1, b2 = hp.beta_1, hp.beta_2
        u_t, u_next = momentum_schedule(b1, t), momentum_schedule(b1, t + 1)
        product = momentum_product(b1, t)  # P_t
        m, v = moments(state, grads, b1, b2)
        m_hat = u_next * m / (1 - product * u_next) + (1 - u_t) * grads / (1 - product)
        v_hat = v / (1 - ops.power(b2, t))
        delta = learning_rate * m_hat / (ops.sqrt(v_hat) + hp.epsilon)
        return rows - delta, {"momentum": m, "velocity": v}

    def to_keras(self):
        return keras.optimizers.Nadam(self.learning_rate, beta_1=self.beta_1,
                                      beta_2=self.beta_2, epsilon=self.epsilon)

    @classmethod
    def from_keras(cls, learning_rate, config, where=""):
        return cls(learning_rate, **keras_betas(config))
