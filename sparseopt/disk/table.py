"""`DiskTable`: what a layer holds for a table on disk, in place of its `[V, D]` variable.

It has what the optimizer and the lookup ask of a table (`path`, `name`,
`shape`, `dtype`) and owns the table's files (`RowFiles`: the rows, then
one column per per-row slot of its updater) and their cache (`RowCache`).
Traced code reaches them through host calls (`backend.host_read`,
`backend.host_write`: JAX callbacks, TensorFlow `numpy_function`s), so a
compiled step reads and writes a step's rows where they live:

- reads take any ids (a batch's, with repeats and invalid ones): each
  distinct valid id is read once through the cache; invalid ids read zeros.
  A read of rows all read since the last write (the optimizer's read of the
  rows its step's lookups read) takes them from that read, not the cache
  again: the cache's counts are the lookups';
- writes take a step's distinct rows (entries from `count` on, ids outside
  the table and, where given, entries `keep` leaves out are not written);
  columns a write leaves out keep their values.

Values cross the host boundary as float32 (int32 for integer state), which
holds every 16-bit value exactly: the stored dtype is the files'.
"""

import logging
import weakref

import numpy as np
from keras import ops

from sparseopt import backend
from sparseopt.disk import snapshots
from sparseopt.disk.initial_rows import InitialRows
from sparseopt.disk.row_cache import RowCache
from sparseopt.disk.row_files import Column, RowFiles

ROWS = "rows"  # the column of the table's own values


class DiskTable:
    """A table's rows and per-row optimizer state in files, hot rows cached in memory.

    Args:
        path: the table's path, as its variable's would be (`"layer/embeddings"`).
        shape: `(V, D)`.
        dtype: the rows' dtype (`"float32"`, `"bfloat16"` or `"float16"`).
        initializer: the Keras initializer whose distribution unwritten rows
            are drawn from (`sparseopt.disk.initial_rows.InitialRows`).
        slots: the table's per-row `SlotSpec`s (its updater's), each a column.
        settings: its `sparseopt.storage.OnDisk`.
    """

    trainable = False  # (never a variable an optimizer is handed)

    def __init__(self, path, shape, dtype, initializer, slots, settings):
        self.path, self.name = path, path.split("/")[-1]
        self.shape, self.dtype = tuple(int(d) for d in shape), str(dtype)
        self.settings = settings
        owner = f"Table '{path}'"
        initial = InitialRows(initializer, self.shape[1], owner=owner)
        columns = {ROWS: Column(self.shape[1:], self.dtype, initial)}
        for spec in slots:
            columns[spec.name] = Column(spec.shape(self.shape)[1:],
                                        spec.dtype_for(settings.state_dtype), spec.initial_value)
        self._owner, self._columns = owner, columns
        self._describe = {"initial": initial.get_config()}
        self._open()

    def _open(self):
        """Opens the files and a new, empty cache over them."""
        self.files = RowFiles(self.settings.path, self.shape[0], self._columns,
                              owner=self._owner, describe=self._describe)
        self._new_cache()

    def _new_cache(self):
        """A new, empty cache over the files, written back when the table is dropped or
        Python exits (training outside `fit`, whose end flushes, keeps its rows)."""
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer.detach()
        self.cache = RowCache(self.files, self.settings.cache_rows, self.settings.policy)
        self._finalizer = weakref.finalize(self, _flush_at_exit, self.cache)
        # `(sorted distinct ids, {column: values})` of the last read, until the next
        # write: the optimizer's read of a step's rows is the lookups' (`_recent`).
        self._last_read = None

    @property
    def columns(self):
        """`{name: Column}`: the rows (`ROWS`), then each per-row slot."""
        return self.files.columns

    def carried_dtype(self, name):
        """The dtype a column's values cross the host boundary in: float32, or int32.

        Args:
            name: the column.
        """
        return "int32" if "int" in self.columns[name].dtype else "float32"

    # -- from traced code --------------------------------------------------

    def read(self, ids, names=(ROWS,)):
        """The values of columns `names` at `ids`: a tuple of `ids.shape + tail` tensors
        (float32, or int32 for integer state); ids outside the table read zeros.

        Args:
            ids: int ids, any shape (a batch's: repeats and invalid ids allowed).
            names: the columns (`"rows"`, per-row slots' names).
        """
        shape = tuple(ids.shape)
        outputs = [(shape + self.columns[n].tail, self.carried_dtype(n)) for n in names]

        def read(ids):
            return self._read_host(np.asarray(ids), names)

        return backend.host_read(read, [ops.cast(ids, "int32")], outputs)

    def write(self, ids, values, count=None, keep=None):
        """Writes `values` (`{column: [M, *tail]}`, as stored) of distinct rows `ids` (`[M]`).

        Args:
            ids: int `[M]`; those outside the table are not written.
            values: some of the columns; the others keep their values.
            count: int scalar: entries from `count` on are not written; None: all.
            keep: boolean `[M]`: only entries where it holds are written (ids
                may then repeat, with equal values); None: all.
        """
        names = sorted(values)
        size = ops.shape(ids)[0]
        count = size if count is None else count
        keep = ops.ones((size,), "bool") if keep is None else keep
        args = [ops.cast(ids, "int32"), ops.cast(count, "int32"), ops.cast(keep, "bool")]
        args += [ops.cast(values[n], self.carried_dtype(n)) for n in names]

        def write(ids, count, keep, *arrays):
            self._write_host(np.asarray(ids), int(count), np.asarray(keep),
                             dict(zip(names, arrays)))

        backend.host_write(write, args)

    # -- on the host -------------------------------------------------------

    def _read_host(self, ids, names):
        flat = ids.reshape(-1).astype(np.int64)
        valid = (flat >= 0) & (flat < self.shape[0])
        wanted, where = np.unique(flat[valid], return_inverse=True)
        found = self._recent(wanted)
        if found is None:
            found = self.cache.read(wanted)
            with self.cache.lock:
                self._last_read = (wanted, found)
        out = []
        for name in names:
            col = self.columns[name]
            values = np.zeros((flat.size,) + col.tail, self.carried_dtype(name))
            values[valid] = found[name][where].astype(values.dtype)
            out.append(values.reshape(ids.shape + col.tail))
        return tuple(out)

    def _recent(self, wanted):
        """`{column: values}` of `wanted` (sorted distinct ids) from the last read, where it
        read them all and nothing was written since; else None."""
        with self.cache.lock:
            last = self._last_read
        if last is None or wanted.size == 0:
            return None
        ids, values = last
        at = np.minimum(np.searchsorted(ids, wanted), max(ids.size - 1, 0))
        if ids.size == 0 or not np.array_equal(ids[at], wanted):
            return None
        return {name: array[at] for name, array in values.items()}

    def _write_host(self, ids, count, keep, values):
        with self.cache.lock:
            self._last_read = None  # (its values are no longer current)
        ids = ids.astype(np.int64)
        take = (np.arange(ids.size) < count) & keep & (ids >= 0) & (ids < self.shape[0])
        ids, first = np.unique(ids[take], return_index=True)  # (repeats hold equal values)
        if ids.size == 0:
            return
        picked = np.flatnonzero(take)[first]
        kept = {n: np.asarray(v)[picked] for n, v in values.items()}
        missing = [n for n in self.columns if n not in kept]
        if missing:  # columns left out keep their values (a look, not a lookup: uncounted)
            old = self.cache.peek(ids)
            kept.update({n: old[n] for n in missing})
        self.cache.write(ids, {n: np.asarray(kept[n]).astype(self.files.maps[n].dtype)
                               for n in self.columns})

    # -- between steps -------------------------------------------------------

    def numpy(self, column=ROWS, ids=None):
        """The current values of `column` (the rows, or a per-row slot's name) at `ids`, as
        stored; reading changes nothing in the cache.

        Args:
            column: `"rows"` or a per-row slot's name.
            ids: int row ids; None: every row (a table's worth of memory).
        """
        ids = np.arange(self.shape[0]) if ids is None else ids
        return self.cache.peek(ids)[column]

    def flush(self):
        """Writes the cache's dirty rows to the files, and the files to disk."""
        self.cache.flush()

    def close(self):
        """Writes the cache's rows to the files and lets the folder go (its lock
        released): another table may open it then. The table is unusable after."""
        with self.cache.lock:
            self.cache.flush()
            self._finalizer.detach()
            self.files.close()

    def snapshot(self):
        """Writes the cache's rows to the files, then copies the files into a new snapshot
        (`sparseopt.disk.snapshots.take`); its name. What a save of the table holds."""
        with self.cache.lock:
            self.cache.flush()
            return snapshots.take(self.settings.path, self.files.names)

    def restore(self, snapshot):
        """Makes the table what snapshot `snapshot` holds (its files copied back, the cache
        emptied: its rows were the table's before).

        Args:
            snapshot: the snapshot's name (`snapshot`'s).

        Raises:
            ValueError: the snapshot is missing, incomplete, or another table's.
        """
        with self.cache.lock:
            try:
                snapshots.restore(self.settings.path, snapshot, self.files.names, self._owner)
            finally:
                # Whatever happened, the maps follow the files there now (a restore
                # that failed before its renames left them as they were), the lock
                # stays, and the old cache's rows were the table's before.
                self._last_read = None
                self.files.reopen()
                self._new_cache()

    def snapshots(self):
        """The names of the table's complete snapshots, oldest first."""
        return snapshots.listed(self.settings.path)

    def remove_snapshots(self, keep):
        """Removes all but the `keep` newest snapshots (files that refer to the others can
        then no longer be loaded); the names removed.

        Args:
            keep: how many of the newest to keep.
        """
        return snapshots.remove(self.settings.path, keep)

    def health(self):
        """The cache's counts so far (`RowCache.health`: hits, misses, hit rate, rows and
        bytes read from and written to the files)."""
        return self.cache.health()


def _flush_at_exit(cache):
    """Writes a dropped table's cache to its files (a finalizer must not raise: it logs)."""
    try:
        cache.flush()
    except Exception as error:  # noqa: BLE001
        logging.getLogger("sparseopt.disk").error(
            "%s: its cached rows could not be written to its files when it was dropped: %s",
            cache.files.owner, error)
