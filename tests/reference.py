"""NumPy implementation of the update rules in docs/semantics.md.

The formulas and the values state starts from are written here, independently of
sparseopt; only which state a rule keeps (its slots' names and shapes) is read from
the updater's declaration (`initial_state`).
"""

import numpy as np


def sgd(w, state, g, lr, cfg, t):
    mu = cfg.get("momentum", 0.0)
    if not mu:
        return w - lr * g, state
    m = mu * state["momentum"] - lr * g
    if cfg.get("nesterov", False):
        return w + mu * m - lr * g, {"momentum": m}
    return w + m, {"momentum": m}


def adam(w, state, g, lr, cfg, t):
    b1, b2, eps = cfg.get("beta_1", 0.9), cfg.get("beta_2", 0.999), cfg.get("epsilon", 1e-7)
    m = b1 * state["momentum"] + (1 - b1) * g
    v = b2 * state["velocity"] + (1 - b2) * g * g
    alpha = lr * np.sqrt(1 - b2 ** t) / (1 - b1 ** t)
    return w - alpha * m / (np.sqrt(v) + eps), {"momentum": m, "velocity": v}


def partial_rowwise_adam(w, state, g, lr, cfg, t):
    b1, b2, eps = cfg.get("beta_1", 0.9), cfg.get("beta_2", 0.999), cfg.get("epsilon", 1e-8)
    m = b1 * state["momentum"] + (1 - b1) * g
    v = b2 * state["velocity"] + (1 - b2) * np.mean(g * g, axis=-1)
    m_hat, v_hat = m / (1 - b1 ** t), v / (1 - b2 ** t)
    return w - lr * m_hat / (np.sqrt(v_hat)[:, None] + eps), {"momentum": m, "velocity": v}


def adagrad_momentum(w, state, g, lr, cfg, t):
    mu, b2 = cfg.get("momentum", 0.0), cfg.get("beta_2", 1.0)
    k, eps = cfg.get("exponent", 2.0), cfg.get("epsilon", 1e-10)
    a = state["accumulator"] + g * g if b2 == 1.0 else b2 * state["accumulator"] + (1 - b2) * g * g
    s = (a + eps) ** (-1.0 / k) * g
    m = mu * state["momentum"] + s
    step = mu * m + s if cfg.get("use_nesterov", False) else m
    return w - lr * step, {"accumulator": a, "momentum": m}


def laprop(w, state, g, lr, cfg, t):
    b1, b2, eps = cfg.get("b1", 0.9), cfg.get("b2", 0.95), cfg.get("eps", 1e-30)
    d = b2 * (1 - b2 ** (t - 1)) / (1 - b2 ** t)
    nu = d * state["nu"] + (1 - d) * (g * g + eps)
    mu = b1 * state["mu"] + np.sqrt(1 - b1 * b1) * g / np.sqrt(nu)
    return w - lr * mu, {"mu": mu, "nu": nu}


def frequency_aware_adagrad(w, state, g, lr, cfg, t):
    seen = state["local_step"] + 1
    boost = np.minimum((max(t - 1, 1) / seen) ** cfg.get("rho", 0.5),
                       cfg.get("max_lr_multiplier", 1e6))
    acc = state["accumulator"] + g * g
    step = (boost[:, None] * g / np.sqrt(acc) + cfg.get("l1_regularization_strength", 0.0)
            * np.sign(w) + cfg.get("l2_regularization_strength", 0.0) * w)
    return w - lr * step, {"accumulator": acc, "local_step": seen}


def adagrad(w, state, g, lr, cfg, t):
    acc = state["accumulator"] + g * g
    return w - lr * g / np.sqrt(acc + cfg.get("epsilon", 1e-7)), {"accumulator": acc}


def rowwise_adagrad(w, state, g, lr, cfg, t):
    acc = state["accumulator"] + np.mean(g * g, axis=-1)
    return w - lr * g / (np.sqrt(acc)[:, None] + cfg.get("epsilon", 1e-8)), {"accumulator": acc}


def ftrl(w, state, g, lr, cfg, t):
    p = -cfg.get("learning_rate_power", -0.5)
    l1, l2 = cfg.get("l1_regularization_strength", 0.0), cfg.get("l2_regularization_strength", 0.0)
    beta = cfg.get("beta", 0.0)
    n, z = state["accumulator"], state["linear"]
    n2 = n + g * g
    if cfg.get("multiply_linear_by_learning_rate", False):
        z2 = z + lr * g - (n2 ** p - n ** p) * w
        w2 = np.where(np.abs(z2) <= lr * l1, 0.0,
                      (np.sign(z2) * lr * l1 - z2) / (n2 ** p + beta + 2 * lr * l2))
    else:
        sigma = (n2 ** p - n ** p) / lr
        z2 = z + g - sigma * w
        w2 = np.where(np.abs(z2) <= l1, 0.0,
                      (np.sign(z2) * l1 - z2) / ((n2 ** p + beta) / lr + 2 * l2))
    return w2, {"accumulator": n2, "linear": z2}


def rmsprop(w, state, g, lr, cfg, t):
    rho, mu, eps = cfg.get("rho", 0.9), cfg.get("momentum", 0.0), cfg.get("epsilon", 1e-7)
    v = rho * state["velocity"] + (1 - rho) * g * g
    out = {"velocity": v}
    var = v
    if cfg.get("centered", False):
        a = rho * state["average_gradient"] + (1 - rho) * g
        out["average_gradient"] = a
        var = v - a * a
    s = lr * g / np.sqrt(var + eps)
    if not mu:
        return w - s, out
    m = mu * state["momentum"] + s
    return w - m, {**out, "momentum": m}


def adamax(w, state, g, lr, cfg, t):
    b1, b2, eps = cfg.get("beta_1", 0.9), cfg.get("beta_2", 0.999), cfg.get("epsilon", 1e-7)
    m = b1 * state["momentum"] + (1 - b1) * g
    u = np.maximum(b2 * state["norm"], np.abs(g))
    return w - lr / (1 - b1 ** t) * m / (u + eps), {"momentum": m, "norm": u}


def nadam(w, state, g, lr, cfg, t):
    b1, b2, eps = cfg.get("beta_1", 0.9), cfg.get("beta_2", 0.999), cfg.get("epsilon", 1e-7)

    def u(k):  # Keras' momentum schedule
        return b1 * (1 - 0.5 * 0.96 ** k)

    product = np.prod([u(k) for k in range(1, t + 1)])  # u_1 ... u_t, from scratch
    m = b1 * state["momentum"] + (1 - b1) * g
    v = b2 * state["velocity"] + (1 - b2) * g * g
    m_hat = u(t + 1) * m / (1 - product * u(t + 1)) + (1 - u(t)) * g / (1 - product)
    w = w - lr * m_hat / (np.sqrt(v / (1 - b2 ** t)) + eps)
    return w, {"momentum": m, "velocity": v}


def lion(w, state, g, lr, cfg, t):
    b1, b2 = cfg.get("beta_1", 0.9), cfg.get("beta_2", 0.99)
    m = state["momentum"]
    return w - lr * np.sign(b1 * m + (1 - b1) * g), {"momentum": b2 * m + (1 - b2) * g}


def lamb(w, state, g, lr, cfg, t):
    """The trust ratio per row (each row as Keras' Lamb treats a whole variable)."""
    b1, b2, eps = cfg.get("beta_1", 0.9), cfg.get("beta_2", 0.999), cfg.get("epsilon", 1e-7)
    m = b1 * state["momentum"] + (1 - b1) * g
    v = b2 * state["velocity"] + (1 - b2) * g * g
    r = (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps)
    out = w.copy()
    for i in range(w.shape[0]):
        wn, rn = np.linalg.norm(w[i]), np.linalg.norm(r[i])
        ratio = wn / rn if wn > 0 and rn > 0 else 1.0
        out[i] = w[i] - lr * ratio * r[i]
    return out, {"momentum": m, "velocity": v}


def adafactor(w, state, g, lr, cfg, t):
    """Keras' Adafactor arithmetic on the matrix of the step's rows (`w`, `g`)."""
    e1, e2 = cfg.get("epsilon_1", 1e-30), cfg.get("epsilon_2", 1e-3)
    threshold, b1 = cfg.get("clip_threshold", 1.0), cfg.get("beta_1", 0.0)
    b = 1 - t ** cfg.get("beta_2_decay", -0.8)
    regulated = g * g + e1
    out = {}
    if cfg.get("factored", True):
        vr = b * state["vr"] + (1 - b) * regulated.mean(axis=1)
        vc = b * state["vc"] + (1 - b) * regulated.mean(axis=0)
        v = np.outer(vr / vr.mean(), vc)
        out.update(vr=vr, vc=vc, row_mean=np.asarray(vr.mean()))
    else:
        v = b * state["v"] + (1 - b) * regulated
        out["v"] = v
    u = g / np.sqrt(v)

    def rms(x):
        return np.sqrt(np.mean(x * x))

    scale = 1 / max(1.0, rms(u) / threshold)
    if cfg.get("multiply_by_parameter_scale", True):
        scale *= max(e2, rms(w))
    out["scale"] = np.asarray(scale)
    rate = min(lr, 1 / np.sqrt(t)) if cfg.get("relative_step", True) else lr
    step = rate * scale * u
    if b1:
        step = b1 * state["momentum"] + (1 - b1) * step
        out["momentum"] = step
    return w - step, out


# `{rule: {slot: (config key, default)}}`: the slots that do not start at zero.
STARTS = {
    "Adagrad": {"accumulator": ("initial_accumulator_value", 0.1)},
    "RowwiseAdagrad": {"accumulator": ("initial_accumulator_value", 0.0)},
    "Ftrl": {"accumulator": ("initial_accumulator_value", 0.1)},
    "FrequencyAwareAdagrad": {"accumulator": ("initial_accumulator_value", 0.1)},
    "AdagradMomentum": {"accumulator": ("initial_accumulator_value", 0.0)},
    "Adafactor": {"row_mean": (None, 1.0)},
}

RULES = {"SGD": sgd, "Adagrad": adagrad, "RowwiseAdagrad": rowwise_adagrad, "Ftrl": ftrl,
         "Adam": adam, "PartialRowwiseAdam": partial_rowwise_adam,
         "AdagradMomentum": adagrad_momentum, "LaProp": laprop,
         "FrequencyAwareAdagrad": frequency_aware_adagrad, "RMSprop": rmsprop,
         "Adamax": adamax, "Nadam": nadam, "Lion": lion, "Lamb": lamb,
         "Adafactor": adafactor}


def initial_state(name, shape, cfg):
    """The state rule `name` starts from, for a table of `shape`.

    Which state a rule keeps (each slot's name, kind and dtype, also the last
    step and moving-average offset that `lazy=False` and `ema_momentum` add)
    is what its updater declares (`SlotSpec`s); the values it starts from are
    stated here, next to each formula (`STARTS`: zero elsewhere).
    """
    import sparseopt

    updater = sparseopt.updaters.registry(shipped_only=True)[name](0.1, **cfg)
    state = {}
    for spec in updater.legacy_slots:  # unread slots too: the formulas read them
        key, default = STARTS.get(name, {}).get(spec.name, (None, 0.0))
        value = cfg.get(key, default) if key else default
        dtype = np.int64 if "int" in (spec.dtype or "") else np.float64
        state[spec.name] = np.full(spec.shape(shape), value, dtype)
    return state


def _decay(cfg, lr):
    """`(mode, amount)` of the `weight_decay` option at learning rate `lr`, or None."""
    wd = cfg.get("weight_decay")
    if not wd:
        return None
    mode = cfg.get("weight_decay_mode", "decoupled")
    times_lr = cfg.get("multiply_weight_decay_by_learning_rate", mode == "decoupled")
    return mode, wd * lr if times_lr else wd


def _row_scale(x, limit):
    norm = np.sqrt(np.sum(x * x, axis=-1, keepdims=True))
    return x * np.where(norm > limit, limit / np.maximum(norm, 1e-30), 1.0)


def sparse_step(name, table, state, ids, grads, lr, cfg, step=1):
    """One exact sparse step: sum duplicates, update each valid touched row once.

    The options every rule takes (`weight_decay`, `clipvalue`, `clipnorm`,
    `clip_weight_min/max`, `max_norm`) in the order docs/semantics.md gives.
    `step` is the optimizer's 1-based step count (Adam's bias correction).
    """
    table, state = table.copy(), {k: v.copy() for k, v in state.items()}
    ids = np.asarray(ids).reshape(-1)
    grads = np.asarray(grads, np.float64).reshape(ids.shape[0], -1)
    valid = (ids >= 0) & (ids < table.shape[0])
    uniq = np.unique(ids[valid])
    if uniq.size == 0:
        return table, state
    summed = np.zeros((uniq.size, table.shape[1]))
    np.add.at(summed, np.searchsorted(uniq, ids[valid]), grads[valid])
    w = table[uniq]
    # Whole-table state (`[D]` or a scalar) is the rule's to read and replace whole.
    whole = {k for k, v in state.items() if v.ndim == 0 or v.shape[0] != table.shape[0]}
    own = {k: (v if k in whole else v[uniq]) for k, v in state.items()
           if k not in ("last_step", "ema_offset")}
    if "last_step" in state:
        missed = step - 1 - state["last_step"][uniq]
        if cfg.get("lazy") is False:
            w, own = _missed(name, w, own, missed, lr, cfg)
        state["last_step"][uniq] = step
    w_before = w
    decay = _decay(cfg, lr)
    if decay and decay[0] == "l2":
        summed = summed + decay[1] * w
    if cfg.get("clipvalue") is not None:
        summed = np.clip(summed, -cfg["clipvalue"], cfg["clipvalue"])
    if cfg.get("clipnorm") is not None:
        summed = _row_scale(summed, cfg["clipnorm"])
    if decay and decay[0] == "decoupled":
        w = w - decay[1] * w
    rows, st = RULES[name](w, own, summed, lr, cfg, step)
    if cfg.get("clip_weight_min") is not None:
        rows = np.maximum(rows, cfg["clip_weight_min"])
    if cfg.get("clip_weight_max") is not None:
        rows = np.minimum(rows, cfg["clip_weight_max"])
    if cfg.get("max_norm") is not None:
        rows = _row_scale(rows, cfg["max_norm"])
    table[uniq] = rows
    for k in st:
        if k in whole:
            state[k] = np.asarray(st[k], np.float64)
        else:
            state[k][uniq] = st[k]
    if "ema_offset" in state:
        # The average of an unchanged row moves toward it by m each step:
        # average - row decays by m^missed; then this step's change.
        mu = cfg["ema_momentum"]
        average = w_before + state["ema_offset"][uniq] * mu ** missed[:, None]
        mu_t = 0.0 if step == 1 else mu
        state["ema_offset"][uniq] = mu_t * average + (1 - mu_t) * rows - rows
    return table, state


def _missed(name, w, state, missed, lr, cfg):
    """What a dense optimizer does to rows over their `missed` steps without
    gradient, step by step: decoupled decay, then the rule on a zero gradient."""
    decay = _decay(cfg, lr)
    for j in range(int(np.max(missed, initial=0))):
        late = missed > j
        if not late.any():
            break
        w2 = w[late] - (decay[1] * w[late] if decay else 0.0)
        w2, st2 = RULES[name](w2, {k: v[late] for k, v in state.items()},
                              np.zeros_like(w2), lr, cfg, 0)
        w = w.copy()
        w[late] = w2
        state = {k: v.copy() for k, v in state.items()}
        for k in st2:
            state[k][late] = st2[k]
    return w, state


def finalize(name, table, state, lr, cfg, steps_done):
    """What the end of `fit` does: every row of a `lazy=False` table brought up to
    `steps_done` step by step; a table with `ema_momentum` replaced by its average."""
    if "last_step" not in state:
        return table, state
    missed = steps_done - state["last_step"]
    own = {k: v for k, v in state.items() if k not in ("last_step", "ema_offset")}
    if cfg.get("lazy") is False:
        table, own = _missed(name, table, own, missed, lr, cfg)
    own["last_step"] = np.full_like(state["last_step"], steps_done)
    if "ema_offset" in state:
        table = table + state["ema_offset"] * cfg["ema_momentum"] ** missed[:, None]
        own["ema_offset"] = np.zeros_like(state["ema_offset"])
    return table, own


# -- 16-bit storage (docs/semantics.md, "Precision") --------------------------

def _fmix32(x):
    x = np.asarray(x, np.uint64) & 0xFFFFFFFF
    x = ((x ^ (x >> 16)) * 0x85EBCA6B) & 0xFFFFFFFF
    x = ((x ^ (x >> 13)) * 0xC2B2AE35) & 0xFFFFFFFF
    return x ^ (x >> 16)


def rounding_bits(seed, table_index, variable_index, step, rows, width):
    """uint32 `[len(rows), width]`: the documented hash of (seed, stream, step, row, column)."""
    key = _fmix32(_fmix32(seed + 0x9E3779B9) ^ ((table_index << 8) | variable_index))
    per_row = _fmix32(_fmix32(key ^ np.uint64(step)) ^ np.asarray(rows, np.uint64))
    column = (np.arange(width, dtype=np.uint64) * 0x9E3779B9) & 0xFFFFFFFF
    return _fmix32(per_row[:, None] + column[None, :]).astype(np.uint32)


def half_neighbours(x, dtype):
    """The two `dtype` values around float64 `x`: toward zero, then away from it."""
    import ml_dtypes

    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16
    x = np.asarray(x, np.float64)
    near = x.astype(np_dtype)
    toward = np.where(np.abs(near.astype(np.float64)) > np.abs(x),
                      np.nextafter(near, np_dtype(0)), near)
    with np.errstate(over="ignore"):  # the largest value's neighbour away is inf
        away = np.nextafter(toward, np.copysign(np.inf, x).astype(np_dtype))
    return toward.astype(np.float64), away.astype(np.float64)


def stochastic_round(x, dtype, bits):
    """float32 `x` written to `dtype`: saturated, then rounded away from zero with
    probability (|x| - |toward|) / spacing, the draw taken from `bits`' top bits."""
    largest = {"bfloat16": 3.3895313892515355e38, "float16": 65504.0}[dtype]
    x = np.clip(np.asarray(x, np.float32).astype(np.float64), -largest, largest)
    toward, away = half_neighbours(x, dtype)
    fraction = np.abs(x - toward) / np.abs(away - toward)
    bits = np.asarray(bits, np.uint64)
    if dtype == "bfloat16":  # 16 random bits added to the 16 discarded ones: carry or not
        up = (bits >> 16) / 2.0**16 + fraction >= 1.0
    else:  # 13 bits in float16's normal range; below it a 24-bit draw in [0, 1)
        up = np.where(np.abs(x) >= 2.0**-14, (bits >> 19) / 2.0**13 + fraction >= 1.0,
                      (bits >> 8) / 2.0**24 < fraction)
    return np.where(up & (fraction > 0), away, toward)
