"""A model's weights are the same with or without sparseopt.

keras-rs models: every weight list and weights file is keras-rs' own at every
point of the model's life (built, compiled, optimizer built, trained), and
files load both ways. `SparseEmbedding`: it saves what `keras.layers.Embedding`
saves, so an Embedding model's checkpoint moves over; its weight list is
Embedding's too, but for the lookup's probe on TensorFlow (whose train step
differentiates weights only). The references are the same models without
sparseopt.
"""

import h5py
import keras
import keras_rs
import numpy as np
import pytest

import sparseopt
from tests.conftest import to_np

BATCH, WIDTH, BAG = 8, 4, 3
# Two tables with different optimizers, and one table shared by two features.
TABLES = {"user": (30, keras.optimizers.Adagrad(0.1)), "item": (20, keras.optimizers.SGD(0.2))}
FEATURES = {"user": "user", "item": "item", "item_seen": "item"}


def rs_model(features):
    keras.utils.set_random_seed(7)
    tables = {name: keras_rs.layers.TableConfig(
        name=name, vocabulary_size=vocab, embedding_dim=WIDTH, optimizer=opt)
        for name, (vocab, opt) in TABLES.items()}
    configs = {f: keras_rs.layers.FeatureConfig(
        name=f, table=tables[t], input_shape=(BATCH, BAG), output_shape=(BATCH, WIDTH))
        for f, t in features.items()}
    inputs = {f: keras.Input((BAG,), dtype="int32", name=f) for f in features}
    out = keras_rs.layers.DistributedEmbedding(configs, name="de")(inputs)
    x = out[next(iter(features))] if len(features) == 1 else keras.layers.Concatenate()(
        [out[f] for f in features])
    return keras.Model(inputs, keras.layers.Dense(1, name="head")(x))


def rs_data(features, steps=2):
    rng = np.random.default_rng(1)
    x = {f: rng.integers(0, TABLES[t][0], size=(steps * BATCH, BAG)).astype("int32")
         for f, t in features.items()}
    return x, rng.normal(size=(steps * BATCH, 1)).astype("float32")


def file_layout(path):
    """`{entry: shape}` of a weights file's model weights (its optimizer part left out)."""
    out = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: out.update({name: obj.shape})
                     if isinstance(obj, h5py.Dataset) and not name.startswith("optimizer")
                     else None)
    return out


def without_probes(model):
    """The model's weights but the lookups' probes (weights on TensorFlow only)."""
    return [v for v in model.weights if getattr(v, "_sparseopt_probe_of", None) is None]


def assert_same_weights(a, b):
    wa, wb = [to_np(v) for v in without_probes(a)], [to_np(v) for v in without_probes(b)]
    assert [w.shape for w in wa] == [w.shape for w in wb]
    for x, y in zip(wa, wb):
        np.testing.assert_array_equal(x, y)


def advance(model, stage, features):
    """Brings a sparseopt keras-rs model to `stage` of its life."""
    if stage == "compiled":
        model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.Adam(0.01)),
                      loss="mse")
    elif stage == "optimizer built":
        model.optimizer.build(model.trainable_variables)
    elif stage == "trained":
        model.fit(*rs_data(features), batch_size=BATCH, shuffle=False, verbose=0)


@pytest.mark.parametrize("features", [{"user": "user"}, FEATURES], ids=["one table", "tables"])
def test_keras_rs_weights_and_files_are_keras_rs_own_at_every_stage(tmp_path, features):
    ours, plain = rs_model(features), rs_model(features)
    plain_file = str(tmp_path / "plain.weights.h5")
    plain.save_weights(plain_file)
    layout = file_layout(plain_file)
    # The tables' entries are keras-rs' `embed_reduce*` (the reference layout).
    assert sum("embed_reduce" in k for k in layout) == len(set(features.values()))
    for stage in ("built", "compiled", "optimizer built", "trained"):
        advance(ours, stage, features)
        assert [(w.path, w.shape) for w in ours.weights] == [
            (w.path, w.shape) for w in plain.weights], stage
        # sparseopt -> plain: file, then weight list.
        path = str(tmp_path / f"ours-{stage}.weights.h5")
        ours.save_weights(path)
        assert file_layout(path) == layout, stage
        plain.load_weights(path)
        assert_same_weights(ours, plain)
        # plain -> sparseopt, with new values.
        plain.set_weights([w + 1.0 for w in plain.get_weights()])
        plain.save_weights(plain_file)
        ours.load_weights(plain_file)
        assert_same_weights(ours, plain)
        ours.set_weights([w * 0.5 for w in plain.get_weights()])
        plain.set_weights(ours.get_weights())
        assert_same_weights(ours, plain)
    # The optimizer part of a .keras file holds the tables' state; the model part
    # is keras-rs' own, and the plain model loads it.
    path = str(tmp_path / "ours.keras")
    ours.save(path)
    plain.load_weights(path)
    assert_same_weights(ours, plain)
    loaded = keras.saving.load_model(path)
    assert len(loaded.optimizer.table_trainers) == len(set(features.values()))
    assert_same_weights(loaded, ours)


def embedding_model(cls, subclassed=False):
    """Two tables (one bag each) and a head, built with `cls` for the tables."""
    keras.utils.set_random_seed(2)

    def table(vocab, name):
        if cls is keras.layers.Embedding:
            return keras.layers.Embedding(vocab, WIDTH, name=name)
        return sparseopt.layers.SparseEmbedding(
            vocab, WIDTH, updater=sparseopt.updaters.Adagrad(0.1), name=name)

    if subclassed:
        return TwoTables(table(30, "user"), table(20, "item"))
    ids = keras.Input((2, BAG), dtype="int32", name="ids")
    pooled = [keras.ops.sum(table(v, n)(ids[:, i]), axis=1)
              for i, (v, n) in enumerate([(30, "user"), (20, "item")])]
    x = keras.layers.Concatenate()(pooled)
    return keras.Model(ids, keras.layers.Dense(1, name="head")(x))


class TwoTables(keras.Model):
    def __init__(self, user, item, **kwargs):
        super().__init__(**kwargs)
        self.user, self.item = user, item
        self.head = keras.layers.Dense(1, name="head")

    def call(self, ids):
        pooled = [keras.ops.sum(t(ids[:, i]), axis=1) for i, t in enumerate([self.user, self.item])]
        return self.head(keras.ops.concatenate(pooled, axis=-1))


def embedding_data(steps=2):
    rng = np.random.default_rng(3)
    x = rng.integers(0, 20, size=(steps * BATCH, 2, BAG)).astype("int32")
    return x, rng.normal(size=(steps * BATCH, 1)).astype("float32")


def trained_keras_model(subclassed=False):
    model = embedding_model(keras.layers.Embedding, subclassed)
    model.compile(optimizer="adam", loss="mse")
    model.fit(*embedding_data(), batch_size=BATCH, verbose=0)
    return model


def sparse_model(subclassed=False, compiled=False):
    model = embedding_model(sparseopt.layers.SparseEmbedding, subclassed)
    model(embedding_data(1)[0][:BATCH])  # built
    if compiled:
        model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.Adam(0.01)),
                      loss="mse")
    return model


def test_sparse_embedding_lists_and_saves_what_embedding_does(tmp_path):
    old, new = trained_keras_model(), sparse_model(compiled=True)
    new.fit(*embedding_data(), batch_size=BATCH, verbose=0)
    table = new.get_layer("user")
    # The bookkeeping is state that train steps thread, not a weight; on TF the
    # probe must be a weight (Keras' TF train step differentiates weights only).
    probe = table._lookup.probe
    assert all(v is not table.num_dropped_ids for v in new.weights)
    assert any(v is table.num_dropped_ids for v in new.non_trainable_variables)
    assert any(v is probe for v in new.trainable_variables)
    probes = 2 if sparseopt.backend.PROBE_IS_WEIGHT else 0
    assert len(new.weights) == len(old.weights) + probes
    assert [w.shape for w in without_probes(new)] == [w.shape for w in old.weights]
    assert int(to_np(table.num_dropped_ids)) == 0
    old_file, new_file = str(tmp_path / "old.weights.h5"), str(tmp_path / "new.weights.h5")
    old.save_weights(old_file)
    new.save_weights(new_file)
    # Same entries but for the class name a functional model keys its layers by.
    renamed = {k.replace("sparse_embedding", "embedding"): s
               for k, s in file_layout(new_file).items()}
    assert renamed == file_layout(old_file)
    if not probes:
        new.set_weights(old.get_weights())
        assert_same_weights(new, old)


@pytest.mark.parametrize("suffix,compiled", [(".weights.h5", False), (".keras", True)],
                         ids=["weights.h5-uncompiled", "keras-compiled"])
def test_an_embedding_model_checkpoint_migrates_to_sparse_embedding(tmp_path, suffix, compiled):
    old = trained_keras_model()
    path = str(tmp_path / f"old{suffix}")
    old.save_weights(path) if suffix == ".weights.h5" else old.save(path)
    new = sparse_model(compiled=compiled)
    sparseopt.saving.load_embedding_weights(new, path)
    assert_same_weights(new, old)
    if not compiled:
        new.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.Adam(0.01)),
                    loss="mse")
    before = to_np(new.get_layer("user").embeddings)
    new.fit(*embedding_data(), batch_size=BATCH, verbose=0)
    assert not np.array_equal(to_np(new.get_layer("user").embeddings), before)
    assert set(new.optimizer.table_trainers) == {"user/embeddings", "item/embeddings"}


def test_a_subclassed_model_migrates_too(tmp_path):
    """Keras keys a subclassed model's layers by attribute name or, for those it
    reaches first through `model.layers`, by class name: plain `load_weights` finds
    some tables and refuses; the helper finds all."""
    old = trained_keras_model(subclassed=True)
    path = str(tmp_path / "old.weights.h5")
    old.save_weights(path)
    new = sparse_model(subclassed=True)
    with pytest.raises(ValueError, match="could not be loaded"):
        new.load_weights(path)
    sparseopt.saving.load_embedding_weights(new, path)
    assert_same_weights(new, old)


def test_a_mismatched_migration_is_an_error_not_a_partial_load(tmp_path):
    old = trained_keras_model()
    path = str(tmp_path / "old.weights.h5")
    old.save_weights(path)
    new = sparse_model()
    with pytest.raises(ValueError, match="could not be loaded"):
        new.load_weights(path)  # a functional model needs the helper: refused, not partial
    other = sparseopt.layers.SparseEmbedding(31, WIDTH, sparseopt.updaters.SGD(0.1), name="u")
    ids = keras.Input((2, BAG), dtype="int32")
    pooled = [keras.ops.sum(other(ids[:, 0]), axis=1),
              keras.ops.sum(sparseopt.layers.SparseEmbedding(
                  20, WIDTH, sparseopt.updaters.SGD(0.1), name="i")(ids[:, 1]), axis=1)]
    wrong = keras.Model(ids, keras.layers.Dense(1)(keras.layers.Concatenate()(pooled)))
    with pytest.raises(ValueError, match="could not be loaded|shape"):
        sparseopt.saving.load_embedding_weights(wrong, path)
