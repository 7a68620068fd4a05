"""The host side of tables on disk (issue 48, first step): files, initial rows, the cache.

These are unit tests of modules no layer reaches yet (the row-storage kind
that trains through them is the next step), so they call them directly;
the training path will be tested through `fit` when it exists. The
reference is a dict of written rows beside the rows' initial values.
"""

import errno
import os

import keras
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from sparseopt.disk import initial_rows
from sparseopt.disk.initial_rows import InitialRows
from sparseopt.disk.row_cache import RowCache
from sparseopt.disk.row_files import RESERVE_BYTES, Column, RowFiles

pytestmark = pytest.mark.backend_independent

M64 = (1 << 64) - 1


def splitmix_finalizer(z):
    """The documented mix in plain Python integers: times splitmix64's golden gamma, then
    its published finalizer (checks NumPy's wrapping uint64 arithmetic against exact ints)."""
    z = (z * 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def test_the_hash_is_the_documented_splitmix64_mix():
    values = [0, 1, 2, 12345, 2**40 + 7, M64]
    got = initial_rows.mix(np.array(values, np.uint64))
    assert [int(v) for v in got] == [splitmix_finalizer(v) for v in values]


def test_initial_rows_follow_the_initializers_distribution_and_repeat():
    ids = np.arange(20000)
    uniform = InitialRows(keras.initializers.RandomUniform(-0.5, 1.5, seed=1), 8)(ids)
    assert uniform.dtype == np.float32 and uniform.shape == (20000, 8)
    assert uniform.min() >= -0.5 and uniform.max() < 1.5
    assert abs(uniform.mean() - 0.5) < 0.01 and abs(uniform.var() - 4 / 12) < 0.01
    normal = InitialRows(keras.initializers.RandomNormal(1.0, 2.0, seed=1), 8)(ids)
    assert abs(normal.mean() - 1.0) < 0.03 and abs(normal.std() - 2.0) < 0.03
    truncated = InitialRows(keras.initializers.TruncatedNormal(0.0, 1.0, seed=1), 8)(ids)
    assert np.abs(truncated).max() <= 2.0
    # A normal truncated at 2 standard deviations has standard deviation 0.8796.
    assert abs(truncated.std() - 0.8796) < 0.01
    assert np.all(InitialRows("ones", 3)(ids[:5]) == 1.0)
    assert np.all(InitialRows(keras.initializers.Constant(0.25), 3)(ids[:5]) == 0.25)
    # A row is the same whichever rows are drawn with it; seeds differ.
    again = InitialRows(keras.initializers.RandomUniform(-0.5, 1.5, seed=1), 8)
    np.testing.assert_array_equal(again(np.array([19999, 3]))[::-1], uniform[[3, 19999]])
    other = InitialRows(keras.initializers.RandomUniform(-0.5, 1.5, seed=2), 8)(ids[:100])
    assert not np.array_equal(other, uniform[:100])


def test_initializers_that_need_the_whole_table_are_refused():
    with pytest.raises(ValueError, match="user/table.*GlorotUniform.*RandomUniform"):
        InitialRows("glorot_uniform", 4, owner="user/table")


def make_files(path, num_rows=1000, width=3, state_dtype="float32", initializer=None):
    init = InitialRows(initializer or keras.initializers.RandomUniform(-1, 1, seed=5), width)
    return RowFiles(path, num_rows, {"rows": Column((width,), "float32", init),
                                     "acc": Column((), state_dtype, 0.1),
                                     "last": Column((), "int32", 0)},
                    owner="emb/embeddings", describe=init.get_config())


def test_a_billion_row_table_costs_no_disk_until_rows_are_written(tmp_path):
    files = make_files(tmp_path, num_rows=10**9, width=16)
    assert files.disk_bytes() < 1 << 20
    ids = np.array([0, 10**9 - 1, 5 * 10**8])
    before = files.read(ids)
    files.write(ids, {"rows": np.ones((3, 16), np.float32), "acc": np.ones(3),
                      "last": np.arange(3)})
    # A block of each file per row is reserved, no more.
    assert files.disk_bytes() <= 3 * 4 * RESERVE_BYTES
    after = files.read(np.concatenate([ids, [7]]))
    assert np.all(after["rows"][:3] == 1) and np.all(after["last"][:3] == [0, 1, 2])
    np.testing.assert_array_equal(after["rows"][3], files.read(np.array([7]))["rows"][0])
    assert not np.array_equal(before["rows"], after["rows"][:3])


def test_files_reopen_with_their_rows_and_refuse_another_table(tmp_path):
    files = make_files(tmp_path)
    files.write(np.array([4]), {"rows": np.full((1, 3), 2.0), "acc": np.ones(1),
                                "last": np.ones(1)})
    files.flush()
    with pytest.raises(ValueError, match="emb/embeddings: its folder .* is open already"):
        make_files(tmp_path)  # (two caches over one folder would lose rows)
    files.close()
    reopened = make_files(tmp_path)
    np.testing.assert_array_equal(reopened.read(np.array([4]))["rows"], [[2.0, 2.0, 2.0]])
    reopened.close()
    with pytest.raises(ValueError, match="emb/embeddings.*another table"):
        make_files(tmp_path, width=4)
    make_files(tmp_path).close()  # (a refused open leaves the folder unlocked)


def test_a_full_disk_is_an_error_naming_the_table_and_writes_nothing(tmp_path, monkeypatch):
    # (A full disk cannot be made here: posix_fallocate is made to fail as it would.)
    files = make_files(tmp_path)

    def no_room(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "posix_fallocate", no_room)
    with pytest.raises(OSError, match="emb/embeddings: no room on disk"):
        files.write(np.array([1]), {"rows": np.zeros((1, 3)), "acc": np.zeros(1),
                                    "last": np.zeros(1)})
    assert not files.is_written(np.array([1]))[0]


def test_files_that_disappear_are_an_error_naming_the_table(tmp_path):
    files = make_files(tmp_path / "t")
    for name in os.listdir(tmp_path / "t"):
        os.remove(tmp_path / "t" / name)
    with pytest.raises(FileNotFoundError, match="emb/embeddings.*disappeared"):
        files.flush()


def test_lru_and_lfu_evict_different_rows(tmp_path):
    def misses_after(policy):
        cache = RowCache(make_files(tmp_path / policy), cache_rows=2, policy=policy, ways=2)
        for ids in ([1], [1], [1], [2], [3]):  # 1 used often, 2 last: 3 evicts one
            cache.read(np.array(ids))
        before = cache.health()["misses"]
        cache.read(np.array([1]))
        return cache.health()["misses"] - before
    assert misses_after("lru") == 1  # 1 was used longest ago
    assert misses_after("lfu") == 0  # 2 was used least often


ops = st.lists(st.tuples(st.sampled_from(["read", "write", "flush"]),
                         st.lists(st.integers(0, 39), min_size=1, max_size=12, unique=True),
                         st.integers(0, 2**16)), min_size=1, max_size=25)


@settings(max_examples=60, deadline=None)
@given(ops=ops, cache_rows=st.sampled_from([1, 3, 8, 16, 64]), ways=st.sampled_from([1, 2, 4]),
       policy=st.sampled_from(["lru", "lfu"]), dtype=st.sampled_from(["float32", "bfloat16"]))
def test_the_cache_reads_what_was_last_written_whatever_it_evicts(
        tmp_path_factory, ops, cache_rows, ways, policy, dtype):
    path = tmp_path_factory.mktemp("cache")
    files = make_files(path, num_rows=40, state_dtype=dtype)
    cache = RowCache(files, cache_rows, policy=policy, ways=ways)
    written = {}  # id -> (row, acc, last), the reference
    fresh = make_files(tmp_path_factory.mktemp("fresh"), num_rows=40, state_dtype=dtype)
    for op, ids, seed in ops:
        ids = np.array(ids)
        if op == "write":
            rng = np.random.default_rng(seed)
            values = {"rows": rng.normal(size=(len(ids), 3)).astype(np.float32),
                      "acc": rng.uniform(size=len(ids)).astype(files.maps["acc"].dtype),
                      "last": rng.integers(0, 100, len(ids)).astype(np.int32)}
            cache.write(ids, values)
            for k, i in enumerate(ids):
                written[int(i)] = tuple(values[n][k] for n in ("rows", "acc", "last"))
        elif op == "flush":
            cache.flush()
        else:
            got = cache.read(ids)
            start = fresh.read(ids)  # never written: the initial values
            for k, i in enumerate(ids):
                want = written.get(int(i), tuple(start[n][k] for n in ("rows", "acc", "last")))
                np.testing.assert_array_equal(got["rows"][k], want[0])
                assert got["acc"][k] == want[1] and got["last"][k] == want[2]
    cache.flush()
    files.close()
    # Everything written reached the files, and nothing else changed there.
    reopened = make_files(path, num_rows=40, state_dtype=dtype)
    ids = np.arange(40)
    on_disk, start = reopened.read(ids), fresh.read(ids)
    for i in ids:
        want = written.get(int(i), tuple(start[n][i] for n in ("rows", "acc", "last")))
        np.testing.assert_array_equal(on_disk["rows"][i], want[0])
        assert on_disk["acc"][i] == want[1] and on_disk["last"][i] == want[2]
    health = cache.health()
    assert health["hits"] + health["misses"] == sum(len(i) for o, i, _ in ops if o == "read")


def test_an_unseeded_initializer_draws_the_same_rows_every_time(tmp_path):
    # Keras draws a seed per unseeded initializer instance; a table on disk must not.
    first = InitialRows("uniform", 4)(np.arange(10))
    np.testing.assert_array_equal(InitialRows("uniform", 4)(np.arange(10)), first)
    make_files(tmp_path, initializer="uniform").flush()
    make_files(tmp_path, initializer="uniform")  # reopens: the same table


def test_missing_or_stray_files_are_refused_not_recreated(tmp_path):
    files = make_files(tmp_path / "t")
    files.write(np.array([7]), {"rows": np.ones((1, 3)), "acc": np.ones(1), "last": np.ones(1)})
    files.flush()
    del files
    os.remove(tmp_path / "t" / "rows.bin")
    with pytest.raises(ValueError, match="emb/embeddings.*rows.bin' is missing"):
        make_files(tmp_path / "t")
    os.remove(tmp_path / "t" / "table.json")
    with pytest.raises(ValueError, match="without their table.json"):
        make_files(tmp_path / "t")


def test_ids_outside_the_table_or_repeated_are_refused(tmp_path):
    files = make_files(tmp_path, num_rows=10)
    values = {"rows": np.ones((1, 3)), "acc": np.ones(1), "last": np.ones(1)}
    for bad in (-1, 10):
        with pytest.raises(IndexError, match=f"emb/embeddings: row {bad} is outside"):
            files.write(np.array([bad]), values)
        with pytest.raises(IndexError, match="outside"):
            RowCache(files, 4).read(np.array([bad]))
    with pytest.raises(ValueError, match="distinct"):
        RowCache(files, 4).write(np.array([5, 5]), {n: np.concatenate([v, v])
                                                     for n, v in values.items()})
    with pytest.raises(KeyError, match="missing \\['last'\\]"):
        files.write(np.array([1]), {"rows": np.ones((1, 3)), "acc": np.ones(1)})
    assert not files.is_written(np.arange(10)).any()


def test_disk_is_reserved_for_every_byte_a_write_touches(tmp_path, monkeypatch):
    # (posix_fallocate is recorded, not replaced: what it was asked must cover the writes.)
    asked = []
    real = os.posix_fallocate

    def record(fd, offset, length):
        asked.append((os.readlink(f"/proc/self/fd/{fd}").rsplit("/", 1)[-1], offset, length))
        real(fd, offset, length)
    monkeypatch.setattr(os, "posix_fallocate", record)
    page = RESERVE_BYTES  # (the blocks reserved at once)
    rows = 40 * page + 3
    files = make_files(tmp_path, num_rows=rows, width=5)
    # Rows of 20 bytes: row `page // 20` spans two blocks of rows.bin; rows 7 and 8 share one.
    ids = np.array([0, 7, 8, page // 20, 30 * page + 17, rows - 1])
    files.write(ids, {"rows": np.ones((6, 5)), "acc": np.ones(6), "last": np.ones(6)})

    def covered(name, start, stop):
        return any(n == name and o <= start and stop <= o + n_ for n, o, n_ in asked)
    for i in ids:
        assert covered("rows.bin", i * 20, (i + 1) * 20)
        assert covered("acc.bin", i * 4, (i + 1) * 4) and covered("last.bin", i * 4, (i + 1) * 4)
        assert covered("written.bits", i // 8, i // 8 + 1)
    sizes = {n: os.stat(tmp_path / n).st_size for n, _, _ in asked}
    assert all(o + n_ <= sizes[n] for n, o, n_ in asked)
    # Whole blocks, each once, and only blocks the rows lie on.
    assert all(o % page == 0 for _, o, _ in asked)
    for name, size in (("rows.bin", 20), ("acc.bin", 4), ("last.bin", 4)):
        touched = {p for i in ids
                   for p in range(i * size // page, ((i + 1) * size - 1) // page + 1)}
        reserved = [p for n, o, n_ in asked if n == name
                    for p in range(o // page, -(-(o + n_) // page))]
        assert sorted(reserved) == sorted(touched), name
    before = len(asked)
    files.write(ids[:2], {"rows": np.ones((2, 5)), "acc": np.ones(2), "last": np.ones(2)})
    assert len(asked) == before  # reserved already
    # Rows wider than a block: every block each lies on, the middle ones too.
    asked.clear()
    width = page // 4 * 5 // 2  # (float32 rows of 2.5 blocks)
    wide = make_files(tmp_path / "wide", num_rows=10, width=width)
    wide.write(np.array([1]), {"rows": np.ones((1, width)), "acc": np.ones(1),
                               "last": np.ones(1)})
    blocks = [p for n, o, n_ in asked if n == "rows.bin"
              for p in range(o // page, -(-(o + n_) // page))]
    assert blocks == [2, 3, 4]  # (bytes 2.5 to 5 blocks)
    # A row on two blocks, the first reserved by an earlier write and the second not:
    # the second is reserved when the row is written (rows whose blocks are all
    # reserved are let through without a look: `RowFiles.reserve`).
    asked.clear()
    two = make_files(tmp_path / "two", num_rows=4 * page, width=5)
    row = page // 20  # (its 20 bytes straddle the first two blocks of rows.bin)
    two.write(np.array([row - 1]), {"rows": np.ones((1, 5)), "acc": np.ones(1),
                                    "last": np.ones(1)})
    assert [o for n, o, _ in asked if n == "rows.bin"] == [0]
    two.write(np.array([row]), {"rows": np.ones((1, 5)), "acc": np.ones(1),
                                "last": np.ones(1)})
    assert [o for n, o, _ in asked if n == "rows.bin"] == [0, page]


def test_the_cache_counts_hits_misses_and_rows_moved(tmp_path):
    cache = RowCache(make_files(tmp_path), cache_rows=2, policy="lru", ways=2)
    values = {"rows": np.ones((2, 3)), "acc": np.ones(2), "last": np.ones(2)}
    cache.write(np.array([1, 2]), values)         # both cached, dirty
    cache.read(np.array([1, 3]))                  # 1 hit; 3 missed, evicts 2 (written back)
    cache.read(np.array([2]))                     # missed: read from the files; evicts
    health = cache.health()                       # 1 (used before 3), written back
    assert (health["hits"], health["misses"]) == (1, 2) and health["hit_rate"] == 1 / 3
    assert (health["rows_written"], health["rows_read"]) == (2, 1)
    row_bytes = 3 * 4 + 4 + 4
    assert (health["bytes_read"], health["bytes_written"]) == (row_bytes, 2 * row_bytes)


def test_a_snapshot_copies_only_what_a_sparse_file_holds(tmp_path):
    from sparseopt.disk.snapshots import copy_sparse

    src, dst = tmp_path / "big.bin", tmp_path / "copy.bin"
    with open(src, "wb") as f:  # 256 MiB, of which 8 KiB hold data
        f.truncate(256 << 20)
        f.seek(100 << 20)
        f.write(b"\x07" * 8192)
    copy_sparse(src, dst)
    assert dst.stat().st_size == src.stat().st_size
    assert dst.stat().st_blocks * 512 < (1 << 20)  # (not 256 MiB)
    with open(dst, "rb") as f:
        f.seek((100 << 20) - 1)
        assert f.read(8194) == b"\x00" + b"\x07" * 8192 + b"\x00"
