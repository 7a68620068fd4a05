"""Plain sparse SGD."""

import keras

from sparseopt.updaters.base import Updater


@keras.saving.register_keras_serializable(package="sparseopt")
class SGD(Updater):
    """Sparse SGD: `w <- w - lr * g` on each touched row.

    Args:
        learning_rate: float or `LearningRateSchedule`.
        name: optional name.
        **options: options every updater takes (e.g. `clipvalue`).
    """

    keras_optimizer = keras.optimizers.SGD

    def __init__(self, learning_rate=0.01, name=None, **options):
        super().__init__(learning_rate, name=name, **options)

    def tf_kernel(self):
        return "sgd"

    def to_keras(self):
        return keras.optimizers.SGD(self.learning_rate)

    @classmethod
    def from_keras(cls, learning_rate, config, where=""):
        if config.get("momentum") or config.get("nesterov"):
            raise ValueError(
                f"sparseopt: SGD momentum/nesterov{where} is not supported for tables "
                "(momentum would have to decay every row each step). Use "
                "keras.optimizers.SGD(learning_rate) or Adagrad."
            )
        return cls(learning_rate)

    def update(self, rows, state, grads, learning_rate, step):
        return rows - learning_rate * grads, {}
