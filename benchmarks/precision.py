"""16-bit and 8-bit tables: a Criteo-shaped DLRM in float32, bfloat16 (rounded to
nearest or stochastically), float16 and int8, side by side in one run.

    python benchmarks/precision.py --quick   # 600k examples: ~4 min a backend
    python benchmarks/precision.py           # 2.4M examples: ~8 min a backend

Each variant trains the same recommender (`common.recommender`: 26 tables with
the Criteo Kaggle row counts capped at 300,000 rows, width 16, one id each;
row-wise Adagrad for tables of 300,000 rows or more, Adagrad from 1,000, FTRL
below; a bottom layer over 13 dense features, two top layers, Adam for the
dense layers) from the same initial weights on the same one pass of synthetic
clicks (`common.clicks`: Zipf-skewed ids, each with a hidden propensity), with
the validation loss and AUC after each chunk. Variants:

- `float32`: float32 tables;
- `bfloat16, nearest`: bfloat16 tables, float32 state, rounded to nearest
  (`stochastic_rounding=False`);
- `bfloat16, stochastic`: bfloat16 tables, float32 state, stochastic
  rounding (the default for 16-bit tables);
- `bfloat16, bf16 state, stochastic`: state in bfloat16 too;
- `float16, stochastic`: float16 tables, float32 state;
- `int8, nearest` and `int8, stochastic`: int8 codes with a float32 scale per
  row (`SparseEmbedding(dtype="int8")`), float32 state, written rounded to
  nearest or stochastically (the default). Their initial tables are the
  float32 model's, quantized to nearest.

Then the step time of each variant, timed round-robin on the same batches
(alternating variants, so the machine's drift hits all alike), the bytes of
tables and optimizer state, and the bytes per row of every updater at each
precision (measured from built variables). Prints the tables, writes
benchmarks/results/precision_<backend>[_quick].json and the plot
precision_<backend>[_quick].png.
"""

import argparse
import json
import os
import pathlib
import time

os.environ.setdefault("KERAS_BACKEND", "jax")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import common  # noqa: E402
import sparseopt  # noqa: E402
from sparseopt import native
from sparseopt.storage import quantization  # noqa: E402

HERE = pathlib.Path(__file__).parent
RESULTS = HERE / "results"
VARIANTS = {
    "float32": (None, {}),
    "bfloat16, nearest": ("bfloat16", {"stochastic_rounding": False}),
    "bfloat16, stochastic": ("bfloat16", {}),
    "bfloat16, bf16 state, stochastic": ("bfloat16", {"state_dtype": "bfloat16"}),
    "float16, stochastic": ("float16", {}),
    "int8, nearest": ("int8", {"stochastic_rounding": False}),
    "int8, stochastic": ("int8", {}),
}
WIDTH, BATCH, DENSE_FEATURES = 16, 1024, 13
ROWS_CAP = 300_000
NATIVE = " (native)"
TABLE_ROWS = {f"c{i}": min(rows, ROWS_CAP) for i, rows in enumerate(common.CRITEO_KAGGLE)}
VALIDATION_EXAMPLES = 50_000


# Each table's updater by its rows (the first whose bound it reaches): row-wise
# state for the largest, full Adagrad for mid-sized, FTRL for small ones.
RULES = ((300_000, lambda: sparseopt.updaters.RowwiseAdagrad(0.05)),
         (1_000, lambda: sparseopt.updaters.Adagrad(0.05)),
         (0, lambda: sparseopt.updaters.Ftrl(0.05, l2_regularization_strength=1e-4)))


def updater_for(rows):
    return next(make() for bound, make in RULES if rows >= bound)


def build(name, init=None):
    keras.utils.set_random_seed(0)
    table_dtype, storage = VARIANTS[name]
    model = common.recommender(
        {name_: (rows, updater_for(rows), 1) for name_, rows in TABLE_ROWS.items()}, WIDTH,
        dense_features=DENSE_FEATURES, bottom=64, top=(128, 64),
        loss=keras.losses.BinaryCrossentropy(from_logits=True),
        metrics=[keras.metrics.AUC(from_logits=True, name="auc")],
        table_dtype=table_dtype, storage=sparseopt.TableStorage(**storage),
        rows_per_step=BATCH)
    if init is not None:  # the float32 model's initial weights, stored as each variant stores
        for v in model.weights:
            if v.path in init and v.dtype != "int8":  # (int8 tables: quantized below)
                v.assign(keras.ops.cast(init[v.path], v.dtype))
        for layer in model.layers:
            if getattr(layer, "int8", None) is not None:
                codes, scale = quantization.quantize(init[layer.embeddings.path])
                layer.embeddings.assign(codes)
                layer.embeddings_scale.assign(scale)
    model.optimizer.build(model.trainable_variables)
    return model


def tables_of(model):
    """Every table's variables: an int8 table's codes, row scales and write buffer."""
    out = []
    for layer in model.layers:
        if isinstance(layer, sparseopt.layers.SparseEmbedding):
            out.append(layer.embeddings)
            if layer.int8 is not None:
                out += [layer.embeddings_scale, *layer.int8.written_variables]
    return out


def variables_bytes(variables):
    """Bytes of `variables`, at their dtypes."""
    return sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in variables)


def memory(model):
    tables = [layer.embeddings for layer in model.layers
              if isinstance(layer, sparseopt.layers.SparseEmbedding)]
    state = [v for t in tables for v in model.optimizer.table_state(t).values()]
    return {"table_bytes": variables_bytes(tables_of(model)),
            "state_bytes": variables_bytes(state)}


def bytes_per_row(width=WIDTH):
    """`{updater: {precision: bytes of a row and its state}}`, from built variables."""
    precisions = {"float32": (None, {}), "bfloat16 table": ("bfloat16", {}),
                  "bfloat16 table + state": ("bfloat16", {"state_dtype": "bfloat16"}),
                  "int8 table": ("int8", {})}
    out = {}
    for name, entry in sorted(sparseopt.updaters.registry(shipped_only=True).items()):
        out[name] = {}
        for label, (dtype, storage) in precisions.items():
            ids = keras.Input((1,), dtype="int32")
            layer = sparseopt.layers.SparseEmbedding(
                64, width, updater=entry(0.01, **entry.test_configs["default"]),
                dtype=dtype, storage=sparseopt.TableStorage(**storage))
            model = keras.Model(ids, layer(ids))
            model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD()),
                          loss="mse")
            model.optimizer.build(model.trainable_variables)
            state = model.optimizer.table_state(layer.embeddings).values()
            # Per row: an int8 table's codes and scale (its write buffer is per table).
            table = [layer.embeddings] + ([layer.embeddings_scale] if dtype == "int8" else [])
            out[name][label] = variables_bytes([*table, *state]) / 64
    return out


def train(names, x, y, val_x, val_y, examples, chunks):
    """One pass for each variant in turn, the validation after each chunk."""
    init = {v.path: keras.ops.convert_to_numpy(v) for v in build("float32").weights}
    curves, memories = {}, {}
    edges = np.linspace(0, examples, chunks + 1).astype(int)
    for name in names:
        model = build(name, init)
        memories[name] = memory(model)
        loss, auc = model.evaluate(val_x, val_y, batch_size=8192, verbose=0)
        curve = [(0, loss, auc)]
        start = time.perf_counter()
        for lo, hi in zip(edges[:-1], edges[1:]):
            model.fit({k: v[lo:hi] for k, v in x.items()}, y[lo:hi], batch_size=BATCH,
                      epochs=1, verbose=0, shuffle=False)
            loss, auc = model.evaluate(val_x, val_y, batch_size=8192, verbose=0)
            curve.append((int(hi), float(loss), float(auc)))
            print(f"  {name:33s} {hi:>10,d} examples  val loss {loss:.4f}  AUC {auc:.4f}",
                  flush=True)
        curves[name] = curve
        print(f"  {name}: {time.perf_counter() - start:.0f} s", flush=True)
        keras.backend.clear_session(free_memory=False)
    return curves, memories


def step_times(names, x, y, rounds, steps):
    """Median ms per step of each variant, timed round-robin: `rounds` x `steps` steps each.

    A name ending in " (native)" is its variant with every native kernel of
    sparseopt on (`sparseopt.native`, read when its step is traced: at its first
    `fit`); the others run the pure path.
    """
    models = {name: build(name.removesuffix(NATIVE)) for name in names}
    n = BATCH * steps
    part = ({k: v[:n] for k, v in x.items()}, y[:n])
    for name, model in models.items():  # compile
        native.set_enabled(name.endswith(NATIVE))  # (else every kernel off: the pure path)
        model.fit(*part, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
    native.set_enabled(None)
    times = {name: [] for name in names}
    for _ in range(rounds):
        for name, model in models.items():
            start = time.perf_counter()
            model.fit(*part, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
            times[name].append((time.perf_counter() - start) / steps * 1e3)
    return {name: float(np.median(t)) for name, t in times.items()}


def times_only(variants, rounds=8, steps=20):
    """Step times of `variants`, each with and without the native kernels, round-robin."""
    backend = keras.backend.backend()
    data, labels = common.clicks(np.random.default_rng(0), TABLE_ROWS, BATCH * steps,
                                 DENSE_FEATURES)
    names = [v + suffix for v in variants for suffix in ("", NATIVE)]
    ms = step_times(names, data, labels, rounds, steps)
    base = ms[variants[0]]
    print(f"\n| variant ({backend}) | ms/step | vs {variants[0]} |")
    print("|---|---|---|")
    for name in names:
        print(f"| {name} | {ms[name]:.1f} | {ms[name] / base:.2f}x |")
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"precision_times_{backend}.json"
    path.write_text(json.dumps({"backend": backend, "batch": BATCH, "rounds": rounds,
                                "steps": steps, "ms_per_step": ms}, indent=1))
    print(f"\nwrote {path}")


def plot(curves, path, backend):
    def style(name):
        # float32 underneath, wide and dashed: the others lie on it where they match.
        return (dict(color="black", linestyle="--", linewidth=3, zorder=0)
                if name == "float32" else dict(marker="o", markersize=4))

    common.plot_loss_and_auc(
        {name: curve[1:] for name, curve in curves.items()}, path,
        f"Criteo-shaped DLRM, 26 tables, width {WIDTH}: table precision ({backend})",
        "examples seen (one pass)", ("validation loss", "validation AUC"), style)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--examples", type=int, default=None)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--times-only", nargs="+", metavar="VARIANT",
                        help="only the step times of these variants on the pure path and "
                             "with the native kernels on ('<variant> (native)'), side by side")
    args = parser.parse_args()
    if args.times_only:
        times_only(args.times_only)
        return
    examples = args.examples or (600_000 if args.quick else 2_400_000)
    backend = keras.backend.backend()
    print(f"precision benchmark: {backend}, {examples:,} examples, batch {BATCH:,}, "
          f"{len(TABLE_ROWS)} tables ({sum(TABLE_ROWS.values()):,} rows) x width {WIDTH}", flush=True)
    data, labels = common.clicks(np.random.default_rng(0), TABLE_ROWS,
                                 examples + VALIDATION_EXAMPLES, DENSE_FEATURES)
    x, val_x = ({k: v[:examples] for k, v in data.items()},
                {k: v[examples:] for k, v in data.items()})
    y, val_y = labels[:examples], labels[examples:]
    names = list(VARIANTS)
    curves, memories = train(names, x, y, val_x, val_y, examples, args.chunks)
    ms = step_times(names, x, y, rounds=5 if args.quick else 8, steps=20)
    per_row = bytes_per_row()

    base = curves["float32"][-1][1]
    print(f"\n| variant ({backend}) | final val loss | vs float32 | final AUC | tables MB | "
          "state MB | ms/step | vs float32 |")
    print("|---|---|---|---|---|---|---|---|")
    for name in names:
        _, loss, auc = curves[name][-1]
        mem = memories[name]
        print(f"| {name} | {loss:.4f} | {100 * (loss / base - 1):+.2f}% | {auc:.4f} | "
              f"{mem['table_bytes'] / 2**20:.1f} | {mem['state_bytes'] / 2**20:.1f} | "
              f"{ms[name]:.1f} | {ms[name] / ms['float32']:.2f}x |")
    labels_ = list(next(iter(per_row.values())))
    print(f"\n| bytes per row, width {WIDTH} (table + state) | " + " | ".join(labels_) + " |")
    print("|---|" + "---|" * len(labels_))
    for name, cells in per_row.items():
        print(f"| `{name}` | " + " | ".join(f"{cells[k]:g}" for k in labels_) + " |")

    suffix = f"{backend}{'_quick' if args.quick else ''}"
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / f"precision_{suffix}.json", "w") as f:
        json.dump({"backend": backend, "examples": examples, "batch": BATCH, "width": WIDTH,
                   "curves": curves, "memory": memories, "ms_per_step": ms,
                   "bytes_per_row": per_row, "keras": keras.__version__,
                   "sparseopt": sparseopt.__version__}, f, indent=1)
    plot(curves, RESULTS / f"precision_{suffix}.png", backend)
    print(f"\nwrote {RESULTS / f'precision_{suffix}.json'} and .png")


if __name__ == "__main__":
    main()
