"""Property test: random step sequences of random batches, table sizes, updaters,
bad-id mixes and non-finite gradients, checked after every step.

After each step: rows (and state rows) outside the valid ids of the batch are
bit-for-bit unchanged; a step with a non-finite gradient changes nothing and
is counted; otherwise the table and its state equal the NumPy reference of
the rule; nothing is ever non-finite.

Each model has a second table with the same updater configuration (5 rows,
its own ids), which `DispatchOptimizer(group_tables=True)` updates in the same
group (one dedup for both): everything above holds for each table on its own, and a
non-finite gradient in one table skips that table only.

On JAX the update takes a step's distinct rows `DISTINCT_CHUNK` at a time
(8192 in use); here chunks are 3 rows, so that most steps take several passes
of the loop and a few (one-row tables) take the single pass.
"""

import keras
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sparseopt
from tests import reference
from tests.conftest import to_np
from tests.helpers import dot_loss, registered_cases

# Every shipped updater with every hyperparameter set its registry entry names.
RULES = {key: (entry.__name__, cfg) for key, (entry, cfg) in registered_cases().items()}
VOCABS = [1, 7, 40, 300]
# JAX compiles every step with XLA; TF traces a graph, or compiles it with XLA.
MODES = {"jax": ["jit"], "tensorflow": ["traced", "xla"]}[keras.backend.backend()]
WIDTH, N_IDS, LR = 3, 4, 0.1
OTHER_VOCAB = 5  # the second table, grouped with the first
BATCHES = [1, 2, 3, 5]  # XLA's dynamic shapes once failed at 2 and not at 3
BAD_IDS = [-1, -7, 2**31 - 1, -(2**31)]
_models = {}


@pytest.fixture(autouse=True, scope="module")
def _small_distinct_chunks():
    if keras.backend.backend() != "jax":
        yield
        return
    from sparseopt.backend import jax_distinct

    kept, jax_distinct.DISTINCT_CHUNK = jax_distinct.DISTINCT_CHUNK, 3
    yield
    jax_distinct.DISTINCT_CHUNK = kept


def _model(name, vocab, mode):
    # One compiled model per (rule, size, mode), reset between examples:
    # compiling per example would make a thousand cases far too slow.
    key = (name, vocab, mode)
    if key not in _models:
        rule, cfg = RULES[name]
        n = len(_models)
        inputs = {k: keras.Input((N_IDS,), dtype="int32", name=k) for k in ("a", "b")}
        tables = [sparseopt.layers.SparseEmbedding(
            rows, WIDTH, updater=getattr(sparseopt.updaters, rule)(LR, **cfg), name=f"{k}_{n}")
            for k, rows in (("emb", vocab), ("other", OTHER_VOCAB))]
        out = keras.layers.Concatenate(axis=1)([tables[0](inputs["a"]), tables[1](inputs["b"])])
        model = keras.Model(inputs, out)
        opt = sparseopt.DispatchOptimizer(keras.optimizers.SGD(), group_tables=True)
        model.compile(optimizer=opt, loss=dot_loss, jit_compile=mode != "traced")
        # Built first (a shortcut, not the users' path): one model per configuration is reused across Hypothesis examples, its fresh state snapshotted to reset it.
        opt.build(model.trainable_variables)
        assert opt.table_groups == [[t.embeddings.path for t in tables]]
        _models[key] = (model, tables, opt, [to_np(v) for v in opt.variables])
    return _models[key]


# Gradient scales: 0, or large enough that the gradients' squares are normal
# float32 numbers. Below that float32 flushes them to zero (XLA:CPU flushes
# subnormals) where the float64 reference keeps them, and a rule that
# normalizes its update (Lamb's trust ratio) turns that into a full step in the
# reference and none here (Keras' own float32 Lamb takes none either).
SCALES = st.one_of(st.just(0.0), st.floats(-4, 4).filter(lambda s: abs(s) >= 1e-15))


@st.composite
def steps(draw, vocab):
    """1-3 steps: id batches (one per table) mixing valid, hot and bad ids; gradients,
    some non-finite."""
    def ids(rows):
        return st.one_of(st.integers(0, rows - 1), st.integers(0, min(2, rows - 1)),
                         st.sampled_from(BAD_IDS + [rows, rows + 3]))

    out = []
    for _ in range(draw(st.integers(1, 3))):
        size = draw(st.sampled_from(BATCHES))
        batch = [np.array(draw(st.lists(st.lists(ids(rows), min_size=N_IDS, max_size=N_IDS),
                                        min_size=size, max_size=size)), "int32")
                 for rows in (vocab, OTHER_VOCAB)]
        poison = draw(st.sampled_from([None] * 6 + [np.nan, np.inf, -np.inf]))
        out.append((batch, draw(SCALES), poison, draw(st.integers(0, 2**16))))
    return out


@st.composite
def cases(draw):
    vocab = draw(st.sampled_from(VOCABS))
    return (draw(st.sampled_from(sorted(RULES))), vocab, draw(st.sampled_from(MODES)),
            draw(steps(vocab)))


# Examples per run: the Hypothesis profile (tests/conftest.py): 120 by default,
# 1000 with `make test-all` (`--hypothesis-profile=full`).
@settings(deadline=None, suppress_health_check=list(HealthCheck))
@given(case=cases())
def test_every_step_touches_only_valid_ids_and_matches_the_reference(case):
    key, vocab, mode, sequence = case
    model, tables, opt, fresh = _model(key, vocab, mode)
    name, cfg = RULES[key]
    for v, value in zip(opt.variables, fresh):
        v.assign(value)
    rng = np.random.default_rng(sequence[0][3])
    expected, slots = [], []
    for layer in tables:
        table = rng.normal(size=tuple(layer.embeddings.shape)).astype("float32")
        layer.embeddings.assign(table)
        table = table.astype(np.float64)
        expected.append((table, reference.initial_state(name, table.shape, cfg)))
        slots.append(opt.table_state(layer.embeddings))
    skipped = [0, 0]
    for step, (xs, scale, poison, seed) in enumerate(sequence, start=1):
        batch = xs[0].shape[0]
        y = (scale * np.random.default_rng(seed).normal(size=(batch, 2 * N_IDS, WIDTH)))
        y = y.astype("float32")
        poisoned = None
        if poison is not None:
            where = tuple(np.random.default_rng(seed).integers(0, [batch, 2 * N_IDS, WIDTH]))
            y[where] = poison
            poisoned = int(where[1] >= N_IDS)  # which table's rows it lands in
        before = [to_np(layer.embeddings) for layer in tables]
        model.train_on_batch({"a": xs[0], "b": xs[1]}, y)
        for i, layer in enumerate(tables):
            rows = layer.input_dim
            x, y_i = xs[i], y[:, i * N_IDS:(i + 1) * N_IDS]
            got = to_np(layer.embeddings)
            got_state = {k: to_np(v) for k, v in slots[i].items()}
            assert np.all(np.isfinite(got)) and all(np.all(np.isfinite(s)) for s in
                                                    got_state.values())
            valid = np.unique(x[(x >= 0) & (x < rows)])
            outside = np.setdiff1d(np.arange(rows), valid)
            np.testing.assert_array_equal(got[outside], before[i][outside])
            table, state = expected[i]
            if poisoned == i:  # anywhere in the lookup's gradient, even at a dropped id
                skipped[i] += 1
            else:
                table, state = reference.sparse_step(name, table, state, x,
                                                     y_i.astype(np.float64) / batch, LR, cfg,
                                                     step=step)
                expected[i] = (table, state)
            np.testing.assert_allclose(got, table, rtol=1e-4, atol=1e-5)
            assert sorted(got_state) == sorted(state)
            for k in state:
                np.testing.assert_allclose(got_state[k], state[k], rtol=1e-4, atol=1e-5)
        assert opt.skipped_steps() == {t.embeddings.path: n for t, n in zip(tables, skipped)}
