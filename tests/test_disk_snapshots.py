"""Incremental snapshots of tables on disk (`sparseopt.disk.snapshots`).

What must hold, through `fit` and `save_weights` / `load_weights` as users
save and load:

- a save after a save (or a load) in the same process holds only the pages
  of the files written between (an incremental snapshot, building on the
  one before); a load of it brings back the table and its per-row state bit
  for bit as they were at that save, whatever was trained after (compared
  with the values read from the table at the save, not with the files);
- a chain stops growing where its pages would outweigh its first, whole
  snapshot: the next one is whole;
- removing snapshots never breaks one kept: what a kept one builds on stays
  on disk (unlisted, not loadable) until nothing kept builds on it;
- a save that dies midway leaves no snapshot, and the next save still holds
  every page written since the last complete one;
- a load whose chain lacks a snapshot is an error naming the table and that
  snapshot, and leaves the table as it was.
"""

import json

import keras
import numpy as np
import pytest

import sparseopt
from sparseopt.disk import snapshots
from sparseopt.storage import OnDisk

# Snapshots are the host's files, whatever the backend trained them: once, in the JAX
# session (to balance the sessions' times; saves and loads through `fit` on both backends:
# test_disk_tables.py).
pytestmark = pytest.mark.jax_session

# 4,096 rows of 16 float32 (64 rows a 4 KiB page of the rows' file), row-wise Adagrad.
ROWS, WIDTH = 4096, 16


def _model(folder, updater=None, dtype=None):
    keras.utils.set_random_seed(5)
    ids = keras.Input((2,), dtype="int32")
    layer = sparseopt.layers.SparseEmbedding(
        ROWS, WIDTH, updater or sparseopt.updaters.RowwiseAdagrad(0.1), name="t", dtype=dtype,
        storage=OnDisk(str(folder), cache_rows=64),
        embeddings_initializer=keras.initializers.RandomUniform(-0.1, 0.1, seed=1))
    out = keras.layers.Dense(1)(keras.layers.Flatten()(layer(ids)))
    model = keras.Model(ids, out)
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.Adam(0.01)),
                  loss="mse")
    return model, layer


def _fit(model, low, high, seed, steps=6):
    """Trains `steps` steps of 16 examples on ids in `[low, high)`."""
    rng = np.random.default_rng(seed)
    x = rng.integers(low, high, (16 * steps, 2)).astype("int32")
    y = rng.normal(size=(16 * steps, 1)).astype("float32")
    model.fit(x, y, batch_size=16, shuffle=False, verbose=0)


def _values(layer):
    """Every column of the table (rows and per-row state) as it reads now."""
    return {name: layer.embeddings.numpy(name).copy() for name in layer.embeddings.columns}


def _record(folder, name):
    return json.loads((folder / "snapshots" / name / "complete.json").read_text())


def _moved_on_then_loaded(model, layer, weights, want, seed):
    """Trains on (the table moves on), then loads `weights`: the table reads `want` again."""
    _fit(model, 0, ROWS, seed=seed)
    model.load_weights(weights)
    _assert_equal(_values(layer), want)


def _assert_equal(got, want):
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_a_save_after_a_save_holds_the_pages_written_between_and_loads_bit_for_bit(tmp_path):
    folder = tmp_path / "t"
    model, layer = _model(folder)
    _fit(model, 0, ROWS, seed=0, steps=40)  # (rows all over the table)
    model.save_weights(tmp_path / "a.weights.h5")
    at_a = _values(layer)
    _fit(model, 0, 128, seed=1)  # rows 0-127 only: pages 0 and 1 of the rows' file
    model.save_weights(tmp_path / "b.weights.h5")
    at_b = _values(layer)
    a, b = layer.embeddings.snapshots()
    whole, delta = _record(folder, a), _record(folder, b)
    assert whole["base"] is None and delta["base"] == a
    assert "rows.bin" in delta["deltas"]
    # (Named apart: nothing that takes the folder for whole files loads it as one.)
    held = folder / "snapshots" / b
    assert (held / "rows.bin.delta").exists() and not (held / "rows.bin").exists()
    pages = np.fromfile(folder / "snapshots" / b / "rows.bin.pages", "<i8")
    assert set(pages.tolist()) <= {0, 1}, pages
    assert delta["bytes"] * 4 < whole["bytes"], (delta["bytes"], whole["bytes"])

    _fit(model, 0, ROWS, seed=2)  # (the table moves on)
    model.load_weights(tmp_path / "b.weights.h5")
    _assert_equal(_values(layer), at_b)
    model.load_weights(tmp_path / "a.weights.h5")
    _assert_equal(_values(layer), at_a)
    # A save after a load builds on what was loaded.
    _fit(model, 256, 320, seed=3)
    model.save_weights(tmp_path / "c.weights.h5")
    at_c = _values(layer)
    c = layer.embeddings.snapshots()[-1]
    assert _record(folder, c)["base"] == a
    _moved_on_then_loaded(model, layer, tmp_path / "c.weights.h5", at_c,
                          seed=4)
    # Loaded by a table opened afresh on the folder (as a new process would).
    layer.embeddings.close()
    again, again_layer = _model(folder)
    again.load_weights(tmp_path / "b.weights.h5")
    _assert_equal(_values(again_layer), at_b)


@pytest.mark.parametrize("kind", ["int8", "lazy_false_momentum"])
def test_every_kind_of_write_reaches_an_incremental_snapshot(tmp_path, kind):
    # An int8 table (codes and scales), and catch-up at the end of `fit` (`lazy=False`:
    # every row written part by part, here every row of the table: its save may be
    # whole); either loads bit for bit.
    updater, dtype = {
        "int8": (sparseopt.updaters.RowwiseAdagrad(0.1), "int8"),
        "lazy_false_momentum": (sparseopt.updaters.SGD(0.1, momentum=0.9, lazy=False), None),
    }[kind]
    folder = tmp_path / "t"
    model, layer = _model(folder, updater, dtype)
    _fit(model, 0, ROWS, seed=40, steps=40)
    model.save_weights(tmp_path / "a.weights.h5")
    _fit(model, 0, 256, seed=41)
    model.save_weights(tmp_path / "b.weights.h5")
    at_b = _values(layer)
    a, b = layer.embeddings.snapshots()
    if kind == "int8":  # (the catch-up's save: whole or not, by its chain's bytes)
        assert _record(folder, b)["base"] == a
    _moved_on_then_loaded(model, layer, tmp_path / "b.weights.h5", at_b,
                          seed=42)


def test_chains_end_whole_and_what_a_kept_snapshot_builds_on_stays(tmp_path):
    folder = tmp_path / "t"
    model, layer = _model(folder)
    saved = {}
    for k in range(5):  # the whole table first, then rows over 3/4 of it each time
        _fit(model, 0, ROWS if k == 0 else 3 * ROWS // 4, seed=10 + k, steps=40)
        model.save_weights(tmp_path / f"{k}.weights.h5")
        saved[layer.embeddings.snapshots()[-1]] = (k, _values(layer))
    names = layer.embeddings.snapshots()
    bases = [_record(folder, n)["base"] for n in names]
    # Whole; built on it (3/4 of its pages); whole again (two such would outweigh it)...
    assert bases == [None, names[0], None, names[2], None], bases

    newest = names[-1]
    kept_chain = set()
    name = newest
    while name is not None:
        kept_chain.add(name)
        name = _record(folder, name)["base"]
    assert layer.embeddings.remove_snapshots(keep=1) == names[:-1]
    assert layer.embeddings.snapshots() == [newest]
    on_disk = {p.name for p in (folder / "snapshots").iterdir() if p.is_dir()}
    assert on_disk == kept_chain, (on_disk, kept_chain)  # (the rest deleted)
    for name in kept_chain - {newest}:  # (kept for the newest, not loadable themselves)
        k, _ = saved[name]
        with pytest.raises(ValueError, match=f"'t/embeddings'.*'{name}'.*missing"):
            model.load_weights(tmp_path / f"{k}.weights.h5")
    k, values = saved[newest]
    model.load_weights(tmp_path / f"{k}.weights.h5")
    _assert_equal(_values(layer), values)
    layer.embeddings.remove_snapshots(keep=0)
    assert not [p for p in (folder / "snapshots").iterdir() if p.is_dir()]


def test_a_save_that_dies_midway_then_a_save_holds_every_page_since_the_last(tmp_path,
                                                                             monkeypatch):
    folder = tmp_path / "t"
    model, layer = _model(folder)
    _fit(model, 0, ROWS, seed=20, steps=40)
    model.save_weights(tmp_path / "a.weights.h5")
    _fit(model, 0, 64, seed=21)  # page 0 of the rows' file
    copy = snapshots.copy_sparse

    def dies(src, dst, *args, **kwargs):
        if "rows.bin" in str(src):
            raise KeyboardInterrupt("killed")
        return copy(src, dst, *args, **kwargs)

    monkeypatch.setattr(snapshots, "copy_sparse", dies)
    with pytest.raises(KeyboardInterrupt):
        model.save_weights(tmp_path / "b.weights.h5")
    monkeypatch.setattr(snapshots, "copy_sparse", copy)
    assert len(layer.embeddings.snapshots()) == 1
    _fit(model, 128, 192, seed=22)  # page 2
    model.save_weights(tmp_path / "c.weights.h5")
    at_c = _values(layer)
    c = layer.embeddings.snapshots()[-1]
    pages = np.fromfile(folder / "snapshots" / c / "rows.bin.pages", "<i8")
    assert {0, 2} <= set(pages.tolist()), pages  # (the first pages' rows not lost)
    _moved_on_then_loaded(model, layer, tmp_path / "c.weights.h5", at_c,
                          seed=23)


def test_a_load_whose_chain_lacks_a_snapshot_names_it_and_changes_nothing(tmp_path):
    folder = tmp_path / "t"
    model, layer = _model(folder)
    _fit(model, 0, ROWS, seed=30, steps=40)
    model.save_weights(tmp_path / "a.weights.h5")
    _fit(model, 0, 64, seed=31)
    model.save_weights(tmp_path / "b.weights.h5")
    a, b = layer.embeddings.snapshots()
    assert _record(folder, b)["base"] == a
    (folder / "snapshots" / a / "complete.json").unlink()  # (damaged by hand)
    _fit(model, 0, ROWS, seed=32)
    before = _values(layer)
    with pytest.raises(ValueError, match=f"'t/embeddings'.*'{b}'.*builds on snapshot '{a}'"):
        model.load_weights(tmp_path / "b.weights.h5")
    _assert_equal(_values(layer), before)
    # A record naming no earlier snapshot (damaged: it names itself) is refused, not followed.
    record = _record(folder, b)
    (folder / "snapshots" / b / "complete.json").write_text(json.dumps({**record, "base": b}))
    with pytest.raises(ValueError, match=f"'t/embeddings'.*'{b}'.*damaged"):
        model.load_weights(tmp_path / "b.weights.h5")
    _assert_equal(_values(layer), before)
    # After a failed load the next save is whole (what the files are is a save's again).
    model.save_weights(tmp_path / "c.weights.h5")
    c = layer.embeddings.snapshots()[-1]
    assert _record(folder, c)["base"] is None
    _moved_on_then_loaded(model, layer, tmp_path / "c.weights.h5", before,
                          seed=33)


def test_a_load_leaves_removing_the_files_it_replaced_to_a_thread_of_its_own(tmp_path,
                                                                            monkeypatch):
    # Removing a trained table's files takes the file system seconds (they were given disk
    # page by page); a load keeps them under hidden names and hands them to a thread of
    # their own: it returns with them still there (held here), and then they go.
    import threading

    gate = threading.Event()
    real = snapshots._unlink

    def held(file):
        gate.wait(60)
        real(file)

    monkeypatch.setattr(snapshots, "_unlink", held)
    folder = tmp_path / "t"
    model, layer = _model(folder)
    _fit(model, 0, ROWS, seed=50, steps=10)
    model.save_weights(tmp_path / "a.weights.h5")
    at_a = _values(layer)
    _fit(model, 0, ROWS, seed=51)
    try:
        model.load_weights(tmp_path / "a.weights.h5")
        replaced = list(folder.glob(".partial-*-replaced-*"))
        assert len(replaced) == len(layer.embeddings.files.names), replaced
        _assert_equal(_values(layer), at_a)
    finally:
        gate.set()
        snapshots.wait_discarded()
    assert not list(folder.glob(".partial-*"))
    assert all((folder / name).is_file() for name in layer.embeddings.files.names)
    # (Read again from the folder's files, not the maps the load made.)
    layer.embeddings.close()
    again, again_layer = _model(folder)
    again.load_weights(tmp_path / "a.weights.h5")
    _assert_equal(_values(again_layer), at_a)


def test_closing_a_table_waits_for_the_files_a_load_left_to_remove(tmp_path, monkeypatch):
    # Nothing works in a folder once its table lets it go (a user may remove it next).
    import time

    real = snapshots._unlink

    def slow(file):
        time.sleep(0.5)  # (a removal of half a second a file: still going at the close)
        real(file)

    monkeypatch.setattr(snapshots, "_unlink", slow)
    folder = tmp_path / "t"
    model, layer = _model(folder)
    _fit(model, 0, ROWS, seed=60, steps=10)
    model.save_weights(tmp_path / "a.weights.h5")
    model.load_weights(tmp_path / "a.weights.h5")
    layer.embeddings.close()
    assert not list(folder.glob(".partial-*"))


def test_files_an_exit_left_are_removed_when_the_table_opens_and_waiters_all_wait(
        tmp_path, monkeypatch):
    # A process that loaded and exited before the thread removed the files it replaced
    # (or crashed) leaves them under hidden names: the next table on the folder removes
    # them; every caller of `wait_discarded` returns only once they are gone.
    import threading
    import time

    folder = tmp_path / "t"
    model, layer = _model(folder)
    _fit(model, 0, ROWS, seed=70, steps=2)
    layer.embeddings.close()
    left = folder / ".partial-rows.bin-replaced-0123456789ab-0"
    left.write_bytes(b"old rows")
    real = snapshots._unlink

    def slow(file):
        time.sleep(0.3)
        real(file)

    monkeypatch.setattr(snapshots, "_unlink", slow)
    _model(folder)  # (opens the folder)
    seen = []
    waiters = [threading.Thread(target=lambda: (snapshots.wait_discarded(folder),
                                                seen.append(left.exists())))
               for _ in range(2)]
    for waiter in waiters:
        waiter.start()
    for waiter in waiters:
        waiter.join()
    assert seen == [False, False]
