"""A four-table recommender trained under several keras.distribution layouts (JAX).

Usage: XLA_FLAGS=--xla_force_host_platform_device_count=8 \
    python -m tests.jobs.sharded_job OUT_DIR [--layouts L ...] [--checks L ...] [--reshard]

Several processes (multi-host on one machine): start one per process, each
with its share of the devices and Keras' own variables
`KERAS_DISTRIBUTION_JOB_ADDRESSES` (the coordinator, e.g. localhost:PORT),
`KERAS_DISTRIBUTION_NUM_PROCESSES` and `KERAS_DISTRIBUTION_PROCESS_ID`.
The script is the same: each process feeds its own slice of every batch and
process 0 writes the results.

Each layout trains the same model from the same initial weights on the same
batches, in this one process, and leaves in OUT_DIR:

- `<layout>.npz`: every model weight and every optimizer state variable
  after training (and `init.npz`: the initial weights);
- `<layout>_bfloat16.npz`, `<layout>_int8.npz` (one device and the rows
  layouts): a bfloat16 table, and an int8 one, trained alone (`run_bfloat16`;
  `<layout>_int8.json`: the int8 step's collectives);
- `<layout>_routing.npz`, `<layout>_routing.json` (the same): ids routed to
  their owner in one round and in several (`run_routing`);
- `<layout>_whole.npz` (the same): a table whose rule keeps whole-table
  state (`run_whole_slots`);
- `<layout>_every_updater.npz`: every registered updater on a table of its own,
  and Adam with Lookahead (`run_every_updater`);
- `<layout>_vocabulary.npz`, `.json` (the same): an open vocabulary
  (`run_vocabulary`);
- `reshard_<i>_{loaded,saved}.npz`: a run saved under one layout and loaded
  under the next (`reshard`);
- `<layout>.json`: where the tables and their state live (bytes per device,
  shard shapes), the compiled step's collectives and memory, the dropped-id
  counts, and the collectives of the same step with 8x larger tables.

Layouts: `single` (no distribution: device 0 alone), `rows8` (every table
row-sharded over one 8-device axis that also splits the batch), `rows2x4`
(rows over a 4-device "model" axis, batch over a 2-device "batch" axis),
`cols2x4` (tables split by columns over "model") and `data8` (DataParallel:
tables replicated).
"""

import argparse
import json
import os
import time

import jax
import keras
import numpy as np
from jax.experimental import multihost_utils

import sparseopt
from sparseopt.distribution import bytes_per_device, collectives, compile_train_step
from tests.helpers import xla_production_options

TABLES = {  # name: (rows, width, updater)
    "user": (4096, 8, lambda: sparseopt.updaters.Adagrad(0.1)),
    "item": (2048, 8, lambda: sparseopt.updaters.Ftrl(0.05, l1_regularization_strength=1e-3)),
    "cat": (1024, 8, lambda: sparseopt.updaters.RowwiseAdagrad(0.1)),
    "tag": (512, 8, lambda: sparseopt.updaters.Adam(0.05)),
}
IDS_PER_TABLE = {"user": 6, "item": 3, "cat": 2, "tag": 4}
BATCH, STEPS = 48, 12  # 48: no batch-sized dimension equals a table shard's rows
LAYOUTS = ("single", "rows8", "rows2x4", "cols2x4", "data8")


def build_model(layout="single", scale=1, **options):
    """The model under `layout`; `scale` multiplies every table's rows; `options` go
    to the `DispatchOptimizer`."""
    # The same variable paths in every run (and no distribution); no garbage
    # collection (0.2 s a call, 2.5 s a job).
    keras.backend.clear_session(free_memory=False)
    keras.distribution.set_distribution(distribution(layout))
    keras.utils.set_random_seed(1)
    inputs, features = [], []
    for name, (rows, width, updater) in TABLES.items():
        ids = keras.Input((IDS_PER_TABLE[name],), dtype="int32", name=f"{name}_ids")
        emb = sparseopt.layers.SparseEmbedding(rows * scale, width, updater(), name=name,
                                               combiner="sum")
        inputs.append(ids)
        features.append(emb(ids))
    dense_in = keras.Input((4,), name="dense")
    inputs.append(dense_in)
    x = keras.layers.Concatenate()(features + [keras.layers.Dense(8, name="bottom")(dense_in)])
    x = keras.layers.Dense(16, activation="relu", name="top")(x)
    model = keras.Model(inputs, keras.layers.Dense(1, name="logit")(x))
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.Adam(0.01), **options),
                  loss=keras.losses.BinaryCrossentropy(from_logits=True))
    return model


def data():
    """Skewed ids with duplicates in every batch and some invalid ids (-1, rows)."""
    rng = np.random.default_rng(0)
    n = BATCH * STEPS
    x = {}
    for name, (rows, _, _) in TABLES.items():
        ids = np.minimum(rng.zipf(1.3, (n, IDS_PER_TABLE[name])) - 1, rows - 1)
        ids = rng.permutation(rows)[ids]  # hot rows spread over every shard
        ids[rng.random(ids.shape) < 0.02] = -1
        ids[rng.random(ids.shape) < 0.02] = rows
        x[f"{name}_ids"] = ids.astype("int32")
    x["dense"] = rng.normal(size=(n, 4)).astype("float32")
    y = (rng.random((n, 1)) < 0.3).astype("float32")
    return x, y


def distribution(layout):
    devices = keras.distribution.list_devices()
    # Each process feeds its own slice of each batch (see `this_process`).
    split = jax.process_count() == 1
    if layout == "single":
        return None
    if layout == "data8":
        return keras.distribution.DataParallel(devices=devices, auto_shard_dataset=split)
    if layout == "rows8":
        return sparseopt.distribution.row_sharded([r".*/embeddings"], auto_shard_dataset=split)
    mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"], devices)
    if layout == "rows2x4":
        return sparseopt.distribution.row_sharded([r".*/embeddings"], mesh,
                                                  auto_shard_dataset=split)
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[r".*/embeddings"] = (None, "model")
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch",
                                            auto_shard_dataset=split)


def table_state(model, name):
    """A table and all of its optimizer variables (state, skip count, dedup workspace)."""
    table = model.get_layer(name).embeddings
    trainer = model.optimizer.table_trainer(table)
    return [table, *trainer.saved_variables, *trainer.scratch_variables]


def this_process(array):
    """This process's slice of every batch (all of it with one process)."""
    n, p = jax.process_count(), jax.process_index()
    per_step = array.reshape((STEPS, n, BATCH // n) + array.shape[1:])
    return per_step[:, p].reshape((-1,) + array.shape[1:])


def to_numpy(value):
    """A whole array, also where other processes hold some of its shards (16-bit
    floats as float32, exactly)."""
    if jax.process_count() > 1:
        value = multihost_utils.process_allgather(value, tiled=True)
    value = np.asarray(value)
    return value.astype(np.float32) if value.dtype.itemsize == 2 else value


def everything(model):
    """Every weight and every optimizer state variable (not the dedup scratch), by path."""
    saved = {f"w:{v.path}": to_numpy(v.value) for v in model.weights}
    saved.update({f"opt:{v.path}": to_numpy(v.value)
                  for v in model.optimizer.state_variables()})
    return saved


def run(layout, out, x, y, init, checks=True):
    """Trains under `layout`; with `checks`, also the vocabulary-growth and
    table-creation checks of a layout (8x tables compiled, a large table, an uneven one)."""
    model = build_model(layout)
    model.set_weights(init)
    x, y = {k: this_process(v) for k, v in x.items()}, this_process(y)
    fit = dict(batch_size=BATCH // jax.process_count(), shuffle=False, verbose=0)
    half = len(y) // 2
    first, second = (({k: v[part] for k, v in x.items()}, y[part])
                     for part in (slice(None, half), slice(half, None)))
    if layout == "rows8":  # checkpointed halfway: the resumed run starts there (`resume`)
        checkpoint = save_halfway(model, layout, out, *first, fit)
        model.fit(*second, **fit)
    else:
        model.fit(x, y, **fit)
    saved = everything(model)
    if jax.process_index() == 0:
        np.savez(os.path.join(out, f"{layout}.npz"), **saved)
    if layout == "rows8":
        resume(layout, out, checkpoint, *second, fit)
    if jax.process_count() > 1:
        return  # the layout checks below run in the one-process job

    report = {"devices": len(keras.distribution.list_devices()),
              "dropped_ids": model.optimizer.dropped_ids(), "tables": {}}
    batch_x = {k: v[:BATCH] for k, v in x.items()}
    if layout != "single":  # what the step moves and holds (one device: nothing moves)
        compiled = compile_train_step(model, batch_x, y[:BATCH],
                                      compiler_options=xla_production_options())
        memory = compiled.memory_analysis()
        report.update(
            collectives=[[c.kind, c.shapes, c.nbytes] for c in collectives(compiled.as_text())],
            temp_bytes=memory.temp_size_in_bytes, argument_bytes=memory.argument_size_in_bytes,
            alias_bytes=memory.alias_size_in_bytes)
    for name in TABLES:
        variables = table_state(model, name)
        report["tables"][name] = {
            "paths": [v.path for v in variables],
            "total_bytes": int(sum(np.asarray(v.value).nbytes for v in variables)),
            "bytes_per_device": sorted(bytes_per_device(variables).values()),
            "shard_shapes": {v.path: sorted({tuple(s.data.shape)
                                             for s in v.value.addressable_shards})
                             for v in variables},
        }
    if layout != "single" and checks:
        # The same step with every table 8x larger: what moves between
        # devices must not grow with the vocabulary.
        big = build_model(layout, scale=8)
        big.optimizer.build(big.trainable_variables)
        big_step = compile_train_step(big, batch_x, y[:BATCH],
                                      compiler_options=xla_production_options())
        report["collectives_8x_rows"] = [[c.kind, c.shapes, c.nbytes]
                                         for c in collectives(big_step.as_text())]
        report["temp_bytes_8x_rows"] = big_step.memory_analysis().temp_size_in_bytes
        # Control for the checks: a step that does gather a whole table.
        table = big.get_layer("user").embeddings.value
        everywhere = jax.sharding.NamedSharding(table.sharding.mesh,
                                                jax.sharding.PartitionSpec())
        gathered = jax.jit(lambda t: t * 2, out_shardings=everywhere).lower(table).compile(
            xla_production_options())
        report["control_collectives"] = [[c.kind, c.shapes, c.nbytes]
                                         for c in collectives(gathered.as_text())]
        # A table large enough that Keras creates it on its devices with a
        # jitted initializer (over 250 MB if it were on every device).
        large = sparseopt.layers.SparseEmbedding(1 << 20, 8, sparseopt.updaters.SGD(0.1),
                                                 name="large")
        large.build()
        report["large_table_shards"] = sorted({tuple(s.data.shape) for s in
                                               large.embeddings.value.addressable_shards})
        try:  # rows that do not split evenly: refused before anything is created
            sparseopt.layers.SparseEmbedding(1001, 8, sparseopt.updaters.SGD(0.1),
                                             name="uneven").build()
            report["uneven_table"] = "created"
        except ValueError as e:
            report["uneven_table"] = str(e)
    with open(os.path.join(out, f"{layout}.json"), "w") as f:
        json.dump(report, f)


def run_controls(layout, out, x, y, init):
    """The training loop's controls under `layout`: 2 micro-batches per update, one
    clipping norm over dense gradients and tables' rows (each shard's summed), and a
    learning-rate callback halving every rate each epoch. Leaves `<layout>_controls.npz`."""
    model = build_model(layout, gradient_accumulation_steps=2, global_clipnorm=0.5)
    model.set_weights(init)
    halve = keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.01 / 2 ** epoch)
    half = len(y) // 2
    model.fit({k: v[:half] for k, v in x.items()}, y[:half], batch_size=BATCH, epochs=2,
              shuffle=False, verbose=0, callbacks=[halve])
    np.savez(os.path.join(out, f"{layout}_controls.npz"), **everything(model))


def run_routing(layout, out):
    """One Adagrad table on fixed row gradients (`sum(y * rows)`), under `layout`,
    for 12 steps: 6 of uniform ids (each device's ids for each shard fit one
    bucket: one round) then 6 whose ids all fall in the first shard's rows
    (they do not: several rounds); then the lookups of the first and last
    batch (`predict`). Leaves `<layout>_routing.npz` and, in
    `<layout>_routing.json`, the rounds each step takes (`_rounds`)."""
    rows, width, n_ids = 1024, 8, 4
    rng = np.random.default_rng(9)
    half = BATCH * STEPS // 2
    x = np.concatenate([rng.integers(-1, rows + 1, (half, n_ids)),
                        rng.integers(0, rows // 8, (half, n_ids))])
    y = rng.normal(size=(2 * half, n_ids, width)).astype("float32")
    keras.backend.clear_session(free_memory=False)
    keras.distribution.set_distribution(distribution(layout))
    keras.utils.set_random_seed(4)
    ids_in = keras.Input((n_ids,), dtype="int32")
    emb = sparseopt.layers.SparseEmbedding(rows, width, sparseopt.updaters.Adagrad(0.1),
                                           name="routed")
    model = keras.Model(ids_in, emb(ids_in))
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD()),
                  loss=lambda t, p: keras.ops.sum(t * p, axis=(1, 2)))
    model.fit(x.astype("int32"), y, batch_size=BATCH, shuffle=False, verbose=0)
    # Lookups of the first (uniform, some invalid) and last (one shard) batch.
    looked_up = {}
    for part, rows_of in (("uniform", slice(0, BATCH)), ("one_shard", slice(-BATCH, None))):
        looked_up[f"ids_{part}"] = x[rows_of].astype("int32")
        if part == "uniform":
            looked_up[f"ids_{part}"][0, :2] = (-1, rows)  # invalid: read zeros
        looked_up[f"lookup_{part}"] = to_numpy(model.predict(
            looked_up[f"ids_{part}"], batch_size=BATCH, verbose=0))
    np.savez(os.path.join(out, f"{layout}_routing.npz"),
             table=to_numpy(emb.embeddings.value),
             accumulator=to_numpy(model.optimizer.table_state(
                 emb.embeddings)["accumulator"].value), **looked_up)
    with open(os.path.join(out, f"{layout}_routing.json"), "w") as f:
        json.dump({"rounds": _rounds(layout, x, rows)}, f)


def _rounds(layout, x, rows):
    """The routed rounds of each step (`sparseopt.distribution.routed_rounds`)."""
    if layout == "single":
        return None
    shards, senders = {"rows8": (8, 8), "rows2x4": (4, 2)}[layout]
    return [sparseopt.distribution.routed_rounds(
        np.split(x[step * BATCH:(step + 1) * BATCH].reshape(-1), senders), rows, shards)
        for step in range(STEPS)]


def run_bfloat16(layout, out, dtype="bfloat16"):
    """A bfloat16 (or int8) table alone (stochastic rounding), trained on fixed row
    gradients.

    The loss is `sum(y * rows)`: the row gradients are `y` exactly under every
    layout, so rounding bits keyed by global row must give one device's
    result bit for bit (in the four-table model, float rounding of the dense
    part would move a rounding threshold now and then). An int8 table also
    saves its row scales and, split over devices, its step's collectives.
    """
    keras.backend.clear_session(free_memory=False)
    keras.distribution.set_distribution(distribution(layout))
    keras.utils.set_random_seed(3)
    rows, width, n_ids = 1024, 8, 4
    ids_in = keras.Input((n_ids,), dtype="int32")
    emb = sparseopt.layers.SparseEmbedding(rows, width, sparseopt.updaters.Adagrad(0.1),
                                           name="half", dtype=dtype)
    model = keras.Model(ids_in, emb(ids_in))
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD()),
                  loss=lambda y, p: keras.ops.sum(y * keras.ops.cast(p, "float32"), axis=(1, 2)))
    rng = np.random.default_rng(5)
    x = rng.integers(-1, rows + 1, (BATCH * STEPS, n_ids)).astype("int32")  # some invalid
    y = rng.normal(size=(BATCH * STEPS, n_ids, width)).astype("float32")
    model.fit(this_process(x), this_process(y), batch_size=BATCH // jax.process_count(),
              shuffle=False, verbose=0)
    saved = {"table": to_numpy(emb.embeddings.value),
             "accumulator": to_numpy(model.optimizer.table_state(
                 emb.embeddings)["accumulator"].value)}
    if dtype == "int8":
        saved["scale"] = to_numpy(emb.embeddings_scale.value)
        saved["shard_rows"] = np.array(sorted({s.data.shape[0] for v in (
            emb.embeddings, emb.embeddings_scale) for s in v.value.addressable_shards}))
        if layout != "single":
            step = compile_train_step(model, x[:BATCH], y[:BATCH],
                                      compiler_options=xla_production_options())
            with open(os.path.join(out, f"{layout}_int8.json"), "w") as f:
                json.dump([[c.kind, c.shapes, c.nbytes] for c in collectives(step.as_text())],
                          f)
    if jax.process_index() == 0:
        np.savez(os.path.join(out, f"{layout}_{dtype}.npz"), **saved)


def run_whole_slots(layout, out):
    """A table whose rule keeps whole-table state (`tests.rules.ColumnScaledSGD`: a
    `[D]` column slot, a scalar, a per-row slot), trained alone on fixed row
    gradients (some ids invalid, many duplicated).

    The whole slots are replicated and updated once a step from every
    shard's rows; the test compares each layout with one device.
    """
    from tests.rules import ColumnScaledSGD

    keras.backend.clear_session(free_memory=False)
    keras.distribution.set_distribution(distribution(layout))
    keras.utils.set_random_seed(4)
    rows, width, n_ids = 1024, 8, 4
    ids_in = keras.Input((n_ids,), dtype="int32")
    emb = sparseopt.layers.SparseEmbedding(rows, width, ColumnScaledSGD(0.2, clipvalue=0.5),
                                           name="whole")
    # Adafactor's dense form: whole slots, one started from the table (its sum of
    # squares, over every shard) and moved by running sums.
    factor = sparseopt.layers.SparseEmbedding(
        rows, width, sparseopt.updaters.Adafactor(0.05, lazy=False), name="factor")
    model = keras.Model(ids_in, keras.layers.Add()([emb(ids_in), factor(ids_in)]))
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD()),
                  loss=lambda y, p: keras.ops.sum(y * p, axis=(1, 2)))
    rng = np.random.default_rng(6)
    x = rng.integers(-1, rows + 1, (BATCH * STEPS, n_ids)).astype("int32")
    x[::3, 0] = x[::3, 1]  # duplicates within and across examples
    y = rng.normal(size=(BATCH * STEPS, n_ids, width)).astype("float32")
    model.fit(this_process(x), this_process(y), batch_size=BATCH // jax.process_count(),
              shuffle=False, verbose=0)
    state = model.optimizer.table_state(emb.embeddings)
    factored = model.optimizer.table_state(factor.embeddings)
    saved = {"table": to_numpy(emb.embeddings.value),
             **{name: to_numpy(v.value) for name, v in state.items()},
             "factor_table": to_numpy(factor.embeddings.value),
             **{f"factor_{name}": to_numpy(v.value) for name, v in factored.items()},
             "replicated": np.array([fully_replicated(state[n]) for n in
                                     ("column_sq", "rows_seen")]
                                    + [fully_replicated(factored[n]) for n in
                                       ("vc", "sum_squares", "excess")])}
    if jax.process_index() == 0:
        np.savez(os.path.join(out, f"{layout}_whole.npz"), **saved)


def run_every_updater(layout, out):
    """Every registered updater (its default configuration), each on its own table of
    one model, trained on the same ids: `<layout>_every_updater.npz` (each table
    and its state), which the test compares with one device's. A new updater
    file is picked up without editing this."""
    keras.backend.clear_session(free_memory=False)
    keras.distribution.set_distribution(distribution(layout))
    keras.utils.set_random_seed(9)
    rows, width, n_ids = 256, 4, 3
    ids_in = keras.Input((n_ids,), dtype="int32")
    registry = sparseopt.updaters.registry(shipped_only=True)
    tables = [sparseopt.layers.SparseEmbedding(
        rows, width, entry(0.05, **entry.test_configs["default"]), name=f"u_{name.lower()}")
        for name, entry in sorted(registry.items())]
    # Lookahead: its sync also writes rows the step did not touch (from the window's list).
    tables.append(sparseopt.layers.SparseEmbedding(
        rows, width, sparseopt.updaters.Adam(0.05, lookahead_period=5), name="lookahead_adam"))
    model = keras.Model(ids_in, keras.layers.Add()([t(ids_in) for t in tables]))
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD()),
                  loss=lambda y, p: keras.ops.sum(y * p, axis=(1, 2)))
    rng = np.random.default_rng(10)
    x = rng.integers(0, rows, (BATCH * STEPS, n_ids)).astype("int32")
    x[::3, 0] = x[::3, 1]  # duplicates within and across examples
    y = rng.normal(size=(BATCH * STEPS, n_ids, width)).astype("float32")
    model.fit(this_process(x), this_process(y), batch_size=BATCH // jax.process_count(),
              shuffle=False, verbose=0)
    saved = {}
    for table in tables:
        saved[f"{table.name}/table"] = to_numpy(table.embeddings.value)
        for name, variable in model.optimizer.table_state(table.embeddings).items():
            saved[f"{table.name}/{name}"] = to_numpy(variable.value)
    if jax.process_index() == 0:
        np.savez(os.path.join(out, f"{layout}_every_updater.npz"), **saved)


VOCABULARY_CAPACITY = 256  # 32 rows a shard over 8 devices; windows cross shards


def vocabulary_model(capacity=VOCABULARY_CAPACITY):
    keras.utils.set_random_seed(7)
    ids = keras.Input((3,), dtype="int32")
    # LFU (a per-row count split with the map) and admission after 2 sightings
    # (a sightings map, split with the rows too); placement contests and evictions
    # every step.
    table = sparseopt.layers.DynamicEmbedding(
        capacity, 8, sparseopt.updaters.Adagrad(0.1), probes=4, eviction="lfu",
        lfu_half_life=3, admit_after=2, admissions_per_step=64, name="dyn")
    model = keras.Model(ids, keras.layers.Dense(1, name="head")(
        keras.layers.Flatten()(table(ids))))
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.05)),
                  loss="mse")
    return model


def run_vocabulary(layout, out):
    """An open vocabulary (`DynamicEmbedding`) under `layout`: `<layout>_vocabulary.npz`
    (the layer's variables, its table's state) and `.json` (totals, held ids, the map's
    shard shapes, and the step's collectives at 8x and 64x the capacity)."""
    keras.backend.clear_session(free_memory=False)
    keras.distribution.set_distribution(distribution(layout))
    rng = np.random.default_rng(8)
    # 3,000 raw ids for 256 rows: most are rare, a few popular.
    pool = rng.integers(-2**31, 2**31 - 1, 3000)
    x = pool[np.minimum(rng.zipf(1.3, (BATCH * STEPS, 3)) - 1, 2999)].astype("int32")
    y = rng.normal(size=(BATCH * STEPS, 1)).astype("float32")
    model = vocabulary_model()
    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    layer = model.get_layer("dyn")
    saved = {f"w:{v.path}": to_numpy(v.value) for v in layer.weights}
    saved.update({f"opt:{v.path}": to_numpy(v.value)
                  for v in model.optimizer.table_trainer(layer.embeddings).saved_variables})
    report = {"stats": layer.vocabulary_stats(),
              "held": {str(k): r for k, r in layer.held_ids().items()},
              "shard_shapes": {v.path: sorted({tuple(s.data.shape)
                                               for s in v.value.addressable_shards})
                               for v in layer.weights}}
    if layout != "single":
        try:  # a trained default row cannot split with the map: refused at build
            sparseopt.layers.DynamicEmbedding(255, 8, sparseopt.updaters.SGD(0.1),
                                              default_row="trained", name="dyn_default",
                                              ).build((None, 3))
            report["trained_default"] = "built"
        except ValueError as e:
            report["trained_default"] = str(e)
        try:  # a sightings map that cannot split with the rows: refused at build
            sparseopt.layers.DynamicEmbedding(256, 8, sparseopt.updaters.SGD(0.1),
                                              admit_after=2, count_capacity=102,
                                              name="dyn_counts").build((None, 3))
            report["uneven_counts"] = "built"
        except ValueError as e:
            report["uneven_counts"] = str(e)
    if layout != "single":  # resharding: an epoch here, saved, the next on one device
        keras.backend.clear_session(free_memory=False)
        keras.distribution.set_distribution(distribution(layout))
        model = vocabulary_model()
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        path = os.path.join(out, f"{layout}_vocabulary.keras")
        model.save(path)
        keras.backend.clear_session(free_memory=False)
        keras.distribution.set_distribution(None)
        model = keras.saving.load_model(path)
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        layer = model.get_layer("dyn")
        resharded = {f"w:{v.path}": to_numpy(v.value) for v in layer.weights}
        resharded.update({f"opt:{v.path}": to_numpy(v.value) for v in
                          model.optimizer.table_trainer(layer.embeddings).saved_variables})
        np.savez(os.path.join(out, f"{layout}_vocabulary_resharded.npz"), **resharded)
        report["resharded_stats"] = layer.vocabulary_stats()
    if layout != "single":  # what moves must not grow with the capacity
        # (From 8x: below, XLA gathers the whole map, smaller than a batch's windows.)
        for scale in (8, 64):
            keras.backend.clear_session(free_memory=False)
            keras.distribution.set_distribution(distribution(layout))
            m = vocabulary_model(VOCABULARY_CAPACITY * scale)
            m.optimizer.build(m.trainable_variables)
            step = compile_train_step(m, x[:BATCH], y[:BATCH],
                                      compiler_options=xla_production_options())
            report[f"collectives_{scale}x"] = [[c.kind, c.shapes, c.nbytes]
                                               for c in collectives(step.as_text())]
    np.savez(os.path.join(out, f"{layout}_vocabulary.npz"), **saved)
    with open(os.path.join(out, f"{layout}_vocabulary.json"), "w") as f:
        json.dump(report, f)


def fully_replicated(variable):
    """Whether every device holds all of `variable` (one device: True)."""
    sharding = getattr(variable.value, "sharding", None)
    return sharding is None or sharding.is_fully_replicated


def save_halfway(model, layout, out, x, y, fit):
    """Trains `model` on the first half of the steps and checkpoints it; returns the path.

    One process: `model.save`. Several: Keras' `OrbaxCheckpoint` (`model.save`
    needs every shard in one process, which Keras cannot fetch across hosts;
    sparseopt's one-file save is refused, which `one_file_save.txt` records).
    """
    if jax.process_count() == 1:
        model.fit(x, y, **fit)
        path = os.path.join(out, f"{layout}_half.keras")
        model.save(path)
        return path
    path = os.path.join(out, f"{layout}_orbax")
    saver = keras.callbacks.OrbaxCheckpoint(path)
    model.fit(x, y, callbacks=[saver], **fit)
    saver.wait_until_finished()
    try:  # one file from one of several processes: refused, with the way out
        sparseopt.saving.save_model(model, os.path.join(out, "one_file.keras"))
        refused = "saved"
    except ValueError as e:
        refused = str(e)
    if jax.process_index() == 0:
        with open(os.path.join(out, "one_file_save.txt"), "w") as f:
            f.write(refused)
    return path


def resume(layout, out, checkpoint, x, y, fit):
    """A new model restored from `save_halfway`'s checkpoint trains the other half.

    One process: `load_model`. Several: a new model and `load_weights`.
    Leaves `<layout>_resumed.npz`.
    """
    if jax.process_count() == 1:
        keras.backend.clear_session(free_memory=False)
        keras.distribution.set_distribution(distribution(layout))
        model = keras.saving.load_model(checkpoint)
    else:
        model = build_model(layout)
        model.optimizer.build(model.trainable_variables)
        model.load_weights(checkpoint)
    model.fit(x, y, **fit)
    saved = everything(model)
    saved["shards"] = np.array(sorted(
        {s.data.shape for v in table_state(model, "user")[:2] for s in v.value.addressable_shards}))
    if jax.process_index() == 0:
        np.savez(os.path.join(out, f"{layout}_resumed.npz"), **saved)


# Resharding: a quarter of the steps under each layout, saved with one saver
# and loaded under the next layout: rows over 8 -> rows 2x4 -> one device ->
# rows over 8, through model.save, save_weights and OrbaxCheckpoint.
RESHARD = [("rows8", None), ("rows2x4", "keras_model"), ("single", "weights"),
           ("rows8", "orbax")]


def reshard(out, x, y, init):
    """Trains through `RESHARD`; leaves `reshard_<i>_saved.npz` (after phase i's
    steps, as saved) and `reshard_<i>_loaded.npz` (what phase i loaded)."""
    quarter = len(y) // len(RESHARD)
    fit = dict(batch_size=BATCH, shuffle=False, verbose=0)
    path = None
    for i, (layout, saver) in enumerate(RESHARD):
        if saver == "keras_model":
            keras.backend.clear_session(free_memory=False)
            keras.distribution.set_distribution(distribution(layout))
            model = keras.saving.load_model(path)
        else:
            model = build_model(layout)
            if saver is None:
                model.set_weights(init)
            model.optimizer.build(model.trainable_variables)
            if saver is not None:
                model.load_weights(path)
        if i:
            loaded = everything(model)
            # Rows per shard of the user table, its accumulator and its dedup workspace.
            loaded["shard_rows"] = np.array(sorted({
                s.data.shape[0] for v in table_state(model, "user") if len(v.shape)
                for s in v.value.addressable_shards}))
            np.savez(os.path.join(out, f"reshard_{i}_loaded.npz"), **loaded)
        part = slice(i * quarter, (i + 1) * quarter)
        callbacks = []
        following = RESHARD[i + 1][1] if i + 1 < len(RESHARD) else None
        if following == "orbax":
            path = os.path.join(out, f"reshard_{i}_orbax")
            callbacks = [keras.callbacks.OrbaxCheckpoint(path)]
        model.fit({k: v[part] for k, v in x.items()}, y[part], callbacks=callbacks, **fit)
        if following == "orbax":
            callbacks[0].wait_until_finished()
        elif following == "keras_model":
            path = os.path.join(out, f"reshard_{i}.keras")
            model.save(path)
        elif following == "weights":
            path = os.path.join(out, f"reshard_{i}.weights.h5")
            model.save_weights(path)
        np.savez(os.path.join(out, f"reshard_{i}_saved.npz"), **everything(model))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS))
    parser.add_argument("--checks", nargs="+", default=None,
                        help="layouts that run the 8x / large / uneven table checks (all)")
    parser.add_argument("--reshard", action="store_true",
                        help="also train through RESHARD (its test compares with single)")
    parser.add_argument("--quick", action="store_true",
                        help="leave out run_every_updater (`make test`; 13 s over 8 devices)")
    args = parser.parse_args()
    if "KERAS_DISTRIBUTION_NUM_PROCESSES" in os.environ:
        keras.distribution.initialize()  # multi-host: configuration only
    x, y = data()
    init = [np.asarray(w) for w in build_model().get_weights()]
    if jax.process_index() == 0:
        np.savez(os.path.join(args.out, "init.npz"), *init)
    start = time.perf_counter()

    def done(what):
        print(f"done {what} ({time.perf_counter() - start:.1f} s)", flush=True)

    for layout in args.layouts:
        run(layout, args.out, x, y, init,
            checks=args.checks is None or layout in args.checks)
        done(layout)
        if jax.process_count() == 1 and layout in ("single", "rows8", "rows2x4"):
            run_bfloat16(layout, args.out)
            done(f"{layout} bfloat16")
            run_bfloat16(layout, args.out, "int8")
            done(f"{layout} int8")
            run_routing(layout, args.out)
            done(f"{layout} routing")
            run_whole_slots(layout, args.out)
            done(f"{layout} whole slots")
            if not args.quick:
                run_every_updater(layout, args.out)
                done(f"{layout} every updater")
            run_vocabulary(layout, args.out)
            done(f"{layout} vocabulary")
        if jax.process_count() == 1 and layout in ("single", "rows8"):
            run_controls(layout, args.out, x, y, init)
            done(f"{layout} controls")
    if jax.process_count() == 1 and args.reshard:
        reshard(args.out, x, y, init)
        done("reshard")


if __name__ == "__main__":
    main()
