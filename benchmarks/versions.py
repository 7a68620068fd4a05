"""Step times of two checkouts of sparseopt, timed side by side (a regression check).

    git worktree add /tmp/base <commit>
    python benchmarks/versions.py --base /tmp/base          # JAX and TF, ~6 minutes

Each checkout runs its own `benchmarks/peers.py` child per framework with the
suite's sparseopt configurations (every updater, batch 1024 x 16 hot ids); the
children are timed round-robin (`children.drive`), so the machine's noise falls
on both alike. Prints the median step time of each and the ratio head / base.
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys

import numpy as np

from children import drive

HERE = pathlib.Path(__file__).resolve().parent
UPDATERS = ["sgd", "adagrad", "rowwise_adagrad", "ftrl"]


def start(checkout, framework, slots, budget_s):
    env = dict(os.environ, KERAS_BACKEND=framework, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=str(checkout))
    child = subprocess.Popen(
        [sys.executable, str(checkout / "benchmarks" / "peers.py"), framework,
         json.dumps(slots), str(budget_s)],
        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready", f"{checkout} {framework} failed"
    return child


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", required=True, help="the other checkout (a git worktree)")
    parser.add_argument("--frameworks", nargs="*", default=["jax", "tensorflow"])
    parser.add_argument("--rows", nargs="*", type=int, default=[10_000, 1_000_000])
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--budget", type=float, default=0.4, help="seconds per timing")
    args = parser.parse_args()
    checkouts = {"base": pathlib.Path(args.base).resolve(), "head": HERE.parent}
    print("| backend | updater | rows | base ms | head ms | head / base |")
    print("|---|---|---|---|---|---|")
    for framework in args.frameworks:
        slots = [{"framework": framework, "peer": f"sparseopt-{u}", "rows": rows,
                  "batch": args.batch} for u in UPDATERS for rows in args.rows]
        children = {name: start(path, framework, slots, args.budget)
                    for name, path in checkouts.items()}
        results = dict(zip(children, drive(children.values(), args.rounds, cooldown_s=0.5)))
        for base, head in zip(results["base"], results["head"]):
            b, h = np.median(base["step_ms"]), np.median(head["step_ms"])
            print(f"| {framework} | {base['peer'][10:]} | {base['rows']:,} | {b:.2f} | {h:.2f} "
                  f"| {h / b:.2f} |", flush=True)


if __name__ == "__main__":
    main()
