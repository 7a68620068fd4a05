"""Sparse Adafactor for tables: a factored second moment, lazy (the step's rows)."""

import keras
from keras import ops

from sparseopt.updaters.core.base import SlotSpec, Updater


def _sum_of_squares(table):
    """The table's sum of squared entries (where `lazy=False`'s `Q` starts)."""
    return ops.sum(ops.square(table))


def _entries(table):
    """The table's number of entries, `V x D` (the means over the whole table)."""
    return ops.cast(ops.size(table), "float32")


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

    `lazy=False` is Keras' dense `Adafactor` on the whole table, at sparse
    cost. An untouched row has a zero gradient, so it does not move, and its
    `vr` only decays toward `epsilon_1`: `vr - epsilon_1` shrinks by `b` a
    step, so each row keeps the running sum `L` of `log b` at its last update
    (`vr_log`, 4 bytes a row) and its `vr` is
    `epsilon_1 + (vr - epsilon_1) exp(L_now - vr_log)` whenever read. The
    statistics over every row are running sums kept per table: the column
    factor gets `epsilon_1` from every untouched row; `S`, the sum of
    `vr - epsilon_1` over all rows, shrinks by `b` and gains the step's rows
    (the row mean is `epsilon_1 + S / V`); the update's RMS is over the
    step's rows' entries divided by all `V x D` (the others are 0); and the
    table's sum of squares `Q` (its RMS) starts from the table when the
    optimizer is built and moves by each step's change of its rows. Exact up
    to float rounding (tested against `keras.optimizers.Adafactor` on a
    one-hot table where most rows miss most steps); `Q` follows the values
    the rule computes, so it is refused with options that change rows outside
    the rule (decoupled `weight_decay`, `max_norm`, weight clips), with
    `beta_1 > 0` (dense momentum moves untouched rows), and on open
    vocabularies (rows reset to new values). Writing the table outside
    training (`assign`) leaves `Q` behind. `keras.optimizers.Adafactor` (a
    keras-rs `TableConfig`) converts to this form and back.

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

    keras_optimizer = keras.optimizers.Adafactor
    dense_in_rule = True
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
        dense = not self.lazy
        if dense:
            self._check_dense(options)
        # Dense: a row never updated reads `epsilon_1 + (start - epsilon_1)`.
        start = float(self.epsilon_1) if dense else 0.0
        slots = ([SlotSpec("vr", kind="row", initial_value=start),
                  SlotSpec("vc", kind="column")] if self.factored
                 else [SlotSpec("v", initial_value=start)])
        if dense:  # (`lazy=False`: the running sums of the class docstring)
            slots += [SlotSpec("vr_log", kind="row"), SlotSpec("log_decay", kind="table"),
                      SlotSpec("log_decay_before", kind="table"),
                      SlotSpec("sum_squares", kind="table", from_table=_sum_of_squares),
                      SlotSpec("entries", kind="table", from_table=_entries)]
            if self.factored:
                slots.append(SlotSpec("excess", kind="table"))
        if self.beta_1:
            slots.append(SlotSpec("momentum"))
        # This step's statistics (`update_whole`), read by the row rule.
        if self.factored:
            slots.append(SlotSpec("row_mean", kind="table", initial_value=1.0))
        slots.append(SlotSpec("scale", kind="table"))
        self.slots = tuple(slots)

    def _check_dense(self, options):
        owner = type(self).__name__
        moved = sorted(k for k in ("max_norm", "clip_weight_min", "clip_weight_max")
                       if options.get(k) is not None)
        if options.get("weight_decay") and options.get("weight_decay_mode",
                                                       "decoupled") == "decoupled":
            moved.append("weight_decay")
        if moved:
            raise ValueError(
                f"{owner}(lazy=False) with {moved}: the table's RMS is kept as a running sum "
                "of the changes the rule makes, which these options would bypass. Remove "
                "them, use weight_decay_mode='l2', or lazy=True.")
        if self.beta_1:
            raise ValueError(
                f"{owner}(lazy=False) with beta_1 > 0: a dense momentum moves every row "
                "every step, which the running sums cannot follow. Use beta_1=0 (Keras' "
                "Adafactor has none) or lazy=True.")

    # -- the pieces of one step ------------------------------------------------

    def _decay(self, hp):
        t = ops.cast(hp.step, "float32")
        return 1.0 - ops.power(t, hp.beta_2_decay)

    def _log_decay(self, hp):
        """`log b` of the step, 0 on the first (where `b = 0` replaces every moment)."""
        t = ops.cast(hp.step, "float32")
        return ops.where(t > 1, ops.log(ops.maximum(self._decay(hp), 1e-38)), 0.0)

    def _second_moment(self, state, grads, hp, before=None):
        """The touched rows' new `vr` (`[U]`) or `v` (`[U, D]`).

        `before`: dense form only, the running `log b` sum as of the previous
        step; the stored moment first decays over the steps the row missed.
        """
        b = self._decay(hp)
        eps = hp.epsilon_1
        regulated = ops.square(grads) + eps
        old = state["vr" if self.factored else "v"]
        if not self.lazy:
            missed = ops.exp(before - state["vr_log"])
            old = eps + (old - eps) * (missed if self.factored else missed[:, None])
        if self.factored:
            return b * old + (1 - b) * ops.mean(regulated, axis=-1)
        return b * old + (1 - b) * regulated

    def contributions(self, rows, state, grads, hp):
        if not self.lazy:
            return self._dense_contributions(rows, state, grads, hp)
        moment = self._second_moment(state, grads, hp)
        square = ops.square(grads)
        ones = ops.ones(ops.shape(grads)[:1])
        out = {"rows": ones, "entries": ones * ops.cast(ops.shape(grads)[1], "float32"),
               "w_square": ops.sum(ops.square(rows), axis=-1)}
        if self.factored:
            out["regulated"] = square + hp.epsilon_1  # -> vc
            out["vr"] = moment                                       # -> mean of vr
            out["u_square"] = square / moment[:, None]               # / (vc / mean vr)
        else:
            out["u_square"] = ops.sum(square / moment, axis=-1)
        return out

    def _dense_contributions(self, rows, state, grads, hp):
        moment = self._second_moment(state, grads, hp, before=state["log_decay"])
        square = ops.square(grads)
        if self.factored:  # sum_T u^2 and sum_T w u, but for the whole factors
            root = ops.sqrt(moment)[:, None]
            return {"square": square, "u_square": square / moment[:, None],
                    "w_u": rows * grads / root}
        root = ops.sqrt(moment)
        return {"u_square": ops.sum(square / moment, axis=-1),
                "w_u": ops.sum(rows * grads / root, axis=-1)}

    def _dense_whole(self, state, sums, num_rows, hp):
        v = ops.cast(num_rows, "float32")
        entries = state["entries"]  # V x D
        b = self._decay(hp)
        eps = hp.epsilon_1
        new = {}
        if self.factored:
            vc = b * state["vc"] + (1 - b) * (eps + sums["square"] / v)
            width = float(state["vc"].shape[0])
            excess = b * state["excess"] + (1 - b) * ops.sum(sums["square"]) / width
            row_mean = eps + excess / v
            u_square = row_mean * ops.sum(sums["u_square"] / vc)
            w_u = ops.sqrt(row_mean) * ops.sum(sums["w_u"] / ops.sqrt(vc))
            new.update(vc=vc, excess=excess, row_mean=row_mean)
        else:
            u_square, w_u = sums["u_square"], sums["w_u"]
        clip = ops.maximum(1.0, ops.sqrt(u_square / entries)
                           / hp.clip_threshold)
        scale = 1.0 / clip
        q = state["sum_squares"]
        if self.multiply_by_parameter_scale:
            scale = scale * ops.maximum(hp.epsilon_2,
                                        ops.sqrt(ops.maximum(q, 0.0) / entries))
        rate = self._rate(hp.learning_rate, hp.step)
        # Each row moves by -a u: the table's sum of squares by -2a w.u + a^2 u.u.
        a = rate * scale
        log_decay = state["log_decay"] + self._log_decay(hp)
        new.update(scale=scale, sum_squares=q - 2.0 * a * w_u + a * a * u_square,
                   log_decay=log_decay, log_decay_before=state["log_decay"], entries=entries)
        return new

    def _rate(self, learning_rate, step):
        if self.relative_step:
            return ops.minimum(learning_rate, ops.rsqrt(ops.cast(step, "float32")))
        return learning_rate

    def update_whole(self, state, sums, num_rows, hp):
        if not self.lazy:
            return self._dense_whole(state, sums, num_rows, hp)
        n = ops.maximum(sums["rows"], 1.0)
        entries = ops.maximum(sums["entries"], 1.0)
        new = {}
        if self.factored:
            b = self._decay(hp)
            # No rows this step: the column factor stays.
            vc = ops.where(sums["rows"] > 0, b * state["vc"] + (1 - b) * sums["regulated"] / n,
                           state["vc"])
            row_mean = ops.where(sums["rows"] > 0, sums["vr"] / n, state["row_mean"])
            u_square = row_mean * ops.sum(sums["u_square"] / vc)
            new.update(vc=vc, row_mean=row_mean)
        else:
            u_square = sums["u_square"]
        clip = ops.maximum(1.0, ops.sqrt(u_square / entries) / hp.clip_threshold)
        scale = 1.0 / clip
        if self.multiply_by_parameter_scale:
            rms_w = ops.sqrt(sums["w_square"] / entries)
            scale = scale * ops.maximum(hp.epsilon_2, rms_w)
        new["scale"] = ops.where(sums["rows"] > 0, scale, state["scale"])
        return new

    def update(self, rows, state, grads, hp):
        before = None if self.lazy else state["log_decay_before"]
        moment = self._second_moment(state, grads, hp, before=before)
        if self.factored:
            v = (moment / state["row_mean"])[:, None] * state["vc"]
            new = {"vr": moment}
        else:
            v, new = moment, {"v": moment}
        if not self.lazy:  # the running log-decay sum its moment is now as of
            new["vr_log"] = ops.broadcast_to(state["log_decay"], ops.shape(moment)[:1])
        delta = self._rate(hp.learning_rate, hp.step) * state["scale"] * grads / ops.sqrt(v)
        if self.beta_1:
            b1 = hp.beta_1
            delta = b1 * state["momentum"] + (1 - b1) * delta
            new["momentum"] = delta
        return rows - delta, new

    def to_keras(self):
        settings = []
        if self.lazy:
            settings.append("lazy=True (its statistics are over the step's rows; Keras' over "
                            "the whole table: lazy=False)")
        if self.beta_1 or not self.factored:
            settings.append("beta_1 > 0 or factored=False (Keras' Adafactor factors a table "
                            "and keeps no momentum)")
        if not (self.relative_step and self.multiply_by_parameter_scale):
            settings.append("relative_step=False or multiply_by_parameter_scale=False (Keras' "
                            "Adafactor always takes min(lr, 1/sqrt(t)) and the parameter scale)")
        if settings:
            raise ValueError(f"sparseopt: Adafactor with {'; '.join(settings)} has no Keras "
                             "optimizer equivalent; use the defaults with lazy=False.")
        return keras.optimizers.Adafactor(
            self.learning_rate, beta_2_decay=self.beta_2_decay, epsilon_1=self.epsilon_1,
            epsilon_2=self.epsilon_2, clip_threshold=self.clip_threshold)

    @classmethod
    def from_keras(cls, learning_rate, config, where=""):
        # Keras' `relative_step` changes nothing in its arithmetic (it takes the
        # minimum with 1/sqrt(t) either way): dropped.
        return cls(learning_rate, beta_2_decay=config["beta_2_decay"],
                   epsilon_1=config["epsilon_1"], epsilon_2=config["epsilon_2"],
                   clip_threshold=config["clip_threshold"], lazy=False)

    def get_config(self):
        return {**super().get_config(), "relative_step": self.relative_step,
                "multiply_by_parameter_scale": self.multiply_by_parameter_scale,
                "factored": self.factored}
