"""A frozen layer (`layer.trainable = False`, Keras' way) trains none of its tables.

Whatever the table's storage: a variable in memory, int8 codes, a table on
disk (the last two are no trainable variables: the optimizer reaches them
through the lookup's probe, which on JAX is layer state that Keras' setter
does not reach). The rest of the model trains; unfrozen and compiled again,
the table trains.
"""

import keras
import numpy as np
import pytest

import sparseopt
from sparseopt.storage import OnDisk
from tests.conftest import to_np


def _rows(emb):
    if emb.on_disk:
        return np.asarray(emb.embeddings.numpy()).copy()
    if emb.int8 is not None:  # (codes and scales)
        return np.concatenate([to_np(emb.embeddings), to_np(emb.embeddings_scale)[:, None]], 1)
    return to_np(emb.embeddings).copy()


@pytest.mark.parametrize("kind", ["memory", "int8", "int8 caught up", "disk",
                                  "disk caught up"])
def test_a_frozen_layer_trains_none_of_its_tables(tmp_path, kind):
    extra = {"storage": OnDisk(str(tmp_path / "t"), cache_rows=8)} if "disk" in kind else {}
    if "int8" in kind:
        extra["dtype"] = "int8"
    # "caught up": lazy=False with weight decay, whose end of fit would move every row.
    rule = (sparseopt.updaters.SGD(0.5, lazy=False, weight_decay=0.1) if "caught" in kind
            else sparseopt.updaters.SGD(0.5))
    ids = keras.Input((3,), dtype="int32")
    emb = sparseopt.layers.SparseEmbedding(40, 4, updater=rule, combiner="sum", **extra)
    head = keras.layers.Dense(1)
    model = keras.Model(ids, head(emb(ids)))
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 40, (32, 3)).astype("int32"), rng.random((32, 1)).astype("float32")
    emb.trainable = False
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.Adam(0.01)),
                  loss="mse")
    table, kernel = _rows(emb), to_np(head.kernel).copy()
    model.fit(x, y, batch_size=8, verbose=0)
    model.optimizer.catch_up_tables()  # (between steps, as the end of fit: nothing either)
    np.testing.assert_array_equal(_rows(emb), table)
    assert not np.array_equal(to_np(head.kernel), kernel)
    emb.trainable = True
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.Adam(0.01)),
                  loss="mse")
    model.fit(x, y, batch_size=8, verbose=0)
    assert not np.array_equal(_rows(emb), table)
