"""The first training step: compile time with sparseopt against plain Keras.

    python benchmarks/first_step.py            # both models, JAX and TensorFlow (~4 min)
    python benchmarks/first_step.py --models criteo --backends jax --repeats 3

Users meet the first step at every start and at every new batch shape: on
JAX it is tracing and XLA's compile of the train step, on TensorFlow tracing
(and building the optimizer inside it). Two models:

- `criteo`: dlrm_step.py's Criteo-shaped one: 26 tables capped at 100,000
  rows, width 16, 13 dense features -> Dense(16), concatenated -> Dense(64)
  -> Dense(1), binary cross-entropy, tables by Adagrad (0.05), the rest by
  Adam. Peers: `sparseopt` (SparseEmbedding + DispatchOptimizer) and `keras`
  (keras.layers.Embedding + Keras' Adagrad, through MultiOptimizer).
- `mlperf`: the shape of keras-rs' MLPerf DLRM-DCNv2 example: the 26
  Criteo 1TB features with their multi-hot sizes (1 to 100 ids), the 9 with
  more than 21,000 rows in one keras-rs `DistributedEmbedding` (rows capped
  at 200,000 here, to fit this machine), the 17 others as
  `keras.layers.Embedding`, width 128, sum-pooled; bottom MLP 512-256-128,
  three keras-rs `FeatureCross` layers (projection 512), top MLP
  1024-1024-512-256-1, Adagrad (0.005), batch 1,024. Peers: `sparseopt`
  (`DispatchOptimizer(Adagrad)`: the large tables trained sparsely by their
  `TableConfig.optimizer`) and `keras` (Adagrad alone: keras-rs' CPU
  fallback trains them densely).

Each measurement is a fresh process (no JAX compilation cache, no warm
Python caches beyond the import), the peers interleaved: it times building
and compiling the model, the first `train_on_batch` (trace, compile, run),
and the median of the next five steps. Prints each peer's times and the
ratio sparseopt / keras of the first step, the medians over `--repeats`
processes each; writes benchmarks/results/first_step.json.
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE))

ROWS_CAP = 100_000
WIDTH = 16
BATCH = 4096


# keras-rs' MLPerf DLRM-DCNv2 example: (rows, ids per example) of each Criteo 1TB
# feature; those over EMBEDDING_THRESHOLD rows go to the DistributedEmbedding.
MLPERF_FEATURES = [
    (40_000_000, 3), (39_060, 2), (17_295, 1), (7_424, 2), (20_265, 6), (3, 1), (7_122, 1),
    (1_543, 1), (63, 1), (40_000_000, 7), (3_067_956, 3), (405_282, 8), (10, 1), (2_209, 6),
    (11_938, 9), (155, 5), (4, 1), (976, 1), (14, 1), (40_000_000, 12), (40_000_000, 100),
    (40_000_000, 27), (590_152, 10), (12_973, 3), (108, 1), (36, 1)]
EMBEDDING_THRESHOLD = 21_000
MLPERF_ROWS_CAP = 200_000
MLPERF_WIDTH = 128
MLPERF_BATCH = 1024


def mlperf_model(peer, batch):
    """keras-rs' MLPerf DLRM-DCNv2 shape (module docstring): `(model, x, y)`."""
    import keras
    import keras_rs
    import numpy as np

    import sparseopt

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    dense_in = keras.Input((13,), name="dense_features")
    x = {"dense_features": rng.normal(size=(batch, 13)).astype("float32")}
    features, large_in, small = {}, {}, []
    for i, (rows, hot) in enumerate(MLPERF_FEATURES):
        name = f"f{i}"
        rows = min(rows, MLPERF_ROWS_CAP)
        x[name] = rng.integers(0, rows, (batch, hot)).astype("int32")
        ids = keras.Input((hot,), dtype="int32", name=name)
        if MLPERF_FEATURES[i][0] > EMBEDDING_THRESHOLD:
            table = keras_rs.layers.TableConfig(
                name=f"t{i}", vocabulary_size=rows, embedding_dim=MLPERF_WIDTH, combiner="sum",
                optimizer=keras.optimizers.Adagrad(0.005))
            features[name] = keras_rs.layers.FeatureConfig(
                name=name, table=table, input_shape=(batch, hot),
                output_shape=(batch, MLPERF_WIDTH))
            large_in[name] = ids
        else:
            pooled = keras.ops.sum(keras.layers.Embedding(rows, MLPERF_WIDTH, name=f"e{i}")(ids),
                                   axis=-2)
            small.append((name, ids, pooled))
    large = keras_rs.layers.DistributedEmbedding(features, name="large")(large_in)
    h = dense_in
    for units in (512, 256, 128):
        h = keras.layers.Dense(units, activation="relu")(h)
    x0 = keras.ops.concatenate([h] + [p for _, _, p in small] + list(large.values()), axis=-1)
    xl = x0
    for _ in range(3):
        xl = keras_rs.layers.FeatureCross(projection_dim=512)(x0, xl)
    for units in (1024, 1024, 512, 256):
        xl = keras.layers.Dense(units, activation="relu")(xl)
    out = keras.layers.Dense(1, activation="sigmoid")(xl)
    inputs = {"dense_features": dense_in, **large_in, **{name: ids for name, ids, _ in small}}
    model = keras.Model(inputs, out)
    optimizer = keras.optimizers.Adagrad(0.005)
    if peer == "sparseopt":
        optimizer = sparseopt.DispatchOptimizer(optimizer)
    model.compile(optimizer=optimizer, loss="binary_crossentropy")
    y = (rng.random((batch, 1)) < 0.3).astype("float32")
    return model, x, y


def child(model_name, peer, batch):
    """In a fresh process: `{build_s, first_step_s, step_s}` of one peer."""
    import numpy as np

    import dlrm_step

    start = time.perf_counter()
    if model_name == "mlperf":
        model, x, y = mlperf_model(peer, batch)
        xs, ys = [x], [y]
    else:
        tables = dlrm_step.tables_of("criteo", ROWS_CAP)
        xs, ys = dlrm_step.make_batches(tables, batch)
        start = time.perf_counter()
        model = dlrm_step.build_keras(f"{os.environ['KERAS_BACKEND']}-{peer}", tables, WIDTH,
                                      "adagrad")
    built = time.perf_counter()
    model.train_on_batch(xs[0], ys[0])
    first = time.perf_counter()
    steps = []
    for i in range(5):
        t = time.perf_counter()
        model.train_on_batch(xs[(i + 1) % len(xs)], ys[(i + 1) % len(ys)])
        steps.append(time.perf_counter() - t)
    return {"build_s": built - start, "first_step_s": first - built,
            "step_s": float(np.median(steps))}


def measure(model, backend, peer, batch):
    env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    done = subprocess.run([sys.executable, __file__, "--child", peer, "--model", model,
                           "--batch", str(batch)],
                          env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{model} {backend} {peer} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def batch_of(model, args):
    """The batch size `model` is measured at (`--batch`, else its own default)."""
    return args.batch or (MLPERF_BATCH if model == "mlperf" else BATCH)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["criteo", "mlperf"])
    parser.add_argument("--backends", nargs="+", default=["jax", "tensorflow"])
    parser.add_argument("--batch", type=int, help="batch size of both models (default: "
                        f"criteo {BATCH:,}, mlperf {MLPERF_BATCH:,})")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="criteo", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(HERE / "results" / "first_step.json"))
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.model, args.child, batch_of(args.model, args))))
        return
    import numpy as np

    results = {}
    for model in args.models:
        for backend in args.backends:
            runs = {"keras": [], "sparseopt": []}
            for _ in range(args.repeats):
                for peer in runs:  # interleaved: the machine's noise falls on both
                    runs[peer].append(measure(model, backend, peer, batch_of(model, args)))
            results[f"{model} {backend}"] = {
                peer: {key: float(np.median([r[key] for r in rs])) for key in rs[0]}
                | {"first_step_runs_s": [r["first_step_s"] for r in rs]}
                for peer, rs in runs.items()}
    print(f"criteo: 26 tables <= {ROWS_CAP:,} rows, width {WIDTH}, batch "
          f"{batch_of('criteo', args):,}; mlperf: keras-rs' DLRM-DCNv2 shape, 9 large tables "
          f"<= {MLPERF_ROWS_CAP:,} rows, width {MLPERF_WIDTH}, batch "
          f"{batch_of('mlperf', args):,}; medians of {args.repeats} fresh processes")
    print(f"{'model':7s} {'backend':11s} {'peer':10s} {'build s':>8s} {'first step s':>13s} "
          f"{'step ms':>8s}")
    for key, peers in results.items():
        model, backend = key.split()
        for peer, r in peers.items():
            print(f"{model:7s} {backend:11s} {peer:10s} {r['build_s']:8.2f} "
                  f"{r['first_step_s']:13.2f} {r['step_s'] * 1e3:8.1f}")
        ratio = peers["sparseopt"]["first_step_s"] / peers["keras"]["first_step_s"]
        print(f"{model:7s} {backend:11s} first step sparseopt / keras: {ratio:.2f}x")
    pathlib.Path(args.out).parent.mkdir(exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(
        {"batch": {m: batch_of(m, args) for m in args.models}, "rows_cap": ROWS_CAP,
         "width": WIDTH,
         "mlperf_rows_cap": MLPERF_ROWS_CAP, "mlperf_width": MLPERF_WIDTH,
         "repeats": args.repeats, "results": results}, indent=1))


if __name__ == "__main__":
    main()
