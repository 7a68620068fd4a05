"""Production-shaped training steps: 26 Criteo tables or one multi-hot table, batch 1k-64k.

    python benchmarks/dlrm_step.py --quick   # tables capped at 100k rows, batch 1k and 4k
    python benchmarks/dlrm_step.py           # the whole grid (about 40 minutes on 2 cores)
    python benchmarks/dlrm_step.py --report benchmarks/results/dlrm_step.json

Two shapes of model, each with 13 dense features -> `Dense(width)` (bottom),
concatenated with the sum-pooled tables -> `Dense(64)` -> `Dense(1)`,
binary cross-entropy, dense part by Adam:

- `criteo`: 26 tables with the Criteo Kaggle (display advertising challenge)
  cardinalities, 33,762,577 rows in all, one id per feature per example.
- `multihot`: one table of 10,131,227 rows (Criteo's largest feature), a bag
  of 20 ids per example.

Ids are Zipf(1.1)-skewed per feature, hot ranks spread over the table by a
multiplicative hash (hot rows are not neighbours). Widths 16 and 64; tables
trained by row-wise Adagrad or Adagrad (learning rate 0.05), batches 1,024 to
65,536. Peers, on the same model and batches:

    framework   peer        tables trained by
    jax, tf     sparseopt   SparseEmbedding + DispatchOptimizer(Adam)
                            (`<framework>-sparseopt-grouped`: the same with group_tables=True;
                            `<framework>-sparseopt-native`: the same with every native
                            kernel on, SPARSEOPT_NATIVE=1; `-pure`: every one off, =0)
    torch       fbgemm      one SplitTableBatchedEmbeddingBagsCodegen holding every table
                            (EXACT_ROWWISE_ADAGRAD / EXACT_ADAGRAD, fused CPU backward)
    jax         keras       keras.layers.Embedding + Adagrad (dense gradient), where it
                            fits in memory (width 16)

One child process per peer hosts one model and times every batch size on it
(the batch sizes share the tables). Children that fit in memory together are
alive at once and timed round-robin, so that the machine's noise falls on all
of them alike; a variant too large for that (width 64 with Adagrad: 17 GB per
peer) is timed one peer at a time, and its ratios say so.

Reported per (variant, peer, batch): step time (median, quartiles, min, max),
examples/s, distinct ids per step, peak RSS of the child, and two
memory-traffic floors for the bytes a step cannot avoid moving (every id's row
read once for the forward pass, every distinct row and its state read and
written once by the update): over the machine's streaming copy bandwidth
(what a perfectly sequential pass would take), and over its random-row
bandwidth (NumPy gathering random rows of that width from a 1 GB table, one
thread), which is what reading rows at scattered ids actually runs into.
Writes benchmarks/results/dlrm_step[_quick].json and its plots.
"""

import argparse
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import time

import numpy as np

import common
from children import StepTimer, answer, drive, memory_mb, reset_peak_memory

HERE = pathlib.Path(__file__).parent
RESULTS = HERE / "results"

CRITEO_KAGGLE = common.CRITEO_KAGGLE
MULTIHOT_ROWS = max(CRITEO_KAGGLE)
BAG = 20
DENSE_FEATURES = 13
TOP = 64
ZIPF_A = 1.1
SPREAD = 2654435761  # a prime: rank -> row is a bijection of [0, rows) for every table
TABLE_LR = 0.05
DENSE_LR = 1e-3
N_BATCHES = 4
RULES = ["rowwise_adagrad", "adagrad"]
WIDTHS = [16, 64]
VARIANTS = ["criteo", "multihot"]
BATCHES = [1024, 4096, 16384, 65536]
QUICK_ROWS_CAP = 100_000
QUICK_BATCHES = [1024, 4096]
MEMORY_BUDGET_GB = 19.0  # of the machine's 24 GiB, for children alive together
PROCESS_GB = {"jax": 1.2, "tensorflow": 1.5, "torch": 0.8}
COOLDOWN_S = 0.5
# glibc malloc setting every child runs with unless `--malloc default`:
# transparent huge pages for what malloc maps (glibc >= 2.35, with THP in
# "madvise" or "always" mode). XLA:CPU allocates a step's temporaries afresh
# on every call (65 MB for multi-hot at batch 16,384), and glibc maps blocks
# over 32 MB freshly and unmaps them on free: every step faulted its
# temporaries in again, 4 KB at a time (12,775 faults, 8 of 28 ms a step on
# JAX, measured); with huge pages a fault brings 2 MB. JAX, measured one
# process at a time: multi-hot 65,536 117 -> 62 ms, Criteo 16,384 52 -> 35 ms,
# Criteo 1,024 2.05 -> 2.6 ms (the one loss seen). Tried and rejected: one
# arena that keeps freed memory (MALLOC_ARENA_MAX=1 + high mmap/trim
# thresholds): 68 ms at 65,536, but 2.05 -> 4.8 ms at Criteo 1,024 (every
# thread on one arena's lock). The same setting for every peer.
HOST_MALLOC = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}


def tables_of(variant, rows_cap=None):
    """`{feature name: (rows, bag)}` of a variant."""
    cap = rows_cap or float("inf")
    if variant == "criteo":
        return {f"c{i}": (int(min(rows, cap)), 1) for i, rows in enumerate(CRITEO_KAGGLE)}
    if variant == "multihot":
        return {"bag": (int(min(MULTIHOT_ROWS, cap)), BAG)}
    raise ValueError(f"unknown variant {variant!r}; one of {VARIANTS}")


def skewed_ids(rng, rows, shape):
    """Zipf(`ZIPF_A`) ids, the hot ranks spread over the table (int32 `shape`)."""
    ranks = common.zipf_ids(rng, rows, shape, ZIPF_A).astype(np.int64)
    return (ranks * SPREAD % rows).astype("int32")


def make_batches(tables, batch, seed=0):
    """`N_BATCHES` batches: `{feature: int32 [batch, bag]}` plus dense features, and labels."""
    rng = np.random.default_rng(seed)
    xs, ys = [], []
    for _ in range(N_BATCHES):
        x = {name: skewed_ids(rng, rows, (batch, bag)) for name, (rows, bag) in tables.items()}
        x["dense"] = rng.normal(size=(batch, DENSE_FEATURES)).astype("float32")
        xs.append(x)
        ys.append((rng.random((batch, 1)) < 0.25).astype("float32"))
    return xs, ys


def state_bytes_per_row(rule, width):
    return {"rowwise_adagrad": 4, "adagrad": 4 * width}[rule]


def traffic_floor_bytes(ids_per_step, distinct_per_step, width, rule):
    """The bytes a step cannot avoid moving for its tables.

    The forward pass reads each id's row once; the update reads and writes
    each distinct row and its state once. (Gradients, pooled outputs and the
    dense layers are left out: a fused kernel keeps them in cache.)
    """
    row = 4 * width
    return ids_per_step * row + distinct_per_step * (row + state_bytes_per_row(rule, width)) * 2


def random_row_bandwidth_gbs(width, table_mb=1024, rows_read=1 << 20, repeats=5):
    """Bytes per second of gathering random rows of `width` floats (NumPy, one thread)."""
    rows = table_mb * 2**20 // (4 * width)
    table = np.ones((rows, width), np.float32)
    ids = np.random.default_rng(0).integers(0, rows, rows_read)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.take(table, ids, axis=0)
        best = min(best, time.perf_counter() - start)
    return rows_read * width * 4 / best / 1e9


def estimate_gb(peer, tables, width, rule):
    """Memory a child holds at its peak, for planning which children run together."""
    rows = sum(r for r, _ in tables.values())
    table = rows * width * 4 / 1e9
    state = rows * state_bytes_per_row(rule, width) / 1e9
    framework = peer.split("-")[0]
    if peer == "keras-jax":
        # Table, dense gradient, Adagrad accumulator, and the update's temporaries.
        return PROCESS_GB["jax"] + 4 * table
    extra = {"jax": rows * 4 / 1e9,  # dedup workspace
             "tensorflow": rows * 4 / 1e9,  # the same (tables drawn in blocks, in place)
             "torch": 0.0}[framework]
    return PROCESS_GB[framework] + table + state + extra


# -- the child: one model, every batch size ---------------------------------------


def _updater(rule):
    import sparseopt

    return {"rowwise_adagrad": sparseopt.updaters.RowwiseAdagrad,
            "adagrad": sparseopt.updaters.Adagrad}[rule](TABLE_LR)


def build_keras(peer, tables, width, rule):
    import keras

    keras.utils.set_random_seed(0)
    sparse = "sparseopt" in peer
    specs = {name: (rows, _updater(rule) if sparse else keras.optimizers.Adagrad(TABLE_LR), bag)
             for name, (rows, bag) in tables.items()}
    model = common.recommender(
        specs, width, sparse=sparse, dense_features=DENSE_FEATURES, bottom=width, top=(TOP,),
        loss=keras.losses.BinaryCrossentropy(from_logits=True),
        dense_optimizer=keras.optimizers.Adam(DENSE_LR))
    if peer.endswith("-grouped"):
        model.optimizer.group_tables = True  # before its first step builds it
    return model


class _TorchModel:
    """The same model with one FBGEMM table-batched module for every table."""

    def __init__(self, tables, width, rule):
        import torch
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
            EmbeddingLocation, PoolingMode)
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen)

        torch.manual_seed(0)
        self.names = list(tables)
        optim = {"rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                 "adagrad": EmbOptimType.EXACT_ADAGRAD}[rule]
        self.tbe = SplitTableBatchedEmbeddingBagsCodegen(
            [(rows, width, EmbeddingLocation.HOST, ComputeDevice.CPU)
             for rows, _ in tables.values()],
            optimizer=optim, learning_rate=TABLE_LR, eps=1e-7, pooling_mode=PoolingMode.SUM)
        self.bottom = torch.nn.Linear(DENSE_FEATURES, width)
        self.top = torch.nn.Sequential(torch.nn.Linear(width * (len(tables) + 1), TOP),
                                       torch.nn.ReLU(), torch.nn.Linear(TOP, 1))
        params = list(self.bottom.parameters()) + list(self.top.parameters())
        self.adam = torch.optim.Adam(params, DENSE_LR)
        self.loss = torch.nn.BCEWithLogitsLoss()

    def inputs(self, x):
        """TBE's input: every table's ids one after another, and the bag offsets."""
        import torch

        ids = np.concatenate([x[name].reshape(-1) for name in self.names]).astype("int64")
        lengths = np.concatenate([np.full(x[name].shape[0], x[name].shape[1])
                                  for name in self.names])
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype("int64")
        return (torch.from_numpy(ids), torch.from_numpy(offsets),
                torch.from_numpy(x["dense"]))

    def step(self, ids, offsets, dense, y):
        import torch

        pooled = self.tbe(ids, offsets)  # [batch, tables * width]
        x = torch.cat([pooled, torch.relu(self.bottom(dense))], dim=1)
        loss = self.loss(self.top(x), y)
        self.adam.zero_grad()
        loss.backward()  # FBGEMM applies the table update inside its backward
        self.adam.step()


def torch_step(model, xs, ys):
    import torch

    data = [model.inputs(x) + (torch.from_numpy(y),) for x, y in zip(xs, ys)]
    counter = [0]

    def run():
        model.step(*data[counter[0] % len(data)])
        counter[0] += 1

    return run, (lambda: None)


class Timing(StepTimer):
    """One batch size of the child's model, with its timings."""

    def __init__(self, run, sync, batch, distinct):
        super().__init__(run, sync, max_steps=300)
        self.batch, self.distinct = batch, distinct


def serve(spec, budget_s):
    """Builds one model (`spec`), then answers `time` / `result` on stdin."""
    peer, width, rule = spec["peer"], spec["width"], spec["rule"]
    tables = {k: tuple(v) for k, v in spec["tables"].items()}
    framework = peer.split("-")[-1] if peer == "keras-jax" else peer.split("-")[0]
    if framework == "torch":
        import torch

        torch.set_num_threads(os.cpu_count())
        import fbgemm_gpu  # noqa: F401
    else:
        import keras  # noqa: F401

        import peers
    base_mb = memory_mb("VmRSS:")
    reset_peak_memory()
    start = time.perf_counter()
    model = _TorchModel(tables, width, rule) if framework == "torch" else \
        build_keras(peer, tables, width, rule)
    build_s = time.perf_counter() - start
    timings, shared_state = [], []
    for batch in spec["batches"]:
        xs, ys = make_batches(tables, batch)
        distinct = float(np.mean([sum(np.unique(x[name]).size for name in tables) for x in xs]))
        if framework == "torch":
            run, sync = torch_step(model, xs, ys)
        elif framework == "jax":
            run, sync = peers.jax_step(model, xs, ys, state=shared_state)
        else:
            run, sync = peers.tf_step(model, xs, ys)
        timings.append(Timing(run, sync, batch, distinct))
    def time_once():
        for timing in timings:
            timing.time(budget_s)

    def result():
        peak = memory_mb("VmHWM:")
        out = []
        for t in timings:
            stats = t.stats()
            ids = t.batch * sum(bag for _, bag in tables.values())
            out.append(dict(
                {k: v for k, v in spec.items() if k != "batches"}, batch=t.batch, **stats,
                examples_per_s=t.batch / stats["median_ms"] * 1e3,
                ids_per_step=ids, distinct_ids_per_step=t.distinct,
                floor_bytes=traffic_floor_bytes(ids, t.distinct, width, rule),
                peak_rss_mb=peak, base_rss_mb=base_mb, build_s=build_s))
        return out

    answer(time_once, result)


# -- the parent ------------------------------------------------------------------------


def spawn(spec, budget_s, malloc="hugepages"):
    framework = "jax" if spec["peer"] == "keras-jax" else spec["peer"].split("-")[0]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    if malloc == "hugepages":
        env.update(HOST_MALLOC)
    if framework != "torch":
        env["KERAS_BACKEND"] = framework
    if spec["peer"].endswith("-native"):  # sparseopt with every native kernel on
        env["SPARSEOPT_NATIVE"] = "1"
    elif spec["peer"].endswith("-pure"):  # ... and with every one off
        env["SPARSEOPT_NATIVE"] = "0"
    return subprocess.Popen(
        [sys.executable, str(pathlib.Path(__file__).resolve()), "--child", json.dumps(spec),
         "--budget", str(budget_s)],
        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run_group(specs, rounds, budget_s, tag, malloc):
    """Times the children of `specs` round-robin; a child that dies is recorded as failed."""
    children, results = [], []
    for spec in specs:
        child = spawn(spec, budget_s, malloc)
        if child.stdout.readline().strip() != "ready":
            child.wait()
            err = child.stderr.read()[-800:].strip()
            last = err.splitlines()[-1] if err else ""
            print(f"  [{tag}] {spec['peer']} failed (exit {child.returncode}): {last}",
                  flush=True)
            results += [dict({k: v for k, v in spec.items() if k != "batches"}, batch=b,
                             failed=f"exit {child.returncode}: {err}")
                        for b in spec["batches"]]
            continue
        children.append(child)
    for out in drive(children, rounds, COOLDOWN_S):
        results += [dict(r, group=tag, alone=len(children) == 1) for r in out]
    return results


def plan(specs, budget_gb):
    """Packs the specs of one variant, in order, into groups that fit in memory together."""
    groups, current, used = [], [], 0.0
    for spec in specs:
        if current and used + spec["estimate_gb"] > budget_gb:
            groups.append(current)
            current, used = [], 0.0
        current.append(spec)
        used += spec["estimate_gb"]
    return groups + ([current] if current else [])


def variant_specs(variant, width, rule, peers_wanted, batches, rows_cap):
    tables = tables_of(variant, rows_cap)
    specs = []
    for peer in peers_wanted:
        if peer == "keras-jax" and width != 16:
            continue  # dense gradient + accumulator: 4 tables, over the machine's memory at 64
        specs.append({"variant": variant, "width": width, "rule": rule, "peer": peer,
                      "tables": tables, "batches": batches,
                      "estimate_gb": estimate_gb(peer, tables, width, rule)})
    return specs


def ratio_rows(results):
    """sparseopt / FBGEMM step-time ratios for each (variant, width, rule, batch)."""
    by_key = {}
    for r in results:
        if "failed" not in r:
            by_key.setdefault((r["variant"], r["width"], r["rule"], r["batch"]), {})[r["peer"]] = r
    rows = []
    for key, peers_at in sorted(by_key.items()):
        fb = peers_at.get("torch-fbgemm")
        for peer in sorted(p for p in peers_at if p != "torch-fbgemm"):
            if fb is not None:
                rows.append(dict(zip(("variant", "width", "rule", "batch"), key), peer=peer,
                                 ratio=peers_at[peer]["median_ms"] / fb["median_ms"],
                                 interleaved=not (peers_at[peer]["alone"] or fb["alone"])))
    return rows


def grid(data):
    """The whole grid in one table: ms per step (and / FBGEMM) by batch, one row per peer."""
    ok = [r for r in data["results"] if "failed" not in r]
    batches = sorted({r["batch"] for r in data["results"]})
    ratio = {(r["variant"], r["width"], r["rule"], r["batch"], r["peer"]): r
             for r in data["ratios"]}
    lines = ["| variant | width | rule | peer | " + " | ".join(f"{b:,}" for b in batches) + " |",
             "|---" * (4 + len(batches)) + "|"]
    keys = sorted({(r["variant"], r["width"], r["rule"], r["peer"]) for r in data["results"]},
                  key=lambda k: (VARIANTS.index(k[0]) if k[0] in VARIANTS else 9, k[1],
                                 k[2], k[3]))
    for variant, width, rule, peer in keys:
        cells = []
        for b in batches:
            r = next((r for r in ok if (r["variant"], r["width"], r["rule"], r["peer"],
                                        r["batch"]) == (variant, width, rule, peer, b)), None)
            failed = any("failed" in r and (r["variant"], r["width"], r["rule"], r["peer"],
                                            r["batch"]) == (variant, width, rule, peer, b)
                         for r in data["results"])
            if r is None:
                cells.append("failed" if failed else "")
                continue
            x = ratio.get((variant, width, rule, b, peer))
            mark = "" if x is None or x["interleaved"] else "*"
            cells.append(f"{r['median_ms']:.1f}" + (f" ({x['ratio']:.2f}x{mark})" if x else ""))
        lines.append(f"| {variant} | {width} | {rule} | {peer} | " + " | ".join(cells) + " |")
    lines.append("")
    malloc = data.get("settings", {}).get("malloc", "default")
    lines.append("ms per step (median); in brackets, / FBGEMM's step on the same batches "
                 "(* timed one peer at a time, not interleaved). Every peer ran with glibc "
                 "malloc " + ("defaults." if malloc == "default" else
                              " ".join(f"{k}={v}" for k, v in malloc.items()) + "."))
    return "\n".join(lines)


def markdown(data):
    bw = data["copy_bandwidth_gbs"]
    lines = ["| variant | width | rule | batch | peer | step ms (p25-p75) | examples/s | "
             "distinct ids | x streaming floor | x random-row floor | peak RSS GB |",
             "|---" * 11 + "|"]
    for r in data["results"]:
        head = f"| {r['variant']} | {r['width']} | {r['rule']} | {r['batch']:,} | {r['peer']} |"
        if "failed" in r:
            lines.append(head + f" failed: {r['failed'].splitlines()[-1][:60]} | | | | | |")
            continue
        floor_ms = r["floor_bytes"] / (bw * 1e9) * 1e3
        random_ms = r["floor_bytes"] / (data["random_row_gbs"][str(r["width"])] * 1e9) * 1e3
        lines.append(
            head + f" {r['median_ms']:.2f} ({r['p25_ms']:.2f}-{r['p75_ms']:.2f}) | "
            f"{r['examples_per_s']:,.0f} | {r['distinct_ids_per_step']:,.0f} | "
            f"{r['median_ms'] / floor_ms:.1f}x ({floor_ms:.2f} ms) | "
            f"{r['median_ms'] / random_ms:.1f}x ({random_ms:.2f} ms) | "
            f"{r['peak_rss_mb'] / 1024:.1f} |")
    lines += ["", "| variant | width | rule | batch | peer | / FBGEMM | timed |", "|---" * 7 + "|"]
    for r in data["ratios"]:
        lines.append(f"| {r['variant']} | {r['width']} | {r['rule']} | {r['batch']:,} | "
                     f"{r['peer']} | {r['ratio']:.2f}x | "
                     f"{'interleaved' if r['interleaved'] else 'one at a time'} |")
    return "\n".join(lines)


def plots(data, out, stem):
    """Examples/s against batch, one panel per (variant, width, rule)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    ok = [r for r in data["results"] if "failed" not in r]
    panels = sorted({(r["variant"], r["width"], r["rule"]) for r in ok})
    if not panels:
        return []
    cols = min(4, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    colors = {"jax-sparseopt": "C0", "tensorflow-sparseopt": "C1", "torch-fbgemm": "C2",
              "jax-sparseopt-native": "C4", "jax-sparseopt-pure": "C5",
              "tensorflow-sparseopt-pure": "C6", "tensorflow-sparseopt-native": "C7",
              "keras-jax": "C3"}
    for ax, (variant, width, rule) in zip(axes.flat, panels):
        for peer in sorted({r["peer"] for r in ok}):
            pts = sorted((r["batch"], r["examples_per_s"]) for r in ok
                         if (r["variant"], r["width"], r["rule"], r["peer"])
                         == (variant, width, rule, peer))
            if pts:
                ax.plot(*zip(*pts), marker="o", label=peer, color=colors.get(peer))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{variant}, width {width}, {rule}", fontsize=9)
        ax.set_xlabel("batch")
        ax.set_ylabel("examples / s")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    path = out / f"{stem}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"tables capped at {QUICK_ROWS_CAP:,} rows, width 16, row-wise "
                             f"Adagrad, batches {QUICK_BATCHES}")
    parser.add_argument("--variants", nargs="*", default=VARIANTS)
    parser.add_argument("--widths", nargs="*", type=int)
    parser.add_argument("--rules", nargs="*")
    parser.add_argument("--batches", nargs="*", type=int)
    parser.add_argument("--peers", nargs="*",
                        default=["jax-sparseopt", "tensorflow-sparseopt", "torch-fbgemm",
                                 "keras-jax"])
    parser.add_argument("--rows-cap", type=int, help="cap every table at this many rows")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--budget", type=float, help="seconds of steps per timing")
    parser.add_argument("--malloc", choices=["hugepages", "default"], default="hugepages",
                        help="glibc malloc setting of every peer: transparent huge pages "
                             "(HOST_MALLOC) or glibc's defaults")
    parser.add_argument("--report", metavar="JSON",
                        help="re-print the tables and re-draw the plot of a saved run")
    parser.add_argument("--name", help="results file stem (default dlrm_step[_quick]), so "
                                         "that a partial grid does not replace the whole one")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        serve(json.loads(args.child), args.budget)
        return
    if args.report:
        path = pathlib.Path(args.report)
        data = json.loads(path.read_text())
        print(grid(data))
        print()
        print(markdown(data))
        for plot in plots(data, path.parent, path.stem):
            print(f"wrote {plot}")
        return
    widths = args.widths or ([16] if args.quick else WIDTHS)
    rules = args.rules or (["rowwise_adagrad"] if args.quick else RULES)
    batches = args.batches or (QUICK_BATCHES if args.quick else BATCHES)
    rows_cap = args.rows_cap or (QUICK_ROWS_CAP if args.quick else None)
    rounds = args.rounds or (3 if args.quick else 5)
    budget = args.budget or (0.15 if args.quick else 0.4)
    wanted = list(args.peers)
    notes = []
    if "torch-fbgemm" in wanted and not (importlib.util.find_spec("torch")
                                         and importlib.util.find_spec("fbgemm_gpu")):
        wanted.remove("torch-fbgemm")
        notes.append("FBGEMM peer skipped: `make bench-peers` installs torch and fbgemm-gpu-cpu.")
        print(notes[-1])
    import run as suite

    bandwidth = suite.copy_bandwidth_gbs()
    print(f"copy bandwidth: {bandwidth:.1f} GB/s (read + write)", flush=True)
    random_row = {str(w): random_row_bandwidth_gbs(w) for w in widths}
    print(f"random-row bandwidth: {random_row} GB/s by width", flush=True)
    start = time.time()
    results = []
    for variant in args.variants:
        for width in widths:
            for rule in rules:
                specs = variant_specs(variant, width, rule, wanted, batches, rows_cap)
                groups = plan(specs, MEMORY_BUDGET_GB)
                for i, group in enumerate(groups):
                    tag = f"{variant} w{width} {rule} {i + 1}/{len(groups)}"
                    gb = sum(s["estimate_gb"] for s in group)
                    print(f"{tag}: {[s['peer'] for s in group]} ~{gb:.1f} GB", flush=True)
                    results += run_group(group, rounds, budget, tag, args.malloc)
    data = {"command": " ".join(["python"] + sys.argv), "copy_bandwidth_gbs": bandwidth,
            "random_row_gbs": random_row,
            "versions": suite.versions(), "cpus": os.cpu_count(), "notes": notes,
            "settings": {"zipf_a": ZIPF_A, "bag": BAG, "rounds": rounds, "budget_s": budget,
                         "rows_cap": rows_cap, "batches": batches, "table_lr": TABLE_LR,
                         "malloc": HOST_MALLOC if args.malloc == "hugepages" else "default"},
            "results": results, "ratios": ratio_rows(results), "seconds": time.time() - start}
    out = suite.QUICK_RESULTS if args.quick else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    stem = args.name or ("dlrm_step_quick" if args.quick else "dlrm_step")
    (out / f"{stem}.json").write_text(json.dumps(data, indent=1))
    print()
    print(grid(data))
    print()
    print(markdown(data))
    for path in plots(data, out, stem):
        print(f"wrote {path}")
    print(f"wrote {out / (stem + '.json')} ({data['seconds'] / 60:.1f} min)")


if __name__ == "__main__":
    main()
