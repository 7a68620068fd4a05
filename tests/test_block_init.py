"""Large tables are drawn block by block: right values, distinct blocks, in place.

JAX: the initializer writes the blocks into one preallocated array. TF: the
table is created as zeros and the blocks written into the variable (TF
copies whatever an initializer returns).
"""

import keras
import numpy as np
import pytest

import sparseopt
from sparseopt import backend
from sparseopt.storage import block_init
from tests.conftest import to_np


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(block_init, "MIN_ELEMENTS", 64)
    monkeypatch.setattr(block_init, "BLOCK_ROWS", 7)  # 50 rows: 7 full blocks and 1 of 1


def table(seed, initializer="uniform"):
    init = keras.initializers.get(initializer)
    if seed is not None:
        init = type(init).from_config(dict(init.get_config(), seed=seed))
    layer = sparseopt.layers.SparseEmbedding(50, 4, updater=sparseopt.updaters.SGD(0.1),
                                             embeddings_initializer=init)
    layer.build((None, 3))
    return to_np(layer.embeddings)


def test_blocks_hold_the_initializers_values_and_differ(small_blocks):
    t = table(seed=3, initializer=keras.initializers.RandomUniform(-0.05, 0.05))
    assert t.shape == (50, 4)
    assert t.min() >= -0.05 and t.max() <= 0.05 and t.std() > 0.02
    blocks = [t[i:i + 7] for i in range(0, 49, 7)]
    for a in blocks:  # with a fixed seed each block still draws its own numbers
        assert sum(np.array_equal(a, b) for b in blocks) == 1
    assert len(np.unique(t)) == t.size


def test_fixed_seed_is_deterministic(small_blocks):
    np.testing.assert_array_equal(table(seed=3), table(seed=3))
    assert not np.array_equal(table(seed=3), table(seed=4))


def test_normal_initializers_keep_their_distribution(small_blocks):
    t = table(seed=1, initializer=keras.initializers.TruncatedNormal(stddev=0.5))
    assert np.abs(t).max() <= 1.0 + 1e-6  # truncated at two standard deviations
    assert 0.2 < t.std() < 0.6


def test_shape_dependent_and_small_tables_are_drawn_whole(small_blocks):
    glorot = keras.initializers.GlorotUniform(seed=2)
    assert block_init.blockwise(glorot) is glorot  # its scale depends on the shape
    want = keras.initializers.RandomUniform(seed=5)((6, 4))  # below MIN_ELEMENTS (64)
    got = block_init.blockwise(keras.initializers.RandomUniform(seed=5))((6, 4))
    np.testing.assert_array_equal(to_np(got), to_np(want))


def test_each_block_is_its_own_draw_in_row_order(small_blocks):
    init = keras.initializers.RandomNormal(stddev=0.3, seed=11)
    t = table(seed=11, initializer=init)
    for i, start in enumerate(range(0, 50, 7)):
        rows = min(7, 50 - start)
        want = block_init.for_block(init, i)((rows, 4), dtype="float32")
        np.testing.assert_array_equal(t[start:start + rows], to_np(want))


@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="TF's variables")
def test_tensorflow_writes_the_blocks_into_the_variable_it_created(small_blocks, monkeypatch):
    """Created as zeros, then each block written in place (`write_rows`), eagerly; under a
    `tf.distribute` strategy (mirrored copies) the table is drawn whole, as Keras does."""
    import tensorflow as tf

    writes = []
    original = backend.write_rows
    monkeypatch.setattr(backend, "write_rows",
                        lambda variable, start, rows: (writes.append((start, rows.shape[0])),
                                                       original(variable, start, rows)))
    t = table(seed=3)
    assert writes == [(start, min(7, 50 - start)) for start in range(0, 50, 7)]
    assert len(np.unique(t)) == t.size

    writes.clear()
    with tf.distribute.MirroredStrategy(["/cpu:0"]).scope():
        assert not backend.fills_variables_in_blocks()
        whole = table(seed=3, initializer=keras.initializers.RandomUniform(seed=3))
    assert writes == []
    np.testing.assert_array_equal(
        whole, to_np(keras.initializers.RandomUniform(seed=3)((50, 4))))
