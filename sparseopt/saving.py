"""Crash-safe saving, and loading weights files written by other model versions.

`save_model` / `save_weights`: a checkpoint file is replaced whole or not at all.

Keras' `model.save` and `model.save_weights` open the target path and write
into it. A crash (SIGKILL, a preempted machine, a full disk) in the middle of
that write leaves a truncated file where the previous good checkpoint was.
These functions write to a temporary file in the same directory, flush it to
disk, and then rename it over the target, which POSIX makes atomic: a reader
sees the old file or the new one, never a mix.
"""

import contextlib
import os
import tempfile
import zipfile

import keras

from sparseopt import compat
from sparseopt.durable import fsync_path  # noqa: F401 (callbacks.py's, and this module's)


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


def load_embedding_weights(model, filepath, skip_mismatch=False):
    """Loads weights written by the same model built with `keras.layers.Embedding`.

    Moves a Keras recommender to sparseopt without retraining: rebuild the
    model with `sparseopt.layers.SparseEmbedding` in place of each
    `keras.layers.Embedding` (same order, same `input_dim`/`output_dim`) and
    load its old weights file here. A `SparseEmbedding` saves exactly what an
    `Embedding` saves (its table); on JAX `get_weights()` lists the same
    arrays too, so `new_model.set_weights(old_model.get_weights())` works
    there (on TensorFlow it also lists each lookup's probe). Keras' own
    `load_weights` refuses the file: it keys the layers of a functional
    or sequential model (and those of a subclassed model that it reaches
    through `model.layers`) by class name, which this function maps.

    Only the model's weights are read: the file's optimizer state (a Keras
    optimizer's slots for whole tables) is not sparseopt's and is skipped;
    the model may be compiled or not.

    Args:
        model: the model built with `SparseEmbedding`s; every one of them was
            a `keras.layers.Embedding` in the model that wrote the file.
        filepath: a `.weights.h5` or `.keras` file.
        skip_mismatch: as in `model.load_weights`.
    """
    from sparseopt.layers import SparseEmbedding

    tables = [layer for layer in compat.sublayers(model) if isinstance(layer, SparseEmbedding)]
    _load_as(model, filepath, tables, "Embedding", skip_mismatch)


def load_legacy_keras_rs_weights(model, filepath, skip_mismatch=False):
    """Loads a keras-rs model's weights file written with sparseopt 0.1.0 or earlier.

    Those versions renamed a keras-rs `EmbedReduce` to `SparseEmbedReduce`
    once a `DispatchOptimizer` was built (on TensorFlow, after the first
    step), and Keras keys keras-rs' tables by class name: such files hold
    them under `.../sparse_embed_reduce*/...`. Later files are keras-rs'
    own and load with `model.load_weights`. The file's optimizer state is
    skipped, as in `load_embedding_weights`.

    Args:
        model: the keras-rs model (with or without sparseopt), built.
        filepath: a `.weights.h5` or `.keras` file.
        skip_mismatch: as in `model.load_weights`.
    """
    import keras_rs

    tables = [reader for layer in compat.sublayers(model)
              if isinstance(layer, keras_rs.layers.DistributedEmbedding) and layer.built
              for _, reader in compat.default_device_features(layer).values()]
    _load_as(model, filepath, tables, "SparseEmbedReduce", skip_mismatch)


def _load_as(model, filepath, layers, class_name, skip_mismatch):
    filepath = os.fspath(filepath)
    with contextlib.ExitStack() as stack:
        if filepath.endswith(".keras"):
            # Keras skips objects for `.weights.h5` files only: read the
            # archive's weights file.
            directory = stack.enter_context(tempfile.TemporaryDirectory())
            with zipfile.ZipFile(filepath) as archive:
                filepath = archive.extract("model.weights.h5", directory)
        elif not filepath.endswith(".weights.h5"):
            raise ValueError(
                f"sparseopt.saving: '{filepath}' is neither a `.weights.h5` nor a "
                "`.keras` file.")
        skip = [model.optimizer] if getattr(model, "optimizer", None) is not None else []
        with compat.saved_as(layers, class_name):
            model.load_weights(filepath, skip_mismatch=skip_mismatch, objects_to_skip=skip)


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
