"""keras-rs DistributedEmbedding on CPU: sparseopt's per-table updates vs keras-rs as is.

One table (TableConfig.optimizer = Adagrad, width 32) of growing size, bags of
16 ids drawn from 8,192 hot rows spread over the table, batches of 1,024, a Dense head. The same
model is compiled two ways and timed side by side in one process per backend:

- `DispatchOptimizer(Adam)`: the table is trained in place by sparse Adagrad
  (its TableConfig.optimizer), Adam trains the head;
- `Adam` alone: keras-rs' fallback as it is, Adam trains the table densely.

    python benchmarks/keras_rs_fallback.py                 # both backends, ~3 min
    python benchmarks/keras_rs_fallback.py --rows 10000,1000000 --backends jax

Prints median ms/step, the ratio, and optimizer state per table byte; writes
benchmarks/results/keras_rs_fallback.json.
"""

import argparse
import json
import os
import subprocess
import sys
import time

import common

HERE = os.path.dirname(os.path.abspath(__file__))
WIDTH, BAG, BATCH, HOT = 32, 16, 1024, 8192


def child(rows_list, steps):
    import keras
    import keras_rs
    import numpy as np

    import sparseopt

    rng = np.random.default_rng(0)
    results = []
    for rows in rows_list:
        for how in ["sparseopt", "keras-rs as is"]:
            keras.backend.clear_session()
            keras.utils.set_random_seed(0)
            table = keras_rs.layers.TableConfig(
                name="t", vocabulary_size=rows, embedding_dim=WIDTH, combiner="sum",
                optimizer=keras.optimizers.Adagrad(0.05))
            feature = keras_rs.layers.FeatureConfig(
                name="f", table=table, input_shape=(BATCH, BAG), output_shape=(BATCH, WIDTH))
            ids = keras.Input((BAG,), dtype="int32", name="f")
            out = keras_rs.layers.DistributedEmbedding({"f": feature})({"f": ids})["f"]
            model = keras.Model({"f": ids}, keras.layers.Dense(1)(out))
            optimizer = (sparseopt.DispatchOptimizer(keras.optimizers.Adam(1e-3))
                         if how == "sparseopt" else keras.optimizers.Adam(1e-3))
            model.compile(optimizer=optimizer, loss="mse")
            x = {"f": common.hot_ids(rng, rows, (BATCH * steps, BAG), hot_rows=HOT)}
            y = rng.normal(size=(BATCH * steps, 1)).astype("float32")
            times = []

            class Timer(keras.callbacks.Callback):
                def on_train_batch_begin(self, batch, logs=None):
                    self.t = time.perf_counter()

                def on_train_batch_end(self, batch, logs=None):
                    float(logs["loss"])  # wait for the step (JAX dispatches async)
                    times.append(time.perf_counter() - self.t)

            model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[Timer()])
            opt = model.optimizer  # Adam alone has no scratch to leave out
            saved = opt.state_variables() if how == "sparseopt" else opt.variables
            state = sum(int(np.prod(v.shape)) * 4 for v in saved)
            results.append({"backend": keras.backend.backend(), "rows": rows, "how": how,
                            "median_ms": 1e3 * float(np.median(times[steps // 3:])),
                            "state_per_table_byte": state / (rows * WIDTH * 4)})
            print(json.dumps({"progress": results[-1]}), flush=True)
    print(json.dumps({"results": results}), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", default="jax,tensorflow")
    parser.add_argument("--rows", default="10000,1000000,4000000")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "keras_rs_fallback.json"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    if args.child:
        return child(rows, args.steps)
    results = []
    for backend in args.backends.split(","):
        env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
        proc = subprocess.run([sys.executable, __file__, "--child", "--rows", args.rows,
                               "--steps", str(args.steps)], env=env, capture_output=True,
                              text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{backend} failed:\n{proc.stderr[-3000:]}")
        last = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        results += last[-1]["results"]
    print(f"{'backend':10s} {'rows':>10s} {'sparseopt ms':>13s} {'keras-rs ms':>12s} "
          f"{'speed-up':>9s} {'state/table: sparseopt':>23s} {'keras-rs':>9s}")
    for backend in args.backends.split(","):
        for r in rows:
            a, b = (next(x for x in results if x["backend"] == backend and x["rows"] == r
                         and x["how"] == how) for how in ["sparseopt", "keras-rs as is"])
            print(f"{backend:10s} {r:>10,d} {a['median_ms']:13.2f} {b['median_ms']:12.2f} "
                  f"{b['median_ms'] / a['median_ms']:8.1f}x {a['state_per_table_byte']:23.2f} "
                  f"{b['state_per_table_byte']:9.2f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
