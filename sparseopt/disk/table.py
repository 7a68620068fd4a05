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

import functools
import logging
import threading
import time
import weakref

import numpy as np
from keras import ops

from sparseopt import backend
from sparseopt.disk import host_ops, int8_columns, look_ahead, snapshots
from sparseopt.disk.background import Background
from sparseopt.disk.initial_rows import InitialRows
from sparseopt.disk.look_ahead import Upcoming, valid_or_minus_one
from sparseopt.disk.native_cache import make_cache
from sparseopt.disk.row_cache import AHEAD, HITS, MISSED_AT_STEP, MISSES
from sparseopt.disk.row_files import Column, RowFiles
from sparseopt.storage import quantization

ROWS = "rows"  # the column of the table's own values
# Rows per part of whole-table work (`DiskTable.each_part`): 65,536 rows of width 16
# with two per-entry slots are 12 MB. A multiple of 16 rows, so that each value sits
# at the same place modulo a SIMD register's width (up to 16 floats) in its part as in
# the whole table: TensorFlow's vectorized kernels (exp, log, pow) can round the last
# bit of a value otherwise (measured: parts of 7 rows moved a few `lazy=False` rows).
PART_ROWS = 1 << 16


class DiskTable:
    """A table's rows and per-row optimizer state in files, hot rows cached in memory.

    Args:
        path: the table's path, as its variable's would be (`"layer/embeddings"`).
        shape: `(V, D)`.
        dtype: the rows' dtype (`"float32"`, `"bfloat16"`, `"float16"`, or `"int8"`:
            codes and a scale per row, `int8_columns`).
        initializer: the Keras initializer whose distribution unwritten rows
            are drawn from (`sparseopt.disk.initial_rows.InitialRows`).
        slots: the table's per-row `SlotSpec`s (its updater's), each a column.
        settings: its `sparseopt.storage.OnDisk`.
        first_row: where a shard of a larger table starts in it
            (`sparseopt.disk.sharded`): its rows never written are drawn as that
            table's rows `first_row + i` are, so a table reads the same split or whole.
    """

    trainable = False  # (never a variable an optimizer is handed)

    def __init__(self, path, shape, dtype, initializer, slots, settings, first_row=0):
        self.path, self.name = path, path.split("/")[-1]
        self.shape, self.dtype = tuple(int(d) for d in shape), str(dtype)
        self.settings, self.first_row = settings, int(first_row)
        owner = f"Table '{path}'"
        drawn = InitialRows(initializer, self.shape[1], owner=owner)
        initial = drawn if not first_row else (lambda ids: drawn(ids + first_row))
        # An int8 table keeps codes and a scale per row (`int8_columns`).
        self.int8 = self.dtype == "int8"
        columns = int8_columns.columns(initial, self.shape[1]) if self.int8 else {
            ROWS: Column(self.shape[1:], self.dtype, initial)}
        for spec in slots:
            if spec.name in columns:
                raise ValueError(f"{owner}: its updater's per-row slot '{spec.name}' has the "
                                 f"name of a column the table keeps itself ({sorted(columns)}); "
                                 "name the slot otherwise.")
            columns[spec.name] = Column(spec.shape(self.shape)[1:],
                                        spec.dtype_for(settings.state_dtype), spec.initial_value)
        self._owner, self._columns = owner, columns
        self._describe = {"initial": drawn.get_config(),
                          **({"first_row": int(first_row)} if first_row else {})}
        # The host work a step need not wait for, beside it (`background.py`).
        self._background = Background(f"sparseopt disk table {path}")
        # Guards `_last_read` alone: the cache's lock is held by the thread beside
        # the step while it writes evicted rows, which this read need not wait for.
        self._recent_lock = threading.Lock()
        self._closed = False
        # The first failure of the work beside the step (a full disk): the table lacks
        # that step's rows, so it refuses to go on until a load replaces them.
        self._failed = None
        # The batches `fit` showed ahead, whose rows are fetched beside the step before.
        self._upcoming = Upcoming(self.shape[0])
        # The batch last fetched ahead and not yet read, whose values the writes after its
        # fetch bring up to date (`_fetch`, `_write_host`); set as jobs are submitted, under
        # its lock, so that each write brings up to date the fetch submitted before it.
        self._last_fetched, self._fetched_lock = None, threading.Lock()
        # Writes applied to the cache (on the thread beside the step): a fetch's values
        # are current as of one of them (`_fetched_values`).
        self._writes = 0
        self._unforeseen = False  # (the batches shown were not what it read: no more)
        # Seconds the step's host calls took, and of those, waiting for the thread
        # beside the step (`health`: where a step on disk spends its time).
        self._in_step = self._waited = 0.0
        # Seconds in `flush` (the end of `fit`'s): its rows written into the files, and
        # the files to disk (`health`: once a fit, apart from its steps).
        self._flushing = 0.0
        # The snapshot the files were last taken in or loaded from, in this process: the
        # next one holds only the pages written since (`snapshots.take(base=...)`).
        self._base = None
        self._open()

    def _open(self):
        """Opens the files and a new, empty cache over them."""
        self.files = RowFiles(self.settings.path, self.shape[0], self._columns,
                              owner=self._owner, describe=self._describe)
        # (Files a load replaced that an exit or a crash left: the folder is ours now.)
        snapshots.discard(snapshots.leftovers(self.settings.path))
        self._new_cache()

    def _new_cache(self):
        """A new, empty cache over the files, written back when the table is dropped or
        Python exits (training outside `fit`, whose end flushes, keeps its rows)."""
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer.detach()
        self.cache = make_cache(self.files, self.settings.cache_rows, self.settings.policy)
        self._finalizer = weakref.finalize(self, _flush_at_exit, self.cache, self._background,
                                           self._owner)
        # `(host_ops.Distinct, {column: values})` of the last read, until the next
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

    def read(self, ids, names=(ROWS,), counted=True, lookup=False):
        """The values of columns `names` at `ids`: a tuple of `ids.shape + tail` tensors
        (float32, or int32 for integer state); ids outside the table read zeros.

        Args:
            ids: int ids, any shape (a batch's: repeats and invalid ids allowed).
            names: the columns (`"rows"`, per-row slots' names).
            counted: False for a read that is no lookup (Lookahead's sync): nothing is
                counted, cached or evicted.
            lookup: whether this is a layer's lookup of a batch's ids (`read_rows`),
                which `fit` may have shown the table ahead (`look_ahead`).
        """
        shape = tuple(ids.shape)
        outputs = [(shape + self.columns[n].tail, self.carried_dtype(n)) for n in names]

        def read(ids):
            if not counted:
                return self._look_host(np.asarray(ids), names)
            return self._read_host(np.asarray(ids), names, lookup)

        return backend.host_read(self._timed(read), [ops.cast(ids, "int32")], outputs)

    def _timed(self, call):
        """`call`, its time added to the step's host time (`health`)."""
        @functools.wraps(call)
        def timed(*args):
            start = time.perf_counter()
            try:
                return call(*args)
            finally:
                self._in_step += time.perf_counter() - start

        return timed

    def read_rows(self, ids, lookup=True):
        """The rows at `ids` as a lookup reads them (traced): float32 (an int8 table's
        `codes / scale`, as Keras reads its int8 `Embedding`), or the table's 16-bit
        values carried in float32; ids outside the table read zeros.

        Args:
            ids: int ids, any shape.
            lookup: whether a layer's lookup reads them (`read`'s): False for a step's
                own reads of its rows.
        """
        return self.read_rows_and_state(ids, (), lookup)[0]

    def read_rows_and_state(self, ids, slots=None, lookup=True):
        """`(rows, {slot: values})` at `ids`, in one host call (traced): the rows as
        `read_rows` reads them, and per-row slots as `read` reads them. A training
        step's lookup reads both: its optimizer starts from them (`RowGrads.state`),
        and makes no host call of its own to read the state.

        Args:
            ids: int ids, any shape.
            slots: the per-row slots' names; None: every one the table keeps
                (`state_columns`).
            lookup: as for `read_rows`.
        """
        slots = self.state_columns if slots is None else tuple(slots)
        stored = (ROWS, int8_columns.SCALE) if self.int8 else (ROWS,)
        values = self.read(ids, stored + slots, lookup=lookup)
        state = dict(zip(slots, values[len(stored):]))
        if not self.int8:
            return values[0], state
        codes, scale = values[:2]
        # (Ids outside the table read codes 0 and scale 0: zeros, not 0 / 0.)
        return ops.where(ops.expand_dims(ops.equal(scale, 0.0), -1), 0.0,
                         quantization.dequantize(codes, scale)), state

    @property
    def state_columns(self):
        """The per-row slots' names (their columns): every column but the rows (an int8
        table's codes) and an int8 table's scales."""
        return tuple(n for n in self.columns if n not in (ROWS, int8_columns.SCALE))

    def number(self, ids):
        """The step's valid ids numbered in the order of their last occurrence by the host
        library's code (`sparseopt.engine.stages._Numbering`'s fields: number, ids_of,
        positions, count), where it is on: on a CPU in the step itself (`backend.number_ids`:
        an FFI call on JAX, an op on TensorFlow), else in a host call; None where it is off
        (the step numbers them on the device, to the same numbers).

        Args:
            ids: int32 `[N]`, the step's ids (repeats and invalid ids allowed).
        """
        lib = host_ops.library()  # (as the step is traced: the step keeps it)
        if lib is None:
            return None
        # (On a CPU the same numbering runs in the step; the host call below crosses
        # into Python and back for it, every step.)
        numbered = backend.number_ids(ids, self.shape[0])
        if numbered is not None:
            return numbered
        n = ids.shape[0]
        outputs = [((n,), "int32")] * 3 + [((), "int32")]

        def number(ids):
            return host_ops.number(np.asarray(ids), self.shape[0], lib)

        return backend.host_read(self._timed(number), [ops.cast(ids, "int32")], outputs)

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

        backend.host_write(self._timed(write), args)

    # -- on the host -------------------------------------------------------

    def ahead(self, ids):
        """Foresees the ids a step will read after those already foreseen: their rows are
        brought into the cache beside the step before it (`look_ahead`), where
        `fetch_ahead` is on. What any step reads and writes is unchanged.

        Args:
            ids: int ids (any shape, repeats and invalid ids allowed).
        """
        if (not self.settings.fetch_ahead or self._closed or self._failed is not None
                or self._unforeseen):
            return
        entry = self._upcoming.add(ids)
        if entry is not None:
            self._fetch(entry)
        if self._upcoming.overflowed:
            # The batches shown are not what its lookups read (its ids are changed on
            # the way, e.g. inside the layer): fetching them would only evict rows.
            self._unforeseen = True
            self._upcoming.clear()
            logging.getLogger("sparseopt.disk").warning(
                "%s: none of the last %d batches `fit` showed it ahead was what its lookups "
                "read; its rows are fetched in the step that reads them from now on. Set "
                "`fetch_ahead=False` on its OnDisk to say so.", self._owner,
                look_ahead.KEPT + 1)

    def _fetch(self, entry):
        """Brings a `Foreseen` batch's rows into the cache, on the thread beside the step,
        and keeps their values as it found them (`entry.found`): the writes submitted
        after it bring those up to date (`_write_host`), so its step takes them as they
        are, without finding each row in the cache again (`_fetched_values`)."""
        cache, num_rows = self.cache, self.shape[0]

        def fetch():
            entry.distinct = host_ops.distinct(entry.ids, num_rows)
            if cache is not self.cache:  # (a load or whole-table work replaced it: let go)
                return
            try:
                with cache.lock:
                    counted = cache.counts.copy()
                    try:
                        found = cache.read_distinct(entry.distinct.ids)
                    except BaseException:
                        # (Its hits and misses, counted before it failed, are the step's
                        # to count: it reads its rows itself.)
                        cache.counts[:] = counted
                        raise
                    cache.counts[AHEAD] += 1
                entry.found, entry.as_of = found, (cache, self._writes)
            except Exception as error:  # noqa: BLE001 (the step reads its rows itself)
                # A fetch only brings rows into the cache (rows it evicts stay dirty until
                # written): the table is whole, so the step reads them, and meets a lasting
                # cause (a file gone, a full disk) itself, named by its own error.
                logging.getLogger("sparseopt.disk").warning(
                    "%s: fetching the next step's rows ahead failed (%s); the step reads "
                    "them itself.", self._owner, error)
                return
            entry.counted = True
            # The rows it evicted reach the files now, while the step computes, not in the
            # write its step waits for (a failure is the thread's, as a write's: kept).
            cache.drain()

        with self._fetched_lock:  # (the writes submitted after it bring it up to date)
            self._last_fetched = entry
            self._background.submit(fetch)

    def _read_host(self, ids, names, lookup=False):
        self._check_open()
        entry = following = None
        # (The batch `fit` showed ahead, if it is this one; no pass over the ids where
        # nothing is shown ahead.)
        if lookup and self.settings.fetch_ahead and not self._unforeseen:
            entry, following = self._upcoming.reached(valid_or_minus_one(ids, self.shape[0]))
        if entry is not None and entry.started:
            self._settle(in_step=True)  # (its fetch, and the work before it, done)
            with self._fetched_lock:  # (read now: no write after need bring it up to date)
                if self._last_fetched is entry:
                    self._last_fetched = None
        fetched = entry is not None and entry.counted
        batch = entry.distinct if fetched else host_ops.distinct(ids, self.shape[0])
        if batch.ids.size == 0:  # (no row: nothing read, the last read kept; zeros)
            found = {n: np.zeros((0,) + self.columns[n].tail, self.files.maps[n].dtype)
                     for n in names}
        else:
            found = self._recent(batch.ids, names)
        if found is None:
            found = self._fetched_values(entry) if fetched else None
            if found is None:
                self._settle(in_step=True)  # (the last write and evictions, applied)
                found = self._step_read(batch.ids, fetched)
                # The rows this read evicted reach the files while the step runs.
                self._background.submit(self.cache.drain)
            with self._recent_lock:
                self._last_read = (batch, found)
        if following is not None:
            # Fetched now, while the step computes: its write, after, brings the values
            # the fetch found up to date (`_write_host`).
            self._fetch(following)
        return self._gathered(found, batch, ids, names)

    def _look_host(self, ids, names):
        """`_read_host` changing nothing in the cache (no row cached, evicted or counted)."""
        self._check_open()
        self._settle(in_step=True)
        batch = host_ops.distinct(ids, self.shape[0])
        return self._gathered(self.cache.peek(batch.ids), batch, ids, names)

    def _gathered(self, found, batch, ids, names):
        """Columns `names` of the distinct rows `found` (`{column: values}` of `batch.ids`)
        at each of `ids` (zeros where invalid), as they cross the host boundary."""
        out = []
        for name in names:
            values = host_ops.gather(found[name], batch.inverse)  # (invalid ids: zeros)
            values = values.astype(self.carried_dtype(name), copy=False)
            out.append(values.reshape(ids.shape + self.columns[name].tail))
        return tuple(out)

    def _fetched_values(self, entry):
        """`{column: values}` of a batch's distinct rows as its fetch ahead read them and the
        writes since brought them up to date, where they are current (the same cache, and
        every write since brought them up to date), else None. The step's read then takes
        them as they are, without finding each row in the cache again (the fetch counted
        them: the step's read is the next read of the cache).

        Args:
            entry: the `Foreseen` batch, fetched (its thread's work settled).
        """
        if entry.as_of != (self.cache, self._writes):
            return None
        return entry.found

    def _step_read(self, ids, fetched):
        """A step's read of distinct `ids` through the cache, counted as the step's: rows
        `fetched` ahead were counted then, so only those missed again (evicted since)
        count now (under the cache's lock: a fetch counts before or after, apart).

        Args:
            ids: int64 distinct rows of the table.
            fetched: whether the fetch ahead of this step counted them.
        """
        counts = self.cache.counts
        with self.cache.lock:  # (a fetch submitted meanwhile counts apart, after)
            before = counts[[HITS, MISSES]].copy()
            found = self.cache.read_distinct(ids)
            hits, misses = counts[[HITS, MISSES]] - before
            counts[MISSED_AT_STEP] += misses
            if fetched:
                counts[HITS] -= hits
        return found

    def _recent(self, wanted, names):
        """`{column: values}` of columns `names` at `wanted` (distinct ids) from the last read,
        where it read them all and nothing was written since; else None."""
        with self._recent_lock:
            last = self._last_read
        if last is None or wanted.size == 0:
            return None
        batch, values = last
        at = batch.positions(wanted)
        if at is None:
            return None
        return {name: host_ops.gather(values[name], at) for name in names}

    def _write_host(self, ids, count, keep, values):
        self._check_open()
        with self._recent_lock:
            self._last_read = None  # (its values are no longer current)
        # Copies of the entries before `count` (the step goes on, and its buffers may be
        # reused, while the thread beside it writes them); the rest of the work is there.
        count = min(max(count, 0), ids.size)
        ids, keep = np.array(ids[:count], np.int64), np.array(keep[:count], bool)
        # (np.asarray first: JAX hands its host calls device arrays, whose slicing would
        # be a computation of its own.)
        values = {n: np.array(np.asarray(v)[:count]) for n, v in values.items()}
        cache, columns, maps = self.cache, list(self.columns), self.files.maps
        num_rows = self.shape[0]

        def write(fetched):
            batch = host_ops.distinct(np.where(keep, ids, -1), num_rows)
            if batch.ids.size == 0:  # (repeats hold equal values: the first is kept)
                return
            self._writes += 1  # (values fetched ahead before this are stale now...)
            if batch.ids.size == ids.size:  # (all distinct and kept: `first` is 0, 1, ...)
                kept = dict(values)
            else:
                kept = {n: host_ops.gather(v, batch.first) for n, v in values.items()}
            missing = [n for n in columns if n not in kept]
            if missing:  # columns left out keep their values (a look, not a lookup: uncounted)
                old = cache.peek(batch.ids)
                kept.update({n: old[n] for n in missing})
            kept = {n: kept[n].astype(maps[n].dtype, copy=False) for n in columns}
            cache.write_distinct(batch.ids, kept)
            # (...but those of the batch fetched ahead, current up to this write: its rows
            # this write wrote take their new values, and they are current again.)
            if (fetched is not None and not fetched.dropped
                    and fetched.as_of == (cache, self._writes - 1)):
                fetched.take_written(batch.ids, kept)
                fetched.as_of = (cache, self._writes)
            cache.drain()

        with self._fetched_lock:  # (the batch fetched ahead, in the order their jobs run)
            self._background.submit(functools.partial(write, self._last_fetched))

    # -- between steps -------------------------------------------------------

    def numpy(self, column=ROWS, ids=None):
        """The current values of `column` (the rows, or a per-row slot's name) at `ids`, as
        stored; reading changes nothing in the cache.

        Args:
            column: `"rows"` (an int8 table's codes), `"scale"` (an int8 table's row
                scales) or a per-row slot's name.
            ids: int row ids; None: every row (a table's worth of memory).
        """
        self._check_open()
        ids = np.arange(self.shape[0]) if ids is None else ids
        self._settle()
        return self.cache.peek(ids)[column]

    def rows_read(self, ids=None):
        """The rows at `ids` as a lookup reads them, between steps: as stored (float32 or
        16-bit), an int8 table's as `codes / scale` in float32 (Keras' own dequantize);
        reading changes nothing in the cache.

        Args:
            ids: int row ids inside the table; None: every row (a table's worth of memory).
        """
        values = self.numpy(ROWS, ids)
        if not self.int8:
            return values
        with backend.outside_trace():
            return np.asarray(ops.convert_to_numpy(quantization.dequantize(
                values, self.numpy(int8_columns.SCALE, ids))), np.float32)

    def each_part(self, work, rows_per_part=None, writes=True):
        """Between steps: `work(ids, {column: values})` on every row, part by part, each
        part's new values (`{column: values}` of every column, or None: unchanged)
        written into the files.

        The cache's rows are written into the files first, so the work reads every
        row's current values there; where it `writes`, the cache is emptied too (its
        hit and miss counts go on), so nothing cached goes stale. Written, every row is
        (rows never written so far too: drawn, then written), so the files take the
        table's full size on disk. Its reads and writes count in `health()`.

        Args:
            work: `work(ids, stored)`: `ids` int64 `[n]` consecutive rows, `stored`
                their values as stored, by column.
            rows_per_part: the rows of one part (the memory it takes: a part's rows
                and state, a few times over); None: `PART_ROWS`.
            writes: False where the work only reads (it must then return None): the
                cache keeps its rows.

        Raises:
            OSError: a part could not be written (a full disk), naming the table and
                the rows worked on before it.
        """
        rows_per_part = self._part_rows(rows_per_part)
        self._before_whole(writes)
        for start in range(0, self.shape[0], rows_per_part):
            ids = np.arange(start, min(start + rows_per_part, self.shape[0]), dtype=np.int64)
            new = work(ids, self.files.read(ids))
            if new is None:
                continue
            if not writes:
                raise ValueError(f"{self._owner}: work said to only read wrote rows.")
            try:
                self.files.write(ids, {n: new[n] for n in self.columns})
            except OSError as error:
                raise whole_work_failed(self._owner, start, error) from error

    def _part_rows(self, rows_per_part):
        """`rows_per_part` checked (a multiple of 16: see PART_ROWS), or PART_ROWS."""
        rows_per_part = rows_per_part or PART_ROWS
        if rows_per_part % 16:
            raise ValueError(f"{self._owner}: parts of whole-table work are a multiple of "
                             f"16 rows (see PART_ROWS), not {rows_per_part}.")
        return rows_per_part

    def _before_whole(self, writes):
        """Before work on every row: the thread beside the step settled, the cache's rows
        in the files, and where the work `writes`, the cache emptied (`each_part`)."""
        self._check_open()
        self._settle()
        self._written_back(empty=writes)

    def parts(self):
        """The tables whose folders hold this one's files: itself (a table split in
        shards, `sparseopt.disk.sharded`, gives its shards)."""
        return [self]

    def _written_back(self, empty):
        """Writes the cache's rows into the files (the thread beside the step settled
        before), and forgets the last read; `empty`: a new, empty cache after, counting on
        from the old one's hits and misses."""
        with self.cache.lock:
            self.cache.flush()
            with self._recent_lock:
                self._last_read = None
        if empty:
            counts = self.cache.counts.copy()
            self._new_cache()
            self.cache.counts[:] = counts
            self._let_go_fetched()

    def _let_go_fetched(self):
        """Lets go the batches foreseen and the one fetched ahead (a load, a new cache):
        marked so, no write brings them up to date, and no reference to one (its values,
        the cache it was fetched from, that cache's maps of files a load replaced) is
        kept."""
        with self._fetched_lock:
            self._upcoming.clear()
            self._last_fetched = None

    def flush(self):
        """Writes the cache's dirty rows to the files, and the files to disk."""
        self._check_open()
        self._settle()
        start = time.perf_counter()
        try:
            self.cache.flush()
        finally:
            self._flushing += time.perf_counter() - start

    def _check_not_closed(self):
        if self._closed:
            raise ValueError(f"{self._owner}: it was closed (`close()`); its folder may be "
                             "another table's now. Make the layer again to use it.")

    def _check_open(self):
        """Raises if the table was closed, or lacks a step's rows (`_settle`)."""
        self._check_not_closed()
        if self._failed is not None:
            raise RuntimeError(
                f"{self._owner}: a write of its rows beside the step failed ("
                f"{self._failed}); the table lacks that step's rows. Load a save "
                "(`model.load_weights`, `BackupAndRestore`) to go on.") from self._failed

    def _settle(self, in_step=False):
        """Waits for the work beside the step; its failure is kept (`_check_open`).

        Args:
            in_step: whether a step's host call waits (its wait counts in `health`).
        """
        start = time.perf_counter()
        try:
            self._background.wait()
        except BaseException as error:
            self._failed = error
            raise
        finally:
            if in_step:
                self._waited += time.perf_counter() - start

    def close(self):
        """Writes the cache's rows to the files and lets the folder go (its lock
        released): another table may open it then. The table is unusable after. Files a
        load replaced, still being removed beside (`snapshots.discard`), are removed
        first: nothing works in the folder after it is let go.

        Raises:
            OSError: a write beside the step failed (a full disk); the cache's other
                rows were written and the folder let go all the same.
        """
        if self._closed:
            return
        try:
            self._background.wait()
        finally:
            self._closed = True
            self._background.close()
            with self.cache.lock:
                try:
                    self.cache.flush()
                finally:
                    self._finalizer.detach()
                    snapshots.wait_discarded(self.settings.path)
                    self.files.close()

    def snapshot(self, at_least=1):
        """Writes the cache's rows to the files, then copies the files into a new snapshot
        (`sparseopt.disk.snapshots.take`); its name. What a save of the table holds. After
        a snapshot taken or loaded in this process, only the pages written since are
        copied (an incremental snapshot), while its chain stays within its first's bytes.

        Args:
            at_least: the lowest number to name it by (`snapshots.take`).
        """
        self._check_open()
        self._settle()
        with self.cache.lock:
            self.cache.flush()
            changed = self.files.changes()
            base = snapshots.delta_base(self.settings.path, self._base, changed)
            name = snapshots.take(self.settings.path, self.files.names, at_least, base=base,
                                  changed=changed)
            # (No write ran meanwhile: the table's lock is held, its thread settled.)
            self.files.forget_changes()
            self._base = name
            return name

    def restore(self, snapshot):
        """Makes the table what snapshot `snapshot` holds (its files copied back, the cache
        emptied: its rows were the table's before).

        Args:
            snapshot: the snapshot's name (`snapshot`'s).

        Raises:
            ValueError: the snapshot is missing, incomplete, or another table's.
        """
        self._check_not_closed()  # (a table lacking a step's rows may load: that mends it)
        self._before_restore()
        self._replace_files(lambda: snapshots.restore(self.settings.path, snapshot,
                                                      self.files.names, self._owner),
                            loaded=snapshot)

    def _before_restore(self):
        """Before its files are replaced: the thread beside the step settled (its failure
        kept: what the snapshot replaces, if it loads), the cache's rows in the files (a
        load that fails leaves the table as it was, its rows in its files)."""
        try:
            self._background.wait()
        except Exception as error:  # noqa: BLE001
            self._failed = error
        with self.cache.lock:
            self.cache.flush()

    def _replace_files(self, replace, loaded=None):
        """`replace()` puts other files in the folder; the table then maps them, with a
        new, empty cache (the old one's rows were the table's before).

        Args:
            replace: the function that replaces the files; it returns the files
                replaced, kept under other names (`snapshots.commit`), or None.
            loaded: the snapshot whose files they are, where `replace()` returns.
        """
        with self.cache.lock:
            self._base = None  # (until they are known to be a snapshot's)
            replaced = None
            try:
                replaced = replace()
                self._failed = None  # (what a failed write lost is replaced)
                self._base = loaded
            finally:
                # Whatever happened, the maps follow the files there now (a restore
                # that failed before its renames left them as they were) and the lock
                # stays; the cache, written, starts empty.
                with self._recent_lock:
                    self._last_read = None
                self.files.reopen()
                self._new_cache()
                self._let_go_fetched()
            # (No map holds the files replaced now: removing them, seconds for a trained
            # table, is left to a thread of their own.)
            snapshots.discard(replaced)

    def snapshots(self):
        """The names of the table's complete snapshots, oldest first."""
        return snapshots.listed(self.settings.path)

    def remove_snapshots(self, keep):
        """Removes all but the `keep` newest snapshots (files that refer to the others can
        then no longer be loaded); the names removed. One that a kept snapshot builds on
        (an incremental one's chain) stays on disk, unlisted, until none does.

        Args:
            keep: how many of the newest to keep.
        """
        self._check_not_closed()  # (the folder may be another table's now)
        return snapshots.remove(self.settings.path, keep)

    def health(self):
        """The cache's counts so far (`RowCache.health`: hits, misses, hit rate, rows and
        bytes read from and written to the files), and where the table's host work went
        since the table was made, in milliseconds of wall clock: `host_ms` in the steps'
        host calls (the step waits for them), `waited_ms` of it waiting for the thread
        beside the step, `beside_ms` on that thread (overlapping the steps), and `flush_ms`
        in `flush` (the end of `fit`'s, `layer.flush()`: the cache's dirty rows written
        into the files, and the files to disk)."""
        self._settle()
        return {**self.cache.health(), "host_ms": 1e3 * self._in_step,
                "waited_ms": 1e3 * self._waited, "beside_ms": 1e3 * self._background.busy,
                "flush_ms": 1e3 * self._flushing}


def whole_work_failed(owner, start, error):
    """The `OSError` of work on every row that wrote rows before `start` and failed there."""
    # (Each row is either worked on or not: the work is row by row, and done again it
    # changes nothing it did, so it may simply be run again.)
    return OSError(
        f"{owner}: the work on every row (the end of fit's catch-up or average) wrote rows 0 "
        f"to {start - 1} and could not write rows from {start} on ({error}). Free disk space "
        "and run it again (`optimizer.catch_up_tables()`, or `fit`), or load a save.")


def _flush_at_exit(cache, background, owner):
    """Writes a dropped table's cache to its files and ends its thread (a finalizer must not
    raise: it logs)."""
    if background.on_its_thread():
        # Collected on its own thread, inside one of its jobs (which this must not
        # wait for): written there, after that job.
        background.submit(lambda: _write_back(cache, background, owner))
        return
    try:
        background.wait()
    except Exception as error:  # noqa: BLE001 (its other rows are written all the same)
        logging.getLogger("sparseopt.disk").error("%s: a write of its rows failed: %s",
                                                  owner, error)
    _write_back(cache, background, owner)


def _write_back(cache, background, owner):
    """Ends a dropped table's thread and writes its cache to its files (logs a failure)."""
    background.close()
    try:
        cache.flush()
    except Exception as error:  # noqa: BLE001
        logging.getLogger("sparseopt.disk").error(
            "%s: its cached rows could not be written to its files when it was dropped: %s",
            owner, error)
