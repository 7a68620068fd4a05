"""Sparse Adafactor for tables: a factored second moment, lazy (the step's rows)."""

import keras
from keras import ops

from sparseopt.updaters.base import SlotSpec, Updater


@keras.saving.register_keras_serializable(package="sparseopt")
class Adafactor(Updater):
    """Adafactor on the rows a step touches: Keras' arithmetic on that sub-table.

    A step's distinct rows `T` (`n` of them, width `D`) are treated as the
    matrix Keras' `Adafactor` updates, with the row factor `vr` of each row
    kept across steps (one float a row) and the column factor `vc` of the
    table (`D` floats). With `t` the optimizer's step (1-based, global),
    `b = 1 - t^beta_2_decay` and `G = g^2 + epsilon_1`:

        vr_i <- b vr_i + (1 - b) mean_d G_i                      (each row of T)
        vc   <- b vc + (1 - b) mean_{i in T} G_i
        v_i   = vr_i / mean_{j in T} vr_j * vc                   (not stored)
        u_i   = g_i / sqrt(v_i)
        s     = max(epsilon_2, rms_T(w)) / max(1, rms_T(u) / clip_threshold)
        w_i  <- w_i - min(lr, 1 / sqrt(t)) s u_i

    `rms_T` is the root mean square over the `n x D` entries of the step's
    rows (`w` before the update). `relative_step=False` uses `lr` instead of
    `min(lr, 1 / sqrt(t))`, and `multiply_by_parameter_scale=False` drops the
    `max(epsilon_2, rms_T(w))` factor. With `beta_1 > 0` the scaled update
    goes through a momentum (`[V, D]`, Tensor2Tensor's form):
    `m_i <- beta_1 m_i + (1 - beta_1) step_i; w_i <- w_i - m_i`. With
    `factored=False` each entry keeps its own second moment (`[V, D]`)
    instead of `vr` and `vc`: `v_i <- b v_i + (1 - b) G_i`.

    Untouched rows and their `vr` do not change, and the means and norms are
    over the step's rows, not the table's: this is not Keras' dense
    `Adafactor` on the table, whose column factor, row mean and norms are
    over every row (so that a table's update scale depends on rows the batch
    never saw). State: `4 + 4/V*D` bytes a row factored (`vr` and the table's
    `vc`), `4 D` with `factored=False`, `4 D` more with `beta_1 > 0`; plus
    two floats a table (this step's row mean and scale, which the row rule
    reads).

    Args:
        learning_rate: float or `LearningRateSchedule` (Keras' default 0.001).
        beta_2_decay: the exponent of the second moment's decay
            `b = 1 - t^beta_2_decay` (negative).
        epsilon_1: added to `g^2`.
        epsilon_2: the least parameter scale (`multiply_by_parameter_scale`).
        clip_threshold: the update's RMS above which it is scaled down.
        relative_step: step size `min(lr, 1 / sqrt(t))` (True) or `lr`.
        multiply_by_parameter_scale: scale the step by the rows' RMS.
        beta_1: momentum of the scaled update; 0 keeps no momentum slot.
        factored: `vr` and `vc` (True) or a second moment per entry.
        name: optional name.
        **options: options every updater takes (e.g. `clipvalue`).

    Reference: Shazeer and Stern, 2018, "Adafactor: Adaptive Learning Rates
    with Sublinear Memory Cost".
    """

    test_configs = {
        "default": {},
        "momentum_unfactored": {"beta_1": 0.8, "factored": False, "clip_threshold": 0.5},
        "absolute_step": {"relative_step": False, "multiply_by_parameter_scale": False,
                          "beta_2_decay": -0.5, "epsilon_2": 1e-2},
    }

    def __init__(self, learning_rate=0.001, beta_2_decay=-0.8, epsilon_1=1e-30,
                 epsilon_2=1e-3, clip_threshold=1.0, relative_step=True,
                 multiply_by_parameter_scale=True, beta_1=0.0, factored=True, name=None,
                 **options):
        super().__init__(learning_rate, name=name, **options)
        self.hyperparameter("beta_2_decay", beta_2_decay, lambda v: v < 0, "< 0")
        self.hyperparameter("epsilon_1", epsilon_1, lambda v: v >= 0, ">= 0")
        self.hyperparameter("epsilon_2", epsilon_2, lambda v: v >= 0, ">= 0")
        self.hyperparameter("clip_threshold", clip_threshold, lambda v: v > 0, "> 0")
        # 0: no momentum slot, so not a value to change into or out of once built.
        self.hyperparameter("beta_1", beta_1, lambda v: 0 <= v < 1, "in [0, 1)",
                            fixed=lambda v: v == 0)
        self.relative_step = bool(relative_step)
        self.multiply_by_parameter_scale = bool(multiply_by_parameter_scale)
        self.factored = bool(factored)
        slots = ([SlotSpec("vr", kind="row"), SlotSpec("vc", kind="column")] if self.factored
                 else [SlotSpec("v")])
        if self.beta_1:
            slots.append(SlotSpec("momentum"))
        # This step's statistics of its rows (`update_whole`), read by the row rule.
        if self.factored:
            slots.append(SlotSpec("row_mean", kind="table", initial_value=1.0))
        slots.append(SlotSpec("scale", kind="table"))
        self.slots = tuple(slots)

    # -- the pieces of one step ------------------------------------------------

    def _decay(self, step):
        t = ops.cast(step, "float32")
        return 1.0 - ops.power(t, self.value("beta_2_decay", step))

    def _second_moment(self, state, grads, step):
        """The touched rows' new `vr` (`[U]`) or `v` (`[U, D]`)."""
        b = self._decay(step)
        regulated = ops.square(grads) + self.value("epsilon_1", step)
        if self.factored:
            return b * state["vr"] + (1 - b) * ops.mean(regulated, axis=-1)
        return b * state["v"] + (1 - b) * regulated

    def contributions(self, rows, state, grads, step):
        moment = self._second_moment(state, grads, step)
        square = ops.square(grads)
        ones = ops.ones(ops.shape(grads)[:1])
        out = {"rows": ones, "entries": ones * ops.cast(ops.shape(grads)[1], "float32"),
               "w_square": ops.sum(ops.square(rows), axis=-1)}
        if self.factored:
            out["regulated"] = square + self.value("epsilon_1", step)  # -> vc
            out["vr"] = moment                                       # -> mean of vr
            out["u_square"] = square / moment[:, None]               # / (vc / mean vr)
        else:
            out["u_square"] = ops.sum(square / moment, axis=-1)
        return out

    def update_whole(self, state, sums, num_rows, step):
        n = ops.maximum(sums["rows"], 1.0)
        entries = ops.maximum(sums["entries"], 1.0)
        new = {}
        if self.factored:
            b = self._decay(step)
            # No rows this step: the column factor stays.
            vc = ops.where(sums["rows"] > 0, b * state["vc"] + (1 - b) * sums["regulated"] / n,
                           state["vc"])
            row_mean = ops.where(sums["rows"] > 0, sums["vr"] / n, state["row_mean"])
            u_square = row_mean * ops.sum(sums["u_square"] / vc)
            new.update(vc=vc, row_mean=row_mean)
        else:
            u_square = sums["u_square"]
        clip = ops.maximum(1.0, ops.sqrt(u_square / entries) / self.value("clip_threshold", step))
        scale = 1.0 / clip
        if self.multiply_by_parameter_scale:
            rms_w = ops.sqrt(sums["w_square"] / entries)
            scale = scale * ops.maximum(self.value("epsilon_2", step), rms_w)
        new["scale"] = ops.where(sums["rows"] > 0, scale, state["scale"])
        return new

    def update(self, rows, state, grads, learning_rate, step):
        moment = self._second_moment(state, grads, step)
        if self.factored:
            v = (moment / state["row_mean"])[:, None] * state["vc"]
            new = {"vr": moment}
        else:
            v, new = moment, {"v": moment}
        rate = learning_rate
        if self.relative_step:
            rate = ops.minimum(learning_rate, ops.rsqrt(ops.cast(step, "float32")))
        delta = rate * state["scale"] * grads / ops.sqrt(v)
        if self.beta_1:
            b1 = self.value("beta_1", step)
            delta = b1 * state["momentum"] + (1 - b1) * delta
            new["momentum"] = delta
        return rows - delta, new

    def get_config(self):
        return {**super().get_config(), "relative_step": self.relative_step,
                "multiply_by_parameter_scale": self.multiply_by_parameter_scale,
                "factored": self.factored}
