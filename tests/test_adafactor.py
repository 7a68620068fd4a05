"""Adafactor's dense form (`lazy=False`) against Keras' own `keras.optimizers.Adafactor`.

The lazy form (statistics over the step's rows) is checked against its NumPy
reference with every other updater (`tests/test_update_rules.py`). Here the
dense form runs on a table where most rows miss most steps, next to Keras'
optimizer on the same table as a dense variable with the dense gradient
(zero on the rows a batch did not touch).
"""

import keras
import numpy as np
import pytest

import sparseopt
from tests.conftest import to_np
from tests.helpers import batches, dot_loss, kinds_by_backend, table_model

VOCAB, N_IDS, BATCH, STEPS = 60, 3, 4, 30
SCHEDULE = keras.optimizers.schedules.ExponentialDecay(0.5, 10, 0.5)


def keras_dense(make, table0, xs, ys, flat=False):
    """Keras' optimizer on the whole table with the dense `dot_loss` gradient."""
    var = keras.Variable(table0.reshape(-1) if flat else table0)
    optimizer = make()
    optimizer.build([var])
    for x, y in zip(xs, ys):
        grad = np.zeros(table0.shape, np.float32)
        np.add.at(grad, x.reshape(-1), y.reshape(-1, table0.shape[1]) / x.shape[0])
        optimizer.apply([keras.ops.convert_to_tensor(grad.reshape(var.shape))], [var])
    return to_np(var).reshape(table0.shape)


CASES = {
    # (Keras optimizer, width): the default; update clipping that bites; a
    # learning-rate schedule; a one-column table (Keras' unfactored form is for
    # 1-D variables: the table as one).
    "default": (lambda: keras.optimizers.Adafactor(0.5), 4),
    "clipped": (lambda: keras.optimizers.Adafactor(0.5, clip_threshold=0.05, epsilon_2=0.1,
                                                   beta_2_decay=-0.6), 4),
    "schedule": (lambda: keras.optimizers.Adafactor(SCHEDULE), 4),
    "unfactored": (lambda: keras.optimizers.Adafactor(0.5, epsilon_1=1e-6), 1),
}


@pytest.mark.parametrize("case", kinds_by_backend(sorted(CASES), sorted(CASES), ["clipped"]))
def test_dense_adafactor_is_keras_adafactor_on_the_whole_table(case):
    make, width = CASES[case]
    rng = np.random.default_rng(6)
    # Ids from the first 40 rows (20 rows are never touched), few per step.
    xs, ys = batches(rng, STEPS, BATCH, N_IDS, VOCAB, width, dup_vocab=40)
    if case == "unfactored":
        updater = sparseopt.updaters.Adafactor(0.5, epsilon_1=1e-6, factored=False, lazy=False)
    else:
        updater = sparseopt.updaters.from_keras_optimizer(make())
        assert not updater.lazy and updater.factored
    model, emb = table_model(VOCAB, width, N_IDS, updater)
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.1)),
                  loss=dot_loss)
    table0 = to_np(emb.embeddings).copy()
    model.fit(xs.reshape(-1, N_IDS), ys.reshape(-1, N_IDS, width), batch_size=BATCH,
              shuffle=False, verbose=0)
    want = keras_dense(make, table0, xs, ys, flat=case == "unfactored")
    got = to_np(emb.embeddings)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    moved = np.abs(want - table0).max(axis=1) > 0
    assert moved[:40].mean() > 0.8 and not moved[40:].any()
    lazy = sparseopt.updaters.Adafactor(0.5)  # statistics over the step's rows: not Keras'
    model, emb = table_model(VOCAB, width, N_IDS, lazy)
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.1)),
                  loss=dot_loss)
    emb.embeddings.assign(table0)
    model.fit(xs.reshape(-1, N_IDS), ys.reshape(-1, N_IDS, width), batch_size=BATCH,
              shuffle=False, verbose=0)
    assert np.abs(to_np(emb.embeddings) - want).max() > 1e-3


def test_dense_adafactor_converts_both_ways_and_refuses_what_it_cannot_follow():
    updater = sparseopt.updaters.from_keras_optimizer(
        keras.optimizers.Adafactor(0.01, beta_2_decay=-0.7, epsilon_1=1e-20, epsilon_2=1e-2,
                                   clip_threshold=2.0))
    again = sparseopt.updaters.to_keras_optimizer(updater)
    assert isinstance(again, keras.optimizers.Adafactor)
    for key in ("beta_2_decay", "epsilon_1", "epsilon_2", "clip_threshold"):
        assert again.get_config()[key] == pytest.approx(getattr(updater, key))
    with pytest.raises(ValueError, match="lazy=True.*statistics are over the step's rows"):
        sparseopt.updaters.to_keras_optimizer(sparseopt.updaters.Adafactor(0.1))
    with pytest.raises(ValueError, match=r"lazy=False\) with \['weight_decay'\]"):
        sparseopt.updaters.Adafactor(0.1, lazy=False, weight_decay=0.1)
    with pytest.raises(ValueError, match=r"lazy=False\) with \['max_norm'\]"):
        sparseopt.updaters.Adafactor(0.1, lazy=False, max_norm=1.0)
    with pytest.raises(ValueError, match="lazy=False\\) with beta_1 > 0"):
        sparseopt.updaters.Adafactor(0.1, lazy=False, beta_1=0.9)


def test_dense_adafactor_is_refused_on_an_open_vocabulary():
    ids = keras.Input((N_IDS,), dtype="int32")
    layer = sparseopt.layers.DynamicEmbedding(
        16, 4, sparseopt.updaters.Adafactor(0.1, lazy=False), name="dyn")
    model = keras.Model(ids, layer(ids))
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.1)),
                  loss=dot_loss)
    with pytest.raises(ValueError, match="'dyn/embeddings'.*Adafactor\\(lazy=False\\).*"
                                         "open vocabulary.*lazy=True"):
        model.optimizer.build(model.trainable_variables)
