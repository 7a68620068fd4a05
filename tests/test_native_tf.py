"""The native TensorFlow op (`sparseopt.native`, `tf_ops.cc`) against the pure path it
replaces, bit for bit.

TensorFlow on CPU: the dedup and sum as one op on the workspace variable gives
the pure path's distinct ids (in the same order where TensorFlow's scatter
runs serially, below 1,024 ids), sums and workspace entries (the sink entry
of invalid ids included), for Hypothesis-drawn steps (bad ids, duplicates,
empty batches, bags with their weights, signed zeros, non-finite
gradients); whole training runs (per id, pooled bags, table groups, an int8
table) end with the same tables and state bit for bit with the op and
without it; with it, a step still has no vocabulary-sized tensor.
"""

import keras
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import sparseopt
from sparseopt import native
from tests.test_native import _same_bits, _train, both_dedups, records

pytestmark = pytest.mark.skipif(keras.backend.backend() != "tensorflow",
                                reason="the native op is a TensorFlow op")


def test_the_op_builds_and_loads_here_and_is_on_by_default():
    """On Linux with a C++ compiler it must (a broken build would only show as a lost
    speed-up); the switch turns it off."""
    assert native.build_error("tensorflow") is None and native.available("tensorflow")
    assert native.enabled("tf_dedup") and native.enabled("tf_disk_number")
    with native.disabled():
        assert not native.enabled("tf_dedup") and not native.enabled("tf_disk_number")


def _dedup(record, rows, use_native):
    import tensorflow as tf

    from sparseopt.backend import tensorflow as tf_backend

    native.set_enabled(use_native)
    try:
        space = tf.Variable(tf.fill([rows + 1], -7))
        distinct = tf_backend.dedup(record, rows, space)
        return [t.numpy() for t in distinct], space.numpy()
    finally:
        native.set_enabled(None)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=records())
def test_native_dedup_is_the_pure_dedup_bit_for_bit(case):
    import tensorflow as tf

    rows, ids = case[:2]
    got_space, want_space = both_dedups(_dedup, case, tf.constant)
    valid = (ids >= 0) & (ids < rows)
    np.testing.assert_array_equal(got_space[ids[valid]], want_space[ids[valid]])
    np.testing.assert_array_equal(got_space[rows], want_space[rows])  # the sink


def test_more_ids_than_the_scatter_runs_serially_for():
    """Past 1,024 ids TensorFlow's scatter runs in parallel and the pure path's
    order of distinct ids is whichever write landed: the same ids and sums,
    each id's sum bit for bit, in the op's order of last occurrence."""
    import tensorflow as tf

    rng = np.random.default_rng(3)
    rows, n = 5000, 20000
    ids = rng.integers(0, 800, n).astype(np.int64)
    ids[rng.random(n) < 0.01] = -1
    values = rng.normal(size=(n, 8)).astype(np.float32)
    record = sparseopt.records.RowGrads(tf.constant(ids), tf.constant(values))
    (uniq, summed, count), _ = _dedup(record, rows, True)
    (want_uniq, want_summed, want_count), _ = _dedup(record, rows, False)
    assert count == want_count == len(np.unique(ids[ids >= 0]))
    last = {int(i): p for p, i in enumerate(ids) if i >= 0}
    assert list(uniq) == sorted(last, key=last.get)
    order = np.argsort(want_uniq)
    np.testing.assert_array_equal(np.sort(uniq), want_uniq[order])
    _same_bits(summed[np.argsort(uniq)], want_summed[order])


@pytest.mark.parametrize("kind", ["ids", "bags", "groups", "int8"])
def test_training_with_the_op_is_training_without_it_bit_for_bit(kind):
    options = {"ids": {}, "bags": {"combiner": "sum"}, "groups": {"group": True},
               "int8": {"dtype": "int8", "group": True}}[kind]
    got, want = _train(True, **options), _train(False, **options)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        _same_bits(a, b)


def _op_types(model, data):
    import tensorflow as tf

    fn = tf.function(model.train_step).get_concrete_function(tf.nest.map_structure(
        lambda a: tf.TensorSpec((None,) + a.shape[1:], a.dtype), data))
    types = set()

    def walk(graph):
        types.update(op.type for op in graph.get_operations())
        for f in graph._functions.values():
            walk(f.graph)

    walk(fn.graph)
    return types


@pytest.mark.parametrize("use_native", [True, False])
def test_no_vocab_work_with_the_op_or_without(use_native):
    """The traced step has no vocabulary-sized tensor either way; the op is in it
    when on (and the pure path's workspace scatter is not), and not when off."""
    from tests.test_no_vocab_work import assert_no_vocab_work, make_model, vocab_sized_work

    native.set_enabled(use_native)
    try:
        model, data = make_model(sparseopt.DispatchOptimizer(keras.optimizers.Adam()))
        assert_no_vocab_work(vocab_sized_work(model, data))
        types = _op_types(model, data)
        assert ("SparseoptDedupSum" in types) == use_native
    finally:
        native.set_enabled(None)


@pytest.mark.parametrize("value,expected", [("0", "False"), (None, "True")])
def test_the_environment_switch_reaches_the_op(value, expected):
    """`SPARSEOPT_NATIVE=0` turns the op off for a process; unset, it is on."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "SPARSEOPT_NATIVE"}
    if value is not None:
        env["SPARSEOPT_NATIVE"] = value
    code = "from sparseopt import native; print(native.enabled('tf_dedup'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.strip().splitlines()
    assert out[-1] == expected
