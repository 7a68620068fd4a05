"""Property test: random batches, sizes, updaters and bad ids, checked every step."""

import keras
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sparseopt
from tests import reference
from tests.conftest import to_np
from tests.helpers import dot_loss, table_model

RULES = {
    "SGD": ({}, lambda: sparseopt.updaters.SGD(0.1)),
    "Adagrad": ({}, lambda: sparseopt.updaters.Adagrad(0.1)),
    "RowwiseAdagrad": ({}, lambda: sparseopt.updaters.RowwiseAdagrad(0.1)),
    "Ftrl": ({"l1_regularization_strength": 0.01},
             lambda: sparseopt.updaters.Ftrl(0.1, l1_regularization_strength=0.01)),
}
VOCAB, WIDTH, N_IDS, BATCH = 40, 3, 4, 3
_models = {}


def _model(name):
    # One compiled model per rule, reset between examples: compiling per example
    # would make a thousand cases far too slow.
    if name not in _models:
        model, emb = table_model(VOCAB, WIDTH, N_IDS, RULES[name][1]())
        opt = sparseopt.DispatchOptimizer(keras.optimizers.SGD())
        model.compile(optimizer=opt, loss=dot_loss)
        opt.build(model.trainable_variables)
        _models[name] = (model, emb, opt, [to_np(v) for v in opt.variables])
    return _models[name]


ids = st.one_of(st.integers(0, VOCAB - 1), st.integers(0, 5),
                st.sampled_from([-1, -7, VOCAB, VOCAB + 3, 2**31 - 1, -(2**31)]))


@settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck))
@given(name=st.sampled_from(sorted(RULES)),
       batch=st.lists(st.lists(ids, min_size=N_IDS, max_size=N_IDS),
                      min_size=BATCH, max_size=BATCH),
       scale=st.floats(-4, 4), seed=st.integers(0, 2**16))
def test_each_step_touches_only_valid_ids_and_matches_the_reference(name, batch, scale, seed):
    model, emb, opt, fresh = _model(name)
    for v, value in zip(opt.variables, fresh):
        v.assign(value)
    rng = np.random.default_rng(seed)
    table0 = rng.normal(size=(VOCAB, WIDTH)).astype("float32")
    emb.embeddings.assign(table0)
    x = np.array(batch, dtype="int32")
    y = (scale * rng.normal(size=(BATCH, N_IDS, WIDTH))).astype("float32")
    model.train_on_batch(x, y)
    table = to_np(emb.embeddings)
    assert np.all(np.isfinite(table))
    valid = np.unique(x[(x >= 0) & (x < VOCAB)])
    outside = np.setdiff1d(np.arange(VOCAB), valid)
    assert np.array_equal(table[outside], table0[outside])
    cfg = RULES[name][0]
    state = reference.initial_state(name, table0.shape, cfg)
    want, _ = reference.sparse_step(name, table0.astype(np.float64), state, x,
                                    y.astype(np.float64) / BATCH, 0.1, cfg)
    np.testing.assert_allclose(table, want, rtol=1e-4, atol=1e-5)
