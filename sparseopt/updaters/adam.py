"""Lazy sparse Adam, in the form of `keras.optimizers.Adam`."""

import keras
from keras import ops

from sparseopt.updaters.core.base import SlotSpec, Updater


@keras.saving.register_keras_serializable(package="sparseopt")
class Adam(Updater):
    """Lazy Adam: the moments of a row move only when the row is touched.

    On each touched row, with `t` the optimizer's step (1-based, global:
    the same `t` for every row, as TF's `LazyAdam` and SparseCore count it):

        m <- beta_1 * m + (1 - beta_1) * g
        v <- beta_2 * v + (1 - beta_2) * g^2
        w <- w - lr * sqrt(1 - beta_2^t) / (1 - beta_1^t) * m / (sqrt(v) + epsilon)

    This is `keras.optimizers.Adam`'s arithmetic on the touched rows. It is
    not dense Adam: dense Adam also decays `m` and `v` of untouched rows and
    moves them by their momentum. For AdamW, add the option `weight_decay`
    (decoupled, times the learning rate by default, as `keras.optimizers.AdamW`).

    Args:
        learning_rate: float or `LearningRateSchedule`.
        beta_1: decay of the first moment, in `[0, 1)`.
        beta_2: decay of the second moment, in `[0, 1)`.
        epsilon: added to `sqrt(v)`.
        name: optional name.
        **options: options every updater takes (e.g. `weight_decay`).

    Reference: Kingma and Ba, 2015, "Adam: A Method for Stochastic Optimization".
    """

    keras_optimizer = keras.optimizers.Adam
    test_configs = {
        "default": {},
        "betas": {"beta_1": 0.5, "beta_2": 0.9, "epsilon": 1e-3},
        "ema": {"ema_momentum": 0.8},
    }

    def __init__(self, learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-7,
                 name=None, **options):
        super().__init__(learning_rate, name=name, **options)
        set_betas(self, beta_1, beta_2, epsilon)
        self.slots = (SlotSpec("momentum"), SlotSpec("velocity"))
        self.unread_slots = unread_momentum(self)

    def update(self, rows, state, grads, hp):
        learning_rate, step = hp.learning_rate, hp.step
        t = ops.cast(step, "float32")
        b1, b2 = hp.beta_1, hp.beta_2
        m, moments = first_moment(self, state, grads, b1)
        v = b2 * state["velocity"] + (1 - b2) * ops.square(grads)
        alpha = learning_rate * ops.sqrt(1 - ops.power(b2, t)) / (1 - ops.power(b1, t))
        eps = hp.epsilon
        return rows - alpha * m / (ops.sqrt(v) + eps), {**moments, "velocity": v}

    def to_keras(self):
        return keras.optimizers.Adam(self.learning_rate, beta_1=self.beta_1,
                                     beta_2=self.beta_2, epsilon=self.epsilon)

    @classmethod
    def from_keras(cls, learning_rate, config, where=""):
        if config.get("amsgrad"):
            raise ValueError(
                f"sparseopt: Adam(amsgrad=True){where} is not supported for tables; "
                "use amsgrad=False.")
        return cls(learning_rate, beta_1=config["beta_1"], beta_2=config["beta_2"],
                   epsilon=config["epsilon"])



def set_betas(updater, beta_1, beta_2, epsilon, beta_1_fixed=lambda v: v == 0,
              beta_1_schedule=True):
    """Sets (checked) `beta_1`, `beta_2`, `epsilon` of an Adam-family updater.

    Args:
        beta_1_fixed: as `Updater.hyperparameter`'s `fixed` for `beta_1`. By
            default `beta_1 = 0` (Adam's: no first moment kept, no slot) is
            not a value to change into, or out of, once built.
        beta_1_schedule: whether `beta_1` may be a schedule.
    """
    updater.hyperparameter("beta_1", beta_1, lambda v: 0 <= v < 1, "in [0, 1)",
                           fixed=beta_1_fixed, schedule=beta_1_schedule)
    updater.hyperparameter("beta_2", beta_2, lambda v: 0 <= v < 1, "in [0, 1)")
    updater.hyperparameter("epsilon", epsilon, lambda v: v >= 0, ">= 0")


def moments(state, grads, b1, b2):
    """Adam's moments of the touched rows: `(m, v)` from the `momentum` and `velocity` slots."""
    return (b1 * state["momentum"] + (1 - b1) * grads,
            b2 * state["velocity"] + (1 - b2) * ops.square(grads))


def keras_betas(config):
    """`{beta_1, beta_2, epsilon}` of a Keras Adam-family optimizer's config."""
    return {k: config[k] for k in ("beta_1", "beta_2", "epsilon")}


def unread_momentum(updater):
    """`("momentum",)` where `beta_1 == 0`: the step never reads the first moment then."""
    return () if updater.beta_1 else ("momentum",)


def first_moment(updater, state, grads, b1):
    """`(m, {"momentum": m} or {})`: this step's first moment, and the state to keep."""
    if not updater.beta_1:
        return grads, {}  # b1 == 0: the moment is this step's gradient
    m = b1 * state["momentum"] + (1 - b1) * grads
    return m, {"momentum": m}
