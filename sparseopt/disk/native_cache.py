"""`NativeRowCache`: `RowCache` whose reads, writes and evictions run in the host library.

The same arrays (tags, dirty flags, uses, ticks, rows), the same sets and
victims, the same counts: the library's loops (`so_cache_*` in
`sparseopt/native/disk_host.cc`) change them as `RowCache`'s NumPy passes
would (tests/test_disk_native.py compares the two, array for array), in
one or two passes over a call's ids instead of a dozen (entries found, then
rows copied, the lines of the entries next asked for ahead).

Evicted dirty rows are staged: copied one after another into memory at
hand, and written into the files' memory maps (scattered writes, the
costly part) by `drain`, which a table on disk runs on a thread beside
the step (`sparseopt.disk.table`). Until drained, a staged row is in
neither the cache nor the files, so whatever reads the files (a miss, a
peek, a flush) drains first. `make_cache` picks this class where the host
library is on and built.
"""

import ctypes

import numpy as np

from sparseopt.disk import host_ops
from sparseopt.disk.row_cache import DEFAULT_WAYS, RowCache

_P = ctypes.c_void_p


class _Cache(ctypes.Structure):
    """The library's `SoCache`: pointers into a `NativeRowCache`'s arrays."""

    _fields_ = [("tags", _P), ("dirty", _P), ("last", _P), ("uses", _P), ("rounds", _P),
                ("sets", ctypes.c_int64), ("ways", ctypes.c_int64), ("lfu", ctypes.c_int64),
                ("columns", ctypes.c_int64), ("data", _P), ("row_bytes", _P), ("files", _P),
                ("written", _P), ("tick", _P), ("counts", _P), ("stage_ids", _P),
                ("stage", _P), ("stage_capacity", ctypes.c_int64), ("staged", _P)]


def make_cache(files, cache_rows, policy="lru", ways=DEFAULT_WAYS):
    """A `NativeRowCache` where the host library is on and built, else a `RowCache`.

    Args:
        files, cache_rows, policy, ways: as for `RowCache`.
    """
    lib = host_ops.library()
    if lib is None:
        return RowCache(files, cache_rows, policy, ways)
    return NativeRowCache(files, cache_rows, policy, ways, lib=lib)


class NativeRowCache(RowCache):
    """A `RowCache` run by the host library (`lib`: its ctypes library).

    Args:
        files, cache_rows, policy, ways: as for `RowCache`.
        lib: the loaded host library (`sparseopt.native.host_library()`).
    """

    def __init__(self, files, cache_rows, policy="lru", ways=DEFAULT_WAYS, *, lib):
        super().__init__(files, cache_rows, policy, ways)
        self._lib = lib
        self._names = list(self.data)
        self._rounds = np.zeros((self.sets,), np.int64)
        self._staged = np.zeros((1,), np.int64)
        # The files' maps are held here too: the library writes into them for as
        # long as this cache lives, even after the files let them go.
        self._maps = [files.maps[n] for n in self._names] + [files.written]
        row_bytes = np.array([host_ops.row_bytes(self.data[n]) for n in self._names], np.int64)
        data = self._columns(self.data)
        maps = (_P * len(self._names))(*(m.ctypes.data for m in self._maps[:-1]))
        self._held = [row_bytes, data, maps]
        self._cache = _Cache(
            self.tags.ctypes.data, self.dirty.ctypes.data, self.last.ctypes.data,
            self.uses.ctypes.data, self._rounds.ctypes.data, self.sets, self.ways,
            int(self.policy == "lfu"), len(self._names), ctypes.addressof(data),
            row_bytes.ctypes.data, ctypes.addressof(maps), self._maps[-1].ctypes.data,
            self.tick.ctypes.data, self.counts.ctypes.data, None, None, 0,
            self._staged.ctypes.data)
        self._stage_room(1024)

    def _columns(self, arrays):
        """A ctypes array of pointers to `arrays[name]` (C-contiguous), column by column."""
        return (_P * len(self._names))(*(arrays[n].ctypes.data for n in self._names))

    def _stage_room(self, rows):
        """Room in the stage for `rows` more evicted rows (grown, keeping what waits)."""
        have, waiting = self._cache.stage_capacity, int(self._staged[0])
        if waiting + rows <= have:
            return
        capacity = max(2 * have, waiting + rows)
        ids = np.empty((capacity,), np.int64)
        stage = {n: np.empty((capacity,) + a.shape[1:], a.dtype) for n, a in self.data.items()}
        if waiting:
            ids[:waiting] = self._stage_ids[:waiting]
            for name in stage:
                stage[name][:waiting] = self._stage[name][:waiting]
        self._stage_ids, self._stage = ids, stage
        pointers = self._columns(stage)
        self._held.append(pointers)  # (the struct points into it)
        self._cache.stage_ids, self._cache.stage = ids.ctypes.data, ctypes.addressof(pointers)
        self._cache.stage_capacity = capacity

    def drain(self):
        """Writes the staged evicted rows into the files."""
        with self.lock:
            if self._staged[0]:
                self.files.rows_written += int(self._lib.so_stage_flush(
                    ctypes.byref(self._cache)))

    def read_distinct(self, ids):
        ids = np.ascontiguousarray(ids, np.int64)
        with self.lock:
            out = {n: np.empty((ids.size,) + a.shape[1:], a.dtype) for n, a in self.data.items()}
            columns = self._columns(out)
            missed = self._hits(self._lib.so_cache_read, ids, columns)
            if missed.size:
                self.drain()  # (a staged row is in neither the cache nor the files)
                self._from_files(ids, missed, columns, out)
                self._insert_at(ids, missed, columns, dirty=False)
            return out

    def _from_files(self, ids, at, columns, out):
        """Rows `ids[at]` (uncached) into rows `at` of `out`, as `RowFiles.read` gives
        them: copied from the files' maps in one pass of the library's where written
        (counted as read), drawn where never written (`RowFiles.draw_into`).

        Args:
            ids: int64 distinct rows of the table (`read_distinct`'s: unchecked).
            at: int64 indices into `ids` of the rows to read.
            columns: the pointers to `out`'s columns (`_columns(out)`).
            out: `{column: values}` of `ids`, written at rows `at`.
        """
        fresh = np.empty(at.size, np.int64)
        count = self._lib.so_files_read(ctypes.byref(self._cache), host_ops.ptr(ids),
                                        host_ops.ptr(at), ctypes.c_int64(at.size), columns,
                                        host_ops.ptr(fresh))
        self.files.rows_read += int(at.size - count)
        if count:
            self.files.draw_into(out, ids, fresh[:count])

    def peek(self, ids):
        with self.lock:
            self.drain()
            return super().peek(ids)

    def write_distinct(self, ids, values):
        ids = np.ascontiguousarray(ids, np.int64)
        values = {n: np.ascontiguousarray(values[n], self.data[n].dtype) for n in self._names}
        for name, value in values.items():  # (the library copies rows of these sizes)
            want = (ids.size,) + self.data[name].shape[1:]
            if value.shape != want:
                raise ValueError(f"{self.files.owner}: a write of column '{name}' has shape "
                                 f"{value.shape}, not {want}.")
        with self.lock:
            self.files.reserve(ids)  # (before any row is dirty: see RowCache)
            columns = self._columns(values)
            missed = self._hits(self._lib.so_cache_write, ids, columns)
            if missed.size:
                self._insert_at(ids, missed, columns, dirty=True)

    def _hits(self, call, ids, columns):
        """`call` (`so_cache_read` or `so_cache_write`) on distinct `ids`; the indices of
        the ids not cached."""
        missed = np.empty(ids.size, np.int64)
        count = call(ctypes.byref(self._cache), host_ops.ptr(ids), ctypes.c_int64(ids.size),
                     columns, host_ops.ptr(missed))
        return missed[:count]

    def _insert_at(self, ids, at, columns, dirty):
        """Caches rows `ids[at]` with rows `at` of `columns`, evicting (staging) others."""
        at = np.ascontiguousarray(at, np.int64)
        self._stage_room(at.size)  # (each insert evicts at most one row)
        if self._lib.so_cache_insert(ctypes.byref(self._cache), host_ops.ptr(ids),
                                     host_ops.ptr(at), ctypes.c_int64(at.size), columns,
                                     ctypes.c_int64(int(dirty))) < 0:
            raise RuntimeError(f"{self.files.owner}: the cache's stage had no room for the "
                               "rows it would evict (none was cached)")

    def flush(self):
        with self.lock:
            self.drain()
            self.files.rows_written += int(self._lib.so_cache_flush(ctypes.byref(self._cache)))
            self.files.flush()
