"""A model with tables on disk, exported for serving (`model.export`).

Each SavedModel holds each table's rows (float32, bfloat16, and an int8
table's as its layer reads them) as they were at its export (rows
trained so far, rows never written as the initializer draws them) and serves
in a process that never imports sparseopt, away from the tables' folders,
giving what the trained model predicted then; training goes on between
exports, the export's copy of the rows is dropped with it, and a table larger
than the memory available is refused with its name.
"""

import gc
import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

import sparseopt
from sparseopt.storage import OnDisk, quantization
from tests.helpers import child_env

ROWS, WIDTH = 40, 4
# Trained rows, rows never written (30-39), and ids outside the table.
IDS = [[0, 35, 39], [-1, 5, 40], [1, 2, 3], [29, 31, 2**31 - 1]]


def _model(folder):
    ids = keras.Input((3,), dtype="int32", name="ids")
    tables = [
        sparseopt.layers.SparseEmbedding(
            ROWS, WIDTH, updater=sparseopt.updaters.RowwiseAdagrad(0.1), combiner="sum",
            storage=OnDisk(os.path.join(folder, "a"), cache_rows=8), name="a"),
        sparseopt.layers.SparseEmbedding(
            ROWS, WIDTH, updater=sparseopt.updaters.Adam(0.05), dtype="bfloat16",
            storage=OnDisk(os.path.join(folder, "b"), cache_rows=8), name="b"),
        sparseopt.layers.SparseEmbedding(
            ROWS, WIDTH, updater=sparseopt.updaters.Adagrad(0.1), combiner="mean",
            dtype="int8", storage=OnDisk(os.path.join(folder, "c"), cache_rows=8), name="c"),
    ]
    pooled = keras.layers.Concatenate()(
        [tables[0](ids), keras.layers.Flatten()(tables[1](ids)), tables[2](ids)])
    model = keras.Model(ids, keras.layers.Dense(1, name="head")(pooled))
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.Adam(0.01)),
                  loss="mse")
    return model, tables


def _fit(model, seed):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 30, (48, 3)).astype("int32")  # rows 30-39 never trained
    model.fit(x, rng.random((48, 1)).astype("float32"), batch_size=8, verbose=0)


SERVE = """
import json, sys
import numpy as np
import tensorflow as tf
ids = tf.constant(json.loads(sys.argv[1]), tf.int32)
found = []
for path in sys.argv[2:]:
    served = tf.saved_model.load(path)
    rows = {v.name: v.numpy().astype("float32").tolist() for v in served.variables
            if "for_serving" in v.name}
    found.append({"out": served.serve(ids).numpy().tolist(), "rows": rows})
assert "sparseopt" not in sys.modules
print(json.dumps(found))
"""


def _rows(table):
    """A table's rows as its layer reads them (an int8 table's `codes / scale`, by Keras'
    int8 arithmetic)."""
    if table.int8:
        return keras.ops.convert_to_numpy(
            quantization.dequantize(table.numpy(), table.numpy("scale")))
    return np.asarray(table.numpy(), "float32")


def _export(model, tables, path):
    """What the model predicts now, each table's rows now, after exporting it to `path`."""
    want = model.predict(np.array(IDS, "int32"), verbose=0)
    rows = [_rows(t.embeddings) for t in tables]
    model.export(str(path))
    return want, rows


def test_exported_models_serve_their_tables_rows_without_sparseopt(tmp_path):
    model, tables = _model(tmp_path / "tables")
    _fit(model, 0)
    first = _export(model, tables, tmp_path / "first")
    _fit(model, 1)  # training goes on after an export...
    second = _export(model, tables, tmp_path / "second")  # ...which the next one holds
    assert not np.array_equal(first[1][0], second[1][0])
    assert not np.array_equal(first[1][2], second[1][2])
    assert not any("for_serving" in v.name for v in model.variables)
    if keras.backend.backend() == "tensorflow":
        # The export's copy of the rows went with its archive (a shortcut: there is no
        # public handle to it). On JAX the archive outlives `model.export`: jax2tf's
        # converted function keeps it (and its TensorFlow copy of every variable).
        gc.collect()
        assert all(t._lookup.exported.variable is None for t in tables)
    proc = subprocess.run(
        [sys.executable, "-c", SERVE, json.dumps(IDS), str(tmp_path / "first"),
         str(tmp_path / "second")],
        capture_output=True, text=True, env=child_env(PYTHONPATH=""), cwd=str(tmp_path),
        timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for (want, rows), got in zip((first, second), json.loads(proc.stdout.splitlines()[-1])):
        np.testing.assert_allclose(np.array(got["out"]), want, rtol=1e-6, atol=1e-6)
        # The rows themselves, every one of them, as the tables held them.
        assert len(got["rows"]) == 3, sorted(got["rows"])
        for table, held in zip(tables, rows):
            name = next(n for n in got["rows"] if n.startswith(f"{table.name}_"))
            np.testing.assert_array_equal(np.array(got["rows"][name], "float32"), held)


def test_an_export_refuses_a_table_larger_than_the_memory_available(tmp_path, monkeypatch):
    from sparseopt.disk import serving

    model, tables = _model(tmp_path / "tables")
    _fit(model, 0)
    # (A shortcut: the machine's available memory, as the export reads it, made small.)
    monkeypatch.setattr(serving, "available_memory", lambda: 1000)
    with pytest.raises(ValueError, match=r"SparseEmbedding 'a': `model.export` writes every "
                                         r"row of its table on disk \('a/embeddings'\)"):
        model.export(str(tmp_path / "served"))
    before = tables[0].embeddings.numpy().copy()
    _fit(model, 1)  # the refusal leaves the model as it was
    assert not np.array_equal(tables[0].embeddings.numpy(), before)


def test_an_archive_that_traces_before_it_reads_the_variables_is_told_what_to_do(tmp_path):
    # (A shortcut: Keras' own archives read the variables first, whatever the order of
    # `track` and `add_endpoint`; this is the guard for one that would not.)
    model, tables = _model(tmp_path / "tables")
    _fit(model, 0)
    with pytest.raises(ValueError, match=r"SparseEmbedding 'a': an export traced its table on "
                                         r"disk \('a/embeddings'\) before reading"):
        tables[0]._lookup.exported.read_by(object())
