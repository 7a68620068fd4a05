"""The host library of tables on disk (`sparseopt/native/disk_host.cc`) against NumPy.

Each native pass must give what its NumPy path gives (`sparseopt.disk.host_ops`,
`RowCache`), which is written independently as vectorized NumPy: the same
distinct ids, the same numbers, the same cache state array for array (tags,
dirty flags, uses, ticks, counts), the same files. The step's numbering is
checked against the device's own (`stages._numbered` without the host) and
against the same code compiled into the step: an FFI call on JAX
(`number_ffi.cc`), an op on TensorFlow (`tf_ops.cc`). These
call the host modules directly: they are the units `fit` runs through on a
table on disk (tests/test_disk_tables.py trains through `fit`, with this
library on, as users do).
"""

import errno
import os

import keras
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from keras import ops

import sparseopt
from sparseopt import native
from sparseopt.disk import host_ops
from sparseopt.disk.background import Background
from sparseopt.disk.initial_rows import InitialRows
from sparseopt.disk.look_ahead import Foreseen
from sparseopt.disk.native_cache import NativeRowCache, make_cache
from sparseopt.disk.row_cache import RowCache
from sparseopt.disk.row_files import Column, RowFiles
from sparseopt.engine import stages
from sparseopt.storage import OnDisk
from sparseopt.storage.dtypes import numpy_dtype

JAX = keras.backend.backend() == "jax"


def _numbers_in_step():
    """Whether a step numbers a table on disk's ids natively in the step (JAX: an FFI call,
    on CPU; TensorFlow: an op, a CPU kernel); on a GPU the host call numbers them."""
    if JAX:
        import jax

        return jax.default_backend() == "cpu"
    import tensorflow as tf

    return not tf.config.list_logical_devices("GPU")


IN_STEP = _numbers_in_step()

# (Host code: once, in the TensorFlow session, but for the numbering, which is
# checked against each backend's device numbering.)
independent = pytest.mark.backend_independent


def make_files(path, num_rows=40):
    return RowFiles(path, num_rows, {
        "rows": Column((3,), "float32", lambda ids: np.outer(ids, [1.0, -1.0, 0.5])),
        "acc": Column((), "bfloat16", 0.1), "last": Column((), "int32", 0)}, owner="emb/t")


@independent
def test_the_host_library_builds_loads_and_is_on_by_default():
    """On Linux with a C++ compiler (this project's machines) it must: a broken build
    would otherwise only show as a slower table on disk."""
    assert native.build_error("host") is None and native.enabled("disk_host")
    assert host_ops.library() is not None
    with native.disabled():
        assert host_ops.library() is None


@independent
def test_the_host_librarys_calls_are_checked_before_they_reach_c():
    """Each function declares its arguments: a call with too few, or an array of the
    wrong width where C reads another, is refused by ctypes, never passed on."""
    import ctypes

    lib = host_ops.library()
    assert set(native.HOST_FUNCTIONS) == {
        "so_unique", "so_find", "so_number", "so_gather", "so_unreserved", "so_cache_read",
        "so_cache_write", "so_cache_insert", "so_stage_flush", "so_uniform",
        "so_cache_flush", "so_files_read"}
    with pytest.raises(TypeError):
        lib.so_stage_flush()
    wide = np.zeros(4, np.int64)
    with pytest.raises(ctypes.ArgumentError):  # int32 ids expected
        lib.so_number(host_ops.ptr(wide), 4, 40, host_ops.ptr(wide), host_ops.ptr(wide),
                      host_ops.ptr(wide))
    # An array is only ever passed as a pointer to elements of its own width.
    with pytest.raises(TypeError, match="int32 .4-byte elements. where C reads 8-byte"):
        host_ops.ptr(np.zeros(4, np.int32))
    with pytest.raises(TypeError, match="not contiguous"):
        host_ops.ptr(np.zeros(8, np.int64)[::2])


ids_lists = st.lists(st.integers(-3, 45), max_size=200)


@independent
@settings(max_examples=60, deadline=None)
@given(ids=ids_lists, wanted=ids_lists)
def test_distinct_ids_and_their_positions_are_numpys(ids, wanted):
    ids, wanted = np.array(ids, np.int64), np.array(wanted, np.int64)
    mine = host_ops.distinct(ids, 40)
    with native.disabled():
        numpy_ = host_ops.distinct(ids, 40)
    for name in ("ids", "first", "inverse"):
        np.testing.assert_array_equal(getattr(mine, name), getattr(numpy_, name))
    # (first-occurrence order, checked against the definition too)
    valid = ids[(ids >= 0) & (ids < 40)]
    assert list(mine.ids) == list(dict.fromkeys(valid.tolist()))
    found, numpy_found = mine.positions(wanted), numpy_.positions(wanted)
    assert (found is None) == (numpy_found is None)
    if found is not None:
        np.testing.assert_array_equal(found, numpy_found)


@independent
@settings(max_examples=40, deadline=None)
@given(index=st.lists(st.integers(-1, 9), max_size=50),
       dtype=st.sampled_from(["float32", "bfloat16", "int32"]))
def test_gather_is_numpys(index, dtype):
    source = np.arange(10 * 3).reshape(10, 3).astype(numpy_dtype(dtype))
    index = np.array(index, np.int64)
    mine = host_ops.gather(source, index)
    with native.disabled():
        numpy_ = host_ops.gather(source, index)
    np.testing.assert_array_equal(mine.view(np.uint8), numpy_.view(np.uint8))


@independent
@settings(max_examples=40, deadline=None)
@given(ids=st.lists(st.integers(0, 2**40), max_size=40), width=st.integers(1, 20),
       low=st.floats(-1e3, 1e3), span=st.floats(1e-6, 1e3), seed=st.integers(0, 2**63 - 1),
       kind=st.sampled_from([float, np.float32, int]))
def test_uniform_initial_rows_are_numpys_bit_for_bit(ids, width, low, span, seed, kind):
    # Bounds as a user gives them: floats, NumPy float32s (Keras keeps them: the NumPy
    # draw subtracts them in float32), ints. (Spans tiny beside their bounds round many
    # values to `maxval` in float32: kept below it.)
    low, high = kind(low), kind(low + span) if kind is not int else int(low) + 1 + int(span)
    init = keras.initializers.RandomUniform(low, high, seed=seed)
    ids = np.array(ids, np.int64)
    assert host_ops.uniform(ids, width, 0, 0.0, 1.0, np.float32(0.5)) is not None
    mine = InitialRows(init, width)(ids)
    with native.disabled():
        assert host_ops.uniform(ids, width, 0, 0.0, 1.0, np.float32(0.5)) is None
        numpy_ = InitialRows(init, width)(ids)
    np.testing.assert_array_equal(mine.view(np.uint32), numpy_.view(np.uint32))


@independent
@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(0, 199), max_size=60),
       row_bytes=st.sampled_from([0, 4, 12, 64, 100, 300]),
       block_bytes=st.sampled_from([64, 256]),
       share=st.sampled_from([0.0, 0.1, 0.5, 0.9, 1.0]), seed=st.integers(0, 2**32 - 1))
def test_the_blocks_left_to_reserve_are_numpys_and_the_definitions(ids, row_bytes,
                                                                    block_bytes, share, seed):
    """Rows of any width against blocks of any size (a row on one block, on two, a row
    wider than a block), and the written-rows bitmap (`row_bytes` 0: a bit per row), a
    `share` of the blocks reserved. (The blocks reserved drawn from a seed: a list of
    hundreds of booleans drawn by Hypothesis took it half a second an example.)"""
    ids = np.array(ids, np.int64)
    blocks = 300 * (1 + 200 * max(row_bytes, 1) // block_bytes // 300)
    reserved = np.random.default_rng(seed).random(blocks) < share
    mine = host_ops.unreserved(ids, row_bytes, block_bytes, reserved)
    with native.disabled():
        numpy_ = host_ops.unreserved(ids, row_bytes, block_bytes, reserved)
    np.testing.assert_array_equal(mine, numpy_)
    # The definition, block by block: every byte of each row, the bitmap's byte.
    spans = [range(i >> 3, (i >> 3) + 1) if row_bytes == 0
             else range(i * row_bytes, (i + 1) * row_bytes) for i in ids.tolist()]
    blocks = {b // block_bytes for span in spans for b in span}
    assert mine.tolist() == sorted(b for b in blocks if not reserved[b])
    if ids.size:  # (a row past the file's blocks is refused, never read past them in C)
        with pytest.raises(IndexError, match="lie outside a file of"):
            host_ops.unreserved(ids + reserved.size * block_bytes, row_bytes or 8,
                                block_bytes, reserved)


@settings(max_examples=40, deadline=None)
@given(ids=st.lists(st.integers(-2, 30), min_size=1, max_size=120),
       num_rows=st.sampled_from([1, 7, 25]))
def test_the_hosts_numbering_is_the_devices_and_the_steps_own(ids, num_rows):
    ids = np.array(ids, np.int32)
    n = ids.size
    host = host_ops.number(ids, num_rows, native.host_library())
    device = stages._numbered(ops.convert_to_tensor(ids), n, num_rows)
    for mine, theirs in zip(host, device):
        np.testing.assert_array_equal(mine, ops.convert_to_numpy(theirs))
    if IN_STEP:  # (the same numbering compiled into a step: FFI call, TensorFlow op)
        if JAX:
            import jax

            in_step = jax.jit(lambda i: sparseopt.backend.number_ids(i, num_rows))(ids)
        else:
            import tensorflow as tf

            in_step = tf.function(lambda i: sparseopt.backend.number_ids(i, num_rows))(ids)
        assert len(in_step) == 4
        for mine, theirs in zip(host, in_step):
            np.testing.assert_array_equal(mine, np.asarray(theirs))


def _trained_on_disk(path, steps=6):
    """A model with a table on disk trained by `fit`: its rows and accumulator at the end."""
    keras.utils.set_random_seed(0)
    x = keras.Input((4,), dtype="int32")
    emb = sparseopt.layers.SparseEmbedding(
        30, 3, sparseopt.updaters.RowwiseAdagrad(0.1), combiner="sum", name="t",
        storage=OnDisk(str(path), cache_rows=8))
    model = keras.Model(x, keras.layers.Dense(1)(emb(x)))
    model.compile(optimizer=sparseopt.DispatchOptimizer("adam"), loss="mse")
    rng = np.random.default_rng(3)
    ids = rng.integers(-2, 32, (8 * steps, 4)).astype("int32")  # (repeats, invalid ids)
    model.fit(ids, rng.normal(size=(8 * steps, 1)), batch_size=8, shuffle=False, verbose=0)
    out = emb.embeddings.rows_read(), emb.embeddings.numpy("accumulator")
    emb.embeddings.close()
    return out


def test_a_step_on_disk_numbers_its_ids_in_the_step_not_a_host_call(tmp_path, monkeypatch):
    # On CPU the step's numbering is compiled into the step (JAX: an FFI call;
    # TensorFlow: an op), with no Python host call, which crossed into Python every
    # step; without it (the backend's seam giving none, as with the `disk_number` /
    # `tf_disk_number` switch off: tests/test_native*.py check the switches), the host
    # call numbers them. Counted through `fit`: the same tables either way, bit for bit.
    calls = []
    numbered = host_ops.number

    def counted(*args):
        calls.append(1)
        return numbered(*args)

    monkeypatch.setattr(host_ops, "number", counted)
    ffi_rows = _trained_on_disk(tmp_path / "ffi")
    assert (len(calls) == 0) == IN_STEP, len(calls)
    monkeypatch.setattr(sparseopt.backend, "number_ids", lambda ids, num_rows: None)
    host_rows = _trained_on_disk(tmp_path / "host")
    assert len(calls) > 0
    for mine, theirs in zip(ffi_rows, host_rows):
        np.testing.assert_array_equal(mine, theirs)


cache_ops = st.lists(st.tuples(st.sampled_from(["read", "write", "drain", "flush", "peek"]),
                               st.lists(st.integers(0, 39), min_size=1, max_size=12,
                                        unique=True),
                               st.integers(0, 2**16)), min_size=1, max_size=25)


@independent
@settings(max_examples=60, deadline=None)
@given(ops_=cache_ops, cache_rows=st.sampled_from([1, 3, 8, 16]),
       ways=st.sampled_from([1, 2, 4]), policy=st.sampled_from(["lru", "lfu"]))
def test_the_native_cache_changes_what_numpys_changes(tmp_path_factory, ops_, cache_rows,
                                                      ways, policy):
    lib = native.host_library()
    caches = [RowCache(make_files(tmp_path_factory.mktemp("numpy")), cache_rows, policy, ways),
              NativeRowCache(make_files(tmp_path_factory.mktemp("native")), cache_rows,
                             policy, ways, lib=lib)]
    for op, ids, seed in ops_:
        ids = np.array(ids)
        rng = np.random.default_rng(seed)
        values = {"rows": rng.normal(size=(len(ids), 3)).astype(np.float32),
                  "acc": rng.uniform(size=len(ids)), "last": rng.integers(0, 9, len(ids))}
        results = []
        for cache in caches:
            if op == "read":
                results.append(cache.read(ids))
            elif op == "peek":
                results.append(cache.peek(ids))
            elif op == "write":
                cache.write(ids, {n: v.astype(cache.data[n].dtype) for n, v in values.items()})
            else:
                getattr(cache, op)()
        for mine, numpy_ in zip(results[1:], results[:1]):
            for name in numpy_:
                np.testing.assert_array_equal(mine[name], numpy_[name])
        numpy_cache, native_cache = caches
        for name in ("tags", "dirty", "last", "uses", "tick", "counts"):
            np.testing.assert_array_equal(getattr(native_cache, name),
                                          getattr(numpy_cache, name), err_msg=name)
        for name in numpy_cache.data:
            np.testing.assert_array_equal(native_cache.data[name], numpy_cache.data[name])
    for cache in caches:
        cache.flush()
    every = np.arange(40)
    numpy_files, native_files = (c.files.read(every, counted=False) for c in caches)
    for name in numpy_files:
        np.testing.assert_array_equal(native_files[name], numpy_files[name])
    np.testing.assert_array_equal(caches[1].files.written, caches[0].files.written)
    assert caches[1].files.counts() == caches[0].files.counts()
    for cache in caches:
        cache.files.close()


def _apply(cache, op, ids, seed):
    """One of `cache_ops`' operations on `cache`; a write's `(ids, values)`, else None."""
    rng = np.random.default_rng(seed)
    if op == "write":
        values = {"rows": rng.normal(size=(len(ids), 3)), "acc": rng.uniform(size=len(ids)),
                  "last": rng.integers(0, 9, len(ids))}
        values = {n: v.astype(cache.data[n].dtype) for n, v in values.items()}
        cache.write(ids, values)
        return ids.astype(np.int64), values
    if op in ("read", "peek"):
        getattr(cache, op)(ids)
    else:
        getattr(cache, op)()
    return None


def _fetched(cache, ids):
    """A `Foreseen` batch of distinct `ids`, fetched through `cache` as a table's fetch
    ahead fetches it (`DiskTable._fetch`)."""
    entry = Foreseen(ids)
    entry.distinct = host_ops.distinct(ids, 40)
    entry.found = cache.read_distinct(entry.distinct.ids)
    return entry


@independent
@settings(max_examples=60, deadline=None)
@given(ops_=cache_ops, wanted=st.lists(st.integers(0, 39), min_size=1, max_size=12,
                                       unique=True),
       at=st.integers(0, 25), cache_rows=st.sampled_from([1, 3, 8, 16]),
       kind=st.sampled_from(["numpy", "native"]))
def test_values_fetched_ahead_and_brought_up_to_date_by_the_writes_after_are_current(
        tmp_path_factory, ops_, wanted, at, cache_rows, kind):
    # A shortcut (the cache alone, not `fit`): what may come between a fetch ahead and the
    # read that takes its values (writes, reads, evictions, drains, flushes) is drawn
    # here, which no step's order produces at will. The values the fetch found, each
    # write after brought up to date (`Foreseen.take_written`, as a table's writes do),
    # are what a look at the rows then finds (`peek`: the cache, else the files).
    files = make_files(tmp_path_factory.mktemp("t"))
    cache = (RowCache(files, cache_rows, ways=2) if kind == "numpy" else
             NativeRowCache(files, cache_rows, ways=2, lib=native.host_library()))
    wanted, entry = np.array(wanted, np.int64), None
    for k, (op, ids, seed) in enumerate(ops_):
        if k == at:
            entry = _fetched(cache, wanted)
        written = _apply(cache, op, np.array(ids), seed)
        if entry is not None and written is not None:
            entry.take_written(*written)
    entry = entry or _fetched(cache, wanted)
    expected = cache.peek(wanted)
    for name in expected:
        np.testing.assert_array_equal(entry.found[name], expected[name], err_msg=name)
    files.close()


@independent
def test_a_staged_row_is_read_back_from_the_stage_never_stale_files(tmp_path):
    """An evicted dirty row waits in the stage until drained; a miss of it must not read
    the files' old values."""
    cache = NativeRowCache(make_files(tmp_path), cache_rows=1, ways=1,
                           lib=native.host_library())
    new = {"rows": np.full((1, 3), 7.0, np.float32),
           "acc": np.full((1,), 2.0, cache.data["acc"].dtype), "last": np.full((1,), 5, np.int32)}
    cache.write(np.array([3]), new)
    cache.read(np.array([4]))  # evicts 3 (dirty) into the stage
    assert cache._staged[0] == 1 and not cache.files.is_written(np.array([3]))[0]
    got = cache.read(np.array([3]))  # a miss: the stage is drained first
    np.testing.assert_array_equal(got["rows"], new["rows"])
    assert got["last"][0] == 5 and cache.files.is_written(np.array([3]))[0]


@independent
def test_a_full_disk_fails_the_write_that_dirties_a_row_before_anything_changes(
        tmp_path, monkeypatch):
    for native_on in (True, False):
        folder = tmp_path / str(native_on)
        if native_on:
            cache = make_cache(make_files(folder), 8)
        else:
            with native.disabled():
                cache = make_cache(make_files(folder), 8)
        assert isinstance(cache, NativeRowCache) == native_on
        before = {n: getattr(cache, n).copy() for n in ("tags", "dirty", "last", "tick")}

        def no_room(fd, offset, length):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        with monkeypatch.context() as patched:
            patched.setattr(os, "posix_fallocate", no_room)
            with pytest.raises(OSError, match="emb/t: no room on disk"):
                cache.write(np.array([1, 2]), {
                    "rows": np.zeros((2, 3), np.float32),
                    "acc": np.zeros((2,), cache.data["acc"].dtype),
                    "last": np.zeros((2,), np.int32)})
        for name, value in before.items():
            np.testing.assert_array_equal(getattr(cache, name), value)
        cache.files.close()


@independent
def test_a_failed_background_job_is_raised_by_the_next_wait_and_later_jobs_still_run():
    background, ran = Background("t"), []

    def fails():
        raise OSError(errno.ENOSPC, "Table 't': no room on disk")
    background.submit(lambda: ran.append(1))
    background.submit(fails)
    background.submit(lambda: ran.append(3))
    with pytest.raises(OSError, match="no room on disk"):
        background.wait()
    assert ran == [1, 3]
    background.wait()  # (raised once)


@independent
def test_the_thread_beside_the_step_keeps_nothing_of_a_job_once_it_ran():
    """A job holds a table's cache and files (their folder's lock): once run, nothing of
    it may stay reachable from the thread, or a dropped table would keep its folder."""
    import gc
    import weakref

    class Held:
        pass

    background, held = Background("t"), Held()
    gone = weakref.ref(held)
    background.submit(lambda held=held: None)
    background.wait()
    del held
    gc.collect()
    assert gone() is None
    background.close()
    with pytest.raises(RuntimeError, match="closed"):
        background.submit(lambda: None)
