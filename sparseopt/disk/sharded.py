"""`ShardedDiskTable`: a table on disk split by rows into shards, each with its own files,
cache and thread.

Where a `keras.distribution` splits a table on disk by rows over `n` devices
(its path in the `LayoutMap`, as `sparseopt.distribution.row_sharded` puts
it), the table is kept as `n` shards: shard `k` holds rows
`[k V // n, (k+1) V // n)` (`V` rows: sizes differ by one row at most) in
its own folder `<path>/shard-k-of-n` (its own files, snapshots and lock), a
cache of `cache_rows // n` rows and its own thread beside the step, so the
shards' writes and evictions run side by side. In one process the host holds
every shard: the step's host calls route each id to its shard on the host
(the device side is the same as for a table on disk that is not split).
Rows never written are drawn as the whole table's rows (each shard knows
where it starts), so a table trains to the same values split or whole.

It is a `DiskTable` to everything that uses one (the lookup, the optimizer's
storage, callbacks): each host-side method routes to the shards.
"""

import dataclasses
import os

import numpy as np

from sparseopt.disk import layout, snapshots
from sparseopt.disk.table import DiskTable, whole_work_failed

SHARD = "shard-{k}-of-{n}"


class ShardedDiskTable(DiskTable):
    """A table's rows and per-row state split by rows over `shards` `DiskTable`s.

    Args:
        path, shape, dtype, initializer, slots, settings: as for `DiskTable`
            (`settings.path` the folder that holds the shards' folders,
            `settings.cache_rows` the rows all shards' caches hold together).
        shards: how many shards (at least 2, at most the table's rows).
    """

    def __init__(self, path, shape, dtype, initializer, slots, settings, shards):
        # (No files of its own: each shard opens its own folder.)
        self.path, self.name = path, path.split("/")[-1]
        self.shape, self.dtype = tuple(int(d) for d in shape), str(dtype)
        self.settings, self.int8, self.first_row = settings, str(dtype) == "int8", 0
        self._owner = f"Table '{path}'"
        count, rows = int(shards), self.shape[0]
        if not 2 <= count <= rows:
            raise ValueError(f"{self._owner}: a table on disk is split into 2 to {rows} shards "
                             f"(its rows), not {count}.")
        # Shard k: rows [k V // n, (k+1) V // n) (sizes differ by one row at most).
        self.starts = np.array([k * rows // count for k in range(count + 1)], np.int64)
        self._closed, self._failed = False, None
        self._in_step = 0.0  # (seconds in its host calls: `health`)
        self.shards = []
        # The folder: locked while open (as a table's own), and saying it holds this
        # table in `count` shards (a folder of the table whole, or in another number
        # of shards, is refused: its rows would not be these).
        self._lock = layout.claim(settings.path, self._owner, count, self.shape)
        try:
            for k in range(count):
                own = dataclasses.replace(
                    settings, path=os.path.join(settings.path, SHARD.format(k=k, n=count)),
                    cache_rows=max(1, settings.cache_rows // count))
                self.shards.append(DiskTable(
                    path, (int(self.starts[k + 1] - self.starts[k]),) + self.shape[1:], dtype,
                    initializer, slots, own, first_row=int(self.starts[k])))
        except BaseException:
            try:
                self._close_shards()  # (their folders' locks let go)
            finally:
                self._lock.close()
            raise

    @property
    def columns(self):
        return self.shards[0].columns

    def parts(self):
        return list(self.shards)

    def _routes(self, ids):
        """`(shard, positions, local ids)` of every shard: where in the flat `ids` its rows
        are, and their rows in it (ids outside the table go to none)."""
        flat = np.asarray(ids, np.int64).reshape(-1)
        owner = np.where((flat >= 0) & (flat < self.shape[0]),
                         np.searchsorted(self.starts, flat, side="right") - 1, -1)
        for k, shard in enumerate(self.shards):
            at = np.flatnonzero(owner == k)
            yield shard, at, flat[at] - self.starts[k]

    # -- from traced code (the host calls `DiskTable`'s traced methods make) --

    def _read_host(self, ids, names, lookup=False):
        self._check_open()
        # (Every shard is called, with no ids too: its batches shown ahead go step by
        # step; with none it reads nothing and keeps its last read.)
        return self._routed(ids, names, lambda shard, local: shard._read_host(local, names,
                                                                                lookup))

    def _look_host(self, ids, names):
        self._check_open()
        return self._routed(ids, names, lambda shard, local: shard._look_host(local, names))

    def _routed(self, ids, names, read):
        """Columns `names` at `ids` (zeros where outside the table), each shard's by
        `read(shard, local ids)`."""
        out = [np.zeros((ids.size,) + self.columns[n].tail, self.carried_dtype(n))
               for n in names]
        for shard, at, local in self._routes(ids):
            for values, got in zip(out, read(shard, local)):
                values[at] = got
        return tuple(v.reshape(ids.shape + self.columns[n].tail) for v, n in zip(out, names))

    def _write_host(self, ids, count, keep, values):
        self._check_open()
        count = min(max(count, 0), ids.size)
        ids, keep = np.asarray(ids)[:count], np.asarray(keep)[:count]
        values = {n: np.asarray(v)[:count] for n, v in values.items()}
        for shard, at, local in self._routes(ids):
            shard._write_host(local, at.size, keep[at], {n: v[at] for n, v in values.items()})

    # -- on the host -------------------------------------------------------

    def ahead(self, ids):
        if self._closed:
            return
        for shard, _, local in self._routes(ids):  # (as the lookup will route them)
            shard.ahead(local)

    def numpy(self, column="rows", ids=None):
        self._check_open()
        ids = np.arange(self.shape[0]) if ids is None else np.asarray(ids, np.int64).reshape(-1)
        outside = ids[(ids < 0) | (ids >= self.shape[0])]
        if outside.size:
            raise IndexError(f"{self._owner}: row {outside[0]} is outside the table's "
                             f"{self.shape[0]} rows.")
        parts = [(at, shard.numpy(column, local)) for shard, at, local in self._routes(ids)]
        out = np.empty((ids.size,) + parts[0][1].shape[1:], parts[0][1].dtype)
        for at, values in parts:
            out[at] = values
        return out

    def each_part(self, work, rows_per_part=None, writes=True):
        """`DiskTable.each_part` over the whole table's parts (a part may lie on two shards:
        parts fall where they would on the table whole, so the work computes the same)."""
        rows_per_part = self._part_rows(rows_per_part)
        self._check_open()
        for shard in self.shards:
            shard._before_whole(writes)
        for start in range(0, self.shape[0], rows_per_part):
            ids = np.arange(start, min(start + rows_per_part, self.shape[0]), dtype=np.int64)
            routes = list(self._routes(ids))
            stored = {n: np.empty((ids.size,) + self.shards[0].files.maps[n].shape[1:],
                                  self.shards[0].files.maps[n].dtype) for n in self.columns}
            for shard, at, local in routes:
                for name, values in shard.files.read(local).items():
                    stored[name][at] = values
            new = work(ids, stored)
            if new is None:
                continue
            if not writes:
                raise ValueError(f"{self._owner}: work said to only read wrote rows.")
            try:
                for shard, at, local in routes:  # (disk for the whole part first, as whole)
                    shard.files.reserve(local)
                for shard, at, local in routes:
                    shard.files.write(local, {n: new[n][at] for n in self.columns})
            except OSError as error:
                raise whole_work_failed(self._owner, start, error) from error

    def flush(self):
        self._check_open()
        for shard in self.shards:
            shard.flush()

    def _check_open(self):
        self._check_not_closed()
        if self._failed is not None:
            raise RuntimeError(
                f"{self._owner}: a load renamed some of its shards' files and not others "
                f"({self._failed}): its shards hold two moments. Load the save again (its "
                "snapshot is whole) to go on.") from self._failed
        for shard in self.shards:
            shard._check_open()

    def _settle(self, in_step=False):
        for shard in self.shards:
            shard._settle(in_step)

    def close(self):
        if self._closed:
            return
        self._closed = True
        try:
            errors = self._close_shards()
        finally:
            self._lock.close()
        if errors:
            raise errors[0]

    def _close_shards(self):
        """Closes every shard, whatever another raised; the errors raised."""
        errors = []
        for shard in self.shards:
            try:
                shard.close()
            except Exception as error:  # noqa: BLE001 (the caller raises the first)
                errors.append(error)
        return errors

    def snapshot(self):
        """A snapshot of every shard, of one name (their files as this save sees them)."""
        self._check_open()
        number = max(snapshots.next_number(s.settings.path) for s in self.shards)
        names = {shard.snapshot(at_least=number) for shard in self.shards}
        assert len(names) == 1, names  # (the folders are locked: none numbers meanwhile)
        return names.pop()

    def restore(self, snapshot):
        """Makes every shard what snapshot `snapshot` holds: every shard's snapshot is
        checked, then every shard's files copied beside its live ones, before any is
        replaced (a load that fails before leaves the table as it was).

        Raises:
            ValueError: a shard's snapshot is missing, incomplete or another table's.
        """
        self._check_not_closed()
        for shard in self.shards:
            snapshots.check(shard.settings.path, snapshot, shard.files.names, shard._owner)
        staged = []
        try:
            for shard in self.shards:
                shard._before_restore()
                staged.append(snapshots.stage(shard.settings.path, snapshot, shard.files.names,
                                              shard._owner))
        except BaseException:
            for files in staged:
                snapshots.unstage(files)
            raise
        # Renamed shard by shard, every shard whatever another raised (rolled forward: a
        # shard left behind would mix two moments; its copies stay for a load again).
        errors = []
        for shard, files in zip(self.shards, staged):
            try:
                shard._replace_files(lambda s=shard, f=files: snapshots.commit(s.settings.path,
                                                                                f),
                                     loaded=snapshot)
            except Exception as error:  # noqa: BLE001 (raised once every shard was tried)
                errors.append(error)
        # (Mixed, it must neither train nor be saved: `_check_open` refuses until a load.)
        self._failed = errors[0] if errors else None
        if errors:
            raise errors[0]

    def snapshots(self):
        """The names of the snapshots every shard holds complete, oldest first (a save
        interrupted between shards leaves its name in some only: never loaded)."""
        held = [set(shard.snapshots()) for shard in self.shards]
        return sorted(set.intersection(*held))

    def remove_snapshots(self, keep):
        """Removes all but the `keep` newest snapshots from every shard (and what a save
        interrupted between shards left in some); the names removed from all.

        Args:
            keep: how many of the newest to keep.
        """
        self._check_not_closed()
        whole = self.snapshots()
        kept = set(whole[max(len(whole) - int(keep), 0):])
        for shard in self.shards:
            snapshots.remove_named(shard.settings.path,
                                   [n for n in shard.snapshots() if n not in kept])
        return [n for n in whole if n not in kept]

    def health(self):
        """`DiskTable.health` summed over the shards: their caches' counts (a step's rows
        fetched ahead where every shard's were), the time waited for and spent on their
        threads (summed over the threads, which run side by side), and the time in the
        table's host calls."""
        stats = [shard.health() for shard in self.shards]
        out = {k: sum(s[k] for s in stats) for k in stats[0] if k != "hit_rate"}
        out["steps_fetched_ahead"] = min(s["steps_fetched_ahead"] for s in stats)
        looked = out["hits"] + out["misses"]
        out["hit_rate"] = out["hits"] / looked if looked else None
        out["host_ms"] = 1e3 * self._in_step
        return out
