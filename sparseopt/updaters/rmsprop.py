"""Lazy sparse RMSprop, in the form of `keras.optimizers.RMSprop`."""

import keras
from keras import ops

from sparseopt.updaters.wrappers import catch_up
from sparseopt.updaters.core.base import SlotSpec, Updater


@keras.saving.register_keras_serializable(package="sparseopt")
class RMSprop(Updater):
    """Lazy RMSprop: a row's running averages move only when the row is touched.

    On each touched row (Keras' arithmetic):

        v <- rho v + (1 - rho) g^2
        a <- rho a + (1 - rho) g                  (centered only)
        s  = lr g / sqrt(v - a^2 + epsilon)       (not centered: sqrt(v + epsilon))
        m <- momentum m + s;  w <- w - m          (momentum > 0; else w <- w - s)

    Dense Keras RMSprop also decays `v` (and `a`, and moves `w` by `m`) on
    rows no batch touches; here untouched rows and their state do not change
    (as `Adam` is lazy Adam). With `lazy=False` a row catches up on the steps
    it missed when next touched (its averages decay by `rho^k`, its momentum
    moves it on, in closed form): dense Keras RMSprop for constant
    hyperparameters.

    Args:
        learning_rate: float or `LearningRateSchedule`.
        rho: decay of the averages, in `[0, 1)`.
        momentum: `>= 0`; 0 keeps no momentum slot.
        epsilon: added under the square root, `>= 0`.
        centered: also keep the average gradient `a` and divide by the
            estimated variance instead of the second moment.
        name: optional name.
        **options: options every updater takes (e.g. `clipvalue`).

    Reference: Hinton, 2012, "Neural Networks for Machine Learning", lecture 6e.
    """

    keras_optimizer = keras.optimizers.RMSprop
    test_configs = {
        "default": {},
        "momentum": {"rho": 0.8, "momentum": 0.5, "epsilon": 1e-3},
        "centered": {"centered": True, "momentum": 0.3},
        "dense_momentum_decay": {"centered": True, "momentum": 0.6, "weight_decay": 0.2,
                                 "lazy": False},
    }

    def __init__(self, learning_rate=0.001, rho=0.9, momentum=0.0, epsilon=1e-7,
                 centered=False, name=None, **options):
        super().__init__(learning_rate, name=name, **options)
        self.hyperparameter("rho", rho, lambda v: 0 <= v < 1, "in [0, 1)")
        self.hyperparameter("momentum", momentum, lambda v: 0 <= v < 1, "in [0, 1)",
                            fixed=lambda v: v == 0)
        self.hyperparameter("epsilon", epsilon, lambda v: v >= 0, ">= 0")
        self.centered = bool(centered)
        slots = [SlotSpec("velocity")]
        if self.momentum:
            slots.append(SlotSpec("momentum"))
        if self.centered:
            slots.append(SlotSpec("average_gradient"))
        self.slots = tuple(slots)

    def missed_steps(self, rows, state, steps, decay, hp):
        # A zero gradient adds nothing but decays the averages; the momentum
        # still moves the row: m <- mu m; w <- decay w - mu m_old.
        fade = catch_up.power(hp.rho, steps)[:, None]
        new = {name: state[name] * fade for name in ("velocity", "average_gradient")
               if name in state}
        if not self.momentum:
            return catch_up.decay_only(self, rows, state, steps, decay, hp)[0], new
        mu = hp.momentum
        rows, m = catch_up.momentum_steps(rows, state["momentum"], steps, decay, mu, -mu)
        return rows, {**new, "momentum": m}

    def update(self, rows, state, grads, hp):
        learning_rate = hp.learning_rate
        rho, eps = hp.rho, hp.epsilon
        v = rho * state["velocity"] + (1 - rho) * ops.square(grads)
        new = {"velocity": v}
        if self.centered:
            a = rho * state["average_gradient"] + (1 - rho) * grads
            new["average_gradient"] = a
            denominator = v - ops.square(a) + eps
        else:
            denominator = v + eps
        increment = learning_rate * grads / ops.sqrt(denominator)
        if not self.momentum:
            return rows - increment, new
        m = hp.momentum * state["momentum"] + increment
        return rows - m, {**new, "momentum": m}

    def to_keras(self):
        return keras.optimizers.RMSprop(self.learning_rate, rho=self.rho,
                                        momentum=self.momentum, epsilon=self.epsilon,
                                        centered=self.centered)

    @classmethod
    def from_keras(cls, learning_rate, config, where=""):
        return cls(learning_rate, rho=config["rho"], momentum=config["momentum"],
                   epsilon=config["epsilon"], centered=config["centered"])

    def get_config(self):
        return {**super().get_config(), "centered": self.centered}
