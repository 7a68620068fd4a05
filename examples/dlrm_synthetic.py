"""A DLRM-style click model on synthetic data, its tables trained by sparseopt.

13 dense features and 26 categorical features (tables from 4 to 1,000,000
rows), a bottom MLP, DLRM's pairwise dot-product interaction and a top MLP.
The dense layers are trained by Adam; each table by its own sparse updater
(Adagrad, row-wise Adagrad or FTRL), in place, on the rows the batch touches.

The labels carry a learnable signal: each id of each feature has a hidden
click propensity, and the click probability is a logistic function of their
sum plus a linear term of the dense features. As recommender models usually
are, it trains in one pass over fresh data (repeated epochs would memorize the
rare ids); the validation loss is reported after each chunk of the stream and
should fall well below that of a constant predictor, towards that of the true
click probabilities (the best any model can do).

At the end the same architecture is trained for a few steps the way most
users start: `keras.layers.Embedding` + `keras.optimizers.Adam` for everything.
Step time and optimizer memory are compared.

    KERAS_BACKEND=jax python examples/dlrm_synthetic.py     # the `make demo` run, ~1 min
    python examples/dlrm_synthetic.py --examples 5000000 --scale 10
"""

import argparse
import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras import ops  # noqa: E402

import sparseopt  # noqa: E402
from dlrm_common import (  # noqa: E402
    TABLE_SIZES, VALIDATION_EXAMPLES, build_dlrm, split_at, state_bytes, synthetic_clicks,
    time_steps, train_in_chunks, updater_for)


def main():
    parser = argparse.ArgumentParser(description="DLRM on synthetic clicks with sparseopt.")
    parser.add_argument("--examples", type=int, default=2_400_000)
    parser.add_argument("--validation", type=int, default=VALIDATION_EXAMPLES,
                        help="held-out examples for the validation loss")
    parser.add_argument("--chunks", type=int, default=6, help="validation points in the pass")
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies table sizes")
    parser.add_argument("--compare-steps", type=int, default=25,
                        help="plain-Keras steps to time (0 to skip)")
    args = parser.parse_args()
    keras.utils.set_random_seed(0)
    sizes = [max(4, int(s * args.scale)) for s in TABLE_SIZES]
    x, y, prob = synthetic_clicks(args.examples + args.validation, sizes)
    (train_x, val_x), (train_y, val_y) = split_at(x, args.examples), split_at(y, args.examples)

    print(f"sparseopt {sparseopt.__version__} on Keras {keras.__version__} "
          f"({keras.backend.backend()} backend)")
    print(f"{len(sizes)} tables, {sum(sizes):,} rows x {args.width}; one pass over "
          f"{args.examples:,} examples, click rate {float(y.mean()):.3f}")
    kinds = {}
    for rows in sizes:
        kinds.setdefault(type(updater_for(rows)).__name__, []).append(rows)
    for kind, rows in kinds.items():
        print(f"  {kind:15s} {len(rows):2d} tables, {sum(rows):>9,} rows")

    model = build_dlrm(sizes, args.width, sparse=True)
    optimizer = sparseopt.DispatchOptimizer(keras.optimizers.Adam(1e-3))
    model.compile(optimizer=optimizer, loss="binary_crossentropy",
                  metrics=[keras.metrics.AUC(name="auc")])
    bce = lambda p: float(np.mean(keras.losses.binary_crossentropy(val_y, p)))  # noqa: E731
    print(f"\nvalidation loss of a constant predictor: {bce(np.full_like(val_y, y.mean())):.4f}; "
          f"of the true click probabilities: {bce(prob[args.examples:]):.4f}")
    print(f"{'examples seen':>14s} {'val loss':>9s} {'val AUC':>8s} {'ms/step':>8s}")
    loss, auc = model.evaluate(val_x, val_y, batch_size=8192, verbose=0)
    print(f"{0:14,d} {loss:9.4f} {auc:8.3f}")
    step_times = train_in_chunks(model, train_x, train_y, val_x, val_y, args)
    sparse_ms = float(np.median(step_times)) * 1e3
    sparse_state = state_bytes(optimizer)
    dropped = sum(int(ops.convert_to_numpy(l.num_dropped_ids)) for l in model.layers
                  if isinstance(l, sparseopt.layers.SparseEmbedding))
    print(f"ids dropped as out of range: {dropped}; table steps skipped for non-finite "
          f"gradients: {sum(optimizer.skipped_steps().values())}")

    table_bytes = sum(sizes) * args.width * 4
    print("\n== sparseopt vs plain Keras (Embedding + Adam on everything) ==")
    rows = [("sparseopt: DispatchOptimizer(Adam) + sparse updaters", sparse_ms, sparse_state)]
    if args.compare_steps:
        keras.utils.set_random_seed(0)
        plain = build_dlrm(sizes, args.width, sparse=False)
        plain_opt = keras.optimizers.Adam(1e-3)
        plain.compile(optimizer=plain_opt, loss="binary_crossentropy")
        plain_ms = time_steps(plain, train_x, train_y, args.batch, args.compare_steps)
        rows.append(("plain Keras: Embedding + Adam", plain_ms, state_bytes(plain_opt)))
    print(f"{'':55s} {'ms/step':>8s} {'optimizer state':>16s} {'state/tables':>13s}")
    for name, ms, nbytes in rows:
        print(f"{name:55s} {ms:8.1f} {nbytes / 2**20:13.1f} MB {nbytes / table_bytes:12.2f}x")
    if len(rows) == 2:
        print(f"sparseopt step: {rows[1][1] / rows[0][1]:.1f}x faster; optimizer state: "
              f"{rows[1][2] / rows[0][2]:.1f}x smaller (tables: {table_bytes / 2**20:.0f} MB)")
    scratch = state_bytes(optimizer, scratch=True)
    if scratch:
        print(f"(plus {scratch / 2**20:.1f} MB of dedup workspace: 4 bytes per row, "
              "scratch, not saved)")


if __name__ == "__main__":
    main()
