"""A model with tables on disk, exported for serving (`model.export`).

The SavedModel holds each table's rows as they were at the export (rows
trained so far, rows never written as the initializer draws them) and serves
in a process that has neither sparseopt nor the table's folder, giving what
the trained model predicts; training goes on after it, and a table larger
than the memory free is refused with its name.
"""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

import sparseopt
from sparseopt.storage import OnDisk
from tests.helpers import child_env

ROWS, WIDTH = 40, 4


def _model(folder):
    ids = keras.Input((3,), dtype="int32", name="ids")
    tables = [
        sparseopt.layers.SparseEmbedding(
            ROWS, WIDTH, updater=sparseopt.updaters.RowwiseAdagrad(0.1), combiner="sum",
            storage=OnDisk(os.path.join(folder, "a"), cache_rows=8), name="a"),
        sparseopt.layers.SparseEmbedding(
            ROWS, WIDTH, updater=sparseopt.updaters.Adam(0.05), dtype="bfloat16",
            storage=OnDisk(os.path.join(folder, "b"), cache_rows=8), name="b"),
    ]
    pooled = keras.layers.Concatenate()(
        [tables[0](ids), keras.layers.Flatten()(tables[1](ids))])
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
served = tf.saved_model.load(sys.argv[1])
ids = tf.constant(json.loads(sys.argv[2]), tf.int32)
rows = {v.name: v.numpy().astype("float32").tolist() for v in served.variables
        if "for_serving" in v.name}
out = served.serve(ids).numpy().tolist()
assert "sparseopt" not in sys.modules
print(json.dumps({"out": out, "rows": rows}))
"""


def test_an_exported_model_serves_its_tables_rows_without_sparseopt(tmp_path):
    model, tables = _model(tmp_path / "tables")
    _fit(model, 0)
    # Trained rows, rows never written (30-39), and ids outside the table.
    ids = [[0, 35, 39], [-1, 5, 40], [1, 2, 3], [29, 31, 2**31 - 1]]
    want = model.predict(np.array(ids, "int32"), verbose=0)
    model.export(str(tmp_path / "served"))
    # A process that never imports sparseopt, away from the tables' folder.
    env = child_env(PYTHONPATH="")
    proc = subprocess.run([sys.executable, "-c", SERVE, str(tmp_path / "served"),
                           json.dumps(ids)], capture_output=True, text=True, env=env,
                          cwd=str(tmp_path), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    np.testing.assert_allclose(np.array(got["out"]), want, rtol=1e-6, atol=1e-6)
    # The rows themselves, every one of them, as the tables hold them now.
    assert len(got["rows"]) == 2, sorted(got["rows"])
    for table in tables:
        name = next(n for n in got["rows"] if n.startswith(f"{table.name}_"))
        np.testing.assert_array_equal(
            np.array(got["rows"][name], "float32"),
            np.asarray(table.embeddings.numpy(), "float32"))
    # The export leaves training as it was: no variable of its own stays.
    assert not any("for_serving" in v.name for v in model.variables)
    before = tables[0].embeddings.numpy().copy()
    _fit(model, 1)
    assert not np.array_equal(tables[0].embeddings.numpy(), before)


def test_an_export_refuses_a_table_larger_than_the_memory_free(tmp_path, monkeypatch):
    from sparseopt.disk import serving

    model, _ = _model(tmp_path / "tables")
    _fit(model, 0)
    # (A shortcut: the machine's free memory, as the export reads it, made small.)
    monkeypatch.setattr(serving, "available_memory", lambda: 1000)
    with pytest.raises(ValueError, match=r"SparseEmbedding 'a': `model.export` writes every "
                                         r"row of its table on disk \('a/embeddings'\)"):
        model.export(str(tmp_path / "served"))
