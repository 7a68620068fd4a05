"""DispatchOptimizer in Keras training loops: routing, loss scaling, errors."""

import keras
import numpy as np
import pytest
from keras import ops

import sparseopt
from tests import reference
from tests.conftest import to_np
from tests.helpers import (OneHotEmbedding, batches, dot_loss, kinds, numpy_replay,
                           optimizer_state, registered_cases, table_model)

VOCAB, WIDTH, N_IDS, BATCH = 200, 4, 6, 8


def head_model(emb_layer, name="head"):
    ids = keras.Input((N_IDS,), dtype="int32")
    x = keras.layers.Flatten()(emb_layer(ids))
    x = keras.layers.Dense(8, activation="relu", name="hidden")(x)
    return keras.Model(ids, keras.layers.Dense(1, name="out")(x), name=name)


def regression_data(seed, steps=60):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 60, size=(steps * BATCH, N_IDS)).astype("int32")
    x[::BATCH, :3] = x[1::BATCH, :3]  # duplicates in every batch
    y = np.sin(x.sum(axis=1, keepdims=True) / 40.0).astype("float32")
    return x, y


def test_adagrad_equals_keras_adagrad_and_dense_equals_adam_alone():
    """Sparse Adagrad == keras Adagrad on a dense-gradient Embedding; head == Adam.

    On JAX the reference is plain `keras.layers.Embedding`. On TF, Keras'
    Adagrad applies an Embedding's IndexedSlices without summing duplicates,
    so the reference there is a one-hot Embedding with an exact dense gradient.
    """
    x, y = regression_data(0)
    sparse = head_model(sparseopt.layers.SparseEmbedding(
        VOCAB, WIDTH, updater=sparseopt.updaters.Adagrad(0.1), name="emb"))
    if keras.backend.backend() == "jax":
        ref_emb = keras.layers.Embedding(VOCAB, WIDTH, name="emb")
    else:
        ref_emb = OneHotEmbedding(VOCAB, WIDTH, name="emb")
    ref = head_model(ref_emb, name="ref")
    for name in ["emb", "hidden", "out"]:
        src = sparse.get_layer(name)
        dst = ref.get_layer(name)
        dst.set_weights([w for w in src.get_weights() if w.ndim and w.dtype.kind == "f"])
    sparse.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.Adam(1e-2)), loss="mse")
    ref.compile(optimizer=keras.optimizers.MultiOptimizer(keras.optimizers.OptimizerMap(
        keras.optimizers.Adam(1e-2), {"emb/embeddings": keras.optimizers.Adagrad(0.1)})),
        loss="mse")
    h1 = sparse.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    ref.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    np.testing.assert_allclose(to_np(sparse.get_layer("emb").embeddings),
                               to_np(ref.get_layer("emb").embeddings), rtol=1e-4, atol=1e-6)
    for name in ["hidden", "out"]:
        for a, b in zip(sparse.get_layer(name).weights, ref.get_layer(name).weights):
            np.testing.assert_allclose(to_np(a), to_np(b), rtol=1e-4, atol=1e-6)
    assert h1.history["loss"][0] > 0


def test_standard_optimizer_creates_no_slot_for_tables():
    model = head_model(sparseopt.layers.SparseEmbedding(
        100_000, WIDTH, updater=sparseopt.updaters.Ftrl(0.1), name="emb"))
    opt = sparseopt.DispatchOptimizer(keras.optimizers.Adam(use_ema=True))
    model.compile(optimizer=opt, loss="mse")
    # Built first (a shortcut, not the users' path): reads which slots exist without training.
    opt.build(model.trainable_variables)
    big = [v.path for v in opt.optimizer.variables if len(v.shape) and v.shape[0] == 100_000]
    assert big == []
    slots = [tuple(v.shape) for v in opt.state_variables()
             if len(v.shape) and v.shape[0] == 100_000]
    assert slots == [(100_000, WIDTH), (100_000, WIDTH)]  # FTRL: accumulator + linear
    table = model.get_layer("emb").embeddings
    assert {k: tuple(v.shape) for k, v in opt.table_state(table).items()} == {
        "accumulator": (100_000, WIDTH), "linear": (100_000, WIDTH)}
    # The dedup scratch: one int32 per row (1/WIDTH of the table; TF: and a
    # sink for invalid ids), not saved.
    from sparseopt import backend

    workspace = [(tuple(v.shape), v.dtype) for v in opt.scratch_variables()]
    assert workspace == [((100_000 + backend.WORKSPACE_SINK,), "int32")]


def _scaled_run(make_optimizer, xs, ys, updater):
    model, emb = table_model(VOCAB, WIDTH, N_IDS, updater, init="glorot_uniform")
    emb.embeddings.assign(np.linspace(-1, 1, VOCAB * WIDTH).reshape(VOCAB, WIDTH))
    model.compile(optimizer=make_optimizer(), loss=dot_loss)
    model.fit(xs.reshape(-1, N_IDS), ys.reshape(-1, N_IDS, WIDTH), batch_size=BATCH,
              shuffle=False, verbose=0)
    return to_np(emb.embeddings), model


@pytest.mark.parametrize("how", ["loss_scale_optimizer", "loss_scale_factor"])
def test_tables_see_the_unscaled_gradient(how):
    rng = np.random.default_rng(5)
    xs, ys = batches(rng, 8, BATCH, N_IDS, VOCAB, WIDTH)
    cfg = {"l1_regularization_strength": 0.001}
    plain, _ = _scaled_run(lambda: sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.1)),
                           xs, ys, sparseopt.updaters.Ftrl(0.05, **cfg))
    if how == "loss_scale_optimizer":
        def make():
            return keras.optimizers.LossScaleOptimizer(
                sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.1)), initial_scale=2.0**12)
    else:
        def make():
            return sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.1, loss_scale_factor=8.0))
    scaled, _ = _scaled_run(make, xs, ys, sparseopt.updaters.Ftrl(0.05, **cfg))
    np.testing.assert_allclose(scaled, plain, rtol=1e-5, atol=1e-6)


def test_loss_scale_optimizer_skip_leaves_tables_and_state_untouched():
    model, emb = table_model(VOCAB, WIDTH, N_IDS, sparseopt.updaters.Adagrad(0.1))
    opt = keras.optimizers.LossScaleOptimizer(
        sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.1)), initial_scale=64.0)
    model.compile(optimizer=opt, loss=dot_loss)
    rng = np.random.default_rng(6)
    xs, ys = batches(rng, 2, BATCH, N_IDS, VOCAB, WIDTH)
    model.train_on_batch(xs[0], ys[0])
    table, state = to_np(emb.embeddings), [to_np(v) for v in optimizer_state(opt)]
    scale = float(to_np(opt.dynamic_scale))
    bad_y = ys[1].copy()
    bad_y[0, 0, 0] = np.inf
    model.train_on_batch(xs[1], bad_y)
    assert np.array_equal(to_np(emb.embeddings), table)
    inner = opt.inner_optimizer
    for v, before in zip(optimizer_state(opt), state):
        if v is opt.dynamic_scale or v is opt.step_counter:
            continue
        assert np.array_equal(to_np(v), before), v.path
    assert float(to_np(opt.dynamic_scale)) == scale / 2
    assert int(to_np(inner.iterations)) == 1


# Every shipped updater, on each of its code paths: on TF those with a fused
# kernel run it (guarded by a cond), the others the rule.
SKIP_UPDATERS = {case: (lambda entry=entry, cfg=cfg: entry(0.1, **cfg))
                 for case, (entry, cfg) in registered_cases(paths_only=True).items()}


# One of each kind: TF's fused kernels (guarded by a cond) and a rule.
@pytest.mark.parametrize("updater", kinds(sorted(SKIP_UPDATERS), [
    "SGD:default", "SGD:momentum", "Adagrad:no_epsilon", "Ftrl:default", "Adam:default"]))
def test_non_finite_gradient_without_loss_scaling_skips_the_table_and_counts_it(updater):
    model, emb = table_model(VOCAB, WIDTH, N_IDS, SKIP_UPDATERS[updater]())
    opt = sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.1))
    model.compile(optimizer=opt, loss=dot_loss)
    rng = np.random.default_rng(7)
    xs, ys = batches(rng, 2, BATCH, N_IDS, VOCAB, WIDTH)
    model.train_on_batch(xs[0], ys[0])
    table = to_np(emb.embeddings)
    state = {v.path: to_np(v) for v in optimizer_state(opt) if "skipped_steps" not in v.path}
    bad_y = ys[1].copy()
    bad_y[3, 2, 1] = np.nan
    model.train_on_batch(xs[1], bad_y)
    assert np.array_equal(to_np(emb.embeddings), table)
    for v in opt.variables:
        if v.path in state and "iteration" not in v.path:
            assert np.array_equal(to_np(v), state[v.path]), v.path
    assert opt.skipped_steps() == {"emb/embeddings": 1}
    assert np.all(np.isfinite(to_np(emb.embeddings)))
    model.train_on_batch(xs[0], ys[0])  # and the next good step trains again
    assert not np.array_equal(to_np(emb.embeddings), table)


def test_per_variable_clipping_and_weight_decay_act_on_dense_variables_only():
    # (`global_clipnorm` is one norm over everything: tests/test_global_clipping.py.)
    rng = np.random.default_rng(8)
    xs, ys = batches(rng, 5, BATCH, N_IDS, VOCAB, WIDTH)
    base, _ = _scaled_run(lambda: sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.1)),
                          xs, ys, sparseopt.updaters.SGD(0.5))
    for kwargs in [{"clipnorm": 1e-6}, {"clipvalue": 1e-6}, {"weight_decay": 0.9}]:
        clipped, _ = _scaled_run(
            lambda: sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.1, **kwargs)),
            xs, ys, sparseopt.updaters.SGD(0.5))
        np.testing.assert_array_equal(clipped, base)


def test_plain_keras_optimizer_is_refused_before_the_first_step():
    model, emb = table_model(VOCAB, WIDTH, N_IDS, sparseopt.updaters.Adagrad(0.1))
    model.compile(optimizer=keras.optimizers.Adam(), loss=dot_loss)
    table = to_np(emb.embeddings)
    rng = np.random.default_rng(9)
    xs, ys = batches(rng, 1, BATCH, N_IDS, VOCAB, WIDTH)
    with pytest.raises(ValueError, match="not a sparseopt.DispatchOptimizer"):
        model.train_on_batch(xs[0], ys[0])
    assert np.array_equal(to_np(emb.embeddings), table)


def test_gradient_accumulation_without_a_batch_to_size_its_buffers_is_refused_clearly():
    # (Accumulation itself: tests/test_gradient_accumulation.py.)
    # Refused before any state exists: then, as the message says, `fit` builds it, each
    # variable once (the refused build had made every table's state first: saved, the
    # optimizer then held two of each and its checkpoint matched no fresh optimizer's).
    def variables_after_training(build_first):
        keras.backend.clear_session(free_memory=False)
        model, _ = table_model(VOCAB, WIDTH, N_IDS, sparseopt.updaters.Adagrad(0.1))
        opt = sparseopt.DispatchOptimizer(keras.optimizers.Adam(gradient_accumulation_steps=4))
        model.compile(optimizer=opt, loss=dot_loss)
        if build_first:
            before = list(opt.variables)
            with pytest.raises(ValueError, match="gradient_accumulation_steps needs.*emb/"
                                                 "embeddings.*accumulation_ids_per_step"):
                opt.build(model.trainable_variables)
            assert not opt.built and opt.variables == before
        model.train_on_batch(np.zeros((BATCH, N_IDS), "int32"),
                             np.zeros((BATCH, N_IDS, WIDTH), "float32"))
        return [(v.path, tuple(v.shape)) for v in opt.variables]

    assert variables_after_training(True) == variables_after_training(False)


def test_shared_layer_looked_up_twice_in_one_step_is_summed_once():
    emb = sparseopt.layers.SparseEmbedding(VOCAB, WIDTH, updater=sparseopt.updaters.Adagrad(0.1),
                                           name="emb")
    a = keras.Input((N_IDS,), dtype="int32")
    b = keras.Input((N_IDS,), dtype="int32")
    model = keras.Model([a, b], ops.concatenate([emb(a), emb(b)], axis=1))
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD()), loss=dot_loss)
    table0 = to_np(emb.embeddings)
    rng = np.random.default_rng(10)
    xs, ys = batches(rng, 6, BATCH, 2 * N_IDS, VOCAB, WIDTH, dup_vocab=30)
    for x, y in zip(xs, ys):
        model.train_on_batch([x[:, :N_IDS], x[:, N_IDS:]], y)
    want, _ = numpy_replay("Adagrad", {}, table0, xs, ys, lambda t: 0.1)
    np.testing.assert_allclose(to_np(emb.embeddings), want, rtol=2e-5, atol=2e-6)


def test_out_of_range_ids_are_dropped_counted_and_never_written():
    model, emb = table_model(VOCAB, WIDTH, 4, sparseopt.updaters.SGD(0.5))
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD()), loss=dot_loss)
    table0 = to_np(emb.embeddings)
    x = np.array([[-1, 3, VOCAB, 7], [2**30, 3, -(2**31), VOCAB - 1]], dtype="int32")
    out = to_np(model.predict(x, verbose=0))
    np.testing.assert_array_equal(out[0, 0], 0.0)
    np.testing.assert_array_equal(out[1, 0], 0.0)
    np.testing.assert_allclose(out[0, 1], table0[3], rtol=1e-6)
    assert int(to_np(emb.num_dropped_ids)) == 4
    y = np.ones((2, 4, WIDTH), "float32")
    model.train_on_batch(x, y)
    want, _ = numpy_replay("SGD", {}, table0, x[None], y[None], lambda t: 0.5)
    np.testing.assert_allclose(to_np(emb.embeddings), want, rtol=1e-6, atol=1e-7)
    changed = np.flatnonzero(np.any(to_np(emb.embeddings) != table0, axis=1))
    assert changed.tolist() == [3, 7, VOCAB - 1]


def test_float_ids_are_refused_with_the_fix():
    emb = sparseopt.layers.SparseEmbedding(VOCAB, WIDTH, updater=sparseopt.updaters.SGD(0.1),
                                           name="emb")
    with pytest.raises(TypeError, match="emb.*must be integers.*int32"):
        emb(keras.Input((3,), dtype="float32"))


@pytest.mark.parametrize("combiner", ["sum", "mean"])
def test_combiners_reduce_the_bag_and_train_correctly(combiner):
    emb = sparseopt.layers.SparseEmbedding(VOCAB, WIDTH, updater=sparseopt.updaters.SGD(1.0),
                                           combiner=combiner, name="emb")
    ids = keras.Input((4,), dtype="int32")
    model = keras.Model(ids, emb(ids))
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD()), loss=dot_loss)
    table0 = to_np(emb.embeddings)
    x = np.array([[1, 1, 5, -1], [5, 9, 9, 9]], dtype="int32")
    valid = (x >= 0)
    counts = valid.sum(1, keepdims=True) if combiner == "mean" else np.ones((2, 1))
    expect = np.stack([table0[x[i][valid[i]]].sum(0) for i in range(2)]) / counts
    np.testing.assert_allclose(to_np(model.predict(x, verbose=0)), expect, rtol=1e-5)
    y = np.arange(2 * WIDTH, dtype="float32").reshape(2, WIDTH)
    model.train_on_batch(x, y)
    per_id = np.repeat((y / 2 / counts)[:, None, :], 4, axis=1)  # dL/drow per occurrence
    want, _ = numpy_replay("SGD", {}, table0, x[None], (per_id * 2)[None], lambda t: 1.0)
    np.testing.assert_allclose(to_np(emb.embeddings), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("compiled", [False, True] if keras.backend.backend() == "tensorflow"
                         else [False])
def test_bags_longer_than_the_unrolled_sum_pool_and_train_like_short_ones(compiled,
                                                                          monkeypatch):
    # On JAX, bags of more than 64 ids are summed in a loop instead of unrolled.
    # On TF, pooled reads of many ids are XLA-compiled (all of them, here).
    if compiled:
        from sparseopt.backend import tensorflow as tf_backend

        monkeypatch.setattr(tf_backend, "COMPILED_POOL_MIN_IDS", 1)
    bag = 70
    emb = sparseopt.layers.SparseEmbedding(VOCAB, WIDTH, updater=sparseopt.updaters.SGD(1.0),
                                           combiner="mean", name="emb")
    ids = keras.Input((bag,), dtype="int32")
    model = keras.Model(ids, emb(ids))
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD()), loss=dot_loss)
    table0 = to_np(emb.embeddings)
    x = np.random.default_rng(13).integers(-3, VOCAB, size=(2, bag)).astype("int32")
    valid = x >= 0
    counts = valid.sum(1, keepdims=True)
    expect = np.stack([table0[x[i][valid[i]]].sum(0) for i in range(2)]) / counts
    np.testing.assert_allclose(to_np(model.predict(x, verbose=0)), expect, rtol=1e-5)
    y = np.arange(2 * WIDTH, dtype="float32").reshape(2, WIDTH)
    model.train_on_batch(x, y)
    per_id = np.repeat((y / 2 / counts)[:, None, :], bag, axis=1)
    want, _ = numpy_replay("SGD", {}, table0, x[None], (per_id * 2)[None], lambda t: 1.0)
    np.testing.assert_allclose(to_np(emb.embeddings), want, rtol=1e-5, atol=1e-6)


class BagsAndIds(keras.layers.Layer):
    """Reads one table pooled (twice) and id by id in one call: three records per step."""

    def build(self, input_shape):
        self.table = self.add_weight(shape=(VOCAB, WIDTH), name="table")
        self.lookup = sparseopt.ops.SparseLookup(self, self.table)

    def call(self, ids):
        return ops.concatenate([self.lookup.pooled(ids[:, :3], "mean")[:, None],
                                self.lookup.pooled(ids[:, 3:], "sum")[:, None],
                                self.lookup(ids)], axis=1)

    @property
    def variable_path_to_optimizer_map(self):
        return {self.table.path: sparseopt.updaters.Adagrad(0.3)}


def test_pooled_and_plain_reads_of_one_table_in_one_step_match_the_reference():
    # Pooled reads hand the optimizer one gradient per bag; with a plain read
    # of the same table in the same step, all of them are summed per row.
    layer = BagsAndIds(name="bags")
    ids = keras.Input((N_IDS,), dtype="int32")
    model = keras.Model(ids, layer(ids))
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD()), loss=dot_loss)
    table = to_np(layer.table)
    rng = np.random.default_rng(12)
    state = np.full(table.shape, 0.1)
    for step in range(3):
        x = rng.integers(0, 12, size=(BATCH, N_IDS)).astype("int32")
        x[0, :3] = [-1, VOCAB, -5]  # a mean over an empty bag: zeros, no update
        x[1, 3:] = [4, -1, 4]
        y = rng.normal(size=(BATCH, 2 + N_IDS, WIDTH)).astype("float32")
        valid = (x >= 0) & (x < VOCAB)
        counts = np.maximum(valid[:, :3].sum(1, keepdims=True), 1)
        want_out = np.concatenate([
            (np.where(valid[:, :3, None], table[np.where(valid, x, 0)[:, :3]], 0).sum(1)
             / counts)[:, None],
            np.where(valid[:, 3:, None], table[np.where(valid, x, 0)[:, 3:]], 0).sum(1)[:, None],
            np.where(valid[..., None], table[np.where(valid, x, 0)], 0)], axis=1)
        np.testing.assert_allclose(to_np(model(x)), want_out, rtol=1e-5, atol=1e-6)
        model.train_on_batch(x, y)
        g = y.astype(np.float64) / BATCH  # dot_loss: dL/d(output)
        per_id = np.concatenate([np.repeat(g[:, :1] / counts[:, :, None], 3, axis=1),
                                 np.repeat(g[:, 1:2], N_IDS - 3, axis=1), g[:, 2:]], axis=1)
        all_ids = np.concatenate([x, x], axis=1)
        table, st = reference.sparse_step("Adagrad", table, {"accumulator": state}, all_ids,
                                          per_id, 0.3, {})
        state = st["accumulator"]
        np.testing.assert_allclose(to_np(layer.table), table, rtol=2e-5, atol=2e-6)


class UserTable(keras.layers.Layer):
    """A user layer that owns a table and declares its updater (docs example)."""

    def __init__(self, rows, width, **kwargs):
        super().__init__(**kwargs)
        self.rows, self.width = rows, width
        self.updater = sparseopt.updaters.RowwiseAdagrad(0.2)

    def build(self, input_shape):
        self.table = self.add_weight(shape=(self.rows, self.width), name="table")
        self.bias = self.add_weight(shape=(self.width,), name="bias", initializer="zeros")
        self.lookup = sparseopt.ops.SparseLookup(self, self.table)

    def call(self, ids):
        return self.lookup(ids) + self.bias

    @property
    def variable_path_to_optimizer_map(self):
        return {self.table.path: self.updater}


def test_user_layer_declaring_its_updater_is_honoured():
    layer = UserTable(VOCAB, WIDTH, name="user")
    ids = keras.Input((N_IDS,), dtype="int32")
    model = keras.Model(ids, layer(ids))
    opt = sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.1))
    model.compile(optimizer=opt, loss=dot_loss)
    table0 = to_np(layer.table)
    rng = np.random.default_rng(11)
    xs, ys = batches(rng, 5, BATCH, N_IDS, VOCAB, WIDTH)
    model.fit(xs.reshape(-1, N_IDS), ys.reshape(-1, N_IDS, WIDTH), batch_size=BATCH,
              shuffle=False, verbose=0)
    want, _ = numpy_replay("RowwiseAdagrad", {}, table0, xs, ys, lambda t: 0.2)
    np.testing.assert_allclose(to_np(layer.table), want, rtol=2e-5, atol=2e-6)
    # The bias went to the dense SGD: minus lr * mean-over-batch gradient, summed over ids.
    expect_bias = -0.1 * sum(y.sum(axis=(0, 1)) / BATCH for y in ys)
    np.testing.assert_allclose(to_np(layer.bias), expect_bias, rtol=1e-4, atol=1e-6)


class DenselyReadTable(UserTable):
    def build(self, input_shape):
        self.table = self.add_weight(shape=(self.rows, self.width), name="table")
        self.bias = self.add_weight(shape=(self.width,), name="bias", initializer="zeros")

    def call(self, ids):
        return ops.take(self.table, ids, axis=0) + self.bias


def test_declared_table_not_read_sparsely_is_refused_at_build():
    layer = DenselyReadTable(VOCAB, WIDTH, name="dense_read")
    ids = keras.Input((N_IDS,), dtype="int32")
    model = keras.Model(ids, layer(ids))
    # The layer has no SparseLookup: it is found through the model it is
    # compiled into (built by Keras' trainer, or by hand).
    opt = sparseopt.DispatchOptimizer(keras.optimizers.SGD())
    model.compile(optimizer=opt, loss="mse")
    with pytest.raises(ValueError, match="dense_read/table.*not read through.*SparseLookup"):
        model.optimizer.build(model.trainable_variables)
    with pytest.raises(ValueError, match="dense_read/table.*not read through.*SparseLookup"):
        model.fit(np.zeros((2, N_IDS), "int32"), np.zeros((2, N_IDS, WIDTH)), verbose=0)


def test_optimizer_map_overrides_declared_updaters_and_routes_dense_variables():
    model = head_model(sparseopt.layers.SparseEmbedding(
        VOCAB, WIDTH, updater=sparseopt.updaters.Adagrad(0.1), name="emb"))
    frozen_sgd = keras.optimizers.SGD(0.0)
    opt = sparseopt.DispatchOptimizer(
        keras.optimizers.Adam(1e-2),
        optimizer_map={"emb/embeddings": sparseopt.updaters.SGD(0.3), "out/.*": frozen_sgd})
    model.compile(optimizer=opt, loss="mse")
    x, y = regression_data(1, steps=3)
    emb = model.get_layer("emb")
    before = {v.path: to_np(v) for v in model.trainable_variables}
    model.fit(x, y, batch_size=BATCH, verbose=0)
    assert [v.path for v in opt.variables if "accumulator" in v.path] == []  # no Adagrad slot
    for v in model.get_layer("out").weights:
        np.testing.assert_array_equal(to_np(v), before[v.path])
    assert not np.array_equal(to_np(emb.embeddings), before["emb/embeddings"])
    assert {id(o) for o in opt.dense_optimizers} == {id(opt.optimizer), id(frozen_sgd)}


def test_evaluate_and_predict_do_not_touch_tables():
    model, emb = table_model(VOCAB, WIDTH, N_IDS, sparseopt.updaters.Adagrad(0.1))
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD()), loss=dot_loss)
    rng = np.random.default_rng(12)
    xs, ys = batches(rng, 2, BATCH, N_IDS, VOCAB, WIDTH)
    model.train_on_batch(xs[0], ys[0])
    table = to_np(emb.embeddings)
    model.evaluate(xs[1], ys[1], verbose=0)
    model.predict(xs[1], verbose=0)
    assert np.array_equal(to_np(emb.embeddings), table)
    model.train_on_batch(xs[1], ys[1])
    assert not np.array_equal(to_np(emb.embeddings), table)


def test_mixed_precision_policy_wraps_and_trains_tables_with_the_true_gradient():
    rng = np.random.default_rng(13)
    xs, ys = batches(rng, 4, BATCH, N_IDS, VOCAB, WIDTH)
    want, _ = _scaled_run(lambda: sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.1)),
                          xs, ys, sparseopt.updaters.Adagrad(0.05))
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        got, model = _scaled_run(lambda: sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.1)),
                                 xs, ys, sparseopt.updaters.Adagrad(0.05))
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert float(to_np(model.optimizer.dynamic_scale)) == 2.0**15  # no overflow, not halved
    # float16 activations: the table moves as in float32, within half precision.
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3)
    assert np.abs(got - want).max() < 0.01 * np.abs(want).max()


def test_a_second_sparse_lookup_of_one_table_is_refused():
    layer = UserTable(VOCAB, WIDTH, name="user")
    layer.build((None, N_IDS))
    with pytest.raises(ValueError, match="user/table.*already has a SparseLookup"):
        sparseopt.ops.SparseLookup(layer, layer.table)


class UndeclaredTable(UserTable):
    @property
    def variable_path_to_optimizer_map(self):
        return {}


def test_sparse_table_without_an_updater_is_refused_at_build():
    layer = UndeclaredTable(VOCAB, WIDTH, name="undeclared")
    ids = keras.Input((N_IDS,), dtype="int32")
    model = keras.Model(ids, layer(ids))
    with pytest.raises(ValueError, match="undeclared/table.*has no sparse updater"):
        sparseopt.DispatchOptimizer(keras.optimizers.SGD()).build(model.trainable_variables)


def test_ambiguous_optimizer_map_patterns_are_refused():
    model = head_model(sparseopt.layers.SparseEmbedding(
        VOCAB, WIDTH, updater=sparseopt.updaters.Adagrad(0.1), name="emb"))
    opt = sparseopt.DispatchOptimizer(
        keras.optimizers.Adam(),
        optimizer_map={"hid.*": keras.optimizers.SGD(), ".*kernel": keras.optimizers.SGD()})
    with pytest.raises(ValueError, match="hidden/kernel.*several optimizer_map keys"):
        opt.build(model.trainable_variables)


def test_loss_scale_optimizer_inside_dispatch_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"LossScaleOptimizer\(DispatchOptimizer"):
        sparseopt.DispatchOptimizer(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()))


class BrokenDeclaration(UserTable):
    @property
    def variable_path_to_optimizer_map(self):
        return {"no/such/variable": self.updater}


def test_a_broken_layer_of_another_live_model_does_not_affect_this_build():
    broken = BrokenDeclaration(VOCAB, WIDTH, name="broken")
    ids = keras.Input((N_IDS,), dtype="int32")
    other = keras.Model(ids, broken(ids))  # alive, built, with a bad map
    other.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD()), loss="mse")
    with pytest.raises(ValueError, match="'broken' declares an updater for 'no/such/variable'"):
        other.optimizer.build(other.trainable_variables)  # its own model is refused
    model, emb = table_model(VOCAB, WIDTH, N_IDS, sparseopt.updaters.Adagrad(0.1))
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD()), loss=dot_loss)
    xs, ys = batches(np.random.default_rng(3), 1, BATCH, N_IDS, VOCAB, WIDTH)
    model.train_on_batch(xs[0], ys[0])  # builds, finds its table, trains
    assert list(model.optimizer.table_trainers) == ["emb/embeddings"]


def test_build_never_walks_the_heap(monkeypatch):
    """Declared updaters are found through lookups and the model, not `gc`.

    A million unrelated live objects stay alive during the build, and any
    heap walk fails the test.
    """
    import gc

    def refuse(*args):
        raise AssertionError("DispatchOptimizer walked the heap")

    unrelated = [object() for _ in range(1_000_000)]  # noqa: F841
    monkeypatch.setattr(gc, "get_objects", refuse)
    monkeypatch.setattr(gc, "get_referrers", refuse)
    layer = UserTable(VOCAB, WIDTH, name="user")
    ids = keras.Input((N_IDS,), dtype="int32")
    model = keras.Model(ids, layer(ids))
    opt = sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.1))
    model.compile(optimizer=opt, loss=dot_loss)
    xs, ys = batches(np.random.default_rng(4), 1, BATCH, N_IDS, VOCAB, WIDTH)
    model.train_on_batch(xs[0], ys[0])
    assert list(opt.table_trainers) == ["user/table"]
    wrapped = keras.optimizers.LossScaleOptimizer(sparseopt.DispatchOptimizer(keras.optimizers.SGD()))
    other, _ = table_model(VOCAB, WIDTH, N_IDS, sparseopt.updaters.SGD(0.1), name="other")
    wrapped.build(other.trainable_variables)  # the wrapper is found without gc too
    assert wrapped.inner_optimizer.loss_scaling_wrapper is wrapped


def test_a_trained_model_dropped_lets_its_tables_and_traces_go():
    """A model trained by `fit` (and run by `predict`) then dropped is freed, its tables
    with it: nothing global keeps its traced steps. (TensorFlow's `tf.custom_gradient`
    registers each trace's gradient function for good, holding that trace's graph and,
    through the lookup's closure, every table it reads: a process that trained model
    after model kept them all.)"""
    import gc
    import weakref

    x, y = regression_data(0, steps=4)
    dense = sparseopt.layers.SparseEmbedding(VOCAB, WIDTH, sparseopt.updaters.Adagrad(0.1))
    dynamic = sparseopt.layers.DynamicEmbedding(64, WIDTH, sparseopt.updaters.Adagrad(0.1))
    ids = keras.Input((N_IDS,), dtype="int32")
    out = keras.layers.Concatenate()([keras.layers.Flatten()(dense(ids)),
                                      keras.layers.Flatten()(dynamic(ids))])
    model = keras.Model(ids, keras.layers.Dense(1)(out))
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.Adam(0.01)),
                  loss="mse")
    model.fit(x, y, batch_size=BATCH, verbose=0)
    model.predict(x[:BATCH], verbose=0)
    gone = [weakref.ref(v) for v in (dense.embeddings, dynamic.embeddings,
                                     dynamic.vocabulary.keys)]
    del model, dense, dynamic, ids, out
    keras.backend.clear_session(free_memory=False)
    if keras.backend.backend() == "jax":
        import jax

        jax.clear_caches()  # (JAX's own caches of the compiled steps hold them until then)
    gc.collect()
    assert [g() is None for g in gone] == [True] * len(gone)
