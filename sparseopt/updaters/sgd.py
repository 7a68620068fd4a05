"""Plain sparse SGD."""

import keras

from sparseopt.updaters.base import Updater


@keras.saving.register_keras_serializable(package="sparseopt")
class SGD(Updater):
    """Sparse SGD: `w <- w - lr * g` on each touched row.

    Args:
        learning_rate: float or `LearningRateSchedule`.
        name: optional name.
    """

    def __init__(self, learning_rate=0.01, name=None):
        super().__init__(learning_rate, name=name)

    def update(self, rows, state, grads, learning_rate, step):
        return rows - learning_rate * grads, {}
