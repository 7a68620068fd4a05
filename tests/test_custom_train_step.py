"""DispatchOptimizer in a user-written `train_step` (the Keras guide's pattern)."""

import keras
import numpy as np

import sparseopt
from tests.conftest import to_np
from tests.helpers import batches, dot_loss, numpy_replay

VOCAB, WIDTH, N_IDS, BATCH = 100, 4, 5, 8

if keras.backend.backend() == "jax":
    import jax

    class CustomStepModel(keras.Model):
        def train_step(self, state, data):
            trainable, non_trainable, optimizer_vars, metrics_vars = state
            x, y = data

            def loss_fn(trainable, non_trainable):
                y_pred, non_trainable = self.stateless_call(
                    trainable, non_trainable, x, training=True)
                return self.compute_loss(x, y, y_pred), non_trainable

            (loss, non_trainable), grads = jax.value_and_grad(loss_fn, has_aux=True)(
                trainable, non_trainable)
            trainable, optimizer_vars = self.optimizer.stateless_apply(
                optimizer_vars, grads, trainable)
            return {"loss": loss}, (trainable, non_trainable, optimizer_vars, metrics_vars)
else:
    import tensorflow as tf

    class CustomStepModel(keras.Model):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = self.compute_loss(x, y, self(x, training=True))
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply(grads, self.trainable_variables)
            return {"loss": loss}


def test_custom_train_step_trains_tables_with_their_updater():
    ids = keras.Input((N_IDS,), dtype="int32")
    emb = sparseopt.layers.SparseEmbedding(VOCAB, WIDTH, updater=sparseopt.updaters.Adagrad(0.1),
                                           name="emb")
    model = CustomStepModel(ids, emb(ids))
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD()), loss=dot_loss)
    table0 = to_np(emb.embeddings)
    xs, ys = batches(np.random.default_rng(0), 6, BATCH, N_IDS, VOCAB, WIDTH, dup_vocab=20)
    model.fit(xs.reshape(-1, N_IDS), ys.reshape(-1, N_IDS, WIDTH), batch_size=BATCH,
              shuffle=False, verbose=0)
    want, _ = numpy_replay("Adagrad", {}, table0, xs, ys, lambda t: 0.1)
    np.testing.assert_allclose(to_np(emb.embeddings), want, rtol=2e-5, atol=2e-6)
