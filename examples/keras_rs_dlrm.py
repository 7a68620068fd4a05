"""The DLRM example written with keras-rs `DistributedEmbedding`, trained by sparseopt.

The same 26 tables as examples/dlrm_synthetic.py, declared the keras-rs way:
one `TableConfig` per table with its own optimizer (Adagrad for the large
tables, FTRL for the small ones) and one `FeatureConfig` per feature. All a
user does for sparseopt is compile with `sparseopt.DispatchOptimizer(Adam)`:

- on CPU/GPU (here), keras-rs falls back to one Keras embedding per table and
  would leave `TableConfig.optimizer` unused; DispatchOptimizer trains each
  table sparsely, in place, with that optimizer's rule, and Adam gets the
  dense layers only;
- on a TPU with SparseCore the same script places the tables on SparseCore,
  where keras-rs applies each `TableConfig.optimizer` inside the lookup's
  backward pass; DispatchOptimizer then only installs those results (see
  docs/sparsecore.md).

At the end, the same model is timed with plain `compile(optimizer=Adam())`,
i.e. keras-rs' fallback as it is: Adam trains every table densely.

    KERAS_BACKEND=jax python examples/keras_rs_dlrm.py        # ~1 min
    KERAS_BACKEND=tensorflow python examples/keras_rs_dlrm.py
"""

import argparse
import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import keras  # noqa: E402
import keras_rs  # noqa: E402
import numpy as np  # noqa: E402

import sparseopt  # noqa: E402
from dlrm_common import (  # noqa: E402
    NUM_DENSE, TABLE_SIZES, VALIDATION_EXAMPLES, dot_interaction, mlp, split_at, state_bytes,
    synthetic_clicks, time_steps, train_in_chunks)


def table_optimizer(rows):
    """What a keras-rs user writes in TableConfig: Keras optimizers by name."""
    if rows >= 1_000:
        return keras.optimizers.Adagrad(0.05)
    return keras.optimizers.Ftrl(0.05, l2_regularization_strength=1e-4)


def build(table_sizes, width, batch):
    features = {}
    for f, rows in enumerate(table_sizes):
        table = keras_rs.layers.TableConfig(
            name=f"table_{f}", vocabulary_size=rows, embedding_dim=width,
            optimizer=table_optimizer(rows), combiner="sum")
        features[f"f{f}"] = keras_rs.layers.FeatureConfig(
            name=f"f{f}", table=table, input_shape=(batch, 1), output_shape=(batch, width))
    dense_in = keras.Input((NUM_DENSE,), name="dense")
    ids_in = {name: keras.Input((1,), dtype="int32", name=name) for name in features}
    embedded = keras_rs.layers.DistributedEmbedding(features, name="tables")(ids_in)
    bottom = mlp(dense_in, [64, width], "bottom")
    top = mlp(dot_interaction(bottom, [embedded[name] for name in features]), [128, 64], "top")
    out = keras.layers.Dense(1, activation="sigmoid", name="click")(top)
    return keras.Model({"dense": dense_in, **ids_in}, out, name="dlrm_keras_rs")


def as_features(x):
    """synthetic_clicks' `ids` matrix -> one `[N, 1]` input per feature."""
    return {"dense": x["dense"], **{f"f{f}": x["ids"][:, f:f + 1]
                                    for f in range(x["ids"].shape[1])}}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--examples", type=int, default=1_200_000)
    parser.add_argument("--validation", type=int, default=VALIDATION_EXAMPLES,
                        help="held-out examples for the validation loss")
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies table sizes")
    parser.add_argument("--compare-steps", type=int, default=20)
    args = parser.parse_args()
    keras.utils.set_random_seed(0)
    sizes = [max(4, int(s * args.scale)) for s in TABLE_SIZES]
    x, y, prob = synthetic_clicks(args.examples + args.validation, sizes)
    x = as_features(x)
    (train_x, val_x), (train_y, val_y) = split_at(x, args.examples), split_at(y, args.examples)

    print(f"keras-rs {keras_rs.__version__} DistributedEmbedding + sparseopt "
          f"{sparseopt.__version__} ({keras.backend.backend()} backend, CPU: tables on "
          "the default device)")
    model = build(sizes, args.width, args.batch)
    optimizer = sparseopt.DispatchOptimizer(keras.optimizers.Adam(1e-3))
    model.compile(optimizer=optimizer, loss="binary_crossentropy",
                  metrics=[keras.metrics.AUC(name="auc")])
    model.optimizer.build(model.trainable_variables)
    kinds = {}
    for table in optimizer.table_trainers.values():
        kinds.setdefault(repr(table.updater), []).append(table.table.shape[0])
    print(f"{len(sizes)} tables, {sum(sizes):,} rows x {args.width}, each "
          "trained by its TableConfig.optimizer:")
    for kind, rows in kinds.items():
        print(f"  {len(rows):2d} tables, {sum(rows):>9,} rows: {kind}")

    bce = lambda p: float(np.mean(keras.losses.binary_crossentropy(val_y, p)))  # noqa: E731
    print(f"\nvalidation loss of a constant predictor: {bce(np.full_like(val_y, y.mean())):.4f}; "
          f"of the true click probabilities: {bce(prob[args.examples:]):.4f}")
    print(f"{'examples seen':>14s} {'val loss':>9s} {'val AUC':>8s} {'ms/step':>8s}")
    step_times = train_in_chunks(model, train_x, train_y, val_x, val_y, args)
    print("table steps skipped for non-finite gradients: "
          f"{sum(optimizer.skipped_steps().values())}")

    adam_table_slots = [v for v in optimizer.optimizer.variables
                        if len(v.shape) == 2 and v.shape[0] in sizes and v.shape[0] > 64]
    print(f"Adam variables shaped like a table: {len(adam_table_slots)}")
    if args.compare_steps:
        keras.utils.set_random_seed(0)
        plain = build(sizes, args.width, args.batch)
        plain_opt = keras.optimizers.Adam(1e-3)
        plain.compile(optimizer=plain_opt, loss="binary_crossentropy")
        plain_ms = time_steps(plain, train_x, train_y, args.batch, args.compare_steps)
        sparse_ms = float(np.median(step_times)) * 1e3
        table_bytes = sum(sizes) * args.width * 4
        print("\n== the same keras-rs model, compiled two ways ==")
        print(f"{'':48s} {'ms/step':>8s} {'optimizer state':>16s}")
        for name, ms, opt in [("DispatchOptimizer(Adam): per-table optimizers", sparse_ms,
                               optimizer),
                              ("Adam (keras-rs fallback as is): Adam on tables", plain_ms,
                               plain_opt)]:
            print(f"{name:48s} {ms:8.1f} {state_bytes(opt) / 2**20:13.1f} MB")
        print(f"(tables: {table_bytes / 2**20:.0f} MB)")


if __name__ == "__main__":
    main()
