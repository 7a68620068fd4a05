"""The largest table: sparseopt trains it where plain Keras with Adam cannot.

    python benchmarks/largest_table.py                 # 2**27 rows x 32 (16 GiB table)
    python benchmarks/largest_table.py --rows 50000000

One table of `rows x 32` float32 (ids [1024, 16], sum -> Dense(1), MSE) is
trained on JAX, each library in its own process:
  * sparseopt: SparseEmbedding + RowwiseAdagrad (state: 4 bytes per row) +
    DispatchOptimizer(Adam); the table is drawn block by block, so memory
    peaks near table + state;
  * plain Keras: Embedding + Adam through MultiOptimizer, what most users
    start with (two table-sized slots, a dense table-sized gradient).
Each child volunteers as the kernel's first out-of-memory victim
(oom_score_adj 1000); the parent samples its resident memory every 50 ms and
records how it ended. Writes benchmarks/results/largest_table.json.
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).parent
import common
from children import memory_mb
ROWS = 2**27
WIDTH, IDS, BATCH, STEPS = 32, 16, 1024, 200


def child(library, rows):
    pathlib.Path("/proc/self/oom_score_adj").write_text("1000")
    import keras
    import numpy as np

    import sparseopt

    keras.utils.set_random_seed(0)
    started = time.perf_counter()
    sparse = library == "sparseopt"
    rule = sparseopt.updaters.RowwiseAdagrad(0.05) if sparse else keras.optimizers.Adam(0.05)
    model = common.recommender({"emb": (rows, rule, IDS)}, WIDTH, sparse=sparse)
    optimizer = model.optimizer
    print(json.dumps({"event": "built", "seconds": time.perf_counter() - started}), flush=True)
    rng = np.random.default_rng(0)
    hot = common.hot_set(rng, rows)
    xs = common.hot_ids(rng, rows, (BATCH * STEPS, IDS), hot=hot)
    # A target the model can learn: a fixed random score per hot row.
    score = dict(zip(hot.tolist(), rng.normal(size=hot.size) * 0.1))
    ys = np.vectorize(score.get)(xs).sum(axis=1, keepdims=True).astype("float32")
    model.fit(xs[:BATCH * 2], ys[:BATCH * 2], batch_size=BATCH, verbose=0)  # compile
    start = time.perf_counter()
    history = model.fit(xs, ys, batch_size=BATCH, epochs=3, verbose=0, shuffle=False)
    seconds = time.perf_counter() - start
    state = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize
                for v in optimizer.variables)
    print(json.dumps({"event": "trained", "ms_per_step": seconds / (3 * STEPS) * 1e3,
                      "loss": history.history["loss"], "optimizer_bytes": state,
                      "peak_rss_gb": memory_mb("VmHWM:") / 1024}), flush=True)


def attempt(library, rows):
    """Runs one child; returns how it ended and the most memory it held."""
    env = dict(os.environ, KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.Popen([sys.executable, __file__, "--child", library, "--rows", str(rows)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak_mb, start = 0.0, time.time()
    while proc.poll() is None:
        peak_mb = max(peak_mb, memory_mb("VmRSS:", proc.pid))  # max() keeps peak_mb over NaN
        time.sleep(0.05)
    out, err = proc.communicate()
    events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    result = {"library": library, "exit_code": proc.returncode,
              "seconds": time.time() - start, "max_rss_gb_sampled": peak_mb / 1024,
              "events": events}
    if proc.returncode != 0:
        killed = proc.returncode == -9
        result["outcome"] = ("out of memory (killed by the kernel's OOM killer)" if killed
                             else "failed: " + (err.strip().splitlines() or ["?"])[-1][:300])
    else:
        result["outcome"] = "trained"
    return result


def render(data):
    """The result as a markdown paragraph and table."""
    lines = [f"One table of {data['rows']:,} rows x {WIDTH} float32 = {data['table_gib']:.1f} "
             f"GiB on a machine with {data['machine_gib']:.1f} GiB of RAM (JAX, batch {BATCH} x "
             f"{IDS} ids, {STEPS} steps per epoch).", "",
             "| library | outcome | peak RSS GiB | optimizer state GiB | ms/step | loss by epoch |",
             "|---|---|---|---|---|---|"]
    for r in data["results"]:
        trained = next((e for e in r["events"] if e["event"] == "trained"), None)
        if trained:
            lines.append(f"| {r['library']} | {r['outcome']} | {trained['peak_rss_gb']:.1f} | "
                         f"{trained['optimizer_bytes'] / 2**30:.2f} | "
                         f"{trained['ms_per_step']:.2f} | "
                         f"{' -> '.join(f'{x:.3g}' for x in trained['loss'])} |")
        else:
            lines.append(f"| {r['library']} | {r['outcome']} | "
                         f"{r['max_rss_gb_sampled']:.1f} (last sample) | | | |")
    return "\n".join(lines)


def run(rows=ROWS):
    table_gb = rows * WIDTH * 4 / 2**30
    print(f"largest table: {rows:,} rows x {WIDTH} ({table_gb:.1f} GiB)", flush=True)
    results = [attempt(lib, rows) for lib in ("sparseopt", "keras-adam")]
    total_gb = memory_mb("MemTotal:", path="/proc/meminfo") / 1024
    data = {"rows": rows, "width": WIDTH, "table_gib": table_gb, "machine_gib": total_gb,
            "results": results}
    data["markdown"] = render(data)
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "largest_table.json").write_text(json.dumps(data, indent=1))
    print(data["markdown"], flush=True)
    return data


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=ROWS)
    parser.add_argument("--child")
    args = parser.parse_args()
    if args.child:
        child(args.child, args.rows)
    else:
        run(args.rows)
