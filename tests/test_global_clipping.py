"""`global_clipnorm`: one norm over the dense gradients and every table's summed rows.

The reference is Keras itself: the same model with a dense-gradient embedding
(one-hot matmul) trained by one Keras SGD with `global_clipnorm`. Its table
gradient is the dense `[V, D]` array whose norm `DispatchOptimizer` must
reproduce from the deduplicated rows alone.
"""

import keras
import numpy as np
import pytest

import sparseopt
from tests.conftest import to_np
from tests.helpers import OneHotEmbedding

VOCAB, WIDTH, N_IDS, BATCH, STEPS, LR, CLIP = 30, 4, 5, 8, 4, 0.5, 0.05


def _model(embedding, pooled=False):
    ids = keras.Input((N_IDS,), dtype="int32")
    x = embedding(ids)
    x = x if pooled else keras.layers.Flatten()(x)
    x = keras.layers.Dense(3, activation="tanh", name="hidden")(x)
    return keras.Model(ids, keras.layers.Dense(1, name="out")(x))


def _data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 12, size=(STEPS * BATCH, N_IDS)).astype("int32")  # many duplicates
    return x, rng.normal(size=(STEPS * BATCH, 1)).astype("float32") * 5


def _named(model):
    """`{"layer/weight": variable}` of the model's trainable weights."""
    return {"/".join(v.path.split("/")[-2:]): v for v in model.trainable_variables if v.ndim}


def _reference(x, y, pooled=False):
    """Keras: a dense-gradient embedding, one SGD with `global_clipnorm` for everything.

    Returns its initial and final weights."""
    keras.utils.set_random_seed(1)
    emb = OneHotEmbedding(VOCAB, WIDTH, name="emb")
    if pooled:
        class Pool(keras.layers.Layer):
            def __init__(self, inner, **kwargs):
                super().__init__(**kwargs)
                self.inner = inner

            def call(self, ids):
                return keras.ops.sum(self.inner(ids), axis=1)

        model = _model(Pool(emb), pooled=True)
    else:
        model = _model(emb)
    model.compile(optimizer=keras.optimizers.SGD(LR, global_clipnorm=CLIP), loss="mse")
    model(x[:1])  # built
    start = {k: to_np(v) for k, v in _named(model).items()}
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    return start, {k: to_np(v) for k, v in _named(model).items()}


def _sparse(x, y, make_optimizer, start, pooled=False):
    """The same model with a `SparseEmbedding` (SGD at the same rate), from `start`."""
    emb = sparseopt.layers.SparseEmbedding(VOCAB, WIDTH, updater=sparseopt.updaters.SGD(LR),
                                           combiner="sum" if pooled else None, name="emb")
    model = _model(emb, pooled)
    for key, variable in _named(model).items():
        variable.assign(start[key])
    model.compile(optimizer=make_optimizer(), loss="mse")
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    return {k: to_np(v) for k, v in _named(model).items()}


def _with(optimizer, **attributes):
    for name, value in attributes.items():
        setattr(optimizer, name, value)
    return optimizer


WAYS = {
    "argument": lambda: sparseopt.DispatchOptimizer(keras.optimizers.SGD(LR),
                                                    global_clipnorm=CLIP),
    "wrapped": lambda: sparseopt.DispatchOptimizer(keras.optimizers.SGD(LR,
                                                                        global_clipnorm=CLIP)),
    # Set between compile and fit (Keras builds the optimizer inside `fit`).
    "set_before_build": lambda: _with(sparseopt.DispatchOptimizer(keras.optimizers.SGD(LR)),
                                      global_clipnorm=CLIP),
    "loss_scaled": lambda: keras.optimizers.LossScaleOptimizer(
        sparseopt.DispatchOptimizer(keras.optimizers.SGD(LR), global_clipnorm=CLIP),
        initial_scale=64.0),
}


@pytest.mark.parametrize("way", sorted(WAYS))
def test_one_norm_over_dense_and_table_gradients_equals_keras(way):
    x, y = _data()
    start, want = _reference(x, y)
    got = _sparse(x, y, WAYS[way], start)
    unclipped = _sparse(x, y, lambda: sparseopt.DispatchOptimizer(keras.optimizers.SGD(LR)),
                        start)
    assert not np.allclose(unclipped["emb/embeddings"], want["emb/embeddings"], atol=1e-4)
    assert sorted(got) == sorted(want)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-4, atol=1e-6, err_msg=key)


def test_pooled_lookups_are_clipped_by_their_summed_rows():
    x, y = _data(1)
    start, want = _reference(x, y, pooled=True)
    got = _sparse(x, y, WAYS["argument"], start, pooled=True)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-4, atol=1e-6, err_msg=key)


def test_grouped_tables_are_clipped_as_tables_alone():
    x, y = _data(2)

    def run(group):
        keras.utils.set_random_seed(1)
        ids = keras.Input((N_IDS,), dtype="int32")
        parts = [sparseopt.layers.SparseEmbedding(VOCAB, WIDTH, name=f"emb{i}",
                                                  updater=sparseopt.updaters.Adagrad(LR))(ids)
                 for i in range(2)]
        out = keras.layers.Dense(1)(keras.layers.Flatten()(keras.layers.Concatenate()(parts)))
        model = keras.Model(ids, out)
        model.compile(optimizer=sparseopt.DispatchOptimizer(
            keras.optimizers.SGD(LR), global_clipnorm=CLIP, group_tables=group), loss="mse")
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
        assert model.optimizer.table_groups == ([["emb0/embeddings", "emb1/embeddings"]]
                                                if group else [])
        return [to_np(v) for v in model.trainable_variables if v.ndim]

    for a, b in zip(run(True), run(False)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_the_setting_round_trips_and_conflicts_are_refused():
    optimizer = WAYS["wrapped"]()
    assert optimizer.global_clipnorm == CLIP and optimizer.optimizer.global_clipnorm is None
    again = sparseopt.DispatchOptimizer.from_config(optimizer.get_config())
    assert again.global_clipnorm == CLIP
    with pytest.raises(ValueError, match="global_clipnorm=1.0 and the wrapped.*0.05 differ"):
        sparseopt.DispatchOptimizer(keras.optimizers.SGD(global_clipnorm=CLIP),
                                    global_clipnorm=1.0)


def test_a_global_clipnorm_set_once_built_is_refused_not_ignored():
    x, y = _data(3)
    model = _model(sparseopt.layers.SparseEmbedding(VOCAB, WIDTH, sparseopt.updaters.SGD(LR)))
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD(LR)), loss="mse")
    model.fit(x, y, batch_size=BATCH, verbose=0)
    with pytest.raises(ValueError, match="`global_clipnorm` cannot change once the optimizer"):
        model.optimizer.global_clipnorm = CLIP
    assert model.optimizer.global_clipnorm is None
