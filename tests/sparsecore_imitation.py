"""A CPU imitation of keras-rs' SparseCore table layout and custom backward (JAX).

There is no TPU here. This layer reproduces what keras-rs 0.4 does on SparseCore,
read from keras_rs/src/layers/embedding/jax/distributed_embedding.py and
embedding_lookup.py (checked against those files by
tests/test_sparsecore.py::test_imitation_matches_keras_rs_source):

- each table is a trainable float32 weight named `var:<table>:table`, each of
  its optimizer slots `var:<table>:table:slot:<name>`, all marked
  `overwrite_with_gradient = True`;
- a trainable float32 scalar `iteration`, also `overwrite_with_gradient`;
- the lookup is a `jax.custom_vjp` whose backward pass returns
  `(None, updated tables and slots, step + 1)`: the table update happens inside
  the backward pass (on TPU, `tpu_sparse_dense_matmul_grad`), and the model's
  optimizer is only expected to install the results.

The update is SGD or Adagrad (jax-tpu-embedding's rule: `acc += g^2`,
`w -= lr * g / sqrt(acc)`) on the rows the batch touched, with the `"sum"`
combiner.
"""

import functools

import jax
import jax.numpy as jnp
import keras


class SparseCoreImitation(keras.layers.Layer):
    """Ids `[B, L]` -> summed rows `[B, D]`, trained inside its backward pass."""

    def __init__(self, vocab, dim, rule="sgd", learning_rate=0.1, **kwargs):
        super().__init__(**kwargs)
        self.vocab, self.dim, self.rule, self.learning_rate = vocab, dim, rule, learning_rate

    def build(self, input_shape):
        prefix = f"var:{self.name}:table"
        self.table = self._add(prefix, (self.vocab, self.dim), "uniform")
        self.slots = ()
        if self.rule == "adagrad":
            self.slots = (self._add(f"{prefix}:slot:accumulators", (self.vocab, self.dim),
                                    keras.initializers.Constant(0.1)),)
        self.iteration = self._add("iteration", (), "zeros")

    def _add(self, name, shape, initializer):
        var = self.add_weight(name=name, shape=shape, initializer=initializer,
                              dtype="float32", trainable=True)
        var.overwrite_with_gradient = True
        return var

    def call(self, ids):
        tables = (self.table.value,) + tuple(s.value for s in self.slots)
        return _lookup((self.rule, self.learning_rate), ids, tables, self.iteration.value)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _lookup(rule, ids, tables, step):
    return jnp.take(tables[0], ids, axis=0).sum(axis=1)


def _lookup_fwd(rule, ids, tables, step):
    return _lookup(rule, ids, tables, step), (ids, tables, step)


def _lookup_bwd(rule, res, grads):
    kind, lr = rule
    ids, tables, step = res
    vocab = tables[0].shape[0]
    flat = ids.reshape(-1)
    row_grads = jnp.repeat(grads, ids.shape[1], axis=0)  # "sum": each id gets its sample's
    summed = jax.ops.segment_sum(row_grads, flat, num_segments=vocab)
    touched = jax.ops.segment_sum(jnp.ones_like(flat), flat, num_segments=vocab)[:, None] > 0
    table = tables[0]
    if kind == "sgd":
        new = (jnp.where(touched, table - lr * summed, table),)
    else:
        acc = jnp.where(touched, tables[1] + summed * summed, tables[1])
        new = (jnp.where(touched, table - lr * summed / jnp.sqrt(acc), table), acc)
    return None, new, step + 1


_lookup.defvjp(_lookup_fwd, _lookup_bwd)
