"""Each private Keras / TF / keras-rs access in sparseopt.compat still works as relied on.

An upgrade of one of these libraries fails here, by name, before anywhere deep
in a train step.
"""

from importlib.metadata import version

import keras
import numpy as np
import pytest

import sparseopt
from sparseopt import compat


def test_installed_versions_are_the_checked_ones():
    for package, checked in compat.CHECKED.items():
        name = {"keras_rs": "keras-rs", "tensorflow": "tensorflow-cpu"}.get(package, package)
        assert version(name).startswith(checked + "."), (
            f"{name} {version(name)}: re-check sparseopt/compat.py against it, then "
            "update CHECKED")


def test_keras_internals():
    with keras.name_scope("outer"):
        assert compat.current_path() == "outer"
    seen = {}

    class Reader(keras.layers.Layer):
        def build(self, shape):
            self.w = self.add_weight(shape=(2,), initializer="ones")

        def call(self, x):
            seen["autocast"] = keras.backend.standardize_dtype(self.w.value.dtype)
            with compat.read_as_stored():
                seen["stored"] = keras.backend.standardize_dtype(self.w.value.dtype)
            return x

    reader = Reader(dtype="mixed_float16")
    reader(np.zeros((1, 2), "float32"))
    assert seen == {"autocast": "float16", "stored": "float32"}
    assert compat.layout_of(reader.w) is None
    stand_in = compat.variable_stand_in("a/b", (4, 2))
    assert stand_in.path == "a/b" and stand_in.shape == (4, 2)

    emb = keras.layers.Embedding(10, 3)
    emb.build((None,))
    assert compat.embedding_variable(emb) is emb.embeddings
    # State that train steps thread but weight lists and files leave out.
    state = keras.Variable(keras.initializers.Zeros(), shape=(), trainable=True, name="s")
    compat.track_state(emb, state)
    assert [v is state for v in emb.trainable_variables] == [False, True]
    assert all(v is not state for v in emb.weights) and len(emb.get_weights()) == 1
    with compat.saved_as([emb], "Other"):
        assert type(emb).__name__ == "Other" and isinstance(emb, keras.layers.Embedding)
    assert type(emb) is keras.layers.Embedding

    inner = keras.layers.Dense(1, name="inner")
    ids = keras.Input((2,))
    model = keras.Model(ids, keras.Sequential([inner])(ids))
    assert inner in compat.sublayers(model)
    compat.set_initial_epoch(model, 3)
    assert model._initial_epoch == 3


def test_keras_saver_walks_what_dir_lists(tmp_path):
    """`unsaved_attributes`: an attribute left out of `dir` is not saved from there."""
    import h5py

    class Holder(keras.Model):
        def __init__(self):
            super().__init__()
            self.shown, self.hidden = keras.layers.Dense(1), keras.layers.Dense(1)

        def call(self, x):
            return self.shown(x) + self.hidden(x)

    class Hiding(Holder):
        __dir__ = compat.unsaved_attributes({"hidden"})

    saved = {}
    for cls in (Holder, Hiding):  # Holder: the control, saved from `dir`
        model = cls()
        model(np.ones((1, 2), "float32"))
        path = tmp_path / f"{cls.__name__}.weights.h5"
        model.save_weights(path)
        with h5py.File(path, "r") as f:
            saved[cls] = []
            f.visit(saved[cls].append)
    # Keras saves a walked attribute under its own name (both layers are also
    # saved under `layers/`, from the model's list of layers).
    assert "hidden/vars/0" in saved[Holder]
    assert "hidden" not in saved[Hiding] and "layers/dense_1/vars/0" in saved[Hiding]


def test_model_and_wrapper_are_found_on_the_stack():
    ids = keras.Input((2,), dtype="int32")
    emb = sparseopt.layers.SparseEmbedding(10, 2, updater=sparseopt.updaters.SGD(0.1))
    model = keras.Model(ids, emb(ids))
    opt = sparseopt.DispatchOptimizer(keras.optimizers.SGD())
    assert compat.model_building(opt) is None  # not compiled into any model
    model.compile(optimizer=opt, loss="mse")
    assert compat.model_building(opt) is model  # a local of this frame
    wrapper = keras.optimizers.LossScaleOptimizer(opt)
    assert compat.wrapper_building(opt) is None  # nothing is building it
    wrapper.build(model.trainable_variables)
    assert opt.loss_scaling_wrapper is wrapper


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="JAX's train-step state")
def test_jax_train_state():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    state = compat.jax_train_state(model, (np.zeros((4, 2), "float32"),
                                           np.zeros((4, 1), "float32")))
    assert len(state) == 4 and len(state[0]) == 2


@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="TF's XLA context")
def test_tensorflow_xla_context():
    import tensorflow as tf

    seen = {}

    @tf.function(jit_compile=True)
    def xla():
        seen["xla"] = compat.in_xla_context()
        return tf.constant(0)

    @tf.function
    def graph():
        seen["graph"] = compat.in_xla_context()
        return tf.constant(0)

    xla(), graph()
    assert seen == {"xla": True, "graph": False}


def test_keras_rs_internals():
    keras_rs = pytest.importorskip("keras_rs")
    table = keras_rs.layers.TableConfig(name="t", vocabulary_size=10, embedding_dim=2,
                                        optimizer="adagrad")
    feature = keras_rs.layers.FeatureConfig(name="f", table=table, input_shape=(4, 1),
                                            output_shape=(4, 2))
    layer = keras_rs.layers.DistributedEmbedding({"f": feature})
    layer({"f": np.zeros((4, 1), "int32")})
    features = compat.default_device_features(layer)
    assert list(features) == ["f"]
    config, reader = features["f"]
    assert config.table.name == "t" and isinstance(reader, keras.layers.Embedding)


def test_sparsecore_conversion_module():
    pytest.importorskip("jax_tpu_embedding", reason="SparseCore specs: Linux x86-64 only")
    conversion = compat.sparsecore_config_conversion()
    assert callable(conversion.keras_to_jte_optimizer)
    assert callable(conversion.jte_to_keras_optimizer)
