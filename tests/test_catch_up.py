"""`lazy=False` and `ema_momentum`: dense semantics at sparse cost, against Keras'
own dense optimizers.

The reference trains the same model with a one-hot table (an exact dense
gradient, zero on untouched rows) by Keras' SGD (momentum, nesterov,
weight_decay) or Adagrad (weight_decay), which move and decay every row every
step, or with `use_ema=True`, which averages every row every step. Each batch
touches a few of the table's rows, so most rows miss most steps: the sparse
table matches only if the missed steps are caught up.
"""

import keras
import numpy as np
import pytest

import sparseopt
from tests.conftest import to_np
from tests.helpers import OneHotEmbedding, dot_loss

VOCAB, WIDTH, N_IDS, BATCH, STEPS, LR = 40, 3, 2, 2, 12, 0.1

CASES = {
    "sgd_momentum_decay": (dict(momentum=0.9, weight_decay=0.2),
                           lambda: keras.optimizers.SGD(LR, momentum=0.9, weight_decay=0.2)),
    "sgd_nesterov_decay": (dict(momentum=0.6, nesterov=True, weight_decay=0.5),
                           lambda: keras.optimizers.SGD(LR, momentum=0.6, nesterov=True,
                                                        weight_decay=0.5)),
    "sgd_momentum": (dict(momentum=0.8), lambda: keras.optimizers.SGD(LR, momentum=0.8)),
    "sgd_decay": (dict(weight_decay=0.3), lambda: keras.optimizers.SGD(LR, weight_decay=0.3)),
    "adagrad_decay": (dict(weight_decay=0.4),
                      lambda: keras.optimizers.Adagrad(LR, weight_decay=0.4)),
}


EMA_CASES = {
    "sgd_ema": (dict(ema_momentum=0.9),
                lambda: keras.optimizers.SGD(LR, use_ema=True, ema_momentum=0.9)),
    "adagrad_ema": (dict(ema_momentum=0.7),
                    lambda: keras.optimizers.Adagrad(LR, use_ema=True, ema_momentum=0.7)),
}


def _models(case):
    kwargs, keras_opt = {**CASES, **EMA_CASES}[case]
    cls = sparseopt.updaters.Adagrad if case.startswith("adagrad") else sparseopt.updaters.SGD
    ids = keras.Input((N_IDS,), dtype="int32")
    lazy = case in EMA_CASES
    emb = sparseopt.layers.SparseEmbedding(VOCAB, WIDTH, updater=cls(LR, lazy=lazy, **kwargs),
                                           name="emb")
    sparse = keras.Model(ids, emb(ids))
    sparse.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD(LR)),
                   loss=dot_loss)
    ref_emb = OneHotEmbedding(VOCAB, WIDTH, name="ref")
    ref = keras.Model(ids, ref_emb(ids))
    ref.compile(optimizer=keras_opt(), loss=dot_loss)
    ref(np.zeros((1, N_IDS), "int32"))
    ref_emb.embeddings.assign(to_np(emb.embeddings))
    return sparse, emb, ref, ref_emb


def _data(seed):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, VOCAB, size=(STEPS * BATCH, N_IDS)).astype("int32")
    y = rng.normal(size=(STEPS * BATCH, N_IDS, WIDTH)).astype("float32")
    return x, y


@pytest.mark.parametrize("case", sorted(CASES))
def test_fit_ends_where_the_dense_keras_optimizer_ends(case):
    sparse, emb, ref, ref_emb = _models(case)
    x, y = _data(0)
    touched_last = np.unique(x[-BATCH:])
    sparse.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    ref.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    # fit ends with finalize_variable_values: every row caught up.
    np.testing.assert_allclose(to_np(emb.embeddings), to_np(ref_emb.embeddings),
                               rtol=2e-5, atol=1e-6)
    assert len(touched_last) < VOCAB // 4  # most rows missed the last step


@pytest.mark.parametrize("case", ["sgd_momentum_decay", "adagrad_decay"])
def test_rows_catch_up_when_touched_and_untouched_rows_wait(case):
    """Step by step (no `fit`): each touched row equals the dense row after its
    step; rows not touched keep their value until touched or caught up."""
    sparse, emb, ref, ref_emb = _models(case)
    x, y = _data(1)
    for step in range(STEPS):
        xb, yb = x[step * BATCH:(step + 1) * BATCH], y[step * BATCH:(step + 1) * BATCH]
        before = to_np(emb.embeddings)
        sparse.train_on_batch(xb, yb)
        ref.train_on_batch(xb, yb)
        got, want = to_np(emb.embeddings), to_np(ref_emb.embeddings)
        touched = np.unique(xb)
        np.testing.assert_allclose(got[touched], want[touched], rtol=2e-5, atol=1e-6)
        untouched = np.setdiff1d(np.arange(VOCAB), touched)
        np.testing.assert_array_equal(got[untouched], before[untouched])
    sparse.optimizer.catch_up_tables()
    np.testing.assert_allclose(to_np(emb.embeddings), to_np(ref_emb.embeddings),
                               rtol=2e-5, atol=1e-6)
    last = to_np(sparse.optimizer.table_state(emb.embeddings)["last_step"])
    np.testing.assert_array_equal(last, STEPS)


@pytest.mark.parametrize("case", sorted(EMA_CASES))
def test_ema_tables_end_fit_on_the_average_keras_use_ema_ends_on(case):
    sparse, emb, ref, ref_emb = _models(case)
    x, y = _data(2)
    sparse.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    ref.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    np.testing.assert_allclose(to_np(emb.embeddings), to_np(ref_emb.embeddings),
                               rtol=2e-5, atol=1e-6)


def test_the_moving_average_is_readable_at_every_step_and_untouched_rows_wait():
    """Against a NumPy average of the dense reference's rows, step by step."""
    sparse, emb, ref, ref_emb = _models("sgd_ema")
    x, y = _data(3)
    average = None
    for step in range(STEPS):
        xb, yb = x[step * BATCH:(step + 1) * BATCH], y[step * BATCH:(step + 1) * BATCH]
        before = to_np(emb.embeddings)
        sparse.train_on_batch(xb, yb)
        ref.train_on_batch(xb, yb)
        rows = to_np(ref_emb.embeddings)
        average = rows if average is None else 0.9 * average + 0.1 * rows
        np.testing.assert_allclose(to_np(sparse.optimizer.table_moving_average(emb.embeddings)),
                                   average, rtol=2e-5, atol=1e-6)
        untouched = np.setdiff1d(np.arange(VOCAB), np.unique(xb))
        np.testing.assert_array_equal(to_np(emb.embeddings)[untouched], before[untouched])


def test_the_per_row_record_is_4_bytes_a_row_of_int32_state():
    updater = sparseopt.updaters.SGD(LR, momentum=0.9, lazy=False)
    model = keras.Sequential([keras.Input((N_IDS,), dtype="int32"),
                              sparseopt.layers.SparseEmbedding(1000, 8, updater=updater,
                                                               name="emb")])
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD()), loss="mse")
    # Built first (a shortcut, not the users' path): reads the state's shapes without training.
    model.optimizer.build(model.trainable_variables)
    state = model.optimizer.table_state(model.get_layer("emb").embeddings)
    assert {k: (tuple(v.shape), str(v.dtype)) for k, v in state.items()} == {
        "momentum": ((1000, 8), "float32"), "last_step": ((1000,), "int32")}


@pytest.mark.parametrize("make,message", [
    (lambda: sparseopt.updaters.Adam(0.1, lazy=False), r"Adam\(lazy=False\): no exact catch-up"),
    (lambda: sparseopt.updaters.Ftrl(0.1, lazy=False), r"Ftrl\(lazy=False\): no exact catch-up"),
    (lambda: sparseopt.updaters.SGD(0.1, lazy=False, max_norm=1.0),
     r"SGD\(lazy=False\) with `max_norm`"),
    (lambda: sparseopt.updaters.SGD(0.1, lazy=False, weight_decay=0.1, weight_decay_mode="l2"),
     r"weight_decay_mode='l2'"),
    (lambda: sparseopt.updaters.Adagrad(0.1, lazy=False, weight_decay=keras.optimizers.
                                        schedules.ExponentialDecay(0.1, 10, 0.5)),
     r"schedules for \['weight_decay'\]"),
    (lambda: sparseopt.updaters.SGD(keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5),
                                    lazy=False, weight_decay=0.1),
     r"learning-rate schedule"),
    (lambda: sparseopt.updaters.AdagradMomentum(
        keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5), momentum=0.9, lazy=False),
     r"learning-rate schedule"),
    (lambda: sparseopt.updaters.SGD(2.0, lazy=False, weight_decay=0.5), r"must be below 1"),
    (lambda: sparseopt.updaters.SGD(0.1, lazy="no"), r"`lazy` must be True or False"),
    (lambda: sparseopt.updaters.SGD(0.1, ema_momentum=1.0), r"`ema_momentum` must be a number"),
    (lambda: sparseopt.updaters.SGD(0.1, momentum=0.9, lazy=False, ema_momentum=0.9),
     r"`ema_momentum` with lazy=False is not supported"),
])
@pytest.mark.backend_independent
def test_settings_without_an_exact_catch_up_are_refused_by_name(make, message):
    with pytest.raises((ValueError, TypeError), match=message):
        make()


@pytest.mark.backend_independent
def test_a_schedule_the_catch_up_does_not_read_is_accepted():
    # SGD momentum's missed steps do not involve the learning rate.
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
    updater = sparseopt.updaters.SGD(schedule, momentum=0.9, lazy=False)
    assert [s.name for s in updater.slots] == ["momentum", "last_step"]
    assert sparseopt.updaters.SGD.from_config(updater.get_config()).lazy is False


def test_the_new_state_saves_and_resumes_bit_for_bit(tmp_path):
    """Adam's moments, `lazy=False`'s per-row record, the moving average's offset:
    6 steps straight == its weights saved after 3, loaded by a new model, 3 more steps."""
    updaters = {
        "adam_ema": lambda: sparseopt.updaters.Adam(0.05, ema_momentum=0.9),
        "sgd_dense": lambda: sparseopt.updaters.SGD(0.1, momentum=0.9, weight_decay=0.2,
                                                    lazy=False),
        "prw_adam": lambda: sparseopt.updaters.PartialRowwiseAdam(0.05, weight_decay=0.01),
        "agm_dense": lambda: sparseopt.updaters.AdagradMomentum(0.1, momentum=0.5,
                                                                lazy=False),
    }

    def build():
        keras.utils.set_random_seed(3)
        ids = keras.Input((N_IDS,), dtype="int32")
        outs = [sparseopt.layers.SparseEmbedding(VOCAB, WIDTH, updater=make(), name=name)(ids)
                for name, make in updaters.items()]
        model = keras.Model(ids, keras.layers.Concatenate(axis=1)(outs))
        model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD(LR)),
                      loss=dot_loss)
        return model

    rng = np.random.default_rng(4)
    x = rng.integers(0, VOCAB, size=(6, BATCH, N_IDS)).astype("int32")
    y = rng.normal(size=(6, BATCH, N_IDS * len(updaters), WIDTH)).astype("float32")

    def snapshot(model):
        out = {}
        for name in updaters:
            table = model.get_layer(name).embeddings
            out[name] = to_np(table)
            for slot, v in model.optimizer.table_state(table).items():
                out[f"{name}/{slot}"] = np.asarray(keras.ops.convert_to_numpy(v))
        out["average"] = to_np(model.optimizer.table_moving_average(
            model.get_layer("adam_ema").embeddings))
        return out

    straight = build()  # saved after 3 of its 6 steps
    path = str(tmp_path / "half.weights.h5")
    for step in range(6):
        if step == 3:
            straight.save_weights(path)
        straight.train_on_batch(x[step], y[step])
    resumed = build()
    resumed.load_weights(path)
    for step in range(3, 6):
        resumed.train_on_batch(x[step], y[step])
    want, got = snapshot(straight), snapshot(resumed)
    assert sorted(got) == sorted(want)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
