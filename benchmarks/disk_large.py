"""A table larger than this machine's memory, trained through `fit` with its rows on disk.

    KERAS_BACKEND=jax python benchmarks/disk_large.py                # ~2 minutes
    KERAS_BACKEND=tensorflow python benchmarks/disk_large.py
    python benchmarks/disk_large.py --rows 2000000000 --dir /data/big

The model is benchmarks/disk_tables.py's (one `SparseEmbedding`, row-wise
Adagrad, width 16, 8 ids per example summed, a dense head, batch 4,096),
with 900M rows: 57.6 GB of rows and 3.6 GB of Adagrad state, 2.5x this
machine's 24 GB, which no table in memory could hold. It trains one pass
over a Zipf stream (exponent 1.05, ranks past the table drawn again, spread
over the rows by a multiplicative hash: a permutation of 900M ids would take
7 GB) with a cache of `--cache-rows` rows, and prints the step time (the
first `--warmup` steps, which compile, apart), the cache's hit rate and
bytes moved, what the files take on disk (sparse: only the rows written),
and the process's peak resident memory (which counts the pages of the
table's files mapped in memory, the kernel's to write back and reclaim; its
own memory and the mapped pages are printed apart at the end). The "disk
KB written" of the timed steps include the end of `fit`'s flush of the
cache.

There is no in-memory run to compare with: the table does not fit. The
files go to a temporary folder unless `--dir` is given, removed after.
"""

import argparse
import json
import pathlib
import resource
import shutil
import sys
import tempfile
import time

import keras
import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import sparseopt  # noqa: E402
from disk_tables import model  # noqa: E402  (the same model)

# An odd prime: ranks times it modulo the table are a bijection for any table
# size it does not divide (checked below).
SPREAD = 2654435761


def zipf_ids(rows, examples, bag, seed=0):
    """int32 `[examples, bag]` Zipf ids over `rows`, spread over the table."""
    rng = np.random.default_rng(seed)
    ranks = rng.zipf(1.05, examples * bag)
    while (over := ranks > rows).any():
        ranks[over] = rng.zipf(1.05, int(over.sum()))
    spread = ((ranks - 1).astype(np.uint64) * np.uint64(SPREAD)) % np.uint64(rows)
    return spread.astype(np.int32).reshape(examples, bag)


def resident_gb():
    """`(own, files)`: this process's resident memory now, GB: its own (anonymous) pages,
    and pages of mapped files (`/proc/self/status` RssAnon, RssFile), which the kernel
    writes back and reclaims as it needs."""
    fields = {}
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        fields[name] = value
    return tuple(int(fields[k].split()[0]) / 1e6 for k in ("RssAnon", "RssFile"))


def memory_gb():
    """This machine's memory, GB (`/proc/meminfo`)."""
    for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) / 1e6
    return float("nan")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=900_000_000)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--cache-rows", type=int, default=20_000_000)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.rows % SPREAD == 0:
        raise SystemExit(f"--rows must not be a multiple of {SPREAD}")
    backend = keras.backend.backend()
    examples = args.batch * (args.warmup + args.steps)
    x = zipf_ids(args.rows, examples, 8)
    y = np.random.default_rng(1).normal(size=(examples, 1)).astype("float32")
    split = args.warmup * args.batch
    folder = pathlib.Path(args.dir or tempfile.mkdtemp(prefix="sparseopt-disk-large-"))
    table_gb = args.rows * (args.width + 1) * 4 / 1e9  # rows and Adagrad's accumulator
    print(f"{backend}: table {args.rows:,} x {args.width} with row-wise Adagrad state: "
          f"{table_gb:.1f} GB on a machine with {memory_gb():.1f} GB of memory; cache "
          f"{args.cache_rows:,} rows; {args.steps} steps of {args.batch * 8:,} Zipf ids")
    try:
        t0 = time.perf_counter()
        m, emb = model(args.rows, args.width,
                       sparseopt.storage.OnDisk(str(folder), cache_rows=args.cache_rows))
        made_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        m.fit(x[:split], y[:split], batch_size=args.batch, shuffle=False, verbose=0)
        warm_s = time.perf_counter() - t0
        before = emb.disk_stats()
        t0 = time.perf_counter()
        history = m.fit(x[split:], y[split:], batch_size=args.batch, shuffle=False, verbose=0)
        step_ms = 1e3 * (time.perf_counter() - t0) / args.steps
        after = emb.disk_stats()
        own_gb, mapped_gb = resident_gb()
        disk_gb = emb.embeddings.files.disk_bytes() / 1e9
        emb.embeddings.close()
    finally:
        if args.dir is None:
            shutil.rmtree(folder, ignore_errors=True)
    looked = (after["hits"] - before["hits"]) + (after["misses"] - before["misses"])
    result = {
        "backend": backend, "args": vars(args), "table_gb": table_gb,
        "machine_memory_gb": memory_gb(), "made_s": made_s, "warmup_s": warm_s,
        "step_ms": step_ms, "hit_rate": (after["hits"] - before["hits"]) / looked,
        "kb_read_per_step": (after["bytes_read"] - before["bytes_read"]) / args.steps / 1024,
        "kb_written_per_step": (after["bytes_written"] - before["bytes_written"])
        / args.steps / 1024,
        "files_on_disk_gb": disk_gb, "loss": float(history.history["loss"][-1]),
        # ru_maxrss: kilobytes on Linux; it counts mapped files' pages too.
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
        "own_rss_gb_at_end": own_gb, "mapped_file_rss_gb_at_end": mapped_gb}
    print("| table | machine memory | cache rows | step ms | hit rate | disk KB read/step "
          "| disk KB written/step | files on disk | peak RSS | at the end: own / mapped files |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print(f"| {args.rows:,} x {args.width} ({table_gb:.1f} GB with state) | "
          f"{result['machine_memory_gb']:.1f} GB | {args.cache_rows:,} | {step_ms:.1f} | "
          f"{result['hit_rate']:.3f} | {result['kb_read_per_step']:.0f} | "
          f"{result['kb_written_per_step']:.0f} | {disk_gb:.2f} GB | "
          f"{result['peak_rss_gb']:.2f} GB | {own_gb:.2f} / {mapped_gb:.2f} GB |")
    print(f"(table made in {made_s:.1f} s; {args.warmup} warm-up steps, compiling, in "
          f"{warm_s:.1f} s)")
    out = pathlib.Path(args.out or HERE / "results" / f"disk_large_{backend}.json")
    out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
