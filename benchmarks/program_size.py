"""What the sparse step adds to the compiled JAX program, per table and per option.

    python benchmarks/program_size.py                   # every configuration (~6 min)
    python benchmarks/program_size.py --configs keras adagrad --tables 26

XLA:CPU's compile time follows the code it generates (docs/benchmarks.md, "The
first step"), so this compiles the train step of `dlrm_step.py`'s Criteo-shaped
model (tables capped at 100,000 rows, width 16, batch 4,096) and counts, from
XLA's own dumps (`--xla_dump_to`): the fused kernels of the optimized program,
the distinct kernels XLA compiles (identical ones are compiled once), and the
bytes of optimized LLVM IR, with the compile time beside them. One fresh
process per configuration (no compilation cache). Configurations: plain Keras
(`keras.layers.Embedding` + Adagrad), and sparseopt's tables with Adagrad as
they are and with one option or storage at a time (`clipnorm`, decoupled
`weight_decay`, `lazy=False`, `ema_momentum`, `swa_period`,
`lookahead_period`, a bfloat16 table, an int8 table, table groups). Prints
each one's figures per table against plain Keras; writes
benchmarks/results/program_size.json. Also the way to compare two checkouts'
programs (run it in each).
"""

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE))

ROWS_CAP, WIDTH, BATCH = 100_000, 16, 4096
# name -> (peer, updater options, table dtype, group_tables)
CONFIGS = {
    "keras": ("keras", {}, None, False),
    "adagrad": ("sparseopt", {}, None, False),
    "clipnorm": ("sparseopt", {"clipnorm": 1.0}, None, False),
    "weight_decay": ("sparseopt", {"weight_decay": 1e-4}, None, False),
    "lazy=False": ("sparseopt", {"weight_decay": 1e-4, "lazy": False}, None, False),
    "ema_momentum": ("sparseopt", {"ema_momentum": 0.99}, None, False),
    "swa_period": ("sparseopt", {"swa_period": 10}, None, False),
    "lookahead_period": ("sparseopt", {"lookahead_period": 5}, None, False),
    "bfloat16": ("sparseopt", {}, "bfloat16", False),
    "int8": ("sparseopt", {}, "int8", False),
    "group_tables": ("sparseopt", {}, None, True),
}


def child(name, tables_count, dump):
    """In a fresh process: compiles one configuration's step (dumping to `dump`)."""
    import jax
    import jax.monitoring
    import keras

    import common
    import dlrm_step
    import sparseopt

    peer, options, dtype, group = CONFIGS[name]
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **_: compiles.append(secs)
        if event.endswith("backend_compile_duration") else None)
    tables = dict(list(dlrm_step.tables_of("criteo", ROWS_CAP).items())[:tables_count])
    xs, ys = dlrm_step.make_batches(tables, BATCH)
    keras.utils.set_random_seed(0)
    sparse = peer == "sparseopt"
    specs = {t: (rows, sparseopt.updaters.Adagrad(0.05, **options) if sparse
                 else keras.optimizers.Adagrad(0.05), bag) for t, (rows, bag) in tables.items()}
    model = common.recommender(
        specs, WIDTH, sparse=sparse, dense_features=dlrm_step.DENSE_FEATURES, bottom=WIDTH,
        top=(dlrm_step.TOP,), loss=keras.losses.BinaryCrossentropy(from_logits=True),
        dense_optimizer=keras.optimizers.Adam(1e-3), table_dtype=dtype)
    if group:
        model.optimizer.group_tables = True
    compiles.clear()
    start = time.perf_counter()
    model.train_on_batch(xs[0], ys[0])
    return {"first_step_s": time.perf_counter() - start, "compile_s": max(compiles)}


def program(dump):
    """`{fusions, kernels, ir_bytes}` of the largest `jit_train_step` module in `dump`."""
    files = os.listdir(dump)
    optimized = [f for f in files if "jit_train_step" in f
                 and f.endswith("cpu_after_optimizations.txt")]
    text = (pathlib.Path(dump) / max(optimized, key=lambda f: os.path.getsize(
        pathlib.Path(dump) / f))).read_text()
    module = optimized[0].split(".")[0]
    entry = text[text.index("\nENTRY"):]
    ir = [f for f in files if f.startswith(module + ".") and f.endswith("ir-with-opt.ll")]
    return {"fusions": len(re.findall(r" fusion\(", entry)), "kernels": len(ir),
            "ir_bytes": sum(os.path.getsize(pathlib.Path(dump) / f) for f in ir)}


def measure(name, tables_count):
    with tempfile.TemporaryDirectory() as dump:
        env = {**os.environ, "KERAS_BACKEND": "jax", "TF_CPP_MIN_LOG_LEVEL": "3",
               "XLA_FLAGS": f"--xla_dump_to={dump} --xla_dump_hlo_as_text"}
        env.pop("JAX_COMPILATION_CACHE_DIR", None)
        done = subprocess.run([sys.executable, __file__, "--child", name,
                               "--tables", str(tables_count)],
                              env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{name} failed:\n{done.stderr[-3000:]}")
        return {**json.loads(done.stdout.strip().splitlines()[-1]), **program(dump)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS))
    parser.add_argument("--tables", type=int, default=26)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(HERE / "results" / "program_size.json"))
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.tables, None)))
        return
    results = {name: measure(name, args.tables) for name in args.configs}
    base = results.get("keras")
    print(f"Criteo-shaped model, {args.tables} tables <= {ROWS_CAP:,} rows, width {WIDTH}, "
          f"batch {BATCH:,}; JAX's compiled train step")
    print(f"{'configuration':18s} {'fusions':>8s} {'kernels':>8s} {'IR MB':>7s} "
          f"{'compile s':>10s} {'first step s':>13s} {'IR / Keras':>11s}")
    for name, r in results.items():
        ratio = f"{r['ir_bytes'] / base['ir_bytes']:10.2f}x" if base else ""
        print(f"{name:18s} {r['fusions']:8d} {r['kernels']:8d} {r['ir_bytes'] / 1e6:7.2f} "
              f"{r['compile_s']:10.2f} {r['first_step_s']:13.2f} {ratio}")
    pathlib.Path(args.out).parent.mkdir(exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(
        {"tables": args.tables, "rows_cap": ROWS_CAP, "width": WIDTH, "batch": BATCH,
         "results": results}, indent=1))


if __name__ == "__main__":
    main()
