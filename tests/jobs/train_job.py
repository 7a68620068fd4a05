"""A small two-table recommender trained in its own process (resume and crash tests).

The user table is bfloat16 (stochastically rounded).

Usage: python -m tests.jobs.train_job MODE DIR [--callback keras|sparseopt]

Modes:
    straight        fit 5 epochs, dump the state to DIR/straight.npz
    first           fit 3 epochs, model.save(DIR/m.keras) and save_weights(DIR/w.weights.h5)
    resume_model    keras.saving.load_model(DIR/m.keras), fit epochs 3-4, dump
    resume_weights  new model, compile, load_weights(DIR/w.weights.h5), fit epochs 3-4, dump
    backup          fit 5 epochs with a BackupAndRestore callback in DIR/backup, dump;
                    prints "batch E B" after each batch
    save            fit 1 epoch and save with `--saver` to DIR/ckpt.*, twice (1 more epoch
                    between); dumps after the first save

Environment: SAVE_TRAP=k kills the process (SIGKILL) inside the k-th save of the model;
KILL_AT="E B" kills it (SIGKILL) right after batch B of epoch E (0-based), mid-epoch.
"""

import argparse
import os
import signal
import sys

import keras
import numpy as np

import sparseopt

EPOCHS, BATCH, STEPS_PER_EPOCH = 5, 32, 8
_saves = {"count": 0}


@keras.saving.register_keras_serializable(package="sparseopt_tests")
class SaveTrap(keras.layers.Layer):
    """Identity layer; with SAVE_TRAP=k it SIGKILLs the process in the k-th save."""

    def call(self, x):
        return x

    def save_own_variables(self, store):
        _saves["count"] += 1
        if os.environ.get("SAVE_TRAP") == str(_saves["count"]):
            print("killed during save", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def build_model():
    keras.utils.set_random_seed(7)
    user_ids = keras.Input((6,), dtype="int32", name="user_ids")
    item_ids = keras.Input((3,), dtype="int32", name="item_ids")
    dense_in = keras.Input((4,), name="dense")
    # A bfloat16 table: stochastic rounding must resume bit for bit too.
    user = sparseopt.layers.SparseEmbedding(
        500, 8, combiner="mean", name="user", dtype="bfloat16",
        updater=sparseopt.updaters.Adagrad(
            keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9)))
    item = sparseopt.layers.SparseEmbedding(
        300, 8, combiner="sum", name="item",
        updater=sparseopt.updaters.Ftrl(0.05, l1_regularization_strength=1e-3))
    x = keras.layers.Concatenate()([user(user_ids), item(item_ids),
                                    keras.layers.Dense(8, name="bottom")(dense_in)])
    x = keras.layers.Dense(16, activation="relu", name="top")(x)
    out = SaveTrap(name="trap")(keras.layers.Dense(1, name="logit")(x))
    model = keras.Model([user_ids, item_ids, dense_in], out)
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.Adam(1e-2)),
                  loss=keras.losses.BinaryCrossentropy(from_logits=True))
    return model


def data():
    rng = np.random.default_rng(123)
    n = BATCH * STEPS_PER_EPOCH
    user_ids = rng.integers(-1, 500, size=(n, 6)).astype("int32")  # -1: padding
    item_ids = rng.zipf(1.3, size=(n, 3)).astype("int32") % 300
    dense = rng.normal(size=(n, 4)).astype("float32")
    y = (rng.random(n) < 0.3).astype("float32")[:, None]
    return [user_ids, item_ids, dense], y


def state(model):
    """Every model weight and every optimizer state variable, by path (16-bit
    floats as their bits)."""
    out = {f"weight:{v.path}": _bits(v) for v in model.weights}
    for i, v in enumerate(model.optimizer.state_variables()):
        out[f"optimizer:{i}:{v.path}"] = _bits(v)
    return out


def _bits(variable):
    value = keras.ops.convert_to_numpy(variable)
    return value.view(np.uint16) if variable.dtype in ("bfloat16", "float16") else value


class Progress(keras.callbacks.Callback):
    """Prints "batch E B" after each batch; SIGKILLs the process at `KILL_AT`."""

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        print(f"batch {self.epoch} {batch}", flush=True)
        if os.environ.get("KILL_AT") == f"{self.epoch} {batch}":
            os.kill(os.getpid(), signal.SIGKILL)


def fit(model, epochs, initial_epoch=0, callbacks=()):
    x, y = data()
    model.fit(x, y, batch_size=BATCH, epochs=epochs, initial_epoch=initial_epoch,
              shuffle=False, verbose=0, callbacks=list(callbacks))


def main(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("mode")
    parser.add_argument("dir")
    parser.add_argument("--callback", default="sparseopt")
    parser.add_argument("--saver", default="sparseopt")
    args = parser.parse_args(argv)
    d = args.dir
    if args.mode in ("straight", "straight_then_first"):
        model = build_model()
        fit(model, EPOCHS)
        if args.mode == "straight_then_first":
            # One process for both (a child's start and compile saved): the
            # straight run's state is written before the first run begins,
            # which starts from a cleared session and the same seed.
            np.savez(os.path.join(d, "straight.npz"), **state(model))
            keras.backend.clear_session()
            main(["first", d])
            return
    elif args.mode == "first":
        model = build_model()
        fit(model, 3)
        model.save(os.path.join(d, "m.keras"))
        model.save_weights(os.path.join(d, "w.weights.h5"))
        print("saved", flush=True)
        return
    elif args.mode == "resume_model":
        model = keras.saving.load_model(os.path.join(d, "m.keras"))
        fit(model, EPOCHS, initial_epoch=3)
    elif args.mode == "resume_weights":
        model = build_model()
        model.load_weights(os.path.join(d, "w.weights.h5"))
        fit(model, EPOCHS, initial_epoch=3)
    elif args.mode == "backup":
        model = build_model()
        backup_dir = os.path.join(d, "backup")
        callback = (keras.callbacks.BackupAndRestore(backup_dir) if args.callback == "keras"
                    else sparseopt.callbacks.BackupAndRestore(backup_dir))
        fit(model, EPOCHS, callbacks=[callback, Progress()])
    elif args.mode == "save":
        model = build_model()
        ext = ".keras" if args.saver.endswith("model") else ".weights.h5"
        path = os.path.join(d, "ckpt" + ext)
        save = {"keras_model": model.save, "keras_weights": model.save_weights,
                "sparseopt_model": lambda p: sparseopt.saving.save_model(model, p),
                "sparseopt_weights": lambda p: sparseopt.saving.save_weights(model, p),
                }[args.saver]
        fit(model, 1)
        save(path)
        np.savez(os.path.join(d, "first_save.npz"), **state(model))
        print("first save done", flush=True)
        fit(model, 2, initial_epoch=1)
        save(path)  # SAVE_TRAP=2 kills the process in here
        print("second save done", flush=True)
        return
    else:
        raise SystemExit(f"unknown mode {args.mode}")
    np.savez(os.path.join(d, f"{args.mode}.npz"), **state(model))
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
