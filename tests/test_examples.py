"""The examples run end to end (small sizes) and report what they promise."""

import os
import subprocess
import sys

import keras
import pytest

from tests.helpers import ROOT, backend_kind, child_env, kinds



def run_example(name, *args):
    env = child_env()
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", name), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


# `make test` runs each example once: the demo's on JAX (its backend), keras-rs'
# on TensorFlow (10 s there against 17-33 s on JAX, which compiles its step for
# longer: the sessions' times balanced); `make test-all` each on both.
JAX = keras.backend.backend() == "jax"
EXAMPLES = ["dlrm_synthetic.py", "keras_rs_dlrm.py"]
ONCE = ["dlrm_synthetic.py"] if JAX else ["keras_rs_dlrm.py"]


@pytest.mark.parametrize("name", kinds(EXAMPLES, ONCE))
def test_example_trains_and_reports(name):
    # The demo also trains plain Keras for a few steps to compare (`make demo`,
    # JAX); checked on JAX, where the TF session's time is tighter.
    compare = "3" if name == "dlrm_synthetic.py" and keras.backend.backend() == "jax" else "0"
    out = run_example(name, "--examples", "4096", "--validation", "1024", "--chunks", "1",
                      "--compare-steps", compare, "--scale", "0.01")
    assert "val loss" in out and "ms/step" in out
    assert "table steps skipped for non-finite gradients: 0" in out
    if compare != "0":
        assert "plain Keras: Embedding + Adam" in out
    if name == "keras_rs_dlrm.py":
        assert "each trained by its TableConfig.optimizer" in out
        assert "rows: Adagrad(" in out and "rows: Ftrl(" in out
        assert "Adam variables shaped like a table: 0" in out


# `make test-all` only: `make test` runs one example of each kind (training
# under sharding is tests/test_sharded.py's).
@pytest.mark.thorough
@pytest.mark.backend_independent  # sharded_dlrm.py runs on JAX whatever KERAS_BACKEND says
def test_sharded_example_splits_tables_and_trains():
    env = child_env("jax", XLA_FLAGS="--xla_force_host_platform_device_count=4")
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "sharded_dlrm.py"), "--examples",
         "4096", "--validation", "2048", "--chunks", "1", "--scale", "0.1"],
        cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "4 cpu devices" in out and "split by rows over 4 devices" in out
    assert "on each device (4.0x less)" in out and ", 0 carrying a table" in out
    assert "val loss" in out and "table steps skipped for non-finite gradients: 0" in out


@pytest.mark.parametrize("backend", backend_kind("jax"))
def test_two_tower_example_trains_adam_tables_and_recall_rises(backend):
    out = run_example("two_tower.py", "--users", "20000", "--items", "5000", "--topics", "50",
                      "--examples", "120000", "--chunks", "2", "--batch", "512")
    assert "tables: Adam (lazy, sparse, in place); dense layers: AdamW" in out
    assert "table steps skipped for non-finite gradients: 0" in out
    line = next(x for x in out.splitlines() if x.startswith("recall@100 rose from"))
    before, after = (float(w) for w in line.split()[3:6:2])
    random = 100 / 5000
    assert after > 2 * before and after > 5 * random, line
