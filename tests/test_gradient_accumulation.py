"""`gradient_accumulation_steps=k`: the mean gradient of k micro-batches, applied once.

References: Keras' own accumulation on the same model with a dense-gradient
embedding (one-hot matmul), and the NumPy reference of each rule applied to
the k micro-batches' rows together (their gradients divided by k).
"""

import keras
import numpy as np
import pytest

import sparseopt
from tests import reference
from tests.conftest import to_np
from tests.helpers import (OneHotEmbedding, batches, dot_loss, kinds, optimizer_state,
                           registered_cases, table_model)

VOCAB, WIDTH, N_IDS, BATCH, K = 30, 4, 3, 4, 3


def _table_reference(name, cfg, table0, xs, ys, steps=K, lr=0.05):
    """The rule on each update's k micro-batches together, at the mean gradient."""
    table = np.asarray(table0, np.float64)
    state = reference.initial_state(name, table.shape, cfg)
    for u in range(len(xs) // steps):
        x = np.concatenate(list(xs[u * steps:(u + 1) * steps]))
        y = np.concatenate(list(ys[u * steps:(u + 1) * steps])) / BATCH / steps
        table, state = reference.sparse_step(name, table, state, x, y, lr, cfg, step=u + 1)
    return table


CASES = registered_cases(paths_only=True)


# One of each kind: TF's fused kernels (plain, momentum), a rule, a rule with an
# integer slot; `make test-all`: every updater on each of its paths.
@pytest.mark.parametrize("case", kinds(sorted(CASES), [
    "Ftrl:default", "Adam:default", "FrequencyAwareAdagrad:default", "SGD:momentum"]))
def test_every_updater_applies_the_mean_of_k_micro_batches_once(case):
    entry, cfg = CASES[case]
    model, emb = table_model(VOCAB, WIDTH, N_IDS, entry(0.05, **cfg))
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.1),
                                                        gradient_accumulation_steps=K),
                  loss=dot_loss)
    xs, ys = batches(np.random.default_rng(1), 2 * K, BATCH, N_IDS, VOCAB, WIDTH)
    table0 = to_np(emb.embeddings)
    for i, (x, y) in enumerate(zip(xs, ys)):
        model.train_on_batch(x, y)
        if i == K - 2:  # the update waits for the k-th micro-batch
            np.testing.assert_array_equal(to_np(emb.embeddings), table0)
    assert int(to_np(model.optimizer.iterations)) == 2
    want = _table_reference(entry.__name__, cfg, table0, xs, ys)
    np.testing.assert_allclose(to_np(emb.embeddings), want, rtol=5e-5, atol=2e-6)


def _dense_reference_pair(x, y, clip=None, pooled=False):
    """(sparseopt model, Keras reference model) with equal weights; SGD everywhere."""
    def build(embedding):
        ids = keras.Input((N_IDS,), dtype="int32")
        h = embedding(ids)
        h = keras.ops.sum(h, axis=1) if pooled and not isinstance(
            embedding, sparseopt.layers.SparseEmbedding) else h
        h = h if pooled else keras.layers.Flatten()(h)
        out = keras.layers.Dense(1, name="out")(keras.layers.Dense(3, activation="tanh",
                                                                   name="hidden")(h))
        return keras.Model(ids, out)

    ref = build(OneHotEmbedding(VOCAB, WIDTH, name="emb"))
    ref.compile(optimizer=keras.optimizers.SGD(0.3, global_clipnorm=clip,
                                               gradient_accumulation_steps=K), loss="mse")
    ours = build(sparseopt.layers.SparseEmbedding(
        VOCAB, WIDTH, updater=sparseopt.updaters.SGD(0.3), name="emb",
        combiner="sum" if pooled else None))
    ours.compile(optimizer=sparseopt.DispatchOptimizer(
        keras.optimizers.SGD(0.3, gradient_accumulation_steps=K), global_clipnorm=clip),
        loss="mse")
    for name in ("emb", "hidden", "out"):
        for a, b in zip(ours.get_layer(name).weights, ref.get_layer(name).weights):
            a.assign(to_np(b))
    return ours, ref


@pytest.mark.parametrize("how", ["plain", "pooled", "global_clipnorm"])
def test_the_model_trains_as_with_keras_dense_accumulation(how):
    rng = np.random.default_rng(2)
    x = rng.integers(0, 10, size=(4 * K * BATCH, N_IDS)).astype("int32")
    y = rng.normal(size=(4 * K * BATCH, 1)).astype("float32") * 3
    ours, ref = _dense_reference_pair(x, y, clip=0.05 if how == "global_clipnorm" else None,
                                      pooled=how == "pooled")
    for m in (ours, ref):
        m.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    for name in ("emb", "hidden", "out"):
        for a, b in zip(ours.get_layer(name).weights, ref.get_layer(name).weights):
            if a.ndim:
                np.testing.assert_allclose(to_np(a), to_np(b), rtol=1e-4, atol=1e-6,
                                           err_msg=a.path)
    assert ours.optimizer.optimizer.gradient_accumulation_steps is None  # moved
    assert ours.optimizer.gradient_accumulation_steps == K


def test_loss_scaling_and_skipped_micro_steps_keep_working():
    xs, ys = batches(np.random.default_rng(3), 2 * K, BATCH, N_IDS, VOCAB, WIDTH)

    def run(scaled, bad):
        keras.backend.clear_session(free_memory=False)
        keras.utils.set_random_seed(0)
        model, emb = table_model(VOCAB, WIDTH, N_IDS, sparseopt.updaters.Adagrad(0.05))
        optimizer = sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.1),
                                                gradient_accumulation_steps=K)
        if scaled:
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer, initial_scale=2.0**10)
        model.compile(optimizer=optimizer, loss=dot_loss)
        for i, (x, y) in enumerate(zip(xs, ys)):
            if bad and i == 1:  # an overflowing micro-batch: skipped, not counted
                model.train_on_batch(x, np.full_like(y, np.inf))
            model.train_on_batch(x, y)
        return to_np(emb.embeddings), model

    plain, _ = run(False, False)
    scaled, model = run(True, True)
    np.testing.assert_allclose(scaled, plain, rtol=1e-5, atol=1e-7)
    assert int(to_np(model.optimizer.iterations)) == 2
    assert float(to_np(model.optimizer.dynamic_scale)) == 2.0**9


def test_a_save_in_the_middle_of_an_accumulation_resumes_bit_for_bit(tmp_path):
    xs, ys = batches(np.random.default_rng(4), 2 * K, BATCH, N_IDS, VOCAB, WIDTH)
    model, emb = table_model(VOCAB, WIDTH, N_IDS, sparseopt.updaters.Adam(0.05))
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.Adam(0.1),
                                                        gradient_accumulation_steps=K),
                  loss=dot_loss)
    for x, y in zip(xs[:K + 1], ys[:K + 1]):  # one update and one micro-batch more
        model.train_on_batch(x, y)
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    for m in (model, loaded):
        for x, y in zip(xs[K + 1:], ys[K + 1:]):
            m.train_on_batch(x, y)
    np.testing.assert_array_equal(to_np(loaded.get_layer("emb").embeddings),
                                  to_np(emb.embeddings))
    for a, b in zip(optimizer_state(loaded.optimizer), optimizer_state(model.optimizer)):
        np.testing.assert_array_equal(to_np(a), to_np(b), err_msg=a.path)


def test_buffers_follow_the_ids_not_the_vocabulary():
    model, emb = table_model(100_000, WIDTH, N_IDS, sparseopt.updaters.SGD(0.1))
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD(),
                                                        gradient_accumulation_steps=K),
                  loss=dot_loss)
    model.train_on_batch(np.zeros((BATCH, N_IDS), "int32"),
                         np.zeros((BATCH, N_IDS, WIDTH), "float32"))
    shapes = sorted(tuple(v.shape) for v in model.optimizer.state_variables()
                    if "accumulated" in v.path)
    assert shapes == [(K * BATCH * N_IDS,), (K * BATCH * N_IDS, WIDTH)]


def test_a_larger_batch_than_the_buffers_hold_is_refused_naming_the_table():
    model, _ = table_model(VOCAB, WIDTH, N_IDS, sparseopt.updaters.SGD(0.1))
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD(),
                                                        gradient_accumulation_steps=K),
                  loss=dot_loss)
    model.train_on_batch(np.zeros((BATCH, N_IDS), "int32"),
                         np.zeros((BATCH, N_IDS, WIDTH), "float32"))
    with pytest.raises((ValueError, Exception), match="emb/embeddings"):
        model.train_on_batch(np.zeros((2 * BATCH, N_IDS), "int32"),
                             np.zeros((2 * BATCH, N_IDS, WIDTH), "float32"))


def test_accumulation_on_an_optimizer_map_optimizer_is_refused_with_the_fix():
    model, _ = table_model(VOCAB, WIDTH, N_IDS, sparseopt.updaters.SGD(0.1))
    optimizer = sparseopt.DispatchOptimizer(
        keras.optimizers.SGD(),
        optimizer_map={"nothing/.*": keras.optimizers.SGD(gradient_accumulation_steps=2)})
    with pytest.raises(ValueError, match="Set it on the DispatchOptimizer"):
        optimizer.build(model.trainable_variables)
