"""What a crash must not undo: flushing a file or a folder entry to disk."""

import os


def fsync_path(path):
    """Flushes a file or a directory entry to disk.

    Args:
        path: the file or folder.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
