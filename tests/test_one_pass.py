"""On a GPU, a step's distinct rows go through their rule in one pass.

On JAX CPU the rows are taken `DISTINCT_CHUNK` at a time by a loop whose trip
count is the step's distinct ids (and an int8 table's write buffer is written
the same way); XLA:GPU decides each trip of such a loop on the host, so on a
GPU there is no loop (`jax_distinct.loops_follow_count`).
No GPU runs this suite, so it is checked here with the loop turned off on the
CPU (a shortcut: the switch is the module's own function, patched): `fit`
writes the same rows as the chunked loop does, to the same values (within
XLA:CPU's rounding of one rule compiled at two shapes: the last bit of a few
entries may differ, as vectorized code and its scalar tail can round
differently), leaves every other row bit for bit, and the compiled step holds
no loop. (TF updates the distinct rows in one pass everywhere: no loop to turn off.)
"""

import keras
import numpy as np
import pytest

import sparseopt
from tests.conftest import to_np
from tests.helpers import batches, dot_loss, table_model

pytestmark = pytest.mark.skipif(keras.backend.backend() != "jax",
                                reason="JAX's chunk loop; TF has none")

VOCAB, WIDTH, IDS, BATCH, STEPS = 60, 4, 5, 8, 3


def _train(monkeypatch, loops, updater, dtype=None):
    from sparseopt import compat
    from sparseopt.backend import jax_distinct

    monkeypatch.setattr(jax_distinct, "DISTINCT_CHUNK", 3)  # up to 40 ids a step: many chunks
    monkeypatch.setattr(jax_distinct, "loops_follow_count", lambda: loops)
    keras.utils.set_random_seed(0)
    model, emb = table_model(VOCAB, WIDTH, IDS, updater, dtype=dtype)
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.Adam(0.01)),
                  loss=dot_loss)
    xs, ys = batches(np.random.default_rng(0), STEPS, BATCH, IDS, VOCAB, WIDTH, dup_vocab=30)
    model.fit(xs.reshape(-1, IDS), ys.reshape(-1, IDS, WIDTH), batch_size=BATCH,
              shuffle=False, verbose=0)
    state = {k: to_np(v) for k, v in model.optimizer.table_state(emb.embeddings).items()}
    # The step's program, lowered again from the trained state (a shortcut: Keras
    # keeps its compiled step to itself).
    import jax

    batch = (xs[0], ys[0])
    program = jax.jit(model.train_step).lower(compat.jax_train_state(model, batch),
                                              batch).as_text()
    return to_np(emb.embeddings), state, program, np.unique(xs)


@pytest.mark.parametrize("updater,dtype", [
    (lambda: sparseopt.updaters.RowwiseAdagrad(0.1), None),
    (lambda: sparseopt.updaters.Adam(0.05, weight_decay=0.01), None),
    (lambda: sparseopt.updaters.Ftrl(0.1, l1_regularization_strength=0.01), None),
    (lambda: sparseopt.updaters.RowwiseAdagrad(0.1), "int8"),  # (its write buffer too)
], ids=["RowwiseAdagrad", "Adam-weight_decay", "Ftrl-l1", "RowwiseAdagrad-int8"])
def test_one_pass_trains_as_the_chunked_loop(monkeypatch, updater, dtype):
    table, state, looped, touched = _train(monkeypatch, True, updater(), dtype)
    table1, state1, one_pass, _ = _train(monkeypatch, False, updater(), dtype)
    untouched = np.setdiff1d(np.arange(VOCAB), touched)
    np.testing.assert_array_equal(table1[untouched], table[untouched])
    np.testing.assert_allclose(table1, table, rtol=2e-6, atol=1e-8)
    assert state1.keys() == state.keys()
    for name in state:
        np.testing.assert_array_equal(state1[name][untouched], state[name][untouched])
        np.testing.assert_allclose(state1[name], state[name], rtol=2e-6, atol=1e-8,
                                   err_msg=name)
    assert "while" in looped  # the loop is there to remove...
    assert "while" not in one_pass  # ...and on a GPU it is gone
