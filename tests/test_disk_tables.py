"""Tables on disk (`storage=OnDisk(...)`), trained by `fit` through their cache.

The reference is the same model with its tables in memory (the in-memory
kind, trained by the same updaters, started from the same rows and head):
every table, its per-row state (columns of its files) and its whole state
(variables) must end bit for bit where the in-memory run's end, for every
registered updater configuration (the registry drives the cases), with a
cache far smaller than the table so that rows are evicted and read back.
"""

import dataclasses
import subprocess
import sys

import keras
import numpy as np
import pytest

import sparseopt
from sparseopt import backend
from sparseopt.storage import OnDisk
from tests.conftest import to_np
from tests.helpers import ROOT, child_env, optimizer_state, registered_cases

ROWS, WIDTH = 40, 3
CASES = registered_cases()
STORAGE_KEYS = ("state_dtype", "stochastic_rounding", "rounding_seed")
# 16-bit rows and state (the registry's configurations are float32 ones).
HALF_CASES = {
    "Adagrad:bfloat16": (sparseopt.updaters.Adagrad, {}, "bfloat16",
                         {"state_dtype": "bfloat16"}),
    "RowwiseAdagrad:float16_state": (sparseopt.updaters.RowwiseAdagrad, {}, "float32",
                                     {"state_dtype": "float16",
                                      "stochastic_rounding": False}),
    "Adam:bfloat16_rows": (sparseopt.updaters.Adam, {}, "bfloat16", {}),
}


def _all_rows(case):
    """Whether an updater configuration needs every row at once (what disk refuses)."""
    entry, cfg = case
    updater = entry(0.05, **{k: v for k, v in cfg.items() if k not in STORAGE_KEYS})
    return bool(updater.wrappers) or any(s.from_table is not None for s in updater.slots)


SUPPORTED = {name: (entry, cfg, "float32", {})
             for name, (entry, cfg) in CASES.items() if not _all_rows((entry, cfg))}
SUPPORTED.update(HALF_CASES)
REFUSED = {name: case for name, case in CASES.items() if _all_rows(case)}


def _model(cases, storage_of):
    """One table per case, two ids each, a dense head; compiled with DispatchOptimizer."""
    ids = keras.Input((2 * len(cases),), dtype="int32")
    outs, layers = [], []
    for i, (entry, cfg, dtype, settings) in enumerate(cases.values()):
        rule = {k: v for k, v in cfg.items() if k not in STORAGE_KEYS}
        settings = {**{k: v for k, v in cfg.items() if k in STORAGE_KEYS}, **settings}
        layer = sparseopt.layers.SparseEmbedding(
            ROWS, WIDTH, updater=entry(0.05, **rule), storage=storage_of(i, settings),
            dtype=dtype, name=f"t{i}")
        layers.append(layer)
        outs.append(keras.layers.Flatten()(layer(ids[:, 2 * i:2 * i + 2])))
    head = keras.layers.Dense(1, name="head")
    model = keras.Model(ids, head(keras.layers.Concatenate()(outs)))
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.Adam(0.01)),
                  loss="mse")
    return model, layers, head


def _data(columns, rows=48, seed=7):
    rng = np.random.default_rng(seed)
    x = rng.integers(-2, ROWS + 2, (rows, columns)).astype("int32")  # some invalid ids
    y = rng.normal(size=(rows, 1)).astype("float32")
    return x, y


def _slot_names(layer):
    return [s.name for s in layer.updater.slots if s.per_row]


def test_tables_on_disk_train_every_updater_as_in_memory_bit_for_bit(tmp_path, monkeypatch):
    # TensorFlow updates float32 tables in memory with its own fused kernels
    # where it has one for the rule (Ftrl, Adagrad without epsilon, SGD...),
    # which differ from the rule in the last bit for some values; a table on
    # disk is updated by the rule, everywhere. So the reference takes the
    # rule's path (the kernels are checked on their own in test_backends.py);
    # the native dedup stays on: its result is the reference's bit for bit.
    monkeypatch.setattr(backend, "KERNELS", tuple(
        k for k in backend.KERNELS if k.stages != ("read", "rule", "write")))
    # Disk first: its rows (drawn per row from the initializer) and head start the
    # in-memory run. A cache of 8 rows per 40-row table: rows are evicted and read back.
    disk, disk_layers, disk_head = _model(
        SUPPORTED, lambda i, s: OnDisk(str(tmp_path / f"t{i}"), cache_rows=8, **s))
    memory, memory_layers, memory_head = _model(
        SUPPORTED, lambda i, s: sparseopt.TableStorage(**s))
    for d, m in zip(disk_layers, memory_layers):
        m.embeddings.assign(d.embeddings.numpy().astype(np.float32))
    memory_head.set_weights(disk_head.get_weights())
    x, y = _data(2 * len(SUPPORTED))
    disk.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    memory.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)

    np.testing.assert_array_equal(disk_head.get_weights()[0], memory_head.get_weights()[0])
    # (By name: the two optimizers' own names differ.)
    memory_state = {v.path.split("/")[-1]: v for v in optimizer_state(memory.optimizer)}
    disk_state = {v.path.split("/")[-1]: v for v in optimizer_state(disk.optimizer)}
    checked = 0
    for name, d, m in zip(SUPPORTED, disk_layers, memory_layers):
        np.testing.assert_array_equal(d.embeddings.numpy().astype(np.float64),
                                      to_np(m.embeddings), err_msg=name)
        stats = d.disk_stats()
        assert stats["misses"] > 0 and stats["rows_written"] > 0, (name, stats)
        per_row = _slot_names(m)
        for path, var in memory_state.items():
            if not path.startswith(f"{m.name}_embeddings_"):
                continue
            slot = path[len(f"{m.name}_embeddings_"):]
            if slot in per_row:  # a column of the files
                got = d.embeddings.numpy(slot).astype(np.float64)
                assert path not in disk_state, path
            else:  # a variable, as in memory
                got = to_np(disk_state[path])
            np.testing.assert_array_equal(got, to_np(var), err_msg=f"{name}: {path}")
            checked += 1
    assert checked >= len(SUPPORTED) * 2  # (state, skip count at least)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_options_that_need_every_row_are_refused_naming_the_table(tmp_path, name):
    entry, cfg = REFUSED[name]
    model, _, _ = _model({name: (entry, cfg, "float32", {})},
                         lambda i, s: OnDisk(str(tmp_path / "t"), **s))
    with pytest.raises(ValueError, match=r"Table 't0/embeddings' \(storage=OnDisk\)"):
        model.fit(*_data(2, rows=8), verbose=0)


def test_a_table_on_disk_is_no_array_in_memory(tmp_path):
    # A billion rows: no variable, optimizer slot or dedup workspace of the
    # table's size exists; the files take only the rows written.
    rows = 10**9
    ids = keras.Input((4,), dtype="int32")
    layer = sparseopt.layers.SparseEmbedding(
        rows, 16, sparseopt.updaters.RowwiseAdagrad(0.05),
        storage=OnDisk(str(tmp_path / "big"), cache_rows=1000), name="big")
    model = keras.Model(ids, keras.layers.Dense(1)(keras.layers.Flatten()(layer(ids))))
    model.compile(optimizer=sparseopt.DispatchOptimizer("adam"), loss="mse")
    rng = np.random.default_rng(0)
    x = rng.integers(0, rows, (64, 4)).astype("int32")
    model.fit(x, np.ones((64, 1), "float32"), batch_size=16, verbose=0)
    arrays = [*model.variables, *model.optimizer.variables]
    assert max(int(np.prod(v.shape)) for v in arrays) < 10**6
    touched = np.unique(x)
    assert layer.disk_stats()["rows_written"] >= min(touched.size, 1) > 0
    # 1024-row chunks of 64 + 4 bytes per row, at most one chunk per touched row.
    assert layer.embeddings.files.disk_bytes() < 2 * touched.size * 1024 * 68 + 2**20
    changed = layer.embeddings.numpy("accumulator", touched)
    assert np.all(changed > 0)  # every touched row took a step (RowwiseAdagrad from 0)


def test_a_table_on_disk_is_reopened_where_fit_left_it(tmp_path):
    def build():
        keras.backend.clear_session(free_memory=False)
        model, layers, _ = _model(
            {"Adagrad": (sparseopt.updaters.Adagrad, {}, "float32", {})},
            lambda i, s: OnDisk(str(tmp_path / "t"), cache_rows=8))
        return model, layers[0]

    model, layer = build()
    start = layer.embeddings.numpy().copy()
    model.fit(*_data(2), batch_size=8, verbose=0)
    trained = layer.embeddings.numpy().copy()
    accumulator = layer.embeddings.numpy("accumulator").copy()
    assert not np.array_equal(start, trained)
    _, again = build()  # a new process would see the same files (fit flushed them)
    np.testing.assert_array_equal(again.embeddings.numpy(), trained)
    np.testing.assert_array_equal(again.embeddings.numpy("accumulator"), accumulator)


def test_the_cache_counts_each_row_once_where_it_holds_them_all(tmp_path):
    model, layers, _ = _model({"SGD": (sparseopt.updaters.SGD, {}, "float32", {})},
                              lambda i, s: OnDisk(str(tmp_path / "t"), cache_rows=4000))
    x, y = _data(2)
    model.fit(x, y, batch_size=8, epochs=3, verbose=0)
    stats = layers[0].disk_stats()
    valid = np.unique(x[(x >= 0) & (x < ROWS)])
    # Every distinct row missed once, then stayed cached; nothing was evicted.
    assert stats["misses"] == valid.size and stats["hits"] > 0
    assert stats["rows_read"] == 0  # (never-written rows are drawn, not read)
    assert stats["rows_written"] == valid.size  # fit's end wrote each once
    assert stats["hit_rate"] == stats["hits"] / (stats["hits"] + stats["misses"])


def test_table_health_reports_the_caches_per_epoch(tmp_path):
    model, layers, _ = _model({"SGD": (sparseopt.updaters.SGD, {}, "float32", {}),
                               "Adam": (sparseopt.updaters.Adam, {}, "float32", {})},
                              lambda i, s: OnDisk(str(tmp_path / f"t{i}"), cache_rows=4000))
    x, y = _data(4)
    seen = []  # each table's counts at each epoch's end, read beside the callback
    record = keras.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: seen.append([layer.disk_stats() for layer in layers]))
    history = model.fit(x, y, batch_size=8, epochs=2, verbose=0,
                        callbacks=[sparseopt.callbacks.TableHealth(warn=False), record]).history
    # Caches that hold every row: the first epoch misses each distinct valid id of
    # each table once, the second finds them all; nothing is evicted, nor read
    # from the files (never-written rows are drawn).
    distinct = sum(np.unique(x[:, 2 * i:2 * i + 2][(x[:, 2 * i:2 * i + 2] >= 0)
                                                   & (x[:, 2 * i:2 * i + 2] < ROWS)]).size
                   for i in range(2))
    assert sum(s["misses"] for s in seen[0]) == distinct
    assert sum(s["misses"] for s in seen[1]) == distinct  # (none more)
    first = sum(s["hits"] for s in seen[0])
    assert history["disk_hit_rate"][0] == pytest.approx(first / (first + distinct))
    assert history["disk_hit_rate"][1] == 1.0
    assert history["disk_kb_read_per_step"] == [0.0, 0.0]
    assert history["disk_kb_written_per_step"] == [0.0, 0.0]


def test_what_a_table_on_disk_cannot_do_yet_is_refused_with_the_fix(tmp_path):
    ids = keras.Input((2,), dtype="int32")
    layer = sparseopt.layers.SparseEmbedding(
        10, 2, sparseopt.updaters.SGD(0.1), storage=OnDisk(str(tmp_path / "t")), name="e")
    model = keras.Model(ids, layer(ids))
    with pytest.raises(ValueError, match="'e/embeddings' is on disk.*flush"):
        model.save_weights(str(tmp_path / "w.weights.h5"))
    with pytest.raises(ValueError, match="int8 table on disk"):
        sparseopt.layers.SparseEmbedding(10, 2, sparseopt.updaters.SGD(0.1), dtype="int8",
                                         storage=OnDisk(str(tmp_path / "u")))(ids)
    with pytest.raises(ValueError, match="RandomUniform, RandomNormal"):
        sparseopt.layers.SparseEmbedding(10, 2, sparseopt.updaters.SGD(0.1),
                                         embeddings_initializer="glorot_uniform",
                                         storage=OnDisk(str(tmp_path / "v")))(ids)
    for bad, match in (({"path": ""}, "path"), ({"path": "p", "cache_rows": 0}, "cache_rows"),
                       ({"path": "p", "policy": "fifo"}, "policy")):
        with pytest.raises(ValueError, match=match):
            OnDisk(**bad)


def test_on_disk_settings_serialize_with_the_layer(tmp_path):
    storage = OnDisk(str(tmp_path / "t"), cache_rows=64, policy="lfu",
                     state_dtype="bfloat16")
    layer = sparseopt.layers.SparseEmbedding(10, 2, sparseopt.updaters.SGD(0.1),
                                             storage=storage)
    again = sparseopt.layers.SparseEmbedding.from_config(layer.get_config())
    assert again.storage == storage and type(again.storage) is OnDisk
    assert dataclasses.asdict(again.storage)["policy"] == "lfu"


CONTROLS = {
    "lr_schedule_callback": ({}, lambda: [keras.callbacks.LearningRateScheduler(
        lambda epoch, lr: lr * 0.5)]),
    "global_clipnorm": ({"global_clipnorm": 0.05}, list),
    "gradient_accumulation": ({"gradient_accumulation_steps": 2}, list),
}


@pytest.mark.parametrize("control", sorted(CONTROLS))
def test_training_controls_act_on_a_table_on_disk_as_in_memory(tmp_path, control):
    options, callbacks = CONTROLS[control]
    cases = {"Adagrad": (sparseopt.updaters.Adagrad, {}, "float32", {}),
             "Ftrl": (sparseopt.updaters.Ftrl, {"l2_regularization_strength": 0.01},
                      "float32", {})}
    clipnorm = {k: v for k, v in options.items() if k == "global_clipnorm"}
    rest = {k: v for k, v in options.items() if k != "global_clipnorm"}

    def train(storage_of, start=None):
        model, layers, head = _model(cases, storage_of)
        model.compile(optimizer=sparseopt.DispatchOptimizer(
            keras.optimizers.Adam(0.01, **clipnorm), **rest), loss="mse")
        if start is not None:  # the in-memory run starts where the disk run started
            for layer, rows in zip(layers, start[0]):
                layer.embeddings.assign(rows)
            head.set_weights(start[1])
        else:
            start = ([layer.embeddings.numpy().astype(np.float32) for layer in layers],
                     head.get_weights())
        model.fit(*_data(4), batch_size=8, epochs=2, shuffle=False, verbose=0,
                  callbacks=callbacks())
        return layers, start

    # (TF's fused kernels left out of the reference: see the registry-driven test.)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(backend, "KERNELS", tuple(
            k for k in backend.KERNELS if k.stages != ("read", "rule", "write")))
        disk, start = train(lambda i, s: OnDisk(str(tmp_path / f"t{i}"), cache_rows=8))
        memory, _ = train(lambda i, s: None, start)
    for name, d, m, first in zip(cases, disk, memory, start[0]):
        np.testing.assert_array_equal(d.embeddings.numpy().astype(np.float64),
                                      to_np(m.embeddings), err_msg=f"{control}: {name}")
        assert not np.array_equal(first, d.embeddings.numpy()), name  # (it trained)


_STRATEGY_CHILD = """
import sys, numpy as np, keras, tensorflow as tf, sparseopt
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
with tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]).scope():
    ids = keras.Input((2,), dtype="int32")
    emb = sparseopt.layers.SparseEmbedding(10, 2, sparseopt.updaters.SGD(0.1), name="t0",
                                           storage=sparseopt.storage.OnDisk(sys.argv[1]))
    model = keras.Model(ids, emb(ids))
    model.compile(optimizer=sparseopt.DispatchOptimizer("sgd"), loss="mse")
try:
    model.fit(np.zeros((4, 2), "int32"), np.zeros((4, 2, 2), "float32"), verbose=0)
except ValueError as error:
    print(error)
"""


@pytest.mark.backend_independent  # (a TensorFlow child: logical devices are fixed at start)
def test_a_table_on_disk_under_a_tensorflow_strategy_is_refused(tmp_path):
    proc = subprocess.run([sys.executable, "-c", _STRATEGY_CHILD, str(tmp_path / "t")],
                          cwd=ROOT, env=child_env("tensorflow"), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Table 't0/embeddings' (storage=OnDisk): a table on disk under a distribution " \
        "strategy" in proc.stdout, proc.stdout + proc.stderr[-2000:]


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="keras.distribution (JAX)")
def test_a_table_on_disk_under_a_keras_distribution_is_refused(tmp_path):
    with keras.distribution.DataParallel().scope():
        with pytest.raises(ValueError, match="'t0': a table on disk under a keras.distrib"):
            _model({"SGD": (sparseopt.updaters.SGD, {}, "float32", {})},
                   lambda i, s: OnDisk(str(tmp_path / "t")))
