"""Configs round-trip; saved models load without custom_objects."""

import keras
import numpy as np
import pytest

import sparseopt
from tests.conftest import to_np
from tests.helpers import (batches, dot_loss, kinds_by_backend, optimizer_state,
                           registered_cases, table_model)

UPDATERS = [
    sparseopt.updaters.SGD(0.3),
    sparseopt.updaters.Adagrad(0.05, initial_accumulator_value=0.2, epsilon=1e-6),
    sparseopt.updaters.RowwiseAdagrad(
        keras.optimizers.schedules.ExponentialDecay(0.1, 100, 0.9), epsilon=1e-4),
    sparseopt.updaters.Ftrl(0.1, learning_rate_power=-0.3, l1_regularization_strength=0.01,
                            l2_regularization_strength=0.02, beta=0.5,
                            initial_accumulator_value=0.3, multiply_linear_by_learning_rate=True),
    sparseopt.updaters.SGD(0.1, momentum=0.9, nesterov=True, clipnorm=0.5),
    sparseopt.updaters.Adam(0.01, beta_1=0.8, weight_decay=keras.optimizers.schedules.
                            CosineDecay(0.01, 1000), clip_weight_min=-1.0),
    sparseopt.updaters.PartialRowwiseAdam(0.01, epsilon=1e-6, weight_decay=0.1,
                                          weight_decay_mode="l2", max_norm=2.0),
    sparseopt.updaters.AdagradMomentum(0.1, momentum=0.9, use_nesterov=True, exponent=4.0,
                                       beta_2=0.99, clip_weight_max=3.0),
]


@pytest.mark.parametrize("updater", UPDATERS, ids=lambda u: type(u).__name__)
@pytest.mark.backend_independent
def test_updater_config_round_trip(updater):
    blob = keras.saving.serialize_keras_object(updater)
    again = keras.saving.deserialize_keras_object(blob)
    assert type(again) is type(updater)
    assert keras.saving.serialize_keras_object(again) == blob
    for step in [0, 50, 300]:
        assert float(again.learning_rate_at(step)) == pytest.approx(
            float(updater.learning_rate_at(step)))


@pytest.mark.parametrize("bad", [
    lambda: sparseopt.updaters.Adagrad(-1.0),
    lambda: sparseopt.updaters.Adagrad("fast"),
    lambda: sparseopt.updaters.Adagrad(0.1, initial_accumulator_value=-0.1),
    lambda: sparseopt.updaters.Ftrl(0.1, learning_rate_power=0.5),
    lambda: sparseopt.updaters.Ftrl(0.1, l1_regularization_strength=-1.0),
    lambda: sparseopt.updaters.Ftrl(0.1, initial_accumulator_value=0.0),
    lambda: sparseopt.layers.SparseEmbedding(10, 4, updater=keras.optimizers.Adagrad()),
    lambda: sparseopt.layers.SparseEmbedding(10, 4, updater=sparseopt.updaters.SGD(),
                                             combiner="max"),
])
@pytest.mark.backend_independent
def test_invalid_options_are_refused(bad):
    with pytest.raises((ValueError, TypeError)):
        bad()


@pytest.mark.parametrize("make,message", [
    (lambda: sparseopt.updaters.SGD(0.1, nesterov=True), r"SGD: `nesterov=True` needs"),
    (lambda: sparseopt.updaters.SGD(0.1, momentum=1.0), r"SGD: `momentum` must be in \[0, 1\)"),
    (lambda: sparseopt.updaters.Adam(0.1, beta_1=1.0), r"Adam: `beta_1` must be in"),
    (lambda: sparseopt.updaters.AdagradMomentum(0.1, exponent=0.0),
     r"AdagradMomentum: `exponent` must be > 0"),
    (lambda: sparseopt.updaters.AdagradMomentum(0.1, epsilon=0.0),
     r"AdagradMomentum: `epsilon` and `initial_accumulator_value` are both 0"),
    (lambda: sparseopt.updaters.Adagrad(0.1, weight_decay_mode="l2"),
     r"Adagrad: \['weight_decay_mode'\] set without `weight_decay`"),
    (lambda: sparseopt.updaters.Adam(0.1, weight_decay=0.1, weight_decay_mode="coupled"),
     r"Adam: `weight_decay_mode` must be one of \['decoupled', 'l2'\]"),
    (lambda: sparseopt.updaters.Adam(0.1, clip_weight_min=1.0, clip_weight_max=0.5),
     r"Adam: `clip_weight_min` \(1.0\) is above `clip_weight_max` \(0.5\)"),
    (lambda: sparseopt.updaters.Ftrl(0.1, clipnorm=0.0), r"Ftrl: `clipnorm` must be a number > 0"),
    (lambda: sparseopt.updaters.SGD(0.1, max_norm="big"), r"SGD: `max_norm` must be a number"),
    (lambda: sparseopt.updaters.SGD(0.1, weight_decay=0.1,
                                    multiply_weight_decay_by_learning_rate=1),
     r"SGD: `multiply_weight_decay_by_learning_rate` must be True or False"),
    (lambda: sparseopt.updaters.SGD(0.1, clip_norm=1.0), r"SGD: unknown option `clip_norm`"),
    (lambda: sparseopt.updaters.Adam(0.1, swa=10), r"Adam: `swa` is not supported.*`swa_period`"),
    (lambda: sparseopt.updaters.Adam(0.1, lookahead=5), r"Adam: `lookahead` is not supported"),
])
@pytest.mark.backend_independent
def test_updater_settings_that_do_not_fit_are_refused_by_name(make, message):
    with pytest.raises((ValueError, TypeError), match=message):
        make()


@pytest.mark.backend_independent
def test_dispatch_optimizer_config_round_trip():
    opt = sparseopt.DispatchOptimizer(
        keras.optimizers.Adam(3e-3),
        optimizer_map={"emb2/embeddings": sparseopt.updaters.SGD(0.2),
                       "out/.*": keras.optimizers.SGD(0.5)})
    blob = keras.saving.serialize_keras_object(opt)
    again = keras.saving.deserialize_keras_object(blob)
    assert isinstance(again, sparseopt.DispatchOptimizer)
    assert keras.saving.serialize_keras_object(again) == blob
    assert float(to_np(again.learning_rate)) == pytest.approx(3e-3)


def test_saved_model_loads_without_custom_objects_and_keeps_training(tmp_path):
    model, emb = table_model(50, 4, 3, sparseopt.updaters.Adagrad(0.1), combiner="mean")
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.Adam()), loss=dot_loss)
    rng = np.random.default_rng(0)
    xs, _ = batches(rng, 3, 4, 3, 50, 4)
    ys = rng.normal(size=(3, 4, 4)).astype("float32")
    model.train_on_batch(xs[0], ys[0])
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    np.testing.assert_array_equal(to_np(loaded.predict(xs[1], verbose=0)),
                                  to_np(model.predict(xs[1], verbose=0)))
    assert isinstance(loaded.optimizer, sparseopt.DispatchOptimizer)
    for a, b in zip(optimizer_state(loaded.optimizer), optimizer_state(model.optimizer)):
        np.testing.assert_array_equal(to_np(a), to_np(b))
    model.train_on_batch(xs[1], ys[1])
    loaded.train_on_batch(xs[1], ys[1])
    loaded_emb = loaded.layers[-1]
    np.testing.assert_allclose(to_np(loaded_emb.embeddings), to_np(emb.embeddings), rtol=1e-6)


def test_checkpoints_hold_state_only_not_the_dedup_workspace():
    """JAX's dedup scratch is never saved: checkpoints match across backends."""
    model, _ = table_model(50, 4, 3, sparseopt.updaters.Ftrl(0.1))
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.Adam()), loss=dot_loss)
    # Built first (a shortcut, not the users' path): saves an untrained optimizer's state.
    model.optimizer.build(model.trainable_variables)
    store = {}
    model.optimizer.save_own_variables(store)
    state = optimizer_state(model.optimizer)
    assert len(store) == len(state) >= 3  # FTRL's two slots, counters, Adam's
    for i, v in enumerate(state):
        np.testing.assert_array_equal(store[str(i)], to_np(v))


def test_wrapped_optimizer_is_saved_once_and_loads_before_build_without_warnings(tmp_path):
    """Keras' saver would also save Adam under the DispatchOptimizer's attributes, and
    loading that copy into an unbuilt Adam warns that it skipped it."""
    import warnings

    import h5py

    model, _ = table_model(50, 4, 3, sparseopt.updaters.Adagrad(0.1))
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.Adam()), loss=dot_loss)
    # Built first (a shortcut, not the users' path): saves an untrained optimizer's state.
    model.optimizer.build(model.trainable_variables)
    path = str(tmp_path / "w.weights.h5")
    model.save_weights(path)
    with h5py.File(path) as f:
        groups = []
        f["optimizer"].visit(groups.append)
    assert [g for g in groups if not g.startswith("vars")] == [], groups
    keras.backend.clear_session(free_memory=False)
    again, _ = table_model(50, 4, 3, sparseopt.updaters.Adagrad(0.1))
    again.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.Adam()), loss=dot_loss)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        again.load_weights(path)


REGISTERED = registered_cases()


@pytest.mark.parametrize("case", sorted(REGISTERED))
def test_every_registered_updater_round_trips_and_builds_its_slots(case):
    entry, cfg = REGISTERED[case]
    updater = entry(0.1, **cfg)
    blob = keras.saving.serialize_keras_object(updater)
    again = keras.saving.deserialize_keras_object(blob)
    assert type(again) is entry and again.get_config() == updater.get_config()
    model, emb = table_model(12, 3, 2, again)
    opt = sparseopt.DispatchOptimizer(keras.optimizers.SGD())
    model.compile(optimizer=opt, loss=dot_loss)
    # Built first (a shortcut, not the users' path): reads the state's slots without training.
    opt.build(model.trainable_variables)
    state = opt.table_state(emb.embeddings)
    assert sorted(state) == sorted(s.name for s in updater.slots)
    for spec in updater.slots:
        assert tuple(state[spec.name].shape) == spec.shape((12, 3))
        np.testing.assert_array_equal(to_np(state[spec.name]), np.float32(spec.initial_value))


# One of each kind of state in `make test` (whole-table slots, int32 per row, the
# per-row record of lazy=False, a moving average); `make test-all`: every one.
@pytest.mark.parametrize("case", kinds_by_backend(sorted(REGISTERED), [
    "Adafactor:default", "Nadam:default", "FrequencyAwareAdagrad:default",
    "SGD:dense_momentum_decay", "Adam:ema", "RMSprop:dense_momentum_decay"],
    ["Adafactor:default", "SGD:dense_momentum_decay"]))
def test_every_registered_updater_resumes_from_a_saved_model_bit_for_bit(case, tmp_path):
    """Three steps, `model.save`, `load_model`, three more: the table and every
    state variable equal those of six steps straight."""
    entry, cfg = REGISTERED[case]
    xs, ys = batches(np.random.default_rng(3), 6, 4, 2, 12, 3, dup_vocab=8)

    def fresh():
        keras.utils.set_random_seed(1)
        model, _ = table_model(12, 3, 2, entry(0.1, **cfg))
        model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD()),
                      loss=dot_loss)
        return model

    straight, half = fresh(), fresh()
    for x, y in zip(xs, ys):
        straight.train_on_batch(x, y)
    for x, y in zip(xs[:3], ys[:3]):
        half.train_on_batch(x, y)
    half.save(tmp_path / "half.keras")
    resumed = keras.saving.load_model(tmp_path / "half.keras")
    for x, y in zip(xs[3:], ys[3:]):
        resumed.train_on_batch(x, y)
    np.testing.assert_array_equal(to_np(resumed.layers[-1].embeddings),
                                  to_np(straight.layers[-1].embeddings))
    want, got = optimizer_state(straight.optimizer), optimizer_state(resumed.optimizer)
    assert [v.name for v in got] == [v.name for v in want]
    for a, b in zip(got, want):
        np.testing.assert_array_equal(to_np(a), to_np(b), err_msg=b.name)
