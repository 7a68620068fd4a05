"""A DLRM-style click model on synthetic data, its tables trained by sparseopt.

13 dense features and 26 categorical features (tables from 4 to 1,000,000
rows), a bottom MLP, DLRM's pairwise dot-product interaction and a top MLP.
The dense layers are trained by Adam; each table by its own sparse updater
(Adagrad, row-wise Adagrad or FTRL), in place, on the rows the batch touches.

The labels carry a learnable signal: each id of each feature has a hidden
click propensity, and the click probability is a logistic function of their
sum plus a linear term of the dense features. As recommender models usually
are, it trains in one pass over fresh data (repeated epochs would memorize the
rare ids); the validation loss is reported after each chunk of the stream and
should fall well below that of a constant predictor, towards that of the true
click probabilities (the best any model can do).

At the end the same architecture is trained for a few steps the way most
users start: `keras.layers.Embedding` + `keras.optimizers.Adam` for everything.
Step time and optimizer memory are compared.

    KERAS_BACKEND=jax python examples/dlrm_synthetic.py     # the `make demo` run, ~1 min
    python examples/dlrm_synthetic.py --examples 5000000 --scale 10
"""

import argparse
import os
import time

os.environ.setdefault("KERAS_BACKEND", "jax")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras import ops  # noqa: E402

import sparseopt  # noqa: E402

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


def build_dlrm(table_sizes, width, sparse=True):
    dense_in = keras.Input((NUM_DENSE,), name="dense")
    ids_in = keras.Input((len(table_sizes),), dtype="int32", name="ids")
    bottom = mlp(dense_in, [64, width], "bottom")
    embeddings = []
    for f, rows in enumerate(table_sizes):
        col = ops.take(ids_in, [f], axis=1)
        if sparse:
            layer = sparseopt.layers.SparseEmbedding(rows, width, updater=updater_for(rows),
                                                     combiner="sum", name=f"table_{f}")
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


def state_bytes(optimizer, scratch=False):
    """Bytes of the optimizer's state (or of its dedup scratch, on JAX)."""
    return sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in optimizer.variables
               if ("dedup_workspace" in v.path) == scratch)


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


def main():
    parser = argparse.ArgumentParser(description="DLRM on synthetic clicks with sparseopt.")
    parser.add_argument("--examples", type=int, default=2_400_000)
    parser.add_argument("--chunks", type=int, default=6, help="validation points in the pass")
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies table sizes")
    parser.add_argument("--compare-steps", type=int, default=25,
                        help="plain-Keras steps to time (0 to skip)")
    args = parser.parse_args()
    keras.utils.set_random_seed(0)
    sizes = [max(4, int(s * args.scale)) for s in TABLE_SIZES]
    x, y, prob = synthetic_clicks(args.examples + VALIDATION_EXAMPLES, sizes)
    (train_x, val_x), (train_y, val_y) = split_at(x, args.examples), split_at(y, args.examples)

    print(f"sparseopt {sparseopt.__version__} on Keras {keras.__version__} "
          f"({keras.backend.backend()} backend)")
    print(f"{len(sizes)} tables, {sum(sizes):,} rows x {args.width}; one pass over "
          f"{args.examples:,} examples, click rate {float(y.mean()):.3f}")
    kinds = {}
    for rows in sizes:
        kinds.setdefault(type(updater_for(rows)).__name__, []).append(rows)
    for kind, rows in kinds.items():
        print(f"  {kind:15s} {len(rows):2d} tables, {sum(rows):>9,} rows")

    model = build_dlrm(sizes, args.width, sparse=True)
    optimizer = sparseopt.DispatchOptimizer(keras.optimizers.Adam(1e-3))
    model.compile(optimizer=optimizer, loss="binary_crossentropy",
                  metrics=[keras.metrics.AUC(name="auc")])
    bce = lambda p: float(np.mean(keras.losses.binary_crossentropy(val_y, p)))  # noqa: E731
    print(f"\nvalidation loss of a constant predictor: {bce(np.full_like(val_y, y.mean())):.4f}; "
          f"of the true click probabilities: {bce(prob[args.examples:]):.4f}")
    print(f"{'examples seen':>14s} {'val loss':>9s} {'val AUC':>8s} {'ms/step':>8s}")
    loss, auc = model.evaluate(val_x, val_y, batch_size=8192, verbose=0)
    print(f"{0:14,d} {loss:9.4f} {auc:8.3f}")
    step_times = train_in_chunks(model, train_x, train_y, val_x, val_y, args)
    sparse_ms = float(np.median(step_times)) * 1e3
    sparse_state = state_bytes(optimizer)
    dropped = sum(int(ops.convert_to_numpy(l.num_dropped_ids)) for l in model.layers
                  if isinstance(l, sparseopt.layers.SparseEmbedding))
    print(f"ids dropped as out of range: {dropped}; table steps skipped for non-finite "
          f"gradients: {sum(optimizer.skipped_steps().values())}")

    table_bytes = sum(sizes) * args.width * 4
    print("\n== sparseopt vs plain Keras (Embedding + Adam on everything) ==")
    rows = [("sparseopt: DispatchOptimizer(Adam) + sparse updaters", sparse_ms, sparse_state)]
    if args.compare_steps:
        keras.utils.set_random_seed(0)
        plain = build_dlrm(sizes, args.width, sparse=False)
        plain_opt = keras.optimizers.Adam(1e-3)
        plain.compile(optimizer=plain_opt, loss="binary_crossentropy")
        plain_ms = time_steps(plain, train_x, train_y, args.batch, args.compare_steps)
        rows.append(("plain Keras: Embedding + Adam", plain_ms, state_bytes(plain_opt)))
    print(f"{'':55s} {'ms/step':>8s} {'optimizer state':>16s} {'state/tables':>13s}")
    for name, ms, nbytes in rows:
        print(f"{name:55s} {ms:8.1f} {nbytes / 2**20:13.1f} MB {nbytes / table_bytes:12.2f}x")
    if len(rows) == 2:
        print(f"sparseopt step: {rows[1][1] / rows[0][1]:.1f}x faster; optimizer state: "
              f"{rows[1][2] / rows[0][2]:.1f}x smaller (tables: {table_bytes / 2**20:.0f} MB)")
    scratch = state_bytes(optimizer, scratch=True)
    if scratch:
        print(f"(plus {scratch / 2**20:.1f} MB of dedup workspace on JAX: 4 bytes per row, "
              "scratch, not saved)")


if __name__ == "__main__":
    main()
