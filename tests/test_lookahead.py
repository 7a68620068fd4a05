"""Lookahead on tables (`lookahead_period`) against TF Addons' dense definition.

The reference (NumPy) keeps a slow copy of the whole table, as TF Addons'
`Lookahead` wrapper does: after the update of every step `t` (1-based) with
`t % k == 0`, every row, touched or not, is synced
(`slow <- slow + alpha (fast - slow)`, `fast <- slow`). The updaters sync
only the rows changed in the window; the tables here are small with few ids
a step, so most rows miss most windows, and some rows change in one window
and not in the next ones (their sync must still happen, untouched).
"""

import keras
import numpy as np
import pytest

import sparseopt
from tests import reference
from tests.conftest import to_np
from tests.helpers import batches, dot_loss, kinds_by_backend, table_model

VOCAB, WIDTH, N_IDS, BATCH, STEPS = 40, 3, 2, 2, 17
PERIOD, ALPHA = 3, 0.4


def dense_lookahead(name, cfg, table0, xs, ys, lr, steps, period=PERIOD, alpha=ALPHA):
    """The fast weights after each of `steps` steps, by TF Addons' definition."""
    fast = np.asarray(table0, np.float64)
    slow = fast.copy()
    state = reference.initial_state(name, fast.shape, cfg)
    out = []
    for t, (x, y) in enumerate(zip(xs[:steps], ys[:steps]), start=1):
        fast, state = reference.sparse_step(name, fast, state, x, y / x.shape[0], lr, cfg,
                                            step=t)
        if t % period == 0:
            slow = slow + alpha * (fast - slow)
            fast = slow.copy()
        out.append(fast)
    return out


CASES = {"SGD": {}, "Adam": {}, "Adagrad": {}, "SGD-momentum": {"momentum": 0.9},
         "RowwiseAdagrad": {}}


def _model(name, cfg, **kwargs):
    updater = getattr(sparseopt.updaters, name)(0.05, lookahead_period=kwargs.pop(
        "period", PERIOD), lookahead_step_size=kwargs.pop("alpha", ALPHA), **cfg)
    model, emb = table_model(VOCAB, WIDTH, N_IDS, updater, **kwargs)
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.1)),
                  loss=dot_loss)
    return model, emb


@pytest.mark.parametrize("case", kinds_by_backend(sorted(CASES), sorted(CASES), ["Adam"]))
def test_every_step_equals_the_dense_lookahead(case):
    name = case.split("-")[0]
    cfg = CASES[case]
    rng = np.random.default_rng(4)
    xs, ys = batches(rng, STEPS, BATCH, N_IDS, VOCAB, WIDTH)
    model, emb = _model(name, cfg)
    table0 = to_np(emb.embeddings).copy()
    want = dense_lookahead(name, cfg, table0, xs, ys, 0.05, STEPS)
    for t in range(STEPS):
        model.train_on_batch(xs[t], ys[t])
        np.testing.assert_allclose(to_np(emb.embeddings), want[t], rtol=1e-5, atol=1e-6,
                                   err_msg=f"after step {t + 1}")
    # Rows changed in one window and untouched in the next ones were synced
    # all the same (the window's list, not the step's ids), and rows never
    # touched never moved.
    touched = np.unique(xs)
    assert touched.size < VOCAB
    untouched = np.setdiff1d(np.arange(VOCAB), touched)
    np.testing.assert_array_equal(to_np(emb.embeddings)[untouched], table0[untouched])
    late = [t for t in range(1, STEPS) if (t + 1) % PERIOD == 0
            and np.setdiff1d(np.unique(xs[t - PERIOD + 1:t]), xs[t]).size]
    assert late  # syncs of rows the sync step did not touch


def test_fit_with_a_period_of_one_and_alpha_one():
    """`lookahead_step_size=1` is the rule alone; a period of 1 syncs every step."""
    rng = np.random.default_rng(6)
    xs, ys = batches(rng, 6, BATCH, N_IDS, VOCAB, WIDTH)
    tables = {}
    for period, alpha in ((1, 1.0), (1, 0.5)):
        model, emb = _model("Adam", {}, period=period, alpha=alpha, init="zeros")
        model.fit(xs.reshape(-1, N_IDS), ys.reshape(-1, N_IDS, WIDTH), batch_size=BATCH,
                  shuffle=False, verbose=0)
        tables[period, alpha] = to_np(emb.embeddings)
    table0 = np.zeros((VOCAB, WIDTH))
    for (period, alpha), got in tables.items():
        want = dense_lookahead("Adam", {}, table0, xs, ys, 0.05, 6, period, alpha)[-1]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_resume_mid_window_is_exact(tmp_path):
    """Three steps (a window open, rows listed), save, load, three more: equal to six
    straight, table and every state variable bit for bit."""
    rng = np.random.default_rng(8)
    xs, ys = batches(rng, 6, BATCH, N_IDS, VOCAB, WIDTH)
    keras.utils.set_random_seed(0)
    straight, _ = _model("Adam", {}, period=4)
    keras.utils.set_random_seed(0)
    first, _ = _model("Adam", {}, period=4)
    for t in range(6):
        straight.train_on_batch(xs[t], ys[t])
    for t in range(3):
        first.train_on_batch(xs[t], ys[t])
    path = str(tmp_path / "m.keras")
    first.save(path)
    resumed = keras.saving.load_model(path, custom_objects={"dot_loss": dot_loss})
    for t in range(3, 6):
        resumed.train_on_batch(xs[t], ys[t])
    for a, b in zip(straight.get_weights(), resumed.get_weights()):
        np.testing.assert_array_equal(a, b)
    want = [to_np(v) for v in straight.optimizer.state_variables()]
    got = [to_np(v) for v in resumed.optimizer.state_variables()]
    assert len(want) == len(got)
    for a, b in zip(want, got):
        np.testing.assert_array_equal(a, b)


def test_lookahead_settings_are_checked_saved_and_refused_where_inexact():
    updater = sparseopt.updaters.SGD(0.1, lookahead_period=5, lookahead_step_size=0.25)
    config = updater.get_config()
    assert config["lookahead_period"] == 5 and config["lookahead_step_size"] == 0.25
    assert sparseopt.updaters.SGD.from_config(config).lookahead == (5, 0.25)
    assert sparseopt.updaters.Adam(0.1, lookahead_period=2).lookahead == (2, 0.5)
    with pytest.raises(ValueError, match="`lookahead_period` must be a positive int"):
        sparseopt.updaters.Adam(0.1, lookahead_period=0)
    with pytest.raises(ValueError, match=r"`lookahead_step_size` must be a number in \(0, 1\]"):
        sparseopt.updaters.Adam(0.1, lookahead_period=2, lookahead_step_size=0.0)
    with pytest.raises(ValueError, match="`lookahead_period` with lazy=False is not supported"):
        sparseopt.updaters.SGD(0.1, momentum=0.9, lazy=False, lookahead_period=5)
    with pytest.raises(ValueError, match="with `ema_momentum` is not supported.*one or the"):
        sparseopt.updaters.Adam(0.1, ema_momentum=0.9, lookahead_period=5)
    with pytest.raises(ValueError, match="with `swa_period` is not supported.*one or the"):
        sparseopt.updaters.Adam(0.1, swa_period=3, lookahead_period=5)
    with pytest.raises(ValueError, match="whole table's values.*Use lazy=True"):
        sparseopt.updaters.Adafactor(0.1, lazy=False, lookahead_period=5)
    with pytest.raises(ValueError, match=r"`lookahead` is not supported.*`lookahead_period`"):
        sparseopt.updaters.Adam(0.1, lookahead=5)
    with pytest.raises(ValueError, match=r"Adam\(lookahead_period=...\) has no Keras"):
        sparseopt.updaters.to_keras_optimizer(sparseopt.updaters.Adam(0.1, lookahead_period=2))
    # Lazy Adafactor is fine (its whole slots come from the touched rows' gradients).
    sparseopt.updaters.Adafactor(0.1, lookahead_period=5)


def test_a_row_given_to_a_new_id_mid_window_is_not_synced_with_the_old_ids_history():
    """An open vocabulary of 2 rows: id 20's row is trained and listed in the window,
    then given to id 30 at the step that ends the window. The sync leaves the new
    row at its initial value (its offset was reset with its other state), and
    id 10's row, changed in the window, is synced."""
    layer = sparseopt.layers.DynamicEmbedding(
        2, WIDTH, sparseopt.updaters.SGD(0.5, lookahead_period=6, lookahead_step_size=0.5),
        embeddings_initializer=keras.initializers.Constant(0.25), name="dyn", probes=2)
    ids = keras.Input((1,), dtype="int32")
    model = keras.Model(ids, layer(ids))
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.1)),
                  loss=dot_loss)
    y = np.ones((1, 1, WIDTH), "float32")
    # (An id's first sighting admits it: its row trains from its next one.)
    for key in (10, 20, 10, 20, 10):
        model.train_on_batch(np.array([[key]], "int32"), y)
    held = layer.held_ids()
    ten, twenty = to_np(layer.embeddings)[held[10]], to_np(layer.embeddings)[held[20]]
    np.testing.assert_allclose(ten, 0.25 - 2 * 0.5)  # two SGD steps of gradient 1
    np.testing.assert_allclose(twenty, 0.25 - 0.5)
    model.train_on_batch(np.array([[30]], "int32"), y)  # step 6: ends the window
    table = to_np(layer.embeddings)
    np.testing.assert_array_equal(table[held[20]], 0.25)  # 30's row: fresh, not synced
    np.testing.assert_allclose(table[held[10]], 0.25 + 0.5 * (ten - 0.25))  # synced


def test_with_gradient_accumulation_windows_count_updates():
    """Accumulating 2 micro-steps a step: the windows count the updates (as TF Addons'
    wrapper counts its inner optimizer's iterations), equal to one step on both
    micro-batches at once."""
    rng = np.random.default_rng(9)
    xs, ys = batches(rng, 12, BATCH, N_IDS, VOCAB, WIDTH)
    tables = []
    for steps in (2, None):
        model, emb = table_model(VOCAB, WIDTH, N_IDS, sparseopt.updaters.Adam(
            0.05, lookahead_period=PERIOD, lookahead_step_size=ALPHA), init="zeros")
        model.compile(optimizer=sparseopt.DispatchOptimizer(
            keras.optimizers.SGD(0.1), gradient_accumulation_steps=steps), loss=dot_loss)
        model.fit(xs.reshape(-1, N_IDS), ys.reshape(-1, N_IDS, WIDTH),
                  batch_size=BATCH * (2 if steps is None else 1), shuffle=False, verbose=0)
        tables.append(to_np(emb.embeddings))
    want = dense_lookahead("Adam", {}, np.zeros((VOCAB, WIDTH)),
                           xs.reshape(6, 2 * BATCH, N_IDS),
                           ys.reshape(6, 2 * BATCH, N_IDS, WIDTH), 0.05, 6)[-1]
    np.testing.assert_allclose(tables[1], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(tables[0], want, rtol=1e-5, atol=1e-6)


def test_a_skipped_step_lists_no_row_and_the_sync_keeps_its_schedule():
    """A non-finite gradient skips the table's update at step 3 (a sync step): it
    changes and lists nothing, and the rows changed at steps 1-2 are synced at
    step 3 all the same (the sync follows the step count, not the gradient)."""
    rng = np.random.default_rng(11)
    xs, ys = batches(rng, 7, BATCH, N_IDS, VOCAB, WIDTH)
    model, emb = _model("SGD", {})
    table0 = to_np(emb.embeddings).copy()
    bad = ys.copy()
    bad[2, 0, 0, 0] = np.nan
    for t in range(7):
        model.train_on_batch(xs[t], bad[t])
    assert model.optimizer.skipped_steps() == {emb.embeddings.path: 1}
    quiet = ys.copy()
    quiet[2] = 0.0  # SGD's step on a zero gradient changes nothing
    want = dense_lookahead("SGD", {}, table0, xs, quiet, 0.05, 7)[-1]
    np.testing.assert_allclose(to_np(emb.embeddings), want, rtol=1e-5, atol=1e-6)


def test_a_window_of_more_rows_than_a_chunk_syncs_each_once():
    """17,000+ rows changed in one window of a 20,000-row table: JAX syncs the
    list in chunks of 8,192 (the last one overlapping the one before), TF at
    once; the table equals the dense definition."""
    vocab, width, n_ids, steps = 20_000, 2, 8, 5
    rng = np.random.default_rng(12)
    xs = rng.integers(0, vocab, (steps, 1000, n_ids)).astype("int32")
    ys = rng.normal(size=(steps, 1000, n_ids, width)).astype("float32")
    model, emb = table_model(vocab, width, n_ids, sparseopt.updaters.SGD(
        0.5, lookahead_period=steps, lookahead_step_size=ALPHA))
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.1)),
                  loss=dot_loss)
    table0 = to_np(emb.embeddings).copy()
    for t in range(steps):
        model.train_on_batch(xs[t], ys[t])
    assert np.unique(xs).size > 2 * 8192
    want = dense_lookahead("SGD", {}, table0, xs, ys, 0.5, steps, steps)[-1]
    np.testing.assert_allclose(to_np(emb.embeddings), want, rtol=1e-5, atol=1e-6)


class SometimesA(keras.Model):
    """Reads table `a` only while `use_a` (the train function is remade on a change)."""

    def __init__(self, updater):
        super().__init__(name="sometimes_a")
        self.use_a = True
        self.a = sparseopt.layers.SparseEmbedding(VOCAB, WIDTH, updater, name="a")
        self.b = sparseopt.layers.SparseEmbedding(VOCAB, WIDTH, sparseopt.updaters.SGD(0.05),
                                                  name="b")

    def call(self, ids):
        out = self.b(ids)
        return out + self.a(ids) if self.use_a else out


def test_a_table_not_looked_up_at_the_end_of_its_window_is_synced_all_the_same():
    rng = np.random.default_rng(13)
    xs, ys = batches(rng, 3, BATCH, N_IDS, VOCAB, WIDTH)
    model = SometimesA(sparseopt.updaters.SGD(0.05, lookahead_period=3,
                                               lookahead_step_size=ALPHA))
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.1)),
                  loss=dot_loss)
    model(xs[0])
    table0 = to_np(model.a.embeddings).copy()
    for t in range(2):
        model.train_on_batch(xs[t], ys[t])
    fast = to_np(model.a.embeddings).copy()
    assert not np.array_equal(fast, table0)
    model.use_a = False
    model.make_train_function(force=True)
    model.train_on_batch(xs[2], ys[2])  # step 3: `a` not looked up, its window ends
    np.testing.assert_allclose(to_np(model.a.embeddings), table0 + ALPHA * (fast - table0),
                               rtol=1e-6, atol=1e-7)
