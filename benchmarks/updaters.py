"""Every updater, option and mode side by side: what each rule costs per step.

    python benchmarks/updaters.py --quick    # 100k rows, batch 1,024: ~2 min
    python benchmarks/updaters.py            # 1M rows, batches 1,024 and 4,096: ~7 min
    python benchmarks/updaters.py --updaters sgd adam adam_lookahead   # some rows only

The suite's model (peers.py: ids [batch, 16] -> one table [rows, 32], sum
pooled -> Dense(1), Adam for the dense part), trained with each sparseopt
updater on JAX and on TensorFlow, next to plain Keras with a dense Adam table
(what a user gets without sparseopt) and FBGEMM's fused CPU kernels for the
rules its CPU build has (EXACT_SGD, EXACT_ADAGRAD, EXACT_ROWWISE_ADAGRAD;
fbgemm-gpu-cpu 1.8.0 refuses ADAM, PARTIAL_ROWWISE_ADAM and LAMB on CPU:
"Optimizer adam is not supported in CPU mode"). Configurations alive
together are timed round-robin (run.py's machinery); prints the step times,
each updater's ratio to sparse SGD on the same backend, and writes
benchmarks/results/updaters[_quick].json.
"""

import argparse
import importlib.util
import json
import time

import run

UPDATERS = ["sgd", "sgd_momentum", "adagrad", "rowwise_adagrad", "adagrad_momentum", "adam",
            "partial_rowwise_adam", "laprop", "frequency_aware_adagrad", "ftrl", "adam_options",
            "sgd_momentum_dense", "adam_ema", "rmsprop", "adamax", "nadam", "lion", "lamb",
            "adafactor", "adafactor_dense", "adam_swa", "adam_lookahead"]
LABELS = {"sgd": "SGD", "sgd_momentum": "SGD(momentum=0.9)", "adagrad": "Adagrad",
          "rowwise_adagrad": "RowwiseAdagrad", "adagrad_momentum": "AdagradMomentum(0.9)",
          "adam": "Adam", "partial_rowwise_adam": "PartialRowwiseAdam", "laprop": "LaProp",
          "frequency_aware_adagrad": "FrequencyAwareAdagrad",
          "ftrl": "Ftrl",
          "adam_options": "Adam + weight_decay, clipnorm, max_norm",
          "sgd_momentum_dense": "SGD(momentum=0.9, weight_decay, lazy=False)",
          "adam_ema": "Adam(ema_momentum=0.99)", "rmsprop": "RMSprop", "adamax": "Adamax",
          "nadam": "Nadam", "lion": "Lion", "lamb": "Lamb", "adafactor": "Adafactor",
          "adafactor_dense": "Adafactor(lazy=False)", "adam_swa": "Adam(swa_period=10)",
          "adam_lookahead": "Adam(lookahead_period=5)"}
PEERS = {"jax": [f"sparseopt-{u}" for u in UPDATERS] + ["keras-adam"],
         "tensorflow": [f"sparseopt-{u}" for u in UPDATERS] + ["keras-adam"],
         "torch": ["fbgemm-sgd", "fbgemm-adagrad", "fbgemm-rowwise_adagrad"]}
FBGEMM_OF = {"sgd": "fbgemm-sgd", "adagrad": "fbgemm-adagrad",
             "rowwise_adagrad": "fbgemm-rowwise_adagrad"}


def table(results, rows, batches, frameworks, chosen=UPDATERS):
    """Markdown: one row per updater, step ms (x SGD on that backend) per backend and batch."""
    ms = {(r["framework"], r["peer"], r["batch"]): r.get("median_ms") for r in results}
    cols = [(fw, b) for fw in frameworks if fw != "torch" for b in batches]
    head = " | ".join(f"{fw} b{b:,}" for fw, b in cols)
    lines = [f"| updater ({rows:,} rows) | {head} | FBGEMM (same rule) |",
             "|---|" + "---|" * (len(cols) + 1)]
    for u in [u for u in UPDATERS if u in chosen] + ["keras-adam"]:
        peer = u if u == "keras-adam" else f"sparseopt-{u}"
        cells = []
        for fw, b in cols:
            t, base = ms.get((fw, peer, b)), ms.get((fw, "sparseopt-sgd", b))
            cells.append("failed" if t is None else f"{t:.2f} ({t / base:.1f}x)" if base else
                         f"{t:.2f}")
        fb = FBGEMM_OF.get(u)
        fb_cells = [f"{ms[('torch', fb, b)]:.2f}" for b in batches
                    if fb and ms.get(("torch", fb, b)) is not None]
        label = "plain Keras, dense Adam table" if u == "keras-adam" else f"`{LABELS[u]}`"
        lines.append(f"| {label} | " + " | ".join(cells) + " | "
                     + (" / ".join(fb_cells) if fb_cells else
                        "not on CPU" if u in ("adam", "partial_rowwise_adam") else "-") + " |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--budget", type=float)
    parser.add_argument("--frameworks", nargs="*", default=["jax", "tensorflow", "torch"])
    parser.add_argument("--updaters", nargs="*", choices=UPDATERS,
                        help="time these rows only (sgd, the ratios' base, is always timed)")
    args = parser.parse_args()
    chosen = ["sgd"] + [u for u in (args.updaters or UPDATERS) if u != "sgd"]
    args.rounds = args.rounds or (3 if args.quick else 5)
    args.budget = args.budget or (0.15 if args.quick else 0.4)
    frameworks = list(args.frameworks)
    if "torch" in frameworks and not (importlib.util.find_spec("torch")
                                      and importlib.util.find_spec("fbgemm_gpu")):
        frameworks.remove("torch")
        print("FBGEMM rows skipped: torch/fbgemm_gpu not installed (`make bench-peers`).")
    rows = 100_000 if args.quick else 1_000_000
    batches = [1024] if args.quick else [1024, 4096]
    start = time.time()
    peers = {fw: [p for p in names if p.split("-", 1)[1] in chosen or not args.updaters]
             for fw, names in PEERS.items()}
    results = run.run_groups(run.slots_for(frameworks, peers, [rows], batches), args, "updaters")
    print(table(results, rows, batches, frameworks, chosen))
    minutes = (time.time() - start) / 60
    print(f"({minutes:.1f} min)")
    out = run.RESULTS / ("updaters_quick.json" if args.quick else "updaters.json"
                         if not args.updaters else "updaters_some.json")
    if args.quick:
        out = run.QUICK_RESULTS / "updaters.json"
        out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "batches": batches, "minutes": minutes,
                               "results": results}, indent=1, default=str))


if __name__ == "__main__":
    main()
