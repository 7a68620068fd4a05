"""The DLRM example with its large tables split by rows over 8 devices (JAX).

The same model, data and training as `dlrm_synthetic.py`. Before the model is
built, one line sets a `keras.distribution`: every table with at least
`--min-rows` rows is row-sharded over all devices (its optimizer state goes
with it), the small tables and the dense layers are replicated, and each
batch is split over the devices (data parallel).

On a CPU machine the devices are simulated (`--devices`, 8 by default): they
share its cores, so expect the memory per device to shrink, not the step
time. On a GPU or TPU host the script uses the real devices; on several
hosts, start it once per host with Keras' `KERAS_DISTRIBUTION_JOB_ADDRESSES`,
`KERAS_DISTRIBUTION_NUM_PROCESSES` and `KERAS_DISTRIBUTION_PROCESS_ID` set
and it calls `keras.distribution.initialize()` (docs/scaling.md).

    python examples/sharded_dlrm.py             # 8 simulated CPU devices, ~1 min
    python examples/sharded_dlrm.py --devices 4 --examples 600000
"""

import argparse
import os


def parse_args():
    parser = argparse.ArgumentParser(description="DLRM with row-sharded tables.")
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
    parser.add_argument("--min-rows", type=int, default=10_000, help="shard tables this large")
    parser.add_argument("--examples", type=int, default=1_200_000)
    parser.add_argument("--validation", type=int, default=None,
                        help="held-out examples for the validation loss (default 50,000)")
    parser.add_argument("--chunks", type=int, default=4, help="validation points in the pass")
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies table sizes")
    return parser.parse_args()


args = parse_args()
# Sharding is keras.distribution's, i.e. JAX's; the device count is fixed at start.
os.environ["KERAS_BACKEND"] = "jax"
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={args.devices}")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import sparseopt  # noqa: E402
from dlrm_common import (  # noqa: E402
    TABLE_SIZES, VALIDATION_EXAMPLES, build_dlrm, split_at, synthetic_clicks, train_in_chunks)
from sparseopt.distribution import (  # noqa: E402
    bytes_per_device, collectives, compile_train_step)


def main():
    if "KERAS_DISTRIBUTION_NUM_PROCESSES" in os.environ:
        keras.distribution.initialize()
    devices = len(keras.distribution.list_devices())
    keras.utils.set_random_seed(0)
    sizes = [max(4, int(s * args.scale)) for s in TABLE_SIZES]
    # Tables split evenly over the devices (JAX needs an even split).
    sharded = [f for f, rows in enumerate(sizes) if rows >= args.min_rows and rows % devices == 0]
    keras.distribution.set_distribution(sparseopt.distribution.row_sharded(
        [f"table_{f}/embeddings" for f in sharded]))

    x, y, _ = synthetic_clicks(args.examples + (args.validation or VALIDATION_EXAMPLES), sizes)
    (train_x, val_x), (train_y, val_y) = split_at(x, args.examples), split_at(y, args.examples)
    print(f"sparseopt {sparseopt.__version__}, Keras {keras.__version__}, "
          f"{devices} {keras.distribution.list_devices()[0].split(':')[0]} devices")
    print(f"{len(sizes)} tables, {sum(sizes):,} rows x {args.width}; {len(sharded)} tables "
          f"({sum(sizes[f] for f in sharded):,} rows) split by rows over {devices} devices, "
          "the rest replicated; batches split over the devices")

    model = build_dlrm(sizes, args.width, sparse=True)
    optimizer = sparseopt.DispatchOptimizer(keras.optimizers.Adam(1e-3))
    model.compile(optimizer=optimizer, loss="binary_crossentropy",
                  metrics=[keras.metrics.AUC(name="auc")])
    optimizer.build(model.trainable_variables)

    tables = [model.get_layer(f"table_{f}").embeddings for f in sharded]
    names = {t.path.replace("/", "_") + "_" for t in tables}
    state = [v for v in optimizer.variables if any(v.path.split("/")[-1].startswith(n)
                                                   for n in names)]
    held = bytes_per_device(tables + state)
    whole = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in tables + state)
    print(f"sharded tables + their optimizer state: {whole / 2**20:.1f} MB in all, "
          f"{max(held.values()) / 2**20:.1f} MB on each device "
          f"({whole / max(held.values()):.1f}x less)")
    batch_x = {k: v[:args.batch] for k, v in train_x.items()}
    moved = collectives(compile_train_step(model, batch_x, train_y[:args.batch]).as_text())
    shard_rows = {sizes[f] // devices for f in sharded} | {sizes[f] for f in sharded}
    table_sized = [c for c in moved for s in c.shapes if s and s[0] in shard_rows]
    print(f"compiled step: {len(moved)} collectives, {sum(c.nbytes for c in moved) / 2**20:.2f} "
          f"MB of collective results per device per step, {len(table_sized)} carrying a table")

    print(f"\n{'examples seen':>14s} {'val loss':>9s} {'val AUC':>8s} {'ms/step':>8s}")
    loss, auc = model.evaluate(val_x, val_y, batch_size=8192, verbose=0)
    print(f"{0:14,d} {loss:9.4f} {auc:8.3f}")
    train_in_chunks(model, train_x, train_y, val_x, val_y, args)
    print(f"ids dropped as out of range: {sum(optimizer.dropped_ids().values())}; table steps "
          f"skipped for non-finite gradients: {sum(optimizer.skipped_steps().values())}")


if __name__ == "__main__":
    main()
