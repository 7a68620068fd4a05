"""Soak test: 100k training steps per backend; memory must stay flat, loss must fall.

A three-table click model (1M-row Adagrad table, 500k-row row-wise Adagrad
table, 1k-row FTRL table, Adam on the dense part) trains with `model.fit` on a
stream of fresh synthetic batches (Zipf-distributed ids, labels drawn from a
hidden logistic model). After every 1,000 steps it records the process' RSS,
the training loss, and the tables' skipped steps and dropped ids.

Each backend runs in its own process. Memory is "flat" when RSS after warm-up
(the first 5,000 steps) grows by less than 1 MB per 10,000 steps (least-squares
slope) and by less than 2% in all.

    python benchmarks/soak.py                          # both backends, 100k steps each
    python benchmarks/soak.py --backends jax --steps 20000
    python benchmarks/soak.py --steps 2000 --rows 10000 --out /tmp/soak.json   # smoke run

Writes benchmarks/results/soak.json (every sample) and soak.png (RSS and loss
against steps).
"""

import argparse
import gc
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
import common
from children import memory_mb  # noqa: E402

STEPS_PER_SAMPLE = 1000
WARMUP_STEPS = 5000
BATCH = 256


def child(args):
    import keras
    import numpy as np

    import sparseopt

    rows = {"user": args.rows, "item": max(args.rows // 2, 1), "ctx": 1000}
    bags = {"user": 4, "item": 2, "ctx": 1}
    updaters = {"user": sparseopt.updaters.Adagrad(0.05),
                "item": sparseopt.updaters.RowwiseAdagrad(0.05),
                "ctx": sparseopt.updaters.Ftrl(0.05, l2_regularization_strength=1e-4)}
    keras.utils.set_random_seed(0)
    model = common.recommender(
        {name: (rows[name], updaters[name], bags[name]) for name in rows}, 32,
        combiner="mean", initializer=keras.initializers.RandomUniform(-0.01, 0.01),
        dense_features=8, bottom=32, top=(64,),
        loss=keras.losses.BinaryCrossentropy(from_logits=True))

    rng = np.random.default_rng(1)
    hidden = {name: rng.normal(0, 0.7, size=n).astype("float32") for name, n in rows.items()}
    dense_w = rng.normal(0, 0.3, size=8).astype("float32")

    def batch():
        feats, logit = {}, np.full(BATCH, -1.0, "float32")
        for name, n in rows.items():
            ids = common.zipf_ids(rng, n, (BATCH, bags[name]), 1.15)
            feats[name] = ids
            logit += hidden[name][ids].mean(axis=1)
        feats["dense"] = rng.normal(size=(BATCH, 8)).astype("float32")
        logit += feats["dense"] @ dense_w
        p = 1 / (1 + np.exp(-logit))
        return feats, (rng.random(BATCH) < p).astype("float32")[:, None], p

    def stream():
        while True:
            feats, y, _ = batch()
            yield feats, y

    # What no model can beat: the entropy of the true click probabilities.
    p = np.concatenate([batch()[2] for _ in range(50)])
    bayes = float(np.mean(-(p * np.log(p) + (1 - p) * np.log(1 - p))))
    base = float(p.mean())
    constant = float(-(base * np.log(base) + (1 - base) * np.log(1 - base)))

    samples = []
    start = time.perf_counter()

    class Record(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            opt = self.model.optimizer
            # Read the step's results first: that waits for the steps still in
            # flight (JAX dispatches ahead), whose buffers would otherwise count
            # as growth; and collect Python garbage, which is not a leak.
            sample = {"step": (epoch + 1) * STEPS_PER_SAMPLE, "loss": float(logs["loss"]),
                      "skipped_steps": sum(opt.skipped_steps().values()),
                      "dropped_ids": sum(opt.dropped_ids().values())}
            gc.collect()
            samples.append(dict(sample, rss_mb=memory_mb("VmRSS:"),
                                seconds=time.perf_counter() - start))
            print(json.dumps({"progress": samples[-1]}), flush=True)

    model.fit(stream(), steps_per_epoch=STEPS_PER_SAMPLE,
              epochs=args.steps // STEPS_PER_SAMPLE, shuffle=False, verbose=0,
              callbacks=[Record()])
    print(json.dumps({"result": {
        "backend": keras.backend.backend(), "rows": rows, "batch": BATCH,
        "samples": samples, "bayes_loss": bayes, "constant_loss": constant,
        "table_mb": sum(n * 32 * 4 for n in rows.values()) / 2**20,
    }}), flush=True)


def verdict(result):
    """Memory growth after warm-up and whether it is flat.

    Flat: the slope is under 1 MB per 10k steps and the growth under 2%.
    A total growth under 1 MB is flat whatever its slope: RSS moves by
    allocator pages, and in a short run one such step between two samples
    would be a steep slope (the 7k-step smoke test failed so, under load).
    """
    import numpy as np

    after = [s for s in result["samples"] if s["step"] > WARMUP_STEPS]
    if len(after) < 2:
        return {"flat": None, "note": "too few steps after warm-up"}
    steps = np.array([s["step"] for s in after], float)
    rss = np.array([s["rss_mb"] for s in after])
    slope = float(np.polyfit(steps, rss, 1)[0] * 10_000)
    growth = float(rss[-1] - rss[0])
    return {"slope_mb_per_10k_steps": slope, "growth_mb": growth,
            "growth_pct": 100 * growth / rss[0], "rss_first_mb": float(rss[0]),
            "rss_last_mb": float(rss[-1]),
            "flat": bool((slope < 1.0 or growth < 1.0) and growth < 0.02 * rss[0])}


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem, loss) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        steps = [s["step"] for s in r["samples"]]
        mem.plot(steps, [s["rss_mb"] for s in r["samples"]], label=r["backend"])
        loss.plot(steps, [s["loss"] for s in r["samples"]], label=r["backend"], alpha=0.8)
    loss.axhline(results[0]["bayes_loss"], color="gray", ls="--", label="best possible")
    loss.axhline(results[0]["constant_loss"], color="gray", ls=":", label="constant predictor")
    mem.set(xlabel="step", ylabel="RSS (MB)", title="Process memory")
    loss.set(xlabel="step", ylabel="training loss (per 1k steps)", title="Loss")
    top = max(s["rss_mb"] for r in results for s in r["samples"])
    mem.set_ylim(0, 1.15 * top)
    for ax in (mem, loss):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", default="jax,tensorflow")
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "soak.json"))
    parser.add_argument("--smoke", action="store_true",
                        help="report the verdict without failing on it: a run of a few "
                             "thousand steps next to other work is too short to judge "
                             "a 1 MB per 10k steps slope (RSS moves by a few MB)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    results = []
    for backend in args.backends.split(","):
        env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
        cmd = [sys.executable, __file__, "--child", "--steps", str(args.steps),
               "--rows", str(args.rows)]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
        for line in proc.stdout:
            if not line.startswith("{"):
                continue
            msg = json.loads(line)
            if "progress" in msg:
                s = msg["progress"]
                if s["step"] % 10_000 == 0 or s["step"] == STEPS_PER_SAMPLE:
                    print(f"{backend:10s} step {s['step']:>7,}  RSS {s['rss_mb']:7.0f} MB  "
                          f"loss {s['loss']:.4f}  {s['seconds']:6.0f} s", flush=True)
            else:
                results.append(msg["result"])
        if proc.wait() != 0:
            raise SystemExit(f"{backend} soak run failed ({proc.returncode})")
    for r in results:
        r["verdict"] = verdict(r)
        v, last = r["verdict"], r["samples"][-1]
        print(f"\n{r['backend']}: {last['step']:,} steps in {last['seconds']:.0f} s "
              f"({1000 * last['seconds'] / last['step']:.2f} ms/step incl. data)")
        print(f"  loss {r['samples'][0]['loss']:.4f} (first 1k steps) -> {last['loss']:.4f} "
              f"(last 1k); constant predictor {r['constant_loss']:.4f}, "
              f"best possible {r['bayes_loss']:.4f}")
        print(f"  skipped steps {last['skipped_steps']}, dropped ids {last['dropped_ids']}")
        if v["flat"] is None:
            print(f"  memory: {v['note']}")
        else:
            print(f"  RSS after warm-up {v['rss_first_mb']:.0f} -> {v['rss_last_mb']:.0f} MB "
                  f"({v['growth_mb']:+.1f} MB, {v['growth_pct']:+.2f}%), slope "
                  f"{v['slope_mb_per_10k_steps']:+.2f} MB per 10k steps: "
                  f"{'FLAT' if v['flat'] else 'GROWING'}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    plot(results, os.path.splitext(args.out)[0] + ".png")
    print(f"\nwrote {args.out} and {os.path.splitext(args.out)[0]}.png")
    if not args.smoke and any(r["verdict"]["flat"] is False for r in results):
        raise SystemExit("memory grew: see above")


if __name__ == "__main__":
    main()
