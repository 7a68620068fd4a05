"""Each updater, trained through `fit`, equals the NumPy reference of its formula."""

import keras
import ml_dtypes
import numpy as np
import pytest

import sparseopt
from tests.conftest import to_np
from tests.helpers import (batches, dot_loss, kinds, numpy_replay, registered_cases,
                           table_model)

VOCAB, WIDTH, N_IDS, BATCH, STEPS = 300, 4, 5, 8, 50

# Every shipped updater, with each hyperparameter set its registry entry names.
REGISTRY = sparseopt.updaters.registry(shipped_only=True)
# ... and with the options every updater takes (sparseopt.updaters.core.transforms),
# two sets that together hold every option, each set on every updater. The
# table starts in [-0.05, 0.05]: the weight clips and max_norm bite.
OPTION_SETS = {
    "l2": {"weight_decay": 0.02, "weight_decay_mode": "l2", "clipvalue": 0.05,
           "clipnorm": 0.08, "clip_weight_min": -0.045, "clip_weight_max": 0.04},
    "decoupled": {"weight_decay": 0.3, "multiply_weight_decay_by_learning_rate": True,
                  "clipnorm": 0.05, "max_norm": 0.07},
}
CASES = {key: (entry.__name__, cfg) for key, (entry, cfg) in registered_cases().items()}
CASES.update({f"{name}:default+{label}": (name, {**entry.test_configs["default"], **options})
              for name, entry in REGISTRY.items() for label, options in OPTION_SETS.items()})
DEFAULTS = [f"{name}:default" for name in REGISTRY]
# One of each kind (`make test`): each updater on each of its code paths, and
# each option set on one updater; `make test-all` runs every case.
PATHS = sorted(registered_cases(paths_only=True))
KINDS = PATHS + ["Adam:default+l2", "SGD:default+decoupled"]
# Each mode on TF runs a different path (fused kernel, XLA rule, eager kernel):
# each updater on each of its paths. On JAX, Keras' `jit_compile=False` and
# `run_eagerly` run the same un-jitted step: one of them.
KERNEL_CASES = sorted(registered_cases(paths_only=True))
MODES = ["jit", "no_jit", "eager"] if keras.backend.backend() == "tensorflow" else ["jit", "eager"]


def slot_values(optimizer, table):
    return {k: to_np(v) for k, v in optimizer.table_state(table).items()}


def train(updater, xs, ys, dtype=None, **compile_kwargs):
    model, emb = table_model(VOCAB, WIDTH, N_IDS, updater, dtype=dtype)
    table0 = to_np(emb.embeddings)
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.1)),
                  loss=dot_loss, **compile_kwargs)
    model.fit(xs.reshape(-1, N_IDS), ys.reshape(-1, N_IDS, WIDTH), batch_size=BATCH,
              shuffle=False, verbose=0)
    return model, emb, table0


@pytest.mark.parametrize("case", kinds(sorted(CASES), KINDS))
def test_updater_matches_numpy_reference(case):
    name, cfg = CASES[case]
    rng = np.random.default_rng(1)
    # Ids drawn from the first 120 rows: rows 120.. are never touched.
    xs, ys = batches(rng, STEPS, BATCH, N_IDS, VOCAB, WIDTH, dup_vocab=120)
    updater = getattr(sparseopt.updaters, name)(learning_rate=0.05, **cfg)
    model, emb, table0 = train(updater, xs, ys)
    want_table, want_state = numpy_replay(name, cfg, table0, xs, ys, lambda t: 0.05)
    np.testing.assert_allclose(to_np(emb.embeddings), want_table, rtol=2e-5, atol=2e-6)
    got_state = slot_values(model.optimizer, emb.embeddings)
    assert sorted(got_state) == sorted(want_state)
    for k in want_state:
        np.testing.assert_allclose(got_state[k], want_state[k], rtol=2e-5, atol=2e-6)


# Every registered configuration, and each option set on one updater (the options
# act on float32 rows whatever the table's dtype; the write is what differs).
BF16_CASES = sorted(registered_cases()) + ["SGD:default+l2", "Adam:default+decoupled"]


# One of each kind: the write of a row, of float state and of integer state.
@pytest.mark.parametrize("case", kinds(BF16_CASES, ["SGD:default+l2", "Adam:default+decoupled",
                                                    "FrequencyAwareAdagrad:default"]))
def test_updater_matches_numpy_reference_in_bfloat16(case):
    """A bfloat16 table, float32 state: the reference rule, then the documented
    stochastic rounding of every row after each step (the same bits)."""
    from tests import reference

    name, cfg = CASES[case]
    rng = np.random.default_rng(1)
    xs, ys = batches(rng, 20, BATCH, N_IDS, VOCAB, WIDTH, dup_vocab=120)
    ys = ys.astype(ml_dtypes.bfloat16).astype(np.float32)  # the cotangents are bfloat16
    updater = getattr(sparseopt.updaters, name)(learning_rate=0.05, **cfg)
    model, emb, table0 = train(updater, xs, ys, dtype="bfloat16")
    assert emb.embeddings.dtype == "bfloat16"

    def stored(table, step):
        bits = reference.rounding_bits(0, 0, 0, step, np.arange(VOCAB), WIDTH)
        return reference.stochastic_round(table, "bfloat16", bits)

    want_table, want_state = numpy_replay(name, cfg, table0, xs, ys, lambda t: 0.05,
                                          stored=stored)
    got = to_np(emb.embeddings)
    # float32 arithmetic here, float64 there: a value within float32 rounding
    # of a rounding threshold can land on the other neighbour (one bfloat16
    # step), rarely; the rows may then drift apart by a step or two.
    spacing = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(want_table), 2.0**-126))) - 7)
    assert np.all(np.abs(got - want_table) <= 2 * spacing), case
    assert np.mean(got == want_table) > 0.98, case
    got_state = slot_values(model.optimizer, emb.embeddings)
    assert sorted(got_state) == sorted(want_state)
    for k in want_state:
        assert model.optimizer.table_state(emb.embeddings)[k].dtype in ("float32", "int32")
        np.testing.assert_allclose(got_state[k], want_state[k], rtol=1e-3, atol=1e-5,
                                   err_msg=k)


@pytest.mark.backend_independent
def test_every_registered_updater_has_an_independent_reference():
    from sparseopt.updaters.core import transforms
    from tests import reference

    assert set(REGISTRY) <= set(reference.RULES), "add its formula to tests/reference.py"
    tested = {k for options in OPTION_SETS.values() for k in options}
    assert tested == set(transforms.OPTIONS), "test every option against the reference"
    for name, entry in REGISTRY.items():
        assert "default" in entry.test_configs, name


# Optimizer state per row, in bytes, as docs/semantics.md states it (float32 tables of width D).
STATE_BYTES = {
    "SGD": lambda cfg, d: 4 * d if cfg.get("momentum") else 0,
    "Adagrad": lambda cfg, d: 4 * d,
    "RowwiseAdagrad": lambda cfg, d: 4,
    "AdagradMomentum": lambda cfg, d: 8 * d,
    "Adam": lambda cfg, d: 8 * d,
    "PartialRowwiseAdam": lambda cfg, d: 4 * d + 4,
    "LaProp": lambda cfg, d: 8 * d,
    "FrequencyAwareAdagrad": lambda cfg, d: 4 * d + 4,
    "Ftrl": lambda cfg, d: 8 * d,
    "RMSprop": lambda cfg, d: 4 * d * (1 + bool(cfg.get("momentum")) + bool(cfg.get("centered"))),
    "Adamax": lambda cfg, d: 8 * d,
    "Nadam": lambda cfg, d: 8 * d,
    "Lion": lambda cfg, d: 4 * d,
    "Lamb": lambda cfg, d: 8 * d,
    "Adafactor": lambda cfg, d: (4 if cfg.get("factored", True) else 4 * d)
    + (4 * d if cfg.get("beta_1") else 0),
}
# Whole-table state, in bytes per table (whatever its rows).
WHOLE_BYTES = {# vc, this step's row mean and scale; unfactored: the scale.
               "Adafactor": lambda cfg, d: 4 * d + 8 if cfg.get("factored", True) else 4}


def test_optimizer_state_is_the_documented_bytes_per_row():
    """Every registered configuration, as built: the rule's state, plus 4 bytes a row
    for `lazy=False`'s record and `4 D + 4` for `ema_momentum`."""
    rows, width = 64, 8
    assert set(STATE_BYTES) == set(REGISTRY), "document the new updater's state here"
    for key, (entry, cfg) in sorted(registered_cases().items()):
        want = STATE_BYTES[entry.__name__](cfg, width)
        want += 4 if cfg.get("lazy") is False else 0
        want += 4 * width + 4 if cfg.get("ema_momentum") is not None else 0
        model, emb = table_model(rows, width, 2, entry(0.05, **cfg), name=f"t{len(key)}")
        model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD()),
                      loss=dot_loss)
        # Built first (a shortcut, not the users' path): measures the state's bytes without training.
        model.optimizer.build(model.trainable_variables)
        state = model.optimizer.table_state(emb.embeddings).values()
        per_row = [v for v in state if len(v.shape) and v.shape[0] == rows]
        got = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in per_row)
        assert got == want * rows, (key, got / rows, want)
        whole = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in state
                    if not any(v is r for r in per_row))
        assert whole == WHOLE_BYTES.get(entry.__name__, lambda cfg, d: 0)(cfg, width), (
            key, whole)


@pytest.mark.parametrize("case", kinds(DEFAULTS + ["Ftrl:l1_l2_beta"],
                                        ["SGD:default", "Ftrl:l1_l2_beta", "Adam:default",
                                         "FrequencyAwareAdagrad:default"]))
def test_untouched_rows_and_state_unchanged_bit_for_bit(case):
    name, cfg = CASES[case]
    rng = np.random.default_rng(2)
    xs, ys = batches(rng, 10, BATCH, N_IDS, VOCAB, WIDTH, dup_vocab=120)
    updater = getattr(sparseopt.updaters, name)(learning_rate=0.05, **cfg)
    model, emb, table0 = train(updater, xs, ys)
    touched = np.unique(xs)
    untouched = np.setdiff1d(np.arange(VOCAB), touched)
    table = to_np(emb.embeddings)
    assert np.array_equal(table[untouched], table0[untouched])
    assert not np.any(np.all(table[touched] == table0[touched], axis=1))
    state0 = numpy_replay(name, cfg, table0, xs[:0], ys[:0], lambda t: 0.0)[1]
    for k, v in slot_values(model.optimizer, emb.embeddings).items():
        if v.ndim == 0 or v.shape[0] != VOCAB:  # whole-table state: no rows
            continue
        assert np.array_equal(v[untouched], state0[k][untouched].astype(np.float32))


def test_learning_rate_schedule_is_evaluated_at_the_training_step():
    cfg = {"initial_accumulator_value": 0.1, "epsilon": 1e-7}
    schedule = keras.optimizers.schedules.ExponentialDecay(0.2, decay_steps=5, decay_rate=0.5)
    rng = np.random.default_rng(3)
    xs, ys = batches(rng, 20, BATCH, N_IDS, VOCAB, WIDTH)
    model, emb, table0 = train(sparseopt.updaters.Adagrad(schedule, **cfg), xs, ys)
    want, _ = numpy_replay("Adagrad", cfg, table0, xs, ys, lambda t: 0.2 * 0.5 ** (t / 5))
    np.testing.assert_allclose(to_np(emb.embeddings), want, rtol=2e-5, atol=2e-6)


def test_option_schedules_are_evaluated_at_the_training_step():
    """Numeric options take schedules of the step, like the learning rate."""
    from tests import reference

    decay = keras.optimizers.schedules.ExponentialDecay(0.5, decay_steps=3, decay_rate=0.5)
    clip = keras.optimizers.schedules.PiecewiseConstantDecay([4], [0.02, 0.2])
    updater = sparseopt.updaters.SGD(0.05, momentum=0.5, weight_decay=decay, clipnorm=clip)
    again = sparseopt.updaters.SGD.from_config(updater.get_config())
    assert again.get_config() == updater.get_config()
    rng = np.random.default_rng(5)
    xs, ys = batches(rng, 8, BATCH, N_IDS, VOCAB, WIDTH)
    model, emb, table0 = train(again, xs, ys)
    table = table0.astype(np.float64)
    state = reference.initial_state("SGD", table.shape, {"momentum": 0.5})
    for t, (x, y) in enumerate(zip(xs, ys)):
        cfg = {"momentum": 0.5, "weight_decay": 0.5 * 0.5 ** (t / 3),
               "clipnorm": 0.02 if t <= 4 else 0.2}
        table, state = reference.sparse_step("SGD", table, state, x, y / x.shape[0], 0.05, cfg,
                                             step=t + 1)
    np.testing.assert_allclose(to_np(emb.embeddings), table, rtol=2e-5, atol=2e-6)


_DECAY = keras.optimizers.schedules.ExponentialDecay(0.9, decay_steps=4, decay_rate=0.5)
_STEPS = keras.optimizers.schedules.PiecewiseConstantDecay([3], [0.002, 0.02])
HYPER_SCHEDULES = {  # rule, constant config, {hyperparameter: (schedule, its value at t)}
    "SGD:momentum": ("SGD", {}, {"momentum": (_DECAY, lambda t: 0.9 * 0.5 ** (t / 4))}),
    "Adam:beta_1+epsilon": ("Adam", {"beta_2": 0.99}, {
        "beta_1": (_DECAY, lambda t: 0.9 * 0.5 ** (t / 4)),
        "epsilon": (_STEPS, lambda t: 0.002 if t <= 3 else 0.02)}),
    "Ftrl:l1": ("Ftrl", {"l2_regularization_strength": 0.01},
                {"l1_regularization_strength": (_STEPS, lambda t: 0.002 if t <= 3 else 0.02)}),
    "AdagradMomentum:momentum+beta_2": ("AdagradMomentum", {}, {
        "momentum": (_DECAY, lambda t: 0.9 * 0.5 ** (t / 4)),
        "beta_2": (_DECAY, lambda t: 0.9 * 0.5 ** (t / 4))}),
}


@pytest.mark.parametrize("case", sorted(HYPER_SCHEDULES))
def test_rule_hyperparameter_schedules_are_evaluated_at_the_training_step(case):
    """Every float hyperparameter of a rule may be a schedule of the step."""
    from tests import reference

    name, cfg, schedules = HYPER_SCHEDULES[case]
    cls = getattr(sparseopt.updaters, name)
    updater = cls(0.05, **cfg, **{k: s for k, (s, _) in schedules.items()})
    assert sorted(updater.scheduled) == sorted(schedules)
    assert updater.fused_kernel() is None  # TF's kernels take constants
    again = cls.from_config(updater.get_config())
    assert again.get_config() == updater.get_config()
    rng = np.random.default_rng(6)
    xs, ys = batches(rng, 8, BATCH, N_IDS, VOCAB, WIDTH)
    model, emb, table0 = train(again, xs, ys)
    table = table0.astype(np.float64)
    state = reference.initial_state(name, table.shape,
                                    {**cfg, **{k: f(0) for k, (_, f) in schedules.items()}})
    for t, (x, y) in enumerate(zip(xs, ys)):
        cfg_t = {**cfg, **{k: f(t) for k, (_, f) in schedules.items()}}
        table, state = reference.sparse_step(name, table, state, x, y / x.shape[0], 0.05,
                                             cfg_t, step=t + 1)
    np.testing.assert_allclose(to_np(emb.embeddings), table, rtol=5e-5, atol=2e-6)


@pytest.mark.backend_independent
def test_scheduled_hyperparameters_that_cannot_be_honoured_are_refused_by_name():
    momentum = sparseopt.updaters.SGD(0.1, momentum=_DECAY)
    with pytest.raises(ValueError, match=r"SGD with schedules for \['momentum'\] has no Keras"):
        sparseopt.updaters.to_keras_optimizer(momentum)
    with pytest.raises(ValueError, match=r"SGD\(lazy=False\) with schedules for \['momentum'\]"):
        sparseopt.updaters.SGD(0.1, momentum=_DECAY, lazy=False)
    with pytest.raises(TypeError,
                       match=r"Adam: `beta_1` must be a float or a LearningRateSchedule"):
        sparseopt.updaters.Adam(0.1, beta_1="0.9")


@pytest.mark.parametrize("mode", MODES)
# One of each kind: each TF kernel (and one updater with none, the rule).
@pytest.mark.parametrize("case", kinds(KERNEL_CASES, [
    c for c in KERNEL_CASES if CASES[c][0] in ("SGD", "Ftrl", "Adam")
    or c == "Adagrad:no_epsilon"]))
def test_compiled_and_eager_steps_agree(mode, case):
    """Each mode (on TF: fused kernel, XLA rule, eager kernel) gives the reference."""
    kwargs = {"jit": {"jit_compile": True}, "no_jit": {"jit_compile": False},
              "eager": {"run_eagerly": True}}[mode]
    name, cfg = CASES[case]
    rng = np.random.default_rng(4)
    xs, ys = batches(rng, 6, BATCH, N_IDS, VOCAB, WIDTH)
    model, emb, table0 = train(getattr(sparseopt.updaters, name)(0.05, **cfg), xs, ys, **kwargs)
    want, _ = numpy_replay(name, cfg, table0, xs, ys, lambda t: 0.05)
    np.testing.assert_allclose(to_np(emb.embeddings), want, rtol=2e-5, atol=2e-6)


def workspace(size, fill=0):
    """An int32 dedup workspace, for backends that need one (else None)."""
    from sparseopt import backend

    if not backend.WORKSPACE:
        return None
    return keras.Variable(np.full(size, fill, "int32"), dtype="int32", trainable=False)


# JAX's dedup runs under XLA in every fit test; TF's also runs outside XLA.
@pytest.mark.parametrize("xla", [False, True] if keras.backend.backend() == "tensorflow"
                         else [False])
@pytest.mark.parametrize("stale", kinds([0, 7, -1], [7]))
@pytest.mark.parametrize("num_rows", [50, 1000])  # fewer rows than ids, and more
@pytest.mark.parametrize("compiled", [False, True] if keras.backend.backend() == "tensorflow"
                         else [True])
def test_backend_dedup_matches_numpy_unique_and_sum(stale, num_rows, xla, compiled,
                                                    monkeypatch):
    """Also with a workspace holding stale positions of an earlier step, and
    compiled by XLA (on TF, where its dynamic shapes once lost valid ids; and
    TF's dedup of few ids, which runs op by op, forced to its compiled form)."""
    from sparseopt import backend
    from sparseopt.records import RowGrads

    if keras.backend.backend() == "tensorflow" and compiled:
        from sparseopt.backend import tensorflow_distinct

        monkeypatch.setattr(tensorflow_distinct, "COMPILED_DEDUP_MIN_IDS", 1)

    rng = np.random.default_rng(9)
    ids = rng.integers(-3, 60, size=500).astype("int32")
    ids[0] = 1003  # an invalid id first: the XLA case that failed
    ids[1:50] = 7
    ids[50:60] = 1003  # out of range for both
    grads = rng.normal(size=(500, 3)).astype("float32")
    space = workspace(num_rows + 8, stale)

    def run(i, g):
        return backend.dedup(RowGrads(i, g), num_rows, space)

    if xla:
        import tensorflow as tf
        run = tf.function(run, jit_compile=True)
    uniq, summed, count = (to_np(t) for t in run(keras.ops.convert_to_tensor(ids),
                                                 keras.ops.convert_to_tensor(grads)))
    keep = uniq < num_rows
    # The distinct ids come first: gather, rule and scatter take those only.
    assert keep[:int(count)].all() and not keep[int(count):].any()
    valid = (ids >= 0) & (ids < num_rows)
    want_ids = np.unique(ids[valid])
    np.testing.assert_array_equal(np.sort(uniq[keep]), want_ids)
    order = np.argsort(uniq[keep])
    want = np.stack([grads[ids == i].sum(0) for i in want_ids])
    np.testing.assert_allclose(summed[keep][order], want, rtol=1e-5, atol=1e-5)
    assert len(set(uniq.tolist())) == len(uniq)  # padding ids are distinct too
    np.testing.assert_array_equal(summed[~keep], 0)


def test_several_steps_per_execution_apply_every_step():
    cfg = {"initial_accumulator_value": 0.1, "epsilon": 1e-7}
    rng = np.random.default_rng(10)
    xs, ys = batches(rng, 8, BATCH, N_IDS, VOCAB, WIDTH, dup_vocab=50)
    model, emb, table0 = train(sparseopt.updaters.Adagrad(0.05, **cfg), xs, ys,
                               steps_per_execution=4)
    want, _ = numpy_replay("Adagrad", cfg, table0, xs, ys, lambda t: 0.05)
    np.testing.assert_allclose(to_np(emb.embeddings), want, rtol=2e-5, atol=2e-6)


@pytest.mark.skipif(keras.backend.backend() != "jax",
                    reason="JAX's dedup pads its result with ids past the table; TF's returns "
                           "exactly the distinct valid ids (no padding to wrap)")
def test_dedup_padding_never_wraps_to_a_real_row_near_int32_limit():
    from sparseopt.backend.jax_rows import padding_ids

    num_rows = 2**31 - 10  # padding ids num_rows + i would overflow int32
    # A workspace for 2**31 rows is 8 GB; the padding ids are all that
    # depends on num_rows there, so check those directly.
    pad = to_np(padding_ids(num_rows, 20)).astype(np.int64)
    assert np.all(pad >= num_rows) and np.all(pad < 2**31)
    np.testing.assert_array_equal(to_np(padding_ids(1000, 20)), 1000 + np.arange(20))
