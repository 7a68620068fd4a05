"""Plain Keras on TensorFlow vs the summed gradient: which Keras optimizers differ.

    KERAS_BACKEND=tensorflow python benchmarks/keras_tf_duplicates.py   # ~1 min
    KERAS_BACKEND=jax python benchmarks/keras_tf_duplicates.py          # the control: all 0

Keras' TensorFlow backend hands an `Embedding`'s gradient to its optimizers as
`tf.IndexedSlices`, one row per occurrence, duplicates unsummed; on JAX the
gradient is dense (duplicates summed). For each Keras optimizer (and the
clipping options), a 20-row table whose every row is looked up 4 times a
batch is trained for 5 steps from one start, once as `keras.layers.Embedding`
and once as a one-hot matmul table (a dense gradient on both backends); the
largest difference between the two tables is printed. docs/backends.md
("Plain Keras on TensorFlow is itself different") holds the figures.
"""

import keras
import numpy as np
from keras import ops

ROWS, WIDTH, STEPS = 20, 4, 5


class OneHotEmbedding(keras.layers.Layer):
    """A table read by a one-hot matmul: its gradient is dense on every backend."""

    def __init__(self, rows, width, **kwargs):
        super().__init__(**kwargs)
        self.rows, self.width = rows, width

    def build(self, input_shape):
        self.embeddings = self.add_weight(shape=(self.rows, self.width), name="embeddings")

    def call(self, ids):
        return ops.matmul(ops.one_hot(ids, self.rows), self.embeddings)


def data(seed=0):
    """`(xs, ys, table0)`: `STEPS` batches of 8 x 10 ids, each row 4 times a batch."""
    rng = np.random.default_rng(seed)
    xs = [rng.permutation(np.repeat(np.arange(ROWS), 4)).reshape(8, 10).astype("int32")
          for _ in range(STEPS)]
    ys = [rng.normal(size=(8, 1)).astype("float32") for _ in range(STEPS)]
    return xs, ys, rng.uniform(-0.05, 0.05, (ROWS, WIDTH)).astype("float32")


def trained(embedding, optimizer, xs, ys, table0):
    """The table after `STEPS` steps of `optimizer` (a frozen all-ones head)."""
    keras.backend.clear_session(free_memory=False)
    ids = keras.Input((10,), dtype="int32")
    head = keras.layers.Dense(1, kernel_initializer="ones", trainable=False)
    model = keras.Model(ids, head(keras.layers.Flatten()(embedding(ids))))
    model.compile(optimizer=optimizer, loss="mse")
    embedding.embeddings.assign(table0)
    for x, y in zip(xs, ys):
        model.train_on_batch(x, y)
    return ops.convert_to_numpy(embedding.embeddings)


def main():
    o = keras.optimizers
    cases = {
        "SGD": lambda: o.SGD(0.1), "SGD(momentum=0.9)": lambda: o.SGD(0.1, momentum=0.9),
        "Adam": lambda: o.Adam(0.01), "AdamW": lambda: o.AdamW(0.01),
        "Adam(weight_decay=0.1)": lambda: o.Adam(0.01, weight_decay=0.1),
        "Adagrad": lambda: o.Adagrad(0.1), "RMSprop": lambda: o.RMSprop(0.01),
        "Adadelta": lambda: o.Adadelta(1.0), "Adamax": lambda: o.Adamax(0.01),
        "Nadam": lambda: o.Nadam(0.01), "Ftrl": lambda: o.Ftrl(0.1),
        "Lion": lambda: o.Lion(0.001), "Adafactor": lambda: o.Adafactor(0.1),
        "Lamb": lambda: o.Lamb(0.01), "Muon": lambda: o.Muon(0.01),
        "SGD(clipnorm=0.01)": lambda: o.SGD(0.1, clipnorm=0.01),
        "SGD(clipvalue=1e-3)": lambda: o.SGD(0.1, clipvalue=1e-3),
        "SGD(global_clipnorm=0.01)": lambda: o.SGD(0.1, global_clipnorm=0.01),
    }
    xs, ys, table0 = data()
    print(f"backend: {keras.backend.backend()}; Keras {keras.__version__}")
    print(f"{'optimizer':28s} max |Embedding - dense-gradient table|")
    for name, make in cases.items():
        plain = trained(keras.layers.Embedding(ROWS, WIDTH), make(), xs, ys, table0)
        dense = trained(OneHotEmbedding(ROWS, WIDTH), make(), xs, ys, table0)
        print(f"{name:28s} {np.abs(plain - dense).max():.2e}")


if __name__ == "__main__":
    main()
