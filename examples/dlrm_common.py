"""What the DLRM examples share: the synthetic click data, the model, timing.

`dlrm_synthetic.py` (the demo), `keras_rs_dlrm.py` and `sharded_dlrm.py`
import this module (each runs as a script from this folder, which Python puts
first on the import path).
"""

import time

import keras
from keras import ops
import numpy as np

import sparseopt

NUM_DENSE = 13
# Table sizes of very different orders, like Criteo's 26 categorical features.
TABLE_SIZES = [1_000_000, 500_000, 300_000, 200_000, 100_000, 50_000, 20_000, 10_000,
               5_000, 3_000, 2_000, 1_000, 1_000, 500, 300, 200, 100, 100, 50, 30, 20,
               10, 10, 5, 4, 4]


def updater_for(rows):
    """Per-table choice, as one would make it: row-wise state for the largest."""
    if rows >= 300_000:
        return sparseopt.updaters.RowwiseAdagrad(0.05)
    if rows >= 1_000:
        return sparseopt.updaters.Adagrad(0.05)
    return sparseopt.updaters.Ftrl(0.05, l2_regularization_strength=1e-4)


def synthetic_clicks(num_examples, table_sizes, seed=0):
    """Dense features, Zipf-like ids and clicks with a learnable signal."""
    rng = np.random.default_rng(seed)
    dense = rng.normal(size=(num_examples, NUM_DENSE)).astype("float32")
    ids = np.empty((num_examples, len(table_sizes)), dtype="int32")
    logit = dense @ rng.normal(scale=0.3, size=NUM_DENSE) - 1.0
    for f, rows in enumerate(table_sizes):
        # Skewed popularity: a few ids are frequent, most are rare.
        ids[:, f] = np.minimum((rows * rng.random(num_examples) ** 3).astype(np.int64), rows - 1)
        propensity = rng.normal(scale=0.6, size=rows)
        logit += propensity[ids[:, f]] / np.sqrt(len(table_sizes) / 4)
    prob = 1 / (1 + np.exp(-logit))
    clicks = (rng.random(num_examples) < prob).astype("float32")
    return {"dense": dense, "ids": ids}, clicks[:, None], prob[:, None].astype("float32")


VALIDATION_EXAMPLES = 50_000


def split_at(data, n):
    """`(first n examples, the rest)` of an array or of a dict of arrays."""
    if isinstance(data, dict):
        return {k: v[:n] for k, v in data.items()}, {k: v[n:] for k, v in data.items()}
    return data[:n], data[n:]


def mlp(x, units, name):
    for i, u in enumerate(units):
        x = keras.layers.Dense(u, activation="relu", name=f"{name}_{i}")(x)
    return x


def dot_interaction(bottom, embeddings):
    """DLRM: pairwise dot products of all feature vectors, upper triangle."""
    feats = ops.stack([bottom] + embeddings, axis=1)  # [B, F, D]
    dots = ops.matmul(feats, ops.transpose(feats, (0, 2, 1)))  # [B, F, F]
    f = len(embeddings) + 1
    rows, cols = np.triu_indices(f, k=1)
    flat = ops.reshape(dots, (-1, f * f))
    pairs = ops.take(flat, rows * f + cols, axis=1)
    return ops.concatenate([bottom, pairs], axis=1)


def build_dlrm(table_sizes, width, sparse=True, table_dtype=None, storage=None):
    """The DLRM; `table_dtype` and `storage` (`sparseopt.TableStorage` settings, a dict) for
    16-bit tables."""
    dense_in = keras.Input((NUM_DENSE,), name="dense")
    ids_in = keras.Input((len(table_sizes),), dtype="int32", name="ids")
    bottom = mlp(dense_in, [64, width], "bottom")
    embeddings = []
    for f, rows in enumerate(table_sizes):
        col = ops.take(ids_in, [f], axis=1)
        if sparse:
            layer = sparseopt.layers.SparseEmbedding(
                rows, width, updater=updater_for(rows), combiner="sum",
                name=f"table_{f}", dtype=table_dtype,
                storage=sparseopt.TableStorage(**storage) if storage else None)
            embeddings.append(layer(col))
        else:
            layer = keras.layers.Embedding(rows, width, name=f"table_{f}")
            embeddings.append(ops.sum(layer(col), axis=1))
    top = mlp(dot_interaction(bottom, embeddings), [128, 64], "top")
    out = keras.layers.Dense(1, activation="sigmoid", name="click")(top)
    return keras.Model({"dense": dense_in, "ids": ids_in}, out, name="dlrm")


class StepTimer(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        self._t = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        # Reading the loss waits for the step to finish (JAX dispatches async).
        if logs and "loss" in logs:
            float(logs["loss"])
        self.times.append(time.perf_counter() - self._t)

    def on_train_begin(self, logs=None):
        self.times = []


def variables_bytes(variables):
    """Bytes of `variables`, at their dtypes."""
    return sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in variables)


def state_bytes(optimizer, scratch=False):
    """Bytes of the optimizer's state (or of its dedup scratch, on JAX)."""
    if not isinstance(optimizer, sparseopt.DispatchOptimizer):  # plain Keras: all state
        variables = [] if scratch else optimizer.variables
    else:
        variables = optimizer.scratch_variables() if scratch else optimizer.state_variables()
    return variables_bytes(variables)


def time_steps(model, x, y, batch, steps):
    timer = StepTimer()
    n = batch * steps
    model.fit({k: v[:n] for k, v in x.items()}, y[:n], batch_size=batch, epochs=1,
              verbose=0, callbacks=[timer])
    return float(np.median(timer.times[2:])) * 1e3  # skip compilation


def train_in_chunks(model, train_x, train_y, val_x, val_y, args):
    """One pass over the training data in `args.chunks` chunks, printing validation
    loss, AUC and step time after each; returns the step times (compilation left out)."""
    timer, step_times = StepTimer(), []
    start = time.perf_counter()
    edges = np.linspace(0, args.examples, args.chunks + 1).astype(int)
    for lo, hi in zip(edges[:-1], edges[1:]):
        model.fit({k: v[lo:hi] for k, v in train_x.items()}, train_y[lo:hi],
                  batch_size=args.batch, epochs=1, verbose=0, callbacks=[timer])
        step_times.extend(timer.times[2:])
        loss, auc = model.evaluate(val_x, val_y, batch_size=8192, verbose=0)
        print(f"{hi:14,d} {loss:9.4f} {auc:8.3f} {np.median(timer.times[2:]) * 1e3:8.1f}",
              flush=True)
    print(f"trained in {time.perf_counter() - start:.0f} s")
    return step_times
