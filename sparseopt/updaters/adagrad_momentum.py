"""Adagrad with momentum, as TPU embedding's and SparseCore's `AdagradMomentum`."""

import keras
from keras import ops

from sparseopt.updaters.wrappers import catch_up
from sparseopt.updaters.core.base import SlotSpec, SparseCoreSpec, Updater


@keras.saving.register_keras_serializable(package="sparseopt")
class AdagradMomentum(Updater):
    """Adagrad whose scaled gradient feeds a momentum (TPU embedding's form).

    On each touched row:

        a <- a + g^2                  (beta_2 == 1; else a <- beta_2 a + (1 - beta_2) g^2)
        s <- (a + epsilon)^(-1 / exponent) * g
        m <- momentum * m + s
        w <- w - lr * m               (use_nesterov: w <- w - lr * (momentum * m + s))

    Lazy by default: `m` and `a` of a row move only when the row is touched.
    With `lazy=False` a row catches up on its missed steps (momentum, the
    accumulator's `beta_2` decay, decoupled weight decay) in closed form,
    exact for a constant learning rate.

    Args:
        learning_rate: float or `LearningRateSchedule`.
        momentum: `>= 0`.
        use_nesterov: Nesterov momentum.
        exponent: `> 0`; `2` gives Adagrad's square root.
        beta_2: `(0, 1]`; `1` sums squared gradients, as Adagrad.
        epsilon: added to the accumulator inside the root.
        initial_accumulator_value: starting value of `a` (`>= 0`).
        name: optional name.
        **options: options every updater takes (e.g. `clipvalue`).
    """

    sparsecore_spec = SparseCoreSpec(
        "AdagradMomentumOptimizerSpec",
        {"momentum": "momentum", "use_nesterov": "use_nesterov", "exponent": "exponent",
         "beta_2": "beta2", "epsilon": "epsilon",
         "initial_accumulator_value": "initial_accumulator_value"},
        {"initial_momentum_value": 0.0}, "the momentum slot starts at 0")
    test_configs = {
        "default": {"momentum": 0.9},
        "nesterov_beta2": {"momentum": 0.5, "use_nesterov": True, "beta_2": 0.9,
                           "exponent": 4.0, "initial_accumulator_value": 0.1},
        "dense": {"momentum": 0.8, "beta_2": 0.95, "lazy": False, "weight_decay": 0.1},
    }
    missed_steps_read_learning_rate = True

    def __init__(self, learning_rate=0.001, momentum=0.0, use_nesterov=False, exponent=2.0,
                 beta_2=1.0, epsilon=1e-10, initial_accumulator_value=0.0, name=None,
                 **options):
        super().__init__(learning_rate, name=name, **options)
        # Values that decide the step's shape (0: no momentum slot; 2: a
        # square root; 1: Adagrad's sum; epsilon 0 needs a positive initial
        # accumulator) cannot be changed into once built.
        self.hyperparameter("momentum", momentum, lambda v: v >= 0, ">= 0",
                            fixed=lambda v: v == 0)
        self.hyperparameter("exponent", exponent, lambda v: v > 0, "> 0",
                            fixed=lambda v: v == 2.0)
        self.hyperparameter("beta_2", beta_2, lambda v: 0 < v <= 1, "in (0, 1]",
                            fixed=lambda v: v == 1.0)
        self.hyperparameter("epsilon", epsilon, lambda v: v >= 0, ">= 0",
                            fixed=lambda v: v == 0)
        self.hyperparameter("initial_accumulator_value", initial_accumulator_value,
                            lambda v: v >= 0, ">= 0", state=False)
        if initial_accumulator_value == 0 and self.epsilon == 0:
            raise ValueError("AdagradMomentum: `epsilon` and `initial_accumulator_value` are "
                             "both 0: a row's first zero gradient would divide by zero. Set "
                             "either above 0.")
        self.use_nesterov = bool(use_nesterov)
        self.slots = (SlotSpec("accumulator", False, self.initial_accumulator_value),
                      SlotSpec("momentum"))
        # Without momentum the rule never reads `m` (it is this step's `s`).
        self.unread_slots = () if self.momentum else ("momentum",)

    def missed_steps(self, rows, state, steps, decay, hp):
        learning_rate = hp.learning_rate
        # One missed step: a <- beta_2 a; m <- mu m; w <- decay w - lr mu m_old
        # (nesterov: lr mu^2 m_old).
        a = state["accumulator"]
        if self.beta_2 != 1.0:
            a = a * catch_up.power(hp.beta_2, steps)[:, None]
        if not self.momentum:
            return rows * catch_up.power(decay, steps)[:, None], {"accumulator": a}
        mu = hp.momentum
        weight = -learning_rate * (mu * mu if self.use_nesterov else mu)
        rows, m = catch_up.momentum_steps(rows, state["momentum"], steps, decay, mu, weight)
        return rows, {"accumulator": a, "momentum": m}

    def update(self, rows, state, grads, hp):
        learning_rate = hp.learning_rate
        if self.beta_2 == 1.0:  # a constant 1: Adagrad's sum
            a = state["accumulator"] + ops.square(grads)
        else:
            b2 = hp.beta_2
            a = b2 * state["accumulator"] + (1 - b2) * ops.square(grads)
        eps = hp.epsilon
        if self.exponent == 2.0:  # the usual root: rsqrt is much cheaper than pow
            scaled = ops.rsqrt(a + eps) * grads
        else:
            scaled = ops.power(a + eps, -1.0 / hp.exponent) * grads
        if not self.momentum:  # m = s: nothing to keep
            return rows - learning_rate * scaled, {"accumulator": a}
        mu = hp.momentum
        m = mu * state["momentum"] + scaled
        direction = mu * m + scaled if self.use_nesterov else m
        return rows - learning_rate * direction, {"accumulator": a, "momentum": m}

    def get_config(self):
        return {**super().get_config(), "use_nesterov": self.use_nesterov}
