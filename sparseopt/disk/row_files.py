"""`RowFiles`: a table's rows and per-row state in memory-mapped files, allocated lazily.

One file per column (the rows, then each per-row slot), laid out row after
row, plus `written.bits` (one bit per row: whether the row was ever written)
and `table.json` (what the files hold). Files are created at their full
size but sparse, so a table costs no disk until its rows are written; a row
never written reads as its initial values (`InitialRows` for the rows, each
slot's constant).

Writes go through the memory map, whose pages the kernel writes back. A page
of a sparse file that cannot be given disk when written would kill the
process (SIGBUS), so disk is reserved (`posix_fallocate`) for the blocks of
`RESERVE_BYTES` (a page) a write touches, in each file, before they are
first written: a full disk is then an `OSError` naming the table, raised
before anything of the write happened. Rows are touched at random, so the
block size trades disk for system calls. Page by page, the files take the
pages of the rows touched: a 900M-row table's 14 GB after 300 steps
(benchmarks/disk_large.py), where blocks of 1024 rows (64 KiB of float32
rows of width 16) would have taken nearly all of its 61 GB by then; the
price is a call for most new rows for as long as training brings new rows
(measured: a 10M-row table's cache step, benchmarks/disk_cache.py at 5%,
6.2 ms with 1024-row blocks, 8.2-10.4 ms page by page, one run and two).
"""

import fcntl
import json
import mmap
import os
import pathlib

import numpy as np

from sparseopt.disk import host_ops
from sparseopt.storage.dtypes import numpy_dtype

# Disk is reserved in blocks of this many bytes of each file: a page.
RESERVE_BYTES = mmap.PAGESIZE

FORMAT = 1
LOCK = ".lock"  # held (flock) by the one RowFiles that has the folder open
SHARDS = "shards.json"  # in the folder of a table split into shards (`layout.py`)
WRITTEN = "written.bits"


class Column:
    """One file's layout: values of shape `tail` per row, of `dtype`, starting at `initial`.

    Args:
        tail: the shape of one row's values (`(width,)`, or `()` for one per row).
        dtype: their dtype name (`"float32"`, `"bfloat16"`, `"float16"`, `"int32"`...).
        initial: a number (every row starts there), or a function of int64
            row ids `[M]` giving float32 `[M, *tail]` (a table's drawn rows).
    """

    def __init__(self, tail, dtype, initial=0.0):
        self.tail, self.dtype, self.initial = tuple(int(d) for d in tail), str(dtype), initial

    def describe(self):
        return {"tail": list(self.tail), "dtype": self.dtype}


class RowFiles:
    """A table's columns (rows and per-row state) in files under `path`.

    Args:
        path: the table's folder (created if missing). Files already there
            are opened, after checking they hold this table.
        num_rows: the table's rows.
        columns: `{name: Column}`.
        owner: the table's name, for messages.
        describe: more of what `table.json` records and a reopening checks
            (the initializer's config).

    The folder is locked (`flock` of its `.lock`) while these files are open:
    a second `RowFiles` on it, in this process or another, is refused, since
    two caches over one table would each write back rows the other changed.

    Raises:
        ValueError: the folder holds another table's files, or is open already.
    """

    def __init__(self, path, num_rows, columns, owner="table", describe=None):
        self.path, self.num_rows, self.owner = pathlib.Path(path), int(num_rows), owner
        self.columns = dict(columns)
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock = locked(self.path / LOCK, owner)
        self._describe = describe
        try:
            self._open(describe)
        except BaseException:
            self.close()  # (a refused folder is not left locked)
            raise

    def _open(self, describe):
        """Checks or creates the files, and maps them."""
        meta = {"format": FORMAT, "num_rows": self.num_rows,
                "columns": {n: c.describe() for n, c in self.columns.items()},
                **(describe or {})}
        layout = {f"{name}.bin": ((self.num_rows,) + col.tail, numpy_dtype(col.dtype))
                  for name, col in self.columns.items()}
        layout[WRITTEN] = (((self.num_rows + 7) // 8,), np.dtype(np.uint8))
        existing = self._check_or_write(meta, layout)
        mode = "r+" if existing else "w+"  # w+: a sparse file of the full size
        maps = {file: np.memmap(self.path / file, dtype=dtype, mode=mode, shape=shape)
                for file, (shape, dtype) in layout.items()}
        self.written = maps.pop(WRITTEN)
        self.maps = {name: maps[f"{name}.bin"] for name in self.columns}
        # Per file, its blocks reserved on disk in this process, and those written since
        # `forget_changes` (what an incremental snapshot holds: `changes`).
        self._reserved = {file: np.zeros((-(-array.nbytes // RESERVE_BYTES),), bool)
                          for file, array in self._files()}
        self._changed = {file: np.zeros_like(blocks) for file, blocks in self._reserved.items()}
        self._inode = os.stat(self.path / WRITTEN).st_ino
        # Rows read from the files (never-written rows are drawn, not read) and written.
        self.rows_read = self.rows_written = 0
        self.row_bytes = sum(host_ops.row_bytes(a) for a in self.maps.values())

    def _check_or_write(self, meta, layout):
        """Whether the folder already holds this table (every file, at its size).

        Raises:
            ValueError: it holds another table's files, files without their
                `table.json`, or misses some of this table's files.
        """
        if (self.path / SHARDS).exists():
            found = read_shards(self.path / SHARDS)
            raise ValueError(
                f"{self.owner}: '{self.path}' holds a table on disk split into shards "
                f"({found}), and this table is whole: its rows would be others. Split it as "
                "it was (its path in the LayoutMap, over the same devices), or give it "
                "another folder.")
        file = self.path / "table.json"
        if not file.exists():
            stray = sorted(f for f in layout if (self.path / f).exists())
            if stray:
                raise ValueError(
                    f"{self.owner}: '{self.path}' holds table files {stray} without their "
                    "table.json: they cannot be checked. Give the table an empty folder.")
            tmp = file.with_suffix(".tmp")
            tmp.write_text(json.dumps(meta, indent=1, sort_keys=True))
            os.replace(tmp, file)
            return False
        found = json.loads(file.read_text())
        if found != json.loads(json.dumps(meta)):
            raise ValueError(
                f"{self.owner}: '{self.path}' holds another table's files ({found}); this "
                f"table is {meta}. Give each table its own folder, or remove the old one.")
        for name, (shape, dtype) in layout.items():
            size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            there = (self.path / name).stat().st_size if (self.path / name).exists() else None
            if there != size:
                raise ValueError(
                    f"{self.owner}: its file '{self.path / name}' is "
                    f"{'missing' if there is None else f'{there} bytes, not {size}'}; the "
                    "table on disk is incomplete. Restore the folder from a save.")
        return True

    def check_ids(self, ids):
        """`ids` as int64, or an IndexError naming the table if one is outside the table."""
        ids = np.asarray(ids, np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_rows):
            bad = ids[(ids < 0) | (ids >= self.num_rows)][0]
            raise IndexError(f"{self.owner}: row {bad} is outside the table's "
                             f"{self.num_rows} rows.")
        return ids

    def is_written(self, ids):
        """Boolean `[M]`: which rows `ids` were ever written."""
        ids = np.asarray(ids, np.int64)
        return (self.written[ids >> 3] >> (ids & 7).astype(np.uint8)) & 1 == 1

    def read(self, ids, counted=True):
        """`{column: values [M, *tail]}` of rows `ids`, as stored (their initial values where
        never written, cast to the column's dtype).

        Args:
            ids: int rows.
            counted: whether the read counts in `counts()` (False: a look that
                is not the table's training, e.g. `RowCache.peek`).
        """
        ids = self.check_ids(ids)
        fresh = ~self.is_written(ids)
        if counted:
            self.rows_read += int(ids.size - fresh.sum())
        # Rows never written are not read from the files: a hole read through the
        # map would take a page of memory (zeros) in the kernel's cache for each.
        where = np.where(fresh, -1, ids)
        out = {name: host_ops.gather(self.maps[name], where) for name in self.columns}
        if fresh.any():
            self.draw_into(out, ids, fresh)
        return out

    def draw_into(self, out, ids, where):
        """Rows `ids[where]` (never written) take the values they start with, at `where` in
        `out`, in each column's dtype (a column starting at a constant: that value).

        Args:
            out: `{column: values}` of `ids`, one row per id.
            ids: int64 rows of the table.
            where: the entries to draw: a boolean mask over `ids`, or their indices.
        """
        drawn = ids[where]
        for name, col in self.columns.items():
            start = col.initial(drawn) if callable(col.initial) else col.initial
            out[name][where] = np.asarray(start).astype(self.maps[name].dtype)

    def write(self, ids, values):
        """Writes `values` (`{column: [M, *tail]}`, every column) of distinct rows `ids`.

        Raises:
            OSError: the disk cannot hold the rows (nothing was written).
            KeyError: a column is missing (nothing was written).
            IndexError: an id is outside the table (nothing was written).
        """
        ids = self.check_ids(ids)
        missing = [name for name in self.columns if name not in values]
        if missing:
            raise KeyError(f"{self.owner}: a write must give every column; missing {missing}.")
        if ids.size == 0:
            return
        self.reserve(ids)
        for name in self.columns:
            self.maps[name][ids] = values[name]
        np.bitwise_or.at(self.written, ids >> 3,
                         np.left_shift(1, ids & 7).astype(np.uint8))
        self.rows_written += int(ids.size)

    def counts(self):
        """Rows and bytes read from the files (rows ever written only) and written to them."""
        return {"rows_read": self.rows_read, "rows_written": self.rows_written,
                "bytes_read": self.rows_read * self.row_bytes,
                "bytes_written": self.rows_written * self.row_bytes}

    def reserve(self, ids):
        """Reserves disk for rows `ids` (int64, in the table): the blocks of
        `RESERVE_BYTES` of each file that hold them, where this process has not yet.
        Every write into the files reserves its rows first (the cache's, as it makes
        them dirty, and `write`'s), so their blocks are also marked written here
        (`changes`).

        Raises:
            OSError: the disk has no room (naming the table); nothing is marked.
        """
        ids = np.asarray(ids, np.int64)
        if ids.size == 0:
            return
        fresh = {}
        for file, array in self._files():
            reserved = self._reserved[file]
            row_bytes = 0 if file == WRITTEN else host_ops.row_bytes(array)  # (0: bitmap)
            # The blocks not marked since the last snapshot: one pass finds those not
            # reserved too, which are among them (a block is marked once reserved).
            blocks = host_ops.unreserved(ids, row_bytes, RESERVE_BYTES, self._changed[file])
            new = blocks[~reserved[blocks]]
            if new.size:
                self._fallocate(file, new, array.nbytes)
                reserved[new] = True
            fresh[file] = blocks
        for file, blocks in fresh.items():
            self._changed[file][blocks] = True

    def changes(self):
        """`{file: int64 sorted block numbers}`: the blocks of `RESERVE_BYTES` (pages) of
        each file written since the files were opened or `forget_changes` was called
        (every column's and the written-rows bitmap's; `table.json` never changes)."""
        return {file: np.flatnonzero(changed) for file, changed in self._changed.items()}

    def forget_changes(self):
        """Starts `changes` afresh (a snapshot of the files as they are was taken)."""
        for changed in self._changed.values():
            changed[:] = False

    def _files(self):
        """`(file name, its map)` of every column and of the written-rows bitmap."""
        return [*((f"{n}.bin", a) for n, a in self.maps.items()), (WRITTEN, self.written)]

    def _fallocate(self, name, blocks, nbytes):
        """Reserves disk for sorted `blocks` of file `name` (of `nbytes`), in runs."""
        try:
            fd = os.open(self.path / name, os.O_RDWR)
        except FileNotFoundError as error:
            raise FileNotFoundError(
                f"{self.owner}: its file '{self.path / name}' disappeared; the table on disk "
                "is incomplete. Restore the folder from a save.") from error
        try:
            # Consecutive blocks in one call each.
            breaks = np.flatnonzero(np.diff(blocks) != 1) + 1
            for run in np.split(blocks, breaks):
                start = int(run[0]) * RESERVE_BYTES
                os.posix_fallocate(fd, start, min(run.size * RESERVE_BYTES, nbytes - start))
        except OSError as error:
            raise OSError(error.errno,
                          f"{self.owner}: no room on disk for its rows in '{self.path}' "
                          f"({error.strerror}); nothing of this write was made. Free disk "
                          "space or move the table's folder.") from error
        finally:
            os.close(fd)

    def flush(self):
        """Writes every mapped page to disk (after checking the files are still there)."""
        try:
            same = os.stat(self.path / WRITTEN).st_ino == self._inode
        except FileNotFoundError:
            same = False
        if not same:
            raise FileNotFoundError(
                f"{self.owner}: its files in '{self.path}' disappeared or were replaced "
                "while it trained. Restore the folder from a save.")
        for array in [*self.maps.values(), self.written]:
            array.flush()

    def reopen(self):
        """Maps the folder's files again (replaced by a restore), keeping its lock.

        Raises:
            ValueError: they are not this table's files (nothing is mapped then).
        """
        self.maps, self.written = {}, None
        self._open(self._describe)

    def close(self):
        """Lets the folder go (its lock released, its maps dropped); unusable after."""
        self.maps, self.written = {}, None
        if getattr(self, "_lock", None) is not None:
            self._lock.close()  # (closing the file releases its flock)
            self._lock = None

    @property
    def names(self):
        """The table's files: every column's, the written-rows bitmap, `table.json` (last)."""
        return [*(f"{n}.bin" for n in self.columns), WRITTEN, "table.json"]

    def disk_bytes(self):
        """Bytes the files take on disk (their allocated blocks, not their size)."""
        return sum(os.stat(self.path / f).st_blocks * 512 for f in self.names[:-1])


def read_shards(file):
    """What a split table's `shards.json` records (its text where it is no JSON object)."""
    text = file.read_text()
    try:
        found = json.loads(text)
    except json.JSONDecodeError:
        return text
    return found if isinstance(found, dict) else text


def locked(path, owner):
    """The open lock file `path`, locked exclusively; a ValueError naming `owner` if another
    holds it."""
    handle = open(path, "a+")
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise ValueError(
            f"{owner}: its folder '{path.parent}' is open already (another layer, a clone of "
            "the model, or another process): two tables over one folder would lose rows. "
            "Give each its own folder, or close the other first "
            "(`layer.embeddings.close()`).") from None
    return handle
