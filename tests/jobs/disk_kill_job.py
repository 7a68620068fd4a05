"""A table on disk trained with `BackupAndRestore` in its own process, killed (SIGKILL) at a
chosen point, or run to the end (tests/test_disk_tables.py's kill tests).

Usage: python -m tests.jobs.disk_kill_job FOLDER MODE

Modes:
    run     fit 3 epochs (resuming from FOLDER/backup if a backup is there), then write
            the table's rows and accumulator to FOLDER/final.npz
    step    the same, killed right after the 6th step (mid second epoch)
    save    killed inside the second backup's snapshot, after its first file
    drain   killed while evicted rows are written into the files (after part of them
            reached them), in a step after the first backup
"""

import os
import signal
import sys

import keras
import numpy as np

import sparseopt
from sparseopt.disk import snapshots
from sparseopt.disk.native_cache import NativeRowCache
from tests.test_disk_tables import _data, _saved_model


def die():
    os.kill(os.getpid(), signal.SIGKILL)


def main():
    folder, mode = sys.argv[1], sys.argv[2]
    x, y = _data(1, rows=32)
    keras.utils.set_random_seed(1)
    model, layer = _saved_model(os.path.join(folder, "t"))
    callbacks = [sparseopt.callbacks.BackupAndRestore(os.path.join(folder, "backup"))]
    if mode == "step":
        class Kill(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if int(self.model.optimizer.iterations.numpy()) == 6:
                    die()
        callbacks.append(Kill())
    elif mode == "save":
        files, copies = len(layer.embeddings.files.names), []
        copy = snapshots.copy_sparse

        def copy_then_die(src, dst, *args, **kwargs):
            copies.append(src)
            if len(copies) == files + 2:  # the second backup's second file (its pages)
                die()
            return copy(src, dst, *args, **kwargs)
        snapshots.copy_sparse = copy_then_die
    elif mode == "drain":
        assert isinstance(layer.embeddings.cache, NativeRowCache)
        drain, drains = NativeRowCache.drain, []

        backups = os.path.join(folder, "backup")

        def drain_part_then_die(self):
            backed_up = os.path.isdir(backups) and any(
                n.startswith("backup-") for n in os.listdir(backups))
            if self._staged[0] >= 2 and backed_up:  # (after the first epoch's backup)
                drains.append(1)
                if len(drains) == 3:
                    self._staged[0] //= 2  # (half of the rows reach the files)
                    drain(self)
                    die()
            drain(self)
        NativeRowCache.drain = drain_part_then_die
    elif mode != "run":
        raise SystemExit(f"unknown mode {mode}")
    model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0, callbacks=callbacks)
    np.savez(os.path.join(folder, "final.npz"), rows=layer.embeddings.numpy(),
             accumulator=layer.embeddings.numpy("accumulator"))


if __name__ == "__main__":
    main()
