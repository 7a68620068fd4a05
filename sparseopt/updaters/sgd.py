"""Sparse SGD, with optional momentum, in the form of `keras.optimizers.SGD`."""

import keras

from sparseopt.updaters.wrappers import catch_up
from sparseopt.updaters.core.base import SlotSpec, Updater


@keras.saving.register_keras_serializable(package="sparseopt")
class SGD(Updater):
    """Sparse SGD: `w <- w - lr * g` on each touched row.

    With `momentum > 0` (Keras' form, one `momentum` slot of the table's shape):

        m <- momentum * m - lr * g
        w <- w + m                          (nesterov: w <- w + momentum * m - lr * g)

    Lazy by default: a row's momentum moves only when the row is touched, so
    an untouched row neither drifts nor decays (dense Keras SGD keeps moving
    every row with its momentum). With `lazy=False` a row catches up on the
    steps it missed when it is next touched (momentum and decoupled weight
    decay in closed form), which is dense Keras SGD for constant
    hyperparameters.

    Args:
        learning_rate: float or `LearningRateSchedule`.
        momentum: `>= 0`, `0` for plain SGD (no state).
        nesterov: Nesterov momentum (needs `momentum > 0`).
        name: optional name.
        **options: options every updater takes (e.g. `clipvalue`).
    """

    keras_optimizer = keras.optimizers.SGD
    test_configs = {
        "default": {},
        "momentum": {"momentum": 0.9},
        "nesterov": {"momentum": 0.5, "nesterov": True},
        "dense_momentum_decay": {"momentum": 0.9, "weight_decay": 0.2, "lazy": False},
    }

    def __init__(self, learning_rate=0.01, momentum=0.0, nesterov=False, name=None, **options):
        super().__init__(learning_rate, name=name, **options)
        # 0: no momentum slot (and TF's plain scatter): not a value to change into.
        self.hyperparameter("momentum", momentum, lambda v: 0 <= v < 1, "in [0, 1)",
                            fixed=lambda v: v == 0)
        if nesterov and not self.momentum:
            raise ValueError("SGD: `nesterov=True` needs `momentum > 0`.")
        self.nesterov = bool(nesterov)
        self.slots = (SlotSpec("momentum"),) if self.momentum else ()

    def tf_kernel(self):
        # ResourceSparseApplyKerasMomentum is this rule exactly (Keras' form).
        return ("keras_momentum", {"use_nesterov": self.nesterov}) if self.momentum else "sgd"

    def to_keras(self):
        return keras.optimizers.SGD(self.learning_rate, momentum=self.momentum,
                                    nesterov=self.nesterov)

    @classmethod
    def from_keras(cls, learning_rate, config, where=""):
        return cls(learning_rate, momentum=config.get("momentum", 0.0),
                   nesterov=config.get("nesterov", False))

    def missed_steps(self, rows, state, steps, decay, hp):
        if not self.momentum:
            return catch_up.decay_only(self, rows, state, steps, decay, hp)
        # One missed step: m <- mu m; w <- decay w + mu m_old (nesterov: mu^2 m_old).
        mu = hp.momentum
        weight = mu * mu if self.nesterov else mu
        rows, m = catch_up.momentum_steps(rows, state["momentum"], steps, decay, mu, weight)
        return rows, {"momentum": m}

    def update(self, rows, state, grads, hp):
        learning_rate = hp.learning_rate
        if not self.momentum:
            return rows - learning_rate * grads, {}
        mu = hp.momentum
        m = mu * state["momentum"] - learning_rate * grads
        if self.nesterov:
            return rows + mu * m - learning_rate * grads, {"momentum": m}
        return rows + m, {"momentum": m}

    def get_config(self):
        return {**super().get_config(), "nesterov": self.nesterov}
