"""Tables on disk split by rows over devices (`sparseopt.distribution.row_sharded`), against
the same tables on disk whole, under the same batch split (tests/test_disk_sharded.py).

Usage: python -m tests.jobs.disk_sharded_job FOLDER   (with 4 JAX devices)

Trains `test_disk_tables`' model with tables of 42 rows on disk (row-wise Adagrad, Adam,
options that work on every row, Lookahead, an int8 table) under `row_sharded` (each table
kept as 4 shards of 10, 11, 10 and 11 rows, each with its own folder, files and cache) and
under `DataParallel` (the tables whole; the same batch split over the same devices). Checks:

- the shards read the rows the whole tables read before training (rows never written
  drawn as the whole table's, wherever a shard starts);
- after two epochs (caches of 8 rows over 4 shards: rows evicted and read back all
  along), every row, every per-row slot and every dense weight is the whole tables',
  bit for bit: the compiled steps are the same, and the host calls route ids only;
- each shard's folder holds its own files; the cache counts add up over the shards;
- a save (`save_weights`) snapshots every shard; trained further, a load brings every
  shard back; a file of the split tables refuses to load into the whole ones;
- `BackupAndRestore` backs every shard up and removes every shard's snapshots with its
  backups; `TableHealth` reports the split tables' times summed over their shards;
- open vocabularies on disk split by rows (their maps split with them) train as whole,
  and exported serve on one device what they predict.

Prints "shards 4, equal" where all holds (an AssertionError otherwise).
"""

import os
import sys

import jax
import keras
import numpy as np

import sparseopt
from sparseopt.storage import OnDisk
from tests.test_disk_tables import SUPPORTED as VOCABULARY_CASES
from tests.test_disk_tables import WRAPPER_CASES, _data, _heads, _model, _set_heads
from tests.test_disk_vocabulary import CAPACITY
from tests.test_disk_vocabulary import _data as vocabulary_data
from tests.test_disk_vocabulary import _model as vocabulary_model

CASES = {"RowwiseAdagrad": (sparseopt.updaters.RowwiseAdagrad, {}, "float32", {}),
         "Adam": (sparseopt.updaters.Adam, {}, "float32", {}),
         # Work on every row (each step's decay of untouched rows, fit's end's average),
         # in parts that may lie on two shards; Lookahead's sync of the rows its window
         # changed; an int8 table's codes and scales.
         **{name: WRAPPER_CASES[name] for name in (
             "SGD:dense_momentum_decay", "RowwiseAdagrad:ema", "RowwiseAdagrad:lookahead",
             "Adagrad:int8_dense_decay")}}
ROWS = 42


def layer_of(i, updater, storage, dtype):
    return sparseopt.layers.SparseEmbedding(ROWS, 3, updater=updater, storage=storage,
                                            dtype=dtype, name=f"t{i}")


def build(folder, name, distribution, **settings):
    with distribution.scope():
        return _model(CASES, lambda i, s: OnDisk(os.path.join(folder, f"{name}{i}"),
                                                 cache_rows=8, **settings), layer_of)


def state(layers, heads):
    return ([(layer.embeddings.numpy().copy(),
              {n: layer.embeddings.numpy(n).copy() for n in layer.embeddings.columns})
             for layer in layers], _heads(heads))


def assert_same(got, want):
    for (rows, slots), (rows_want, slots_want) in zip(got[0], want[0]):
        np.testing.assert_array_equal(rows, rows_want)
        for name in slots_want:
            np.testing.assert_array_equal(slots[name], slots_want[name], err_msg=name)
    for head, head_want in zip(got[1], want[1]):
        for w, w_want in zip(head, head_want):
            np.testing.assert_array_equal(w, w_want)


def split_vocabularies(folder, sharded, whole_distribution):
    """Open vocabularies on disk (`test_disk_vocabulary`'s model: ids of 40 values for
    24-row maps; a float32 table whose ids not held read zeros, an int8 one whose read a
    trained default row, the table's last, on its last shard) split by rows over the 4
    devices, against the same ones on disk whole: the map split with the rows (6 entries
    on each device), its hand-over, totals and held ids, every row and per-row slot, the
    heads and `delta` end bit for bit; exported, it serves on one device what it predicts;
    a save and a load; sizes the split does not divide are refused. (How each updater's rows and state train on disk is
    `test_disk_vocabulary`'s; the shards route rows whatever the updater.)"""
    chosen = ("RowwiseAdagrad:default", "RowwiseAdagrad:int8")
    # (In the registry's order: int8 tables last, as `test_disk_vocabulary` trains them.)
    cases = {name: case for name, case in VOCABULARY_CASES.items() if name in chosen}
    assert sorted(cases) == sorted(chosen), cases
    runs = []
    for name, distribution in (("vs", sharded), ("vw", whole_distribution)):
        with distribution.scope():
            runs.append(vocabulary_model(cases, lambda i, s: OnDisk(
                os.path.join(folder, f"{name}{i}"), cache_rows=8, **s)))
    (split, split_layers, split_heads), (whole, whole_layers, whole_heads) = runs
    for layer in split_layers:
        assert len(layer.embeddings.parts()) == 4, layer.embeddings
        keys = layer.vocabulary.keys
        assert len(keys.value.sharding.device_set) == 4
        assert keys.value.addressable_shards[0].data.shape == (CAPACITY // 4, 2)
    _set_heads(split_heads, _heads(whole_heads))
    start = state(whole_layers, whole_heads)
    assert_same(state(split_layers, split_heads), start)
    x, y = vocabulary_data(len(cases))
    with sharded.scope():
        split.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    with whole_distribution.scope():
        whole.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert_same(state(split_layers, split_heads), state(whole_layers, whole_heads))
    # (The int8 table's ids not held read its trained default row, on its last shard:
    # it trained, its codes or scale changed.)
    default = split_layers[1].embeddings
    assert any(not np.array_equal(default.numpy(c, [CAPACITY]), before[CAPACITY:])
               for c, before in (("rows", start[0][1][0]), ("scale", start[0][1][1]["scale"]))
               ), "the default row did not train"
    for name, s, w in zip(cases, split_layers, whole_layers):
        assert s.held_ids() == w.held_ids() and len(s.held_ids()) > 0, name
        for got, want in zip(s.vocabulary.variables, w.vocabulary.variables):
            np.testing.assert_array_equal(np.asarray(got.value), np.asarray(want.value),
                                          err_msg=f"{name}: {want.path}")
        assert s.vocabulary_stats() == w.vocabulary_stats(), name
        assert s.vocabulary_stats()["evicted"] > 0, name  # (ids lost their rows)
        assert s.disk_stats()["misses"] > 0, name
        for since in (0, 3):  # (what a serving copy reads: the map's ids, their rows)
            got, want = s.delta(since), w.delta(since)
            for field, value in zip(want._fields, want):
                np.testing.assert_array_equal(getattr(got, field), value,
                                              err_msg=f"{name}: delta {field}")
    # Exported, it serves on one device what the split model predicts (the map's
    # hand-over written before the export: the served function only reads the map).
    want = np.asarray(split.predict(x[:16], batch_size=16, verbose=0))
    # (Keras exports through TensorFlow, which the JAX children's start-up hides:
    # tests/jax_children/sitecustomize.py. Imported here, for this export only.)
    sys.modules.pop("tensorflow", None)
    with sharded.scope():
        split.export(os.path.join(folder, "served"), verbose=False)
    import tensorflow as tf  # (the SavedModel, served by TensorFlow itself)

    served = tf.saved_model.load(os.path.join(folder, "served"))
    # (TensorFlow's XLA compiles the served program: to its rounding.)
    np.testing.assert_allclose(served.serve(tf.constant(x[:16])).numpy(), want, rtol=1e-5,
                               atol=1e-6)
    assert not np.allclose(want, want[0])  # (held ids and the default row differ)
    # A save holds every shard's snapshot and the split map; trained further, a load
    # brings both back.
    weights = os.path.join(folder, "vocabularies.weights.h5")
    trained = state(split_layers, split_heads)
    maps = [[np.asarray(v.value).copy() for v in s.vocabulary.variables]
            for s in split_layers]
    with sharded.scope():
        split.save_weights(weights)
        split.fit(x, y, batch_size=16, shuffle=False, verbose=0)
        assert split_layers[0].vocabulary_stats() != whole_layers[0].vocabulary_stats()
        split.load_weights(weights)
    assert_same(state(split_layers, split_heads), trained)
    for s, saved in zip(split_layers, maps):
        for got, want in zip(s.vocabulary.variables, saved):
            np.testing.assert_array_equal(np.asarray(got.value), want, err_msg=got.path)
    # The map's split must divide its capacity, and its sightings map's: refused
    # otherwise, naming the layer and the fix, before any file is opened.
    for size, fix in ((dict(capacity=CAPACITY + 2), f"capacity={CAPACITY + 4}"),
                      (dict(capacity=CAPACITY, admit_after=2, count_capacity=10),
                       "count_capacity=12")):
        odd_folder = os.path.join(folder, "odd")
        with sharded.scope():
            odd = sparseopt.layers.DynamicEmbedding(
                output_dim=3, updater=sparseopt.updaters.SGD(0.1), name="odd",
                storage=OnDisk(odd_folder, cache_rows=8), **size)
            try:
                odd(keras.ops.zeros((2, 2), "int32"))
            except ValueError as error:
                assert "'odd'" in str(error) and fix in str(error), error
            else:
                raise AssertionError(f"a map split unevenly was built: {size}")
        assert not os.path.exists(odd_folder), os.listdir(odd_folder)


def main():
    folder = sys.argv[1]
    devices = jax.devices()
    assert len(devices) == 4, devices
    sharded = sparseopt.distribution.row_sharded(tables=[r".*/embeddings"])
    whole_distribution = keras.distribution.DataParallel(devices=devices)
    # (The split tables fetch each step's rows ahead, by shard: the cache is transparent.)
    split, split_layers, split_heads = build(folder, "s", sharded, fetch_ahead=True)
    whole, whole_layers, whole_heads = build(folder, "w", whole_distribution)
    for layer in split_layers:
        table = layer.embeddings
        assert len(table.parts()) == 4, table
        assert sorted(os.listdir(table.settings.path)) == sorted(
            [".lock", "shards.json", *(f"shard-{k}-of-4" for k in range(4))])
        assert [p.shape[0] for p in table.parts()] == [10, 11, 10, 11]
    for w in whole_layers:
        assert len(w.embeddings.parts()) == 1
    _set_heads(split_heads, _heads(whole_heads))
    start = state(whole_layers, whole_heads)
    assert_same(state(split_layers, split_heads), start)  # (drawn where a shard starts)

    x, y = _data(len(CASES), rows=64)
    with sharded.scope():
        split.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    with whole_distribution.scope():
        whole.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    trained = state(whole_layers, whole_heads)
    assert not np.array_equal(trained[0][0][0], start[0][0][0])  # (it trained)
    assert_same(state(split_layers, split_heads), trained)
    for s, w in zip(split_layers, whole_layers):
        got, want = s.disk_stats(), w.disk_stats()
        per_shard = [p.health() for p in s.embeddings.parts()]
        assert got["misses"] == sum(p["misses"] for p in per_shard) > 0
        # (Each step's rows looked up once, and again where a fetch ahead was evicted.)
        assert got["hits"] + got["misses"] >= want["hits"] + want["misses"]
        assert got["host_ms"] > 0 and got["beside_ms"] > 0
        assert got["steps_fetched_ahead"] > 0 and want["steps_fetched_ahead"] == 0
        np.testing.assert_array_equal(s.embeddings.rows_read(), w.embeddings.rows_read())

    # A save snapshots every shard; a load brings every shard back.
    weights = os.path.join(folder, "split.weights.h5")
    with sharded.scope():
        split.save_weights(weights)
        saved = [layer.embeddings.snapshots() for layer in split_layers]
        for layer, names in zip(split_layers, saved):
            assert len(names) == 1 and all(
                p.snapshots() == names for p in layer.embeddings.parts())
        split.fit(x, y, batch_size=16, shuffle=False, verbose=0)
        assert not np.array_equal(split_layers[0].embeddings.numpy(), trained[0][0][0])
        split.load_weights(weights)
    assert_same(state(split_layers, split_heads), trained)
    try:
        whole.load_weights(weights)
    except ValueError as error:
        assert "split into 4 shard(s)" in str(error), error
    else:
        raise AssertionError("a file of the split tables loaded into the whole ones")
    # BackupAndRestore backs every shard up, and removes every shard's snapshots with
    # its backups.
    backups = os.path.join(folder, "backups")
    # TableHealth reports the split tables' caches and times, summed over their shards.
    before = [layer.disk_stats() for layer in split_layers]
    with sharded.scope():
        history = split.fit(
            x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
            callbacks=[sparseopt.callbacks.BackupAndRestore(backups),
                       sparseopt.callbacks.TableHealth(warn=False)]).history
    for layer, names in zip(split_layers, saved):
        assert layer.embeddings.snapshots() == names, layer.embeddings.snapshots()
        assert all(p.snapshots() == names for p in layer.embeddings.parts())
    after = [layer.disk_stats() for layer in split_layers]
    steps = 2 * (x.shape[0] // 16)
    for key in ("host_ms", "beside_ms"):  # (fit's end reads rows too: not the epochs')
        total = sum(a[key] - b[key] for a, b in zip(after, before))
        per_step = history[f"disk_{key}_per_step"]
        assert abs(sum(per_step) * steps / 2 - total) <= 1e-6 * total and total > 0, key

    split_vocabularies(folder, sharded, whole_distribution)
    print("shards 4, equal")


if __name__ == "__main__":
    main()
