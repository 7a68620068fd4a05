"""The host side of a table on disk (issue 48, in progress): a step's rows through the cache.

    python benchmarks/disk_cache.py                  # ~2 minutes
    python benchmarks/disk_cache.py --rows 100000000 --steps 200

A step of a table on disk reads its distinct rows and their state through
the row cache and writes new ones back (the rule's arithmetic left out: what
is measured is where rows live), with both caches side by side in the same
loop on the same ids, each over its own files: `RowCache` (NumPy) and
`NativeRowCache` (the host library; its evicted rows written into the files
in the same step here, `drain`, where a table on disk leaves that to a
thread beside the step). Beside them, the same ids on the same table held in
memory (NumPy arrays: gather, then scatter). Ids are a Zipf stream (exponent 1.05, ids shuffled
over the table), 4,096 x 8 ids per step; row-wise Adagrad's state (one float
per row) travels with each row. Cache sizes: 1%, 5% and 20% of the rows.
Prints per cache size the median step of each, their ratios to the in-memory
one, the hit rate and the bytes read from and written to the files per step
(the same for both caches: they evict the same rows), after a warm-up.

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

from sparseopt import native
from sparseopt.disk.initial_rows import InitialRows
from sparseopt.disk.native_cache import NativeRowCache
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
    print("| cache | distinct ids/step | in memory ms | NumPy cache ms | native cache ms "
          "| NumPy / in memory | native / in memory | hit rate | disk KB read/step "
          "| disk KB written/step |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    library = native.host_library()
    if library is None:
        raise SystemExit(f"the host library is not built here: {native.build_error('host')}")
    for fraction in (0.01, 0.05, 0.20):
        with tempfile.TemporaryDirectory() as folder:
            caches = {}
            for name in ("numpy", "native"):
                files = RowFiles(f"{folder}/{name}", args.rows, {
                    "rows": Column((args.width,), "float32", init),
                    "accumulator": Column((), "float32", 0.1)}, owner="benchmark")
                rows = int(args.rows * fraction)
                caches[name] = (RowCache(files, rows, policy="lru") if name == "numpy" else
                                NativeRowCache(files, rows, policy="lru", lib=library))
            times = {"memory": [], "numpy": [], "native": []}
            distinct = []
            before = None
            cache = caches["native"]
            for step, ids in enumerate(zipf_stream(args.rows, args.batch,
                                                   args.warmup + args.steps)):
                if step == args.warmup:
                    before = cache.health()
                t0 = time.perf_counter()
                rows, acc = memory_rows[ids], memory_acc[ids]
                memory_rows[ids], memory_acc[ids] = rows + 1e-3, acc + 1.0
                spent = {"memory": time.perf_counter() - t0}
                for name, each in caches.items():
                    t0 = time.perf_counter()
                    got = each.read(ids)
                    each.write(ids, {"rows": got["rows"] + 1e-3,
                                     "accumulator": got["accumulator"] + 1.0})
                    each.drain()
                    spent[name] = time.perf_counter() - t0
                if step >= args.warmup:
                    for name, value in spent.items():
                        times[name].append(value)
                    distinct.append(ids.size)
            after = cache.health()
            assert after == caches["numpy"].health()  # (the same rows, evicted alike)
            for each in caches.values():
                each.files.close()
            looked = (after["hits"] - before["hits"]) + (after["misses"] - before["misses"])
            row = {"cache_fraction": fraction, "distinct": float(np.mean(distinct)),
                   "memory_ms": 1e3 * float(np.median(times["memory"])),
                   "numpy_ms": 1e3 * float(np.median(times["numpy"])),
                   "native_ms": 1e3 * float(np.median(times["native"])),
                   "hit_rate": (after["hits"] - before["hits"]) / looked,
                   "kb_read": (after["bytes_read"] - before["bytes_read"]) / args.steps / 1024,
                   "kb_written": (after["bytes_written"] - before["bytes_written"])
                   / args.steps / 1024}
            results.append(row)
            print(f"| {fraction:.0%} | {row['distinct']:,.0f} | {row['memory_ms']:.2f} | "
                  f"{row['numpy_ms']:.2f} | {row['native_ms']:.2f} | "
                  f"{row['numpy_ms'] / row['memory_ms']:.1f}x | "
                  f"{row['native_ms'] / row['memory_ms']:.1f}x | {row['hit_rate']:.3f} | "
                  f"{row['kb_read']:.0f} | {row['kb_written']:.0f} |",
                  flush=True)
    out = pathlib.Path(args.out)
    out.write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
