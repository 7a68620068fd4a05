"""Sparse tables trained by TensorFlow `MirroredStrategy` replicas (logical CPUs).

Usage: python -m tests.jobs.replicas_job OUT_DIR [--replicas R] [--quick]

The device count is fixed when TensorFlow starts, hence a process of its
own. Each run leaves in OUT_DIR (`<run>.npz`: arrays; `<run>.json`: counts
and messages):

- `fit`: `init/...`, the initial weights of a five-table recommender (Adagrad twice, momentum SGD mean-pooled
  over skewed ids, `lazy=False` momentum SGD sum-pooled, Adam on an int8 table; invalid ids and
  duplicates in every batch) trained by `fit` on one device (`single/...`)
  and by 4 replicas at the same global batch, tables apart (`multi/...`) and
  grouped (`grouped/...`), every replica's copy of every variable
  (`.../<path>@<replica>`); then the replicas' checkpoint loaded on one
  device (`loaded/...`);
- `uneven`: a global batch that does not split evenly (64 + R / 2 examples
  by 16: the last batch gives half the replicas one example and the others
  none; 66 and 1, 1, 0, 0 with 4 replicas): a sparse SGD table against
  Keras' own SGD on a dense one-hot table, both under the same strategy;
- `scaled`: `LossScaleOptimizer(DispatchOptimizer(...))` whose step 2 has a
  non-finite loss on the last replica only, on one device and on R replicas;
- `graph`: a custom training loop's traced step (`strategy.run`): every op
  output with a table-sized dimension, and the collectives;
- `vocabulary`: an open vocabulary (`DynamicEmbedding`: admission after 2
  sightings, LRU eviction, a trained default row) trained by `fit` on one
  device and on R replicas: plain, with a last batch that leaves some
  replicas empty, and with gradient accumulation;
- `refused`: the message `CentralStorageStrategy` gets.
"""

import json
import os
import sys
import time

import tensorflow as tf

# R logical devices (4 unless `--replicas`): fixed before TensorFlow starts.
REPLICAS = int(sys.argv[sys.argv.index("--replicas") + 1]) if "--replicas" in sys.argv else 4
_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    _cpu, [tf.config.LogicalDeviceConfiguration()] * REPLICAS)

import keras  # noqa: E402
import keras_rs  # noqa: E402
import numpy as np  # noqa: E402

import sparseopt  # noqa: E402
from tests.helpers import OneHotEmbedding  # noqa: E402

DEVICES = [f"/cpu:{i}" for i in range(REPLICAS)]
BATCH, EXAMPLES, EPOCHS, WIDTH = 16, 64, 1, 4
GRAPH_ROWS = 9973  # a prime: no batch-derived size equals it


_STRATEGY = []


def mirrored():
    """One strategy for every run (collectives of two in one process collided, TF 2.21)."""
    if not _STRATEGY:
        _STRATEGY.append(tf.distribute.MirroredStrategy(DEVICES))
    return _STRATEGY[0]


def recommender(group_tables=False, **options):
    keras.utils.set_random_seed(1)
    up = sparseopt.updaters
    inputs = {n: keras.Input((k,), dtype="int32", name=n)
              for n, k in {"user_ids": 3, "user2_ids": 2, "item_ids": 5, "tag_ids": 4,
                           "user8_ids": 3}.items()}
    parts = [
        keras.layers.Flatten()(sparseopt.layers.SparseEmbedding(
            50, WIDTH, up.Adagrad(0.3), name="user")(inputs["user_ids"])),
        keras.layers.Flatten()(sparseopt.layers.SparseEmbedding(
            60, WIDTH, up.Adagrad(0.3), name="user2")(inputs["user2_ids"])),
        # (Lookahead: its window's list and sync, in each replica's copy.)
        sparseopt.layers.SparseEmbedding(30, WIDTH, up.SGD(0.2, momentum=0.9,
                                                            lookahead_period=3),
                                         combiner="mean", name="item")(inputs["item_ids"]),
        sparseopt.layers.SparseEmbedding(40, WIDTH, up.SGD(0.1, momentum=0.5, lazy=False),
                                         combiner="sum", name="tag")(inputs["tag_ids"]),
        # (int8: each replica's write buffer and its copy of the codes.)
        keras.layers.Flatten()(sparseopt.layers.SparseEmbedding(
            45, WIDTH, up.Adam(0.05), dtype="int8", name="user8")(inputs["user8_ids"])),
    ]
    out = keras.layers.Dense(1, name="head")(keras.layers.Concatenate()(parts))
    model = keras.Model(inputs, out)
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.Adam(0.01),
                                                        group_tables=group_tables, **options),
                  loss="mse")
    return model


def recommender_data(seed=0):
    rng = np.random.default_rng(seed)
    x = {"user_ids": rng.integers(0, 50, (EXAMPLES, 3)),
         "user2_ids": rng.integers(0, 60, (EXAMPLES, 2)),
         "item_ids": rng.integers(0, 8, (EXAMPLES, 5)),  # skewed: 8 of 30 rows
         "tag_ids": rng.integers(-1, 40, (EXAMPLES, 4)),  # -1: padding, dropped
         "user8_ids": rng.integers(0, 45, (EXAMPLES, 3))}
    x = {n: v.astype("int32") for n, v in x.items()}
    x["user_ids"][::5, 0] = 50  # out of range in every batch
    x["user_ids"][1::BATCH, :2] = x["user_ids"][::BATCH, :2]  # duplicates within a batch
    y = rng.normal(size=(EXAMPLES, 1)).astype("float32")
    return x, y


def variables(model):
    """`{key: variable}`: every weight (by path) and optimizer variable (by
    name, numbered where repeated: paths depend on where Keras built the
    optimizer, positions on grouping)."""
    found = {v.path: v for v in model.weights}
    found.update(optimizer_variables(model.optimizer))
    return found


def optimizer_variables(optimizer):
    found, seen = {}, {}
    for v in optimizer.variables:
        n = seen[v.name] = seen.get(v.name, -1) + 1
        found[f"optimizer/{v.name}" + (f"#{n}" if n else "")] = v
    return found


def copies(strategy, model, prefix):
    """Every replica's copy of every variable, `{prefix/path@replica: array}`."""
    out = {}
    for path, var in variables(model).items():
        for i, value in enumerate(strategy.experimental_local_results(var.value)):
            out[f"{prefix}/{path}@{i}"] = np.asarray(value.numpy())
    return out


def primary(model, prefix):
    return {f"{prefix}/{p}": np.asarray(v.numpy()) for p, v in variables(model).items()}


# The runs under the strategy: tables alone, and grouped (`--quick`: alone only).
FIT_RUNS = [("multi", False), ("grouped", True)]


def run_fit(out):
    x, y = recommender_data()
    arrays, report = {}, {}
    keras.backend.clear_session()  # the same variable paths in every run
    single = recommender()
    arrays.update({f"init/{w.path}": w.numpy() for w in single.weights})
    single.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    arrays.update(primary(single, "single"))
    report["single"] = counts(single)
    scratch = {id(v) for v in single.optimizer.scratch_variables()}
    report["scratch"] = [k for k, v in optimizer_variables(single.optimizer).items()
                         if id(v) in scratch]
    strategy = mirrored()
    for name, grouped in FIT_RUNS:
        keras.backend.clear_session()  # outside the scope (it resets the scope stack)
        with strategy.scope():
            model = recommender(group_tables=grouped)
        model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
        arrays.update(copies(strategy, model, name))
        report[name] = counts(model)
        report[name]["groups"] = model.optimizer.table_groups
    report["saved"] = name  # the last run's model is saved and loaded on one device
    path = os.path.join(out, "replicas.weights.h5")
    model.save_weights(path)
    keras.backend.clear_session()
    loaded = recommender()
    # Built first (a shortcut, not the users' path): loads the optimizer state into a built optimizer, as a resumed replica run does.
    loaded.optimizer.build(loaded.trainable_variables)
    loaded.load_weights(path)
    arrays.update(primary(loaded, "loaded"))
    np.savez(os.path.join(out, "fit.npz"), **arrays)
    write_json(out, "fit", report)


def counts(model):
    return {"dropped": model.optimizer.dropped_ids(),
            "skipped": model.optimizer.skipped_steps()}


def run_controls(out):
    """The training loop's controls under the strategy: two micro-batches per update,
    one clipping norm over everything, a learning-rate callback halving every rate."""
    x, y = recommender_data(5)
    arrays, strategy = {}, mirrored()
    halve = keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.01 / 2 ** epoch)
    options = {"gradient_accumulation_steps": 2, "global_clipnorm": 0.05}
    for name in ("single", "multi"):
        keras.backend.clear_session()
        if name == "multi":
            with strategy.scope():
                model = recommender(**options)
        else:
            model = recommender(**options)
        model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[halve])
        arrays.update(primary(model, name))
    arrays.update(copies(strategy, model, "copies"))
    np.savez(os.path.join(out, "controls.npz"), **arrays)


def run_uneven(out):
    strategy, examples = mirrored(), EXAMPLES + REPLICAS // 2
    arrays = {"examples": np.array(examples)}
    rng = np.random.default_rng(examples)
    x = rng.integers(0, 40, (examples, 3)).astype("int32")
    y = rng.normal(size=(examples, 1)).astype("float32")
    with strategy.scope():
        models = [one_table_model(sparse) for sparse in (True, False)]
    for weight, reference in zip(dense_weights(models[0]), models[1].weights):
        reference.assign(weight.numpy())
    for model in models:
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    for kind, model in zip(("sparse", "dense"), models):
        for i, w in enumerate(dense_weights(model)):
            arrays[f"{kind}/{i}"] = w.numpy()
        arrays[f"{kind}/replicas_equal"] = np.array(all(
            all(np.array_equal(c.numpy(), w.numpy())
                for c in strategy.experimental_local_results(w.value))
            for w in model.weights))
    np.savez(os.path.join(out, "uneven.npz"), **arrays)


def one_table_model(sparse):
    keras.utils.set_random_seed(2)
    ids = keras.Input((3,), dtype="int32")
    if sparse:
        table = sparseopt.layers.SparseEmbedding(40, WIDTH, sparseopt.updaters.SGD(0.5),
                                                 name="table")
        optimizer = sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.5))
    else:
        table, optimizer = OneHotEmbedding(40, WIDTH, name="table"), keras.optimizers.SGD(0.5)
    model = keras.Model(ids, keras.layers.Dense(1)(keras.layers.Flatten()(table(ids))))
    model.compile(optimizer=optimizer, loss="mse")
    return model


def dense_weights(model):
    """The table and head weights (not the sparse model's probe), in the same order."""
    return [w for w in model.weights if not w.path.endswith("_sparse_grad")]


def run_scaled(out):
    rng = np.random.default_rng(3)
    x = rng.integers(0, 50, (EXAMPLES, 3)).astype("int32")
    y = rng.normal(size=(EXAMPLES, 1)).astype("float32")
    y[BATCH + (REPLICAS - 1) * BATCH // REPLICAS] = np.inf  # step 2, the last replica's first
    strategy, arrays, report = mirrored(), {}, {}
    for name in ("single", "multi"):
        keras.backend.clear_session()
        if name == "multi":
            with strategy.scope():
                model = scaled_model()
        else:
            model = scaled_model()
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
        arrays.update(primary(model, name))
        report[name] = {"skipped": model.optimizer.inner_optimizer.skipped_steps(),
                        "scale": float(model.optimizer.dynamic_scale.numpy())}
    arrays.update(copies(strategy, model, "copies"))
    np.savez(os.path.join(out, "scaled.npz"), **arrays)
    write_json(out, "scaled", report)


def scaled_model():
    keras.utils.set_random_seed(4)
    ids = keras.Input((3,), dtype="int32")
    table = sparseopt.layers.SparseEmbedding(50, WIDTH, sparseopt.updaters.Adagrad(0.3),
                                             name="table")
    model = keras.Model(ids, keras.layers.Dense(1, name="head")(
        keras.layers.Flatten()(table(ids))))
    model.compile(optimizer=keras.optimizers.LossScaleOptimizer(
        sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.05)), initial_scale=2.0**10),
        loss="mse")
    return model


def run_graph(out):
    """A custom loop's step: no op output may have a table-sized dimension."""
    strategy = mirrored()
    with strategy.scope():
        ids = {n: keras.Input((3,), dtype="int32", name=n) for n in ("plain_ids", "bag_ids", "rs_ids")}
        plain = sparseopt.layers.SparseEmbedding(GRAPH_ROWS, WIDTH,
                                                 sparseopt.updaters.Adagrad(0.5), name="plain")
        bag = sparseopt.layers.SparseEmbedding(GRAPH_ROWS, WIDTH,
                                               sparseopt.updaters.SGD(0.5, momentum=0.9),
                                               combiner="mean", name="bag")
        rs_table = keras_rs.layers.TableConfig(
            name="rs", vocabulary_size=GRAPH_ROWS, embedding_dim=WIDTH, combiner="sum",
            optimizer=keras.optimizers.Adagrad(0.2))
        rs = keras_rs.layers.DistributedEmbedding({"rs": keras_rs.layers.FeatureConfig(
            name="rs", table=rs_table, input_shape=(BATCH // REPLICAS, 3),
            output_shape=(BATCH // REPLICAS, WIDTH))}, name="de")
        x = keras.layers.Concatenate()([keras.layers.Flatten()(plain(ids["plain_ids"])),
                                        bag(ids["bag_ids"]), rs({"rs": ids["rs_ids"]})["rs"]])
        model = keras.Model(ids, keras.layers.Dense(1)(x))
        model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.5)))
        optimizer = model.optimizer  # compiled: its build finds the keras-rs table
        optimizer.build(model.trainable_variables)

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(model(x) - y)) / BATCH
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)

    @tf.function
    def step(x, y):
        strategy.run(replica_step, args=(x, y))

    rng = np.random.default_rng(5)
    data = ({n: rng.integers(0, GRAPH_ROWS, (BATCH, 3)).astype("int32") for n in ids},
            rng.normal(size=(BATCH, 1)).astype("float32"))
    batch = next(iter(strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices(data).batch(BATCH))))
    before = {v.path: v.numpy() for v in model.weights}
    step(*batch)
    graph = step.get_concrete_function(*batch).graph
    table_sized, ops = [], {}
    for op in graph.get_operations():
        ops[op.type] = ops.get(op.type, 0) + 1
        for t in op.outputs:
            dims = t.shape.as_list() if t.shape.rank else []
            if any(d in (GRAPH_ROWS, GRAPH_ROWS + 1) for d in dims):
                table_sized.append(f"{op.type} {op.name} {dims}")
    changed = {p: int((np.abs(v.numpy() - before[p]).sum(axis=-1) > 0).sum())
               for p, v in ((v.path, v) for v in model.weights)
               if len(v.shape) == 2 and v.shape[0] == GRAPH_ROWS}
    write_json(out, "graph", {"table_sized": table_sized, "ops": ops, "changed_rows": changed})


# (config, micro-batches per update, examples); `--quick` (`make test`) leaves out "uneven".
VOCABULARY_RUNS = [("plain", None, EXAMPLES + REPLICAS),
                   ("uneven", None, EXAMPLES + REPLICAS // 2),
                   ("accumulated", 2, EXAMPLES)]


def run_vocabulary(out):
    """An open vocabulary (`DynamicEmbedding`) on one device and on the replicas, plain and
    with 2 micro-batches per update: `vocabulary.npz` (`<config>/<single|multi>/<path>`, and
    `@<replica>` copies) and `vocabulary.json` (totals and held ids)."""
    rng = np.random.default_rng(5)
    pool = rng.integers(-2**31, 2**31 - 1, 40)
    strategy, arrays, report = mirrored(), {}, {}
    # Plain: a short last batch (one example a replica); uneven: one that does
    # not split evenly (some replicas get none; Keras' own loss then weighs
    # the replicas' examples unlike one device: only the map compares). (With
    # accumulation, batches of a known shape: its buffers are sized by it.)
    for config, k, examples in VOCABULARY_RUNS:
        # Drifting: the first half's ids stop, then come back (evictions each time).
        half = examples // 2
        x = np.concatenate([rng.choice(pool[:20], (half, 3)),
                            rng.choice(pool[20:], (examples - half, 3))]).astype("int32")
        y = rng.normal(size=(examples, 1)).astype("float32")
        for name in ("single", "multi"):
            keras.backend.clear_session()
            if name == "multi":
                with strategy.scope():
                    model = vocabulary_model(k)
            else:
                model = vocabulary_model(k)
            model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
            layer = model.get_layer("dyn")
            arrays.update(primary(model, f"{config}/{name}"))
            report[f"{config}/{name}"] = {
                "stats": layer.vocabulary_stats(),
                "held": {str(key): row for key, row in layer.held_ids().items()}}
        arrays.update(copies(strategy, model, f"{config}/copies"))
    np.savez(os.path.join(out, "vocabulary.npz"), **arrays)
    write_json(out, "vocabulary", report)


def vocabulary_model(accumulation_steps):
    keras.utils.set_random_seed(6)
    ids = keras.Input((3,), dtype="int32")
    # 12 rows for 40 ids, 3 probes: admission after 2 sightings, LRU eviction and
    # placement contests in every step; one trained default row.
    table = sparseopt.layers.DynamicEmbedding(
        12, WIDTH, sparseopt.updaters.Adagrad(0.3), probes=3, admit_after=2,
        admissions_per_step=4, default_row="trained", name="dyn")
    model = keras.Model(ids, keras.layers.Dense(1, name="head")(
        keras.layers.Flatten()(table(ids))))
    model.compile(optimizer=sparseopt.DispatchOptimizer(
        keras.optimizers.SGD(0.05), gradient_accumulation_steps=accumulation_steps),
        loss="mse")
    return model


def run_refused(out):
    strategy = tf.distribute.experimental.CentralStorageStrategy(DEVICES[:2])
    with strategy.scope():
        ids = keras.Input((3,), dtype="int32")
        table = sparseopt.layers.SparseEmbedding(40, WIDTH, sparseopt.updaters.SGD(0.5),
                                                 name="e")
        model = keras.Model(ids, keras.layers.Dense(1)(keras.layers.Flatten()(table(ids))))
        model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD()), loss="mse")
    try:
        model.fit(np.ones((8, 3), "int32"), np.ones((8, 1), "float32"), verbose=0)
        message = None
    except ValueError as e:
        message = str(e)
    write_json(out, "refused", {"message": message})


def write_json(out, name, report):
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    target = sys.argv[1]
    if "--quick" in sys.argv:
        FIT_RUNS = FIT_RUNS[:1]
        VOCABULARY_RUNS = [r for r in VOCABULARY_RUNS if r[0] != "uneven"]
    for run in (run_fit, run_controls, run_uneven, run_scaled, run_graph, run_vocabulary,
                run_refused):
        start = time.perf_counter()
        run(target)
        print(f"{run.__name__}: {time.perf_counter() - start:.1f} s", flush=True)
