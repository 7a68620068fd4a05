"""Tables on disk through `fit`: a step with `storage=OnDisk(...)` beside the same table in memory.

    KERAS_BACKEND=jax python benchmarks/disk_tables.py          # ~3 minutes
    KERAS_BACKEND=tensorflow python benchmarks/disk_tables.py
    python benchmarks/disk_tables.py --rows 20000000 --steps 100
    python benchmarks/disk_tables.py --dtype int8   # int8 tables, on disk and in memory
    python benchmarks/disk_tables.py --vocabulary   # open vocabularies (DynamicEmbedding)

The model: one `SparseEmbedding` (row-wise Adagrad, width 16, `combiner="sum"`
over 8 ids per example) and a dense head, batch 4,096 (32,768 ids per
step), ids from a Zipf stream (exponent 1.05, truncated to the table by
redrawing, shuffled over the rows: `disk_cache.zipf_stream`'s). Each run
first trains `--warmup` steps (compiling, filling the cache), then
`--steps` timed steps through `model.fit`, whole: the per-step figure is
the timed `fit` over its steps, Keras' own loop included, the same for
both, less the end of `fit`'s flush of a table on disk (its cache's dirty
rows into the files and the files to disk: once a `fit`, not a step, and
growing with the pages the `fit` wrote), which is printed apart, in
milliseconds for the timed `fit`. Runs, in one process on the backend Keras was given: the table in
memory, then on disk with caches of 1%, 5% and 20% of its rows, that
sequence `--repeats` times (this machine's speed drifts between runs by as
much as 1.5x; interleaved, a slow spell slows all). Prints each median step
time and every run's, the median's ratio to the in-memory one (the issue's goal: a 5%
cache at >= 0.5x the in-memory throughput, i.e. <= 2x its step), the processor time
the process took a step (every thread's: against the step's wall time, how many of
the machine's cores a step keeps busy; the end of `fit`'s flush is in it), the hit
rate, the bytes read from and written to the files per timed step, and
where the table's host work went per timed step (`disk_stats()`): in the
step's host calls, which the step waits for (of which, waiting for the
thread beside the step), and on that thread, overlapping the steps. The
three caches fetch the next step's rows while a step runs
(`OnDisk(fetch_ahead=True)`), and one more table is beside them: the 5%
cache with its rows fetched in the step that reads them
(`fetch_ahead=False`, the default); each run's share of steps whose rows
were fetched ahead is printed. (Open vocabularies fetch in the step: their
rows follow from their map.) On TensorFlow, whose `fit` takes its batches
in Python where a table fetches ahead, one more run beside them: the table
in memory with its batches taken so too, and nothing fetched (what taking
the batches in Python costs alone). And one more on both, the 5% cache
fetched ahead as before one change: its step's ids numbered in a Python host
call, as before the step numbered them itself (an XLA FFI call on JAX, an op on
TensorFlow).

The files are in a temporary folder: on a machine whose page cache holds
them, "disk" bytes are copies to and from the kernel's pages, not device I/O.
"""

import argparse
import contextlib
import json
import pathlib
import sys
import tempfile
import time

import keras
import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import sparseopt  # noqa: E402
from sparseopt import backend as seams, compat  # noqa: E402


def ids(rows, batch, bag, steps, seed):
    """int32 `[steps * batch, bag]` Zipf ids (with repeats: the stream's raw draws)."""
    rng = np.random.default_rng(seed)
    perm = rng.permutation(rows)
    ranks = rng.zipf(1.05, steps * batch * bag)
    while (over := ranks > rows).any():
        ranks[over] = rng.zipf(1.05, int(over.sum()))
    return perm[ranks - 1].astype("int32").reshape(steps * batch, bag)


# `--vocabulary`: the most new ids one step gives rows to (the stream's new ids per step
# stay below it after the warm-up steps), the same on disk and in memory.
ADMISSIONS = 8192


def model(rows, width, storage, dtype=None, ids_per_step=None, vocabulary=False):
    keras.utils.set_random_seed(0)
    x = keras.Input((8,), dtype="int32")
    common = dict(combiner="sum", storage=storage, name="table", dtype=dtype,
                  embeddings_initializer=keras.initializers.RandomUniform(-0.05, 0.05, seed=1))
    if vocabulary:  # an open vocabulary of `rows` rows, the stream's ids as raw ids
        emb = sparseopt.layers.DynamicEmbedding(
            rows, width, sparseopt.updaters.RowwiseAdagrad(0.05),
            admissions_per_step=ADMISSIONS, **common)
    else:
        # An int8 table in memory buffers a step's rows: room for every id of a step.
        buffer = ids_per_step if dtype == "int8" and storage is None else None
        emb = sparseopt.layers.SparseEmbedding(
            rows, width, sparseopt.updaters.RowwiseAdagrad(0.05), rows_per_step=buffer,
            **common)
    out = keras.layers.Dense(1)(keras.layers.Dense(64, activation="relu")(emb(x)))
    m = keras.Model(x, out)
    m.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.Adam(1e-3)), loss="mse")
    return m, emb


# A table whose step numbers its ids in a Python host call, as before the step numbered
# them itself (an FFI call on JAX, an op on TensorFlow: `sparseopt.backend.number_ids`),
# beside the others.
HOST_NUMBERING = "host numbering"


@contextlib.contextmanager
def numbered_in_step(on):
    """Models built inside number a table on disk's step ids in the step itself if `on`
    (where the backend can: an FFI call on JAX, an op on TensorFlow), else in a host call
    (the backend's seam giving none, whatever `SPARSEOPT_NATIVE` says)."""
    before = seams.number_ids
    if not on:
        seams.number_ids = lambda ids, num_rows: None
    try:
        yield
    finally:
        seams.number_ids = before


def run(args, storage, warm, timed, from_python=False):
    """One model trained `warm`, then timed on `timed`: its step and cache counts.

    Args:
        from_python: `fit` takes its batches as where tables fetch ahead (in Python, one
            batch early, on TensorFlow), with nothing to fetch.
    """
    m, emb = model(args.rows, args.width, storage, args.dtype, args.batch * 8,
                   args.vocabulary)
    if from_python:
        compat.batches_seen_ahead(m, lambda batch: None)
    m.fit(warm[0], warm[1], batch_size=args.batch, shuffle=False, verbose=0)
    before = emb.disk_stats()
    t0, c0 = time.perf_counter(), time.process_time()
    m.fit(timed[0], timed[1], batch_size=args.batch, shuffle=False, verbose=0)
    fit_ms = 1e3 * (time.perf_counter() - t0)
    # The processor time the whole process took a step, every thread's (XLA's, the
    # table's beside the step, Keras' loop; the end of fit's flush too, unlike the
    # step's wall time): against the step's wall time, how much of the machine's
    # cores a step keeps busy.
    cpu_ms = 1e3 * (time.process_time() - c0) / args.steps
    after = emb.disk_stats()
    if after is not None:
        emb.embeddings.close()  # (its folder is removed next)
    # The end of fit's flush, once a fit (`flush_ms`), apart from the steps.
    flush_ms = 0.0 if before is None else after["flush_ms"] - before["flush_ms"]
    out = {"step_ms": (fit_ms - flush_ms) / args.steps, "cpu_ms": cpu_ms,
           "fit_flush_ms": flush_ms}
    if before is not None:
        looked = (after["hits"] - before["hits"]) + (after["misses"] - before["misses"])
        out.update(hit_rate=(after["hits"] - before["hits"]) / looked,
                   fetched_ahead=(after["steps_fetched_ahead"]
                                  - before["steps_fetched_ahead"]) / args.steps,
                   kb_read=(after["bytes_read"] - before["bytes_read"]) / args.steps / 1024,
                   kb_written=(after["bytes_written"] - before["bytes_written"])
                   / args.steps / 1024,
                   # Where the table's host work went, per timed step (`disk_stats`).
                   **{f"{k}_per_step": (after[k] - before[k]) / args.steps
                      for k in ("host_ms", "waited_ms", "beside_ms")})
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "int8"],
                        help="the table's dtype, on disk and in memory (default float32)")
    parser.add_argument("--vocabulary", action="store_true",
                        help="an open vocabulary (DynamicEmbedding) of --rows rows, on disk "
                             "and in memory, instead of a SparseEmbedding")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    backend = keras.backend.backend()
    x = ids(args.rows, args.batch, 8, args.warmup + args.steps, seed=0)
    y = np.random.default_rng(1).normal(size=(x.shape[0], 1)).astype("float32")
    split = args.warmup * args.batch
    warm, timed = (x[:split], y[:split]), (x[split:], y[split:])
    distinct = np.mean([np.unique(timed[0][i:i + args.batch]).size
                        for i in range(0, timed[0].shape[0], args.batch)])
    kind = "open vocabulary" if args.vocabulary else "table"
    print(f"{backend}: {kind} {args.rows:,} x {args.width} ({args.dtype or 'float32'}), "
          "row-wise Adagrad; "
          f"{args.batch * 8:,} Zipf ids per step ({distinct:,.0f} distinct)")
    print("| table | step ms (median) | step / in memory | each run's step ms "
          "| processor ms/step | hit rate | disk KB read/step | disk KB written/step "
          "| host calls ms/step (waiting) | beside ms/step | end of fit's flush ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    tables = [("memory", None, None)] + [(f"disk {f:.0%}", f, True) for f in (0.01, 0.05, 0.20)]
    if not args.vocabulary:  # (the tables fetched ahead; see above)
        tables.append(("disk 5% in step", 0.05, False))
        # (the step's ids numbered in a host call: as before it numbered them itself)
        tables.append(("disk 5% host numbering", 0.05, HOST_NUMBERING))
        if backend == "tensorflow":
            tables.append(("memory from Python", None, "python"))
    runs = {name: [] for name, _, _ in tables}
    for _ in range(args.repeats):  # (interleaved: a slow spell of the machine hits all)
        for name, fraction, ahead in tables:
            if fraction is None:
                runs[name].append(run(args, None, warm, timed, from_python=bool(ahead)))
                continue
            with tempfile.TemporaryDirectory() as folder, numbered_in_step(
                    ahead != HOST_NUMBERING):
                storage = sparseopt.storage.OnDisk(folder, cache_rows=int(args.rows * fraction),
                                                   fetch_ahead=bool(ahead))
                runs[name].append(run(args, storage, warm, timed))
    results = []
    for name, fraction, ahead in tables:
        steps = [r["step_ms"] for r in runs[name]]
        row = {**runs[name][-1], "table": name, "step_ms": float(np.median(steps)),
               "step_ms_runs": steps,
               "cpu_ms": float(np.median([r["cpu_ms"] for r in runs[name]])),
               "fit_flush_ms": float(np.median([r["fit_flush_ms"] for r in runs[name]]))}
        results.append(row)
        ratio = row["step_ms"] / results[0]["step_ms"]
        label = "in memory" if fraction is None else f"on disk, {fraction:.0%} cache"
        if fraction is None and ahead:
            label += ", batches taken in Python as when fetching ahead (nothing fetched)"
        if ahead is False:
            label += ", rows fetched in the step"
        elif ahead == HOST_NUMBERING:
            label += (f", {row['fetched_ahead']:.0%} fetched ahead, its ids numbered in a host "
                      "call (not in the step)")
        elif ahead and fraction is not None and not args.vocabulary:
            label += f", {row['fetched_ahead']:.0%} of steps' rows fetched ahead"
        stats = ("| | | | | |" if fraction is None else
                 f"{row['hit_rate']:.3f} | {row['kb_read']:.0f} | {row['kb_written']:.0f} | "
                 f"{row['host_ms_per_step']:.1f} ({row['waited_ms_per_step']:.1f}) | "
                 f"{row['beside_ms_per_step']:.1f} | {row['fit_flush_ms']:.0f} |")
        print(f"| {label} | {row['step_ms']:.1f} | {ratio:.2f}x | "
              f"{', '.join(f'{t:.1f}' for t in steps)} | {row['cpu_ms']:.1f} | {stats}",
              flush=True)
    suffix = f"_{args.dtype}" if args.dtype not in (None, "float32") else ""
    suffix += "_vocabulary" if args.vocabulary else ""
    out = pathlib.Path(args.out or HERE / "results" / f"disk_tables_{backend}{suffix}.json")
    out.write_text(json.dumps({"args": vars(args), "backend": backend,
                               "distinct_per_step": float(distinct), "results": results},
                              indent=1))
    plot(results, f"{kind}, {backend}" + (f", {args.dtype}" if args.dtype else ""),
         out.with_suffix(".png"))


def plot(results, title, path):
    """Step time per table (bars; inside, the milliseconds of it in the table's host
    calls) and the cache's hit rate (points)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.6, 3.2))
    names = [r["table"] for r in results]
    disk = [r for r in results if "hit_rate" in r]  # (the tables on disk)

    def color(r):
        if r not in disk:
            return "#4c72b0" if r is results[0] else "#8fa8d6"  # (in memory)
        return "#c9a27e" if r["table"].endswith("in step") else "#dd8452"

    ax.bar(names, [r["step_ms"] for r in results], color=[color(r) for r in results])
    ax.tick_params(axis="x", labelsize=7, labelrotation=15)
    # Inside each table on disk's bar: the part of its step spent in its host calls.
    if disk and "host_ms_per_step" in disk[-1]:
        ax.bar([r["table"] for r in disk], [r["host_ms_per_step"] for r in disk], width=0.4,
               color="#8c564b", label="of which in the table's host calls")
    ax.axhline(2 * results[0]["step_ms"], ls="--", c="k", lw=0.8,
               label="goal: 2x the in-memory step")
    ax.set_ylabel("step (ms)")
    ax.set_ylim(0, 1.35 * max(r["step_ms"] for r in results))  # (room for the legend)
    ax.set_title(f"2M x 16 on disk ({title}): step time and hit rate", fontsize=9)
    rates = ax.twinx()
    rates.plot([r["table"] for r in disk], [r["hit_rate"] for r in disk], "o", c="#55a868")
    rates.set_ylim(0, 1)
    rates.set_ylabel("cache hit rate")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
