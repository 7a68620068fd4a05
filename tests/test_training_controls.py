"""The training loop's controls reach the tables: learning-rate callbacks, hyperparameters
changed after compile, weight-decay exclusions, unread moments.

Each case is checked against the NumPy reference of the rule (tests/reference.py)
replayed with the rates and values the controls set, on both backends.
"""

import keras
import numpy as np
import pytest

import sparseopt
from tests import reference
from tests.conftest import to_np
from tests.helpers import batches, dot_loss, numpy_replay, registered_cases, table_model

VOCAB, WIDTH, N_IDS, BATCH, STEPS = 40, 4, 3, 4, 2  # STEPS per epoch


def _data(seed, steps=STEPS):
    """`steps` batches (one epoch's, by default)."""
    return batches(np.random.default_rng(seed), steps, BATCH, N_IDS, VOCAB, WIDTH)


def _fit(model, xs, ys, epochs=1, callbacks=()):
    """`epochs` passes over the batches `xs`, `ys`; returns every step's batch, in order."""
    model.fit(xs.reshape(-1, N_IDS), ys.reshape(-1, N_IDS, WIDTH), batch_size=BATCH,
              epochs=epochs, shuffle=False, verbose=0, callbacks=list(callbacks))
    return np.concatenate([xs] * epochs), np.concatenate([ys] * epochs)


class RecordRates(keras.callbacks.Callback):
    """Records the model's learning rate at each epoch's start (after other callbacks)."""

    def __init__(self):
        super().__init__()
        self.rates = []

    def on_epoch_begin(self, epoch, logs=None):
        self.rates.append(float(to_np(self.model.optimizer.learning_rate)))


@pytest.mark.parametrize("callback", ["scheduler", "plateau"])
def test_learning_rate_callbacks_reach_the_tables_in_proportion(callback):
    xs, ys = _data(1)
    model, emb = table_model(VOCAB, WIDTH, N_IDS, sparseopt.updaters.SGD(0.5))
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.1)),
                  loss=dot_loss)
    table0 = to_np(emb.embeddings)
    if callback == "scheduler":  # halves, then stops
        driver = keras.callbacks.LearningRateScheduler(lambda epoch, lr: [0.1, 0.05, 0.0][epoch])
    else:  # never improves by 1e9: halves the rate after each epoch but the first
        driver = keras.callbacks.ReduceLROnPlateau("loss", factor=0.5, patience=0,
                                                   min_delta=1e9, mode="max")
    record = RecordRates()
    xs, ys = _fit(model, xs, ys, 3, [driver, record])
    assert len(set(record.rates)) > 1, record.rates  # the callback did change the rate
    want, _ = numpy_replay("SGD", {}, table0, xs, ys,
                           lambda t: 0.5 * record.rates[t // STEPS] / 0.1)
    np.testing.assert_allclose(to_np(emb.embeddings), want, rtol=1e-5, atol=1e-6)


def test_a_rate_set_to_zero_stops_the_tables():
    xs, ys = _data(2)
    model, emb = table_model(VOCAB, WIDTH, N_IDS, sparseopt.updaters.Adagrad(0.5))
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.Adam(0.01)),
                  loss=dot_loss)
    _fit(model, xs, ys)
    moved = to_np(emb.embeddings)
    model.optimizer.learning_rate = 0.0
    _fit(model, xs, ys)
    np.testing.assert_array_equal(to_np(emb.embeddings), moved)


def test_follow_learning_rate_false_keeps_a_tables_rate():
    xs, ys = _data(3)
    updater = sparseopt.updaters.SGD(0.5, follow_learning_rate=False)
    model, emb = table_model(VOCAB, WIDTH, N_IDS, updater)
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.1)),
                  loss=dot_loss)
    table0 = to_np(emb.embeddings)
    xs, ys = _fit(model, xs, ys, 2, [keras.callbacks.LearningRateScheduler(lambda e, lr: 0.0)])
    want, _ = numpy_replay("SGD", {}, table0, xs, ys, lambda t: 0.5)
    np.testing.assert_allclose(to_np(emb.embeddings), want, rtol=1e-5, atol=1e-6)
    assert updater.get_config()["follow_learning_rate"] is False
    assert sparseopt.updaters.SGD.from_config(updater.get_config()).follow_learning_rate is False


def test_a_callback_setting_one_tables_rate_takes_effect_at_the_next_step():
    xs, ys = _data(4)
    updater = sparseopt.updaters.SGD(0.5)
    model, emb = table_model(VOCAB, WIDTH, N_IDS, updater)
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.1)),
                  loss=dot_loss)
    table0 = to_np(emb.embeddings)
    # Mid-epoch, and without going through `self.model` (which would sync JAX's state).
    change = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: setattr(updater, "learning_rate", 0.1 * (batch + 2)))
    xs, ys = _fit(model, xs, ys, 2, [change])
    rates = [0.5] + [0.1 * (t % STEPS + 2) for t in range(len(xs) - 1)]
    want, _ = numpy_replay("SGD", {}, table0, xs, ys, lambda t: rates[t])
    np.testing.assert_allclose(to_np(emb.embeddings), want, rtol=1e-5, atol=1e-6)
    trainer = model.optimizer.table_trainer(emb.embeddings)
    last = float(to_np(trainer.hyperparameters["learning_rate"]))
    assert last == pytest.approx(0.1 * (STEPS + 1))


# Every shipped updater, on each code path (on TF: a fused kernel or the rule).
CASES = registered_cases(paths_only=True)


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_hyperparameter_that_may_change_reaches_the_next_step(case):
    entry, cfg = CASES[case]
    name = entry.__name__
    updater = entry(0.05, **cfg)
    model, emb = table_model(VOCAB, WIDTH, N_IDS, updater)
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.1)),
                  loss=dot_loss)
    xs, ys = _data(5)
    table = to_np(emb.embeddings)
    state = reference.initial_state(name, table.shape, cfg)
    changed = {}
    for t, (x, y) in enumerate(zip(xs, ys)):
        model.train_on_batch(x, y)
        table, state = reference.sparse_step(name, table, state, x, y / BATCH,
                                             cfg.get("learning_rate", 0.05) if t == 0 else
                                             changed["learning_rate"], {**cfg, **changed},
                                             step=t + 1)
        if t == 0:
            spec = updater._specs
            for hp, value in updater.state_hyperparameters.items():
                new = value * 0.5 if value else value
                if spec[hp].may_change(value, new) and (spec[hp].check is None
                                                        or spec[hp].check(new)):
                    setattr(updater, hp, new)
                    changed[hp] = new
            changed.setdefault("learning_rate", 0.05)
    assert len(changed) > 1 or name == "SGD", changed  # more than the rate changed
    np.testing.assert_allclose(to_np(emb.embeddings), table, rtol=5e-5, atol=2e-6)


def test_values_that_decide_the_step_are_refused_once_built_naming_the_table():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9)
    cases = [
        (sparseopt.updaters.SGD(0.1, momentum=0.9), "momentum", 0.0),
        (sparseopt.updaters.SGD(0.1, momentum=0.9), "nesterov", True),
        (sparseopt.updaters.SGD(0.1), "clipvalue", 1.0),  # off when built
        (sparseopt.updaters.Adam(0.1, beta_1=0.0), "beta_1", 0.9),
        (sparseopt.updaters.Adagrad(schedule), "learning_rate", 0.1),
        (sparseopt.updaters.Adagrad(0.1), "learning_rate", schedule),
        (sparseopt.updaters.Adagrad(0.1), "initial_accumulator_value", 0.5),
        (sparseopt.updaters.Ftrl(0.1), "learning_rate_power", -0.3),
    ]
    for updater, name, value in cases:
        keras.backend.clear_session(free_memory=False)
        model, _ = table_model(VOCAB, WIDTH, N_IDS, updater)
        model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD()),
                      loss=dot_loss)
        # Built first (a shortcut, not the users' path): the refusals come from a built optimizer.
        model.optimizer.build(model.trainable_variables)
        before = updater.get_config()
        with pytest.raises(ValueError, match=rf"`{name}` cannot change once.*'emb/embeddings'"):
            setattr(updater, name, value)
        assert updater.get_config() == before
    with pytest.raises(ValueError, match="`beta_1` must be in"):
        sparseopt.updaters.Adam(0.1).beta_1 = 1.5  # checked like the constructor's


def test_an_option_set_before_compile_acts():
    xs, ys = _data(6)
    updater = sparseopt.updaters.SGD(0.5)
    updater.clipvalue = 1e-3
    model, emb = table_model(VOCAB, WIDTH, N_IDS, updater)
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD()), loss=dot_loss)
    table0 = to_np(emb.embeddings)
    _fit(model, xs, ys)
    want, _ = numpy_replay("SGD", {"clipvalue": 1e-3}, table0, xs, ys, lambda t: 0.5)
    np.testing.assert_allclose(to_np(emb.embeddings), want, rtol=1e-5, atol=1e-7)
    assert updater.get_config()["clipvalue"] == 1e-3


def test_changed_rates_are_saved_and_resume_exactly(tmp_path):
    xs, ys = _data(7)
    updater = sparseopt.updaters.Adagrad(0.3)
    model, emb = table_model(VOCAB, WIDTH, N_IDS, updater)
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.1)),
                  loss=dot_loss)
    _fit(model, xs, ys)
    updater.learning_rate = 0.2
    model.optimizer.learning_rate = 0.05  # tables now at half their own rate
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    loaded_emb = loaded.get_layer("emb")
    assert loaded_emb.updater.learning_rate == pytest.approx(0.2)
    assert float(to_np(loaded.optimizer.learning_rate_scale())) == pytest.approx(0.5)
    for m in (model, loaded):
        _fit(m, xs, ys)
    np.testing.assert_array_equal(to_np(loaded_emb.embeddings), to_np(emb.embeddings))


def test_exclude_from_weight_decay_reaches_the_dense_optimizers_and_the_tables():
    xs, ys = _data(8)

    def run(table_decay, exclude):
        keras.utils.set_random_seed(1)
        ids = keras.Input((N_IDS,), dtype="int32")
        emb = sparseopt.layers.SparseEmbedding(
            VOCAB, WIDTH, name="emb",
            updater=sparseopt.updaters.SGD(0.5, weight_decay=0.3 if table_decay else None))
        out = keras.layers.Dense(WIDTH, name="dense")(emb(ids))
        model = keras.Model(ids, out)
        optimizer = sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.1, weight_decay=0.3))
        if exclude:
            optimizer.exclude_from_weight_decay(var_names=exclude)
        model.compile(optimizer=optimizer, loss=dot_loss)
        _fit(model, xs, ys)
        return {v.path: to_np(v) for v in model.trainable_variables if v.ndim}

    # The table's decay and the bias' are excluded: as if neither had any.
    excluded = run(True, ["bias", "embeddings"])
    undecayed = run(False, ["bias"])
    for path in ("emb/embeddings", "dense/bias", "dense/kernel"):
        np.testing.assert_allclose(excluded[path], undecayed[path], rtol=1e-6, atol=1e-7)
    decayed = run(True, None)  # and they would have been decayed otherwise
    for path in ("emb/embeddings", "dense/bias"):
        assert not np.allclose(decayed[path], undecayed[path], rtol=1e-4, atol=1e-5), path


def test_exclusions_set_on_the_wrapped_optimizer_reach_the_tables():
    xs, ys = _data(9)
    model, emb = table_model(VOCAB, WIDTH, N_IDS, sparseopt.updaters.SGD(0.5, weight_decay=0.3))
    wrapped = keras.optimizers.SGD(0.1)
    wrapped.exclude_from_weight_decay(var_names=["embeddings"])
    model.compile(optimizer=sparseopt.DispatchOptimizer(wrapped), loss=dot_loss)
    table0 = to_np(emb.embeddings)
    _fit(model, xs, ys)
    want, _ = numpy_replay("SGD", {}, table0, xs, ys, lambda t: 0.5)  # no decay
    np.testing.assert_allclose(to_np(emb.embeddings), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name,cfg,unread", [
    ("Adam", {"beta_1": 0.0}, "momentum"),
    ("PartialRowwiseAdam", {"beta_1": 0.0}, "momentum"),
    ("LaProp", {"b1": 0.0}, "mu"),
    ("AdagradMomentum", {"momentum": 0.0}, "momentum"),
])
def test_a_moment_a_configuration_never_reads_has_no_slot(name, cfg, unread):
    xs, ys = _data(10)
    updater = getattr(sparseopt.updaters, name)(0.05, **cfg)
    model, emb = table_model(VOCAB, WIDTH, N_IDS, updater)
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD()), loss=dot_loss)
    table0 = to_np(emb.embeddings)
    _fit(model, xs, ys)
    assert unread not in model.optimizer.table_state(emb.embeddings)
    assert [s.name for s in updater.slots] == [
        s.name for s in updater.legacy_slots if s.name != unread]
    want, _ = numpy_replay(name, cfg, table0, xs, ys, lambda t: 0.05)
    np.testing.assert_allclose(to_np(emb.embeddings), want, rtol=5e-5, atol=2e-6)


def test_a_checkpoint_that_kept_the_unread_moment_still_loads():
    """sparseopt 0.2 kept Adam(beta_1=0)'s momentum slot and no hyperparameters."""
    xs, ys = _data(11)
    model, emb = table_model(VOCAB, WIDTH, N_IDS, sparseopt.updaters.Adam(0.05, beta_1=0.0))
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.1)),
                  loss=dot_loss)
    _fit(model, xs, ys)
    optimizer = model.optimizer
    trainer = optimizer.table_trainer(emb.embeddings)
    velocity = to_np(trainer.slots["velocity"])
    # That version's entries: every state variable but the new ones, and a
    # momentum of the table's shape before the velocity.
    new = {id(v) for v in trainer.hyperparameters.values()} | {id(optimizer._rate_at_start)}
    old = []
    for v in optimizer.state_variables():
        if id(v) in new:
            continue
        if v is trainer.slots["velocity"]:
            old.append(np.full(v.shape, 7.0, "float32"))  # the momentum, never read
        old.append(to_np(v).astype(v.dtype))
    keras.backend.clear_session(free_memory=False)
    again, emb2 = table_model(VOCAB, WIDTH, N_IDS, sparseopt.updaters.Adam(0.05, beta_1=0.0))
    again.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.1)),
                  loss=dot_loss)
    # Built first (a shortcut, not the users' path): loads state into a built optimizer by hand.
    again.optimizer.build(again.trainable_variables)
    again.optimizer.load_own_variables({str(i): v for i, v in enumerate(old)})
    np.testing.assert_array_equal(
        to_np(again.optimizer.table_state(emb2.embeddings)["velocity"]), velocity)
    assert int(to_np(again.optimizer.iterations)) == STEPS


# A change a user makes before the optimizer is built (between compile and fit:
# Keras builds it inside `fit`, on TensorFlow inside the first traced step) and
# the same change after it is built (between two fits). Each is held against the
# NumPy rule replayed with the rate and hyperparameters in force at each step.
# SGD with momentum: a rule with state, whose hyperparameter may change.
CHANGES = {
    # control: (what it does to the model, callbacks for the fits it applies to,
    #           table rate after it, updater config after it)
    "rate_assignment": (lambda model, updater: setattr(model.optimizer, "learning_rate", 0.05),
                        None, 0.25, {}),
    "rate_to_zero": (lambda model, updater: setattr(model.optimizer, "learning_rate", 0.0),
                     None, 0.0, {}),
    "rate_scheduler": (None, lambda: [keras.callbacks.LearningRateScheduler(
        lambda epoch, lr: 0.05)], 0.25, {}),
    "updater_rate": (lambda model, updater: setattr(updater, "learning_rate", 0.2),
                     None, 0.2, {}),
    "updater_hyperparameter": (lambda model, updater: setattr(updater, "momentum", 0.25),
                               None, 0.5, {"momentum": 0.25}),
}


@pytest.mark.parametrize("when", ["before_build", "after_build"])
@pytest.mark.parametrize("control", sorted(CHANGES))
def test_a_change_reaches_the_tables_made_before_the_build_or_after_it(control, when):
    """The reference rate is the one the user gave (`SGD(0.1)` here): a rate set
    before the build is a change like any other, on both backends."""
    change, callbacks, rate_after, cfg_after = CHANGES[control]
    xs, ys = _data(11)
    updater = sparseopt.updaters.SGD(0.5, momentum=0.5)
    model, emb = table_model(VOCAB, WIDTH, N_IDS, updater)
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.1)),
                  loss=dot_loss)
    table0 = to_np(emb.embeddings)
    if when == "after_build":  # one epoch first: the optimizer is built by it
        _fit(model, xs, ys)
        assert model.optimizer.built
    else:
        assert not model.optimizer.built
    if change is not None:
        change(model, updater)
    _fit(model, xs, ys, callbacks=callbacks() if callbacks else ())
    steps = 2 * STEPS if when == "after_build" else STEPS
    changed_from = STEPS if when == "after_build" else 0
    table = np.asarray(table0, np.float64)
    cfg0 = {"momentum": 0.5}
    state = reference.initial_state("SGD", table.shape, cfg0)
    for t in range(steps):
        x, y = xs[t % STEPS], ys[t % STEPS]
        lr, cfg = (0.5, cfg0) if t < changed_from else (rate_after, {**cfg0, **cfg_after})
        table, state = reference.sparse_step("SGD", table, state, x, y / BATCH, lr, cfg,
                                             step=t + 1)
    np.testing.assert_allclose(to_np(emb.embeddings), table, rtol=1e-5, atol=1e-6)
    if control.startswith("rate"):
        assert model.optimizer.learning_rate_scale() == pytest.approx(rate_after / 0.5)


def test_under_mixed_float16_the_dispatch_optimizer_is_reached_through_of():
    """Keras wraps the compiled optimizer in a `LossScaleOptimizer` under `mixed_float16`:
    `DispatchOptimizer.of(model)` (or `inner_optimizer`) reaches ours and its members."""
    xs, ys = _data(12)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model, emb = table_model(VOCAB, WIDTH, N_IDS, sparseopt.updaters.Adagrad(0.1))
        model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.1)),
                      loss=dot_loss)
        _fit(model, xs, ys)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    ours = sparseopt.DispatchOptimizer.of(model)
    assert ours is model.optimizer.inner_optimizer
    assert sparseopt.DispatchOptimizer.of(model.optimizer) is ours
    assert sparseopt.DispatchOptimizer.of(ours) is ours
    path = emb.embeddings.path
    assert ours.skipped_steps() == {path: 0} and ours.dropped_ids() == {path: 0}
    assert sorted(ours.table_state(emb.embeddings)) == ["accumulator"]
    scale = ours.learning_rate_scale()
    assert isinstance(scale, float) and scale == 1.0
    plain = keras.Sequential([keras.layers.Dense(1)])
    plain.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match="not trained by a sparseopt.DispatchOptimizer"):
        sparseopt.DispatchOptimizer.of(plain)


def test_the_reference_rate_travels_with_the_config():
    """A clone made from the config (`from_config(get_config())`, what loading a model
    does before its state arrives) keeps the proportion, not the rate it was cloned at."""
    xs, ys = _data(13)
    optimizer = sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.1))
    optimizer.learning_rate = 0.05
    clone = sparseopt.DispatchOptimizer.from_config(optimizer.get_config())
    assert clone.get_config()["learning_rate_reference"] == pytest.approx(0.1)
    assert clone.learning_rate_scale() == pytest.approx(0.5)
    model, emb = table_model(VOCAB, WIDTH, N_IDS, sparseopt.updaters.SGD(0.5))
    model.compile(optimizer=clone, loss=dot_loss)
    table0 = to_np(emb.embeddings)
    xs, ys = _fit(model, xs, ys)
    want, _ = numpy_replay("SGD", {}, table0, xs, ys, lambda t: 0.25)
    np.testing.assert_allclose(to_np(emb.embeddings), want, rtol=1e-5, atol=1e-6)


# Controls the traced step reads as Python values: set before the build (between
# compile and fit) they act (tests/test_global_clipping.py, test_gradient_accumulation.py,
# test_dispatch.py's loss scaling, test_lookahead.py, test_swa.py, test_catch_up.py);
# once built, a change is refused naming the fix, never silently ignored.
AFTER_BUILD = {
    "loss_scale_factor": lambda model, emb: setattr(model.optimizer, "loss_scale_factor", 64.0),
    "global_clipnorm": lambda model, emb: setattr(model.optimizer, "global_clipnorm", 0.1),
    "gradient_accumulation_steps": lambda model, emb: setattr(
        model.optimizer, "gradient_accumulation_steps", 2),
    "exclude_from_weight_decay": lambda model, emb: model.optimizer.exclude_from_weight_decay(
        var_names=["emb"]),
    "ema_momentum": lambda model, emb: setattr(emb.updater, "ema_momentum", 0.9),
    "swa_period": lambda model, emb: setattr(emb.updater, "swa_period", 2),
    "lookahead_period": lambda model, emb: setattr(emb.updater, "lookahead_period", 2),
    "lazy": lambda model, emb: setattr(emb.updater, "lazy", False),
}


@pytest.mark.parametrize("control", sorted(AFTER_BUILD))
def test_a_control_the_step_reads_once_is_refused_after_the_build(control):
    xs, ys = _data(14)
    model, emb = table_model(VOCAB, WIDTH, N_IDS, sparseopt.updaters.SGD(0.5, momentum=0.5))
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.1)),
                  loss=dot_loss)
    _fit(model, xs, ys)
    before = to_np(emb.embeddings)
    with pytest.raises(ValueError, match="once the optimizer|only be configured before"):
        AFTER_BUILD[control](model, emb)
    _fit(model, xs, ys)  # training goes on as configured
    assert not np.array_equal(to_np(emb.embeddings), before)
