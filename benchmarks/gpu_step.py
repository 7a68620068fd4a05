"""The DLRM step on a GPU: sparseopt against plain Keras and the HBM random-row floor (JAX).

    python benchmarks/gpu_step.py                    # on a GPU machine: the grid below
    python benchmarks/gpu_step.py --smoke --out F    # anywhere (CPU): tiny tables, one batch
    python benchmarks/gpu_step.py --report benchmarks/results/gpu_step.json

The models are `dlrm_step.py`'s: the 26 Criteo-shaped tables (`criteo`, one id
per feature) and one 10M-row bag table (`multihot`, 20 ids per example), width
16, tables trained by row-wise Adagrad, the dense part by Adam. Peers:

    sparseopt   SparseEmbedding + DispatchOptimizer(Adam)
    keras       keras.layers.Embedding + Adagrad (dense gradient), the same Adam

One child process per (XLA flags, variant, peer), so that each reports its own
peak device memory (`memory_stats()["peak_bytes_in_use"]`); it times every
batch (4,096 to 65,536) on one model, three timings each, the median kept.
XLA flags: XLA:GPU's defaults, then `--xla_gpu_deterministic_ops=true` (what
bit-for-bit resume needs on a GPU, docs/backends.md).

Also measured, each in a child of its own:

- the floor: the HBM random-row gather bandwidth (`jnp.take` of 16M random
  rows of a 4 GB table, width 16 and 64), over which the bytes a step cannot
  avoid moving (`dlrm_step.traffic_floor_bytes`) give the floor in ms;
- a scatter-add of the step's ids, duplicates included, into a 10M-row table
  (XLA:GPU's duplicate-index scatter regressed in some jaxlib versions:
  jax#38806), against a sorted segment sum of the same;
- `--profile`: the sparse Criteo step at batch 16,384 under `jax.profiler`,
  and at 4,096, its device time summed per XLA op (with the JAX op it came
  from), beside the step's wall time (what the device is not busy for is
  launch and host time).

Writes the JSON as it goes (a run stopped at its time limit keeps what it
measured), prints the grid and draws it beside the JSON (`.png`).
"""

import argparse
import glob
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

import numpy as np

import dlrm_step
from children import StepTimer

HERE = pathlib.Path(__file__).parent
RESULTS = HERE / "results"
BATCHES = [4096, 16384, 65536]
VARIANTS = ["criteo", "multihot"]
PEERS = ["sparseopt", "keras"]
MORE_PEERS = ["sparseopt-grouped"]  # DispatchOptimizer(group_tables=True): one dedup for all
WIDTH = 16
RULE = "rowwise_adagrad"
FLAGS = {"default": "", "deterministic": "--xla_gpu_deterministic_ops=true"}
PROFILE_BATCHES = [4096, 16384]
SMOKE_ROWS = 1000
SMOKE_BATCHES = [256]


def device_memory_peak():
    """Peak bytes the first device's allocator has held (None where it keeps no count)."""
    import jax

    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def device_name():
    import jax

    d = jax.local_devices()[0]
    return f"{d.platform}: {getattr(d, 'device_kind', '')}"


# -- children ----------------------------------------------------------------------


def time_model(spec):
    """Builds one model, times each batch; returns a result per batch."""
    import peers

    tables = {k: tuple(v) for k, v in spec["tables"].items()}
    peer = "keras-jax" if spec["peer"] == "keras" else f"jax-{spec['peer']}"
    start = time.perf_counter()
    model = dlrm_step.build_keras(peer, tables, WIDTH, RULE)
    build_s = time.perf_counter() - start
    state, out = [], []
    for batch in spec["batches"]:
        xs, ys = dlrm_step.make_batches(tables, batch)
        distinct = float(np.mean([sum(np.unique(x[name]).size for name in tables)
                                  for x in xs]))
        start = time.perf_counter()
        run, sync = peers.jax_step(model, xs, ys, state=state)
        timer = StepTimer(run, sync, max_steps=200)
        first_s = time.perf_counter() - start  # compile + 4 steps
        for _ in range(spec["rounds"]):
            timer.time(spec["budget_s"])
        ids = batch * sum(bag for _, bag in tables.values())
        out.append(dict(variant=spec["variant"], peer=spec["peer"], flags=spec["flags"],
                        batch=batch, **timer.stats(), first_s=first_s, build_s=build_s,
                        ids_per_step=ids, distinct_ids_per_step=distinct,
                        floor_bytes=dlrm_step.traffic_floor_bytes(ids, distinct, WIDTH, RULE),
                        peak_device_bytes=device_memory_peak()))
        if batch in spec.get("profile", ()):
            import jax

            compiled = jax.jit(model.train_step, donate_argnums=0).lower(
                state[0], (jax.device_put(xs[0]), jax.device_put(ys[0]))).compile()
            try:
                out[-1]["profile"] = profile_steps(run, sync, compiled.as_text())
            except Exception as e:  # the timings stand without it
                out[-1]["profile"] = {"error": f"{type(e).__name__}: {e}"[:1000]}
    return out


def profile_steps(run, sync, hlo_text, steps=5, top=25):
    """Device time per XLA op over `steps` steps, largest first (per step).

    Args:
        run, sync: one step, and the wait for the steps in flight.
        hlo_text: the compiled step's HLO (`Compiled.as_text()`), which says
            what each op is and which JAX op it came from.
        steps: steps profiled.
        top: ops and kernels kept.
    """
    import jax
    from jax.profiler import ProfileData

    folder = tempfile.mkdtemp(prefix="gpu_step_profile_")
    sync()
    jax.profiler.start_trace(folder)
    for _ in range(steps):
        run()
    sync()
    jax.profiler.stop_trace()
    paths = glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True)
    if not paths:
        return {"error": f"no .xplane.pb under {folder}"}
    data = ProfileData.from_file(paths[0])
    planes = [p for p in data.planes if p.name.startswith("/device:")] or \
        [p for p in data.planes if p.name.startswith("/host:CPU")]
    by_op, kernels, lines, busy, launches = {}, {}, set(), 0.0, 0
    for plane in planes:
        for line in plane.lines:
            lines.add(f"{plane.name} | {line.name}")
            for event in line.events:
                if plane.name.startswith("/device:"):
                    busy += event.duration_ns
                    launches += 1
                op = dict(event.stats).get("hlo_op")
                if op is None:
                    continue
                by_op[str(op)] = by_op.get(str(op), 0.0) + event.duration_ns
                kernels[event.name] = kernels.get(event.name, 0.0) + event.duration_ns
    what = hlo_ops(hlo_text)
    scopes = {}  # the JAX scope each op came from: a table, the optimizer, a dense layer
    for op, ns in by_op.items():
        path = what.get(op, "").split(" ")[-1].split("/")
        scope = path[1] if len(path) > 1 else "(none)"
        scopes[scope] = scopes.get(scope, 0.0) + ns

    def per_step(ns):
        return ns / steps / 1e6

    classes = {}  # kernels by name less its number: "input_scatter_fusion", "wrapped_sort"
    for name, ns in kernels.items():
        key = re.sub(r"[._]?\d+$", "", name)
        classes[key] = classes.get(key, 0.0) + ns
    return {"steps": steps, "lines": sorted(lines)[:40],
            "kernel_classes": [{"kind": k[:80], "ms_per_step": per_step(ns)} for k, ns in
                               sorted(classes.items(), key=lambda kv: -kv[1])[:top]],
            "device_busy_ms_per_step": per_step(busy), "device_events_per_step": launches / steps,
            "op_ms_per_step": per_step(sum(by_op.values())),
            "scopes": [{"scope": k, "ms_per_step": per_step(ns)}
                       for k, ns in sorted(scopes.items(), key=lambda kv: -kv[1])[:top]],
            "ops": [{"op": op, "ms_per_step": per_step(ns), "what": what.get(op, "")}
                    for op, ns in sorted(by_op.items(), key=lambda kv: -kv[1])[:top]],
            "kernels": [{"kernel": name[:120], "ms_per_step": per_step(ns)}
                        for name, ns in sorted(kernels.items(), key=lambda kv: -kv[1])[:top]]}


def hlo_ops(text):
    """`{instruction name: what it is}` from HLO text: opcode, fusion kind, JAX op name."""
    out = {}
    for line in text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = [^ ]+(?: [^ ]+)*? ([a-z\-]+)\(", line)
        if not m:
            continue
        kind = re.search(r"kind=(\w+)", line)
        target = re.search(r'custom_call_target="([^"]+)"', line)
        name = re.search(r'op_name="([^"]+)"', line)
        out[m.group(1)] = " ".join(filter(None, [
            m.group(2), kind and kind.group(1), target and target.group(1),
            name and name.group(1)[-120:]]))
    return out


def time_jax(fn, *args, repeats=10):
    """Best wall time (ms) of a jitted `fn(*args)`, compiled and warmed first."""
    import jax

    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def floors(spec):
    """Random-row gather bandwidth, and the duplicate-index scatter against a segment sum."""
    import jax
    import jax.numpy as jnp

    out = {"device": device_name(), "jax": jax.__version__, "random_row_gbs": {}}
    table_bytes, reads = spec["table_bytes"], spec["rows_read"]
    for width in (16, 64):
        rows = table_bytes // (4 * width)
        table = jnp.ones((rows, width), jnp.float32)
        ids = jax.random.randint(jax.random.key(0), (reads,), 0, rows)
        ms = time_jax(jax.jit(lambda t, i: jnp.take(t, i, axis=0)), table, ids)
        out["random_row_gbs"][str(width)] = reads * width * 4 / (ms / 1e3) / 1e9
        del table
    # The sparse step's sums over the batch's ids: scatter-add with duplicates,
    # and the sorted segment sum it could be instead.
    rows, n = spec["scatter_rows"], spec["scatter_ids"]
    rng = np.random.default_rng(0)
    ids = jnp.asarray(dlrm_step.skewed_ids(rng, rows, (n,)))
    grads = jnp.ones((n, 16), jnp.float32)
    table = jnp.zeros((rows, 16), jnp.float32)
    scatter = jax.jit(lambda t, i, g: t.at[i].add(g), donate_argnums=0)
    jax.block_until_ready(scatter(table, ids, grads))
    table = jnp.zeros((rows, 16), jnp.float32)
    best = float("inf")
    for _ in range(10):
        start = time.perf_counter()
        table = scatter(table, ids, grads)
        jax.block_until_ready(table)
        best = min(best, time.perf_counter() - start)
    order = jnp.argsort(ids)
    out["scatter_add_duplicates_ms"] = best * 1e3
    out["segment_sum_sorted_ms"] = time_jax(
        jax.jit(lambda i, g: jax.ops.segment_sum(g, i, num_segments=rows,
                                                 indices_are_sorted=True)),
        ids[order], grads[order])
    out["scatter_ids"], out["scatter_rows"] = n, rows
    return out


def child(spec):
    """Runs one child's job and prints its JSON."""
    if spec["job"] == "floors":
        print(json.dumps(floors(spec)), flush=True)
    else:
        print(json.dumps(time_model(spec)), flush=True)


# -- the parent --------------------------------------------------------------------


def spawn(spec, flags, timeout_s):
    """Runs a child under `flags`; its JSON, or a dict saying why there is none."""
    xla = " ".join([os.environ.get("XLA_FLAGS", ""), FLAGS[flags], spec.get("xla_flags", "")])
    env = dict(os.environ, KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="2",
               XLA_FLAGS=" ".join(xla.split()))
    try:
        done = subprocess.run([sys.executable, str(pathlib.Path(__file__).resolve()),
                               "--child", json.dumps(spec)],
                              env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        return {"failed": f"over {timeout_s:.0f} s", "stderr": str(e.stderr or "")[-1500:]}
    lines = [line for line in done.stdout.splitlines() if line.startswith(("{", "["))]
    if done.returncode or not lines:
        return {"failed": f"exit {done.returncode}", "stderr": done.stderr[-3000:]}
    return json.loads(lines[-1])


def jobs(args):
    """The children, most wanted first (a run cut short keeps the first ones)."""
    cap = SMOKE_ROWS if args.smoke else None
    batches = SMOKE_BATCHES if args.smoke else args.batches
    rounds, budget = (1, 0.05) if args.smoke else (3, 0.5)
    out = [] if args.no_floors else [("default", {"job": "floors", "table_bytes": (1 << 20) if args.smoke else (4 << 30),
                        "rows_read": 4096 if args.smoke else 1 << 24,
                        "scatter_rows": SMOKE_ROWS if args.smoke else dlrm_step.MULTIHOT_ROWS,
                        "scatter_ids": 4096 if args.smoke else 26 * 65536})]
    for flags in args.flags:
        for variant in args.variants:
            for peer in args.peers:
                b = batches if flags == "default" else [batches[len(batches) // 2]]
                out.append((flags, {"job": "model", "variant": variant, "peer": peer,
                                    "flags": flags, "batches": b, "rounds": rounds,
                                    "budget_s": budget,
                                    "tables": dlrm_step.tables_of(variant, cap),
                                    "profile": (b if args.smoke else PROFILE_BATCHES)
                                    if args.profile and peer == "sparseopt"
                                    and variant == (args.variants[0] if args.smoke
                                                    else "criteo") else ()}))
    return out


def main(args):
    out_path = pathlib.Path(args.out)
    data = {"argv": sys.argv[1:], "smoke": args.smoke, "results": [], "skipped": []}
    deadline = time.monotonic() + args.deadline_s
    for flags, spec in jobs(args):
        spec["xla_flags"] = args.xla_flags
        left = deadline - time.monotonic()
        name = spec["job"] if spec["job"] == "floors" else \
            f"{flags} {spec['variant']} {spec['peer']}"
        if left < 20:
            data["skipped"].append(name)
            continue
        start = time.perf_counter()
        got = spawn(spec, flags, left)
        print(f"  {name}: {time.perf_counter() - start:.0f} s"
              + (f" FAILED {got['failed']}: {got['stderr'][-400:]}"
                 if isinstance(got, dict) and "failed" in got else ""), flush=True)
        if spec["job"] == "floors":
            data["floors"] = got
        elif isinstance(got, dict):
            data["results"] += [dict(variant=spec["variant"], peer=spec["peer"], flags=flags,
                                     batch=b, **got) for b in spec["batches"]]
        else:
            data["results"] += got
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(data, indent=1))
    print(report(data))
    if data["results"]:
        plot(data, out_path.with_suffix(".png"))
    return data


def report(data):
    """The grid as Markdown: ms per step, ratios, floor, peak device memory."""
    fl = data.get("floors", {})
    lines = []
    if "failed" in fl or not fl:
        lines.append(f"floors: {fl.get('failed', 'not measured')}")
        gbs = None
    else:
        gbs = fl["random_row_gbs"]
        lines += [f"device {fl['device']}, JAX {fl['jax']}",
                  "random-row gather: " + ", ".join(f"width {w}: {v:.0f} GB/s"
                                                    for w, v in gbs.items()),
                  f"scatter-add of {fl['scatter_ids']:,} skewed ids (duplicates) into "
                  f"{fl['scatter_rows']:,} rows: {fl['scatter_add_duplicates_ms']:.2f} ms; "
                  f"sorted segment sum: {fl['segment_sum_sorted_ms']:.2f} ms", ""]
    ok = {(r["flags"], r["variant"], r["peer"], r["batch"]): r
          for r in data["results"] if "failed" not in r}
    lines += ["| flags | variant | batch | sparseopt ms | Keras ms | Keras / sparseopt "
              "| sparseopt x floor | peak GB sparseopt / Keras |", "|---" * 8 + "|"]
    for flags, variant, batch in sorted({k[:2] + (k[3],) for k in ok}):
        s = ok.get((flags, variant, "sparseopt", batch))
        k = ok.get((flags, variant, "keras", batch))

        def ms(r):
            return f"{r['median_ms']:.2f}" if r else "-"

        def gb(r):
            return f"{r['peak_device_bytes'] / 1e9:.1f}" if r and r["peak_device_bytes"] \
                else "-"

        ratio = f"{k['median_ms'] / s['median_ms']:.2f}" if s and k else "-"
        floor = "-"
        if s and gbs:
            floor_ms = s["floor_bytes"] / (gbs[str(WIDTH)] * 1e9) * 1e3
            floor = f"{s['median_ms'] / floor_ms:.1f}x ({floor_ms:.3f} ms)"
        lines.append(f"| {flags} | {variant} | {batch:,} | {ms(s)} | {ms(k)} | {ratio} | "
                     f"{floor} | {gb(s)} / {gb(k)} |")
    more = sorted(k for k in ok if k[2] not in PEERS)
    if more:
        lines += ["", "| flags | variant | batch | peer | ms | / sparseopt |", "|---" * 6 + "|"]
    for flags, variant, peer, batch in more:
        base = ok.get((flags, variant, "sparseopt", batch))
        ms = ok[(flags, variant, peer, batch)]["median_ms"]
        lines.append(f"| {flags} | {variant} | {batch:,} | {peer} | {ms:.2f} | "
                     + (f"{ms / base['median_ms']:.2f} |" if base else "- |"))
    for r in data["results"]:
        if "failed" in r:
            lines.append(f"failed: {r['flags']} {r['variant']} {r['peer']} {r['batch']}: "
                         f"{r['failed']}")
        if r.get("profile"):
            p = r["profile"]
            if "error" in p:
                lines.append(f"profile: {p['error']}")
                continue
            lines += ["", f"profile, {r['flags']} {r['variant']} {r['peer']} batch "
                      f"{r['batch']:,}: step {r['median_ms']:.2f} ms, the device busy "
                      f"{p.get('device_busy_ms_per_step', float('nan')):.3f} ms of it "
                      f"({p.get('device_events_per_step', float('nan')):.0f} device events), "
                      f"{p['op_ms_per_step']:.3f} ms in XLA ops"]
            lines += [] if "kernel_classes" not in p else ["  by kernel kind: " + ", ".join(
                f"{c['kind']} {c['ms_per_step']:.3f}" for c in p["kernel_classes"][:15])]
            lines += ["  by scope: " + ", ".join(f"{c['scope']} {c['ms_per_step']:.3f}"
                                             for c in p["scopes"])]
            lines += [f"  {o['ms_per_step']:.4f} ms  {o['op']}  {o['what']}" for o in p["ops"]]
    if data.get("skipped"):
        lines.append("skipped (time limit): " + ", ".join(data["skipped"]))
    return "\n".join(lines)


def plot(data, path):
    """Step time by batch, sparseopt and Keras, one panel per variant (the floor dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in data["results"] if "failed" not in r and r["flags"] == "default"]
    gbs = data.get("floors", {}).get("random_row_gbs")
    variants = [v for v in VARIANTS if any(r["variant"] == v for r in ok)]
    fig, axes = plt.subplots(1, len(variants), figsize=(5.5 * len(variants), 4), squeeze=False)
    for ax, variant in zip(axes[0], variants):
        for peer, color in (("sparseopt", "tab:green"), ("keras", "tab:red"),
                            ("sparseopt-grouped", "tab:olive")):
            rs = sorted((r for r in ok if r["variant"] == variant and r["peer"] == peer),
                        key=lambda r: r["batch"])
            if rs:
                ax.plot([r["batch"] for r in rs], [r["median_ms"] for r in rs], "o-",
                        color=color, label=peer)
        rs = sorted((r for r in ok if r["variant"] == variant and r["peer"] == "sparseopt"),
                    key=lambda r: r["batch"])
        if gbs and rs:
            ax.plot([r["batch"] for r in rs],
                    [r["floor_bytes"] / (gbs[str(WIDTH)] * 1e9) * 1e3 for r in rs], "k--",
                    label="HBM random-row floor")
        ax.set(xscale="log", yscale="log", xlabel="batch", ylabel="ms per step",
               title=f"{variant}, width {WIDTH}, {RULE}\n{data.get('floors', {}).get('device', '')}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny tables, one small batch (CPU)")
    p.add_argument("--out", default=str(RESULTS / "gpu_step.json"))
    p.add_argument("--flags", nargs="+", default=list(FLAGS), choices=list(FLAGS))
    p.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS)
    p.add_argument("--peers", nargs="+", default=PEERS, choices=PEERS + MORE_PEERS)
    p.add_argument("--batches", nargs="+", type=int, default=BATCHES)
    p.add_argument("--no-floors", action="store_true", help="skip the floor's child")
    p.add_argument("--xla-flags", default="",
                   help="XLA flags for every child (`--xla_gpu_enable_command_buffer=` "
                        "shows each op in the profile instead of one command buffer)")
    p.add_argument("--profile", action="store_true", help="profile the sparse Criteo step")
    p.add_argument("--deadline-s", type=float, default=480.0,
                   help="start no child after this many seconds; what is left is listed")
    p.add_argument("--report", help="print the grid of a results JSON and exit")
    p.add_argument("--plot", help="with --report: also draw the grid into this PNG")
    p.add_argument("--child", help=argparse.SUPPRESS)
    return p.parse_args(argv)


if __name__ == "__main__":
    args = parse()
    if args.child:
        child(json.loads(args.child))
    elif args.report:
        data = json.loads(pathlib.Path(args.report).read_text())
        print(report(data))
        if args.plot:
            plot(data, args.plot)
    else:
        main(args)
