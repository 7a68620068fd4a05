"""Step time and peak memory vs table size: sparseopt next to plain Keras.

The same model (ids [batch, 16] -> table [V, 32] -> sum -> Dense(1)) is
trained with
  * sparseopt: SparseEmbedding(updater=Adagrad) + DispatchOptimizer(Adam)
  * plain Keras: keras.layers.Embedding + keras.optimizers.Adagrad
at each table size, every configuration in its own subprocess (so its memory
is its own), side by side in one run. Prints a markdown table and the target
ratios, and writes benchmarks/results/table_scaling_<backend>_<ids>[_hugepages].json.

Two id distributions (--ids):
  * hot:     every batch draws its 16k ids from one fixed set of 8192 rows
             spread over the table, so each batch touches ~7.1k distinct rows
             at every table size: equal work, which is what "cost does not grow
             with the vocabulary" is about (the target row);
  * uniform: ids uniform over the table; a 10k-row table then sees ~8k
             distinct rows per batch and a 20M-row table ~16k, all cold.

Step time is the marginal cost of a step: (time of fit(S2 steps) - time of
fit(S1 steps)) / (S2 - S1), so Keras' fixed per-`fit` work is left out. All
sizes of one library are alive at once and timed round-robin, one timing per
size per round, so that the machine's noise falls on every size alike; the
tables report the median over rounds.
"Train RSS" is the peak resident memory while training (the peak counter is
reset after the model and its state exist); "peak RSS" is the whole process.

    python benchmarks/table_scaling.py                    # JAX, 1e4 .. 2e7 rows
    python benchmarks/table_scaling.py --backend tensorflow
    python benchmarks/table_scaling.py --quick            # small sizes, ~1 minute
    python benchmarks/table_scaling.py --hugepages        # back big arrays by 2 MB pages
    python benchmarks/table_scaling.py --backend tensorflow --jit-compile true --quick

On TensorFlow the run also times `model.train_step` alone and the table
update alone next to a bare tf.function calling TF's own sparse-apply kernel
on the same ids (the floor on that backend).
"""

import argparse
import json
import os
import pathlib
import platform
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from children import drive, memory_mb, reset_peak_memory  # noqa: E402

SIZES = [10_000, 100_000, 1_000_000, 4_000_000, 20_000_000]
QUICK_SIZES = [10_000, 100_000, 1_000_000]
RESULTS = pathlib.Path(__file__).parent / "results"


HOT_ROWS = 8192


def serve(library, rows, width, batch, ids_per_example, distribution, budget_s, jit_compile):
    """Child process: builds the model, then answers `time` / `result` on stdin."""
    import resource

    import keras
    import numpy as np

    import sparseopt

    keras.utils.set_random_seed(0)
    ids = keras.Input((ids_per_example,), dtype="int32")
    if library == "sparseopt":
        emb = sparseopt.layers.SparseEmbedding(
            rows, width, updater=sparseopt.updaters.Adagrad(0.05), combiner="sum", name="emb")
        x = emb(ids)
        optimizer = sparseopt.DispatchOptimizer(keras.optimizers.Adam(1e-3))
    else:
        x = keras.ops.sum(keras.layers.Embedding(rows, width, name="emb")(ids), axis=1)
        optimizer = keras.optimizers.Adagrad(0.05)
    model = keras.Model(ids, keras.layers.Dense(1)(x))
    model.compile(optimizer=optimizer, loss="mse", jit_compile=jit_compile)
    rng = np.random.default_rng(0)
    if distribution == "hot":
        hot = rng.choice(rows, size=min(HOT_ROWS, rows), replace=False)
        make_x = lambda n: hot[rng.integers(0, hot.size, size=(n, ids_per_example))]  # noqa: E731
    else:
        make_x = lambda n: rng.integers(0, rows, size=(n, ids_per_example))  # noqa: E731
    data_x = make_x(batch * 64).astype("int32")
    data_y = rng.normal(size=(batch * 64, 1)).astype("float32")

    def fit(steps):
        xs = np.resize(data_x, (steps * batch, ids_per_example))
        ys = np.resize(data_y, (steps * batch, 1))
        if keras.backend.backend() == "tensorflow":
            # Keras' own tf.data pipeline for arrays runs the tf.data autotuner,
            # whose thread on 2 cores makes each `fit` call randomly 2 ms/step
            # slower (plain Keras too). A batched dataset without it is stable.
            import tensorflow as tf

            options = tf.data.Options()
            options.autotune.enabled = False
            data = tf.data.Dataset.from_tensor_slices((xs, ys)).batch(batch).with_options(options)
            start = time.perf_counter()
            model.fit(data, verbose=0)
            return time.perf_counter() - start
        start = time.perf_counter()
        model.fit(xs, ys, batch_size=batch, verbose=0, shuffle=False)
        return time.perf_counter() - start

    fit(2)  # compile
    reset_peak_memory()
    probe = fit(3) / 3
    short, long = 2, 2 + max(3, min(200, int(budget_s / max(probe, 1e-4))))
    state_bytes = sum(
        int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in optimizer.variables)
    distinct = np.mean([np.unique(data_x[i * batch:(i + 1) * batch]).size for i in range(8)])
    times = []
    update_fns = {}
    if keras.backend.backend() == "tensorflow":
        update_fns["train_step"] = _train_step_timer(model, data_x[:batch], data_y[:batch],
                                                     jit_compile is True)
        if library == "sparseopt":
            update_fns.update(_update_timers(model, optimizer, data_x[:batch], width))
    update_times = {name: [] for name in update_fns}
    print("ready", flush=True)
    for command in sys.stdin:
        if command.strip() == "time":
            times.append((fit(long) - fit(short)) / (long - short))
            for name, fn in update_fns.items():
                update_times[name].append(_time_calls(fn, budget_s / 4))
            print("ok", flush=True)
            continue
        print(json.dumps({
            "library": library, "rows": rows, "width": width, "batch": batch,
            "ids": distribution, "ids_per_step": batch * ids_per_example,
            "distinct_ids_per_step": float(distinct), "steps_timed": long - short,
            "step_ms": [t * 1e3 for t in times],
            "median_step_ms": float(np.median(times) * 1e3),
            "min_step_ms": float(np.min(times) * 1e3),
            "train_rss_mb": memory_mb("VmHWM:"),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "optimizer_state_mb": state_bytes / 2**20,
            "table_mb": rows * width * 4 / 2**20,
            "update_ms": {k: [t * 1e3 for t in v] for k, v in update_times.items()},
            "median_update_ms": {k: float(np.median(v) * 1e3) for k, v in update_times.items()},
        }), flush=True)
        return


def _train_step_timer(model, x, y, jit_compile):
    """TF only: `model.train_step` as one tf.function on a fixed batch.

    The step without Keras' `fit` loop (data pipeline, callbacks): what the
    table size can change.
    """
    import tensorflow as tf

    step = tf.function(model.train_step, jit_compile=jit_compile)
    batch = (tf.constant(x), tf.constant(y))
    return lambda: step(batch)


def _update_timers(model, optimizer, batch_ids, width):
    """TF only: the table update alone, next to TF's own sparse-apply kernel.

    All three update the model's table and Adagrad accumulator on one batch's
    ids (duplicates included) with random gradients:
      * sparseopt_rule: sparseopt's update for the benchmark's Adagrad (Keras
        form, epsilon inside the root: dedup, gather, rule, scatter);
      * sparseopt_kernel: sparseopt's update for Adagrad(epsilon=0), which it
        hands to ResourceSparseApplyAdagradV2 after dedup;
      * tf_kernel: the floor, a bare tf.function calling
        ResourceSparseApplyAdagradV2 on the raw ids (no dedup, so duplicate
        ids are applied one by one: cheaper, and not the same result).
    """
    import numpy as np
    import tensorflow as tf

    import sparseopt
    from sparseopt.sparse_apply import sparse_apply

    emb = model.get_layer("emb")
    table = emb.embeddings
    slots = {"accumulator": next(v for v in optimizer.variables
                                 if v.path.endswith("embeddings_accumulator"))}
    ids = tf.constant(np.asarray(batch_ids).reshape(-1))
    grads = tf.constant(np.random.default_rng(1).normal(
        size=(ids.shape[0], width)).astype("float32") * 1e-3)
    lr, step = tf.constant(1e-6), tf.constant(1)
    rule = sparseopt.updaters.Adagrad(1e-6)
    fused = sparseopt.updaters.Adagrad(1e-6, epsilon=0.0)

    @tf.function
    def tf_kernel():
        tf.raw_ops.ResourceSparseApplyAdagradV2(
            var=table.value.handle, accum=slots["accumulator"].value.handle, lr=lr,
            epsilon=tf.constant(1e-7), grad=grads, indices=ids)

    return {
        "sparseopt_rule": tf.function(lambda: sparse_apply(rule, table, slots, ids, grads, lr, step)),
        "sparseopt_kernel": tf.function(lambda: sparse_apply(fused, table, slots, ids, grads, lr, step)),
        "tf_kernel": tf_kernel,
    }


def _time_calls(fn, budget_s):
    """Seconds per call of `fn`, after a warm-up, over about `budget_s`."""
    fn()
    start, calls = time.perf_counter(), 0
    while calls < 20 or time.perf_counter() - start < budget_s:
        fn()
        calls += 1
    return (time.perf_counter() - start) / calls


def run_library(args, library, sizes):
    """Starts one child per size, times them round-robin, returns their results."""
    env = dict(os.environ, KERAS_BACKEND=args.backend, TF_CPP_MIN_LOG_LEVEL="2")
    if args.hugepages:
        # glibc >= 2.35: madvise(MADV_HUGEPAGE) on malloc's large mappings, i.e. on
        # XLA's/TF's table buffers, where transparent huge pages are "madvise".
        env["GLIBC_TUNABLES"] = "glibc.malloc.hugetlb=1"
    children = {}
    for rows in sizes:
        cmd = [sys.executable, __file__, "--child", library, str(rows),
               "--backend", args.backend, "--width", str(args.width), "--batch", str(args.batch),
               "--ids-per-example", str(args.ids_per_example), "--ids", args.ids,
               "--budget", str(args.budget), "--jit-compile", args.jit_compile]
        child = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        if child.stdout.readline().strip() != "ready":  # build one at a time: less memory
            raise RuntimeError(f"{library} {rows:,} rows failed:\n{child.stderr.read()[-2000:]}")
        children[rows] = child
    return drive(children.values(), args.repeats)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="jax", choices=["jax", "tensorflow"])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sizes", type=int, nargs="*")
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--ids-per-example", type=int, default=16)
    parser.add_argument("--ids", default="hot", choices=["hot", "uniform"])
    parser.add_argument("--budget", type=float, default=1.0,
                        help="seconds of steps per timing (sets the step counts)")
    parser.add_argument("--repeats", type=int, default=7, help="interleaved timing rounds")
    parser.add_argument("--hugepages", action="store_true",
                        help="ask glibc for transparent huge pages (see docs/benchmarks.md)")
    parser.add_argument("--jit-compile", default="auto", choices=["auto", "true", "false"],
                        help="passed to model.compile (Keras resolves 'auto' to False on TF/CPU)")
    parser.add_argument("--child", nargs=2, metavar=("LIBRARY", "ROWS"))
    args = parser.parse_args()
    if args.child:
        serve(args.child[0], int(args.child[1]), args.width, args.batch,
              args.ids_per_example, args.ids, args.budget,
              {"auto": "auto", "true": True, "false": False}[args.jit_compile])
        return

    sizes = args.sizes or (QUICK_SIZES if args.quick else SIZES)
    by_lib = {lib: {r["rows"]: r for r in run_library(args, lib, sizes)}
              for lib in ("sparseopt", "plain_keras")}
    print(f"backend {args.backend}, ids '{args.ids}', width {args.width}, batch {args.batch} x "
          f"{args.ids_per_example} ids, median (min) of {args.repeats} interleaved rounds"
          f"{', huge pages' if args.hugepages else ''}"
          f"{', jit_compile=True' if args.jit_compile == 'true' else ''}\n\n"
          "| rows | distinct ids/step | sparseopt ms/step | plain Keras ms/step | speed-up | "
          "sparseopt train RSS MB | plain train RSS MB | sparseopt opt. state MB | "
          "plain opt. state MB |\n|---|---|---|---|---|---|---|---|---|")
    for rows in sizes:
        s, p = by_lib["sparseopt"][rows], by_lib["plain_keras"][rows]
        print(f"| {rows:,} | {s['distinct_ids_per_step']:.0f} | {s['median_step_ms']:.2f} "
              f"({s['min_step_ms']:.2f}) | {p['median_step_ms']:.1f} ({p['min_step_ms']:.1f}) | "
              f"{p['median_step_ms'] / s['median_step_ms']:.1f}x | "
              f"{s['train_rss_mb']:.0f} | {p['train_rss_mb']:.0f} | "
              f"{s['optimizer_state_mb']:.0f} | {p['optimizer_state_mb']:.0f} |")

    sparse, plain = by_lib["sparseopt"], by_lib["plain_keras"]
    lo, hi = min(sizes), max(sizes)
    mid = 4_000_000 if 4_000_000 in sizes else hi
    summary = {
        "flatness": sparse[hi]["median_step_ms"] / sparse[lo]["median_step_ms"],
        "flatness_min": sparse[hi]["min_step_ms"] / sparse[lo]["min_step_ms"],
        "speedup_vs_plain": plain[mid]["median_step_ms"] / sparse[mid]["median_step_ms"],
    }
    print(f"\nsparseopt step time at {hi:,} rows / at {lo:,} rows: "
          f"{summary['flatness']:.2f}x on medians, {summary['flatness_min']:.2f}x on minima "
          "(target <= 1.2x)")
    print(f"plain Keras / sparseopt step time at {mid:,} rows: "
          f"{summary['speedup_vs_plain']:.1f}x (target >= 30x)")
    if "train_step" in sparse[lo].get("median_update_ms", {}):
        print("\n`model.train_step` alone, as one tf.function on a fixed batch (no `fit` loop):\n\n"
              "| rows | sparseopt ms | plain Keras ms | speed-up |\n|---|---|---|---|")
        for rows in sizes:
            s_ms = sparse[rows]["median_update_ms"]["train_step"]
            p_ms = plain[rows]["median_update_ms"]["train_step"]
            print(f"| {rows:,} | {s_ms:.2f} | {p_ms:.1f} | {p_ms / s_ms:.1f}x |")
        summary["flatness_train_step"] = (sparse[hi]["median_update_ms"]["train_step"]
                                          / sparse[lo]["median_update_ms"]["train_step"])
        print(f"\nsparseopt train_step at {hi:,} rows / at {lo:,} rows: "
              f"{summary['flatness_train_step']:.2f}x (target <= 1.2x)")
    if sparse[lo].get("median_update_ms"):
        print("\nThe table update alone (one batch's ids), against TF's own kernel:\n\n"
              "| rows | sparseopt Adagrad (rule) ms | sparseopt Adagrad eps=0 (TF kernel) ms | "
              "bare ResourceSparseApplyAdagradV2 ms | rule / bare | kernel / bare |\n"
              "|---|---|---|---|---|---|")
        for rows in sizes:
            u = sparse[rows]["median_update_ms"]
            print(f"| {rows:,} | {u['sparseopt_rule']:.2f} | {u['sparseopt_kernel']:.2f} | "
                  f"{u['tf_kernel']:.2f} | {u['sparseopt_rule'] / u['tf_kernel']:.2f}x | "
                  f"{u['sparseopt_kernel'] / u['tf_kernel']:.2f}x |")
        worst = max(sparse[r]["median_update_ms"]["sparseopt_rule"]
                    / sparse[r]["median_update_ms"]["tf_kernel"] for r in sizes)
        summary["update_vs_tf_kernel_worst"] = worst
        print(f"\nworst sparseopt update / bare TF kernel: {worst:.2f}x (target <= 1.2x)")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / (f"table_scaling_{args.backend}_{args.ids}"
                     f"{'_hugepages' if args.hugepages else ''}"
                     f"{'_jit' if args.jit_compile == 'true' else ''}"
                     f"{'_quick' if args.quick else ''}.json")
    out.write_text(json.dumps({
        "backend": args.backend, "hugepages": args.hugepages, "jit_compile": args.jit_compile, "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "summary": summary,
        "results": [r for lib in by_lib.values() for r in lib.values()]}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
