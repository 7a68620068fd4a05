"""Crash-safe saving: a checkpoint file is replaced whole or not at all.

Keras' `model.save` and `model.save_weights` open the target path and write
into it. A crash (SIGKILL, a preempted machine, a full disk) in the middle of
that write leaves a truncated file where the previous good checkpoint was.
These functions write to a temporary file in the same directory, flush it to
disk, and then rename it over the target, which POSIX makes atomic: a reader
sees the old file or the new one, never a mix.
"""

import contextlib
import os

import keras


def save_model(model, filepath, **kwargs):
    """`model.save(filepath)` that never leaves a partly written file.

    Args:
        model: the Keras model.
        filepath: local path ending in `.keras`.
        **kwargs: passed on to `model.save`.
    """
    if kwargs.get("zipped", True) is False:
        raise ValueError("sparseopt.saving.save_model: `zipped=False` writes a directory, "
                         "which cannot be replaced atomically; save a `.keras` file.")
    with _atomic_file(filepath) as tmp:
        model.save(tmp, **kwargs)


def save_weights(model, filepath, **kwargs):
    """`model.save_weights(filepath)` that never leaves a partly written file.

    Args:
        model: the Keras model.
        filepath: local path ending in `.weights.h5`.
        **kwargs: passed on to `model.save_weights`.
    """
    if kwargs.get("max_shard_size") is not None:
        raise ValueError("sparseopt.saving.save_weights: sharded weights are several files, "
                         "which cannot be replaced atomically together; save one "
                         "`.weights.h5` file, or write each checkpoint to a new directory.")
    with _atomic_file(filepath) as tmp:
        model.save_weights(tmp, **kwargs)


def fsync_path(path):
    """Flushes a file or a directory entry to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_one_process(what):
    """Refuses to write a checkpoint file from one of several JAX processes.

    Keras' `.keras` / `.weights.h5` writers fetch every variable into this
    process, which fails for tables sharded over several hosts' devices.

    Args:
        what: the saver's name, for the message.
    """
    if keras.backend.backend() != "jax":
        return
    import jax

    if jax.process_count() > 1:
        raise ValueError(
            f"{what}: this is one of {jax.process_count()} processes, and a sharded "
            "model's variables are spread over all of them; one file cannot be written "
            "from here. Use `keras.callbacks.OrbaxCheckpoint(directory)` (every process "
            "writes its own shards) and `model.load_weights(directory)` to resume."
        )


@contextlib.contextmanager
def _atomic_file(filepath):
    check_one_process("sparseopt.saving")
    filepath = os.fspath(filepath)
    if "://" in filepath:  # gs://, s3://, hf://: no atomic rename there
        raise ValueError(
            f"sparseopt.saving: '{filepath}' is a remote path; atomic replacement "
            "is only guaranteed on a local file system. Save locally and copy, "
            "or use the object store's own versioning."
        )
    directory, base = os.path.split(os.path.abspath(filepath))
    os.makedirs(directory, exist_ok=True)
    # Same directory (rename must not cross file systems) and same suffix
    # (Keras checks `.keras` / `.weights.h5`).
    tmp = os.path.join(directory, f".tmp-{os.getpid()}-{base}")
    try:
        yield tmp
        fsync_path(tmp)
        os.replace(tmp, filepath)
        fsync_path(directory)  # make the rename itself durable
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
