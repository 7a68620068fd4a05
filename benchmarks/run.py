"""The benchmark suite: sparseopt side by side with what users would pick instead.

    python benchmarks/run.py --quick     # small sizes, under 3 minutes on 2 cores
    python benchmarks/run.py             # 1e4 .. 2e7 rows, batch sweep, largest table

One run measures, on the same model, batches and sizes (see peers.py):
sparseopt on JAX and TensorFlow with each updater, plain Keras 3 (Embedding +
Adagrad / Adam through MultiOptimizer), TorchRec/FBGEMM's fused CPU kernels
(if `torch` and `fbgemm_gpu` are installed: `make bench-peers`), and the floor
(the bytes a step must move over this machine's measured copy bandwidth).

Configurations that fit in memory together are alive at once (one process
per framework) and timed round-robin, one timing each per round, so that the
machine's noise falls on all of them alike; the target ratios come from
dedicated interleaved groups. Prints markdown tables; writes every figure to
benchmarks/results/run[_quick].json and plots to benchmarks/results/*.png.
"""

import argparse
import importlib.util
import json
import os
import pathlib
import platform
import subprocess
import sys
import time

import numpy as np

import peers
import report
from children import drive

HERE = pathlib.Path(__file__).parent
RESULTS = HERE / "results"
QUICK_RESULTS = RESULTS / "quick"  # untracked (.gitignore)
SIZES = [10_000, 100_000, 1_000_000, 4_000_000, 20_000_000]
QUICK_SIZES = [10_000, 100_000, 1_000_000]
BATCHES = [256, 1024, 4096, 16384]
QUICK_BATCHES = [256, 1024, 4096]
BATCH = 1024
BATCH_SWEEP_PEERS = {"jax": ["sparseopt-adagrad", "sparseopt-rowwise_adagrad", "keras-adagrad"],
                     "tensorflow": ["sparseopt-adagrad", "keras-adagrad"],
                     "torch": ["fbgemm-adagrad", "fbgemm-rowwise_adagrad"]}
MEMORY_BUDGET_GB = 18.0  # of the machine's 24 GiB, for one group of configurations
# Pause before each child's timing: a framework's worker threads keep
# spinning for a while after its last step and would slow the next child.
COOLDOWN_S = 0.5


def copy_bandwidth_gbs(mb=512, repeats=7):
    """Bytes read + written per second by a large memory copy (NumPy, 1 thread)."""
    src = np.ones(mb * 2**20 // 8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.nbytes / best / 1e9


def estimate_gb(slots):
    frameworks = {s["framework"] for s in slots}
    tables = sum(peers.MEMORY_TABLES[s["peer"]] * s["rows"] * peers.WIDTH * 4 for s in slots)
    return sum(peers.PROCESS_GB[f] for f in frameworks) + tables / 1e9


def plan(slots, budget_gb):
    """Packs slots, in order, into groups that fit in `budget_gb` together."""
    groups, current = [], []
    for slot in slots:
        if current and estimate_gb(current + [slot]) > budget_gb:
            groups.append(current)
            current = []
        current.append(slot)
    return groups + ([current] if current else [])


def run_group(slots, rounds, budget_s, tag):
    """Times `slots` round-robin (one child process per framework); returns results.

    A child that dies (e.g. out of memory) is recorded as failed, with the
    tail of its error output.
    """
    by_fw = {}
    for slot in slots:
        by_fw.setdefault(slot["framework"], []).append(slot)
    children = {}
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    for fw, fw_slots in by_fw.items():
        env_fw = dict(env, KERAS_BACKEND=fw) if fw != "torch" else env
        cmd = [sys.executable, str(HERE / "peers.py"), fw, json.dumps(fw_slots), str(budget_s)]
        children[fw] = subprocess.Popen(cmd, env=env_fw, stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    failed = []
    for fw, child in list(children.items()):
        if child.stdout.readline().strip() != "ready":
            child.wait()
            err = child.stderr.read()[-600:]
            print(f"  [{tag}] {fw} {[s['peer'] for s in by_fw[fw]]} failed "
                  f"(exit {child.returncode}): {err.strip().splitlines()[-1] if err else ''}",
                  flush=True)
            failed += [dict(s, failed=f"exit {child.returncode}: {err}") for s in by_fw[fw]]
            del children[fw]
    results = [r for out in drive(children.values(), rounds, COOLDOWN_S) for r in out]
    return [dict(r, group=tag) for r in results] + failed


def run_groups(slots, args, tag):
    results = []
    groups = plan(slots, MEMORY_BUDGET_GB)
    for i, group in enumerate(groups):
        name = f"{tag} {i + 1}/{len(groups)}"
        print(f"  {name}: {len(group)} configurations, ~{estimate_gb(group):.1f} GB", flush=True)
        results += run_group(group, args.rounds, args.budget, name)
    return results


def slots_for(frameworks, peer_lists, rows_list, batch_list):
    return [{"framework": fw, "peer": peer, "rows": rows, "batch": batch}
            for rows in rows_list for batch in batch_list
            for fw in frameworks for peer in peer_lists[fw]]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, < 3 min")
    parser.add_argument("--rounds", type=int, help="interleaved timing rounds")
    parser.add_argument("--budget", type=float, help="seconds of steps per timing")
    parser.add_argument("--frameworks", nargs="*", default=["jax", "tensorflow", "torch"])
    parser.add_argument("--skip-largest", action="store_true",
                        help="leave out the largest-table demonstration")
    args = parser.parse_args()
    args.rounds = args.rounds or (3 if args.quick else 7)
    args.budget = args.budget or (0.15 if args.quick else 0.5)
    start = time.time()

    frameworks = list(args.frameworks)
    notes = []
    if "torch" in frameworks and not (importlib.util.find_spec("torch")
                                      and importlib.util.find_spec("fbgemm_gpu")):
        frameworks.remove("torch")
        notes.append("TorchRec/FBGEMM rows skipped: `torch` and `fbgemm_gpu` are not installed "
                     "(`make bench-peers` installs torch==2.13.0 and fbgemm-gpu-cpu==1.8.0).")
        print(notes[-1])
    sizes = QUICK_SIZES if args.quick else SIZES
    batches = QUICK_BATCHES if args.quick else BATCHES
    bandwidth = copy_bandwidth_gbs()
    print(f"copy bandwidth: {bandwidth:.1f} GB/s (read + write)", flush=True)

    print("table sweep", flush=True)
    table = run_groups(slots_for(frameworks, peers.FRAMEWORK_PEERS, sizes, [BATCH]), args,
                       "table sweep")
    batch_rows = 100_000 if args.quick else 1_000_000
    print(f"batch sweep at {batch_rows:,} rows", flush=True)
    bsweep = run_groups(slots_for(frameworks, BATCH_SWEEP_PEERS, [batch_rows], batches), args,
                        "batch sweep")

    # The target ratios, each from one group timed round-robin.
    print("target groups", flush=True)
    lo, hi = sizes[0], sizes[-1]
    flat = []
    for fw in [f for f in frameworks if f != "torch"]:
        flat += run_group([{"framework": fw, "peer": "sparseopt-adagrad", "rows": r,
                            "batch": BATCH} for r in (lo, hi)],
                          args.rounds * 2, args.budget, f"flatness {fw}")
    peer_rows = 100_000 if args.quick else 1_000_000
    fbgemm = run_group(slots_for(frameworks, {
        "jax": ["sparseopt-rowwise_adagrad", "sparseopt-adagrad"],
        "tensorflow": ["sparseopt-rowwise_adagrad", "sparseopt-adagrad"],
        "torch": ["fbgemm-rowwise_adagrad", "fbgemm-adagrad"]}, [peer_rows], [BATCH]),
        args.rounds * 2, args.budget, "vs fbgemm")

    largest = None
    if not args.quick and not args.skip_largest:
        import largest_table

        largest = largest_table.run()

    data = {
        "command": " ".join(["python"] + sys.argv),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version(),
                    "copy_bandwidth_gbs": bandwidth, "versions": versions()},
        "settings": {"width": peers.WIDTH, "ids_per_example": peers.IDS_PER_EXAMPLE,
                     "hot_rows": peers.HOT_ROWS, "batch": BATCH, "rounds": args.rounds,
                     "budget_s": args.budget, "sizes": sizes, "batches": batches,
                     "batch_sweep_rows": batch_rows, "fbgemm_rows": peer_rows},
        "notes": notes,
        "table_sweep": table, "batch_sweep": bsweep,
        "flatness": flat, "vs_fbgemm": fbgemm, "largest_table": largest,
        "seconds": time.time() - start,
    }
    data["targets"] = report.targets(data)
    # A quick run checks the suite; it never replaces the tracked full results.
    out = QUICK_RESULTS if args.quick else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    stem = "run_quick" if args.quick else "run"
    (out / f"{stem}.json").write_text(json.dumps(data, indent=1))
    print()
    print(report.markdown(data))
    for path in report.plots(data, out, stem):
        print(f"wrote {path}")
    print(f"wrote {out / (stem + '.json')} ({data['seconds'] / 60:.1f} min)")


def versions():
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ["keras", "jax", "tensorflow-cpu", "tensorflow", "torch", "fbgemm-gpu-cpu",
                 "numpy"]:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out


if __name__ == "__main__":
    main()
