"""The tests of Keras PR #21196 (the `DispatchOptimizer` this project grew from), ported.

Written against sparseopt's public API: the PR's per-variable optimizer is a
variable's `optimizer` attribute, which `sparseopt.DispatchOptimizer`
honours, as it honours `optimizer_map` entries and the Keras optimizers a
layer declares in `variable_path_to_optimizer_map`. Stateless (`stateless_apply`)
on JAX, stateful (`apply`) on TensorFlow, as in the PR. Expected values are
the PR's: plain SGD by hand.
"""

import keras
import numpy as np
import pytest
from keras import ops

import sparseopt
from tests.conftest import to_np
from tests.helpers import dot_loss

STATELESS = keras.backend.backend() == "jax"
GRADS = [[1.0, 6.0, 7.0, 2.0], [2.0, 12.0, 14.0, 4.0], [3.0, 18.0, 21.0, 6.0]]
START = [[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [9.0, 10.0, 11.0, 12.0]]
# SGD(0.5) on the first variable, SGD(0.1) on the other two.
WANT = [[0.5, -1.0, -0.5, 3.0], [4.8, 4.8, 5.6, 7.6], [8.7, 8.2, 8.9, 11.4]]


def _step(optimizer, variables, grads):
    """One step, stateless on JAX and stateful on TF; returns the new values."""
    grads = [ops.array(g) for g in grads]
    if STATELESS:
        optimizer.build(variables)
        values, _ = optimizer.stateless_apply(optimizer.variables, grads, variables)
        return [to_np(v) for v in values]
    optimizer.apply(grads, variables)
    return [to_np(v) for v in variables]


def test_config():
    default_optimizer = keras.optimizers.SGD(learning_rate=0.5, momentum=0.06, nesterov=True,
                                             weight_decay=0.004)
    optimizer = sparseopt.DispatchOptimizer(default_optimizer)
    config = optimizer.get_config()
    restored = sparseopt.DispatchOptimizer.from_config(config)
    assert restored.get_config() == config
    revived = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(optimizer))
    assert isinstance(revived, sparseopt.DispatchOptimizer)
    assert revived.optimizer.get_config() == default_optimizer.get_config()


def test_step():
    optimizer = sparseopt.DispatchOptimizer(keras.optimizers.SGD(learning_rate=0.5))
    got = _step(optimizer, [keras.Variable(START[0])], GRADS[:1])
    np.testing.assert_allclose(got, WANT[:1], rtol=1e-4, atol=1e-4)


def test_per_variable_optimizers():
    default_optimizer = keras.optimizers.SGD(learning_rate=0.5)
    per_variable_optimizer = keras.optimizers.SGD(learning_rate=0.1)
    optimizer = sparseopt.DispatchOptimizer(default_optimizer)
    variables = [keras.Variable(v) for v in START]
    # Two variables share the same optimizer.
    variables[1].optimizer = per_variable_optimizer
    variables[2].optimizer = per_variable_optimizer
    got = _step(optimizer, variables, GRADS)
    np.testing.assert_allclose(got, WANT, rtol=1e-4, atol=1e-4)
    # One optimizer for both, built once on the two, stepped once.
    assert [id(o) for o in optimizer.dense_optimizers] == [id(default_optimizer),
                                                           id(per_variable_optimizer)]
    if not STATELESS:
        assert int(to_np(per_variable_optimizer.iterations)) == 1


@pytest.mark.parametrize("pattern", ["exact", "regex"])
def test_one_optimizer_shared_by_two_optimizer_map_entries_steps_once(pattern):
    shared = keras.optimizers.SGD(learning_rate=0.1)
    keys = (["v1", "v2"] if pattern == "exact" else ["v[1]", "v[2]"])
    optimizer = sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.5),
                                            optimizer_map={k: shared for k in keys})
    variables = [keras.Variable(v, name=n) for v, n in zip(START, ["v0", "v1", "v2"])]
    got = _step(optimizer, variables, GRADS)
    np.testing.assert_allclose(got, WANT, rtol=1e-4, atol=1e-4)
    assert len(optimizer.dense_optimizers) == 2


def test_iterations_update():
    optimizer = sparseopt.DispatchOptimizer(keras.optimizers.SGD(learning_rate=0.5))
    variables = [keras.Variable(START[0])]
    optimizer.build(variables)
    opt_vars = optimizer.variables
    grads = [ops.array(GRADS[0])]
    assert int(to_np(optimizer.iterations)) == 0
    for i in range(3):
        if STATELESS:
            _, opt_vars = optimizer.stateless_apply(opt_vars, grads, variables)
            for ref, value in zip(optimizer.variables, opt_vars):
                ref.assign(value)
        else:
            optimizer.apply(grads, variables)
        assert int(to_np(optimizer.iterations)) == i + 1


class TableAndFrozenHead(keras.layers.Layer):
    """Declares an updater for its table and a Keras optimizer for its kernel."""

    def __init__(self, head_optimizer, **kwargs):
        super().__init__(**kwargs)
        self.head_optimizer = head_optimizer

    def build(self, input_shape):
        self.table = self.add_weight(shape=(50, 4), name="table")
        self.kernel = self.add_weight(shape=(4, 1), name="kernel")
        self.bias = self.add_weight(shape=(1,), name="bias", initializer="ones")
        self.lookup = sparseopt.ops.SparseLookup(self, self.table)

    def call(self, ids):
        return ops.matmul(ops.sum(self.lookup(ids), axis=1), self.kernel) + self.bias

    @property
    def variable_path_to_optimizer_map(self):
        return {self.table.path: sparseopt.updaters.SGD(0.5),
                self.kernel.path: self.head_optimizer}


def test_a_keras_optimizer_declared_by_a_layer_trains_that_variable():
    frozen = keras.optimizers.SGD(0.0)
    layer = TableAndFrozenHead(frozen, name="layer")
    ids = keras.Input((3,), dtype="int32")
    model = keras.Model(ids, layer(ids))
    optimizer = sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.1))
    model.compile(optimizer=optimizer, loss=dot_loss)
    before = {v.path: to_np(v) for v in model.trainable_variables}
    x = np.array([[1, 2, 3], [4, 5, 1]], "int32")
    model.fit(x, np.ones((2, 1), "float32"), batch_size=2, verbose=0)
    np.testing.assert_array_equal(to_np(layer.kernel), before["layer/kernel"])  # lr 0
    # d loss / d bias = 1 (dot_loss with y = 1, mean over the batch): SGD(0.1).
    np.testing.assert_allclose(to_np(layer.bias), before["layer/bias"] - 0.1, rtol=1e-6)
    assert not np.array_equal(to_np(layer.table), before["layer/table"])
    assert list(optimizer.table_trainers) == ["layer/table"]
    assert [id(o) for o in optimizer.dense_optimizers] == [id(optimizer.optimizer), id(frozen)]


@pytest.mark.parametrize("bad", ["string", "wrapped"])
def test_a_per_variable_optimizer_that_is_not_one_is_refused_naming_the_variable(bad):
    variable = keras.Variable(START[0], name="w")
    variable.optimizer = ("sgd" if bad == "string" else
                          keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()))
    optimizer = sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.5))
    error = TypeError if bad == "string" else ValueError
    with pytest.raises(error, match="variable 'w'"):
        optimizer.build([variable])
