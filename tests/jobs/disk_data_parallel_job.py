"""Tables on disk in a data-parallel model (`keras.distribution.DataParallel`), against the
same model with its tables in memory on one device (tests/test_disk_tables.py's
data-parallel test).

Usage: python -m tests.jobs.disk_data_parallel_job FOLDER   (with several JAX devices)

Trains `test_disk_tables`' model with a row-wise Adagrad table and an Adam table on disk,
and `test_disk_vocabulary`'s with open vocabularies on disk, each under `DataParallel`
over every device (each batch split over them), and the same models in memory on one
device; prints "devices N, equal" where every table and every head end alike to float
rounding and every open vocabulary's map exactly (an AssertionError otherwise). To float
rounding: split over devices, gradients are summed in another order than on one device
(the dense part's too; a table in memory under the same distribution differs from both
in the last bits as well).
"""

import os
import sys

import jax
import keras
import numpy as np

import sparseopt
from sparseopt.storage import OnDisk
from tests.conftest import to_np
from tests.test_disk_tables import _data, _heads, _model, _set_heads
from tests.test_disk_vocabulary import _open_vocabulary

CASES = {"RowwiseAdagrad": (sparseopt.updaters.RowwiseAdagrad, {}, "float32", {}),
         "Adam": (sparseopt.updaters.Adam, {}, "float32", {})}
CLOSE = dict(rtol=1e-5, atol=1e-7)


def train(folder, layer_of, name):
    data_parallel = keras.distribution.DataParallel(devices=jax.devices())
    with data_parallel.scope():
        disk, disk_layers, disk_heads = _model(
            CASES, lambda i, s: OnDisk(os.path.join(folder, f"{name}{i}"), cache_rows=8),
            layer_of)
    memory, memory_layers, memory_heads = _model(CASES, lambda i, s: None, layer_of)
    start = [d.embeddings.numpy().copy() for d in disk_layers]
    for m, rows in zip(memory_layers, start):
        m.embeddings.assign(rows)
    heads = _heads(disk_heads)
    _set_heads(memory_heads, heads)
    x, y = _data(len(CASES), rows=64)  # (ids outside a SparseEmbedding's table: dropped)
    with data_parallel.scope():  # (Keras splits each batch over the devices in `fit`)
        disk.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert len(disk_heads[0].kernel.value.sharding.device_set) == len(jax.devices())
    memory.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    for got, want, first in zip(_heads(disk_heads), _heads(memory_heads), heads):
        np.testing.assert_allclose(got[0], want[0], **CLOSE)
        assert not np.array_equal(got[0], first[0])  # (it trained)
    for case, d, m, first in zip(CASES, disk_layers, memory_layers, start):
        np.testing.assert_allclose(d.embeddings.numpy(), to_np(m.embeddings), err_msg=case,
                                   **CLOSE)
        assert not np.array_equal(d.embeddings.numpy(), first), case
        assert d.disk_stats()["misses"] > 0, case
        if hasattr(d, "held_ids"):
            assert d.held_ids() == m.held_ids(), case
        else:
            dropped = int(to_np(d.num_dropped_ids))
            assert dropped > 0 and dropped == int(to_np(m.num_dropped_ids)), case


def main():
    assert len(jax.devices()) > 1, jax.devices()
    folder = sys.argv[1]
    train(folder, lambda i, updater, storage, dtype: sparseopt.layers.SparseEmbedding(
        40, 3, updater=updater, storage=storage, dtype=dtype, name=f"t{i}"), "t")
    train(folder, _open_vocabulary, "v")
    print(f"devices {len(jax.devices())}, equal")


if __name__ == "__main__":
    main()
