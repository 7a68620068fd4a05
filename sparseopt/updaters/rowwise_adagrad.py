"""Row-wise Adagrad: one accumulator scalar per row (FBGEMM EXACT_ROWWISE_ADAGRAD)."""

import keras
from keras import ops

from sparseopt.updaters.wrappers import catch_up
from sparseopt.updaters.core.base import SlotSpec, Updater


@keras.saving.register_keras_serializable(package="sparseopt")
class RowwiseAdagrad(Updater):
    """Adagrad with a single accumulator per row: state `V` instead of `V * D`.

    On each touched row:

        G <- G + mean_d(g_d^2)
        w <- w - lr * g / (sqrt(G) + epsilon)

    Args:
        learning_rate: float or `LearningRateSchedule`.
        initial_accumulator_value: starting value of `G` (>= 0).
        epsilon: added to `sqrt(G)`.
        name: optional name.
        **options: options every updater takes (e.g. `clipvalue`).
    """

    test_configs = {
        "default": {"initial_accumulator_value": 0.0, "epsilon": 1e-8},
        "init": {"initial_accumulator_value": 0.5, "epsilon": 1e-3},
        "small_init": {"initial_accumulator_value": 0.05},
        "ema": {"ema_momentum": 0.9},
    }

    def __init__(self, learning_rate=0.01, initial_accumulator_value=0.0,
                 epsilon=1e-8, name=None, **options):
        super().__init__(learning_rate, name=name, **options)
        self.hyperparameter("initial_accumulator_value", initial_accumulator_value,
                            lambda v: v >= 0, ">= 0", state=False)
        self.hyperparameter("epsilon", epsilon, lambda v: v >= 0, ">= 0")
        self.slots = (SlotSpec("accumulator", True, self.initial_accumulator_value),)

    missed_steps = catch_up.decay_only  # a zero gradient leaves row and accumulator

    def update(self, rows, state, grads, hp):
        learning_rate = hp.learning_rate
        acc = state["accumulator"] + ops.mean(ops.square(grads), axis=-1)
        scale = learning_rate / (ops.sqrt(acc) + hp.epsilon)
        return rows - scale[:, None] * grads, {"accumulator": acc}
