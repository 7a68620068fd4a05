"""Open vocabularies on disk: `DynamicEmbedding(..., storage=OnDisk(...))`, trained by `fit`.

The reference is the same model with the open vocabulary in memory (the
in-memory kind, started from the same rows and heads): the map (which ids
hold which rows, its totals), every row as the lookup reads it, each row's
per-row state and the whole state must end bit for bit where the in-memory
run's end, for every registered updater configuration a table on disk
supports (the registry drives the cases; `make test` trains the fewest that
cover every way a row's fresh start is written), 16-bit and int8 rows too. Each
table has 24 rows for ids drawn from 40 values (ids lose their rows to
others) and a cache of 8 rows (rows leave the cache and are read back from
the files): an id whose row left the cache keeps it in the map.
"""


import keras
import numpy as np
import pytest

import sparseopt
from sparseopt.storage import OnDisk
from tests.conftest import to_np
from tests.helpers import THOROUGH, optimizer_state
from tests.test_disk_tables import (STORAGE_KEYS, SUPPORTED, at_default_flags,  # noqa: F401
                                    parts_of_16_rows, rules_own_path)
from tests.test_disk_tables import _model as disk_tables_model
from tests.test_disk_tables import assert_state_as_in_memory

CAPACITY, WIDTH, IDS = 24, 3, 40


def _start_features(case):
    """What writing a row's fresh start depends on for a case: the table's dtype, and each
    per-row slot's kind, dtype, whether it starts at a nonzero value or at the step; no
    per-row slot at all. (How each rule then updates rows on disk, its rounding and whole
    slots included, is test_disk_tables' registry test.)"""
    entry, cfg, dtype, settings = case
    settings = {**{k: v for k, v in cfg.items() if k in STORAGE_KEYS}, **settings}
    state = settings.get("state_dtype", "float32")
    updater = entry(0.05, **{k: v for k, v in cfg.items() if k not in STORAGE_KEYS})
    found = {("table", dtype)}
    found |= {("slot", s.kind, s.dtype_for(state), s.initial_value != 0, s.holds_step)
              for s in updater.slots if s.per_row}
    return found if any(s.per_row for s in updater.slots) else found | {("no slot",)}


def _covering(cases):
    """The fewest cases (greedily, in the registry's order) whose `_start_features`
    cover every case's: `make test` trains those, `make test-all` every case (how each
    rule updates rows on disk is test_disk_tables' registry test)."""
    left = set().union(*(_start_features(c) for c in cases.values()))
    chosen = set()
    while left:
        name = max(cases, key=lambda n: len(_start_features(cases[n]) & left))
        chosen.add(name)
        left -= _start_features(cases[name])
    # (In the registry's order: a table's position keys its rounding bits, and int8
    # tables come last there, as in memory: docs/disk.md, "Exactness".)
    return {name: case for name, case in cases.items() if name in chosen}


def _with_lookahead(cases):
    """`cases` and Lookahead's (a row given to a new id while its window lists it: synced
    from its fresh start, which changes nothing), float tables before int8 ones."""
    chosen = {**cases, "RowwiseAdagrad:lookahead": SUPPORTED["RowwiseAdagrad:lookahead"]}
    return {name: case for name, case in SUPPORTED.items() if name in chosen}


CASES = SUPPORTED if THOROUGH else _with_lookahead(_covering(SUPPORTED))


def _open_vocabulary(i, updater, storage, dtype):
    """Table `i` of `_model`: an open vocabulary; every other one's ids not held read a
    trained default row."""
    return sparseopt.layers.DynamicEmbedding(
        CAPACITY, WIDTH, updater=updater, storage=storage, dtype=dtype,
        embeddings_initializer=keras.initializers.RandomUniform(-0.1, 0.1, seed=i),
        default_row="trained" if i % 2 else "zeros", tombstone_log=4096, name=f"v{i}")


def _model(cases, storage_of):
    """test_disk_tables' model (a table and a head per case), of open vocabularies."""
    return disk_tables_model(cases, storage_of, _open_vocabulary)


def _data(tables, rows=64, seed=11):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, IDS, (rows, 2 * tables)).astype("int32")
    y = rng.normal(size=(rows, 1)).astype("float32")
    return x, np.repeat(y, tables, axis=1)


def _same_start(disk_layers, memory_layers, disk_heads, memory_heads):
    """The in-memory tables start from the rows the tables on disk read (rows never
    written are drawn per row from the initializer there), and the heads alike."""
    for d, m in zip(disk_layers, memory_layers):
        if d.embeddings.int8:
            m.embeddings.assign(d.embeddings.numpy())
            m.embeddings_scale.assign(d.embeddings.numpy("scale"))
        else:
            m.embeddings.assign(d.embeddings.numpy().astype(np.float32))
    for d, m in zip(disk_heads, memory_heads):
        m.set_weights(d.get_weights())


def _held_only(layers, x):
    """`x` with each table's ids replaced by ids its map holds (no admission, no
    eviction): a step that trains held rows and makes no new ones."""
    x = x.copy()
    for i, layer in enumerate(layers):
        held = np.array(sorted(layer.held_ids()), np.int32)
        x[:, 2 * i:2 * i + 2] = held[np.arange(x.shape[0] * 2).reshape(-1, 2) % held.size]
    return x


@at_default_flags
@pytest.mark.usefixtures("rules_own_path")
def test_open_vocabularies_on_disk_train_every_updater_as_in_memory_bit_for_bit(
        tmp_path, parts_of_16_rows):
    disk, disk_layers, disk_heads = _model(
        CASES, lambda i, s: OnDisk(str(tmp_path / f"v{i}"), cache_rows=8, **s))
    memory, memory_layers, memory_heads = _model(
        CASES, lambda i, s: sparseopt.TableStorage(**s))
    _same_start(disk_layers, memory_layers, disk_heads, memory_heads)
    x, y = _data(len(CASES))
    disk.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    memory.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    # One more step on ids held by both maps: an int8 table in memory writes the rows
    # the last step gave to new ids in its next call, in that call's program (one on
    # disk writes them in the step that gave them); a training call writes them as
    # every earlier step's were, and gives no row to a new id itself.
    held = _held_only(disk_layers, x[:8])
    assert np.array_equal(held, _held_only(memory_layers, x[:8]))
    disk.fit(held, y[:8], batch_size=8, shuffle=False, verbose=0)
    memory.fit(held, y[:8], batch_size=8, shuffle=False, verbose=0)

    _assert_as_in_memory(CASES, (disk, disk_layers, disk_heads),
                         (memory, memory_layers, memory_heads))
    assert {16, CAPACITY % 16} <= set(parts_of_16_rows)  # (an average's end of fit, in parts)


def _assert_as_in_memory(cases, disk, memory):
    """The heads, each map and its totals, every row, what a serving copy takes, and the
    optimizer state (per-row columns and whole variables) of `disk` (a `_model`'s
    `(model, layers, heads)`) are `memory`'s, bit for bit."""
    (disk, disk_layers, disk_heads), (memory, memory_layers, memory_heads) = disk, memory
    for got, want in zip(disk_heads, memory_heads):
        np.testing.assert_array_equal(got.get_weights()[0], want.get_weights()[0])
    memory_state = {v.path.split("/")[-1]: v for v in optimizer_state(memory.optimizer)}
    disk_state = {v.path.split("/")[-1]: v for v in optimizer_state(disk.optimizer)}
    for name, d, m in zip(cases, disk_layers, memory_layers):
        # The map: the same ids in the same rows, the same totals.
        assert d.held_ids() == m.held_ids(), name
        stats = d.vocabulary_stats()
        assert stats == m.vocabulary_stats(), name
        assert stats["evicted"] > 0, (name, stats)  # (ids lost their rows to others)
        # The cache: rows left it and were read back, their ids still in the map.
        cache = d.disk_stats()
        assert cache["misses"] > 0 and cache["rows_written"] > 0, (name, cache)
        # Every row, as stored (an int8 table's codes and scales).
        np.testing.assert_array_equal(d.embeddings.numpy().astype(np.float64),
                                      to_np(m.embeddings), err_msg=name)
        if d.embeddings.int8:
            np.testing.assert_array_equal(d.embeddings.numpy("scale"),
                                          to_np(m.embeddings_scale), err_msg=name)
        # What a serving copy takes: the same ids, rows and values.
        got, want = d.delta(0), m.delta(0)
        for field in ("ids", "rows", "values", "tombstones", "default"):
            np.testing.assert_array_equal(getattr(got, field), getattr(want, field),
                                          err_msg=f"{name}: {field}")
        assert assert_state_as_in_memory(name, d, m, disk_state, memory_state) >= 1


@at_default_flags
@pytest.mark.usefixtures("rules_own_path")
def test_an_open_vocabulary_on_disk_with_gradient_accumulation_trains_as_in_memory(tmp_path):
    # Each micro-batch gives rows to new ids (started through the host write at once),
    # while the rows' gradients wait for the update.
    cases = {"RowwiseAdagrad": (sparseopt.updaters.RowwiseAdagrad, {}, "float32", {}),
             "SGD:lazy_false": (sparseopt.updaters.SGD,
                                 {"momentum": 0.9, "weight_decay": 0.1, "lazy": False},
                                 "float32", {})}
    runs = []
    for storage_of in (lambda i, s: OnDisk(str(tmp_path / f"v{i}"), cache_rows=8, **s),
                       lambda i, s: sparseopt.TableStorage(**s)):
        model, layers, heads = _model(cases, storage_of)
        model.compile(optimizer=sparseopt.DispatchOptimizer(
            keras.optimizers.Adam(0.01), gradient_accumulation_steps=2), loss="mse")
        runs.append((model, layers, heads))
    _same_start(runs[0][1], runs[1][1], runs[0][2], runs[1][2])
    x, y = _data(len(cases))
    for model, _, _ in runs:
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    _assert_as_in_memory(cases, *runs)


def _one(folder, on_disk=True, **kwargs):
    keras.utils.set_random_seed(0)
    ids = keras.Input((2,), dtype="int32")
    layer = sparseopt.layers.DynamicEmbedding(
        CAPACITY, WIDTH, updater=sparseopt.updaters.Adam(0.05), name="v",
        storage=OnDisk(str(folder), cache_rows=8) if on_disk else None, tombstone_log=4096,
        **kwargs)
    model = keras.Model(ids, keras.layers.Dense(1, name="head")(
        keras.layers.Flatten()(layer(ids))))
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.Adam(0.01)),
                  loss="mse")
    return model, layer


def _everything(layer):
    """The table's rows and per-row state as stored, and the map."""
    table = layer.embeddings
    return ({c: table.numpy(c).copy() for c in table.columns},
            [to_np(v).copy() for v in layer.vocabulary.variables])


def _assert_same(got, want):
    for name in want[0]:
        np.testing.assert_array_equal(got[0][name], want[0][name], err_msg=name)
    for i, (g, w) in enumerate(zip(got[1], want[1])):
        np.testing.assert_array_equal(g, w, err_msg=f"map variable {i}")


def test_a_save_holds_the_snapshot_and_the_map_of_one_moment(tmp_path):
    x, y = _data(1, rows=48)
    model, layer = _one(tmp_path / "v")
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    model.save(tmp_path / "m.keras")
    saved = _everything(layer)
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    after = _everything(layer)
    assert not np.array_equal(after[1][0], saved[1][0])  # (the map moved on too)
    layer.embeddings.close()
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    table = loaded.get_layer("v")
    assert table.on_disk and table.embeddings.numpy().shape == (CAPACITY, WIDTH)
    _assert_same(_everything(table), saved)
    # Resumed from the save, the next epoch ends where the first run's did.
    loaded.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    _assert_same(_everything(table), after)


def test_a_file_of_an_open_vocabulary_in_memory_is_refused_on_disk(tmp_path):
    x, y = _data(1, rows=16)
    keras.utils.set_random_seed(0)
    ids = keras.Input((2,), dtype="int32")
    layer = sparseopt.layers.DynamicEmbedding(CAPACITY, WIDTH, sparseopt.updaters.Adam(0.05),
                                              name="v", tombstone_log=4096)
    memory = keras.Model(ids, keras.layers.Dense(1, name="head")(
        keras.layers.Flatten()(layer(ids))))
    memory.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.Adam()), loss="mse")
    memory.fit(x, y, verbose=0)
    memory.save_weights(tmp_path / "memory.weights.h5")
    model, layer = _one(tmp_path / "v")
    model.fit(x, y, verbose=0)
    before = _everything(layer)
    with pytest.raises(ValueError, match="'v'.*no snapshot of a table on disk"):
        model.load_weights(tmp_path / "memory.weights.h5")
    _assert_same(_everything(layer), before)  # (nothing of it was loaded)


@pytest.mark.parametrize("on_disk", [True, False])
def test_an_open_vocabulary_is_exported_with_its_rows(tmp_path, on_disk):
    # (In memory too. The map's hand-over is written before the export traces the model:
    # the served function only reads the map, DynamicEmbedding.variables.)
    x, y = _data(1, rows=48)
    model, layer = _one(tmp_path / "v", default_row="trained", on_disk=on_disk)
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    want = model.predict(x[:16], verbose=0)
    model.export(str(tmp_path / "served"), verbose=False)
    import tensorflow as tf  # (the SavedModel, served by TensorFlow itself)
    served = tf.saved_model.load(str(tmp_path / "served"))
    got = served.serve(tf.constant(x[:16])).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert not np.allclose(want, want[0])  # (held ids and the default row differ)


@pytest.mark.jax_session  # (a keras.distribution is JAX's; TF's strategies: test_disk_tables)
def test_an_open_vocabulary_on_disk_split_over_one_device_is_whole(tmp_path):
    # (Data parallel, it trains: test_disk_tables' data-parallel child trains one. Split
    # over several devices, as shards with its map split: tests/jobs/disk_sharded_job.py.)
    with sparseopt.distribution.row_sharded(tables=[r".*/embeddings"]).scope():
        _, layer = _one(tmp_path / "v")
    assert layer.embeddings.parts() == [layer.embeddings]
