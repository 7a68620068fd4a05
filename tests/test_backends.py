"""The same numbers on JAX and TensorFlow, and TF's own kernels where they fit."""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from keras import ops

import sparseopt
from tests import reference
from tests.conftest import to_np
from tests.helpers import (ROOT, OneHotEmbedding, child_env, dot_loss, kinds, optimizer_state,
                           table_model)

BACKEND = keras.backend.backend()


def test_duplicate_ids_are_summed_before_adagrad():
    """The measured Keras-3-on-TF trap: ids [1, 1, 2] in each of 4 examples.

    Plain `keras.optimizers.Adagrad` on TF applies an Embedding's
    IndexedSlices per occurrence (acc grows by the sum of squares, not the
    square of the sum) and ends at row 1 = -0.107; summing first gives 0.273.
    """
    ids = keras.Input((3,), dtype="int32")
    emb = sparseopt.layers.SparseEmbedding(
        4, 1, updater=sparseopt.updaters.Adagrad(0.1), combiner="sum",
        embeddings_initializer=keras.initializers.Constant(0.5), name="emb")
    model = keras.Model(ids, emb(ids))
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD()),
                  loss=lambda y_true, y_pred: ops.mean(y_pred))
    x = np.tile(np.array([[1, 1, 2]], "int32"), (4, 1))
    for _ in range(3):
        model.train_on_batch(x, np.zeros((4, 1), "float32"))

    # NumPy: each occurrence's gradient is 1/4 (mean over 4 examples).
    grads = np.full((12, 1), 0.25)
    table, state = np.full((4, 1), 0.5), reference.initial_state("Adagrad", (4, 1), {})
    per_occurrence = table.copy()
    acc = state["accumulator"].copy()
    for _ in range(3):
        table, state = reference.sparse_step("Adagrad", table, state, x, grads, 0.1, {})
        for i, g in zip(x.reshape(-1), grads[:, 0]):  # the trap, for contrast
            acc[i] += g * g
        for i in (1, 2):
            n = int((x == i).sum())
            per_occurrence[i] -= 0.1 * n * 0.25 / np.sqrt(acc[i] + 1e-7)
    got = to_np(emb.embeddings)
    np.testing.assert_allclose(got, table, rtol=1e-5)
    assert round(float(got[1, 0]), 3) == 0.273
    assert round(float(per_occurrence[1, 0]), 3) == -0.107
    assert got[0, 0] == 0.5 and got[3, 0] == 0.5


# -- one model, one init, one data stream, on both backends -------------------

TABLES = {  # name: (updater, rows, id columns, combiner)
    "adagrad": (lambda: sparseopt.updaters.Adagrad(0.1), 50, slice(0, 3), "sum"),
    "rowwise": (lambda: sparseopt.updaters.RowwiseAdagrad(0.2, epsilon=1e-3), 50, slice(0, 3), "mean"),
    "ftrl": (lambda: sparseopt.updaters.Ftrl(0.1, l1_regularization_strength=0.01, beta=0.1),
             40, slice(3, 6), "sum"),
    "sgd": (lambda: sparseopt.updaters.SGD(0.05), 40, slice(3, 6), None),
}


def train_reference_model():
    """Trains the shared model from a NumPy init; returns every variable by path."""
    rng = np.random.default_rng(7)
    ids = keras.Input((6,), dtype="int32")
    parts = []
    for name, (make, rows, cols, combiner) in TABLES.items():
        emb = sparseopt.layers.SparseEmbedding(rows, 4, updater=make(), combiner=combiner,
                                               name=name)
        out = emb(ids[:, cols])
        parts.append(out if combiner else keras.layers.Flatten()(out))
    x = keras.layers.Dense(8, activation="relu", name="hidden")(keras.layers.Concatenate()(parts))
    model = keras.Model(ids, keras.layers.Dense(1, name="out")(x))
    for v in model.weights:  # the same init on both backends (probes: TF weights only)
        if v.trainable and getattr(v, "_sparseopt_probe_of", None) is None:
            v.assign(rng.uniform(-0.5, 0.5, v.shape).astype("float32"))
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.Adam(1e-2)), loss="mse")
    xs = rng.integers(0, 40, size=(320, 6)).astype("int32")
    xs[::5, 0] = xs[::5, 1]  # duplicates within a bag
    xs[::7, 4] = -1  # padding: dropped
    ys = rng.normal(size=(320, 1)).astype("float32")
    model.fit(xs, ys, batch_size=16, epochs=2, shuffle=False, verbose=0)
    # The lookups' probes (weights on TF only, values unused) are left out.
    out = {v.path: keras.ops.convert_to_numpy(v).tolist() for v in model.weights
           if getattr(v, "_sparseopt_probe_of", None) is None}
    out.update({"optimizer/" + v.path: keras.ops.convert_to_numpy(v).tolist()
                for v in optimizer_state(model.optimizer)})
    return out


# Once per `make test` (it trains on both backends either way: here and in a child),
# in the TensorFlow session (the two sessions' times balanced).
@pytest.mark.backend_independent
def test_same_model_init_and_data_give_the_same_weights_on_both_backends(tmp_path):
    other = "tensorflow" if BACKEND == "jax" else "jax"
    out = tmp_path / "other.json"
    code = ("import json, sys; from tests.test_backends import train_reference_model; "
            "json.dump(train_reference_model(), open(sys.argv[1], 'w'))")
    subprocess.run([sys.executable, "-c", code, str(out)], check=True, cwd=ROOT,
                   env=child_env(other))
    theirs, ours = json.loads(out.read_text()), train_reference_model()
    assert sorted(theirs) == sorted(ours)
    tables = [p for p in ours if p.endswith("/embeddings")]
    assert len(tables) == 4
    for path in ours:
        np.testing.assert_allclose(np.asarray(ours[path]), np.asarray(theirs[path]),
                                   rtol=1e-4, atol=1e-5, err_msg=f"{path}: {BACKEND} vs {other}")
    # the comparison covers every table's state and the dense optimizer's
    assert any(p.endswith("ftrl_embeddings_linear") for p in ours)
    assert any("adam" in p and "hidden_kernel" in p for p in ours)


# -- TensorFlow's fused sparse-apply kernels ---------------------------------

KERNELS = {  # updater -> the TF op that must apply it (None: the keras.ops rule)
    "sgd": (lambda: sparseopt.updaters.SGD(0.1), "ResourceScatterSub"),
    "adagrad_no_epsilon": (lambda: sparseopt.updaters.Adagrad(0.1, epsilon=0.0),
                           "ResourceSparseApplyAdagradV2"),
    "ftrl": (lambda: sparseopt.updaters.Ftrl(0.1, beta=0.5), "ResourceSparseApplyFtrl"),
    "adagrad_keras_epsilon": (lambda: sparseopt.updaters.Adagrad(0.1), None),
    "rowwise": (lambda: sparseopt.updaters.RowwiseAdagrad(0.1), None),
}


# `make test`: every case traced, and one with a kernel under XLA (which has none).
MODES = [f"{case}-{jit}" for jit in ("traced", "xla") for case in sorted(KERNELS)]


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow kernels")
@pytest.mark.parametrize("mode", kinds(MODES, [m for m in MODES if m.endswith("-traced")]
                                       + ["ftrl-xla"]))
def test_tensorflow_applies_its_own_kernel_where_the_rule_matches(mode):
    import tensorflow as tf

    case, jit_compile = mode.split("-")[0], mode.endswith("-xla")

    make, kernel = KERNELS[case]
    ids = keras.Input((4,), dtype="int32")
    emb = sparseopt.layers.SparseEmbedding(100, 3, updater=make(), combiner="sum", name="emb")
    model = keras.Model(ids, keras.layers.Dense(1)(emb(ids)))
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.Adam()), loss="mse")
    data = (np.zeros((8, 4), "int32"), np.zeros((8, 1), "float32"))
    model.train_on_batch(*data)
    step = tf.function(model.train_step, jit_compile=jit_compile)
    graph = step.get_concrete_function(
        (tf.TensorSpec((None, 4), tf.int32), tf.TensorSpec((None, 1), tf.float32))).graph
    ops_used = set()

    def walk(g):
        ops_used.update(op.type for op in g.get_operations())
        for f in g._functions.values():
            walk(f.graph)

    walk(graph)
    sparse_apply_ops = {o for o in ops_used if o.startswith("ResourceSparseApply")
                        or o == "ResourceScatterSub"}
    if kernel is None or jit_compile:  # XLA has no sparse-apply kernels
        assert sparse_apply_ops == set()
        assert "ResourceScatterUpdate" in ops_used
    else:
        assert sparse_apply_ops == {kernel}


@pytest.mark.skipif(BACKEND != "tensorflow", reason="tf.function's tracing")
def test_an_optimizer_built_before_fit_lets_tensorflow_trace_the_first_step_once():
    """docs/backends.md: built up front, the tables' state (and the wrapped Adam's) exists
    before the step is traced; built by Keras inside the trace (the control), the
    step is traced again after the variables are created."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 50, (64, 3)).astype("int32")
    y = rng.normal(size=(64, 3, 4)).astype("float32")

    def traces(build_first):
        model, _ = table_model(50, 4, 3, sparseopt.updaters.Adagrad(0.1))
        model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.Adam(0.1)),
                      loss=dot_loss)
        if build_first:
            model.optimizer.build(model.trainable_variables)
        step, traced = model.train_step, []

        def counted(data):  # runs once per trace of the step
            traced.append(1)
            return step(data)

        model.train_step = counted
        model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
        return len(traced)

    assert (traces(True), traces(False)) == (1, 2)


# One table per updater (its default), and Adafactor's whole-table form, whose state
# hands old values on (`log_decay_before`): the cases a build could set up apart.
BUILD_UPDATERS = ([entry(0.05, **entry.test_configs["default"])
                   for entry in sparseopt.updaters.registry(shipped_only=True).values()]
                  + [sparseopt.updaters.Adafactor(0.05, lazy=False)])


@pytest.mark.skipif(BACKEND != "tensorflow", reason="on JAX Keras builds the optimizer "
                    "before tracing the step either way (`fit`'s symbolic build)")
def test_an_optimizer_built_before_fit_trains_exactly_as_one_built_by_fit():
    """Built up front (docs/backends.md: one trace on TensorFlow) or by Keras inside the
    first step: every table, its state and the dense layer end bit for bit the same.
    (On TensorFlow, `variable.value` is the live variable: a rule's old whole-slot value
    read after the step assigned it once made Adafactor, lazy or not, diverge here.)"""
    n = len(BUILD_UPDATERS)
    rng = np.random.default_rng(3)
    x = rng.integers(0, 30, (48, 2 * n)).astype("int32")
    y = rng.normal(size=(48, 1)).astype("float32")

    def trained(build_first):
        keras.backend.clear_session(free_memory=False)
        keras.utils.set_random_seed(1)
        ids = keras.Input((2 * n,), dtype="int32")
        rows = [sparseopt.layers.SparseEmbedding(30, 4, updater=updater, name=f"t{i}")(
            ids[:, 2 * i:2 * i + 2]) for i, updater in enumerate(BUILD_UPDATERS)]
        flat = keras.layers.Flatten()(keras.layers.Concatenate()(rows))
        model = keras.Model(ids, keras.layers.Dense(1, name="head")(flat))
        model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.Adam(0.01)),
                      loss="mse")
        if build_first:
            model.optimizer.build(model.trainable_variables)
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        return ({v.path: to_np(v) for v in model.weights},
                {v.path: to_np(v) for v in optimizer_state(model.optimizer)})

    (weights, state), (weights_first, state_first) = trained(False), trained(True)
    assert sorted(state) == sorted(state_first) and len(state) > 3 * n
    for got, want in ((weights_first, weights), (state_first, state)):
        for path in want:
            np.testing.assert_array_equal(got[path], want[path], err_msg=path)


def test_each_backend_provides_the_whole_contract_and_nothing_is_a_none_stub():
    """Both backend modules define every name of `backend.contract`, none None; the package
    exposes the active one's (a module missing a name is refused: the control)."""
    import importlib
    import types

    from sparseopt import backend
    from sparseopt.backend.contract import CONTRACT

    for name in ("jax", "tensorflow"):
        module = importlib.import_module(f"sparseopt.backend.{name}")
        assert backend.check(module) == [], name
    active = importlib.import_module(f"sparseopt.backend.{keras.backend.backend()}")
    assert all(getattr(backend, name) is getattr(active, name) for name in CONTRACT)
    partial = types.SimpleNamespace(**{name: getattr(active, name) for name in CONTRACT})
    partial.dedup, partial.trace_forward = None, None
    del partial.tap
    assert backend.check(partial) == ["tap", "dedup", "trace_forward"]


def test_fill_in_blocks_gives_the_blocks_in_order_on_either_backend():
    """Where `FILLS_IN_BLOCKS` is false (TF) it still does what the contract says."""
    from sparseopt import backend

    def block(i, shape):
        return np.full(shape, float(i), "float32") + np.arange(shape[0])[:, None]

    got = to_np(backend.fill_in_blocks(block, (7, 2), "float32", 3))
    want = np.concatenate([block(0, (3, 2)), block(1, (3, 2)), block(2, (1, 2))])
    np.testing.assert_array_equal(got, want)
    if not backend.ROW_SHARDS:
        table = keras.Variable(np.zeros((4, 2), "float32"), name="t")
        with pytest.raises(ValueError, match="'t'.*never split by rows"):
            backend.on_row_shards(None, None, [table], None, None)


@settings(max_examples=25, deadline=None)
@given(keys=st.lists(st.tuples(st.integers(-2, 1), st.integers(-3, 3)), min_size=1,
                     max_size=40),
       seed=st.integers(0, 2**16), k=st.integers(1, 12))
def test_the_batch_dedup_plumbing_matches_plain_python(keys, seed, k):
    """`first_occurrences` (a hash dedup: JAX a scratch table, TF `tf.unique`), `first_true`
    and `scatter_min` against Python loops, on few distinct keys (many repeats, pairs
    that share a half)."""
    from sparseopt import backend

    rng = np.random.default_rng(seed)
    high = np.array([h for h, _ in keys], "int32")
    low = np.array([lo for _, lo in keys], "int32")
    active = rng.random(len(keys)) < 0.7
    first, want = {}, []
    for i, key in enumerate(keys):
        want.append(first.setdefault(key, i) if active[i] else i)
    got = to_np(backend.first_occurrences(ops.convert_to_tensor(high),
                                          ops.convert_to_tensor(low),
                                          ops.convert_to_tensor(active)))
    np.testing.assert_array_equal(got, want)

    trues = list(np.nonzero(active)[0][:k])
    padded = trues + [-1] * (k - len(trues))  # (static shapes: JAX)
    got = to_np(backend.first_true(ops.convert_to_tensor(active), k)).tolist()
    assert got == (padded if keras.backend.backend() == "jax" else trues)

    var = keras.Variable(np.full((5,), 10, "int32"), dtype="int32", trainable=False)
    ids = rng.integers(0, 5, len(keys)).astype("int32")
    values = rng.integers(-20, 20, len(keys)).astype("int32")
    backend.scatter_min(var, ops.convert_to_tensor(ids), ops.convert_to_tensor(values),
                        ops.convert_to_tensor(active))
    expect = np.full((5,), 10)
    for i, v, a in zip(ids, values, active):
        if a:
            expect[i] = min(expect[i], v)
    np.testing.assert_array_equal(to_np(var), expect)


# docs/backends.md "Plain Keras on TensorFlow": Keras' dense optimizers get an
# `Embedding`'s gradient as `IndexedSlices` there, duplicates unsummed. The model, data
# and training loop are benchmarks/keras_tf_duplicates.py's (20 rows, each looked up 4
# times a batch, 5 steps); the reference is Keras' optimizer on the dense gradient (a
# one-hot matmul table), which is what Keras on JAX computes.
GAP_CASES = {
    "Adagrad": (lambda: keras.optimizers.Adagrad(0.1),
                lambda: sparseopt.updaters.Adagrad(0.1)),
    "Adafactor": (lambda: keras.optimizers.Adafactor(0.1),
                  lambda: sparseopt.updaters.Adafactor(0.1, lazy=False)),
    "SGD(global_clipnorm=0.01)": (lambda: keras.optimizers.SGD(0.1, global_clipnorm=0.01),
                                  lambda: sparseopt.updaters.SGD(0.1)),
}


@pytest.mark.parametrize("case", sorted(GAP_CASES))
def test_tables_get_the_summed_gradients_result_where_plain_keras_on_tf_does_not(case):
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "keras_tf_duplicates", os.path.join(ROOT, "benchmarks", "keras_tf_duplicates.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    keras_optimizer, updater = GAP_CASES[case]
    xs, ys, table0 = bench.data()
    rows, width = table0.shape
    dense = bench.trained(OneHotEmbedding(rows, width), keras_optimizer(), xs, ys, table0)
    plain = bench.trained(keras.layers.Embedding(rows, width), keras_optimizer(), xs, ys,
                          table0)
    ours = bench.trained(sparseopt.layers.SparseEmbedding(rows, width, updater()),
                         sparseopt.DispatchOptimizer(keras_optimizer()), xs, ys, table0)
    np.testing.assert_allclose(ours, dense, rtol=1e-5, atol=1e-6)
    gap = np.abs(plain - dense).max()
    if BACKEND == "tensorflow":  # Keras' own, measured 1e-4 to 1e-1: docs/backends.md
        assert gap > 1e-5, gap
    else:  # the same dense gradient (0 here; rounding apart on other XLA versions)
        assert gap <= 1e-6, gap


@pytest.mark.skipif(keras.backend.backend() != "tensorflow",
                    reason="JAX orders host calls as effects (a token through every one)")
def test_host_calls_inside_run_if_stay_in_program_order():
    # A conditional over variables (Lookahead's sync, an accumulated update) holding host
    # calls (a table on disk): they run after the host calls before it and before those
    # after it, even where nothing else orders them (on TensorFlow a cond over variables
    # is ordered by its variables only, and ran its host read before a slower host write).
    import time

    import tensorflow as tf

    from sparseopt import backend

    log = []
    flag = keras.Variable(0, dtype="int32", trainable=False)

    def write(x):
        time.sleep(0.05)
        log.append("write")

    def read(x):
        log.append("read")
        return (np.int32(1),)

    def after(x):
        log.append("after")

    def step(x):
        backend.host_write(write, [x])

        def taken():
            backend.host_read(read, [flag.value], [((), "int32")])
            flag.assign(flag.value + 1)

        backend.run_if(ops.greater(x, 0), taken, [flag])
        backend.host_write(after, [x])
        return x

    traced = tf.function(step)
    for _ in range(3):
        traced(tf.constant(1))
    assert log == ["write", "read", "after"] * 3
