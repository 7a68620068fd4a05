"""Hostile inputs, each run eagerly, traced without XLA, and compiled with XLA.

Every check compares with the NumPy reference or with the state before the
step: a bad batch changes no row it had no right to touch, and what was
refused is visible (`num_dropped_ids`, `skipped_steps`, `TableHealth`).
"""

import subprocess
import sys
import warnings

import keras
import numpy as np
import pytest
from keras import ops

import sparseopt
from tests.conftest import to_np
from tests.helpers import (ROOT, child_env, crossed, dot_loss, kinds, numpy_replay,
                           optimizer_state, table_model)

VOCAB, WIDTH = 40, 3
MODES = {"eager": {"run_eagerly": True}, "traced": {"jit_compile": False},
         "xla": {"jit_compile": True}}
# On JAX, Keras' `jit_compile=False` runs the same un-jitted step as
# `run_eagerly`: `make test` runs one of them there (`make test-all` both).
# Compiled first: the usual case leads `crossed` rotations.
ON_JAX = keras.backend.backend() == "jax"
COVERED_MODES = ["xla", "eager"] if ON_JAX else ["xla", "traced", "eager"]
OTHER_MODES = [m for m in MODES if m not in COVERED_MODES]
RUN_MODES = kinds(sorted(MODES), COVERED_MODES)


def compiled(updater, n_ids, mode, optimizer=None, id_dtype="int32"):
    ids = keras.Input((n_ids,), dtype=id_dtype)
    emb = sparseopt.layers.SparseEmbedding(VOCAB, WIDTH, updater=updater, name="emb")
    model = keras.Model(ids, emb(ids))
    model.compile(optimizer=optimizer or sparseopt.DispatchOptimizer(keras.optimizers.SGD()),
                  loss=dot_loss, **MODES[mode])
    # Built first (a shortcut, not the users' path): the state is snapshotted before the first step.
    model.optimizer.build(model.trainable_variables)
    return model, emb


def snapshot(model, emb):
    return to_np(emb.embeddings), {v.path: to_np(v) for v in optimizer_state(model.optimizer)}


def assert_only_rows_changed(emb, model, before, rows):
    """Rows (of the table and of every table-shaped slot) outside `rows` are unchanged."""
    table0, state0 = before
    others = np.setdiff1d(np.arange(VOCAB), rows)
    np.testing.assert_array_equal(to_np(emb.embeddings)[others], table0[others])
    for v in optimizer_state(model.optimizer):
        if len(v.shape) and v.shape[0] == VOCAB:
            np.testing.assert_array_equal(to_np(v)[others], state0[v.path][others], v.path)
        assert np.all(np.isfinite(to_np(v))), v.path
    assert np.all(np.isfinite(to_np(emb.embeddings)))


@pytest.mark.parametrize("mode", RUN_MODES)
def test_ids_below_zero_above_range_and_at_the_int32_limits_are_dropped(mode):
    model, emb = compiled(sparseopt.updaters.Adagrad(0.5), 6, mode)
    before = snapshot(model, emb)
    x = np.array([[-1, 3, VOCAB, 2**31 - 1, -(2**31), 7],
                  [VOCAB + 1, 3, -5, 9, 2**30, VOCAB - 1]], dtype="int32")
    out = to_np(model.predict(x, verbose=0))
    bad = (x < 0) | (x >= VOCAB)
    np.testing.assert_array_equal(out[bad], 0.0)
    np.testing.assert_array_equal(out[~bad], before[0][x[~bad]])
    y = np.random.default_rng(0).normal(size=(2, 6, WIDTH)).astype("float32")
    model.train_on_batch(x, y)
    want, _ = numpy_replay("Adagrad", {}, before[0], x[None], y[None], lambda t: 0.5)
    np.testing.assert_allclose(to_np(emb.embeddings), want, rtol=1e-5, atol=1e-6)
    assert_only_rows_changed(emb, model, before, [3, 7, 9, VOCAB - 1])
    # predict and train each saw the 7 bad ids
    assert model.optimizer.dropped_ids() == {"emb/embeddings": 14}


@pytest.mark.parametrize("mode", RUN_MODES)
def test_int64_ids_near_the_int64_limit_are_dropped_where_int64_exists(mode):
    from sparseopt import backend

    if not backend.has_int64():
        # JAX without x64: JAX converts int64 to int32 before any layer runs.
        # The policy is a warning at model construction (and the x64 run
        # below, in its own process).
        with pytest.warns(UserWarning, match="emb.*declared int64.*JAX_ENABLE_X64"):
            compiled(sparseopt.updaters.SGD(0.5), 4, mode, id_dtype="int64")
        return
    model, emb = compiled(sparseopt.updaters.SGD(0.5), 4, mode, id_dtype="int64")
    before = snapshot(model, emb)
    x = np.array([[2**63 - 1, 2**32 + 5, -(2**63), 5]] * 2, dtype="int64")
    model.train_on_batch(x, np.ones((2, 4, WIDTH), "float32"))
    assert_only_rows_changed(emb, model, before, [5])
    assert not np.array_equal(to_np(emb.embeddings)[5], before[0][5])
    assert model.optimizer.dropped_ids() == {"emb/embeddings": 6}


def test_int64_ids_on_jax_with_x64_enabled_are_dropped_not_wrapped():
    if keras.backend.backend() != "jax":
        pytest.skip("TF has int64 natively (test above)")
    script = """
import numpy as np, keras, sparseopt
from tests.helpers import dot_loss
ids = keras.Input((4,), dtype="int64")
emb = sparseopt.layers.SparseEmbedding(40, 3, updater=sparseopt.updaters.Adagrad(0.5), name="e")
model = keras.Model(ids, emb(ids))
model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD()), loss=dot_loss)
t0 = keras.ops.convert_to_numpy(emb.embeddings).copy()
x = np.array([[2**63 - 1, 2**32 + 5, -(2**63), 5]] * 2, dtype="int64")
model.train_on_batch(x, np.ones((2, 4, 3), "float32"))
print("changed", np.flatnonzero(np.any(keras.ops.convert_to_numpy(emb.embeddings) != t0, 1)))
"""
    env = child_env("jax", JAX_ENABLE_X64="1")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "changed [5]" in proc.stdout


@pytest.mark.parametrize("mode", RUN_MODES)
def test_float_ids_are_refused_naming_the_layer_and_the_fix(mode):
    emb = sparseopt.layers.SparseEmbedding(VOCAB, WIDTH, updater=sparseopt.updaters.SGD(0.1),
                                           name="emb")
    with pytest.raises(TypeError, match="Layer 'emb'.*must be integers.*int32"):
        emb(keras.Input((3,), dtype="float32"))
    with pytest.raises(TypeError, match="Layer 'emb'.*must be integers"):
        emb(np.array([[1.0, 2.0]], "float32"))

    class Model(keras.Model):  # ids arrive as floats only at train time
        def __init__(self):
            super().__init__()
            self.emb = sparseopt.layers.SparseEmbedding(
                VOCAB, WIDTH, updater=sparseopt.updaters.SGD(0.1), name="emb2")

        def call(self, x):
            return self.emb(x)

    model = Model()
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD()),
                  loss=dot_loss, **MODES[mode])
    # Keras wraps it when the first batch builds the model; the message stays.
    with pytest.raises((TypeError, RuntimeError), match="Layer 'emb2'.*must be integers"):
        model.fit(np.ones((2, 3), "float32"), np.ones((2, 3, WIDTH), "float32"), verbose=0)


@pytest.mark.parametrize("mode", RUN_MODES)
def test_empty_batches_and_all_padding_bags_change_nothing(mode):
    ids = keras.Input((4,), dtype="int32")
    emb = sparseopt.layers.SparseEmbedding(VOCAB, WIDTH, updater=sparseopt.updaters.Ftrl(0.5),
                                           combiner="mean", name="emb")
    model = keras.Model(ids, keras.layers.Dense(1)(emb(ids)))
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.Adam()), loss="mse",
                  **MODES[mode])
    # Built first (a shortcut, not the users' path): the state is snapshotted before the first step.
    model.optimizer.build(model.trainable_variables)
    before = snapshot(model, emb)
    # A bag of padding only: the mean is 0 (not 0/0), nothing is written.
    loss = model.train_on_batch(-np.ones((3, 4), "int32"), np.ones((3, 1), "float32"))
    assert np.isfinite(loss)
    assert_only_rows_changed(emb, model, before, [])
    if keras.backend.backend() == "tensorflow":
        loss = model.train_on_batch(np.zeros((0, 4), "int32"), np.zeros((0, 1), "float32"))
        assert np.isfinite(loss)
    else:
        # Keras' JAX trainer refuses zero-row batches for every model (plain
        # Dense too); the sparse step itself takes empty ids in stride.
        out = model.predict_on_batch(np.zeros((0, 4), "int32"))
        assert out.shape == (0, 1)
        updated = _empty_sparse_apply(model, emb, jit=mode == "xla")
        assert bool(updated)
    assert_only_rows_changed(emb, model, before, [])
    assert model.optimizer.skipped_steps() == {"emb/embeddings": 0}


def _empty_sparse_apply(model, emb, jit):
    """The optimizer's sparse step on zero ids, eagerly or under `jax.jit`."""
    import jax

    from sparseopt.engine import plans
    from sparseopt.records import RowGrads

    table = model.optimizer.table_trainer(emb.embeddings)
    variables = [emb.embeddings, *table.slots.values(), table.workspace]

    def step(values):
        with keras.StatelessScope(state_mapping=list(zip(variables, values))) as scope:
            prepared = table.prepare(RowGrads(ops.zeros((0,), "int32"), ops.zeros((0, WIDTH))))
            applied = plans.finish(table.updater, table.row_storage, prepared,
                                   table.values_at(0), 1)
        return applied, [scope.get_current_value(v) for v in variables]

    applied, values = (jax.jit(step) if jit else step)([v.value for v in variables])
    for var, value in zip(variables, values):
        var.assign(value)
    return applied


# One of each kind: a rule with per-entry state, a fused TF kernel (traced on TF),
# a rule with per-row state; each mode once (`make test-all`: every pair).
KINDS = ["Adam", "Ftrl", "PartialRowwiseAdam"]


@pytest.mark.parametrize("mode,name", crossed(
    COVERED_MODES, KINDS, OTHER_MODES,
    [n for n in sorted(sparseopt.updaters.registry(shipped_only=True)) if n not in KINDS]))
def test_a_batch_of_one_id_repeated_everywhere(mode, name):
    updater = getattr(sparseopt.updaters, name)(0.1)
    model, emb = compiled(updater, 16, mode)
    before = snapshot(model, emb)
    x = np.full((64, 16), 7, "int32")
    y = np.random.default_rng(1).normal(size=(64, 16, WIDTH)).astype("float32")
    model.train_on_batch(x, y)
    want, _ = numpy_replay(name, {}, before[0], x[None], y[None], lambda t: 0.1)
    np.testing.assert_allclose(to_np(emb.embeddings), want, rtol=1e-5, atol=1e-6)
    assert_only_rows_changed(emb, model, before, [7])


@pytest.mark.parametrize("mode,scaling", crossed(
    COVERED_MODES, ["none", "loss_scale_factor", "loss_scale_optimizer"], OTHER_MODES))
@pytest.mark.parametrize("bad", kinds([np.nan, np.inf], [np.nan]))
def test_non_finite_gradients_leave_table_and_state_unchanged_and_are_reported(
        mode, scaling, bad):
    inner = sparseopt.DispatchOptimizer(
        keras.optimizers.SGD(0.1, loss_scale_factor=8.0 if scaling == "loss_scale_factor"
                             else None))
    optimizer = (keras.optimizers.LossScaleOptimizer(inner, initial_scale=64.0)
                 if scaling == "loss_scale_optimizer" else inner)
    model, emb = compiled(sparseopt.updaters.Adagrad(0.1), 4, mode, optimizer=optimizer)
    rng = np.random.default_rng(2)
    x = rng.integers(0, VOCAB, size=(8, 4)).astype("int32")
    y = rng.normal(size=(8, 4, WIDTH)).astype("float32")
    health = sparseopt.callbacks.TableHealth()
    model.fit(x, y, batch_size=8, verbose=0, callbacks=[health])
    before = snapshot(model, emb)
    y_bad = y.copy()
    y_bad[5, 1, 2] = bad
    if scaling == "loss_scale_optimizer":
        # Keras skips the whole step (tables included) and halves the scale.
        with pytest.warns(UserWarning, match=r"LossScaleOptimizer skipped 1 steps"):
            history = model.fit(x, y_bad, batch_size=8, verbose=0, callbacks=[health])
        assert history.history["loss_scale_skipped_steps"] == [1]
        assert history.history["loss_scale"] == [32.0]
        assert inner.skipped_steps() == {"emb/embeddings": 0}
    else:
        with pytest.warns(UserWarning, match=r"skipped steps.*'emb/embeddings': 1"):
            history = model.fit(x, y_bad, batch_size=8, verbose=0, callbacks=[health])
        assert history.history["sparse_skipped_steps"] == [1]
        assert inner.skipped_steps() == {"emb/embeddings": 1}
    np.testing.assert_array_equal(to_np(emb.embeddings), before[0])
    for v in optimizer_state(inner):
        if "skipped_steps" not in v.path and "iteration" not in v.path:
            np.testing.assert_array_equal(to_np(v), before[1][v.path], v.path)
    model.fit(x, y, batch_size=8, verbose=0)  # the next good step trains again
    assert not np.array_equal(to_np(emb.embeddings), before[0])
    assert np.all(np.isfinite(to_np(emb.embeddings)))


class _TableWithExtras(keras.layers.Layer):
    def __init__(self, **extras):
        super().__init__(name="mine")
        self.extras = extras

    def build(self, input_shape):
        self.table = self.add_weight(shape=(VOCAB, WIDTH), name="table", **self.extras)
        self.lookup = sparseopt.ops.SparseLookup(self, self.table)

    def call(self, ids):
        return self.lookup(ids)

    @property
    def variable_path_to_optimizer_map(self):
        return {self.table.path: sparseopt.updaters.Adagrad(0.1)}


def _build_with(layer):
    ids = keras.Input((3,), dtype="int32")
    model = keras.Model(ids, layer(ids))
    sparseopt.DispatchOptimizer(keras.optimizers.Adam()).build(model.trainable_variables)


REFUSED = {
    "table_regularizer": (
        lambda: _build_with(_TableWithExtras(regularizer="l2")),
        r"'mine/table' has a regularizer.*l2_regularization_strength"),
    "table_constraint": (
        lambda: _build_with(_TableWithExtras(constraint="non_neg")),
        r"'mine/table' has a constraint.*touch every row"),
    "embeddings_regularizer": (
        lambda: sparseopt.layers.SparseEmbedding(
            VOCAB, WIDTH, sparseopt.updaters.SGD(), embeddings_regularizer="l2", name="e"),
        r"'e': `embeddings_regularizer` is not supported.*Ftrl"),
    "embeddings_constraint": (
        lambda: sparseopt.layers.SparseEmbedding(
            VOCAB, WIDTH, sparseopt.updaters.SGD(), embeddings_constraint="non_neg"),
        r"`embeddings_constraint` is not supported"),
    "mask_zero": (
        lambda: sparseopt.layers.SparseEmbedding(VOCAB, WIDTH, sparseopt.updaters.SGD(),
                                                 mask_zero=True),
        r"`mask_zero` is not supported.*-1"),
    "lora_rank": (
        lambda: sparseopt.layers.SparseEmbedding(VOCAB, WIDTH, sparseopt.updaters.SGD(),
                                                 lora_rank=4),
        r"`lora_rank` is not supported"),
    "backup_every_n_batches": (
        lambda: sparseopt.callbacks.BackupAndRestore("/tmp/x", save_freq=100),
        r"save_freq=100.*trained twice.*steps_per_epoch"),
    "unzipped_atomic_save": (
        lambda: sparseopt.saving.save_model(None, "/tmp/m", zipped=False),
        r"zipped=False.*\.keras"),
    "sharded_atomic_save": (
        lambda: sparseopt.saving.save_weights(None, "/tmp/m.weights.json", max_shard_size=1),
        r"sharded weights.*atomically"),
    "remote_atomic_save": (
        lambda: sparseopt.saving.save_weights(None, "gs://bucket/m.weights.h5"),
        r"remote path.*local file system"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unsupported_option_is_refused_with_what_to_change(case):
    make, message = REFUSED[case]
    with pytest.raises(ValueError, match=message):
        make()


def test_checkpoint_of_a_different_optimizer_is_an_error_not_a_partial_load(tmp_path):
    model, _ = table_model(VOCAB, WIDTH, 3, sparseopt.updaters.Ftrl(0.1))
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.Adam()), loss=dot_loss)
    # Built first (a shortcut, not the users' path): saves an untrained optimizer's state.
    model.optimizer.build(model.trainable_variables)
    path = str(tmp_path / "ftrl.weights.h5")
    model.save_weights(path)
    keras.backend.clear_session(free_memory=False)
    other, _ = table_model(VOCAB, WIDTH, 3, sparseopt.updaters.SGD(0.1))
    other.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.Adam()), loss=dot_loss)
    # Built first (a shortcut, not the users' path): loads into a built optimizer.
    other.optimizer.build(other.trainable_variables)
    with pytest.raises(ValueError, match="does not match this optimizer.*compile it exactly"):
        other.load_weights(path)
    # Not built yet: the mismatch surfaces when it is built, before any step.
    keras.backend.clear_session(free_memory=False)
    late, _ = table_model(VOCAB, WIDTH, 3, sparseopt.updaters.SGD(0.1))
    late.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.Adam()), loss=dot_loss)
    late.load_weights(path)
    with pytest.raises(ValueError, match="does not match this optimizer"):
        late.optimizer.build(late.trainable_variables)


def test_table_health_logs_dropped_ids_and_warns_once_per_increase():
    model, emb = table_model(VOCAB, WIDTH, 4, sparseopt.updaters.SGD(0.1))
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD()), loss=dot_loss)
    x = np.array([[1, 2, -1, VOCAB]] * 4, "int32")
    y = np.ones((4, 4, WIDTH), "float32")
    health = sparseopt.callbacks.TableHealth()
    with pytest.warns(UserWarning, match=r"dropped ids.*'emb/embeddings': 8"):
        history = model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[health])
    assert history.history["sparse_dropped_ids"] == [8]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no new drops: no warning
        model.fit(np.array([[1, 2, 3, 4]] * 4, "int32"), y, batch_size=4, verbose=0,
                  callbacks=[health])
