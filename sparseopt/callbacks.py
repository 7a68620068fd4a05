"""Callbacks: crash-safe `BackupAndRestore`, and `TableHealth` for refused updates."""

import json
import os
import re
import shutil
import warnings

import keras
from keras import ops

from sparseopt import compat
from sparseopt.disk import snapshots
from sparseopt.disk.table import DiskTable
from sparseopt.optimizer.dispatch import DispatchOptimizer
from sparseopt.saving import check_one_process, fsync_path

_DONE = re.compile(r"^backup-(\d{8})$")
_WEIGHTS = "model.weights.h5"
_METADATA = "training_metadata.json"


class BackupAndRestore(keras.callbacks.BackupAndRestore):
    """`keras.callbacks.BackupAndRestore` with crash-safe backups.

    Keras' callback overwrites `latest.weights.h5` in place and then writes the
    epoch number to a second file. A crash during the weights write leaves no
    readable backup; a crash between the two writes pairs new weights with the
    old epoch, so the restarted run trains that epoch twice. Here each backup
    (weights and epoch together) is written to a fresh directory that is
    renamed into place only when complete, so a restart always finds the
    latest complete backup, and a backup never mixes two epochs.

    Restarting `fit` with the same model, compile arguments and data order
    continues exactly where the last backup was taken: tables, every
    updater's state, the dense optimizer's state and the step count all come
    back (see docs/reliability.md).

    Args:
        backup_dir: local directory for the backups; used by this callback only.
        save_freq: `"epoch"` (the only exact choice, see below).
        double_checkpoint: keep the previous backup as well (twice the disk).
        delete_checkpoint: delete the backups when `fit` completes.

    A model with tables on disk (`storage=OnDisk(...)`): each backup's
    weights file names a snapshot of each table's files (docs/disk.md), and
    the backup's metadata lists them, so the snapshots go with the backup
    when it is replaced by a newer one or deleted at the end of `fit`. (A
    crash in the middle of a backup can leave that backup's snapshots:
    `layer.embeddings.remove_snapshots(keep=...)` removes them.)

    Keras restores the epoch, not the batch within it, so a mid-epoch backup
    (integer `save_freq`) would replay that epoch's first batches on weights
    that already learned from them; it is refused. For more frequent backups
    make epochs shorter: `fit(dataset.repeat(), steps_per_epoch=N, ...)`.
    """

    def __init__(self, backup_dir, save_freq="epoch", double_checkpoint=False,
                 delete_checkpoint=True):
        if save_freq != "epoch":
            raise ValueError(
                f"sparseopt BackupAndRestore: save_freq={save_freq!r} is not "
                "supported: Keras resumes at the start of the backed-up epoch, so "
                "batches after a mid-epoch backup would be trained twice. Use "
                "save_freq='epoch' with shorter epochs, e.g. "
                "`fit(dataset.repeat(), steps_per_epoch=N)`."
            )
        if "://" in str(backup_dir):
            raise ValueError(
                f"sparseopt BackupAndRestore: '{backup_dir}' is a remote path; "
                "crash-safe backups need a local file system (atomic rename)."
            )
        super().__init__(backup_dir, save_freq="epoch", double_checkpoint=double_checkpoint,
                         delete_checkpoint=delete_checkpoint)

    def _backups(self):
        """Complete backups, oldest first."""
        if not os.path.isdir(self.backup_dir):
            return []
        done = sorted(n for n in os.listdir(self.backup_dir) if _DONE.match(n))
        return [os.path.join(self.backup_dir, n) for n in done]

    def _load_model(self):
        if not self.model.built:
            raise ValueError(
                "sparseopt BackupAndRestore: build the model before `fit` (call it "
                "on a batch, or use a functional model) so its backup can be loaded."
            )
        self._remove_partial_backups()
        backups = self._backups()
        if not backups:
            return
        latest = backups[-1]
        if self.model.optimizer is not None and not self.model.optimizer.built:
            self.model.optimizer.build(self.model.trainable_variables)
        self.model.load_weights(os.path.join(latest, _WEIGHTS))
        with open(os.path.join(latest, _METADATA)) as f:
            compat.set_initial_epoch(self.model, json.load(f)["epoch"])

    def _save_model(self):
        os.makedirs(self.backup_dir, exist_ok=True)
        backups = self._backups()
        number = int(_DONE.match(os.path.basename(backups[-1])).group(1)) + 1 if backups else 0
        final = os.path.join(self.backup_dir, f"backup-{number:08d}")
        partial = os.path.join(self.backup_dir, f".partial-{number:08d}")
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
        # (Each folder's: a table split in shards snapshots every shard's folder.)
        tables = [part for table in disk_tables(self.model) for part in table.parts()]
        before = [set(table.snapshots()) for table in tables]
        self.model.save_weights(os.path.join(partial, _WEIGHTS))
        # The snapshots this save took (one per table on disk): this backup's.
        taken = [[os.path.abspath(table.settings.path), name]
                 for table, old in zip(tables, before)
                 for name in table.snapshots() if name not in old]
        with open(os.path.join(partial, _METADATA), "w") as f:
            json.dump({"epoch": self._current_epoch, "snapshots": taken}, f)
        for name in (_WEIGHTS, _METADATA, ""):
            fsync_path(os.path.join(partial, name))
        os.rename(partial, final)  # the commit point
        fsync_path(self.backup_dir)
        keep = 2 if self.double_checkpoint else 1
        for old in backups[: max(0, len(backups) + 1 - keep)]:
            _remove_backup(old)

    def _remove_partial_backups(self):
        if os.path.isdir(self.backup_dir):
            for name in os.listdir(self.backup_dir):
                if name.startswith(".partial-"):  # (with snapshots its metadata lists)
                    _remove_backup(os.path.join(self.backup_dir, name))

    def on_train_begin(self, logs=None):
        check_one_process("sparseopt.callbacks.BackupAndRestore")
        self._load_model()

    def on_train_end(self, logs=None):
        if self.delete_checkpoint:
            for backup in self._backups():
                _remove_backup(backup)
            shutil.rmtree(self.backup_dir, ignore_errors=True)


def _remove_backup(folder):
    """Removes backup `folder` and the snapshots of tables on disk its metadata lists."""
    try:
        with open(os.path.join(folder, _METADATA)) as f:
            taken = json.load(f).get("snapshots", [])
    except (OSError, ValueError):
        taken = []
    for path, name in taken:
        snapshots.remove_named(path, [name])
    shutil.rmtree(folder, ignore_errors=True)


def disk_tables(model):
    """The tables on disk (`DiskTable`s) of `model`'s layers.

    Found through the layers: on TF the optimizer is built inside the first
    step, after `fit`'s first callbacks ran.

    Args:
        model: a Keras model.
    """
    return [layer.embeddings for layer in compat.sublayers(model)
            if isinstance(getattr(layer, "embeddings", None), DiskTable)]


class TableHealth(keras.callbacks.Callback):
    """Shows, in `fit`'s logs, the updates the tables refused.

    A step whose gradient for a table is not finite leaves that table and its
    state untouched; an id outside `[0, rows)` is never written. At the end of
    each epoch this callback adds to the logs (so `History`, progress bars and
    TensorBoard show them):

    - `sparse_skipped_steps`: steps a table skipped for non-finite gradients,
      summed over tables, since training began;
    - `sparse_dropped_ids`: ids outside `[0, rows)`, summed over tables;
    - with a `keras.optimizers.LossScaleOptimizer`, which skips such a step
      for every variable before the tables see it: `loss_scale` and
      `loss_scale_skipped_steps` (this epoch);
    - with open-vocabulary tables (`DynamicEmbedding`), summed over them:
      `vocabulary_held` (rows holding an id now) and the running totals
      `vocabulary_admitted`, `vocabulary_evicted`, `vocabulary_default_lookups`
      (lookups of ids not held), `vocabulary_found`, `vocabulary_probe_length`,
      `vocabulary_reclaimed` and `vocabulary_unplaced` (`sparseopt.vocabulary.COUNTS`), and
      `vocabulary_mean_probe_length` (rows read per id found; 1: its home row);
    - with tables on disk (`storage=OnDisk(...)`), over them and this epoch:
      `disk_hit_rate` (the share of row lookups their caches held),
      `disk_kb_read_per_step` and `disk_kb_written_per_step` (their files'
      bytes, rows and per-row state); the epoch's lookups include its
      validation's. And where their host work went, in milliseconds per
      training step: `disk_host_ms_per_step` (in the steps' host calls, which
      the step waits for), `disk_waited_ms_per_step` (of those, waiting for the
      tables' threads beside the step), `disk_beside_ms_per_step` (on those
      threads, overlapping the steps).

    With `warn=True` it also warns, naming each table whose count grew.

    Args:
        warn: whether to warn when a count grows.
    """

    def __init__(self, warn=True):
        super().__init__()
        self.warn = warn
        self._last = {}

    def _dispatch(self):
        try:
            return DispatchOptimizer.of(self.model)
        except ValueError:
            raise ValueError("TableHealth: the model's optimizer is not a "
                             "sparseopt.DispatchOptimizer.") from None

    def on_epoch_begin(self, epoch, logs=None):
        self._steps = 0
        self._applied_before = int(ops.convert_to_numpy(self._dispatch().iterations))
        self._disk_before = self._disk_counts()

    def _disk_counts(self):
        """The counts of every table on disk's cache, summed; None without one."""
        tables = disk_tables(self.model)
        if not tables:
            return None
        stats = [table.health() for table in tables]
        return {k: sum(s[k] for s in stats)
                for k in ("hits", "misses", "bytes_read", "bytes_written", "host_ms",
                          "waited_ms", "beside_ms")}

    def on_train_batch_end(self, batch, logs=None):
        self._steps = max(self._steps, batch + 1)  # batch: last index run so far

    def on_epoch_end(self, epoch, logs=None):
        optimizer = self._dispatch()
        logs = {} if logs is None else logs
        counts = {"skipped steps (non-finite gradients)": optimizer.skipped_steps(),
                  "dropped ids (outside [0, rows))": optimizer.dropped_ids()}
        logs["sparse_skipped_steps"], logs["sparse_dropped_ids"] = (
            sum(c.values()) for c in counts.values())
        vocabularies = [t.vocabulary for t in optimizer.table_trainers.values()
                        if t.vocabulary is not None]
        if vocabularies:
            stats = [v.stats() for v in vocabularies]
            for name in stats[0]:
                logs[f"vocabulary_{name}"] = sum(s[name] for s in stats)
            logs["vocabulary_mean_probe_length"] = (logs["vocabulary_probe_length"]
                                                    / max(logs["vocabulary_found"], 1))
        disk = self._disk_counts()
        if disk is not None:
            before = self._disk_before or dict.fromkeys(disk, 0)
            new = {k: disk[k] - before[k] for k in disk}
            looked = new["hits"] + new["misses"]
            logs["disk_hit_rate"] = new["hits"] / looked if looked else 0.0
            steps = max(self._steps, 1)
            logs["disk_kb_read_per_step"] = new["bytes_read"] / steps / 1024
            logs["disk_kb_written_per_step"] = new["bytes_written"] / steps / 1024
            for name in ("host", "waited", "beside"):
                logs[f"disk_{name}_ms_per_step"] = new[f"{name}_ms"] / steps
        scaler = self.model.optimizer
        if isinstance(scaler, keras.optimizers.LossScaleOptimizer):
            applied = int(ops.convert_to_numpy(optimizer.iterations)) - self._applied_before
            logs["loss_scale"] = float(ops.convert_to_numpy(scaler.dynamic_scale))
            logs["loss_scale_skipped_steps"] = self._steps - applied
            if self.warn and self._steps > applied:
                warnings.warn(
                    f"Epoch {epoch + 1}: LossScaleOptimizer skipped {self._steps - applied} "
                    "steps with non-finite gradients (every variable, tables included); "
                    f"loss scale now {logs['loss_scale']}.", stacklevel=2)
        if self.warn:
            for what, per_table in counts.items():
                grew = {t: n for t, n in per_table.items() if n > self._last.get((what, t), 0)}
                if grew:
                    warnings.warn(f"Epoch {epoch + 1}: {what} so far: {grew}.", stacklevel=2)
                self._last.update({(what, t): n for t, n in per_table.items()})
