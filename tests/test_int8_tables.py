"""8-bit tables (`SparseEmbedding(dtype="int8")`): row-wise int8 codes with a float32 scale.

Every step is checked against a NumPy replay (the reference rule on the
rows read back as `codes / scale`, then the documented quantization of the
touched rows with the documented bits); the rounding's expectation against
the float32 value; files against Keras' own int8 `Embedding`; resume,
skipped steps and untouched rows bit for bit; refusals by their messages.
"""

import keras
import numpy as np
import pytest

import sparseopt
from sparseopt.storage import quantization
from tests import reference
from tests.conftest import to_np
from tests.helpers import batches, dot_loss, kinds, registered_cases, table_model

VOCAB, WIDTH, N_IDS, BATCH, STEPS = 300, 4, 5, 8, 20


def _refused(entry, cfg):
    """Whether int8 tables refuse this configuration (`checks.int8_table`)."""
    return entry(0.05, **cfg).lookahead is not None


CASES = {k: (entry, cfg) for k, (entry, cfg) in registered_cases().items()
         if not _refused(entry, cfg)}
# One of each kind: row-wise, per-entry and two-slot state, FTRL, whole-table
# state (Adafactor), `lazy=False`'s per-row record, a moving average.
KEEP = ["SGD:default", "Adagrad:default", "Adam:default", "RowwiseAdagrad:default",
        "Ftrl:default", "Adafactor:default", "Adagrad:dense_decay", "Adam:ema"]


def _stored(rows, step, ids):
    """The documented write of float64 `rows` (ids `ids`) at `step`: float32, then
    `floor(x * scale + u)` with `u` the top 24 of the stream-0 bits."""
    return _stored_at(rows, step, ids, 0)


def _read(codes, scale):
    return codes.astype(np.float32) / scale[:, None].astype(np.float32)


def _train(updater, xs, ys, **compile_kwargs):
    model, emb = table_model(VOCAB, WIDTH, N_IDS, updater, dtype="int8")
    start = (to_np(emb.embeddings), to_np(emb.embeddings_scale))
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.1)),
                  loss=dot_loss, **compile_kwargs)
    model.fit(xs.reshape(-1, N_IDS), ys.reshape(-1, N_IDS, WIDTH), batch_size=BATCH,
              shuffle=False, verbose=0)
    return model, emb, start


@pytest.mark.parametrize("case", kinds(sorted(CASES), KEEP))
def test_int8_table_matches_numpy_replay(case):
    entry, cfg = CASES[case]
    name = entry.__name__
    rng = np.random.default_rng(3)
    xs, ys = batches(rng, STEPS, BATCH, N_IDS, VOCAB, WIDTH, dup_vocab=120)
    model, emb, (codes, scale) = _train(entry(learning_rate=0.05, **cfg), xs, ys)
    assert emb.embeddings.dtype == "int8" and emb.embeddings_scale.dtype == "float32"
    codes, scale = codes.copy(), scale.copy()
    state = reference.initial_state(name, (VOCAB, WIDTH), cfg)
    for t, (x, y) in enumerate(zip(xs, ys)):
        table = _read(codes, scale).astype(np.float64)
        new, state = reference.sparse_step(name, table, state, x, y / BATCH, 0.05, cfg,
                                           step=t + 1)
        touched = np.unique(x)
        codes[touched], scale[touched] = _stored(new[touched], t + 1, touched)
    # The end of `fit`: `lazy=False`'s catch-up, the moving average; the rows
    # they change are written (quantized) at the steps done.
    table = _read(codes, scale).astype(np.float64)
    final, state = reference.finalize(name, table, state, 0.05, cfg, STEPS)
    changed = np.flatnonzero(np.any(final.astype(np.float32) != table.astype(np.float32), 1))
    if changed.size:
        codes[changed], scale[changed] = _stored(final[changed], STEPS, changed)
    got_codes, got_scale = to_np(emb.embeddings), to_np(emb.embeddings_scale)
    if not changed.size or changed.min() >= 120:
        # Never looked up (nor moved by the end of `fit`): exactly as initialized.
        np.testing.assert_array_equal(got_codes[120:], codes[120:])
        np.testing.assert_array_equal(got_scale[120:], scale[120:])
    # float32 rules here, float64 there: a value within rounding of a code
    # boundary can land on the other code, rarely; the rows then drift by a code.
    np.testing.assert_allclose(got_scale, scale, rtol=1e-3)
    assert np.max(np.abs(got_codes.astype(int) - codes)) <= 2, case
    assert np.mean(got_codes == codes) > 0.97, case
    got_state = {k: to_np(v) for k, v in model.optimizer.table_state(emb.embeddings).items()}
    for k, v in got_state.items():
        assert model.optimizer.table_state(emb.embeddings)[k].dtype in ("float32", "int32")
        np.testing.assert_allclose(v, state[k], rtol=2e-2, atol=1e-3, err_msg=k)


@pytest.mark.backend_independent
def test_quantize_is_keras_format_and_stochastic_rounding_is_unbiased():
    """Nearest rounding is Keras' `abs_max_quantize`; stochastic rounding's mean
    over many draws is the float32 value (within 6 standard deviations of a
    Bernoulli draw), which nearest misses by 0.1-0.5 of a code."""
    from keras.src.quantizers.quantizers import abs_max_quantize

    rng = np.random.default_rng(0)
    rows = rng.normal(size=(64, 16)).astype(np.float32)
    codes, scale = quantization.quantize(rows)
    want_codes, want_scale = abs_max_quantize(rows, axis=-1)
    np.testing.assert_array_equal(to_np(codes), to_np(want_codes))
    np.testing.assert_array_equal(to_np(scale), to_np(want_scale)[:, 0])

    n = 80000
    # Column 0 sets the scale (127 / ~1); the others sit 0.1, 0.5, 0.6 of a code past one.
    values = np.array([1.0, 38.1 / 127, -12.5 / 127, 90.6 / 127], np.float32)
    block = np.tile(values, (n, 1))
    bits = reference.rounding_bits(5, 1, 0, 7, np.arange(n), 4)
    codes, scale = quantization.quantize(block, bits)
    read = to_np(quantization.dequantize(codes, scale))
    spacing = 1.0 / to_np(scale)[0]
    bound = 6 * 0.5 * spacing / np.sqrt(n)
    np.testing.assert_allclose(read.mean(axis=0), values, atol=bound)
    nearest = to_np(quantization.dequantize(*quantization.quantize(values[None])))[0]
    assert np.all(np.abs(nearest[1:] - values[1:]) > 4 * bound)


def test_files_load_into_keras_own_int8_embedding(tmp_path):
    """A trained int8 table saves Keras' int8 `Embedding` entries: a plain quantized
    Keras model has the same file layout (but for the class name a functional
    model keys its layers by), loads the layer's entries and reads the same rows."""
    from tests.test_weights_files import file_layout

    rng = np.random.default_rng(0)
    xs, ys = batches(rng, 6, BATCH, N_IDS, VOCAB, WIDTH)
    model, emb, _ = _train(sparseopt.updaters.Adagrad(0.1), xs, ys)
    ids = keras.Input((N_IDS,), dtype="int32")
    plain = keras.Model(ids, keras.layers.Embedding(VOCAB, WIDTH, name="emb")(ids))
    plain.quantize("int8")
    ours, theirs = str(tmp_path / "ours.weights.h5"), str(tmp_path / "plain.weights.h5")
    model.save_weights(ours)
    plain.save_weights(theirs)
    renamed = {k.replace("sparse_embedding", "embedding"): v
               for k, v in file_layout(ours).items()}
    assert renamed == file_layout(theirs)
    store = {}
    emb.save_own_variables(store)
    store = {k: to_np(v) for k, v in store.items()}  # copies, as a file holds
    plain.get_layer("emb").load_own_variables(store)
    x = xs.reshape(-1, N_IDS)[:16]
    np.testing.assert_array_equal(to_np(plain.predict(x, verbose=0)),
                                  to_np(model.predict(x, verbose=0)))
    want = _read(to_np(emb.embeddings), to_np(emb.embeddings_scale))[x]
    # (XLA may divide as a multiplication by the reciprocal: within an ulp.)
    np.testing.assert_allclose(to_np(model.predict(x, verbose=0)), want, rtol=3e-7)


def test_resume_from_a_saved_model_is_bit_for_bit(tmp_path):
    """The last step's rows (still in the write buffer when `fit` returns) are in
    the file; the loaded model continues exactly as the uninterrupted run."""
    rng = np.random.default_rng(2)
    xs, ys = batches(rng, 8, BATCH, N_IDS, VOCAB, WIDTH)
    x, y = xs.reshape(-1, N_IDS), ys.reshape(-1, N_IDS, WIDTH)

    def fresh():
        keras.utils.set_random_seed(4)
        model, emb = table_model(VOCAB, WIDTH, N_IDS, sparseopt.updaters.Adam(0.05),
                                 dtype="int8")
        model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.1)),
                      loss=dot_loss)
        return model, emb

    whole, emb = fresh()
    whole.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    first, _ = fresh()
    first.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    first.save(tmp_path / "m.keras")
    again = keras.saving.load_model(tmp_path / "m.keras",
                                    custom_objects={"dot_loss": dot_loss})
    again.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    layer = again.get_layer("emb")
    assert layer.int8 is not None
    np.testing.assert_array_equal(to_np(layer.embeddings), to_np(emb.embeddings))
    np.testing.assert_array_equal(to_np(layer.embeddings_scale), to_np(emb.embeddings_scale))
    for k, v in whole.optimizer.table_state(emb.embeddings).items():
        np.testing.assert_array_equal(
            to_np(again.optimizer.table_state(layer.embeddings)[k]), to_np(v), err_msg=k)


def test_a_skipped_step_writes_nothing():
    """A non-finite gradient skips the step: the table and its state stay as they
    were, bit for bit, and the next step trains as usual."""
    rng = np.random.default_rng(5)
    xs, ys = batches(rng, 3, BATCH, N_IDS, VOCAB, WIDTH)
    model, emb, _ = _train(sparseopt.updaters.Adagrad(0.1), xs[:1], ys[:1])
    before = (to_np(emb.embeddings), to_np(emb.embeddings_scale),
              {k: to_np(v) for k, v in model.optimizer.table_state(emb.embeddings).items()})
    bad = ys[1].copy()
    bad[0, 0, 0] = np.nan
    model.train_on_batch(xs[1], bad)
    model.predict(xs[1], verbose=0)  # a call writes what the step buffered: nothing
    np.testing.assert_array_equal(to_np(emb.embeddings), before[0])
    np.testing.assert_array_equal(to_np(emb.embeddings_scale), before[1])
    for k, v in model.optimizer.table_state(emb.embeddings).items():
        np.testing.assert_array_equal(to_np(v), before[2][k], err_msg=k)
    assert model.optimizer.skipped_steps() == {emb.embeddings.path: 1}
    model.train_on_batch(xs[2], ys[2])
    model.predict(xs[2], verbose=0)
    assert not np.array_equal(to_np(emb.embeddings), before[0])


def test_memory_is_a_quarter_of_float32_and_the_config_round_trips():
    _, emb = table_model(VOCAB, 64, N_IDS, sparseopt.updaters.SGD(0.1), dtype="int8")
    # (TF's train step differentiates weights only: there the probe is one.)
    weights = [w for w in emb.weights if w is not emb._lookup.probe]
    assert sorted(w.path for w in weights) == ["emb/embeddings", "emb/embeddings_scale"]
    stored = sum(np.prod(w.shape) * np.dtype(w.dtype).itemsize for w in weights)
    assert stored == VOCAB * (64 + 4)  # against 256 bytes a row in float32
    config = emb.get_config()
    assert config["dtype"] == "int8"
    again = sparseopt.layers.SparseEmbedding.from_config(config)
    assert again.int8 is not None and again.compute_dtype == "float32"


REFUSED = {
    "lookahead_period": lambda: sparseopt.updaters.SGD(0.1, lookahead_period=2),
    "lookahead_period, Adam": lambda: sparseopt.updaters.Adam(0.1, lookahead_period=3),
}


@pytest.mark.parametrize("option", sorted(REFUSED))
def test_what_int8_tables_cannot_do_yet_is_refused_with_the_fix(option):
    model, _ = table_model(VOCAB, WIDTH, N_IDS, REFUSED[option](), dtype="int8")
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.1)),
                  loss=dot_loss)
    xs, ys = batches(np.random.default_rng(0), 1, BATCH, N_IDS, VOCAB, WIDTH)
    with pytest.raises(ValueError, match="int8.*bfloat16"):
        model.train_on_batch(xs[0], ys[0])


def test_rows_per_step_is_for_int8_tables_only():
    with pytest.raises(ValueError, match="rows_per_step"):
        sparseopt.layers.SparseEmbedding(100, 4, sparseopt.updaters.SGD(0.1), rows_per_step=8)


def test_gradient_accumulation_equals_the_larger_batch():
    """k micro-batches accumulated are one update of their ids (in order) at the mean
    gradient: the same codes, bit for bit, as that update taken at once (the
    rounding bits follow the update count)."""
    def run(batch, steps):
        keras.utils.set_random_seed(1)
        updater = sparseopt.updaters.Adagrad(0.1)
        model, emb = table_model(VOCAB, WIDTH, N_IDS, updater, dtype="int8")
        model.compile(optimizer=sparseopt.DispatchOptimizer(
            keras.optimizers.SGD(0.1), gradient_accumulation_steps=steps), loss=dot_loss)
        model.fit(x, y, batch_size=batch, shuffle=False, verbose=0)
        return emb, model

    xs, ys = batches(np.random.default_rng(6), 6, BATCH, N_IDS, VOCAB, WIDTH, dup_vocab=60)
    x, y = xs.reshape(-1, N_IDS), ys.reshape(-1, N_IDS, WIDTH)
    accumulated, model = run(BATCH, 2)
    whole, _ = run(2 * BATCH, None)
    np.testing.assert_array_equal(to_np(accumulated.embeddings), to_np(whole.embeddings))
    np.testing.assert_array_equal(to_np(accumulated.embeddings_scale),
                                  to_np(whole.embeddings_scale))
    assert int(to_np(model.optimizer.iterations)) == 3  # updates, of 6 micro-batches


def test_swa_average_of_an_int8_table():
    """`swa_period`: the average (kept in float32 from the values each step wrote)
    replaces the table at the end of `fit`, quantized; rows never looked up keep
    their codes. Against TF Addons' dense SWA of the same run's float values, to
    within the quantization's noise (the table's trajectory is its int8 one)."""
    from tests.test_swa import PERIOD, START

    rng = np.random.default_rng(4)
    xs, ys = batches(rng, 23, BATCH, N_IDS, VOCAB, WIDTH, dup_vocab=120)
    updater = sparseopt.updaters.SGD(0.05, swa_period=PERIOD, swa_start=START)
    model, emb = table_model(VOCAB, WIDTH, N_IDS, updater, dtype="int8")
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.1)),
                  loss=dot_loss)
    start = (to_np(emb.embeddings), to_np(emb.embeddings_scale))
    codes, scale = start[0].copy(), start[1].copy()
    state = reference.initial_state("SGD", (VOCAB, WIDTH), {})
    average, k = np.zeros((VOCAB, WIDTH)), 0
    for t, (x, y) in enumerate(zip(xs, ys), start=1):
        table = _read(codes, scale).astype(np.float64)
        new, state = reference.sparse_step("SGD", table, state, x, y / BATCH, 0.05, {}, step=t)
        if t - 1 >= START and (t - 1 - START) % PERIOD == 0:
            average = (k * average + new) / (k + 1)
            k += 1
        touched = np.unique(x)
        codes[touched], scale[touched] = _stored(new[touched], t, touched)
    model.fit(xs.reshape(-1, N_IDS), ys.reshape(-1, N_IDS, WIDTH), batch_size=BATCH,
              shuffle=False, verbose=0)
    got = _read(to_np(emb.embeddings), to_np(emb.embeddings_scale))
    step = np.max(np.abs(average), axis=1, keepdims=True) / 127
    assert np.all(np.abs(got - average) <= 3 * step)
    assert np.mean(np.abs(got - average) <= step) > 0.95
    np.testing.assert_array_equal(to_np(emb.embeddings)[120:], start[0][120:])
    np.testing.assert_array_equal(to_np(emb.embeddings_scale)[120:], start[1][120:])


@pytest.mark.parametrize("entry", ["fit", "train_on_batch"])
def test_a_step_updating_more_rows_than_the_buffer_holds_is_an_error(entry):
    """The error names the fix, and is what the user sees: `fit` ends each run (also
    one whose first step failed while traced) in the optimizer's end-of-fit hook,
    which must then not raise an error of its own over it."""
    ids = keras.Input((N_IDS,), dtype="int32")
    emb = sparseopt.layers.SparseEmbedding(VOCAB, WIDTH, sparseopt.updaters.SGD(0.1),
                                           dtype="int8", rows_per_step=16, name="emb")
    model = keras.Model(ids, emb(ids))
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.1)),
                  loss=dot_loss)
    xs, ys = batches(np.random.default_rng(0), 1, BATCH, N_IDS, VOCAB, WIDTH)
    assert len(np.unique(xs[0])) > 16
    with pytest.raises(Exception, match="rows_per_step"):
        if entry == "fit":
            model.fit(xs[0], ys[0], batch_size=BATCH, verbose=0)
        else:
            model.train_on_batch(xs[0], ys[0])


def test_grouped_int8_tables_are_written_as_tables_alone():
    """`group_tables=True`: one dedup for both int8 tables, each member's rule on the
    rows its own lookups read (found through the group's workspace); the codes and
    scales equal those of each table updated alone (float rounding aside: another
    compiled program)."""
    from tests.test_precision import _two_tables

    grouped, model = _two_tables(seed=0, dtype="int8", group_tables=True)
    alone, _ = _two_tables(seed=0, dtype="int8")
    assert model.optimizer.table_groups == [["a/embeddings", "b/embeddings"]]
    for a, b in zip(grouped, alone):
        if a.dtype == np.int8:
            assert np.mean(a == b) > 0.99
            assert np.max(np.abs(a.astype(int) - b)) <= 1
        else:
            np.testing.assert_allclose(a, b, rtol=1e-5)


def test_dense_adafactor_on_an_int8_table_follows_keras_adafactor():
    """`Adafactor(lazy=False)`: its whole-table statistics start from the int8 table's
    values read back and follow the values each step wrote; against Keras' own
    Adafactor on the (dequantized) table as a dense variable, to within the
    quantization's noise (a few codes), and far from the lazy form's result."""
    from tests.test_adafactor import keras_dense

    vocab, width = 60, 4
    rng = np.random.default_rng(6)
    xs, ys = batches(rng, 30, 4, 3, vocab, width, dup_vocab=40)
    model, emb = table_model(vocab, width, 3, sparseopt.updaters.Adafactor(0.5, lazy=False),
                             dtype="int8", init=keras.initializers.RandomUniform(-1, 1))
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.1)),
                  loss=dot_loss)
    table0 = _read(to_np(emb.embeddings), to_np(emb.embeddings_scale))
    model.fit(xs.reshape(-1, 3), ys.reshape(-1, 3, width), batch_size=4, shuffle=False,
              verbose=0)
    want = keras_dense(lambda: keras.optimizers.Adafactor(0.5), table0, xs, ys)
    got = _read(to_np(emb.embeddings), to_np(emb.embeddings_scale))
    step = np.max(np.abs(want), axis=1, keepdims=True) / 127
    assert np.all(np.abs(got - want) <= 4 * step), np.max(np.abs(got - want) / step)
    np.testing.assert_array_equal(got[40:], table0[40:])  # never touched
    assert np.max(np.abs(want[:40] - table0[:40])) > 20 * np.max(step)  # it moved


_PROPERTY_MODELS = {}


def _property_model(key, vocab):
    """Two int8 tables with one updater configuration, updated in one group (cached:
    one compiled model per rule and size, reset between examples)."""
    from tests.test_properties import N_IDS as n_ids, OTHER_VOCAB, RULES, WIDTH as width

    if (key, vocab) not in _PROPERTY_MODELS:
        rule, cfg = RULES[key]
        n = len(_PROPERTY_MODELS)
        inputs = {k: keras.Input((n_ids,), dtype="int32", name=k) for k in ("a", "b")}
        tables = [sparseopt.layers.SparseEmbedding(
            rows, width, updater=getattr(sparseopt.updaters, rule)(0.1, **cfg),
            name=f"{k}_{n}", dtype="int8", embeddings_initializer=keras.initializers.RandomNormal())
            for k, rows in (("emb", vocab), ("other", OTHER_VOCAB))]
        out = keras.layers.Concatenate(axis=1)([tables[0](inputs["a"]), tables[1](inputs["b"])])
        model = keras.Model(inputs, out)
        opt = sparseopt.DispatchOptimizer(keras.optimizers.SGD(), group_tables=True)
        model.compile(optimizer=opt, loss=dot_loss)
        # Built first (a shortcut, not the users' path): one model per configuration is reused across examples, its fresh state snapshotted to reset it.
        opt.build(model.trainable_variables)
        fresh = ([to_np(v) for v in opt.variables],
                 [(to_np(t.embeddings), to_np(t.embeddings_scale)) for t in tables])
        _PROPERTY_MODELS[(key, vocab)] = (model, tables, opt, fresh)
    return _PROPERTY_MODELS[(key, vocab)]


def _int8_cases():
    from hypothesis import strategies as st

    from tests.test_properties import RULES, steps

    @st.composite
    def cases(draw):
        vocab = draw(st.sampled_from([1, 7, 40]))
        key = draw(st.sampled_from(sorted(k for k in RULES if not _refused(*CASES[k]))))
        return key, vocab, draw(steps(vocab))

    return cases()


def test_int8_steps_with_bad_ids_duplicates_and_non_finite_gradients():
    """The property test's random steps (tests/test_properties.py: bad ids, hot ids,
    empty and one-row tables, non-finite gradients, two grouped tables) on int8
    tables: rows outside a step's valid ids keep their codes and scales bit for bit;
    a poisoned table changes nothing; otherwise the rows are the reference rule's,
    quantized, within the float32-vs-float64 slack of a code."""
    from hypothesis import HealthCheck, given, settings

    from tests.test_properties import N_IDS as n_ids, RULES, WIDTH as width

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    @given(case=_int8_cases())
    def check(case):
        key, vocab, sequence = case
        model, tables, opt, (fresh, start) = _property_model(key, vocab)
        name, cfg = RULES[key]
        for v, value in zip(opt.variables, fresh):
            v.assign(value)
        expected = []
        for layer, (codes, scale) in zip(tables, start):
            layer.embeddings.assign(codes)
            layer.embeddings_scale.assign(scale)
            layer.int8.clear()
            expected.append((codes.copy(), scale.copy(),
                             reference.initial_state(name, codes.shape, cfg)))
        for step, (xs, scale_, poison, seed) in enumerate(sequence, start=1):
            batch = xs[0].shape[0]
            y = (scale_ * np.random.default_rng(seed).normal(
                size=(batch, 2 * n_ids, width))).astype("float32")
            poisoned = None
            if poison is not None:
                where = tuple(np.random.default_rng(seed).integers(0, [batch, 2 * n_ids, width]))
                y[where] = poison
                poisoned = int(where[1] >= n_ids)
            before = [(to_np(t.embeddings), to_np(t.embeddings_scale)) for t in tables]
            model.train_on_batch({"a": xs[0], "b": xs[1]}, y)
            for i, layer in enumerate(tables):
                layer.int8.flush()  # (what the next call writes)
                codes, scale, state = expected[i]
                rows = layer.input_dim
                x = xs[i]
                valid = np.unique(x[(x >= 0) & (x < rows)])
                if poisoned != i and valid.size:
                    table = _read(codes, scale).astype(np.float64)
                    grads = y[:, i * n_ids:(i + 1) * n_ids].astype(np.float64) / batch
                    new, state = reference.sparse_step(name, table, state, x, grads, 0.1, cfg,
                                                       step=step)
                    codes, scale = codes.copy(), scale.copy()
                    new_codes, new_scale = _stored_at(new[valid], step, valid, i)
                    codes[valid], scale[valid] = new_codes, new_scale
                    expected[i] = (codes, scale, state)
                got_codes, got_scale = to_np(layer.embeddings), to_np(layer.embeddings_scale)
                outside = np.setdiff1d(np.arange(rows), valid if poisoned != i else [])
                np.testing.assert_array_equal(got_codes[outside], before[i][0][outside])
                np.testing.assert_array_equal(got_scale[outside], before[i][1][outside])
                assert np.all(np.isfinite(got_scale))
                assert np.max(np.abs(got_codes.astype(int) - codes), initial=0) <= 2
                np.testing.assert_allclose(got_scale, scale, rtol=1e-3)

    check()


def _stored_at(rows, step, ids, table_index):
    """`_stored` for the optimizer's `table_index`-th table (its own rounding bits)."""
    x = np.asarray(rows, np.float32)
    scale = np.float32(127) / (np.max(np.abs(x), axis=1) + np.float32(1e-7))
    bits = reference.rounding_bits(0, table_index, 0, step, ids, x.shape[1])
    u = (bits >> 8).astype(np.float32) * np.float32(2.0**-24)
    return np.clip(np.floor(x * scale[:, None] + u), -127, 127).astype(np.int8), scale
