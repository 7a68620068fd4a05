"""The first training step: compile time with sparseopt against plain Keras.

    python benchmarks/first_step.py            # JAX and TensorFlow, batch 4,096 (~75 s)
    python benchmarks/first_step.py --backends jax --repeats 3

Users meet the first step at every start and at every new batch shape: on
JAX it is tracing and XLA's compile of the train step, on TensorFlow tracing
(and building the optimizer inside it). The model is dlrm_step.py's
Criteo-shaped one: 26 tables capped at 100,000 rows, width 16, 13 dense
features -> Dense(16), concatenated -> Dense(64) -> Dense(1), binary
cross-entropy, tables by Adagrad (0.05), the rest by Adam. Peers:
`sparseopt` (SparseEmbedding + DispatchOptimizer) and `keras`
(keras.layers.Embedding + Keras' Adagrad, through MultiOptimizer).

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


def child(peer, batch):
    """In a fresh process: `{build_s, first_step_s, step_s}` of one peer."""
    import numpy as np

    import dlrm_step

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


def measure(backend, peer, batch):
    env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    done = subprocess.run([sys.executable, __file__, "--child", peer, "--batch", str(batch)],
                          env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{backend} {peer} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", nargs="+", default=["jax", "tensorflow"])
    parser.add_argument("--batch", type=int, default=BATCH)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(HERE / "results" / "first_step.json"))
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.batch)))
        return
    import numpy as np

    results = {}
    for backend in args.backends:
        runs = {"keras": [], "sparseopt": []}
        for _ in range(args.repeats):
            for peer in runs:  # interleaved: the machine's noise falls on both
                runs[peer].append(measure(backend, peer, args.batch))
        results[backend] = {peer: {key: float(np.median([r[key] for r in rs]))
                                   for key in rs[0]} for peer, rs in runs.items()}
    print(f"Criteo-shaped model (26 tables <= {ROWS_CAP:,} rows, width {WIDTH}, Adagrad), "
          f"batch {args.batch:,}; medians of {args.repeats} fresh processes")
    print(f"{'backend':11s} {'peer':10s} {'build s':>8s} {'first step s':>13s} "
          f"{'step ms':>8s}")
    for backend, peers in results.items():
        for peer, r in peers.items():
            print(f"{backend:11s} {peer:10s} {r['build_s']:8.2f} {r['first_step_s']:13.2f} "
                  f"{r['step_s'] * 1e3:8.1f}")
        ratio = peers["sparseopt"]["first_step_s"] / peers["keras"]["first_step_s"]
        print(f"{backend:11s} first step sparseopt / keras: {ratio:.2f}x")
    pathlib.Path(args.out).parent.mkdir(exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(
        {"batch": args.batch, "rows_cap": ROWS_CAP, "width": WIDTH, "repeats": args.repeats,
         "results": results}, indent=1))


if __name__ == "__main__":
    main()
