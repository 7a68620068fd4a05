"""Partial row-wise Adam: FBGEMM's PARTIAL_ROWWISE_ADAM."""

import keras
from keras import ops

from sparseopt.updaters.adam import first_moment, set_betas, unread_momentum
from sparseopt.updaters.core.base import SlotSpec, Updater


@keras.saving.register_keras_serializable(package="sparseopt")
class PartialRowwiseAdam(Updater):
    """Adam with the first moment per entry and the second per row (FBGEMM's form).

    State per row: `D + 1` floats instead of Adam's `2 D`. On each touched
    row, with `t` the optimizer's step (1-based, global):

        m <- beta_1 * m + (1 - beta_1) * g                  (per entry)
        v <- beta_2 * v + (1 - beta_2) * mean_d(g_d^2)      (per row)
        w <- w - lr * (m / (1 - beta_1^t)) / (sqrt(v / (1 - beta_2^t)) + epsilon)

    Bias correction divides the moments themselves (FBGEMM), so `epsilon`
    is added to the corrected root, unlike Keras' `Adam`.

    Args:
        learning_rate: float or `LearningRateSchedule`.
        beta_1: decay of the first moment, in `[0, 1)`.
        beta_2: decay of the row's second moment, in `[0, 1)`.
        epsilon: added to the corrected `sqrt(v)`.
        name: optional name.
        **options: options every updater takes (e.g. `weight_decay`).
    """

    test_configs = {
        "default": {},
        "betas": {"beta_1": 0.5, "beta_2": 0.9, "epsilon": 1e-3},
    }

    def __init__(self, learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-8,
                 name=None, **options):
        super().__init__(learning_rate, name=name, **options)
        set_betas(self, beta_1, beta_2, epsilon)
        self.slots = (SlotSpec("momentum"), SlotSpec("velocity", rowwise=True))
        self.unread_slots = unread_momentum(self)

    def update(self, rows, state, grads, hp):
        learning_rate, step = hp.learning_rate, hp.step
        t = ops.cast(step, "float32")
        b1, b2 = hp.beta_1, hp.beta_2
        m, moments = first_moment(self, state, grads, b1)
        v = b2 * state["velocity"] + (1 - b2) * ops.mean(ops.square(grads), axis=-1)
        m_hat = m / (1 - ops.power(b1, t))
        v_hat = v / (1 - ops.power(b2, t))
        step_size = learning_rate / (ops.sqrt(v_hat) + hp.epsilon)
        return rows - step_size[:, None] * m_hat, {**moments, "velocity": v}
