"""Sparse Adagrad, in the form of `keras.optimizers.Adagrad`."""

import keras
from keras import ops

from sparseopt.updaters.wrappers import catch_up
from sparseopt.updaters.core.base import SlotSpec, Updater


@keras.saving.register_keras_serializable(package="sparseopt")
class Adagrad(Updater):
    """Sparse Adagrad with one accumulator entry per table entry.

    On each touched row (Keras 3 form, epsilon inside the root):

        acc <- acc + g^2
        w   <- w - lr * g / sqrt(acc + epsilon)

    Untouched rows keep their value and accumulator, so the result equals
    `keras.optimizers.Adagrad` applied densely.

    Args:
        learning_rate: float or `LearningRateSchedule`.
        initial_accumulator_value: starting value of the accumulator (>= 0).
        epsilon: small constant added inside the square root.
        name: optional name.
        **options: options every updater takes (e.g. `clipvalue`).

    Reference: Duchi et al., 2011, "Adaptive Subgradient Methods".
    """

    keras_optimizer = keras.optimizers.Adagrad
    test_configs = {
        "default": {"initial_accumulator_value": 0.1, "epsilon": 1e-7},
        "no_epsilon": {"initial_accumulator_value": 0.2, "epsilon": 0.0},  # TF's kernel
        "dense_decay": {"weight_decay": 0.3, "lazy": False},
    }

    def __init__(self, learning_rate=0.001, initial_accumulator_value=0.1,
                 epsilon=1e-7, name=None, **options):
        super().__init__(learning_rate, name=name, **options)
        self.hyperparameter("initial_accumulator_value", initial_accumulator_value,
                            lambda v: v >= 0, ">= 0", state=False)
        # 0 selects TF's fused kernel (its form differs for other values).
        self.hyperparameter("epsilon", epsilon, lambda v: v >= 0, ">= 0",
                            fixed=lambda v: v == 0)
        self.slots = (SlotSpec("accumulator", False, self.initial_accumulator_value),)

    missed_steps = catch_up.decay_only  # a zero gradient leaves row and accumulator

    def update(self, rows, state, grads, hp):
        learning_rate = hp.learning_rate
        acc = state["accumulator"] + ops.square(grads)
        rows = rows - learning_rate * grads / ops.sqrt(acc + hp.epsilon)
        return rows, {"accumulator": acc}

    def tf_kernel(self):
        # ApplyAdagradV2 divides by sqrt(acc) + epsilon: the Keras form
        # sqrt(acc + epsilon) exactly only when epsilon is 0.
        return "adagrad" if self.epsilon == 0.0 else None

    def to_keras(self):
        return keras.optimizers.Adagrad(
            self.learning_rate, initial_accumulator_value=self.initial_accumulator_value,
            epsilon=self.epsilon)

    @classmethod
    def from_keras(cls, learning_rate, config, where=""):
        return cls(learning_rate, initial_accumulator_value=config["initial_accumulator_value"],
                   epsilon=config["epsilon"])
