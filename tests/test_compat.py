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


# The stack walks (`model_building`, `training_batch`, `wrapper_building`), at
# every Keras entry point that builds an optimizer: each test fails, by name,
# when a Keras release moves what the walk reads (the model as a frame's
# `self` or local, `_symbolic_build`'s `data_batch` / `iterator`, a
# `LossScaleOptimizer`'s `inner_optimizer`).
JAX = keras.backend.backend() == "jax"


_SEEN = []


class Spy(sparseopt.DispatchOptimizer):
    """Records what the walks find when Keras builds it (a test double: the
    walks must run from inside `build`, where sparseopt runs them). What it
    saw is kept outside it (`_SEEN`): Keras' saver walks an optimizer's
    attributes, and a list holding the model would lead it round in a circle."""

    def build(self, var_list):
        if not self.built:
            _SEEN.append({"model": compat.model_building(self),
                              "wrapper": compat.wrapper_building(self),
                              "batch": compat.training_batch(self)})
        super().build(var_list)


def _spied_model(wrap=False):
    ids = keras.Input((3,), dtype="int32")
    emb = sparseopt.layers.SparseEmbedding(10, 2, updater=sparseopt.updaters.SGD(0.1))
    model = keras.Model(ids, keras.layers.Dense(1)(keras.ops.mean(emb(ids), axis=1)))
    _SEEN.clear()
    opt = Spy(keras.optimizers.SGD(0.1))
    model.compile(optimizer=keras.optimizers.LossScaleOptimizer(opt) if wrap else opt,
                  loss="mse")
    return model, opt


_X = np.arange(12, dtype="int32").reshape(4, 3) % 10
_Y = np.ones((4, 1), "float32")


@pytest.mark.parametrize("entry", ["fit", "train_on_batch", "evaluate"])
def test_stack_walks_at_keras_training_entry_points(entry):
    model, _ = _spied_model()
    if entry == "fit":
        model.fit(_X, _Y, batch_size=4, epochs=1, verbose=0)
    elif entry == "train_on_batch":
        model.train_on_batch(_X, _Y)
    else:
        model.evaluate(_X, _Y, batch_size=4, verbose=0)
        model.fit(_X, _Y, batch_size=4, epochs=1, verbose=0)  # (built by now, on either backend)
    assert len(_SEEN) == 1
    seen = _SEEN[0]
    assert seen["model"] is model and seen["wrapper"] is None
    if JAX and entry != "evaluate":
        # Keras' JAX trainer builds the optimizer in `_symbolic_build`, before
        # the train step is traced; the batch it holds there is found.
        x = keras.utils.unpack_x_y_sample_weight(seen["batch"])[0]
        assert tuple(x.shape) == _X.shape
    elif not JAX:
        # TF builds it inside the traced train step, after the forward pass:
        # no `_symbolic_build` frame, and nothing needs one.
        assert seen["batch"] is None


def test_stack_walks_under_a_loss_scale_wrapper_in_fit():
    model, opt = _spied_model(wrap=True)
    model.fit(_X, _Y, batch_size=4, epochs=1, verbose=0)
    assert _SEEN[0]["model"] is model
    assert _SEEN[0]["wrapper"] is model.optimizer and opt.loss_scaling_wrapper is model.optimizer


def test_stack_walks_when_a_saved_model_is_loaded(tmp_path):
    model, _ = _spied_model()
    model.fit(_X, _Y, batch_size=4, epochs=1, verbose=0)
    path = tmp_path / "m.keras"
    model.save(path)
    _SEEN.clear()
    # `compile_from_config` builds the optimizer, the loaded model its frame's `self`.
    loaded = keras.saving.load_model(path, custom_objects={"Spy": Spy})
    assert [s["model"] for s in _SEEN] == [loaded]


def test_a_deferred_variable_is_told_from_one_holding_a_value():
    """`compat.holds_a_value` reads a Keras variable's private `_value` (None until a
    deferred initialization runs)."""
    assert compat.holds_a_value(keras.Variable(np.zeros(3)))
    with keras.StatelessScope(initialize_variables=False):
        deferred = keras.Variable(initializer="zeros", shape=(3,))
        assert not compat.holds_a_value(deferred)


def test_an_export_is_found_on_the_stack():
    """`compat.exporting` knows Keras' export archive (whatever the backend's class) by its
    classes' names: a rename fails here first. (The users' path, `model.export` of tables on
    disk, is tests/test_disk_export.py.)"""
    archive = keras.export.ExportArchive()

    class Seen(keras.layers.Layer):
        """A layer that notes the export at work when its variables are read."""

        found = []

        @property
        def variables(self):
            Seen.found.append(compat.exporting())
            return super().variables

    layer = Seen()
    layer.build((None, 1))
    archive.track(layer)  # (Keras' archive reads the layer's variables)
    assert Seen.found and all(found is archive for found in Seen.found)

    # A method of the archive's class outside Keras' export modules is not read:
    # reading a frame's locals keeps them alive with it (compat.exporting).
    def a_method_of(self):
        return compat.exporting()

    assert a_method_of(archive) is None
    assert compat.exporting() is None


def test_stack_walks_read_what_keras_names():
    """The names the walks read, checked at their source: a rename fails here first."""
    import inspect

    assert {"iterator", "data_batch"} <= set(
        inspect.signature(keras.Model._symbolic_build).parameters)
    wrapper = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())
    assert isinstance(wrapper.inner_optimizer, keras.optimizers.SGD)


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="JAX's train-step state")
def test_jax_train_state():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    state = compat.jax_train_state(model, (np.zeros((4, 2), "float32"),
                                           np.zeros((4, 1), "float32")))
    assert len(state) == 4 and len(state[0]) == 2


def test_fit_shows_each_batch_one_step_ahead():
    # Keras' `fit` takes each step's batch in `model.train_function(state, iterator)` on
    # JAX, `model.train_function(iterator)` on TensorFlow (given a Python iterator, from
    # Python), made by `make_train_function`: seen one step early, trained on in order,
    # across epochs that share an iterator (`steps_per_epoch`), and after a second `fit`;
    # with nothing to see, Keras' own iterator is passed on again.
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1, use_bias=False)])
    model.compile(optimizer="sgd", loss="mse")
    seen, trained = [], []

    class Record(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            trained.append(len(seen))  # (batches seen when this step begins)

    compat.batches_seen_ahead(model, lambda batch: seen.append(int(batch[0][0, 0])))
    x = np.arange(6, dtype="float32").reshape(6, 1)
    model.fit(x, x, batch_size=1, epochs=2, steps_per_epoch=3, shuffle=False, verbose=0,
              callbacks=[Record()])
    assert seen == [0, 1, 2, 3, 4, 5]
    # Step k begins with k + 1 batches seen, bar the first (the batch after it is taken
    # inside the step's call, when its own batch is); the last has no batch after it.
    assert trained == [0, 2, 3, 4, 5, 6]
    model.fit(x[:2], x[:2], batch_size=1, shuffle=False, verbose=0)  # (wrapped once)
    assert seen[6:] == [0, 1]
    model.train_on_batch(x[:1], x[:1])
    assert seen[8:] == [0]
    compat.batches_seen_ahead(model, None)
    given = []
    function = model.train_function.function
    model.train_function.function = lambda *args: (given.append(args[-1]), function(*args))[1]
    model.fit(x[:2], x[:2], batch_size=1, shuffle=False, verbose=0)
    assert len(seen) == 9 and given and not any(
        type(it).__name__ == "_AheadReader" for it in given)


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
