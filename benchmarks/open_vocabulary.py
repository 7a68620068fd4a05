"""Open vocabularies on a drifting click stream: `DynamicEmbedding` against hashing into a
fixed table of the same rows and against a fixed table with a row for every id.

    python benchmarks/open_vocabulary.py --quick   # ~1 min a backend
    python benchmarks/open_vocabulary.py           # ~2 min a backend

The stream: chunks of clicks on one id feature whose population turns over:
each id has a Zipf popularity (over a random ranking of the id universe), and
each chunk draws ids by popularity from a window of a quarter of the universe
that slides on (an id lives about six chunks: new ids appear, old ones stop),
plus a static id feature and dense features; every id has a hidden
propensity. The ids are raw 31-bit
values (no id is its own row). Three variants of the same model (width 16,
Adagrad tables, Adam for the dense layers), from the same initial dense
weights:

- `open vocabulary`: `DynamicEmbedding(capacity=R)` on the raw ids (LRU);
- `hashed`: the raw ids hashed into `R` rows in the input pipeline (what
  `keras.layers.Hashing(num_bins=R)` does: a hash modulo `R`), then a
  `SparseEmbedding(R)`;
- `row per id`: a `SparseEmbedding` with a row for each id of the universe
  (ids mapped to their index: the memory ceiling).

`R` is a quarter of the universe (`--rows-divisor 8`: an eighth, fewer rows
than the ids alive at once, so the open vocabulary evicts all along). Each chunk is first evaluated (log-loss and
AUC on examples the model has not trained on: progressive validation), then
trained on. Then the step time of each variant at batch 4,096 and 16,384,
round-robin on the same batches, and the bytes of tables, optimizer state and
map. Prints the tables, writes benchmarks/results/open_vocabulary_<backend>
[_quick].json and .png.
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

HERE = pathlib.Path(__file__).parent
RESULTS = HERE / "results"
WIDTH, DENSE, BATCH = 16, 8, 1024
ZIPF_A = 1.2
VARIANTS = ("open vocabulary", "hashed", "row per id")
STATIC_ROWS = 1000


def stream(universe, chunks, per_chunk, seed=0):
    """`[(x, y)]` per chunk: the drifting id (raw), the static id, dense features, clicks."""
    rng = np.random.default_rng(seed)
    raw = rng.choice(2**31 - 1, size=universe, replace=False).astype(np.int64)
    propensity = rng.normal(scale=1.0, size=universe)
    static = rng.normal(scale=0.5, size=STATIC_ROWS)
    weights = rng.normal(scale=0.3, size=DENSE)
    # Each id's popularity: Zipf(ZIPF_A) over a random ranking of the universe.
    popularity = 1.0 / rng.permutation(np.arange(1, universe + 1)) ** ZIPF_A
    live = universe // 4  # the ids alive in one chunk: a window that slides on
    out = []
    for c in range(chunks):
        start = (universe - live) * c // max(chunks - 1, 1)
        chance = popularity[start:start + live]
        index = start + rng.choice(live, size=per_chunk, p=chance / chance.sum())
        s = rng.integers(0, STATIC_ROWS, per_chunk)
        dense = rng.normal(size=(per_chunk, DENSE)).astype("float32")
        logit = propensity[index] + static[s] + dense @ weights - 1.0
        y = (rng.random(per_chunk) < 1 / (1 + np.exp(-logit))).astype("float32")[:, None]
        out.append(({"index": index, "raw": raw[index], "static": s, "dense": dense}, y))
    return out


def hashed(raw, rows):
    """A hash of the raw ids modulo `rows` (splitmix64's finalizer)."""
    z = raw.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return ((z ^ (z >> np.uint64(31))) % np.uint64(rows)).astype("int32")


def inputs_of(variant, x, rows):
    ids = {"open vocabulary": x["raw"].astype("int32"), "hashed": hashed(x["raw"], rows),
           "row per id": x["index"].astype("int32")}[variant]
    return {"ids": ids[:, None], "static": x["static"][:, None].astype("int32"),
            "dense_features": x["dense"]}


def build(variant, universe, rows):
    keras.utils.set_random_seed(0)
    ids = keras.Input((1,), dtype="int32", name="ids")
    static = keras.Input((1,), dtype="int32", name="static")
    dense = keras.Input((DENSE,), name="dense_features")
    adagrad = sparseopt.updaters.Adagrad(0.05)
    if variant == "open vocabulary":
        table = sparseopt.layers.DynamicEmbedding(rows, WIDTH, adagrad, combiner="sum",
                                                  name="drifting")
    else:
        table = sparseopt.layers.SparseEmbedding(rows if variant == "hashed" else universe,
                                                 WIDTH, adagrad, combiner="sum",
                                                 name="drifting")
    side = sparseopt.layers.SparseEmbedding(STATIC_ROWS, WIDTH,
                                            sparseopt.updaters.Adagrad(0.05), combiner="sum",
                                            name="static_table")
    x = keras.layers.Concatenate()([table(ids), side(static),
                                    keras.layers.Dense(WIDTH, activation="relu")(dense)])
    x = keras.layers.Dense(64, activation="relu")(x)
    model = keras.Model({"ids": ids, "static": static, "dense_features": dense},
                        keras.layers.Dense(1)(x))
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.Adam(1e-3)),
                  loss=keras.losses.BinaryCrossentropy(from_logits=True),
                  metrics=[keras.metrics.AUC(from_logits=True, name="auc")])
    return model, table


def memory_bytes(model, table):
    """Bytes of the drifting table, its optimizer state and (open vocabulary) its map."""
    state = model.optimizer.table_state(table.embeddings).values()
    extra = table.vocabulary.variables if hasattr(table, "vocabulary") else []
    return sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize
               for v in [table.embeddings, *state, *extra])


def run_stream(chunks, universe, rows):
    curves, memories = {}, {}
    for variant in VARIANTS:
        model, table = build(variant, universe, rows)
        curve = []
        start = time.perf_counter()
        for c, (x, y) in enumerate(chunks):
            feed = inputs_of(variant, x, rows)
            if c:  # progressive validation: this chunk before training on it
                loss, auc = model.evaluate(feed, y, batch_size=8192, verbose=0)
                curve.append((c, float(loss), float(auc)))
            model.fit(feed, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
        memories[variant] = memory_bytes(model, table)
        curves[variant] = curve
        stats = table.vocabulary_stats() if hasattr(table, "vocabulary_stats") else None
        print(f"  {variant:16s} final chunk: log-loss {curve[-1][1]:.4f}  AUC {curve[-1][2]:.4f}"
              f"  ({time.perf_counter() - start:.0f} s){'  ' + str(stats) if stats else ''}",
              flush=True)
        keras.backend.clear_session(free_memory=False)
    return curves, memories


class StepClock(keras.callbacks.Callback):
    """Each training step's wall time (from the end of one to the end of the next)."""

    def __init__(self):
        super().__init__()
        self.ms, self._last = [], None

    def on_epoch_begin(self, epoch, logs=None):
        self._last = None  # (the pause between `fit` calls is no step's)

    def on_train_batch_end(self, batch, logs=None):
        float(logs["loss"])  # waits for the step (JAX dispatches ahead)
        now = time.perf_counter()
        if self._last is not None:
            self.ms.append((now - self._last) * 1e3)
        self._last = now


def step_times(x, y, universe, rows, batch, rounds=8, steps=10):
    """Median ms per step of each variant, round-robin on the same batches (each step
    timed alone, so that `fit`'s own set-up counts in none)."""
    models = {v: build(v, universe, rows)[0] for v in VARIANTS}
    n = batch * steps
    parts = {v: ({k: a[:n] for k, a in inputs_of(v, x, rows).items()}, y[:n])
             for v in VARIANTS}
    for v, model in models.items():  # compile, and fill the open vocabulary
        model.fit(*parts[v], batch_size=batch, epochs=2, verbose=0, shuffle=False)
    clocks = {v: StepClock() for v in VARIANTS}
    for _ in range(rounds):
        for v, model in models.items():
            model.fit(*parts[v], batch_size=batch, epochs=1, verbose=0, shuffle=False,
                      callbacks=[clocks[v]])
    keras.backend.clear_session(free_memory=False)
    return {v: float(np.median(clock.ms)) for v, clock in clocks.items()}


def plot(curves, path, backend, rows, universe):
    common.plot_loss_and_auc(curves, path,
                             f"Drifting ids, {universe:,} in all, {rows:,} rows ({backend})",
                             "chunk of the stream",
                             ("log-loss on the next chunk", "AUC on the next chunk"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rows-divisor", type=int, default=4,
                        help="rows of the open and hashed tables: the universe / this "
                             "(8: fewer rows than live ids, so the table overflows)")
    parser.add_argument("--step-times-only", action="store_true",
                        help="only the step times of each variant (no stream, nothing written)")
    args = parser.parse_args()
    universe = 200_000 if args.quick else 800_000
    chunks_n, per_chunk = (12, 50_000) if args.quick else (20, 100_000)
    rows = universe // args.rows_divisor
    backend = keras.backend.backend()
    if args.step_times_only:
        big = stream(universe, 1, 16384 * 10, seed=1)[0]
        print(f"| batch ({backend}, {rows:,} rows) | "
              + " | ".join(f"{v} ms" for v in VARIANTS) + " | open / row per id |")
        print("|---" * (len(VARIANTS) + 2) + "|")
        for batch in (4096, 16384):
            ms = step_times(big[0], big[1], universe, rows, batch)
            print(f"| {batch:,} | " + " | ".join(f"{ms[v]:.1f}" for v in VARIANTS)
                  + f" | {ms['open vocabulary'] / ms['row per id']:.2f}x |", flush=True)
        return
    print(f"open vocabulary benchmark: {backend}, {universe:,} ids, {rows:,} rows, "
          f"{chunks_n} chunks of {per_chunk:,}", flush=True)
    chunks = stream(universe, chunks_n, per_chunk)
    curves, memories = run_stream(chunks, universe, rows)
    big = stream(universe, 1, 16384 * 10, seed=1)[0]
    ms = {batch: step_times(big[0], big[1], universe, rows, batch) for batch in (4096, 16384)}

    base = {name: np.mean([l for _, l, _ in curve[-5:]]) for name, curve in curves.items()}
    print(f"\n| variant ({backend}) | log-loss, last 5 chunks | vs row per id | AUC, last 5 "
          "| table + state + map MB | ms/step 4,096 | vs row per id | ms/step 16,384 | "
          "vs row per id |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in VARIANTS:
        auc = np.mean([a for _, _, a in curves[name][-5:]])
        print(f"| {name} | {base[name]:.4f} | {100 * (base[name] / base['row per id'] - 1):+.2f}%"
              f" | {auc:.4f} | {memories[name] / 2**20:.1f} | {ms[4096][name]:.1f} | "
              f"{ms[4096][name] / ms[4096]['row per id']:.2f}x | {ms[16384][name]:.1f} | "
              f"{ms[16384][name] / ms[16384]['row per id']:.2f}x |")
    suffix = (f"{backend}{'_quick' if args.quick else ''}"
              f"{'' if args.rows_divisor == 4 else f'_rows_{args.rows_divisor}'}")
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / f"open_vocabulary_{suffix}.json", "w") as f:
        json.dump({"backend": backend, "universe": universe, "rows": rows,
                   "chunks": chunks_n, "per_chunk": per_chunk, "curves": curves,
                   "memory_bytes": memories, "ms_per_step": ms,
                   "keras": keras.__version__, "sparseopt": sparseopt.__version__}, f, indent=1)
    plot(curves, RESULTS / f"open_vocabulary_{suffix}.png", backend, rows, universe)
    print(f"\nwrote {RESULTS / f'open_vocabulary_{suffix}.json'} and .png")


if __name__ == "__main__":
    main()
