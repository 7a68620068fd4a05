"""Row-sharded tables on 1, 2, 4 and 8 simulated devices, at a fixed total size.

Two tables (`big`: row-wise Adagrad, `mid`: Adagrad, a quarter of `big`'s
rows), bags of ids from a skewed distribution, a Dense tower with Adam. Each
device count runs in its own process (JAX fixes the device count at start;
`--xla_force_host_platform_device_count`), with the tables row-sharded by
`sparseopt.distribution.row_sharded` (1 device: no distribution), updated
both ways: "every" (every shard takes every id; lookups by XLA's
partitioner) and "routed" (each id sent to its owner, for the update and the
lookup; forced on from 2 shards here, to show the crossover). The
processes are timed round-robin, side by side, and each reports:

- median ms per step of the compiled train step (state donated, as `fit`);
- the ids each shard dedups per table and round, the rows it reads for the
  lookups, and the bytes the update's and the lookups' own collectives bring
  each device (from the HLO of the train step and of the forward pass), and
  the routed rounds each timed batch takes
  (`sparseopt.distribution.routed_rounds`);
- bytes per device of the tables and their optimizer state (shards held);
- the compiled step's scratch memory per device (XLA's memory analysis);
- bytes each device receives in collectives per step (from the HLO), and
  whether any collective carries a table-sized array.

From the measured per-row state bytes and per-id collective bytes it prints
the estimate for a large table (default 1e9 rows x 128) used in
docs/scaling.md. Simulated devices share this machine's cores: the step
times show the cost of sharding on one host, not a speed-up.

    python benchmarks/sharded.py                 # 4M + 1M rows x 32, ~5 min
    python benchmarks/sharded.py --rows 1000000 --rounds 3   # quick
    python benchmarks/sharded.py --spread        # hot ids spread over the shards

Writes benchmarks/results/sharded.json and sharded.png.
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
import common
from children import answer, drive, memory_mb  # noqa: E402

DEVICES = (1, 2, 4, 8)


def child(args):
    import jax
    import keras
    import numpy as np

    import sparseopt
    from sparseopt.backend import jax_sharding
    from sparseopt.distribution import (bytes_per_device, collectives, compile_train_step,
                                        step_inputs)

    # Which way row-sharded updates take: "every" (every shard takes every id),
    # "routed" (each id to its owner, from 2 shards on, to show the crossover).
    jax_sharding.ROUTE_MIN_SHARDS = 2 if args.path == "routed" else 10**9
    devices = jax.device_count()
    if devices > 1:
        keras.distribution.set_distribution(
            sparseopt.distribution.row_sharded([r".*/embeddings"]))
    keras.utils.set_random_seed(0)
    tables = {"big": (args.rows, sparseopt.updaters.RowwiseAdagrad(0.05), args.bag),
              "mid": (args.rows // 4, sparseopt.updaters.Adagrad(0.05), args.bag)}
    model = common.recommender(tables, args.width, top=(64,),
                               loss=keras.losses.BinaryCrossentropy(from_logits=True))
    model.optimizer.build(model.trainable_variables)

    rng = np.random.default_rng(0)
    batches = []
    for _ in range(4):
        xb = {name: common.zipf_ids(rng, rows, (args.batch, args.bag), 1.2, start=0)
              for name, (rows, _, _) in tables.items()}
        if args.spread:  # hot ids spread over the shards (a bijection of the rows)
            xb = {name: np.where(ids >= 0, ids.astype(np.int64) * 2654435761 % tables[name][0],
                                 ids).astype("int32") for name, ids in xb.items()}
        batches.append((xb, (rng.random((args.batch, 1)) < 0.3).astype("float32")))
    compiled = compile_train_step(model, *batches[0])
    inputs = [step_inputs(model, xb, yb)[1] for xb, yb in batches]

    table_variables = [
        v for n in tables for t in [model.optimizer.table_trainer(f"{n}_table/embeddings")]
        for v in (t.table, *t.saved_variables, *t.scratch_variables)]
    held = bytes_per_device(table_variables)
    moved = collectives(compiled.as_text())
    largest_table_rows = {rows // devices for rows, _, _ in tables.values()}
    ids_per_table = args.batch * args.bag
    # The every-id way: all-gathers of a table's ids [ids] and gradients [ids, width]
    # (a routed step has none: the way is chosen when the step is traced).
    every = [c for c in moved if c.kind == "all-gather" and c.shapes
             and c.shapes[0][:1] == (ids_per_table,)]
    routed = [c for c in moved if c.kind == "all-to-all"]
    moved_bytes = sum(c.nbytes for c in moved)
    # The lookups' own collectives: those of the forward pass alone (Keras'
    # predict step on the same batch: the train step's forward does the same).
    state, data = step_inputs(model, *batches[0])
    looked_up = collectives(jax.jit(model.predict_step).lower(
        state[:2], (data[0],)).compile().as_text())
    lookup_bytes = sum(c.nbytes for c in looked_up)
    # Routed, the lookups' all-to-alls are in the train step too: the update's
    # are the others.
    taken = routed if args.path == "routed" and devices > 1 else every
    update_bytes = sum(c.nbytes for c in taken) - (
        sum(c.nbytes for c in looked_up if c.kind == "all-to-all") if taken is routed else 0)
    result = {
        "devices": devices,
        "path": args.path,
        # Entries each shard dedups per table and round: the ids it receives
        # (all-to-all: [shards, capacity], possibly one operand per sender;
        # all-gather: [ids]), from the HLO.
        "dedup_entries_per_device_per_table": max(
            [sum(math.prod(s) for s in c.shapes if len(s) == (2 if c.kind == "all-to-all"
                                                             else 1)) for c in taken]
            or [ids_per_table]),
        # Rows each shard gathers per table and round for the lookups: routed,
        # the ids it is asked for ([shards, capacity]); else every looked-up id
        # (XLA's partitioner reads each shard's rows for all of them).
        "lookup_entries_per_device_per_table": max(
            [sum(math.prod(s) for s in c.shapes if len(s) == 2)
             for c in looked_up if c.kind == "all-to-all"] or [ids_per_table]),
        # The table updates' own collectives on the way taken (per round), the
        # lookups' (per round where routed), and everything the step moves on
        # that way (dense gradients too).
        "update_collective_bytes_per_device": update_bytes,
        "lookup_collective_bytes_per_device": lookup_bytes,
        "step_collective_bytes_per_device": moved_bytes,
        "rounds_per_batch": rounds(batches, tables, devices)
        if args.path == "routed" and devices > 1 else None,
        "table_and_state_bytes_per_device": max(held.values()),
        # Of which, per table: its skip counter and hyperparameters (4-byte scalars).
        "table_scalar_bytes": 4 * sum(1 for v in table_variables if not len(v.shape)),
        "scratch_bytes_per_device": compiled.memory_analysis().temp_size_in_bytes,
        "collective_bytes_per_device": moved_bytes,
        "collectives": len(moved),
        "table_sized_collectives": sum(
            1 for c in moved for s in c.shapes if s and s[0] in largest_table_rows),
        "ids_per_step": args.batch * args.bag * len(tables),
        "times_ms": [],
    }
    for _ in range(3):  # warm-up
        _, state = compiled(state, inputs[0])
    jax.block_until_ready(state)
    step = 0

    def time_once():
        nonlocal state, step
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            logs, state = compiled(state, inputs[step % len(inputs)])
            jax.block_until_ready(logs)
            times.append(time.perf_counter() - start)
            step += 1
        result["times_ms"].append(1e3 * statistics.median(times[args.steps // 3:]))

    def final():
        result["rss_mb"] = memory_mb("VmRSS:")
        return result

    answer(time_once, final)


def rounds(batches, tables, devices):
    """The routed rounds each timed batch takes (its largest over the tables)."""
    import numpy as np

    from sparseopt.distribution import routed_rounds

    return [max(routed_rounds(np.array_split(xb[name].reshape(-1), devices), rows, devices)
                for name, (rows, _, _) in tables.items()) for xb, _ in batches]


def estimate(results, args):
    """What a `rows x width` table needs, from the measured per-row figures."""
    one = next(r for r in results if r["devices"] == 1)
    most = max(r["devices"] for r in results)
    eight = next(r for r in results if r["devices"] == most and r["path"] == "every")
    routed = next((r for r in results if r["devices"] == most and r["path"] == "routed"), None)
    # Bytes per row: the row (4 * width), the dedup workspace (4) and the
    # rule's state (row-wise Adagrad 4, Adagrad 4 * width, FTRL 8 * width).
    # The formula must give the measured bytes (plus each table's 4-byte
    # scalars: skip counter, hyperparameters) before it is used at another width.
    expected = (args.rows * (4 * args.width + 8)
                + args.rows // 4 * (8 * args.width + 4)) + one["table_scalar_bytes"]
    measured = one["table_and_state_bytes_per_device"]
    if measured != expected:
        print(f"WARNING: measured state {measured} B != per-row formula {expected} B")
    per_row = {"sgd": 4 * args.est_width + 4, "rowwise_adagrad": 4 * args.est_width + 8,
               "adagrad": 8 * args.est_width + 4, "ftrl": 12 * args.est_width + 4}
    # Collective bytes per looked-up id and per width element, measured.
    per_id_elem = eight["collective_bytes_per_device"] / (eight["ids_per_step"] * args.width)
    ids = args.est_batch * args.est_ids_per_example
    usable = args.device_gb * 1e9 * 0.8  # leave 20% for activations and XLA scratch
    out = {"measured_state_bytes": measured, "formula_state_bytes": expected,
           "measured_collective_bytes_per_id_per_width": per_id_elem,
           "per_row_bytes": per_row, "rows": args.est_rows, "width": args.est_width,
           "global_ids_per_step": ids, "options": {}}
    for rule, b in per_row.items():
        total = args.est_rows * b
        least = int(-(-total // usable))
        nodes = -(-least // args.devices_per_node)  # whole hosts
        devices = nodes * args.devices_per_node
        out["options"][rule] = {"state_gb": total / 1e9, "least_devices": least,
                                "devices": devices, "hosts": nodes,
                                "gb_per_device": total / devices / 1e9}
    out["collective_gb_per_device_per_step"] = per_id_elem * ids * args.est_width / 1e9
    if routed is not None:
        # Routed, the lookups' and the update's collectives each bring a
        # device about `ROUTE_CAPACITY / devices` of the ids (one round: ids
        # spread over the shards): measured at `most` devices, scaled to the
        # estimate's device count. The rest (dense gradients) does not scale.
        scale = routed["ids_per_step"] * args.width
        update = routed["update_collective_bytes_per_device"] / scale
        lookup = routed["lookup_collective_bytes_per_device"] / scale
        rest = routed["step_collective_bytes_per_device"] / scale - update - lookup
        out["routed_measured_bytes_per_id_per_width"] = {"update": update, "lookup": lookup,
                                                         "rest": rest}
        out["routed_collective_gb_per_device_per_step"] = {
            rule: (rest + (update + lookup) * most / o["devices"]) * ids * args.est_width / 1e9
            for rule, o in out["options"].items()}
    out["single_device_ms_per_1k_ids"] = min(one["times_ms"]) / one["ids_per_step"] * 1e3
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=4_000_000, help="rows of `big`")
    parser.add_argument("--devices", type=int, nargs="*", default=list(DEVICES),
                        help="simulated device counts to compare")
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--bag", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30, help="steps per timing")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--est-rows", type=float, default=1e9)
    parser.add_argument("--est-width", type=int, default=128)
    parser.add_argument("--est-batch", type=int, default=65536)
    parser.add_argument("--est-ids-per-example", type=int, default=26)
    parser.add_argument("--device-gb", type=float, default=80, help="memory per device")
    parser.add_argument("--devices-per-node", type=int, default=8)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "sharded.json"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--path", default="every", help=argparse.SUPPRESS)
    parser.add_argument("--spread", action="store_true",
                        help="spread hot ids over the shards (ids x a large prime mod rows)")
    args = parser.parse_args()
    if args.child:
        return child(args)

    argv = [sys.executable, __file__, "--child", "--rows", str(args.rows), "--width",
            str(args.width), "--batch", str(args.batch), "--bag", str(args.bag),
            "--steps", str(args.steps)] + (["--spread"] if args.spread else [])
    children = []
    # One device: nothing to route. More: both ways, side by side.
    runs = [(n, path) for n in args.devices for path in
            (["every"] if n == 1 else ["every", "routed"])]
    for n, path in runs:
        env = dict(os.environ, KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="3",
                   XLA_FLAGS=f"--xla_force_host_platform_device_count={n}",
                   PYTHONPATH=os.path.dirname(HERE))
        proc = subprocess.Popen(argv + ["--path", path], env=env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        line = proc.stdout.readline().strip()
        assert line == "ready", f"{n} devices: child said {line!r}"
        children.append(proc)
    results = drive(children, args.rounds, cooldown_s=0.5)

    base = statistics.median(results[0]["times_ms"])
    print(f"\nTables: {args.rows:,} + {args.rows // 4:,} rows x {args.width}; "
          f"batch {args.batch} x {args.bag} ids per table; median of {args.rounds} rounds\n")
    print("| Devices | way | ms/step | vs 1 device | tables+state per device (MB) | vs 1 device "
          "| step scratch per device (MB) | ids each shard dedups per table (of "
          f"{args.batch * args.bag:,}) | update collectives per device (KB) "
          "| rows each shard reads per table | lookup collectives per device (KB) "
          "| all collectives per device per step (KB) | table-sized collectives "
          "| rounds per batch |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    held1 = results[0]["table_and_state_bytes_per_device"]
    for r in results:
        ms = statistics.median(r["times_ms"])
        held = r["table_and_state_bytes_per_device"]
        rounds_ = ("-" if r["rounds_per_batch"] is None
                   else ", ".join(map(str, r["rounds_per_batch"])))
        print(f"| {r['devices']} | {r['path']} | {ms:.2f} | {ms / base:.2f}x "
              f"| {held / 1e6:.1f} | {held / held1:.3f} "
              f"| {r['scratch_bytes_per_device'] / 1e6:.2f} "
              f"| {r['dedup_entries_per_device_per_table']:,} "
              f"| {r['update_collective_bytes_per_device'] / 1e3:.0f} "
              f"| {r['lookup_entries_per_device_per_table']:,} "
              f"| {r['lookup_collective_bytes_per_device'] / 1e3:.0f} "
              f"| {r['step_collective_bytes_per_device'] / 1e3:.0f} "
              f"| {r['table_sized_collectives']} | {rounds_} |")
    est = estimate(results, args)
    print(f"\nEstimate for {args.est_rows:.0e} rows x {args.est_width}, "
          f"{args.device_gb:.0f} GB devices (80% usable), "
          f"{est['global_ids_per_step']:,} ids per step:")
    print(f"  measured state at 1 device: {est['measured_state_bytes']:,} B "
          f"(per-row formula: {est['formula_state_bytes']:,} B)")
    for rule, o in est["options"].items():
        print(f"  {rule}: {o['state_gb']:.0f} GB of table+state -> at least "
              f"{o['least_devices']} devices; {o['hosts']} hosts of {args.devices_per_node}: "
              f"{o['devices']} devices, {o['gb_per_device']:.1f} GB each")
    print(f"  collectives: {est['measured_collective_bytes_per_id_per_width']:.1f} B per id "
          f"per width element -> {est['collective_gb_per_device_per_step']:.2f} GB of "
          "collective results per device per step")
    print(f"  work: {est['single_device_ms_per_1k_ids']:.3f} ms per 1k ids per step on one "
          "CPU device (each shard processes every id of the step)")
    if "routed_collective_gb_per_device_per_step" in est:
        measured = est["routed_measured_bytes_per_id_per_width"]
        print(f"  routed: {measured['update']:.2f} B per id per width element for the update, "
              f"{measured['lookup']:.2f} for the lookups (per round) and {measured['rest']:.2f} "
              "for the rest at the largest device count measured; at the devices above: "
              + ", ".join(
                  f"{rule} {gb:.3f} GB" for rule, gb in
                  est["routed_collective_gb_per_device_per_step"].items())
              + " per device per step")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "results": results, "estimate": est}, f, indent=1)
    plot(results, args.out.replace(".json", ".png"))


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, c, b) = plt.subplots(1, 3, figsize=(15, 3.8))
    one = [r for r in results if r["devices"] == 1]
    for way, label in (("every", "every shard takes every id"),
                       ("routed", "ids routed to their owner")):
        runs = one + [r for r in results if r["path"] == way and r["devices"] > 1]
        a.plot([r["devices"] for r in runs], [statistics.median(r["times_ms"]) for r in runs],
               "o-", label=label)
        runs = runs[1:]
        c.plot([r["devices"] for r in runs],
               [r["step_collective_bytes_per_device"] / 1e6 for r in runs], "o-", label=label)
    a.legend()
    c.legend()
    n = sorted({r["devices"] for r in results if r["devices"] > 1})
    c.set_xscale("log", base=2)
    c.set(xticks=n, xticklabels=n, xlabel="devices", ylabel="MB per device per step (round)",
          title="Collectives: lookups, updates, dense", ylim=(0, None))
    results = [r for r in results if r["path"] == "every"]
    n = [r["devices"] for r in results]
    a.set_xscale("log", base=2)
    a.set(xticks=n, xticklabels=n, xlabel="simulated devices (one host, 2 cores)",
          ylabel="ms per step", title="Step time, fixed total table size")
    held = [r["table_and_state_bytes_per_device"] / 1e6 for r in results]
    b.plot(n, held, "o-", label="measured")
    b.plot(n, [held[0] / d for d in n], "k:", label="1/devices")
    b.set_xscale("log", base=2)
    b.set_yscale("log", base=2)
    b.set(xticks=n, xticklabels=n, yticks=held, yticklabels=[f"{h:.0f}" for h in held],
          xlabel="devices", ylabel="MB per device", title="Tables + optimizer state per device")
    for ax in (a, b, c):
        ax.minorticks_off()
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
