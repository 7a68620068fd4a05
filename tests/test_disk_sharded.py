"""Tables on disk split by rows into shards (`sparseopt.disk.sharded`).

Through `fit`, as users train them: `tests/jobs/disk_sharded_job.py`, a child
with 4 devices (`row_sharded` splits each table into 4 shards, against the same
tables whole under the same batch split: bit for bit; saves, loads, backups; open
vocabularies too, their maps split with their rows).
Here also, at the host level, what `fit` cannot produce on demand: a save
interrupted between two shards, and a load that fails on one shard.
"""

import os

import keras
import numpy as np
import pytest

import sparseopt
from sparseopt.disk import snapshots
from sparseopt.disk.sharded import ShardedDiskTable
from sparseopt.storage import OnDisk
from tests.helpers import run_device_job


@pytest.mark.jax_session  # (its child is JAX's, with 4 simulated devices)
def test_a_table_split_by_rows_over_devices_trains_as_the_table_whole(tmp_path):
    proc = run_device_job("tests.jobs.disk_sharded_job", tmp_path)
    assert proc.returncode == 0 and "shards 4, equal" in proc.stdout, \
        proc.stdout[-2000:] + proc.stderr[-3000:]


def _table(folder, shards=3, rows=10):
    """A row-wise Adagrad table of `rows` x 2 split into `shards`, made directly (a
    shortcut: these tests are of its host side, between steps)."""
    updater = sparseopt.updaters.RowwiseAdagrad(0.1)
    return ShardedDiskTable("emb/embeddings", (rows, 2), "float32",
                            keras.initializers.RandomUniform(-1, 1, seed=3),
                            [s for s in updater.slots if s.per_row],
                            OnDisk(str(folder), cache_rows=6), shards=shards)


def _written(table, value):
    """Every row written `value` (as a step's write would), through the host."""
    ids = np.arange(table.shape[0])
    table._write_host(ids, ids.size, np.ones(ids.size, bool),
                      {"rows": np.full((ids.size, 2), value, np.float32)})
    table.flush()


def _whole(folder, rows=10):
    return sparseopt.disk.table.DiskTable(
        "emb/embeddings", (rows, 2), "float32", keras.initializers.RandomUniform(-1, 1, seed=3),
        [], OnDisk(str(folder), cache_rows=6))


@pytest.mark.backend_independent
@pytest.mark.parametrize("rows,shards,sizes", [(10, 3, [3, 3, 4]), (6, 4, [1, 2, 1, 2]),
                                               (5, 4, [1, 1, 1, 2]), (2, 2, [1, 1])])
def test_shards_split_any_table_and_read_and_write_its_rows(tmp_path, rows, shards, sizes):
    split = _table(tmp_path / "split", shards=shards, rows=rows)
    assert [p.shape[0] for p in split.parts()] == sizes
    assert sorted(os.listdir(tmp_path / "split")) == sorted(
        [".lock", "shards.json", *(f"shard-{k}-of-{shards}" for k in range(shards))])
    whole = _whole(tmp_path / "whole", rows)
    # Rows never written: drawn as the whole table's, wherever a shard starts.
    np.testing.assert_array_equal(split.numpy(), whole.numpy())
    backwards = np.arange(rows)[::-1]
    np.testing.assert_array_equal(split.numpy(ids=backwards), whole.numpy(ids=backwards))
    # Each id's row written to its shard, and read back from it.
    ids = np.array([rows - 1, 0, -1, rows, rows // 2])  # (two outside the table)
    split._write_host(ids, ids.size, np.ones(ids.size, bool),
                      {"rows": np.repeat(ids[:, None], 2, 1).astype(np.float32) + 0.5})
    want = whole.numpy().copy()
    want[[rows - 1, 0, rows // 2]] = np.array([rows - 1, 0, rows // 2])[:, None] + 0.5
    np.testing.assert_array_equal(split.numpy(), want)
    got = split._read_host(ids.reshape(1, -1), ["rows"])[0]
    np.testing.assert_array_equal(got[0, [2, 3]], 0.0)  # (outside: zeros)
    np.testing.assert_array_equal(got[0, [0, 1, 4]], want[[rows - 1, 0, rows // 2]])
    with pytest.raises(IndexError, match=f"row {rows} is outside the table's {rows} rows"):
        split.numpy(ids=[rows])


@pytest.mark.backend_independent
def test_a_folder_holds_one_table_whole_or_split_one_way(tmp_path):
    with pytest.raises(ValueError, match="split into 2 to 10 shards .its rows., not 11"):
        _table(tmp_path / "many", shards=11, rows=10)
    whole = _whole(tmp_path / "w")
    whole.close()
    with pytest.raises(ValueError, match="holds a table on disk whole .its table.json., and "
                                         "this table is split into 3 shards"):
        _table(tmp_path / "w")
    split = _table(tmp_path / "s", shards=3)
    with pytest.raises(ValueError, match="is open already"):  # (split, open: locked)
        _whole(tmp_path / "s")
    with pytest.raises(ValueError, match="is open already"):
        _table(tmp_path / "s", shards=3)
    split.close()
    (tmp_path / "s" / "shards.json").write_text("{not json")  # (damaged: still refused)
    with pytest.raises(ValueError, match="holds a table on disk split into shards .{not "
                                         "json.* and this table is whole"):
        _whole(tmp_path / "s")
    os.remove(tmp_path / "s" / "shards.json")
    with pytest.raises(ValueError, match=r"holds shards \['shard-0-of-3', 'shard-1-of-3', "
                                         r"'shard-2-of-3'\] of another split, without its "
                                         "shards.json; this table is split into 2"):
        _table(tmp_path / "s", shards=2)
    _table(tmp_path / "s", shards=3).close()  # (its own shards: its record written again)
    with pytest.raises(ValueError, match="holds a table on disk split into shards .* and "
                                         "this table is whole"):
        _whole(tmp_path / "s")
    with pytest.raises(ValueError, match="split as .'shape': .10, 2., 'shards': 3.; this "
                                         "table is split as .'shards': 2"):
        _table(tmp_path / "s", shards=2)
    _table(tmp_path / "s", shards=3).close()  # (as it was: reopened)


@pytest.mark.backend_independent
def test_a_save_interrupted_between_shards_is_never_listed_and_is_removed(tmp_path):
    table = _table(tmp_path / "t")
    _written(table, 1.0)
    first = table.snapshot()
    # A save that stopped after its first shard (a crash): that shard alone holds it.
    table.parts()[0].snapshot(at_least=snapshots.next_number(table.parts()[0].settings.path))
    assert table.snapshots() == [first]
    second = table.snapshot()  # (one name for every shard, past the interrupted one)
    assert int(second) == int(first) + 2
    assert all(p.snapshots()[-1] == second for p in table.parts())
    assert table.remove_snapshots(keep=1) == [first]
    assert all(p.snapshots() == [second] for p in table.parts())  # (the stray one too)


@pytest.mark.backend_independent
@pytest.mark.parametrize("failure", ["damaged", "copy"])
def test_a_load_that_fails_on_one_shard_leaves_every_shard_as_it_was(tmp_path, monkeypatch,
                                                                      failure):
    table = _table(tmp_path / "t")
    _written(table, 1.0)
    saved = table.snapshot()
    _written(table, 2.0)
    last = table.parts()[-1]
    if failure == "damaged":  # the last shard's snapshot lost a file: checked first
        os.remove(tmp_path / "t" / "shard-2-of-3" / "snapshots" / saved / "rows.bin")
        match = "whose 'rows.bin' is missing"
    else:  # the last shard's copy fails (a full disk), after the others were copied
        copy = snapshots.copy_sparse

        def failing(src, dst, *args, **kwargs):
            if str(last.settings.path) in str(dst):
                raise OSError(28, "No space left on device")
            return copy(src, dst, *args, **kwargs)

        monkeypatch.setattr(snapshots, "copy_sparse", failing)
        match = "No space left"
    with pytest.raises((ValueError, OSError), match=match):
        table.restore(saved)
    np.testing.assert_array_equal(table.numpy(), np.full((10, 2), 2.0, np.float32))
    for part in table.parts():  # (no copy left beside the live files)
        assert not [f for f in os.listdir(part.settings.path) if f.startswith(".partial")]
    monkeypatch.undo()
    if failure == "copy":  # (the snapshot itself is whole: it loads)
        table.restore(saved)
        np.testing.assert_array_equal(table.numpy(), np.full((10, 2), 1.0, np.float32))


@pytest.mark.backend_independent
def test_a_load_whose_renames_fail_on_one_shard_renames_the_others_and_loads_again(
        tmp_path, monkeypatch):
    table = _table(tmp_path / "t")
    _written(table, 1.0)
    saved = table.snapshot()
    _written(table, 2.0)
    commit = snapshots.commit
    middle = str(table.parts()[1].settings.path)

    def failing(path, staged):
        if str(path) == middle:
            raise OSError(5, "Input/output error")
        return commit(path, staged)

    monkeypatch.setattr(snapshots, "commit", failing)
    with pytest.raises(OSError, match="Input/output error"):
        table.restore(saved)
    # Rolled forward: the other shards hold the snapshot, the failed one its own rows;
    # mixed, the table neither trains, nor reads, nor is saved until loaded again.
    got = [part.numpy() for part in table.parts()]
    assert np.all(got[0] == 1.0) and np.all(got[1] == 2.0) and np.all(got[2] == 1.0)
    for use in (table.snapshot, table.numpy, table.flush,
                lambda: table._read_host(np.array([0]), ["rows"])):
        with pytest.raises(RuntimeError, match="a load renamed some of its shards' files and "
                                               "not others .*Load the save again"):
            use()
    monkeypatch.undo()
    table.restore(saved)  # (loaded again: every shard the snapshot)
    np.testing.assert_array_equal(table.numpy(), np.full((10, 2), 1.0, np.float32))


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="keras.distribution: JAX's")
def test_rows_split_over_one_device_keep_the_table_whole(tmp_path):
    with sparseopt.distribution.row_sharded(tables=[r".*/embeddings"]).scope():
        layer = sparseopt.layers.SparseEmbedding(
            8, 2, sparseopt.updaters.SGD(0.1), name="t",
            storage=OnDisk(str(tmp_path / "t"), cache_rows=4))
        layer(keras.ops.zeros((2, 2), "int32"))
    assert layer.embeddings.parts() == [layer.embeddings]
    assert "table.json" in os.listdir(tmp_path / "t")  # (its own files: no shard folders)


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="keras.distribution: JAX's")
def test_a_split_of_a_table_on_disks_columns_is_refused_with_the_fix(tmp_path):
    mesh = keras.distribution.DeviceMesh((1,), ["model"])
    layout = keras.distribution.LayoutMap(mesh)
    layout["t/embeddings"] = (None, "model")
    with keras.distribution.ModelParallel(layout_map=layout).scope():
        layer = sparseopt.layers.SparseEmbedding(
            8, 2, sparseopt.updaters.SGD(0.1), name="t",
            storage=OnDisk(str(tmp_path / "t"), cache_rows=4))
        with pytest.raises(ValueError, match="splits the columns of its table on disk "
                                             "'t/embeddings'.*Split its rows"):
            layer(keras.ops.zeros((2, 2), "int32"))


@pytest.mark.backend_independent
def test_a_step_reads_only_the_shards_its_ids_are_on(tmp_path):
    table = _table(tmp_path / "t", shards=3, rows=12)  # (rows 0-3, 4-7, 8-11)
    ids = np.array([[1, 3, 1, -1, 2]])
    for _ in range(2):  # (the lookup's read, then the optimizer's of the same rows)
        got = table._read_host(ids, ["rows"], lookup=True)[0]
        np.testing.assert_array_equal(got[0, 3], 0.0)
    counts = [p.health() for p in table.parts()]
    # Read once through the first shard's cache (the second read served from the
    # first); the other shards read nothing.
    assert (counts[0]["hits"], counts[0]["misses"]) == (0, 3)
    assert all(c["hits"] + c["misses"] == 0 for c in counts[1:])


@pytest.mark.backend_independent
def test_closing_closes_every_shard_and_the_folder_whatever_one_raised(tmp_path):
    table = _table(tmp_path / "t")

    def broken():
        raise ValueError("a job beside the step failed")

    table.parts()[0]._background.submit(broken)
    with pytest.raises(ValueError, match="a job beside the step failed"):
        table.close()
    _table(tmp_path / "t").close()  # (every shard's folder and the table's let go)
