"""LaProp, as SparseCore's (jax-tpu-embedding) `LaPropOptimizerSpec`."""

import keras
from keras import ops

from sparseopt.updaters.core.base import SlotSpec, SparseCoreSpec, Updater


@keras.saving.register_keras_serializable(package="sparseopt")
class LaProp(Updater):
    """LaProp: momentum on the gradient already divided by its running RMS.

    On each touched row, with `t` the optimizer's step (1-based, global):

        d  = b2 (1 - b2^(t-1)) / (1 - b2^t)      (0 on the first step)
        nu <- d nu + (1 - d) (g^2 + eps)
        mu <- b1 mu + sqrt(1 - b1^2) g / sqrt(nu)
        w  <- w - lr mu

    `d` makes `nu` the bias-corrected average of `g^2 + eps` over the row's
    updates, as SparseCore's `LaPropOptimizerSpec.get_decay_rate` computes it.
    Lazy: `mu` and `nu` of a row move only when the row is touched.

    Args:
        learning_rate: float or `LearningRateSchedule`.
        b1: decay of the momentum, in `[0, 1)`.
        b2: decay of the squared-gradient average, in `[0, 1)`.
        eps: `> 0`, added to `g^2` (keeps a zero gradient from dividing by 0).
        name: optional name.
        **options: options every updater takes (e.g. `clipvalue`).

    Reference: Ziyin et al., 2020, "LaProp: Separating Momentum and
    Adaptivity in Adam".
    """

    sparsecore_spec = SparseCoreSpec(
        "LaPropOptimizerSpec", {"b1": "b1", "b2": "b2", "eps": "eps"},
        {"rms_clip_threshold": None, "initial_slot_value": 0.0}, "no RMS clip; slots start at 0")
    test_configs = {
        "default": {},
        "betas": {"b1": 0.5, "b2": 0.8, "eps": 1e-6},
    }

    def __init__(self, learning_rate=0.001, b1=0.9, b2=0.95, eps=1e-30, name=None, **options):
        super().__init__(learning_rate, name=name, **options)
        # 0: no momentum kept (the step never reads `mu`), so no slot.
        self.hyperparameter("b1", b1, lambda v: 0 <= v < 1, "in [0, 1)", fixed=lambda v: v == 0)
        self.hyperparameter("b2", b2, lambda v: 0 <= v < 1, "in [0, 1)")
        self.hyperparameter("eps", eps, lambda v: v > 0, "> 0")
        self.slots = (SlotSpec("mu"), SlotSpec("nu"))
        self.unread_slots = () if self.b1 else ("mu",)

    def update(self, rows, state, grads, hp):
        learning_rate, step = hp.learning_rate, hp.step
        t = ops.cast(step, "float32")
        b1, b2 = hp.b1, hp.b2
        d = b2 * (1 - ops.power(b2, t - 1)) / (1 - ops.power(b2, t))
        nu = d * state["nu"] + (1 - d) * (ops.square(grads) + hp.eps)
        scaled = ops.sqrt(1 - ops.square(b1)) * grads * ops.rsqrt(nu)
        if not self.b1:  # mu is this step's scaled gradient
            return rows - learning_rate * scaled, {"nu": nu}
        mu = b1 * state["mu"] + scaled
        return rows - learning_rate * mu, {"mu": mu, "nu": nu}
