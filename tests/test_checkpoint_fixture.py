"""Checkpoints written by earlier versions load and resume (to float rounding across CPUs)."""

import os
import subprocess
import sys

import keras
import numpy as np
import pytest

import sparseopt
from tests.fixtures import make_checkpoint as fixture
from tests.helpers import ROOT, child_env



# The fixture was written on another machine. XLA:CPU compiles for the host's
# instruction set, so the same steps can round differently in the last bits
# on another CPU (1 ulp, 3.7e-9, in 30 of 160 entries of `sgd/embeddings` on an
# AVX2-only AMD EPYC, measured); TF also ran TF's kernels then where it now runs
# compiled functions (up to 10 ulp after two steps, measured). A state that
# failed to load, or a step that trained wrongly, is off by far more: each step
# moves these weights by about 1e-2. Bit for bit holds within one machine and
# is checked there (tests/test_resume.py).
RTOL, ATOL = 1e-5, 1e-7


def check_fixture_resumes():
    """Loads the fixture of this backend, trains its last 2 steps, compares."""
    backend = keras.backend.backend()
    path = os.path.join(fixture.HERE, f"main_{backend}.keras")
    want = dict(np.load(os.path.join(fixture.HERE, f"main_{backend}_expected.npz")))
    model = keras.saving.load_model(path)
    x, y = fixture.data(5)
    model.fit(x[3 * fixture.BATCH:], y[3 * fixture.BATCH:], batch_size=fixture.BATCH,
              shuffle=False, verbose=0)
    got = {k: v for k, v in fixture.snapshot(model).items() if not k.startswith("optimizer:")}
    # Then, the optimizer saved no hyperparameters (and no learning rate at
    # start): the file has sparseopt 0.2's layout, whose entries are these.
    legacy = model.optimizer._layouts()[-1]
    got.update({f"optimizer:{i}": keras.ops.convert_to_numpy(v)
                for i, (v, _) in enumerate(legacy) if v is not None})
    # Then, each lookup's probe and dropped-id count were weights of its
    # layer (and in the file); now they are layer state that no file holds
    # (the probe is a weight on TensorFlow, but not saved).
    for v in model.weights:
        if getattr(v, "_sparseopt_probe_of", None) is not None:
            del got[f"weight:{v.path}"]
    bookkeeping = {k for k in want if k.endswith(("_sparse_grad", "_dropped_ids"))}
    assert len(bookkeeping) == 2 * len(fixture.UPDATERS)
    assert sorted(got) == sorted(set(want) - bookkeeping)
    assert sum(k.startswith("optimizer:") for k in got) > 10  # tables' state and Adam's
    for key in got:
        np.testing.assert_allclose(got[key], want[key], rtol=RTOL, atol=ATOL, err_msg=key)


def test_checkpoint_of_main_0741813_resumes_exactly():
    check_fixture_resumes()


# Runs once (in the JAX session, the two sessions' times balanced): the child is
# JAX whatever the session's backend; XLA_FLAGS sets the ISA of JAX's whole step
# (TF compiles only parts of its step with XLA).
@pytest.mark.backend_independent
@pytest.mark.jax_session
def test_the_fixture_check_holds_on_a_cpu_without_avx512():
    """The same check where XLA may use AVX2 at most, as on many x86-64 machines."""
    env = child_env("jax", XLA_FLAGS="--xla_cpu_max_isa=AVX2")
    proc = subprocess.run([sys.executable, "-c", "from tests.test_checkpoint_fixture import "
                           "check_fixture_resumes as c; c(); print('ok')"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_keras_rs_weights_of_main_947df4a_load_with_the_legacy_helper():
    """Then, keras-rs tables were saved under `sparse_embed_reduce*` once sparseopt had
    built the optimizer; `load_legacy_keras_rs_weights` reads them, into a model with or
    without sparseopt."""
    from tests.fixtures import make_keras_rs_weights as rs_fixture

    backend = keras.backend.backend()
    path = os.path.join(rs_fixture.HERE, f"keras_rs_{backend}.weights.h5")
    want = dict(np.load(os.path.join(rs_fixture.HERE, f"keras_rs_{backend}_expected.npz")))
    for optimizer in (sparseopt.DispatchOptimizer(keras.optimizers.Adam(1e-2)), "adam"):
        model = rs_fixture.build_model()
        model.compile(optimizer=optimizer, loss="mse")
        sparseopt.saving.load_legacy_keras_rs_weights(model, path)
        got = {w.path: keras.ops.convert_to_numpy(w) for w in model.weights}
        assert set(got) == {k for k in want if not k.endswith(("_sparse_grad", "_dropped_ids"))}
        for key, value in got.items():
            np.testing.assert_array_equal(value, want[key], err_msg=key)
        model.fit(*rs_fixture.data(1), batch_size=rs_fixture.BATCH, verbose=0)  # still trains
