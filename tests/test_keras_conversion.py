"""Updater <-> Keras optimizer (keras-rs TableConfig.optimizer), both ways.

Each supported pair is checked twice: the hyperparameters survive a round trip
(also through keras-rs' own TableConfig serialization), and the converted rule
computes what the Keras optimizer computes on the same gradients.
"""

import keras
import keras_rs
import numpy as np
import pytest

import sparseopt
from sparseopt.updaters import from_keras_optimizer, to_keras_optimizer
from tests.conftest import to_np
from tests.helpers import dot_loss, kinds_by_backend, registered_cases, table_model

SCHEDULE = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
PAIRS = {
    "sgd": (lambda: keras.optimizers.SGD(0.3), sparseopt.updaters.SGD),
    "sgd_schedule": (lambda: keras.optimizers.SGD(SCHEDULE), sparseopt.updaters.SGD),
    "sgd_momentum": (lambda: keras.optimizers.SGD(0.1, momentum=0.8), sparseopt.updaters.SGD),
    "sgd_nesterov": (lambda: keras.optimizers.SGD(0.1, momentum=0.6, nesterov=True),
                     sparseopt.updaters.SGD),
    "sgd_clipvalue": (lambda: keras.optimizers.SGD(0.3, clipvalue=0.5), sparseopt.updaters.SGD),
    "adagrad_ema": (lambda: keras.optimizers.Adagrad(0.05, use_ema=True, ema_momentum=0.95),
                    sparseopt.updaters.Adagrad),
    "adam": (lambda: keras.optimizers.Adam(0.02, beta_1=0.8, beta_2=0.95, epsilon=1e-4),
             sparseopt.updaters.Adam),
    "adagrad": (lambda: keras.optimizers.Adagrad(0.05, initial_accumulator_value=0.3,
                                                 epsilon=1e-5), sparseopt.updaters.Adagrad),
    "ftrl": (lambda: keras.optimizers.Ftrl(0.2, learning_rate_power=-0.3,
                                           initial_accumulator_value=0.4,
                                           l1_regularization_strength=0.01,
                                           l2_regularization_strength=0.02, beta=0.5),
             sparseopt.updaters.Ftrl),
    "rmsprop": (lambda: keras.optimizers.RMSprop(0.01, rho=0.8, momentum=0.5, epsilon=1e-4),
                sparseopt.updaters.RMSprop),
    "rmsprop_centered": (lambda: keras.optimizers.RMSprop(0.01, centered=True),
                         sparseopt.updaters.RMSprop),
    "adamax": (lambda: keras.optimizers.Adamax(0.02, beta_1=0.8, beta_2=0.95, epsilon=1e-4),
               sparseopt.updaters.Adamax),
    "nadam": (lambda: keras.optimizers.Nadam(0.02, beta_1=0.8, beta_2=0.95, epsilon=1e-4),
              sparseopt.updaters.Nadam),
    "lion": (lambda: keras.optimizers.Lion(0.01, beta_1=0.8, beta_2=0.95),
             sparseopt.updaters.Lion),
    "lamb": (lambda: keras.optimizers.Lamb(0.02, beta_1=0.8, beta_2=0.95, epsilon=1e-4),
             sparseopt.updaters.Lamb),
}
HYPER = ["learning_rate", "rho", "centered", "initial_accumulator_value", "epsilon", "learning_rate_power",
         "l1_regularization_strength", "l2_regularization_strength", "beta", "momentum",
         "nesterov", "beta_1", "beta_2", "clipvalue", "use_ema", "ema_momentum"]


def hyper(config):
    out = {k: config[k] for k in HYPER if k in config}
    if isinstance(out["learning_rate"], dict):  # compare schedules by their config
        out["learning_rate"] = out["learning_rate"]["config"]
    if hasattr(out["learning_rate"], "get_config"):
        out["learning_rate"] = out["learning_rate"].get_config()
    return out


@pytest.mark.parametrize("case", sorted(PAIRS))
@pytest.mark.backend_independent
def test_round_trip_keeps_every_hyperparameter(case):
    make, updater_class = PAIRS[case]
    optimizer = make()
    updater = from_keras_optimizer(optimizer)
    assert type(updater) is updater_class
    again = to_keras_optimizer(updater)
    assert type(again) is type(optimizer)
    assert hyper(again.get_config()) == hyper(optimizer.get_config())
    assert from_keras_optimizer(again).get_config() == updater.get_config()


@pytest.mark.parametrize("case", sorted(PAIRS))
@pytest.mark.backend_independent
def test_through_keras_rs_table_config_serialization(case):
    updater = from_keras_optimizer(PAIRS[case][0]())
    table = keras_rs.layers.TableConfig(name="t", vocabulary_size=10, embedding_dim=4,
                                        optimizer=to_keras_optimizer(updater))
    restored = keras_rs.layers.TableConfig.from_config(table.get_config())
    assert from_keras_optimizer(restored.optimizer).get_config() == updater.get_config()


COMPUTED = ["sgd", "adagrad", "ftrl", "sgd_schedule", "sgd_momentum", "sgd_nesterov",
            "sgd_clipvalue", "adam", "rmsprop", "rmsprop_centered", "adamax", "nadam", "lion",
            "lamb"]


@pytest.mark.parametrize("case", kinds_by_backend(COMPUTED, COMPUTED, [
    "sgd", "adagrad", "ftrl", "sgd_schedule", "sgd_momentum", "sgd_nesterov", "sgd_clipvalue",
    "adam", "nadam", "lamb"]))
def test_converted_rule_computes_what_the_keras_optimizer_computes(case):
    """Every row touched with a nonzero gradient: dense Keras == sparse rule
    (for momentum and Adam too: no row misses a step). Through `fit`, so that
    whole-table state (Nadam's momentum product) advances as in training. Lamb
    takes its trust ratio per row: Keras' Lamb on each row as its own variable."""
    optimizer = PAIRS[case][0]()
    updater = from_keras_optimizer(optimizer)
    rng = np.random.default_rng(0)
    w0 = rng.normal(size=(6, 3)).astype("float32")
    per_row = case == "lamb"
    variables = ([keras.Variable(w0[i:i + 1]) for i in range(6)] if per_row
                 else [keras.Variable(w0)])
    optimizer.build(variables)
    model, emb = table_model(6, 3, 6, updater, init="zeros")
    emb.embeddings.assign(w0)
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.1)),
                  loss=dot_loss)
    ids = np.arange(6, dtype="int32")[None]
    for _ in range(4):
        g = rng.normal(size=w0.shape).astype("float32")
        model.train_on_batch(ids, g[None])  # dot_loss: the row gradients are g
        grads = [keras.ops.convert_to_tensor(g[i:i + 1]) for i in range(6)] if per_row else [
            keras.ops.convert_to_tensor(g)]
        optimizer.apply(grads, variables)
    want = np.concatenate([to_np(v) for v in variables])
    np.testing.assert_allclose(to_np(emb.embeddings), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name,updater_class", [("sgd", sparseopt.updaters.SGD),
                                                ("adagrad", sparseopt.updaters.Adagrad),
                                                ("adam", sparseopt.updaters.Adam),
                                                ("ftrl", sparseopt.updaters.Ftrl)])
def test_optimizer_names_convert_with_keras_defaults(name, updater_class):
    updater = from_keras_optimizer(name)
    assert type(updater) is updater_class
    assert hyper(to_keras_optimizer(updater).get_config()) == hyper(
        keras.optimizers.get(name).get_config())


REFUSED_FROM_KERAS = {
    "adadelta": (lambda: keras.optimizers.Adadelta(),
                 r"Adadelta for table 't' has no sparse.*nearest rule is "
                 r"keras.optimizers.RMSprop \(sparseopt.updaters.RMSprop\)"),
    "adadelta_by_name": (lambda: "adadelta", r"Adadelta.*no sparse, per-row equivalent"),
    "muon": (lambda: keras.optimizers.Muon(), r"Muon.*whole 2-D update.*nearest.*Adam"),
    "schedule_free": (lambda: keras.optimizers.ScheduleFreeAdamW(weight_decay=None),
                      r"ScheduleFreeAdamW.*every row every step.*nearest.*Adam"),
    "amsgrad": (lambda: keras.optimizers.Adam(amsgrad=True), r"amsgrad=True.*table 't'"),
    "clipnorm": (lambda: keras.optimizers.Adagrad(clipnorm=1.0),
                 r"`clipnorm=1.0`.*updater's own `clipnorm`"),
    "global_clipnorm": (lambda: keras.optimizers.Ftrl(global_clipnorm=1.0),
                        r"`global_clipnorm=1.0`"),
    "weight_decay": (lambda: keras.optimizers.Adagrad(weight_decay=0.01),
                     r"`weight_decay=0.01`.*updater's own `weight_decay`"),
    "ema_overwrite": (lambda: keras.optimizers.SGD(use_ema=True, ema_overwrite_frequency=5),
                      r"`ema_overwrite_frequency=5`"),
    "loss_scale_factor": (lambda: keras.optimizers.SGD(loss_scale_factor=8.0),
                          r"`loss_scale_factor=8.0`.*model's optimizer"),
    "gradient_accumulation": (lambda: keras.optimizers.Adagrad(gradient_accumulation_steps=2),
                              r"`gradient_accumulation_steps=2`"),
    "l2_shrinkage": (lambda: keras.optimizers.Ftrl(l2_shrinkage_regularization_strength=0.1),
                     r"l2_shrinkage_regularization_strength"),
    "callable_learning_rate": (lambda: keras.optimizers.SGD(lambda: 0.1),
                               r"unsupported learning rate"),
}


@pytest.mark.parametrize("case", sorted(REFUSED_FROM_KERAS))
@pytest.mark.backend_independent
def test_settings_without_a_sparse_meaning_are_refused(case):
    make, message = REFUSED_FROM_KERAS[case]
    with pytest.raises(ValueError, match=message):
        from_keras_optimizer(make(), table="t")


@keras.saving.register_keras_serializable(package="sparseopt_tests")
class _SignSGD(sparseopt.updaters.SGD):
    pass


@pytest.mark.parametrize("updater,message", [
    (sparseopt.updaters.RowwiseAdagrad(0.1), r"RowwiseAdagrad has no Keras optimizer"),
    (_SignSGD(0.1), r"_SignSGD has no Keras optimizer"),
    (sparseopt.updaters.Ftrl(0.1, multiply_linear_by_learning_rate=True),
     r"multiply_linear_by_learning_rate=True"),
    (sparseopt.updaters.Adagrad(0.1, clipnorm=1.0, clipvalue=0.5),
     r"Adagrad options \['clipnorm'\] have no Keras optimizer equivalent"),
    (sparseopt.updaters.SGD(0.1, momentum=0.9, lazy=False), r"SGD\(lazy=False\)"),
    (sparseopt.updaters.Adam(0.1, swa_period=5), r"Adam\(swa_period=...\) has no Keras"),
    (sparseopt.updaters.Adagrad(0.1, state_dtype="bfloat16"),
     r"Adagrad storage settings \[\"state_dtype='bfloat16'\"\] have no Keras"),
    (sparseopt.updaters.Adam(0.1, stochastic_rounding=False, rounding_seed=4),
     r"Adam storage settings \['stochastic_rounding=False', 'rounding_seed=4'\]"),
])
@pytest.mark.backend_independent
def test_updaters_without_a_keras_optimizer_are_refused(updater, message):
    with pytest.raises(ValueError, match=message):
        to_keras_optimizer(updater)


SPEC_FIELDS = {
    "SGD": [],
    "Adam": ["beta_1", "beta_2", "epsilon"],
    "Adagrad": ["initial_accumulator_value"],
    "Ftrl": ["learning_rate_power", "l1_regularization_strength",
             "l2_regularization_strength", "beta", "initial_accumulator_value"],
}


@pytest.mark.parametrize("case", ["sgd", "sgd_schedule", "adagrad", "adam", "ftrl"])
def test_sparsecore_spec_via_keras_rs_own_conversion_keeps_hyperparameters(case):
    pytest.importorskip("jax_tpu_embedding", reason="SparseCore specs: Linux x86-64 only")
    from sparseopt.updaters import from_sparsecore_spec, to_sparsecore_spec

    optimizer = PAIRS[case][0]()
    if isinstance(optimizer, keras.optimizers.Adagrad):
        optimizer = keras.optimizers.Adagrad(0.05, initial_accumulator_value=0.3)  # eps 1e-7
    updater = from_keras_optimizer(optimizer)
    spec = to_sparsecore_spec(updater)
    assert type(spec).__name__.upper().startswith(type(updater).__name__.upper())
    for field in SPEC_FIELDS[type(updater).__name__]:
        assert getattr(spec, field) == pytest.approx(getattr(updater, field), rel=1e-7)
    for step in [0, 7, 30]:  # a float, or keras-rs' callable for a schedule
        rate = spec.learning_rate(step) if callable(spec.learning_rate) else spec.learning_rate
        assert float(rate) == pytest.approx(float(updater.learning_rate_at(step)), rel=1e-6)
    again = from_sparsecore_spec(spec)
    assert type(again) is type(updater)
    assert {k: v for k, v in again.get_config().items() if k != "learning_rate"} == {
        k: v for k, v in updater.get_config().items() if k != "learning_rate"}


@pytest.mark.parametrize("updater", [
    sparseopt.updaters.AdagradMomentum(0.05, momentum=0.8, use_nesterov=True, exponent=3.0,
                                       beta_2=0.99, epsilon=1e-6, initial_accumulator_value=0.2),
    sparseopt.updaters.AdagradMomentum(SCHEDULE, momentum=0.9),
    sparseopt.updaters.LaProp(0.02, b1=0.8, b2=0.9, eps=1e-12),
    sparseopt.updaters.LaProp(SCHEDULE),
    sparseopt.updaters.FrequencyAwareAdagrad(0.05, rho=0.7, initial_accumulator_value=0.2,
                                             l1_regularization_strength=0.01,
                                             l2_regularization_strength=0.02,
                                             max_lr_multiplier=50.0),
])
def test_rules_sparsecore_has_and_keras_has_not_map_field_by_field(updater):
    """AdagradMomentum, LaProp, F2A: mapped directly to their specs, both ways."""
    pytest.importorskip("jax_tpu_embedding", reason="SparseCore specs: Linux x86-64 only")
    from sparseopt.updaters import from_sparsecore_spec, to_sparsecore_spec

    spec = to_sparsecore_spec(updater)
    spec_names = {"FrequencyAwareAdagrad": "F2AOptimizerSpec"}
    assert type(spec).__name__ == spec_names.get(type(updater).__name__,
                                                 f"{type(updater).__name__}OptimizerSpec")
    if isinstance(updater, sparseopt.updaters.FrequencyAwareAdagrad):
        fields = ["rho", "initial_accumulator_value", "l1_regularization_strength",
                  "l2_regularization_strength", "max_lr_multiplier"]
        assert [getattr(spec, f) for f in fields] == [getattr(updater, f) for f in fields]
        assert spec.initial_local_step_value == 0.0
    elif isinstance(updater, sparseopt.updaters.LaProp):
        assert (spec.b1, spec.b2, spec.eps, spec.initial_slot_value) == (
            updater.b1, updater.b2, updater.eps, 0.0)
        # The decay of `nu` on step t (1-based) is SparseCore's for the t - 1 steps before.
        for t in range(1, 6):
            d = updater.b2 * (1 - updater.b2 ** (t - 1)) / (1 - updater.b2 ** t)
            assert float(spec.get_decay_rate(t - 1)) == pytest.approx(d, rel=1e-6, abs=1e-7)
    else:
        assert (spec.momentum, spec.use_nesterov, spec.exponent, spec.beta2, spec.epsilon,
                spec.initial_accumulator_value) == pytest.approx(
            (updater.momentum, updater.use_nesterov, updater.exponent, updater.beta_2,
             updater.epsilon, updater.initial_accumulator_value))
    for step in [0, 7, 30]:
        rate = spec.learning_rate(step) if callable(spec.learning_rate) else spec.learning_rate
        assert float(rate) == pytest.approx(float(updater.learning_rate_at(step)), rel=1e-6)
    again = from_sparsecore_spec(spec)
    assert again.get_config() == updater.get_config()


@pytest.mark.parametrize("updater,message", [
    (sparseopt.updaters.Adagrad(0.1, epsilon=1e-5), r"epsilon"),
    (sparseopt.updaters.RowwiseAdagrad(0.1), r"RowwiseAdagrad has no Keras optimizer"),
    (sparseopt.updaters.SGD(0.1, momentum=0.9), r"momentum"),
    (sparseopt.updaters.Adam(0.1, clipvalue=1.0), r"Adam settings \['clipvalue'\]"),
    (sparseopt.updaters.Adam(0.1, ema_momentum=0.9), r"Adam settings \['ema_momentum'\]"),
    (sparseopt.updaters.SGD(0.1, lazy=False), r"SGD settings \['lazy=False'\]"),
    (sparseopt.updaters.PartialRowwiseAdam(0.1), r"PartialRowwiseAdam has no Keras optimizer"),
    # SparseCore stores float32 only; also for the rules it has and Keras has not.
    (sparseopt.updaters.Adagrad(0.1, state_dtype="float16"),
     r"Adagrad storage settings \[\"state_dtype='float16'\"\]: SparseCore stores"),
    (sparseopt.updaters.LaProp(0.1, state_dtype="bfloat16"), r"LaProp storage settings"),
    (sparseopt.updaters.Adam(0.1, swa_period=4), r"Adam settings \['swa_period'\]"),
    (sparseopt.updaters.RMSprop(0.1), r"RMSprop has no SparseCore optimizer spec"),
    (sparseopt.updaters.Adafactor(0.1, lazy=False), r"Adafactor settings \['lazy=False'\]"),
])
def test_settings_sparsecore_cannot_honour_are_refused(updater, message):
    pytest.importorskip("jax_tpu_embedding", reason="SparseCore specs: Linux x86-64 only")
    with pytest.raises(ValueError, match=message):
        sparseopt.updaters.to_sparsecore_spec(updater)


REGISTERED = registered_cases()


@pytest.mark.parametrize("case", sorted(REGISTERED))
@pytest.mark.backend_independent
def test_every_registered_updater_converts_both_ways_or_says_why_not(case):
    """Entries with a Keras equivalent round-trip; the others refuse by name."""
    entry, cfg = REGISTERED[case]
    updater = entry(0.05, **cfg)
    if entry.keras_optimizer is None:
        with pytest.raises(ValueError, match=f"{entry.__name__} has no Keras optimizer"):
            to_keras_optimizer(updater)
        return
    # A rule whose Keras form is its dense one (Adafactor) converts with lazy=False.
    named = list(cfg) + (["lazy=True"] if entry.dense_in_rule and updater.lazy else [])
    try:
        optimizer = to_keras_optimizer(updater)
    except ValueError as e:  # a setting Keras cannot express, said by name
        assert any(k in str(e) for k in named), e
        if entry.dense_in_rule and not cfg:  # ... and its dense form does convert
            updater = entry(0.05, **{**cfg, "lazy": False})
            assert from_keras_optimizer(to_keras_optimizer(updater)).get_config() == (
                {**updater.get_config(), "learning_rate": pytest.approx(0.05)})
        return
    assert isinstance(optimizer, entry.keras_optimizer)
    again = from_keras_optimizer(optimizer).get_config()
    assert again.pop("learning_rate") == pytest.approx(0.05)  # Keras keeps it in float32
    assert again == {k: v for k, v in updater.get_config().items() if k != "learning_rate"}


@pytest.mark.parametrize("spec_name,fixed", [
    ("AdagradMomentumOptimizerSpec", {"initial_momentum_value": 0.5}),
    ("LaPropOptimizerSpec", {"initial_slot_value": 0.1}),
    ("F2AOptimizerSpec", {"initial_local_step_value": 3.0}),
])
def test_sparsecore_settings_sparseopt_cannot_take_are_refused_by_name(spec_name, fixed):
    pytest.importorskip("jax_tpu_embedding", reason="SparseCore specs: Linux x86-64 only")
    from jax_tpu_embedding.sparsecore.lib.nn import embedding_spec

    spec = getattr(embedding_spec, spec_name)(learning_rate=0.1, **fixed)
    name = next(iter(fixed))
    with pytest.raises(ValueError, match=rf"{spec_name} with \{{'{name}'.*no sparseopt"):
        sparseopt.updaters.from_sparsecore_spec(spec)
