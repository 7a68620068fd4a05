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

`restore` checks the snapshot (complete, this table's, every file at its
recorded size), copies every file beside the live ones under hidden names,
then renames them over the live files. A failure before the renames leaves
the live files as they were; the renames themselves are the only window in
which a crash mixes live files (the snapshot stays whole: load again).
"""

import errno
import json
import os
import pathlib
import shutil

from sparseopt.durable import fsync_path

FOLDER = "snapshots"
COMPLETE = "complete.json"
LAST = "last-number"  # (in FOLDER) the highest number ever taken
_PARTIAL = ".partial-"


def next_number(path):
    """The number `take` would give the next snapshot of the table in folder `path`."""
    path = pathlib.Path(path)
    last_file = path / FOLDER / LAST
    last = int(last_file.read_text()) if last_file.exists() else 0
    return max([int(n) for n in listed(path)] + [last]) + 1


def take(path, names, at_least=1):
    """Copies the table's files `names` in folder `path` into a new snapshot; its name.

    Args:
        path: the table's folder (locked by the caller's open files).
        names: its files (every column's, the written-rows bitmap, `table.json`).
        at_least: the lowest number to give it (a table split in shards gives
            each shard's snapshot of one save the same name: the highest of
            their `next_number`s).
    """
    path = pathlib.Path(path)
    root = path / FOLDER
    if not root.exists():
        root.mkdir()
        fsync_path(path)
    for stale in [*root.glob(_PARTIAL + "*"), *path.glob(_PARTIAL + "*")]:
        # An earlier save's or load's crash: never referred to.
        if stale.is_dir():
            shutil.rmtree(stale)
        else:
            stale.unlink()
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
    for name in names:
        copy_sparse(path / name, partial / name)
    sizes = {name: (partial / name).stat().st_size for name in names}
    (partial / COMPLETE).write_text(json.dumps({"files": sizes}, sort_keys=True))
    fsync_path(partial / COMPLETE)
    fsync_path(partial)
    os.replace(partial, root / snapshot)
    fsync_path(root)
    return snapshot


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
    """
    commit(path, stage(path, snapshot, names, owner))


def stage(path, snapshot, names, owner):
    """`restore`'s first half: the snapshot checked and its files copied beside the live
    ones under hidden names; `{name: copy}` (nothing is left where it fails).

    Args:
        path, snapshot, names, owner: as for `restore`.
    """
    path = pathlib.Path(path)
    check(path, snapshot, names, owner)
    folder = path / FOLDER / str(snapshot)
    staged = {name: path / (_PARTIAL + name) for name in names}
    try:
        for name in names:
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
    `path` (the only window in which a crash mixes live files)."""
    path = pathlib.Path(path)
    for name, file in staged.items():
        os.replace(file, path / name)
    fsync_path(path)


def check(path, snapshot, names, owner):
    """Raises a ValueError naming `owner` unless snapshot `snapshot` of the table in folder
    `path` is complete, whole, and of this table's files (as `restore` checks first).

    Args:
        path, snapshot, names, owner: as for `restore`.
    """
    path = pathlib.Path(path)
    folder = path / FOLDER / str(snapshot)
    where = f"{owner}: the file being loaded holds its rows in snapshot '{snapshot}' of '{path}'"
    if str(snapshot).startswith(_PARTIAL) or not (folder / COMPLETE).exists():
        raise ValueError(
            f"{where}, which is {'incomplete' if folder.exists() else 'missing'}. Load a "
            "file saved with this table's folder in place, or restore the folder.")
    sizes = json.loads((folder / COMPLETE).read_text())["files"]
    for name in names:
        file = folder / name
        if sizes.get(name) is None or not file.exists() or file.stat().st_size != sizes[name]:
            raise ValueError(f"{where}, whose '{name}' is missing or damaged.")
    if (folder / "table.json").read_text() != (path / "table.json").read_text():
        raise ValueError(f"{where}, which holds another table's files than this layer's.")


def listed(path):
    """The names of the complete snapshots in folder `path`, oldest first.

    Args:
        path: the table's folder.
    """
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
        shutil.rmtree(pathlib.Path(path) / FOLDER / name)
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
        if folder.is_dir() and not folder.name.startswith(_PARTIAL):
            shutil.rmtree(folder)
            removed.append(str(name))
    return removed


def copy_sparse(src, dst):
    """Copies file `src` to `dst` (created or replaced, then synced), holes left holes.

    Args:
        src: the file to copy.
        dst: where (replaced if it exists).
    """
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        size = os.fstat(fin.fileno()).st_size
        fout.truncate(size)
        offset = 0
        while offset < size:
            try:
                start = os.lseek(fin.fileno(), offset, os.SEEK_DATA)
            except OSError as error:
                if error.errno != errno.ENXIO:  # (ENXIO: no data past `offset`)
                    raise
                break
            end = os.lseek(fin.fileno(), start, os.SEEK_HOLE)
            _copy_range(fin.fileno(), fout.fileno(), start, end - start)
            offset = end
        fout.flush()
        os.fsync(fout.fileno())


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
