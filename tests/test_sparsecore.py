"""SparseCore placement (keras-rs, JAX), on a CPU imitation of its layout.

Tables, slots and the float step counter are `overwrite_with_gradient`
weights whose "gradients" are their new values. DispatchOptimizer must
install them and nothing else: no slot in the dense optimizer, no scaling, no
clipping, no accumulation; loss scaling and gradient accumulation are refused.
"""

import os

import keras
import numpy as np
import pytest

import sparseopt
from tests.conftest import to_np

pytestmark = pytest.mark.skipif(keras.backend.backend() != "jax",
                                reason="keras-rs places tables on SparseCore on JAX only")

V, D, L, BATCH = 50, 4, 3, 8


def imitation_model(optimizer, rule="sgd", **compile_kwargs):
    from tests.sparsecore_imitation import SparseCoreImitation

    ids = keras.Input((L,), dtype="int32")
    emb = SparseCoreImitation(V, D, rule=rule, learning_rate=0.1, name="sc")
    model = keras.Model(ids, keras.layers.Dense(1, name="head")(emb(ids)))
    model.compile(optimizer=optimizer, loss="mse", **compile_kwargs)
    return model, emb


def batches(steps, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 20, size=(steps * BATCH, L)).astype("int32"),
            rng.normal(size=(steps * BATCH, 1)).astype("float32"))


class DenseSum(keras.layers.Layer):
    def build(self, input_shape):
        self.table = self.add_weight(shape=(V, D), name="table")

    def call(self, ids):
        return keras.ops.sum(keras.ops.matmul(keras.ops.one_hot(ids, V), self.table), axis=1)


def test_tables_slots_and_step_are_installed_and_nothing_else():
    """SGD inside the backward pass, installed: equals dense Keras SGD on the table."""
    # Clipping on the dense optimizer must not reach the installed values.
    # (`global_clipnorm`, one norm over everything, is refused with them: below.)
    model, emb = imitation_model(sparseopt.DispatchOptimizer(
        keras.optimizers.Adam(0.01, clipnorm=1e-3)))
    ids = keras.Input((L,), dtype="int32")
    dense = DenseSum(name="ref")
    ref = keras.Model(ids, keras.layers.Dense(1, name="ref_head")(dense(ids)))
    ref.compile(loss="mse", optimizer=sparseopt.DispatchOptimizer(
        keras.optimizers.Adam(0.01, clipnorm=1e-3),
        optimizer_map={"ref/table": keras.optimizers.SGD(0.1)}))
    dense.table.assign(to_np(emb.table))
    for a, b in zip(ref.get_layer("ref_head").weights, model.get_layer("head").weights):
        a.assign(to_np(b))
    x, y = batches(5)
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    ref.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    np.testing.assert_allclose(to_np(emb.table), to_np(dense.table), rtol=1e-5, atol=1e-6)
    assert float(to_np(emb.iteration)) == 5.0  # the backward's step + 1, installed
    adam = model.optimizer.optimizer
    assert sorted(tuple(v.shape) for v in adam.variables if len(v.shape)) == [
        (1,), (1,), (D, 1), (D, 1)]  # slots for the head only


def test_adagrad_slots_are_installed_from_the_backward_pass():
    model, emb = imitation_model(sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.0)),
                                 rule="adagrad")
    table0 = to_np(emb.table)
    x, y = batches(1)
    model.fit(x, y, batch_size=BATCH, verbose=0)
    acc = to_np(emb.slots[0])
    touched = np.unique(x)
    untouched = np.setdiff1d(np.arange(V), touched)
    assert np.all(acc[touched] > 0.1) and np.all(acc[untouched] == np.float32(0.1))
    np.testing.assert_array_equal(to_np(emb.table)[untouched], table0[untouched])


def test_plain_keras_scales_installs_and_allocates_slots_the_imitation_reproduces_it():
    """The problems the issue measured on keras-rs' layout, reproduced here: so
    the imitation behaves like the real layout, and the tests above can fail."""
    x, y = batches(1)
    plain, emb = imitation_model(keras.optimizers.SGD(0.0))
    t0 = to_np(emb.table)
    plain.fit(x, y, batch_size=BATCH, verbose=0)
    step = to_np(emb.table) - t0
    keras.backend.clear_session(free_memory=False)
    scaled, emb = imitation_model(keras.optimizers.SGD(0.0, loss_scale_factor=8.0))
    emb.table.assign(t0)
    for a, b in zip(scaled.get_layer("head").weights, plain.get_layer("head").weights):
        a.assign(to_np(b))
    scaled.fit(x, y, batch_size=BATCH, verbose=0)
    # Keras installs the backward's table computed from the 8x loss.
    assert np.abs(to_np(emb.table) - t0).max() > 4 * np.abs(step).max()
    keras.backend.clear_session(free_memory=False)
    adam_model, _ = imitation_model(keras.optimizers.Adam(gradient_accumulation_steps=2))
    adam_model.fit(x, y, batch_size=BATCH, verbose=0)
    # Keras allocates a table-sized gradient accumulator for the table.
    assert any(tuple(v.shape) == (V, D) for v in adam_model.optimizer.variables)


@pytest.mark.parametrize("how", ["loss_scale_factor", "loss_scale_optimizer", "mixed_float16"])
def test_loss_scaling_with_sparsecore_tables_is_refused(how):
    if how == "loss_scale_factor":
        opt = sparseopt.DispatchOptimizer(keras.optimizers.Adam(loss_scale_factor=8.0))
    elif how == "loss_scale_optimizer":
        opt = keras.optimizers.LossScaleOptimizer(
            sparseopt.DispatchOptimizer(keras.optimizers.Adam()))
    else:
        keras.mixed_precision.set_global_policy("mixed_float16")
        opt = sparseopt.DispatchOptimizer(keras.optimizers.Adam())
    try:
        model, _ = imitation_model(opt)
        x, y = batches(1)
        with pytest.raises(ValueError, match=r"loss scaling.*SparseCore tables.*var:sc:table"):
            model.fit(x, y, batch_size=BATCH, verbose=0)
    finally:
        keras.mixed_precision.set_global_policy("float32")


@pytest.mark.parametrize("option, match", [
    # Accumulating needs the tables' row gradients, which SparseCore consumes in its backward.
    ({"gradient_accumulation_steps": 2}, r"gradient_accumulation_steps=2.*SparseCore"),
    # One norm over everything cannot include tables updated inside their backward.
    ({"global_clipnorm": 1.0}, r"global_clipnorm=1.0.*SparseCore.*var:sc:table"),
])
def test_controls_that_need_the_tables_row_gradients_are_refused_with_sparsecore(option, match):
    model, _ = imitation_model(sparseopt.DispatchOptimizer(keras.optimizers.Adam(**option)))
    x, y = batches(1)
    with pytest.raises(ValueError, match=match):
        model.fit(x, y, batch_size=BATCH, verbose=0)


def test_imitation_matches_keras_rs_source():
    """The layout facts the imitation copies, found in keras-rs' own source."""
    import keras_rs

    root = os.path.join(os.path.dirname(keras_rs.__file__), "src", "layers", "embedding", "jax")
    layer = open(os.path.join(root, "distributed_embedding.py")).read()
    lookup = open(os.path.join(root, "embedding_lookup.py")).read()
    assert 'variable_name = f"var:{stacked_table_spec.stack_name}:table"' in layer
    assert 'name=f"{variable_name}:slot:{slot_name}"' in layer
    assert "var.overwrite_with_gradient = overwrite_with_gradient" in layer
    assert 'name="iteration"' in layer and "self._iterations.overwrite_with_gradient = True" \
        in layer
    assert "embedding_lookup.defvjp(embedding_lookup_fwd, embedding_lookup_bwd)" in lookup
    assert "step + 1 if step is not None else None" in lookup
