"""Tables on disk (`storage=OnDisk(...)`), trained by `fit` through their cache.

The reference is the same model with its tables in memory (the in-memory
kind, trained by the same updaters, started from the same rows and head):
every table, its per-row state (columns of its files) and its whole state
(variables) must end bit for bit where the in-memory run's end, for every
registered updater configuration (the registry drives the cases), with a
cache far smaller than the table so that rows are evicted and read back.
"""

import dataclasses
import logging
import os
import re
import signal
import subprocess
import sys
import time

import keras
import numpy as np
import pytest

import sparseopt
from sparseopt import backend
from sparseopt.disk import table as disk_table
from sparseopt.storage import disk_parts
from sparseopt.storage import OnDisk
from tests.conftest import to_np
from tests.helpers import (THOROUGH, ROOT, child_env, optimizer_state, registered_cases,
                           run_device_job)

ROWS, WIDTH = 40, 3
# `make test`: each registered updater's default and one other code path of it
# (`registered_cases(paths_only=True)`); `make test-all`: every configuration.
CASES = registered_cases(paths_only=not THOROUGH)
STORAGE_KEYS = ("state_dtype", "stochastic_rounding", "rounding_seed")
# 16-bit rows and state (the registry's configurations are float32 ones).
HALF_CASES = {
    "Adagrad:bfloat16": (sparseopt.updaters.Adagrad, {}, "bfloat16",
                         {"state_dtype": "bfloat16"}),
    "RowwiseAdagrad:float16_state": (sparseopt.updaters.RowwiseAdagrad, {}, "float32",
                                     {"state_dtype": "float16",
                                      "stochastic_rounding": False}),
    "Adam:bfloat16_rows": (sparseopt.updaters.Adam, {}, "bfloat16", {}),
    # int8 rows (codes and a scale per row): a per-row and a per-entry rule; how
    # the rows are kept does not depend on the rule (every rule: test_int8_tables.py).
    "RowwiseAdagrad:int8": (sparseopt.updaters.RowwiseAdagrad, {}, "int8", {}),
    "Adam:int8_nearest": (sparseopt.updaters.Adam, {}, "int8",
                          {"stochastic_rounding": False}),
}


# Options whose end of `fit` works on every row (part by part on disk): `lazy=False`'s
# catch-up, the moving and weight averages; on an int8 and a bfloat16 table too.
# (`make test` trains no registered configuration with them: `paths_only`.)
WRAPPER_CASES = {
    "SGD:dense_momentum_decay": (sparseopt.updaters.SGD,
                                 {"momentum": 0.9, "weight_decay": 0.2, "lazy": False},
                                 "float32", {}),
    "RowwiseAdagrad:ema": (sparseopt.updaters.RowwiseAdagrad, {"ema_momentum": 0.9},
                           "float32", {}),
    "SGD:swa": (sparseopt.updaters.SGD, {"swa_period": 2, "swa_start": 1}, "float32", {}),
    "Adagrad:int8_dense_decay": (sparseopt.updaters.Adagrad,
                                 {"weight_decay": 0.3, "lazy": False}, "int8", {}),
    "Adam:ema_bfloat16": (sparseopt.updaters.Adam, {"ema_momentum": 0.8}, "bfloat16", {}),
    # (Whole slots, which the moving average passes through: never written part by part.)
    "Adafactor:ema": (sparseopt.updaters.Adafactor, {"ema_momentum": 0.9}, "float32", {}),
    # Lookahead's sync of the rows its window changed (a list on disk: `lookahead_list`),
    # the last window of `fit` left unsynced; on a bfloat16 table, its rounding.
    "RowwiseAdagrad:lookahead": (sparseopt.updaters.RowwiseAdagrad, {"lookahead_period": 5},
                                 "float32", {}),
    "Adam:lookahead_bfloat16": (sparseopt.updaters.Adam,
                                {"lookahead_period": 5, "lookahead_step_size": 0.4},
                                "bfloat16", {}),
}


def _refused(case):
    """Whether an updater configuration is refused on disk: whole state started from every
    row of the table."""
    entry, cfg = case
    updater = entry(0.05, **{k: v for k, v in cfg.items() if k not in STORAGE_KEYS})
    return any(s.from_table is not None for s in updater.slots)


SUPPORTED = {name: (entry, cfg, "float32", {})
             for name, (entry, cfg) in CASES.items() if not _refused((entry, cfg))}
# (Float tables before int8 ones: in memory an int8 table is trained beside the
# variables, after every float table, and a table's position among the optimizer's
# tables keys its rounding bits; on disk every table is trained beside them, in the
# model's order. docs/disk.md, "Exactness".)
SUPPORTED.update({k: v for k, v in {**HALF_CASES, **WRAPPER_CASES}.items() if v[2] != "int8"})
SUPPORTED.update({k: v for k, v in {**HALF_CASES, **WRAPPER_CASES}.items() if v[2] == "int8"})
# Every configuration refused (the registry's, whatever `make test` trains).
REFUSED = {name: case for name, case in registered_cases().items() if _refused(case)}


def _sparse_embedding(i, updater, storage, dtype):
    return sparseopt.layers.SparseEmbedding(ROWS, WIDTH, updater=updater, storage=storage,
                                            dtype=dtype, name=f"t{i}")


def _model(cases, storage_of, layer_of=_sparse_embedding):
    """One table per case (two ids each) with a dense head of its own, the heads'
    outputs side by side; compiled with DispatchOptimizer and `mse`.

    A head per table: each table's gradients depend on its own rows only (the
    mean squared error's gradient at each output is its own). One head over
    every table would make each table's update depend on how XLA compiles a
    dot over all of their rows, which a change anywhere else in the program can
    change in the last bit.

    Args:
        cases: `{name: (Updater class, config, dtype, storage settings)}`.
        storage_of: `storage_of(i, settings)`, table `i`'s `storage=`.
        layer_of: `layer_of(i, updater, storage, dtype)`, table `i`'s layer.
    """
    ids = keras.Input((2 * len(cases),), dtype="int32")
    outs, layers, heads = [], [], []
    for i, (entry, cfg, dtype, settings) in enumerate(cases.values()):
        rule = {k: v for k, v in cfg.items() if k not in STORAGE_KEYS}
        settings = {**{k: v for k, v in cfg.items() if k in STORAGE_KEYS}, **settings}
        layer = layer_of(i, entry(0.05, **rule), storage_of(i, settings), dtype)
        layers.append(layer)
        heads.append(keras.layers.Dense(1, name=f"head{i}"))
        outs.append(heads[-1](keras.layers.Flatten()(layer(ids[:, 2 * i:2 * i + 2]))))
    model = keras.Model(ids, keras.layers.Concatenate()(outs) if len(outs) > 1 else outs[0])
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.Adam(0.01)),
                  loss="mse")
    return model, layers, heads


def _data(tables, rows=48, seed=7):
    """`(ids, targets)` for `_model`'s `tables` tables (one target per example, each
    table's head aiming at it)."""
    rng = np.random.default_rng(seed)
    x = rng.integers(-2, ROWS + 2, (rows, 2 * tables)).astype("int32")  # some invalid ids
    y = rng.normal(size=(rows, 1)).astype("float32")
    return x, np.repeat(y, tables, axis=1)


def _heads(heads):
    return [h.get_weights() for h in heads]


def _set_heads(heads, weights):
    for h, w in zip(heads, weights):
        h.set_weights(w)


@pytest.fixture
def rules_own_path(monkeypatch):
    """The in-memory reference updated by the rules, as a table on disk is.

    TensorFlow updates float32 tables in memory with its own fused kernels where
    it has one for the rule (Ftrl, Adagrad without epsilon, SGD...), which can
    differ from the rule in the last bit; a table on disk is updated by the
    rule, everywhere (the kernels are checked on their own in
    test_backends.py). The native dedup stays on: its result is the rule
    path's bit for bit.
    """
    monkeypatch.setattr(backend, "KERNELS", tuple(
        k for k in backend.KERNELS if k.stages != ("read", "rule", "write")))


def assert_state_as_in_memory(name, disk_layer, memory_layer, disk_state, memory_state):
    """Asserts that each optimizer slot of `memory_layer`'s table (`memory_state`: the
    in-memory optimizer's variables by name) is `disk_layer`'s: a column of its files for
    a per-row slot, a variable of its optimizer (`disk_state`) for a whole one. How many
    slots it compared.

    Args:
        name: the case, for messages.
    """
    per_row = [s.name for s in memory_layer.updater.slots if s.per_row]
    prefix, checked = f"{memory_layer.name}_embeddings_", 0
    for path, var in memory_state.items():
        if not path.startswith(prefix):
            continue
        slot = path[len(prefix):]
        if slot.startswith("lookahead_"):  # the window: its rows, not how they are listed
            if slot == "lookahead_count":
                checked += _assert_same_window(name, prefix, disk_state, memory_state)
            continue
        if slot in per_row:  # a column of the files
            got = disk_layer.embeddings.numpy(slot).astype(np.float64)
            assert path not in disk_state, path
        else:  # a variable, as in memory
            got = to_np(disk_state[path])
        np.testing.assert_array_equal(got, to_np(var), err_msg=f"{name}: {path}")
        checked += 1
    return checked


def _assert_same_window(name, prefix, disk_state, memory_state):
    """Asserts that the rows Lookahead's window lists (changed since the last sync) are the
    same: in memory each row once (`lookahead_rows`), on disk each step's, repeats included
    (`lookahead_list`). 1 (a slot compared)."""
    def listed(state, rows):
        count = int(to_np(state[prefix + "lookahead_count"]))
        return set(to_np(state[prefix + rows])[:count].tolist())

    in_memory, on_disk = listed(memory_state, "lookahead_rows"), listed(disk_state,
                                                                        "lookahead_list")
    assert in_memory == on_disk, (name, in_memory, on_disk)
    assert on_disk, name  # (the last window left rows to sync: the test would see a sync)
    return 1


# The flags `make test` compiles JAX's programs with to cut compile time (Makefile)
# may change the last bit of a result differently in two programs (measured: one
# Adafactor configuration's whole-table statistics, FTRL under gradient
# accumulation). Users compile at XLA's defaults, where these tests hold bit for
# bit: on JAX they run there, in a child
# (`test_tables_on_disk_equal_memory_at_xlas_default_flags`).
_TEST_FLAGS = [f for f in os.environ.get("SPARSEOPT_TEST_XLA_FLAGS", "").split()
               if f in os.environ.get("XLA_FLAGS", "").split()]
at_default_flags = pytest.mark.skipif(
    keras.backend.backend() == "jax" and bool(_TEST_FLAGS),
    reason="on JAX: runs in a child compiling at XLA's default flags (see above)")


@pytest.fixture
def parts_of_16_rows(monkeypatch):
    """Whole-table work on a table on disk (the end of `fit` of `lazy=False`,
    `ema_momentum`, `swa_*`) in parts of 16 rows, so that a 40-row table is worked on
    in three parts, the last shorter (`DiskTable.each_part`; 65,536 rows a part
    otherwise; a multiple of 16 rows, as `PART_ROWS` must be). The sizes of the parts
    worked on, in a list."""
    monkeypatch.setattr(disk_table, "PART_ROWS", 16)
    sizes, made = [], disk_parts.RowsPart.__init__

    def counted(self, storage, ids, stored):
        sizes.append(ids.size)
        made(self, storage, ids, stored)

    monkeypatch.setattr(disk_parts.RowsPart, "__init__", counted)
    return sizes


@at_default_flags
@pytest.mark.usefixtures("rules_own_path")
def test_lookahead_on_disk_with_gradient_accumulation_as_in_memory(tmp_path):
    # An accumulated update changes the rows of all its micro-steps: the list on disk
    # holds the period times that many (it was sized by one micro-step's ids).
    cases = {"RowwiseAdagrad:lookahead": SUPPORTED["RowwiseAdagrad:lookahead"]}
    runs = []
    for storage_of in (lambda i, s: OnDisk(str(tmp_path / f"t{i}"), cache_rows=8, **s),
                       lambda i, s: sparseopt.TableStorage(**s)):
        model, layers, heads = _model(cases, storage_of)
        model.compile(optimizer=sparseopt.DispatchOptimizer(
            keras.optimizers.Adam(0.01), gradient_accumulation_steps=2), loss="mse")
        runs.append((model, layers, heads))
    (disk, disk_layers, disk_heads), (memory, memory_layers, memory_heads) = runs
    memory_layers[0].embeddings.assign(disk_layers[0].embeddings.numpy().astype(np.float32))
    _set_heads(memory_heads, _heads(disk_heads))
    x, y = _data(1, rows=96)  # (12 micro-steps: 6 updates, a sync after the fifth)
    for model in (disk, memory):
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    np.testing.assert_array_equal(disk_layers[0].embeddings.numpy().astype(np.float64),
                                  to_np(memory_layers[0].embeddings))
    np.testing.assert_array_equal(disk_layers[0].embeddings.numpy("lookahead_offset"),
                                  to_np(memory.optimizer.table_state(
                                      memory_layers[0].embeddings)["lookahead_offset"]))


@at_default_flags
@pytest.mark.usefixtures("rules_own_path")
def test_tables_on_disk_train_every_updater_as_in_memory_bit_for_bit(tmp_path,
                                                                      parts_of_16_rows):
    # Disk first: its rows (drawn per row from the initializer) and head start the
    # in-memory run. A cache of 8 rows per 40-row table: rows are evicted and read back.
    disk, disk_layers, disk_heads = _model(
        SUPPORTED, lambda i, s: OnDisk(str(tmp_path / f"t{i}"), cache_rows=8, **s))
    memory, memory_layers, memory_heads = _model(
        SUPPORTED, lambda i, s: sparseopt.TableStorage(**s))
    for d, m in zip(disk_layers, memory_layers):
        if d.embeddings.int8:  # (codes and scales)
            m.embeddings.assign(d.embeddings.numpy())
            m.embeddings_scale.assign(d.embeddings.numpy("scale"))
        else:
            m.embeddings.assign(d.embeddings.numpy().astype(np.float32))
    _set_heads(memory_heads, _heads(disk_heads))
    x, y = _data(len(SUPPORTED))
    disk.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    memory.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)

    for got, want in zip(_heads(disk_heads), _heads(memory_heads)):
        np.testing.assert_array_equal(got[0], want[0])
    # (By name: the two optimizers' own names differ.)
    memory_state = {v.path.split("/")[-1]: v for v in optimizer_state(memory.optimizer)}
    disk_state = {v.path.split("/")[-1]: v for v in optimizer_state(disk.optimizer)}
    checked = 0
    for name, d, m in zip(SUPPORTED, disk_layers, memory_layers):
        np.testing.assert_array_equal(d.embeddings.numpy().astype(np.float64),
                                      to_np(m.embeddings), err_msg=name)
        if d.embeddings.int8:
            np.testing.assert_array_equal(d.embeddings.numpy("scale"),
                                          to_np(m.embeddings_scale), err_msg=name)
        stats = d.disk_stats()
        assert stats["misses"] > 0 and stats["rows_written"] > 0, (name, stats)
        checked += assert_state_as_in_memory(name, d, m, disk_state, memory_state)
    assert checked >= len(SUPPORTED) * 2  # (state, skip count at least)
    assert {16, 40 % 16} <= set(parts_of_16_rows)  # (the end of fit's work, part by part)


@at_default_flags
@pytest.mark.usefixtures("rules_own_path")
def test_averages_and_catch_up_between_steps_on_disk_as_in_memory(tmp_path,
                                                                    parts_of_16_rows):
    # Mid-training (not at the end of `fit`): the whole table's moving and weight
    # averages, read part by part, and every row caught up.
    cases = {n: WRAPPER_CASES[n] for n in ("SGD:dense_momentum_decay", "RowwiseAdagrad:ema",
                                           "SGD:swa", "Adagrad:int8_dense_decay")}
    disk, disk_layers, disk_heads = _model(
        cases, lambda i, s: OnDisk(str(tmp_path / f"t{i}"), cache_rows=8, **s))
    memory, memory_layers, memory_heads = _model(
        cases, lambda i, s: sparseopt.TableStorage(**s))
    for d, m in zip(disk_layers, memory_layers):
        if d.embeddings.int8:
            m.embeddings.assign(d.embeddings.numpy())
            m.embeddings_scale.assign(d.embeddings.numpy("scale"))
        else:
            m.embeddings.assign(d.embeddings.numpy())
    _set_heads(memory_heads, _heads(disk_heads))
    x, y = _data(len(cases))

    class Between(keras.callbacks.Callback):
        """What a user reads between two steps, on step 3."""

        def __init__(self, layers):
            super().__init__()
            self.layers, self.seen = layers, {}

        def on_train_batch_end(self, batch, logs=None):
            if batch != 3:
                return
            optimizer = self.model.optimizer
            for name, layer in zip(cases, self.layers):
                path = layer.embeddings.path
                if "ema" in name:
                    self.seen[name] = to_np(optimizer.table_moving_average(path))
                elif "swa" in name:
                    self.seen[name] = to_np(optimizer.table_swa_average(path))
            optimizer.catch_up_tables()  # (lazy=False rows brought up to this step)
            for name, layer in zip(cases, self.layers):
                if "decay" in name:  # (an int8 table's codes)
                    on_disk = isinstance(layer.embeddings, disk_table.DiskTable)
                    self.seen[name] = (layer.embeddings.numpy() if on_disk
                                       else to_np(layer.embeddings))

    on_disk, in_memory = Between(disk_layers), Between(memory_layers)
    disk.fit(x, y, batch_size=8, shuffle=False, verbose=0, callbacks=[on_disk])
    memory.fit(x, y, batch_size=8, shuffle=False, verbose=0, callbacks=[in_memory])
    assert sorted(on_disk.seen) == sorted(cases)
    for name in cases:
        np.testing.assert_array_equal(np.asarray(on_disk.seen[name], np.float64),
                                      np.asarray(in_memory.seen[name], np.float64),
                                      err_msg=name)
    for name, d, m in zip(cases, disk_layers, memory_layers):
        np.testing.assert_array_equal(d.embeddings.numpy().astype(np.float64),
                                      to_np(m.embeddings), err_msg=name)
    assert {16, 40 % 16} <= set(parts_of_16_rows)


@pytest.mark.parametrize("kind,dtype", [("functional", "float32"), ("functional", "int8"),
                                        ("passing_training", "float32"),
                                        ("not_passing_training", "float32")])
def test_a_training_lookup_reads_the_rows_state_for_the_optimizer_in_its_host_call(
        tmp_path, monkeypatch, kind, dtype):
    # The optimizer starts from the per-row state the step's lookup read with the rows
    # (`RowGrads.state`): a step makes one host read (the lookup's) and one write, not
    # a second read for the state; `predict` reads the rows alone. A subclassed model's
    # `call` passes `training` on to the layer (as to `Dropout`): where it does not, the
    # step reads the state in a host call of its own. (The values are those of the same
    # table in memory: the registry's exactness tests.)
    reads = []
    read_host = disk_table.DiskTable._read_host

    def counted(self, ids, names, lookup=False):
        reads.append(tuple(names))
        return read_host(self, ids, names, lookup)

    monkeypatch.setattr(disk_table.DiskTable, "_read_host", counted)
    layer = sparseopt.layers.SparseEmbedding(
        40, 4, sparseopt.updaters.Adam(0.05), storage=OnDisk(str(tmp_path / "t"), cache_rows=8),
        name="e", dtype=dtype)
    head = keras.layers.Dense(1)
    if kind == "functional":
        ids = keras.Input((3,), dtype="int32")
        model = keras.Model(ids, head(layer(ids)))
    else:
        class Subclassed(keras.Model):
            def __init__(self):
                super().__init__()
                self.embedding, self.head = layer, head

            def call(self, ids, training=None):
                passed = {"training": training} if kind == "passing_training" else {}
                return self.head(self.embedding(ids, **passed))

        model = Subclassed()
    model.compile(optimizer=sparseopt.DispatchOptimizer("sgd"), loss="mse")
    x = np.random.default_rng(0).integers(0, 40, (32, 3)).astype("int32")
    model.fit(x, np.ones((32, 1, 1), "float32"), batch_size=8, epochs=2, verbose=0)
    stored = ("rows", "scale") if dtype == "int8" else ("rows",)
    state = ("momentum", "velocity")
    # 8 steps: one read each; two where `training` is not passed on and Keras' step
    # calls the model's `call` itself (JAX's `stateless_call`, Keras 3.15; TensorFlow's
    # calls the model, whose call context gives the layer `training`: a Keras whose JAX
    # step did so too would make it one there as well).
    one, two = [stored + state] * 8, [stored, state] * 8
    jax_alone = kind == "not_passing_training" and keras.backend.backend() == "jax"
    assert reads == (two if jax_alone else one), reads
    reads.clear()
    model.predict(x, batch_size=8, verbose=0)
    assert reads == [stored] * 4, reads


def test_ids_outside_a_table_on_disk_look_up_none_of_its_rows(tmp_path):
    # They read zeros and are not lookups of any row: nothing cached, counted or written.
    ids = keras.Input((3,), dtype="int32")
    layer = sparseopt.layers.SparseEmbedding(
        10, 2, sparseopt.updaters.SGD(0.1), storage=OnDisk(str(tmp_path / "t"), cache_rows=8),
        name="e")
    model = keras.Model(ids, keras.layers.Dense(1)(keras.layers.Flatten()(layer(ids))))
    model.compile(optimizer=sparseopt.DispatchOptimizer("sgd"), loss="mse")
    x = np.array([[-1, 10, 99]] * 8, "int32")
    model.fit(x, np.ones((8, 1), "float32"), verbose=0)
    stats = layer.disk_stats()
    assert (stats["hits"], stats["misses"], stats["rows_written"]) == (0, 0, 0), stats
    assert int(to_np(layer.num_dropped_ids)) == 24  # (counted as dropped, as in memory)
    np.testing.assert_array_equal(to_np(layer(x)), 0.0)


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_a_table_on_disk_is_read_by_an_eager_call(tmp_path, dtype):
    # Outside any traced step (a user's `layer(x)`, `model(x)`): the rows as the layer
    # reads them (an int8 table's host call returns two results: codes and scales).
    layer = sparseopt.layers.SparseEmbedding(
        10, 2, sparseopt.updaters.SGD(0.1), storage=OnDisk(str(tmp_path / "t"), cache_rows=8),
        combiner=None, name="e", dtype=dtype)
    x = np.array([[1, 5, 9]] * 8 + [[0, -1, 10]] * 8, "int32")
    got = to_np(layer(x))
    rows = np.vstack([layer.embeddings.rows_read(), np.zeros((1, 2))])  # (row 10: zeros)
    np.testing.assert_array_equal(got, rows[np.where((x >= 0) & (x < 10), x, 10)])


@pytest.mark.jax_session  # (once, in a JAX child: XLA reads its flags when it starts)
def test_tables_on_disk_equal_memory_at_xlas_default_flags(tmp_path):
    # `make test` compiles with flags that cut compile time (Makefile); users compile
    # at XLA's defaults. The exactness tests (`as_in_memory`, here and in
    # test_disk_vocabulary.py), in a child compiling at the defaults: in `make test`
    # the two registry-driven ones (every updater's update, where XLA's code
    # generation could round otherwise: 44 s alone, where the ten took 78 s in a
    # whole session), in `make test-all` all ten (the training controls, odd
    # batches, averages and accumulation too).
    env = child_env("jax", test_xla=False)
    assert not [f for f in _TEST_FLAGS if f in env.get("XLA_FLAGS", "")]
    chosen, count = ("as_in_memory", 10) if THOROUGH else ("every_updater_as_in_memory", 2)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-p",
                           "no:cacheprovider", "tests/test_disk_tables.py",
                           "tests/test_disk_vocabulary.py", "-k", chosen,
                           "--basetemp", str(tmp_path / "child")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and f"{count} passed" in proc.stdout, proc.stdout[-3000:]


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_options_a_table_on_disk_cannot_take_are_refused_naming_the_table(tmp_path, name):
    entry, cfg = REFUSED[name]
    model, _, _ = _model({name: (entry, cfg, "float32", {})},
                         lambda i, s: OnDisk(str(tmp_path / "t"), **s))
    with pytest.raises(ValueError, match=r"Table 't0/embeddings' \(storage=OnDisk\)"):
        model.fit(*_data(1, rows=8), verbose=0)


def test_lookahead_on_an_int8_table_on_disk_is_refused(tmp_path):
    model, _, _ = _model({"x": (sparseopt.updaters.SGD, {"lookahead_period": 2}, "int8", {})},
                         lambda i, s: OnDisk(str(tmp_path / "t"), **s))
    with pytest.raises(ValueError, match=r"Table 't0/embeddings' \(storage=OnDisk\) \(int8\)"
                       r".*lookahead_period"):
        model.fit(*_data(1, rows=8), verbose=0)


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
    files = layer.embeddings.files
    assert files.is_written(touched).all()  # (fit's end wrote the cache's rows)
    untouched = np.setdiff1d(rng.integers(0, rows, 1000), touched)
    assert not files.is_written(untouched).any()
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
    model.fit(*_data(1), batch_size=8, verbose=0)
    trained = layer.embeddings.numpy().copy()
    accumulator = layer.embeddings.numpy("accumulator").copy()
    assert not np.array_equal(start, trained)
    with pytest.raises(ValueError, match="'t0/embeddings'.* is open already"):
        build()  # (a second table over an open folder would lose rows)
    layer.embeddings.close()
    _, again = build()  # a new process would see the same files (fit flushed them)
    np.testing.assert_array_equal(again.embeddings.numpy(), trained)
    np.testing.assert_array_equal(again.embeddings.numpy("accumulator"), accumulator)


def test_the_cache_counts_each_row_once_where_it_holds_them_all(tmp_path):
    model, layers, _ = _model({"SGD": (sparseopt.updaters.SGD, {}, "float32", {})},
                              lambda i, s: OnDisk(str(tmp_path / "t"), cache_rows=4000))
    x, y = _data(1)
    model.fit(x, y, batch_size=8, epochs=3, verbose=0)
    stats = layers[0].disk_stats()
    valid = np.unique(x[(x >= 0) & (x < ROWS)])
    # Every distinct row missed once, then stayed cached; nothing was evicted.
    assert stats["misses"] == valid.size and stats["hits"] > 0
    assert stats["rows_read"] == 0  # (never-written rows are drawn, not read)
    assert stats["rows_written"] == valid.size  # fit's end wrote each once
    assert stats["hit_rate"] == stats["hits"] / (stats["hits"] + stats["misses"])


def test_table_health_reports_the_caches_per_epoch(tmp_path):
    # Caches of 8 rows: rows are evicted (written back) and read again.
    model, layers, _ = _model({"SGD": (sparseopt.updaters.SGD, {}, "float32", {}),
                               "Adam": (sparseopt.updaters.Adam, {}, "float32", {})},
                              lambda i, s: OnDisk(str(tmp_path / f"t{i}"), cache_rows=8))
    x, y = _data(2)
    times = ("host_ms", "waited_ms", "beside_ms", "flush_ms")
    seen = [[layer.disk_stats() for layer in layers]]
    assert all(stats[k] == 0 for stats in seen[0] for k in times)  # (nothing ran yet)
    record = keras.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: seen.append([layer.disk_stats() for layer in layers]))
    start = time.perf_counter()
    history = model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0,
                        callbacks=[sparseopt.callbacks.TableHealth(warn=False), record]).history
    wall_ms = 1e3 * (time.perf_counter() - start)
    steps = x.shape[0] // 8
    for epoch in range(3):
        new = {k: sum(after[k] - before[k] for before, after in zip(seen[epoch],
                                                                    seen[epoch + 1]))
               for k in ("hits", "misses", "bytes_read", "bytes_written", *times)}
        for name in ("host", "waited", "beside"):
            assert history[f"disk_{name}_ms_per_step"][epoch] == pytest.approx(
                new[f"{name}_ms"] / steps)
        # Each epoch's steps called the host and ran work beside them; a wait is part of
        # a host call.
        assert new["host_ms"] > 0 and new["beside_ms"] > 0
        assert 0 <= new["waited_ms"] <= new["host_ms"]
        assert new["flush_ms"] == 0  # (an epoch's end flushes nothing: fit's end does)
        assert history["disk_hit_rate"][epoch] == pytest.approx(
            new["hits"] / (new["hits"] + new["misses"]))
        assert history["disk_kb_read_per_step"][epoch] == pytest.approx(
            new["bytes_read"] / steps / 1024)
        assert history["disk_kb_written_per_step"][epoch] == pytest.approx(
            new["bytes_written"] / steps / 1024)
    # Rows were written back and read again: SGD's row (12 bytes) and Adam's row and
    # two moments (36 bytes) a row.
    assert min(history["disk_kb_read_per_step"][1:]) > 0
    assert min(history["disk_kb_written_per_step"]) > 0
    stats = [layer.disk_stats() for layer in layers]
    # The steps' host calls ran inside fit, one after another (each table's own).
    assert sum(s["host_ms"] for s in stats) < wall_ms
    # The end of fit flushed each table, once, inside fit.
    assert all(0 < s["flush_ms"] for s in stats)
    assert sum(s["flush_ms"] for s in stats) < wall_ms
    assert stats[0]["bytes_written"] == 12 * stats[0]["rows_written"]
    assert stats[1]["bytes_read"] == 36 * stats[1]["rows_read"]


def test_what_a_table_on_disk_cannot_do_yet_is_refused_with_the_fix(tmp_path):
    ids = keras.Input((2,), dtype="int32")
    layer = sparseopt.layers.SparseEmbedding(
        10, 2, sparseopt.updaters.Adagrad(0.1), storage=OnDisk(str(tmp_path / "t")), name="e")
    # Said before compile, where Keras resolves jit_compile="auto": TF's XLA cannot
    # compile the host calls (JAX compiles them into its program).
    assert layer.supports_jit == (keras.backend.backend() == "jax")
    model = keras.Model(ids, layer(ids))
    model.compile(optimizer=sparseopt.DispatchOptimizer("sgd"), loss="mse")
    model.fit(np.zeros((2, 2), "int32"), np.zeros((2, 2, 2), "float32"), verbose=0)
    with pytest.raises(ValueError, match="'e/embeddings': its per-row state .* its files"):
        model.optimizer.table_state(layer.embeddings)
    with pytest.raises(ValueError, match="'u': `rows_per_step` sizes the write buffer of an "
                                         "int8 table in memory; a table on disk"):
        sparseopt.layers.SparseEmbedding(10, 2, sparseopt.updaters.SGD(0.1), dtype="int8",
                                         rows_per_step=4, storage=OnDisk(str(tmp_path / "u")),
                                         name="u")
    with pytest.raises(ValueError, match="RandomUniform, RandomNormal"):
        sparseopt.layers.SparseEmbedding(10, 2, sparseopt.updaters.SGD(0.1),
                                         embeddings_initializer="glorot_uniform",
                                         storage=OnDisk(str(tmp_path / "v")))(ids)
    for bad, match in (({"path": ""}, "path"), ({"path": "p", "cache_rows": 0}, "cache_rows"),
                       ({"path": "p", "policy": "fifo"}, "policy")):
        with pytest.raises(ValueError, match=match):
            OnDisk(**bad)


def test_a_lookup_of_a_users_variable_on_disk_is_refused(tmp_path):
    class Mine(keras.layers.Layer):
        def build(self, input_shape):
            self.table = self.add_weight(shape=(10, 2), name="table")
            self.lookup = sparseopt.ops.SparseLookup(
                self, self.table, storage=OnDisk(str(tmp_path / "t")))

        def call(self, ids):
            return self.lookup(ids)

        @property
        def variable_path_to_optimizer_map(self):
            return {self.table.path: sparseopt.updaters.SGD(0.1)}

    ids = keras.Input((2,), dtype="int32")
    model = keras.Model(ids, Mine(name="mine")(ids))
    model.compile(optimizer=sparseopt.DispatchOptimizer("sgd"), loss="mse")
    with pytest.raises(ValueError, match="'mine/table' \\(storage=OnDisk\\): only a "
                                         "`sparseopt.layers.SparseEmbedding`"):
        model.fit(np.zeros((2, 2), "int32"), np.zeros((2, 2, 2), "float32"), verbose=0)


def test_weight_decay_exclusion_reaches_a_table_on_disk(tmp_path):
    def rows(weight_decay, exclude):
        keras.utils.set_random_seed(4)
        model, layers, _ = _model(
            {"SGD": (sparseopt.updaters.SGD, {"weight_decay": weight_decay}, "float32", {})},
            lambda i, s: OnDisk(str(tmp_path / f"t{weight_decay}{exclude}"), cache_rows=8))
        if exclude:
            model.optimizer.exclude_from_weight_decay(var_list=[layers[0].embeddings])
        model.fit(*_data(1), batch_size=8, shuffle=False, verbose=0)
        return layers[0].embeddings.numpy()

    excluded, undecayed, decayed = rows(0.5, True), rows(0.0, False), rows(0.5, False)
    np.testing.assert_array_equal(excluded, undecayed)
    assert not np.array_equal(decayed, undecayed)  # (the control: decay acts)


def test_on_disk_settings_serialize_with_the_layer(tmp_path):
    storage = OnDisk(str(tmp_path / "t"), cache_rows=64, policy="lfu", fetch_ahead=True,
                     state_dtype="bfloat16")
    layer = sparseopt.layers.SparseEmbedding(10, 2, sparseopt.updaters.SGD(0.1),
                                             storage=storage)
    again = sparseopt.layers.SparseEmbedding.from_config(layer.get_config())
    assert again.storage == storage and type(again.storage) is OnDisk
    assert dataclasses.asdict(again.storage)["policy"] == "lfu"
    assert again.storage.fetch_ahead is True
    assert OnDisk(str(tmp_path / "u")).fetch_ahead is False  # (off by default)
    with pytest.raises(ValueError, match="OnDisk: `fetch_ahead` must be True or False"):
        OnDisk(str(tmp_path / "v"), fetch_ahead="yes")


CONTROLS = {
    "lr_schedule_callback": ({}, lambda: [keras.callbacks.LearningRateScheduler(
        lambda epoch, lr: lr * 0.5)]),
    "global_clipnorm": ({"global_clipnorm": 0.05}, list),
    "gradient_accumulation": ({"gradient_accumulation_steps": 2}, list),
}


@at_default_flags
@pytest.mark.usefixtures("rules_own_path")
@pytest.mark.parametrize("control", sorted(CONTROLS))
def test_training_controls_act_on_a_table_on_disk_as_in_memory(tmp_path, control):
    options, callbacks = CONTROLS[control]
    cases = {"Adagrad": (sparseopt.updaters.Adagrad, {}, "float32", {}),
             "Ftrl": (sparseopt.updaters.Ftrl, {"l2_regularization_strength": 0.01},
                      "float32", {})}
    clipnorm = {k: v for k, v in options.items() if k == "global_clipnorm"}
    rest = {k: v for k, v in options.items() if k != "global_clipnorm"}

    def train(storage_of, start=None):
        model, layers, heads = _model(cases, storage_of)
        model.compile(optimizer=sparseopt.DispatchOptimizer(
            keras.optimizers.Adam(0.01, **clipnorm), **rest), loss="mse")
        if start is not None:  # the in-memory run starts where the disk run started
            for layer, rows in zip(layers, start[0]):
                layer.embeddings.assign(rows)
            _set_heads(heads, start[1])
        else:
            start = ([layer.embeddings.numpy().astype(np.float32) for layer in layers],
                     _heads(heads))
        model.fit(*_data(2), batch_size=8, epochs=2, shuffle=False, verbose=0,
                  callbacks=callbacks())
        return layers, start

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


@pytest.mark.jax_session  # (its child is JAX's, with 4 simulated devices)
def test_tables_on_disk_train_data_parallel_over_devices_as_on_one(tmp_path):
    # keras.distribution.DataParallel over 4 devices: the batch split, the tables on disk
    # on the host, read and written by the one compiled step's host calls. A table and
    # open vocabularies end as the same tables in memory on one device, to float rounding
    # (sums over devices go in another order), the maps exactly.
    proc = run_device_job("tests.jobs.disk_data_parallel_job", tmp_path)
    assert proc.returncode == 0 and "devices 4, equal" in proc.stdout, \
        proc.stdout[-2000:] + proc.stderr[-3000:]


def test_each_step_reads_the_rows_before_it_writes_them(tmp_path):
    # A loss linear in the rows: its gradient needs no row, so nothing but the
    # host calls' order makes the lookup read before the update writes. The
    # logged loss of each batch must be the in-memory model's.
    def losses(storage, start=None):
        ids = keras.Input((2,), dtype="int32")
        layer = sparseopt.layers.SparseEmbedding(
            ROWS, WIDTH, sparseopt.updaters.SGD(0.5), storage=storage, name="t",
            embeddings_initializer=keras.initializers.RandomUniform(-1, 1, seed=2))
        model = keras.Model(ids, keras.layers.Flatten()(layer(ids)))
        if start is None:
            start = layer.embeddings.numpy().astype(np.float32)
        else:  # the in-memory run starts from the disk table's rows
            layer.embeddings.assign(start)
        model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.1)),
                      loss=lambda y, p: keras.ops.mean(p))
        seen = []
        record = keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs: seen.append(float(logs["loss"])))
        x = np.random.default_rng(0).integers(0, 5, (32, 2)).astype("int32")
        model.fit(x, np.zeros((32, 1), "float32"), batch_size=4, shuffle=False, verbose=0,
                  callbacks=[record])
        return seen, start

    on_disk, start = losses(OnDisk(str(tmp_path / "t"), cache_rows=8))
    in_memory, _ = losses(None, start)
    assert len(set(on_disk)) > 1  # (the rows changed between steps)
    assert on_disk == in_memory


def _saved_model(folder, dtype="float32"):
    model, layers, heads = _model({"Adagrad": (sparseopt.updaters.Adagrad, {}, dtype, {})},
                                  lambda i, s: OnDisk(str(folder), cache_rows=8))
    return model, layers[0]


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_a_save_holds_a_snapshot_that_a_load_brings_back(tmp_path, dtype):
    x, y = _data(1)
    model, layer = _saved_model(tmp_path / "t", dtype)
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    model.save(tmp_path / "m.keras")
    saved = layer.embeddings.numpy().copy(), layer.embeddings.numpy("accumulator").copy()
    if dtype == "int8":  # (its config makes the loaded layer int8, on disk)
        saved += (layer.embeddings.numpy("scale").copy(),)
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)  # (the live files move on; the save does not)
    after = layer.embeddings.numpy().copy()
    assert not np.array_equal(after, saved[0])
    assert len(layer.embeddings.snapshots()) == 1
    layer.embeddings.close()
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    table = loaded.get_layer("t0").embeddings
    np.testing.assert_array_equal(table.numpy(), saved[0])
    np.testing.assert_array_equal(table.numpy("accumulator"), saved[1])
    if dtype == "int8":
        assert table.int8
        np.testing.assert_array_equal(table.numpy("scale"), saved[2])
    # Resumed from the save, the next epoch ends where the first run's did, bit for bit.
    loaded.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    np.testing.assert_array_equal(table.numpy(), after)


def test_backup_and_restore_resumes_a_table_on_disk_bit_for_bit(tmp_path):
    x, y = _data(1, rows=32)

    class Crash(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if self.model.optimizer.iterations.numpy() == 6:  # in the second epoch
                raise RuntimeError("crash")

    keras.utils.set_random_seed(1)  # (both runs' heads start alike)
    straight, straight_layer = _saved_model(tmp_path / "straight")
    straight.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0)
    want = straight_layer.embeddings.numpy()

    class Snapshots(keras.callbacks.Callback):  # (after the backup's own epoch end)
        seen = []

        def on_epoch_end(self, epoch, logs=None):
            self.seen.append(len(layer.embeddings.snapshots()))

    backup = sparseopt.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    keras.utils.set_random_seed(1)
    model, layer = _saved_model(tmp_path / "t")
    with pytest.raises(RuntimeError, match="crash"):
        model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0,
                  callbacks=[backup, Snapshots(), Crash()])
    assert Snapshots.seen == [1]  # the first epoch's backup, and its snapshot
    layer.embeddings.close()  # (the crashed process is gone)
    keras.backend.clear_session(free_memory=False)
    model, layer = _saved_model(tmp_path / "t")
    model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0,
              callbacks=[sparseopt.callbacks.BackupAndRestore(str(tmp_path / "backup")),
                         Snapshots()])
    np.testing.assert_array_equal(layer.embeddings.numpy(), want)
    # A backup replaced takes its snapshot with it; the backups deleted at the end, theirs.
    assert Snapshots.seen == [1, 1, 1] and layer.embeddings.snapshots() == []


@pytest.fixture(scope="module")
def run_to_the_end(tmp_path_factory):
    """The kill job's table and accumulator after 3 epochs, never killed."""
    folder = tmp_path_factory.mktemp("run")
    _kill_job(folder, "run")
    return np.load(folder / "final.npz")


def _kill_job(folder, mode):
    proc = subprocess.run([sys.executable, "-m", "tests.jobs.disk_kill_job", str(folder), mode],
                          cwd=ROOT, env=child_env("jax"), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == (0 if mode == "run" else -signal.SIGKILL), proc.stderr[-3000:]


@pytest.mark.jax_session  # (JAX children, once: in the JAX session)
@pytest.mark.parametrize("point", ["step", "save", "drain"])
def test_a_process_killed_anywhere_resumes_from_its_backup_bit_for_bit(tmp_path, point,
                                                                        run_to_the_end):
    # SIGKILL between steps, inside a backup's snapshot, or while evicted rows are
    # written into the files (part of them there): the live files are left mid-step;
    # the next process restores the last complete backup and ends where a run never
    # killed ends.
    from sparseopt.disk import snapshots

    _kill_job(tmp_path, point)
    assert not (tmp_path / "final.npz").exists()
    if point == "save":  # (the snapshot it was copying is not listed; the first backup's is)
        assert snapshots.listed(tmp_path / "t") == ["00000001"]
    _kill_job(tmp_path, "run")
    got = np.load(tmp_path / "final.npz")
    for name in ("rows", "accumulator"):
        np.testing.assert_array_equal(got[name], run_to_the_end[name], err_msg=name)


def test_a_load_of_a_missing_snapshot_is_an_error_naming_the_table(tmp_path):
    model, layer = _saved_model(tmp_path / "t")
    model.fit(*_data(1), batch_size=8, verbose=0)
    model.save_weights(tmp_path / "w.weights.h5")
    layer.embeddings.remove_snapshots(keep=0)
    with pytest.raises(ValueError, match="'t0/embeddings'.*snapshot .* which is missing"):
        model.load_weights(tmp_path / "w.weights.h5")


@at_default_flags
@pytest.mark.usefixtures("rules_own_path")
def test_odd_batches_train_a_table_on_disk_as_in_memory(tmp_path):
    # A last batch of another size (TF: a dynamic number of ids), a batch of padding
    # only, a batch of one id repeated, a batch of one example.
    x = np.random.default_rng(1).integers(0, ROWS, (23, 2)).astype("int32")
    x[8:12] = -1
    x[12:16] = 5
    y = np.random.default_rng(2).normal(size=(23, 1)).astype("float32")
    cases = {"Adagrad": (sparseopt.updaters.Adagrad, {}, "float32", {})}
    disk, (d,), d_heads = _model(cases, lambda i, s: OnDisk(str(tmp_path / "t"), cache_rows=8))
    memory, (m,), m_heads = _model(cases, lambda i, s: None)
    m.embeddings.assign(d.embeddings.numpy().astype(np.float32))
    _set_heads(m_heads, _heads(d_heads))
    for model in (disk, memory):
        model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
        model.fit(x[:1], y[:1], batch_size=1, shuffle=False, verbose=0)
    np.testing.assert_array_equal(d.embeddings.numpy().astype(np.float64), to_np(m.embeddings))
    np.testing.assert_array_equal(d.embeddings.numpy("accumulator").astype(np.float64),
                                  to_np(memory.optimizer.table_state(m.embeddings)[
                                      "accumulator"]))


@at_default_flags
def test_a_whole_slot_summed_in_chunks_trains_on_disk_as_in_memory(tmp_path):
    # More distinct ids in a step than a chunk of the step's rows (JAX sums a whole
    # slot's contributions chunk by chunk; TF in one pass): factored Adafactor's column
    # statistics. (Its whole slot `vc` is checked through the rows and `vr` it steers.)
    from sparseopt.backend import jax_distinct

    rows, distinct = 12_000, jax_distinct.DISTINCT_CHUNK + 500
    x = np.random.default_rng(3).permutation(rows)[:distinct].reshape(-1, 1).astype("int32")
    y = np.random.default_rng(4).normal(size=(x.shape[0], 1)).astype("float32")

    def model(storage):
        keras.utils.set_random_seed(5)
        layer = sparseopt.layers.SparseEmbedding(
            rows, WIDTH, updater=sparseopt.updaters.Adafactor(0.05), storage=storage,
            name="t")
        ids = keras.Input((1,), dtype="int32")
        out = keras.layers.Dense(1)(keras.layers.Flatten()(layer(ids)))
        m = keras.Model(ids, out)
        m.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.01)),
                  loss="mse")
        return m, layer

    disk, d = model(OnDisk(str(tmp_path / "t"), cache_rows=4096))
    memory, m = model(None)
    m.embeddings.assign(d.embeddings.numpy())
    for each in (disk, memory):
        each.fit(x, y, batch_size=x.shape[0], epochs=2, shuffle=False, verbose=0)
    np.testing.assert_array_equal(d.embeddings.numpy(), to_np(m.embeddings))
    state = memory.optimizer.table_state(m.embeddings)
    np.testing.assert_array_equal(d.embeddings.numpy("vr"), to_np(state["vr"]))


def test_a_full_disk_stops_training_naming_the_table_until_a_load(tmp_path, monkeypatch,
                                                                 caplog):
    # The step's write into the cache runs beside the step: its failure (no room for
    # rows never written) stops `fit` at the table's next read, naming the table; the
    # table then refuses to go on without that step's rows, until a load replaces them.
    import errno

    from sparseopt.disk.row_files import RowFiles

    model, layer = _saved_model(tmp_path / "t")
    x, y = _data(1)
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    model.save_weights(tmp_path / "w.weights.h5")
    saved = layer.embeddings.numpy().copy()

    def no_room(files, ids):  # (this table's 40 rows share a page, reserved already)
        raise OSError(errno.ENOSPC, f"{files.owner}: no room on disk for its rows")
    with monkeypatch.context() as patched, caplog.at_level(logging.ERROR):
        patched.setattr(RowFiles, "reserve", no_room)
        with pytest.raises(Exception) as raised:
            model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    # TF raises the host call's error; JAX logs it and raises its own (the step's
    # donated arrays are gone: a JAX model is loaded again after any failed step).
    said = str(raised.value) + caplog.text
    assert re.search("t0/embeddings.*no room on disk", said), said[-2000:]
    if keras.backend.backend() == "tensorflow":
        with pytest.raises(Exception, match="t0/embeddings.*lacks that step's rows"):
            model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    with pytest.raises(RuntimeError, match="t0/embeddings.*lacks that step's rows"):
        layer.embeddings.snapshot()  # (a save would hold a table without the step)
    if keras.backend.backend() == "jax":  # (a model again, its table on the same folder)
        layer.embeddings.close()
        model, layer = _saved_model(tmp_path / "t")
    model.load_weights(tmp_path / "w.weights.h5")
    np.testing.assert_array_equal(layer.embeddings.numpy(), saved)
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)


def test_a_save_that_dies_midway_leaves_the_last_snapshot_whole(tmp_path, monkeypatch):
    from sparseopt.disk import snapshots

    model, layer = _saved_model(tmp_path / "t")
    x, y = _data(1)
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    model.save_weights(tmp_path / "first.weights.h5")
    first = layer.embeddings.numpy().copy()
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    copy = snapshots.copy_sparse
    copied = []

    def dies(src, dst, *args, **kwargs):  # (the process dies after the first file)
        if copied:
            raise KeyboardInterrupt("killed")
        copied.append(src)
        return copy(src, dst, *args, **kwargs)

    monkeypatch.setattr(snapshots, "copy_sparse", dies)
    with pytest.raises(KeyboardInterrupt):
        model.save_weights(tmp_path / "second.weights.h5")
    monkeypatch.setattr(snapshots, "copy_sparse", copy)
    assert len(layer.embeddings.snapshots()) == 1  # (the partial copy is no snapshot)
    model.load_weights(tmp_path / "first.weights.h5")
    np.testing.assert_array_equal(layer.embeddings.numpy(), first)
    model.save_weights(tmp_path / "third.weights.h5")  # (and clears the partial copy)
    assert len(layer.embeddings.snapshots()) == 2
    assert not list((tmp_path / "t" / "snapshots").glob(".partial-*"))


def test_a_load_checks_the_snapshot_before_it_touches_the_table(tmp_path):
    model, layer = _saved_model(tmp_path / "t")
    x, y = _data(1)
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    model.save_weights(tmp_path / "w.weights.h5")
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    live = layer.embeddings.numpy().copy()
    (snapshot,) = layer.embeddings.snapshots()
    damaged = tmp_path / "t" / "snapshots" / snapshot / "rows.bin"
    with open(damaged, "r+b") as f:
        f.truncate(100)
    with pytest.raises(ValueError, match=f"'t0/embeddings'.*snapshot '{snapshot}'.*damaged"):
        model.load_weights(tmp_path / "w.weights.h5")
    np.testing.assert_array_equal(layer.embeddings.numpy(), live)  # (untouched)
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)  # (and still trains)


def test_a_file_of_the_other_kind_of_table_is_refused(tmp_path):
    on_disk, _ = _saved_model(tmp_path / "t")
    in_memory, _, _ = _model({"Adagrad": (sparseopt.updaters.Adagrad, {}, "float32", {})},
                             lambda i, s: None)
    in_memory.save_weights(tmp_path / "memory.weights.h5")
    with pytest.raises(ValueError, match="'t0/embeddings' is on disk .* holds no snapshot"):
        on_disk.load_weights(tmp_path / "memory.weights.h5")
    on_disk.save_weights(tmp_path / "disk.weights.h5")
    with pytest.raises(ValueError, match="'t0': the file's table has shape"):
        in_memory.load_weights(tmp_path / "disk.weights.h5")


_OUTSIDE_FIT_CHILD = """
import sys, numpy as np, keras, sparseopt
sys.path.insert(0, sys.argv[2])
from tests.test_disk_tables import _saved_model, _data
model, layer = _saved_model(sys.argv[1])
x, y = _data(1)
model.train_on_batch(x[:8], y[:8])  # (no end of fit to write the cache to the files)
np.save(sys.argv[1] + ".npy", layer.embeddings.numpy())
"""


def test_training_outside_fit_reaches_the_files_when_python_exits(tmp_path):
    proc = subprocess.run([sys.executable, "-c", _OUTSIDE_FIT_CHILD, str(tmp_path / "t"), ROOT],
                          cwd=ROOT, env=child_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _, layer = _saved_model(tmp_path / "t")
    trained = np.load(str(tmp_path / "t") + ".npy")
    assert layer.embeddings.files.is_written(np.arange(ROWS)).any()
    np.testing.assert_array_equal(layer.embeddings.numpy(), trained)


def test_snapshots_are_numbered_and_a_crash_before_the_rename_lists_none(tmp_path,
                                                                         monkeypatch):
    from sparseopt.disk import snapshots

    model, layer = _saved_model(tmp_path / "t")
    for _ in range(2):
        model.save_weights(tmp_path / "w.weights.h5")
    assert layer.embeddings.snapshots() == ["00000001", "00000002"]
    real = snapshots.os.replace

    def dies(src, dst):  # (the copy is complete, the rename never happens)
        if ".partial-" in str(src):
            raise KeyboardInterrupt("killed")
        real(src, dst)

    monkeypatch.setattr(snapshots.os, "replace", dies)
    with pytest.raises(KeyboardInterrupt):
        model.save_weights(tmp_path / "w2.weights.h5")
    monkeypatch.setattr(snapshots.os, "replace", real)
    assert layer.embeddings.snapshots() == ["00000001", "00000002"]
    assert layer.embeddings.remove_snapshots(keep=1) == ["00000001"]
    model.save_weights(tmp_path / "w3.weights.h5")
    # (The crashed save's number is spent; a removed one is never given again, so a
    # file naming it fails to load instead of loading another.)
    assert layer.embeddings.snapshots() == ["00000002", "00000004"]
    layer.embeddings.remove_snapshots(keep=0)
    model.save_weights(tmp_path / "w4.weights.h5")
    assert layer.embeddings.snapshots() == ["00000005"]
