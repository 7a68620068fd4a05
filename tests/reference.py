"""NumPy implementation of the update rules in docs/semantics.md, independent of sparseopt."""

import numpy as np


def sgd(w, state, g, lr, cfg):
    return w - lr * g, state


def adagrad(w, state, g, lr, cfg):
    acc = state["accumulator"] + g * g
    return w - lr * g / np.sqrt(acc + cfg.get("epsilon", 1e-7)), {"accumulator": acc}


def rowwise_adagrad(w, state, g, lr, cfg):
    acc = state["accumulator"] + np.mean(g * g, axis=-1)
    return w - lr * g / (np.sqrt(acc)[:, None] + cfg.get("epsilon", 1e-8)), {"accumulator": acc}


def ftrl(w, state, g, lr, cfg):
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


RULES = {"SGD": sgd, "Adagrad": adagrad, "RowwiseAdagrad": rowwise_adagrad, "Ftrl": ftrl}


def initial_state(name, shape, cfg):
    rows = shape[0]
    if name == "Adagrad":
        return {"accumulator": np.full(shape, cfg.get("initial_accumulator_value", 0.1))}
    if name == "RowwiseAdagrad":
        return {"accumulator": np.full((rows,), cfg.get("initial_accumulator_value", 0.0))}
    if name == "Ftrl":
        return {"accumulator": np.full(shape, cfg.get("initial_accumulator_value", 0.1)),
                "linear": np.zeros(shape)}
    return {}


def sparse_step(name, table, state, ids, grads, lr, cfg):
    """One exact sparse step: sum duplicates, update each valid touched row once."""
    table, state = table.copy(), {k: v.copy() for k, v in state.items()}
    ids = np.asarray(ids).reshape(-1)
    grads = np.asarray(grads, np.float64).reshape(ids.shape[0], -1)
    valid = (ids >= 0) & (ids < table.shape[0])
    uniq = np.unique(ids[valid])
    if uniq.size == 0:
        return table, state
    summed = np.zeros((uniq.size, table.shape[1]))
    np.add.at(summed, np.searchsorted(uniq, ids[valid]), grads[valid])
    if cfg.get("clipvalue") is not None:  # an option of every rule: clip the summed gradient
        summed = np.clip(summed, -cfg["clipvalue"], cfg["clipvalue"])
    rows, st = RULES[name](table[uniq], {k: v[uniq] for k, v in state.items()}, summed, lr, cfg)
    table[uniq] = rows
    for k in state:
        state[k][uniq] = st[k]
    return table, state
