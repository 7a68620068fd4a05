"""Exact resume, SIGKILL recovery and crash-safe saves, each in real child processes.

The job (tests/jobs/train_job.py) trains a two-table model (Adagrad with a
schedule, FTRL) plus an Adam-trained dense part for 5 epochs. Every check
compares the final tables, dense weights and optimizer state with an
uninterrupted run, bit for bit.
"""

import os
import signal
import subprocess
import sys

import keras
import numpy as np
import pytest

from tests.helpers import ROOT, THOROUGH, backend_kind, child_env, kinds

# `make test` runs each variant once: resume from `save_weights` on TensorFlow,
# every other variant on JAX, whose child processes start and compile in a
# third of a TensorFlow child's time (measured: 4 vs 10 s); `make test-all`
# runs every variant on both.
JAX = keras.backend.backend() == "jax"


def on_jax(cases):
    """`cases` as parameters that `make test` runs in the JAX session only."""
    return kinds(cases, cases if JAX else [])


def job(mode, directory, *args, env=None, check=True):
    """Runs the job to completion; returns its stdout."""
    proc = subprocess.run(
        [sys.executable, "-m", "tests.jobs.train_job", mode, str(directory), *args],
        cwd=ROOT, env=_env(env), capture_output=True, text=True, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"job {mode} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc


def _env(extra=None):
    env = child_env()
    env.pop("SAVE_TRAP", None)
    env.pop("KILL_AT", None)
    env.update(extra or {})
    return env


def assert_same_state(want_path, got_path):
    want, got = np.load(want_path), np.load(got_path)
    assert sorted(want) == sorted(got)
    assert any(k.startswith("optimizer:") and "accumulator" in k for k in want)
    assert any(k.startswith("optimizer:") and "linear" in k for k in want)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


@pytest.fixture(scope="module")
def straight_then_first(tmp_path_factory):
    """One child: the straight 5 epochs, then (cleared session, same seed) 3
    epochs and `model.save` + `save_weights` for both resume tests."""
    directory = tmp_path_factory.mktemp("straight_then_first")
    job("straight_then_first", directory)
    return directory


@pytest.fixture(scope="module")
def straight(straight_then_first):
    return straight_then_first / "straight.npz"


@pytest.fixture(scope="module")
def first(straight_then_first):
    return straight_then_first


@pytest.mark.parametrize("how", kinds(["resume_model", "resume_weights"],
                                      ["resume_model" if JAX else "resume_weights"]))
def test_three_epochs_save_load_in_a_new_process_two_more_equals_five(straight, first, how):
    """`model.save` + `load_model` (no custom_objects), and `save_weights` +
    `load_weights` into a freshly compiled model (optimizer not yet built)."""
    job(how, first)
    assert_same_state(straight, first / f"{how}.npz")


@pytest.mark.parametrize("callback", on_jax(["keras", "sparseopt"]))
def test_sigkill_mid_epoch_then_backup_and_restore_ends_where_straight_run_ends(
        straight, tmp_path, callback):
    """SIGKILL right after the 4th batch of the 3rd epoch (of 5; `KILL_AT` counts from 0),
    then a restart of the same command."""
    proc = job("backup", tmp_path, "--callback", callback, env={"KILL_AT": "2 3"},
               check=False)
    seen = proc.stdout.split("\n")
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert "batch 2 3" in seen and "batch 2 4" not in seen and "done" not in seen
    assert not (tmp_path / "backup.npz").exists()
    job("backup", tmp_path, "--callback", callback)
    assert_same_state(straight, tmp_path / "backup.npz")


@pytest.mark.parametrize("backend", backend_kind("jax"))
def test_sigkill_during_a_backup_then_restart_still_ends_where_straight_run_ends(
        straight, tmp_path, backend):
    """Killed inside the 3rd backup (end of epoch 3): the restart resumes from
    the 2nd, complete, backup."""
    proc = job("backup", tmp_path, env={"SAVE_TRAP": "3"}, check=False)
    assert proc.returncode == -signal.SIGKILL and "killed during save" in proc.stdout
    names = os.listdir(tmp_path / "backup")
    assert any(n.startswith(".partial-") for n in names), names  # the torn backup
    job("backup", tmp_path)
    assert_same_state(straight, tmp_path / "backup.npz")


@pytest.mark.parametrize("kind", on_jax(["model", "weights"]))
def test_crash_during_save_leaves_the_previous_checkpoint_readable(tmp_path, kind):
    """Killed while overwriting a checkpoint: Keras' own save destroys the old
    file (the control: one kind in `make test`, both in `make test-all`);
    sparseopt.saving keeps it intact and loadable."""
    ext = ".keras" if kind == "model" else ".weights.h5"
    for saver in ["keras", "sparseopt"] if kind == "model" or THOROUGH else ["sparseopt"]:
        directory = tmp_path / saver
        directory.mkdir()
        proc = job("save", directory, "--saver", f"{saver}_{kind}",
                   env={"SAVE_TRAP": "2"}, check=False)
        assert proc.returncode == -signal.SIGKILL and "first save done" in proc.stdout
        readable = _loads(directory / ("ckpt" + ext), directory / "first_save.npz", kind)
        assert readable == (saver == "sparseopt"), saver
    torn = [n for n in os.listdir(tmp_path / "sparseopt") if n.startswith(".tmp-")]
    assert torn  # the kill did land mid-write, in the temporary file


def _loads(path, want_path, kind):
    """Whether `path` loads, and then that it equals the state at the first save."""
    from tests.jobs import train_job

    keras.backend.clear_session(free_memory=False)  # fresh names, as in the job's own process
    try:
        if kind == "model":
            model = keras.saving.load_model(path)
        else:
            model = train_job.build_model()
            model.load_weights(path)
            # Built first (a shortcut, not the users' path): the pending checkpoint is assigned by this build (the user's way to check it).
            model.optimizer.build(model.trainable_variables)
    except Exception:
        return False
    want, got = np.load(want_path), train_job.state(model)
    assert sorted(want) == sorted(got)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    return True


@pytest.mark.parametrize("double", [False, True])
def test_backups_are_committed_whole_and_old_ones_pruned(tmp_path, double):
    import sparseopt
    from tests.helpers import dot_loss, table_model

    model, _ = table_model(20, 3, 2, sparseopt.updaters.Adagrad(0.1))
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.Adam()), loss=dot_loss)
    callback = sparseopt.callbacks.BackupAndRestore(
        str(tmp_path / "b"), double_checkpoint=double, delete_checkpoint=False)
    x = np.random.default_rng(0).integers(0, 20, (8, 2)).astype("int32")
    model.fit(x, np.ones((8, 2, 3), "float32"), epochs=3, batch_size=4, verbose=0,
              callbacks=[callback])
    kept = sorted(os.listdir(tmp_path / "b"))
    assert kept == (["backup-00000001", "backup-00000002"] if double else ["backup-00000002"])
    for name in kept:
        assert sorted(os.listdir(tmp_path / "b" / name)) == [
            "model.weights.h5", "training_metadata.json"]
