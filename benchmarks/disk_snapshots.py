"""Saves and loads of a table on disk: incremental snapshots beside whole ones, in one run.

    KERAS_BACKEND=jax python benchmarks/disk_snapshots.py          # ~2 minutes
    KERAS_BACKEND=tensorflow python benchmarks/disk_snapshots.py
    python benchmarks/disk_snapshots.py --rows 100000000 --between 10 100

The model is benchmarks/disk_tables.py's (one `SparseEmbedding`, row-wise
Adagrad, width 16, 8 ids per example summed, a dense head, batch 4,096) with
`--rows` rows on disk and a cache of 5% of them, trained on benchmarks/disk_large.py's
Zipf stream (spread over the table). It trains `--first` steps and saves
(`model.save_weights`: the table's first snapshot, whole); then, for each
count in `--between`, trains that many steps more and saves again: an
incremental snapshot, holding only the pages of the table's files written
since the save before. Beside each, the same files are copied into a whole
snapshot (`sparseopt.disk.snapshots.take` without a base: what every save
was before incremental snapshots), and both are loaded back
(`DiskTable.restore`: an incremental one copies its chain's whole first
snapshot, then each later one's pages), after a first load timed apart (the
first load after training replaces the trained files, which took disk page
by page, and leaves their removal to a thread of their own: how long that
thread still took after the load returned is printed too, and waited for
before the loads compared). Prints, for each: seconds, what it takes on
disk, and the ratio incremental / whole. The files are in a
temporary folder: in the page cache on a machine with memory to spare, so
the seconds are copies between the kernel's pages rather than device I/O.
"""

import argparse
import json
import pathlib
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
from disk_large import zipf_ids  # noqa: E402  (the same stream)
from disk_tables import model  # noqa: E402  (the same model)
from sparseopt.disk import snapshots  # noqa: E402


def folder_mb(folder):
    """What snapshot `folder`'s files take on disk (allocated blocks), MB."""
    return sum(f.stat().st_blocks * 512 for f in folder.iterdir()) / 1e6


def timed(call):
    """`(seconds, result)` of `call()`."""
    t0 = time.perf_counter()
    result = call()
    return time.perf_counter() - t0, result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--first", type=int, default=60)
    parser.add_argument("--between", type=int, nargs="+", default=[1, 10, 50])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    backend = keras.backend.backend()
    steps = args.first + sum(args.between)
    x = zipf_ids(args.rows, args.batch * steps, 8)
    y = np.random.default_rng(1).normal(size=(x.shape[0], 1)).astype("float32")
    work = pathlib.Path(tempfile.mkdtemp(prefix="sparseopt-disk-snapshots-"))
    print(f"{backend}: table {args.rows:,} x 16 with row-wise Adagrad state on disk, cache "
          f"5%; {args.first} steps, then {args.between} more between saves")
    rows = []
    try:
        m, emb = model(args.rows, 16, sparseopt.storage.OnDisk(
            str(work / "t"), cache_rows=args.rows // 20))
        table = emb.embeddings
        at = 0

        def train(count):
            nonlocal at
            part = slice(at * args.batch, (at + count) * args.batch)
            m.fit(x[part], y[part], batch_size=args.batch, shuffle=False, verbose=0)
            at += count

        train(args.first)
        seconds, _ = timed(lambda: m.save_weights(work / "first.weights.h5"))
        first = table.snapshots()[-1]
        rows.append({"after": args.first, "kind": "first save (whole)", "save_s": seconds,
                     "mb": folder_mb(work / "t" / "snapshots" / first)})
        for k, count in enumerate(args.between):
            train(count)
            seconds, _ = timed(lambda: m.save_weights(work / f"{k}.weights.h5"))
            name = table.snapshots()[-1]
            folder = work / "t" / "snapshots" / name
            record = json.loads((folder / snapshots.COMPLETE).read_text())
            # The same files whole (no training since the save: the files are its state).
            whole_s, whole = timed(lambda: snapshots.take(table.settings.path,
                                                          table.files.names))
            # Timed apart: the first load after training replaces the trained files, whose
            # removal (files given disk page by page: many extents) it leaves to a thread
            # of their own; that thread's time is waited for apart, before the loads
            # compared (which it would slow).
            replaced_s, _ = timed(lambda: table.restore(whole))
            removed_s, _ = timed(snapshots.wait_discarded)
            load_s, _ = timed(lambda: table.restore(name))
            snapshots.wait_discarded()
            load_whole_s, _ = timed(lambda: table.restore(whole))
            snapshots.wait_discarded()
            chain, link = 0, name
            while link is not None:
                chain += 1
                link = json.loads((work / "t" / "snapshots" / link / snapshots.COMPLETE)
                                  .read_text()).get("base")
            rows.append({"after": count, "kind": "incremental" if record["base"] else "whole",
                         "save_s": seconds, "mb": folder_mb(folder), "chain": chain,
                         "whole_save_s": whole_s,
                         "whole_mb": folder_mb(work / "t" / "snapshots" / whole),
                         "load_s": load_s, "whole_load_s": load_whole_s,
                         "first_load_s": replaced_s, "removed_after_s": removed_s})
            table.remove_snapshots(keep=0)  # (the comparison's whole one is no save's)
            seconds, _ = timed(lambda: m.save_weights(work / f"{k}b.weights.h5"))
            # (Saved again, whole now: the next count builds on a save of its own.)
        table.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("| steps since the save before | snapshot | save s | MB on disk | chain | "
          "whole: save s | whole: MB | incremental / whole (MB) | load s | whole: load s "
          "| first load after training s | its replaced files removed beside, s after |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "whole_mb" not in r:
            print(f"| {r['after']} (first) | {r['kind']} | {r['save_s']:.2f} | {r['mb']:.0f} "
                  "| 1 | | | | | | | |")
            continue
        print(f"| {r['after']} | {r['kind']} | {r['save_s']:.2f} | {r['mb']:.0f} | "
              f"{r['chain']} | {r['whole_save_s']:.2f} | {r['whole_mb']:.0f} | "
              f"{r['mb'] / r['whole_mb']:.2f}x | {r['load_s']:.2f} | "
              f"{r['whole_load_s']:.2f} | {r['first_load_s']:.2f} | "
              f"{r['removed_after_s']:.2f} |", flush=True)
    out = pathlib.Path(args.out or HERE / "results" / f"disk_snapshots_{backend}.json")
    out.write_text(json.dumps({"backend": backend, "args": vars(args), "results": rows},
                              indent=1))
    plot(rows[1:], f"{args.rows:,} rows, {backend}", out.with_suffix(".png"))


def plot(rows, title, path):
    """Per save: the incremental snapshot's MB and seconds beside the whole one's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(7, 3))
    labels = [f"{r['after']} steps" for r in rows]
    at = np.arange(len(rows))
    for ax, (key, whole_key, unit) in zip(axes, [("mb", "whole_mb", "MB on disk"),
                                                 ("save_s", "whole_save_s", "save (s)")]):
        ax.bar(at - 0.2, [r[key] for r in rows], 0.4, label="incremental", color="#dd8452")
        ax.bar(at + 0.2, [r[whole_key] for r in rows], 0.4, label="whole", color="#4c72b0")
        ax.set_xticks(at, labels, fontsize=8)
        ax.set_ylabel(unit)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Snapshots after N more steps ({title})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
