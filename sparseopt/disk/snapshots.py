"""Snapshots of a table on disk: what a save holds of it, and how a load brings it back.

A weights file cannot hold a table larger than memory, so a save of a table
on disk takes a snapshot of its files in its own folder
(`<path>/snapshots/<name>/`) and the file records the snapshot's name
(`SparseEmbedding.save_own_variables`). A snapshot is taken between steps
(Keras saves outside the train step), after the cache's dirty rows are
written into the files, so it holds one step's end, never half of one.

Crash safety (`take`): the copy is written under a hidden name, each file
synced, then a `complete.json` synced, then the folder renamed into place
and the parent synced. A crash at any point leaves either no snapshot of
that name or a complete one; what a completed save refers to is never
touched by a later save or by training, which writes the live files only.
Leftover partial copies are removed by the next `take`.

Files are copied sparsely (only the blocks that hold data: `SEEK_DATA` /
`SEEK_HOLE`), so a snapshot costs the table's written rows, not its size.

`restore` copies a snapshot back over the live files (each file written
under a hidden name, synced, then renamed over the live one). A crash while
restoring can leave the live files mixed, never the snapshot: load again.
"""

import json
import os
import pathlib
import shutil
import time
import uuid

from sparseopt.durable import fsync_path

FOLDER = "snapshots"
COMPLETE = "complete.json"
_PARTIAL = ".partial-"


def take(path, names):
    """Copies the table's files `names` in folder `path` into a new snapshot; its name.

    Args:
        path: the table's folder.
        names: its files (every column's, the written-rows bitmap, `table.json`).
    """
    path = pathlib.Path(path)
    root = path / FOLDER
    root.mkdir(exist_ok=True)
    for stale in root.glob(_PARTIAL + "*"):  # an earlier save's crash: never referred to
        shutil.rmtree(stale, ignore_errors=True)
    for name in names:
        fsync_path(path / name)
    snapshot = f"{time.time_ns():020d}-{uuid.uuid4().hex[:8]}"
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
        ValueError: the snapshot is missing or incomplete, or holds another table.
    """
    path = pathlib.Path(path)
    folder = path / FOLDER / str(snapshot)
    if not (folder / COMPLETE).exists():
        raise ValueError(
            f"{owner}: the file being loaded holds its rows in snapshot '{snapshot}' of "
            f"'{path}', which is {'incomplete' if folder.exists() else 'missing'}. Load a "
            "file saved with this table's folder in place, or restore the folder.")
    if (folder / "table.json").read_text() != (path / "table.json").read_text():
        raise ValueError(f"{owner}: snapshot '{snapshot}' in '{path}' holds another table's "
                         "files than this layer's.")
    for name in names:
        staged = path / (_PARTIAL + name)
        copy_sparse(folder / name, staged)
        os.replace(staged, path / name)
    fsync_path(path)


def listed(path):
    """The names of the complete snapshots in folder `path`, oldest first."""
    root = pathlib.Path(path) / FOLDER
    if not root.exists():
        return []
    return sorted(p.name for p in root.iterdir() if (p / COMPLETE).exists())


def remove(path, keep):
    """Removes all but the `keep` newest complete snapshots in folder `path`; their names.

    A weights file that refers to a removed snapshot can no longer be loaded:
    keep those your files need.
    """
    old = listed(path)[:max(len(listed(path)) - int(keep), 0)]
    for name in old:
        shutil.rmtree(pathlib.Path(path) / FOLDER / name)
    return old


def copy_sparse(src, dst):
    """Copies file `src` to `dst` (created or replaced, then synced), holes left holes."""
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        size = os.fstat(fin.fileno()).st_size
        fout.truncate(size)
        offset = 0
        while offset < size:
            try:
                start = os.lseek(fin.fileno(), offset, os.SEEK_DATA)
            except OSError:  # (ENXIO: no data past `offset`)
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
        n = os.copy_file_range(fin, fout, length - done, offset + done, offset + done)
        if n == 0:
            break
        done += n
