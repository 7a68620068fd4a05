"""Snapshots of a table on disk: what a save holds of it, and how a load brings it back.

A weights file cannot hold a table larger than memory, so a save of a table
on disk takes a snapshot of its files in its own folder
(`<path>/snapshots/<name>/`) and the file records the snapshot's name
(`SparseEmbedding.save_own_variables`). A snapshot is taken between steps
(Keras saves outside the train step), after the cache's dirty rows are
written into the files, so it holds one step's end, never half of one.
Names are numbers, each higher than every one taken before in the folder
(`LAST` keeps the highest, so a number removed is never given again: a
weights file naming a removed snapshot fails to load rather than load
another); the table's folder is locked while open, so no other writer
numbers one at the same time.

Crash safety (`take`): the copy is written under a hidden name, each file
synced, then its `complete.json` (every file's size) synced, then the folder
renamed into place and the parent synced. A crash at any point leaves either
no snapshot of that name or a complete one (hidden copies are never listed
or restored, and the next `take` removes them); what a completed save refers
to is never touched by a later save or by training, which writes the live
files only.

Files are copied sparsely (only the blocks that hold data: `SEEK_DATA` /
`SEEK_HOLE`, Linux), so a snapshot costs the table's written rows, not its
size.

Incremental (`take(base=...)`): where the table knows every page of its
files written since its last snapshot (`RowFiles.changes`: since that
snapshot was taken or loaded, in this process), the next snapshot holds only
those pages of each file (at their places in a sparse file, `<file>.delta`,
named apart so that nothing loads it as a whole file; their numbers beside
it in `<file>.pages`) and names the snapshot it builds on (`base` in
`complete.json`, an earlier number). A load copies the chain's first snapshot, which is whole,
then each later one's pages over it, oldest first. A chain stops growing
where its pages would take more than its whole first snapshot (`delta_base`):
the next snapshot is whole again, so a load copies at most about twice a
whole snapshot.

Removing (`remove`, `remove_named`) marks a snapshot released: no longer
listed or loadable, and deleted as soon as no snapshot kept builds on it
(`collect`: renamed away first, so a crash never leaves half of one listed).

`restore` checks the snapshot (complete, this table's, every file at its
recorded size), copies every file beside the live ones under hidden names,
then renames them over the live files. A failure before the renames leaves
the live files as they were; the renames themselves are the only window in
which a crash mixes live files (the snapshot stays whole: load again). The
files replaced keep a hidden name until the table maps the new ones, and are
then removed on a thread of their own (`commit`, `discard`): a trained
table's files take the file system seconds to free.
"""

import errno
import json
import os
import pathlib
import atexit
import itertools
import logging
import shutil
import threading

import numpy as np

from sparseopt.disk.row_files import RESERVE_BYTES
from sparseopt.durable import fsync_path

FOLDER = "snapshots"
COMPLETE = "complete.json"
LAST = "last-number"  # (in FOLDER) the highest number ever taken
RELEASED = "released"  # (in a snapshot's folder) removed, kept while others build on it
PAGES = ".pages"  # (suffix) the pages an incremental snapshot holds of a file, int64
# (suffix) a file held in part: named apart from a whole file, so that no reader taking the
# folder for whole snapshots (an earlier sparseopt, a folder copied alone) loads it whole.
DELTA = ".delta"
# The unit of an incremental snapshot: the blocks `RowFiles` marks written (a page);
# recorded in each such snapshot, which a load follows.
PAGE_BYTES = RESERVE_BYTES
_PARTIAL = ".partial-"
_REPLACED = "-replaced-"  # (in the hidden names of files a load replaced: `commit`)
_numbers = itertools.count()  # (each such name used once in a process)
_TOKEN = os.urandom(6).hex()  # (and a process's own: pids repeat, in containers too)


def next_number(path):
    """The number `take` would give the next snapshot of the table in folder `path`."""
    path = pathlib.Path(path)
    last_file = path / FOLDER / LAST
    last = int(last_file.read_text()) if last_file.exists() else 0
    return max([int(n) for n in listed(path)] + [last]) + 1


def take(path, names, at_least=1, base=None, changed=None):
    """Copies the table's files `names` in folder `path` into a new snapshot; its name.

    Args:
        path: the table's folder (locked by the caller's open files).
        names: its files (every column's, the written-rows bitmap, `table.json`).
        at_least: the lowest number to give it (a table split in shards gives
            each shard's snapshot of one save the same name: the highest of
            their `next_number`s).
        base: a complete snapshot such that the files differ from it only in
            the pages `changed` lists: the new one then holds only those (an
            incremental snapshot). None: every file whole.
        changed: `{file: int64 sorted page numbers}` (pages of `PAGE_BYTES`)
            written since `base`; a file not in it is copied whole.
    """
    path = pathlib.Path(path)
    root = path / FOLDER
    if not root.exists():
        root.mkdir()
        fsync_path(path)
    replaced = []
    for stale in [*root.glob(_PARTIAL + "*"), *path.glob(_PARTIAL + "*")]:
        # An earlier save's or load's crash, or files a load replaced: never referred to.
        if stale.is_dir():
            shutil.rmtree(stale)
        elif _REPLACED in stale.name:
            replaced.append(stale)  # (slow to remove, and named once: not here)
        else:
            stale.unlink(missing_ok=True)
    discard(replaced)
    collect(path)  # (what a crash between a removal's release and its deletion left)
    for name in names:
        fsync_path(path / name)
    snapshot = f"{max(next_number(path), int(at_least)):08d}"
    # Recorded before the copy: a crash after it leaves the number spent, never reused.
    tmp = root / (LAST + ".tmp")
    tmp.write_text(str(int(snapshot)))
    fsync_path(tmp)
    os.replace(tmp, root / LAST)
    partial = root / (_PARTIAL + snapshot)
    partial.mkdir()
    deltas = sorted(set(changed or ()) & set(names)) if base is not None else []
    copied = 0
    for name in names:
        pages = changed[name] if name in deltas else None
        copied += copy_sparse(path / name, partial / _stored(name, deltas), pages)
        if pages is not None:
            np.ascontiguousarray(pages, "<i8").tofile(partial / (name + PAGES))
            fsync_path(partial / (name + PAGES))
    sizes = {name: (partial / _stored(name, deltas)).stat().st_size for name in names}
    # (`bytes`: what was copied, counted as copied: a file system's block counts may lag.)
    record = {"files": sizes, "base": base if deltas else None, "deltas": deltas,
              "page_bytes": PAGE_BYTES, "bytes": copied}
    (partial / COMPLETE).write_text(json.dumps(record, sort_keys=True))
    fsync_path(partial / COMPLETE)
    fsync_path(partial)
    os.replace(partial, root / snapshot)
    fsync_path(root)
    return snapshot


def _stored(name, deltas):
    """The name file `name` has in a snapshot whose files `deltas` are held in part."""
    return name + DELTA if name in deltas else name


def restore(path, snapshot, names, owner):
    """Copies snapshot `snapshot` of the table in folder `path` over its live files.

    Args:
        path: the table's folder.
        snapshot: the snapshot's name (`take`'s).
        names: the table's files.
        owner: the table, for messages.

    Raises:
        ValueError: the snapshot is missing, incomplete or damaged, or another
            table's (the live files are then untouched).

    Returns:
        The live files replaced, kept under hidden names (`commit`): `discard` them once
        nothing maps them.
    """
    return commit(path, stage(path, snapshot, names, owner))


def stage(path, snapshot, names, owner):
    """`restore`'s first half: the snapshot checked and its files copied beside the live
    ones under hidden names; `{name: copy}` (nothing is left where it fails).

    Args:
        path, snapshot, names, owner: as for `restore`.
    """
    path = pathlib.Path(path)
    links = check(path, snapshot, names, owner)
    staged = {name: path / (_PARTIAL + name) for name in names}
    try:
        # The chain's first snapshot (whole), then each later one's pages over it (a
        # file a snapshot holds whole, e.g. `table.json`, replaces what was copied).
        for folder, record in reversed(links):
            for name in names:
                if name in record["deltas"]:
                    copy_sparse(folder / (name + DELTA), staged[name], _pages(folder, name),
                                over=True, page_bytes=record["page_bytes"])
                else:
                    copy_sparse(folder / name, staged[name])
    except BaseException:
        unstage(staged)
        raise
    return staged


def unstage(staged):
    """Removes `stage`'s copies (a restore given up before its `commit`)."""
    for file in staged.values():
        file.unlink(missing_ok=True)


def commit(path, staged):
    """`restore`'s second half: `stage`'s copies renamed over the live files of folder
    `path` (the only window in which a crash mixes live files); the files replaced.

    Each live file replaced is kept under a hidden name (a second link to it, made
    first): deleting a file that training gave disk page by page (`RowFiles.reserve`:
    many extents) takes the file system seconds for a large table, which its last
    name's removal would cost whoever drops its last map. `discard` removes them on a
    thread of its own once the table maps the new files; a crash before leaves them to
    the next `take`, which removes every hidden name.

    Returns:
        `[path]` of the files replaced, under their hidden names.
    """
    path = pathlib.Path(path)
    kept = []
    try:
        for name, file in staged.items():
            # (A name of its own: one being removed on a thread is never given again.)
            old = path / f"{_PARTIAL}{name}{_REPLACED}{_TOKEN}-{next(_numbers)}"
            try:
                os.link(path / name, old)
                kept.append(old)
            except OSError as error:  # (removed by the rename then, where it is mapped)
                logging.getLogger("sparseopt.disk").info(
                    "'%s' could not be kept for removal beside the load (%s): it is freed "
                    "where its last map goes.", path / name, error)
            os.replace(file, path / name)
        fsync_path(path)
    except BaseException:
        discard(kept)  # (their live names, or the loaded files' maps, keep what is used)
        raise
    return kept


# `(folder, thread)` of each `discard` not yet seen ended by `wait_discarded`.
_discarding = []
_discarding_lock = threading.Lock()


def discard(files):
    """Removes `files` (`commit`'s, no longer mapped) on a thread of its own. Python waits
    for it at exit (a daemon thread would be stopped midway).

    Args:
        files: paths, in one table's folder (None: none).
    """
    files = [pathlib.Path(f) for f in files or ()]
    if not files:
        return
    thread = threading.Thread(target=_unlink_all, args=(files,), daemon=True,
                              name="sparseopt replaced table files")
    with _discarding_lock:
        _discarding.append((files[0].parent, thread))
    thread.start()


def leftovers(path):
    """The files loads replaced in folder `path` that a crash or an exit left: `discard`
    them (the folder's table holds its lock, so no load of another is under way)."""
    return [f for f in pathlib.Path(path).glob(f"{_PARTIAL}*{_REPLACED}*") if f.is_file()]


def _unlink_all(files):
    for file in files:
        _unlink(file)


def _unlink(file):
    """Removes `file` (missing: already removed, e.g. by a `take`)."""
    pathlib.Path(file).unlink(missing_ok=True)


def wait_discarded(path=None):
    """Returns once every file `discard` was given (in folder `path`; None: anywhere) is
    removed.

    Args:
        path: a table's folder, or None.
    """
    folder = None if path is None else pathlib.Path(path)
    with _discarding_lock:
        mine = [t for f, t in _discarding if folder is None or f == folder]
    for thread in mine:
        thread.join()
    with _discarding_lock:
        _discarding[:] = [(f, t) for f, t in _discarding if t.is_alive()]


atexit.register(wait_discarded)


def check(path, snapshot, names, owner):
    """Raises a ValueError naming `owner` unless snapshot `snapshot` of the table in folder
    `path`, and each snapshot it builds on, is complete, whole, and of this table's files
    (as `restore` checks first); else `[(folder, record)]` of the chain, `snapshot`'s first.

    Args:
        path, snapshot, names, owner: as for `restore`.
    """
    path = pathlib.Path(path)
    where = f"{owner}: the file being loaded holds its rows in snapshot '{snapshot}' of '{path}'"
    folder = path / FOLDER / str(snapshot)
    if (folder / RELEASED).exists():  # (removed; kept only for the snapshots after it)
        raise ValueError(f"{where}, which is missing (removed). Load a file whose snapshot "
                         "was kept.")
    links, name = [], str(snapshot)
    while name is not None:
        folder = path / FOLDER / name
        if name.startswith(_PARTIAL) or not (folder / COMPLETE).exists():
            state = "incomplete" if folder.exists() else "missing"
            what = (f"which is {state}" if not links else
                    f"which builds on snapshot '{name}', {state}")
            raise ValueError(f"{where}, {what}. Load a file saved with this table's folder "
                             "in place, or restore the folder.")
        record = json.loads((folder / COMPLETE).read_text())
        record.setdefault("deltas", [])
        _check_files(where, folder, record, names)
        if (folder / "table.json").read_text() != (path / "table.json").read_text():
            raise ValueError(f"{where}, which holds another table's files than this "
                             "layer's.")
        links.append((folder, record))
        name = _base_of(record, name)
        if name is False:
            raise ValueError(f"{where}, whose record in '{folder}' is damaged (it builds on "
                             "no earlier snapshot).")
    return links


def _base_of(record, name):
    """The snapshot `record` (snapshot `name`'s) builds on, None, or False where it names
    one that is no earlier snapshot (a damaged record: following it could loop)."""
    base = record.get("base")
    if base is None:
        return None
    try:
        return str(base) if int(base) < int(name) else False
    except (TypeError, ValueError):
        return False


def _check_files(where, folder, record, names):
    """Raises a ValueError unless every file of `names` is in snapshot `folder` at its size,
    and the pages of each file held in part are listed."""
    sizes = record["files"]
    for name in names:
        file = folder / _stored(name, record["deltas"])
        if sizes.get(name) is None or not file.exists() or file.stat().st_size != sizes[name]:
            raise ValueError(f"{where}, whose '{name}' is missing or damaged.")
        if name in record["deltas"]:
            pages = folder / (name + PAGES)
            if (not pages.exists() or pages.stat().st_size % 8
                    or not isinstance(record.get("page_bytes"), int)):
                raise ValueError(f"{where}, whose '{name}' is missing or damaged (its list "
                                 "of pages).")


def _pages(folder, name):
    """The page numbers an incremental snapshot holds of file `name`."""
    return np.fromfile(folder / (name + PAGES), "<i8")


def delta_base(path, base, changed):
    """`base` if the next snapshot of the table in folder `path` may build on it, holding
    the pages `changed`: it is complete, and its chain's pages with these stay within its
    first (whole) snapshot's bytes; else None (the next snapshot is whole).

    Args:
        path: the table's folder.
        base: the snapshot its files were last taken in or loaded from (or None).
        changed: `{file: int64 sorted page numbers}` the next one would hold.
    """
    if base is None:
        return None
    added = 0
    for name, pages in changed.items():  # (the bytes they hold: a last page may be short)
        if pages.size:
            size = (pathlib.Path(path) / name).stat().st_size
            added += pages.size * PAGE_BYTES - max(0, (int(pages[-1]) + 1) * PAGE_BYTES - size)
    root, name = pathlib.Path(path) / FOLDER, str(base)
    while True:
        try:
            record = json.loads((root / name / COMPLETE).read_text())
        except (OSError, ValueError):
            return None  # (gone, or damaged: a whole one)
        earlier = _base_of(record, name)
        if earlier is None:
            return str(base) if added <= record.get("bytes", 0) else None
        if earlier is False:
            return None
        added += record.get("bytes", 0)
        name = earlier


def listed(path):
    """The names of the complete snapshots in folder `path`, oldest first.

    Args:
        path: the table's folder.
    """
    return [name for name in _complete(path)
            if not (pathlib.Path(path) / FOLDER / name / RELEASED).exists()]


def _complete(path):
    """Every complete snapshot in folder `path`, released ones too, oldest first."""
    root = pathlib.Path(path) / FOLDER
    if not root.exists():
        return []
    return sorted(p.name for p in root.iterdir()
                  if not p.name.startswith(_PARTIAL) and (p / COMPLETE).exists())


def remove(path, keep):
    """Removes all but the `keep` newest complete snapshots in folder `path`; their names.

    A weights file that refers to a removed snapshot can no longer be loaded:
    keep those your files need.

    Args:
        path: the table's folder.
        keep: how many of the newest to keep.
    """
    names = listed(path)
    old = names[:max(len(names) - int(keep), 0)]
    for name in old:
        _release(pathlib.Path(path) / FOLDER / name)
    collect(path)
    return old


def remove_named(path, names):
    """Removes the snapshots `names` in folder `path` (those already gone are skipped); the
    names removed.

    Args:
        path: the table's folder.
        names: snapshot names (`take`'s).
    """
    removed = []
    for name in names:
        folder = pathlib.Path(path) / FOLDER / str(name)
        if not folder.is_dir() or folder.name.startswith(_PARTIAL):
            continue
        if not (folder / COMPLETE).exists():  # (no snapshot, nothing builds on it)
            _delete(folder)
            removed.append(str(name))
        elif not (folder / RELEASED).exists():
            _release(folder)
            removed.append(str(name))
    collect(path)
    return removed


def _release(folder):
    """Marks snapshot `folder` removed (durably: a crash never lists it again)."""
    (folder / RELEASED).touch()
    fsync_path(folder / RELEASED)
    fsync_path(folder)


def collect(path):
    """Deletes the released snapshots in folder `path` that no snapshot kept builds on.

    Each is renamed to a hidden name before it is deleted: a crash midway leaves
    no part of one listed (the next `take` deletes what is left).
    """
    root = pathlib.Path(path) / FOLDER
    every = _complete(path)
    needed = set()
    for name in every:
        if (root / name / RELEASED).exists():
            continue
        while name is not None and name not in needed:
            needed.add(name)
            try:
                record = json.loads((root / name / COMPLETE).read_text())
            except (OSError, ValueError):
                return  # (what it builds on is unknown: nothing is deleted)
            name = _base_of(record, name) or None
    for name in every:
        if name not in needed and (root / name / RELEASED).exists():
            _delete(root / name)
    if every:
        fsync_path(root)


def _delete(folder):
    """Deletes snapshot `folder`, renamed to a hidden name first (a crash midway leaves
    nothing listed; the next `take` deletes what is left)."""
    gone = folder.parent / f"{_PARTIAL}{folder.name}-removed"
    os.replace(folder, gone)
    shutil.rmtree(gone)


def copy_sparse(src, dst, pages=None, over=False, page_bytes=PAGE_BYTES):
    """Copies file `src` to `dst` (created or replaced, then synced), holes left holes.

    Args:
        src: the file to copy.
        dst: where (replaced if it exists).
        pages: int64 sorted page numbers (of `PAGE_BYTES`): only those pages are
            copied, each to its place (None: the whole file).
        over: write the pages over `dst` as it is (it exists, of `src`'s size),
            rather than into a new file.
        page_bytes: the bytes of a page.

    Returns:
        The bytes copied.
    """
    with open(src, "rb") as fin, open(dst, "r+b" if over else "wb") as fout:
        size = os.fstat(fin.fileno()).st_size
        if not over:
            fout.truncate(size)
        if pages is not None:
            copied = 0
            for start, stop in _runs(pages):
                begin = start * page_bytes
                length = min(stop * page_bytes, size) - begin
                _copy_range(fin.fileno(), fout.fileno(), begin, length)
                copied += length
            fout.flush()
            os.fsync(fout.fileno())
            return copied
        offset = copied = 0
        while offset < size:
            try:
                start = os.lseek(fin.fileno(), offset, os.SEEK_DATA)
            except OSError as error:
                if error.errno != errno.ENXIO:  # (ENXIO: no data past `offset`)
                    raise
                break
            end = os.lseek(fin.fileno(), start, os.SEEK_HOLE)
            _copy_range(fin.fileno(), fout.fileno(), start, end - start)
            copied += end - start
            offset = end
        fout.flush()
        os.fsync(fout.fileno())
        return copied


def _runs(pages):
    """`[(start, stop)]`: runs of consecutive page numbers in sorted `pages`."""
    pages = np.asarray(pages, np.int64)
    if pages.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(pages) != 1) + 1
    starts = np.concatenate([pages[:1], pages[breaks]])
    stops = np.concatenate([pages[breaks - 1], pages[-1:]]) + 1
    return list(zip(starts.tolist(), stops.tolist()))


def _copy_range(fin, fout, offset, length):
    """Bytes `[offset, offset + length)` of `fin` to the same place in `fout`."""
    done = 0
    while done < length:
        try:
            n = os.copy_file_range(fin, fout, length - done, offset + done, offset + done)
        except OSError as error:  # (a file system without it: plain reads and writes)
            if error.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                raise
            n = os.pwrite(fout, os.pread(fin, min(length - done, 1 << 24), offset + done),
                          offset + done)
        if n == 0:
            raise OSError(errno.EIO, f"copying a table's file stopped at byte {offset + done}")
        done += n
