"""DispatchOptimizer in a user-written `train_step` (the Keras guide's pattern)."""

import keras
import numpy as np
import pytest

import sparseopt
from tests.conftest import to_np
from tests.helpers import batches, dot_loss, numpy_replay

VOCAB, WIDTH, N_IDS, BATCH = 100, 4, 5, 8

if keras.backend.backend() == "jax":
    import jax

    class CustomStepModel(keras.Model):
        forward_between = False

        def train_step(self, state, data):
            trainable, non_trainable, optimizer_vars, metrics_vars = state
            x, y = data

            def loss_fn(trainable, non_trainable):
                y_pred, non_trainable = self.stateless_call(
                    trainable, non_trainable, x, training=True)
                return self.compute_loss(x, y, y_pred), non_trainable

            (loss, non_trainable), grads = jax.value_and_grad(loss_fn, has_aux=True)(
                trainable, non_trainable)
            if self.forward_between:  # e.g. metrics on a second forward pass
                self.stateless_call(trainable, non_trainable, x, training=False)
            trainable, optimizer_vars = self.optimizer.stateless_apply(
                optimizer_vars, grads, trainable)
            return {"loss": loss}, (trainable, non_trainable, optimizer_vars, metrics_vars)
else:
    import tensorflow as tf

    class CustomStepModel(keras.Model):
        forward_between = False

        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = self.compute_loss(x, y, self(x, training=True))
            grads = tape.gradient(loss, self.trainable_variables)
            if self.forward_between:  # e.g. metrics on a second forward pass
                self(x, training=False)
            self.optimizer.apply(grads, self.trainable_variables)
            return {"loss": loss}


@pytest.mark.parametrize("forward_between", [False, True])
def test_custom_train_step_trains_tables_with_their_updater(forward_between):
    """Also when the step runs the model again between gradient and `apply`.

    (Such a forward pass used to drop the recorded row gradients, and the
    table silently did not move.)
    """
    ids = keras.Input((N_IDS,), dtype="int32")
    emb = sparseopt.layers.SparseEmbedding(VOCAB, WIDTH, updater=sparseopt.updaters.Adagrad(0.1),
                                           name="emb")
    model = CustomStepModel(ids, emb(ids))
    model.forward_between = forward_between
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD()), loss=dot_loss)
    table0 = to_np(emb.embeddings)
    xs, ys = batches(np.random.default_rng(0), 6, BATCH, N_IDS, VOCAB, WIDTH, dup_vocab=20)
    model.fit(xs.reshape(-1, N_IDS), ys.reshape(-1, N_IDS, WIDTH), batch_size=BATCH,
              shuffle=False, verbose=0)
    want, _ = numpy_replay("Adagrad", {}, table0, xs, ys, lambda t: 0.1)
    np.testing.assert_allclose(to_np(emb.embeddings), want, rtol=2e-5, atol=2e-6)


def test_row_gradients_discarded_before_apply_are_an_error_not_a_silent_skip():
    """Eagerly, a forward pass between gradient and `apply` cannot be told from a new step.

    It discards the recorded row gradients; `apply` then says so, naming the
    table, instead of leaving the table untrained.
    """
    ids = keras.Input((N_IDS,), dtype="int32")
    emb = sparseopt.layers.SparseEmbedding(VOCAB, WIDTH, updater=sparseopt.updaters.Adagrad(0.1),
                                           name="emb")
    model = CustomStepModel(ids, emb(ids))
    model.forward_between = True
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD()), loss=dot_loss,
                  run_eagerly=True)
    xs, ys = batches(np.random.default_rng(0), 1, BATCH, N_IDS, VOCAB, WIDTH)
    with pytest.raises(ValueError, match="table 'emb/embeddings'.*would not be trained"):
        model.fit(xs[0], ys[0], batch_size=BATCH, verbose=0)
