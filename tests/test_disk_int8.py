"""An int8 table on disk: codes and a scale per row in its files (Keras' int8 format).

Training through the cache against an int8 table in memory is in
tests/test_disk_tables.py (bit for bit), and a save and load in the same
file; here, what the host computes for such a table (the initial rows'
codes and scales, the rows read back) against Keras' own quantization
arithmetic, and what the layer reports of it.
"""

import keras
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import sparseopt
from sparseopt.disk import int8_columns
from sparseopt.storage import OnDisk, quantization

# (The host's arithmetic against each session's backend; the rest once.)
independent = pytest.mark.backend_independent

rows_strategy = st.integers(1, 6).flatmap(lambda width: st.lists(
    st.lists(st.floats(-3.0, 3.0, width=32) | st.sampled_from([0.0, -0.0, 0.5, 1.5, -2.5]),
             min_size=width, max_size=width), min_size=1, max_size=8))


@settings(max_examples=80, deadline=None)
@given(rows=rows_strategy)
def test_the_hosts_codes_and_scales_are_keras_own_bit_for_bit(rows):
    rows = np.asarray(rows, np.float32)
    codes, scale = int8_columns.quantize_nearest(rows)
    want_codes, want_scale = quantization.quantize(rows)
    np.testing.assert_array_equal(codes, keras.ops.convert_to_numpy(want_codes))
    np.testing.assert_array_equal(scale, keras.ops.convert_to_numpy(want_scale))


@independent
def test_an_int8_table_on_disk_starts_as_its_initializer_quantized(tmp_path):
    init = keras.initializers.RandomUniform(-0.05, 0.05, seed=3)
    layer = sparseopt.layers.SparseEmbedding(
        50, 6, sparseopt.updaters.Adagrad(0.1), embeddings_initializer=init, dtype="int8",
        storage=OnDisk(str(tmp_path / "t"), cache_rows=8), name="e")
    float_layer = sparseopt.layers.SparseEmbedding(
        50, 6, sparseopt.updaters.Adagrad(0.1), embeddings_initializer=init,
        storage=OnDisk(str(tmp_path / "f"), cache_rows=8), name="f")
    layer.build()
    float_layer.build()
    table = layer.embeddings
    assert table.int8 and table.columns["rows"].dtype == "int8"
    codes, scale = int8_columns.quantize_nearest(float_layer.embeddings.numpy())
    np.testing.assert_array_equal(table.numpy(), codes)
    np.testing.assert_array_equal(table.numpy("scale"), scale)
    # Each row's largest value takes the whole range of codes.
    assert (np.abs(table.numpy()).max(axis=1) == 127).all()
    assert layer.count_params() == 50 * 6 + 50  # codes and scales, as Keras' int8 Embedding
    assert layer.get_config()["dtype"] == "int8"


@independent
def test_an_updater_slot_named_like_a_column_of_the_table_is_refused(tmp_path):
    class Scaled(sparseopt.updaters.RowwiseAdagrad):  # a per-row slot named "scale"
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.slots = (sparseopt.updaters.SlotSpec("scale", rowwise=True),)

    layer = sparseopt.layers.SparseEmbedding(
        10, 2, Scaled(0.1), dtype="int8", storage=OnDisk(str(tmp_path / "t")), name="e")
    with pytest.raises(ValueError, match=r"per-row slot 'scale' has the name of a column"):
        layer.build()
