"""`RowCache`: the hot rows of a table on disk, and their state, in memory.

A set-associative write-back cache (FBGEMM's and HugeCTR's layout): a row's
id picks one set (a hash of the id, so strided ids spread), and the row is
held in one of that set's `ways` entries. A row is read from the files when
missed, written to them only when evicted dirty (or at `flush`). Which entry
of a full set is evicted:

- `"lru"`: the one used longest ago;
- `"lfu"`: the one used least often since it was cached (ties: longest ago).

Every operation is vectorized over the ids of a call (NumPy), so a step's
cost follows its distinct ids; `NativeRowCache` (`native_cache.py`) does the
same in the host library's loops, to the same state. Disk for a row is
reserved before the row is first made dirty in the cache (`RowFiles.reserve`),
so a full disk fails the write that would make it dirty, before anything of
that write happened, and a write-back never needs new disk. Reads and writes
hold the cache's lock: the thread beside the step and the step may call it at once.
"""

import threading

import numpy as np

from sparseopt.disk.initial_rows import mix

POLICIES = ("lru", "lfu")
DEFAULT_WAYS = 8
_TICK_BITS = 40
# LFU's counts stop here, so that `uses << _TICK_BITS` stays a positive int64.
_MAX_USES = (1 << 22) - 1
# `RowCache.counts`: its reads' hits and misses (the host library adds to these two),
# then what a table on disk counts of its steps (`DiskTable`): the steps whose rows
# were fetched ahead, and the misses of steps' own reads.
HITS, MISSES, AHEAD, MISSED_AT_STEP = range(4)


class RowCache:
    """`cache_rows` rows of `files` (a `RowFiles`) and their state, in memory.

    Args:
        files: the table's `sparseopt.disk.row_files.RowFiles`.
        cache_rows: how many rows (with their state) memory holds; rounded
            down to whole sets of `ways` (at least one set).
        policy: `"lru"` or `"lfu"`.
        ways: entries per set.
    """

    def __init__(self, files, cache_rows, policy="lru", ways=DEFAULT_WAYS):
        if policy not in POLICIES:
            raise ValueError(f"{files.owner}: cache policy must be one of {POLICIES}, got "
                             f"{policy!r}.")
        if isinstance(cache_rows, bool) or int(cache_rows) != cache_rows or cache_rows < 1:
            raise ValueError(f"{files.owner}: `cache_rows` must be a positive int, got "
                             f"{cache_rows!r}.")
        self.files, self.policy = files, policy
        self.ways = max(1, min(int(ways), int(cache_rows)))
        self.sets = max(1, int(cache_rows) // self.ways)
        entries = self.sets * self.ways
        self.tags = np.full((self.sets, self.ways), -1, np.int64)  # row id, -1: empty
        self.dirty = np.zeros((self.sets, self.ways), bool)
        self.uses = np.zeros((self.sets, self.ways), np.int64)
        self.last = np.zeros((self.sets, self.ways), np.int64)
        self.data = {name: np.zeros((entries,) + col.tail, files.maps[name].dtype)
                     for name, col in files.columns.items()}
        self.tick = np.zeros((1,), np.int64)  # (arrays: the native cache writes them too)
        self.counts = np.zeros((4,), np.int64)  # HITS, MISSES, AHEAD, MISSED_AT_STEP
        self.lock = threading.RLock()

    @property
    def stats(self):
        """`{"hits", "misses", "steps_fetched_ahead", "missed_at_step"}` so far."""
        return {"hits": int(self.counts[HITS]), "misses": int(self.counts[MISSES]),
                "steps_fetched_ahead": int(self.counts[AHEAD]),
                "missed_at_step": int(self.counts[MISSED_AT_STEP])}

    @property
    def capacity(self):
        """How many rows the cache holds."""
        return self.sets * self.ways

    def set_of(self, ids):
        """The set each id is cached in (a hash of the id)."""
        return (mix(np.asarray(ids, np.int64).astype(np.uint64))
                % np.uint64(self.sets)).astype(np.int64)

    def _checked(self, ids):
        """`ids` as int64, refused if one is outside the table or repeats."""
        ids = self.files.check_ids(ids)
        # (Strictly increasing ids, as np.unique gives them, are distinct: no sort.)
        if not np.all(ids[1:] > ids[:-1]) and np.unique(ids).size != ids.size:
            raise ValueError(f"{self.files.owner}: the cache reads and writes distinct "
                             "rows; these ids repeat.")
        return ids

    def _find(self, ids):
        """`(sets, ways, hit)` of distinct `ids`: where each is cached, if it is."""
        sets = self.set_of(ids)
        match = self.tags[sets] == ids[:, None]
        return sets, np.argmax(match, axis=1), match.any(axis=1)

    def _touch(self, sets, ways):
        self.tick[0] += 1
        self.last[sets, ways] = self.tick[0]
        self.uses[sets, ways] = np.minimum(self.uses[sets, ways] + 1, _MAX_USES)

    def read(self, ids):
        """`{column: values [M, *tail]}` of distinct rows `ids` (int `[M]`), as stored.

        Missed rows are read from the files and cached (evicting others).
        """
        return self.read_distinct(self._checked(ids))

    def read_distinct(self, ids):
        """`read` of int64 ids known to be distinct rows of the table (unchecked)."""
        with self.lock:
            sets, ways, hit = self._find(ids)
            out = {n: np.empty((ids.size,) + a.shape[1:], a.dtype) for n, a in self.data.items()}
            slots = sets[hit] * self.ways + ways[hit]
            for name, array in self.data.items():
                out[name][hit] = array[slots]
            self._touch(sets[hit], ways[hit])
            missed = np.flatnonzero(~hit)
            self.counts[HITS] += int(hit.sum())
            self.counts[MISSES] += int(missed.size)
            if missed.size:
                fetched = self.files.read(ids[missed])
                for name in out:
                    out[name][missed] = fetched[name]
                self._insert(ids[missed], sets[missed], fetched, dirty=False)
            return out

    def peek(self, ids):
        """`{column: values [M, *tail]}` of rows `ids` as they are now (cached or in the
        files), changing nothing: no row is cached or evicted, nothing counted.

        Args:
            ids: int rows (repeats allowed).
        """
        ids = self.files.check_ids(ids)
        with self.lock:
            out = self.files.read(ids, counted=False)
            sets, ways, hit = self._find(ids)
            slots = sets[hit] * self.ways + ways[hit]
            for name, array in self.data.items():
                out[name][hit] = array[slots]
            return out

    def write(self, ids, values):
        """Writes `values` (`{column: [M, *tail]}`, every column) of distinct rows `ids`.

        Cached rows are updated in memory (written to the files when
        evicted); others are cached with their new values.

        Raises:
            OSError: the disk has no room for rows never written before (nothing
                of this write happened).
        """
        self.write_distinct(self._checked(ids), values)

    def write_distinct(self, ids, values):
        """`write` of int64 ids known to be distinct rows of the table (unchecked)."""
        with self.lock:
            self.files.reserve(ids)  # (before any row is dirty: see the module's doc)
            sets, ways, hit = self._find(ids)
            slots = sets[hit] * self.ways + ways[hit]
            for name, array in self.data.items():
                array[slots] = np.asarray(values[name])[hit]
            self.dirty[sets[hit], ways[hit]] = True
            self._touch(sets[hit], ways[hit])
            missed = np.flatnonzero(~hit)
            if missed.size:
                self._insert(ids[missed], sets[missed],
                             {n: np.asarray(v)[missed] for n, v in values.items()}, dirty=True)

    def _insert(self, ids, sets, values, dirty):
        """Caches distinct uncached `ids` (in `sets`) with `values`, evicting (and writing
        back) others.

        A set receives one id per round, so the victims of a round are
        distinct entries; where more ids than ways fall in one set, later
        ones evict earlier ones (written back if dirty: nothing is lost).
        """
        order = np.argsort(sets, kind="stable")
        # Rank of each id among those of its set: round k holds the k-th.
        sorted_sets = sets[order]
        first = np.searchsorted(sorted_sets, sorted_sets, side="left")
        rank = np.empty_like(order)
        rank[order] = np.arange(order.size) - first
        for k in range(int(rank.max()) + 1):
            members = np.flatnonzero(rank == k)
            s = sets[members]
            ways = np.argmin(self._victim_key(s), axis=1)
            self._write_back(s, ways)
            slots = s * self.ways + ways
            for name, array in self.data.items():
                array[slots] = values[name][members]
            self.tags[s, ways] = ids[members]
            self.dirty[s, ways] = dirty
            self.uses[s, ways] = 0
            self._touch(s, ways)

    def _victim_key(self, sets):
        """Per way of each set, a key whose smallest entry is evicted (empty ones first)."""
        last = self.last[sets]
        key = last if self.policy == "lru" else (self.uses[sets] << _TICK_BITS) | last
        return np.where(self.tags[sets] < 0, -1, key)

    def _write_back(self, sets, ways):
        """Writes the dirty rows held at `(sets, ways)` to the files."""
        dirty = self.dirty[sets, ways] & (self.tags[sets, ways] >= 0)
        if not dirty.any():
            return
        s, w = sets[dirty], ways[dirty]
        slots = s * self.ways + w
        self.files.write(self.tags[s, w], {n: a[slots] for n, a in self.data.items()})
        self.dirty[s, w] = False

    def drain(self):
        """Writes rows evicted but not yet in the files into them (this class writes them at
        once: nothing to do; `NativeRowCache` stages them)."""

    def flush(self):
        """Writes every dirty row to the files, and the files to disk."""
        with self.lock:
            s, w = np.nonzero(self.dirty & (self.tags >= 0))
            self._write_back(s, w)
            self.files.flush()

    def health(self):
        """Counts so far: hits, misses, hit rate, and the files' rows and bytes read and
        written (`RowFiles.counts`)."""
        with self.lock:
            stats = {**self.stats, **self.files.counts()}
        looked = stats["hits"] + stats["misses"]
        stats["hit_rate"] = stats["hits"] / looked if looked else None
        return stats

