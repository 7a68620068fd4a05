"""Memory to build a large table: sparseopt's `SparseEmbedding` against Keras' `Embedding`.

    python benchmarks/build_memory.py                    # 20,000,000 x 16 (1.19 GiB)
    python benchmarks/build_memory.py --rows 50000000 --width 32

One table of `rows x width` float32 with Keras' default `RandomUniform`
initializer is built in a fresh process per backend and layer (JAX and
TensorFlow; `SparseEmbedding` and `keras.layers.Embedding`), then its
optimizer (sparseopt: `DispatchOptimizer` with an Adagrad table, a
table-sized accumulator; Keras: Adagrad on the table), either with
`model.optimizer.build(...)` or the way `fit` does it by default: inside the
first train step (`train_on_batch`), which on TensorFlow is traced. Each
child reports its resident memory over the process' baseline after each
part, and the peak (`VmHWM`) while building it: the peak is what decides
whether a table fits. Writes benchmarks/results/build_memory.json.
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE))
from children import memory_mb, reset_peak_memory  # noqa: E402


def done(variables):
    """Waits for `variables` to be computed: JAX dispatches their initializers
    asynchronously. (TensorFlow runs them eagerly; a dense read there would copy a
    table that a sparse op has written, TensorFlow's copy-on-read mode.)"""
    import keras

    if keras.backend.backend() == "jax":
        import jax

        jax.block_until_ready([variable.value for variable in variables])


def child(layer, build, rows, width):
    import keras
    import numpy as np

    import sparseopt

    keras.utils.set_random_seed(0)
    base = memory_mb("VmRSS:")
    report = {"base_mb": base}
    reset_peak_memory()
    ids = keras.Input((4,), dtype="int32")
    if layer == "sparseopt":
        table = sparseopt.layers.SparseEmbedding(rows, width,
                                                 updater=sparseopt.updaters.Adagrad(0.1))
        optimizer = sparseopt.DispatchOptimizer(keras.optimizers.Adam())
    else:
        table = keras.layers.Embedding(rows, width)
        optimizer = keras.optimizers.Adagrad(0.1)
    model = keras.Model(ids, keras.layers.Dense(1)(keras.ops.sum(table(ids), axis=1)))
    done(model.variables)
    report["table"] = {"rss_mb": memory_mb("VmRSS:") - base, "peak_mb": memory_mb("VmHWM:") - base}
    reset_peak_memory()
    before = memory_mb("VmRSS:")
    model.compile(optimizer=optimizer, loss="mse")
    if build == "explicit":
        model.optimizer.build(model.trainable_variables)
    else:  # what `fit` does: the optimizer is built by the first step (one batch here)
        model.train_on_batch(np.zeros((8, 4), "int32"), np.zeros((8, 1), "float32"))
    done(model.optimizer.variables)
    report["optimizer"] = {"rss_mb": memory_mb("VmRSS:") - before,
                           "peak_mb": memory_mb("VmHWM:") - before}
    first = np.arange(1000, dtype="int32")  # a gather: drawn, not left at zero
    report["first_rows_std"] = float(np.std(keras.ops.convert_to_numpy(
        keras.ops.take(table.embeddings, first, axis=0))))
    print(json.dumps(report), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20_000_000)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child[1], args.child[2], args.rows, args.width)
    table_mb = args.rows * args.width * 4 / 2**20
    results = []
    for backend in ("jax", "tensorflow"):
        for layer in ("sparseopt", "keras"):
            for build in ("explicit", "first step"):
                env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
                proc = subprocess.run(
                    [sys.executable, __file__, "--rows", str(args.rows), "--width",
                     str(args.width), "--child", backend, layer, build],
                    env=env, capture_output=True, text=True)
                if proc.returncode != 0:
                    results.append({"backend": backend, "layer": layer, "build": build,
                                    "error": proc.stderr[-2000:]})
                    print(backend, layer, build, "failed:", proc.stderr[-500:])
                    continue
                report = json.loads(proc.stdout.strip().splitlines()[-1])
                results.append(dict(report, backend=backend, layer=layer, build=build))
    print(f"\nOne {args.rows:,} x {args.width} float32 table ({table_mb:,.0f} MB), "
          "MB over each process' baseline (peak: while building that part; the optimizer "
          "built by `optimizer.build` or by the first step, as `fit` does)\n")
    print("| backend | layer | table: held | table: peak | peak / table "
          "| optimizer built by | optimizer: held | optimizer: peak |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['backend']} | {r['layer']} | failed | | | {r['build']} | | |")
            continue
        t, o = r["table"], r["optimizer"]
        print(f"| {r['backend']} | {r['layer']} | {t['rss_mb']:,.0f} | {t['peak_mb']:,.0f} "
              f"| {t['peak_mb'] / table_mb:.2f}x | {r['build']} | {o['rss_mb']:,.0f} "
              f"| {o['peak_mb']:,.0f} |")
    out = HERE / "results" / "build_memory.json"
    out.write_text(json.dumps({"command": " ".join(["python", "benchmarks/build_memory.py",
                                                    *sys.argv[1:]]),
                               "rows": args.rows, "width": args.width, "table_mb": table_mb,
                               "results": results}, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
