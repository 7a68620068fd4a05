"""keras-rs `DistributedEmbedding` on CPU: each table trained by its TableConfig.optimizer.

The reference trains the same architecture densely: a one-hot matmul table per
feature, given to Keras' own Adagrad / SGD through `optimizer_map`. For these
two rules a zero gradient leaves a row and its state unchanged, so dense Keras
training equals exact sparse training.
"""

import keras
import keras_rs
import numpy as np
import pytest
from keras import ops

import sparseopt
from tests.conftest import to_np
from tests.helpers import optimizer_state

BATCH, WIDTH = 8, 4


def rs_model(tables, bags):
    """A DistributedEmbedding with one feature per table, then a Dense head."""
    features, inputs = {}, {}
    for name, table in tables.items():
        features[name] = keras_rs.layers.FeatureConfig(
            name=name, table=table, input_shape=(BATCH, bags[name]),
            output_shape=(BATCH, WIDTH))
        inputs[name] = keras.Input((bags[name],), dtype="int32", name=name)
    emb = keras_rs.layers.DistributedEmbedding(features, name="de")
    out = emb(inputs)
    x = keras.layers.Concatenate()([out[name] for name in tables])
    model = keras.Model(inputs, keras.layers.Dense(1, name="head")(x))
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.Adam(0.01)),
                  loss="mse")
    return model, emb


class DenseBag(keras.layers.Layer):
    """Reference: `combiner(one_hot(ids) @ table)`, a dense gradient for any optimizer."""

    def __init__(self, vocab, combiner, **kwargs):
        super().__init__(**kwargs)
        self.vocab, self.combiner = vocab, combiner

    def build(self, input_shape):
        self.table = self.add_weight(shape=(self.vocab, WIDTH), name="table")

    def call(self, ids):
        rows = ops.matmul(ops.one_hot(ids, self.vocab), self.table)
        return ops.mean(rows, axis=1) if self.combiner == "mean" else ops.sum(rows, axis=1)


def data(vocabs, bags, steps, seed=0, touched=None):
    rng = np.random.default_rng(seed)
    x = {n: rng.integers(0, touched or v, size=(steps * BATCH, bags[n])).astype("int32")
         for n, v in vocabs.items()}
    return x, rng.normal(size=(steps * BATCH, 1)).astype("float32")


def test_tables_follow_their_table_config_optimizer_and_match_dense_keras():
    tables = {
        "user": keras_rs.layers.TableConfig(
            name="user", vocabulary_size=60, embedding_dim=WIDTH, combiner="mean",
            optimizer=keras.optimizers.Adagrad(0.1, initial_accumulator_value=0.2)),
        "item": keras_rs.layers.TableConfig(
            name="item", vocabulary_size=40, embedding_dim=WIDTH, combiner="sum",
            optimizer=keras.optimizers.SGD(0.2)),
    }
    bags = {"user": 3, "item": 2}
    model, emb = rs_model(tables, bags)
    start = {n: to_np(t) for n, t in emb.get_embedding_tables().items()}

    inputs = {n: keras.Input((bags[n],), dtype="int32", name=n) for n in tables}
    ref_bags = {n: DenseBag(t.vocabulary_size, t.combiner, name=f"ref_{n}")
                for n, t in tables.items()}
    x = keras.layers.Concatenate()([ref_bags[n](inputs[n]) for n in tables])
    ref = keras.Model(inputs, keras.layers.Dense(1, name="ref_head")(x))
    ref.compile(loss="mse", optimizer=sparseopt.DispatchOptimizer(
        keras.optimizers.Adam(0.01), optimizer_map={
            "ref_user/table": keras.optimizers.Adagrad(0.1, initial_accumulator_value=0.2),
            "ref_item/table": keras.optimizers.SGD(0.2)}))
    for n in tables:
        ref_bags[n].table.assign(start[n])
    for a, b in zip(ref.get_layer("ref_head").weights, model.get_layer("head").weights):
        a.assign(to_np(b))  # a copy: JAX's fit donates (deletes) the buffers it is given

    xs, ys = data({n: t.vocabulary_size for n, t in tables.items()}, bags, steps=6)
    model.fit(xs, ys, batch_size=BATCH, shuffle=False, verbose=0)
    ref.fit(xs, ys, batch_size=BATCH, shuffle=False, verbose=0)

    got = {n: to_np(t) for n, t in emb.get_embedding_tables().items()}
    for n in tables:
        np.testing.assert_allclose(got[n], to_np(ref_bags[n].table), rtol=1e-5, atol=1e-6)
        untouched = np.setdiff1d(np.arange(tables[n].vocabulary_size), xs[n])
        np.testing.assert_array_equal(got[n][untouched], start[n][untouched])
    for a, b in zip(ref.get_layer("ref_head").weights, model.get_layer("head").weights):
        np.testing.assert_allclose(to_np(b), to_np(a), rtol=1e-5, atol=1e-6)
    # Adam holds slots for the head only; the tables' state is their updaters'.
    adam = model.optimizer.optimizer
    assert all(len(v.shape) == 0 or v.shape[0] in (2 * WIDTH, 1) for v in adam.variables)
    saved = {id(v) for v in optimizer_state(model.optimizer)}
    trainers = model.optimizer.table_trainers
    assert set(trainers["de/user/embeddings"].state()) == {"accumulator"}
    assert all(id(v) in saved for v in trainers["de/user/embeddings"].state().values())
    assert trainers["de/item/embeddings"].state() == {}  # SGD: none


def test_ftrl_table_leaves_untouched_rows_and_their_state_alone():
    table = keras_rs.layers.TableConfig(
        name="ctx", vocabulary_size=1000, embedding_dim=WIDTH,
        optimizer=keras.optimizers.Ftrl(0.1, l1_regularization_strength=0.01))
    model, emb = rs_model({"ctx": table}, {"ctx": 2})
    start = to_np(emb.get_embedding_tables()["ctx"])
    xs, ys = data({"ctx": 1000}, {"ctx": 2}, steps=4, touched=50)
    model.fit(xs, ys, batch_size=BATCH, verbose=0)
    got = to_np(emb.get_embedding_tables()["ctx"])
    assert not np.array_equal(got[:50], start[:50])
    np.testing.assert_array_equal(got[50:], start[50:])
    slots = {k: to_np(v) for k, v in model.optimizer.table_state("de/ctx/embeddings").items()}
    np.testing.assert_array_equal(slots["linear"][50:], 0.0)
    np.testing.assert_array_equal(slots["accumulator"][50:], np.float32(0.1))
    assert model.optimizer.skipped_steps() == {"de/ctx/embeddings": 0}


def test_table_config_default_adam_trains_as_lazy_adam_and_matches_dense_keras_adam():
    """keras-rs' default `TableConfig.optimizer` ("adam") trains the table sparsely.

    Every batch holds every id of the table, so no row misses a step and lazy
    Adam equals Keras' dense Adam on the same architecture."""
    table = keras_rs.layers.TableConfig(name="user", vocabulary_size=6, embedding_dim=WIDTH)
    model, emb = rs_model({"user": table}, {"user": 3})
    start = to_np(emb.get_embedding_tables()["user"])
    inputs = {"user": keras.Input((3,), dtype="int32", name="user")}
    bag = DenseBag(6, "mean", name="ref_user")
    ref = keras.Model(inputs, keras.layers.Dense(1, name="ref_head")(bag(inputs["user"])))
    ref.compile(loss="mse", optimizer=sparseopt.DispatchOptimizer(
        keras.optimizers.Adam(0.01), optimizer_map={"ref_user/table": keras.optimizers.Adam()}))
    bag.table.assign(start)
    for a, b in zip(ref.get_layer("ref_head").weights, model.get_layer("head").weights):
        a.assign(to_np(b))
    xs, ys = data({"user": 6}, {"user": 3}, steps=5)
    xs["user"][0::BATCH] = [0, 1, 2]  # every batch holds every id
    xs["user"][1::BATCH] = [3, 4, 5]
    model.fit(xs, ys, batch_size=BATCH, shuffle=False, verbose=0)
    ref.fit(xs, ys, batch_size=BATCH, shuffle=False, verbose=0)
    np.testing.assert_allclose(to_np(emb.get_embedding_tables()["user"]), to_np(bag.table),
                               rtol=1e-5, atol=1e-6)
    trainer = model.optimizer.table_trainers["de/user/embeddings"]
    assert type(trainer.updater) is sparseopt.updaters.Adam
    assert set(trainer.state()) == {"momentum", "velocity"}


def test_a_saved_keras_rs_model_loads_and_continues_exactly(tmp_path):
    table = keras_rs.layers.TableConfig(
        name="user", vocabulary_size=30, embedding_dim=WIDTH,
        optimizer=keras.optimizers.Adagrad(0.1))
    model, emb = rs_model({"user": table}, {"user": 3})
    xs, ys = data({"user": 30}, {"user": 3}, steps=4)
    first = {k: v[: 2 * BATCH] for k, v in xs.items()}
    model.fit(first, ys[: 2 * BATCH], batch_size=BATCH, shuffle=False, verbose=0)
    path = str(tmp_path / "rs.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    rest = {k: v[2 * BATCH:] for k, v in xs.items()}
    for m in (model, loaded):
        m.fit(rest, ys[2 * BATCH:], batch_size=BATCH, shuffle=False, verbose=0)
    for a, b in zip(optimizer_state(model.optimizer), optimizer_state(loaded.optimizer)):
        np.testing.assert_array_equal(to_np(a), to_np(b))
    np.testing.assert_array_equal(
        to_np(loaded.get_layer("de").get_embedding_tables()["user"]),
        to_np(emb.get_embedding_tables()["user"]))


def train_one_table(table_optimizer, optimizer, vocab=40, bag=3, seed=3):
    """3 steps of a one-table keras-rs model compiled with `optimizer`; the trained table."""
    keras.utils.set_random_seed(seed)
    table = keras_rs.layers.TableConfig(name="t", vocabulary_size=vocab, embedding_dim=WIDTH,
                                        optimizer=table_optimizer)
    model, emb = rs_model({"t": table}, {"t": bag})
    model.compile(optimizer=optimizer, loss="mse")
    xs, ys = data({"t": vocab}, {"t": bag}, steps=3)
    model.fit(xs, ys, batch_size=BATCH, shuffle=False, verbose=0)
    return model, to_np(emb.get_embedding_tables()["t"])


@pytest.mark.parametrize("how", ["loss_scale_optimizer", "loss_scale_factor"])
def test_fallback_tables_see_the_unscaled_gradient_under_loss_scaling(how):
    adagrad = keras.optimizers.Adagrad(0.1)
    _, plain = train_one_table(adagrad, sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.1)))
    if how == "loss_scale_optimizer":
        optimizer = keras.optimizers.LossScaleOptimizer(
            sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.1)), initial_scale=2.0**10)
    else:
        optimizer = sparseopt.DispatchOptimizer(
            keras.optimizers.SGD(0.1, loss_scale_factor=64.0))
    _, scaled = train_one_table(adagrad, optimizer)
    np.testing.assert_allclose(scaled, plain, rtol=1e-5, atol=1e-6)


def test_optimizer_map_can_hand_a_small_table_to_a_dense_keras_optimizer():
    """The documented escape hatch for tiny tables. SGD: on TF, Keras' optimizers get
    IndexedSlices and apply duplicate ids one by one, which only SGD makes exact."""
    def train(optimizer_map):
        return train_one_table(keras.optimizers.SGD(0.1), sparseopt.DispatchOptimizer(
            keras.optimizers.Adam(0.01), optimizer_map=optimizer_map), vocab=12, bag=2, seed=5)

    sparse_model, sparse = train(None)
    dense_model, dense = train({"de/t/embeddings": keras.optimizers.SGD(0.1)})
    np.testing.assert_allclose(dense, sparse, rtol=1e-5, atol=1e-6)
    assert sparse_model.optimizer.skipped_steps() == {"de/t/embeddings": 0}
    assert dense_model.optimizer.skipped_steps() == {}  # not a sparse table there


def test_tables_keep_the_dtype_keras_rs_creates_and_state_is_float32():
    """keras-rs 0.4 creates its default-device tables in float32 whatever the layer's
    dtype policy; sparseopt keeps each table as created (and state in float32)."""
    table = keras_rs.layers.TableConfig(name="t", vocabulary_size=30, embedding_dim=WIDTH,
                                        optimizer=keras.optimizers.Adagrad(0.1))
    feature = keras_rs.layers.FeatureConfig(name="f", table=table, input_shape=(BATCH, 2),
                                            output_shape=(BATCH, WIDTH))
    ids = keras.Input((2,), dtype="int32", name="f")
    emb = keras_rs.layers.DistributedEmbedding({"f": feature}, dtype="bfloat16")
    model = keras.Model({"f": ids}, keras.layers.Dense(1)(emb({"f": ids})["f"]))
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.Adam()), loss="mse")
    created = {v.path: v.dtype for v in emb.weights if v.path.endswith("/embeddings")}
    assert created == {"distributed_embedding/t/embeddings": "float32"}
    x, y = data({"f": 30}, {"f": 2}, steps=2)
    model.fit(x, y, batch_size=BATCH, verbose=0)
    assert {v.path: v.dtype for v in emb.weights if v.path in created} == created
    assert sorted(model.optimizer.table_trainers) == sorted(created)
    for path in created:
        state = model.optimizer.table_state(path)
        assert {k: v.dtype for k, v in state.items()} == {"accumulator": "float32"}
