"""The host side of a table on disk (issue 48, in progress): a step's rows through the cache.

    python benchmarks/disk_cache.py                  # ~2 minutes
    python benchmarks/disk_cache.py --rows 100000000 --steps 200

A step of a table on disk reads its distinct rows and their state through
`sparseopt.disk.row_cache.RowCache` and writes new ones back (the rule's
arithmetic left out: what is measured is where rows live). Beside it, in the
same loop, the same ids on the same table held in memory (NumPy arrays:
gather, then scatter). Ids are a Zipf stream (exponent 1.05, ids shuffled
over the table), 4,096 x 8 ids per step; row-wise Adagrad's state (one float
per row) travels with each row. Cache sizes: 1%, 5% and 20% of the rows.
Prints per cache size the median step of each, their ratio, the hit rate and
the bytes read from and written to the files per step, after a warm-up.

The files are in a temporary folder: on a machine whose page cache holds them
(this one: 24 GB), "disk" bytes are copies between the cache and the kernel's
pages, not device I/O; what this shows is the cache's own cost.
"""

import argparse
import json
import pathlib
import tempfile
import time

import keras
import numpy as np

from sparseopt.disk.initial_rows import InitialRows
from sparseopt.disk.row_cache import RowCache
from sparseopt.disk.row_files import Column, RowFiles

HERE = pathlib.Path(__file__).resolve().parent


def zipf_stream(rows, batch, steps, seed=0):
    rng = np.random.default_rng(seed)
    perm = rng.permutation(rows) if rows <= 10**8 else None
    for _ in range(steps):
        ranks = rng.zipf(1.05, batch)
        # Truncated to the table: ranks past it are drawn again (clipping them
        # would pile a third of the ids onto one row).
        while (over := ranks > rows).any():
            ranks[over] = rng.zipf(1.05, int(over.sum()))
        ranks = ranks - 1
        ids = perm[ranks] if perm is not None else (ranks.astype(np.uint64) * np.uint64(
            2654435761) % np.uint64(rows)).astype(np.int64)
        yield np.unique(ids)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4096 * 8)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--out", default=str(HERE / "results" / "disk_cache.json"))
    args = parser.parse_args()
    init = InitialRows(keras.initializers.RandomUniform(-0.05, 0.05, seed=1), args.width)
    memory_rows = np.zeros((args.rows, args.width), np.float32)
    memory_acc = np.zeros((args.rows,), np.float32)
    results = []
    print(f"table {args.rows:,} x {args.width}, row-wise Adagrad state; "
          f"{args.batch:,} Zipf ids per step")
    print("| cache | distinct ids/step | in memory ms | cached ms | cached / in memory "
          "| hit rate | disk KB read/step | disk KB written/step |")
    print("|---|---|---|---|---|---|---|---|")
    for fraction in (0.01, 0.05, 0.20):
        with tempfile.TemporaryDirectory() as folder:
            files = RowFiles(folder, args.rows, {
                "rows": Column((args.width,), "float32", init),
                "accumulator": Column((), "float32", 0.1)}, owner="benchmark")
            cache = RowCache(files, int(args.rows * fraction), policy="lru")
            times = {"memory": [], "cache": []}
            distinct = []
            before = None
            for step, ids in enumerate(zipf_stream(args.rows, args.batch,
                                                   args.warmup + args.steps)):
                if step == args.warmup:
                    before = cache.health()
                t0 = time.perf_counter()
                rows, acc = memory_rows[ids], memory_acc[ids]
                memory_rows[ids], memory_acc[ids] = rows + 1e-3, acc + 1.0
                t1 = time.perf_counter()
                got = cache.read(ids)
                cache.write(ids, {"rows": got["rows"] + 1e-3,
                                  "accumulator": got["accumulator"] + 1.0})
                t2 = time.perf_counter()
                if step >= args.warmup:
                    times["memory"].append(t1 - t0)
                    times["cache"].append(t2 - t1)
                    distinct.append(ids.size)
            after = cache.health()
            looked = (after["hits"] - before["hits"]) + (after["misses"] - before["misses"])
            row = {"cache_fraction": fraction, "distinct": float(np.mean(distinct)),
                   "memory_ms": 1e3 * float(np.median(times["memory"])),
                   "cache_ms": 1e3 * float(np.median(times["cache"])),
                   "hit_rate": (after["hits"] - before["hits"]) / looked,
                   "kb_read": (after["bytes_read"] - before["bytes_read"]) / args.steps / 1024,
                   "kb_written": (after["bytes_written"] - before["bytes_written"])
                   / args.steps / 1024}
            results.append(row)
            print(f"| {fraction:.0%} | {row['distinct']:,.0f} | {row['memory_ms']:.2f} | "
                  f"{row['cache_ms']:.2f} | {row['cache_ms'] / row['memory_ms']:.1f}x | "
                  f"{row['hit_rate']:.3f} | {row['kb_read']:.0f} | {row['kb_written']:.0f} |",
                  flush=True)
    out = pathlib.Path(args.out)
    out.write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
