"""What a table's folder holds: the table whole, or the table split into shards.

A table on disk whole keeps its files in its folder (`row_files.py`:
`table.json` says what they hold). A table split into `n` shards
(`sharded.py`) keeps each shard's files in a folder of its own inside it,
and `shards.json` in it says so (the table's shape and `n`). Each kind
refuses the other's folder (`RowFiles` one with `shards.json`), and a split
table refuses a folder split otherwise: a shard's rows are a range of the
table's, so the same files read under another split (or whole) would be
other rows. The folder of a split
table is locked while it is open, as a whole table's is (the same lock file),
so a table opened whole and split at once is refused too.
"""

import json
import os
import pathlib

from sparseopt.disk.row_files import LOCK, SHARDS, locked, read_shards
from sparseopt.durable import fsync_path


def claim(path, owner, shards, shape):
    """Locks folder `path` for a table split into `shards` (created if missing), recording
    its split there, or refuses it; the open lock (closing it lets the folder go).

    Args:
        path: the folder holding the shards' folders.
        owner: the table, for messages.
        shards: how many shards.
        shape: the table's shape.

    Raises:
        ValueError: the folder holds the table whole, or split otherwise, or is open.
    """
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    lock = locked(path / LOCK, owner)
    try:
        if (path / "table.json").exists():
            raise ValueError(
                f"{owner}: '{path}' holds a table on disk whole (its table.json), and this "
                f"table is split into {shards} shards: their rows would be others. Give it "
                "another folder, or train it whole (leave its path out of the LayoutMap).")
        record = {"shards": int(shards), "shape": [int(d) for d in shape]}
        file = path / SHARDS
        if file.exists():
            found = read_shards(file)
            if found != record:
                raise ValueError(
                    f"{owner}: '{path}' holds a table on disk split as {found}; this table "
                    f"is split as {record}: its shards' rows would be others. Split it as "
                    "it was (the same devices for its rows), or give it another folder.")
        else:
            # (Shards of this split check themselves, each its own table.json; shards of
            # another would be left beside new ones, their rows silently not these.)
            stray = sorted(p.name for p in path.glob("shard-*-of-*")
                           if not p.name.endswith(f"-of-{int(shards)}"))
            if stray:
                raise ValueError(
                    f"{owner}: '{path}' holds shards {stray} of another split, without its "
                    f"{SHARDS}; this table is split into {shards}. Split it as it was, give "
                    "it an empty folder, or restore the folder.")
            tmp = file.with_suffix(".tmp")
            tmp.write_text(json.dumps(record, sort_keys=True))
            fsync_path(tmp)
            os.replace(tmp, file)
            fsync_path(path)
    except BaseException:
        lock.close()
        raise
    return lock
