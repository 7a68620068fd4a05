"""Checkpoints written by earlier versions load (and resume bit for bit)."""

import os

import keras
import numpy as np

import sparseopt
from tests.fixtures import make_checkpoint as fixture


def test_checkpoint_of_main_0741813_resumes_exactly():
    """Bit for bit on JAX; to float rounding on TensorFlow (see below)."""
    backend = keras.backend.backend()
    path = os.path.join(fixture.HERE, f"main_{backend}.keras")
    want = dict(np.load(os.path.join(fixture.HERE, f"main_{backend}_expected.npz")))
    model = keras.saving.load_model(path)
    x, y = fixture.data(5)
    model.fit(x[3 * fixture.BATCH:], y[3 * fixture.BATCH:], batch_size=fixture.BATCH,
              shuffle=False, verbose=0)
    got = fixture.snapshot(model)
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
        if backend == "tensorflow":
            # TF now runs its dedup, pooled reads and rules as compiled
            # functions where 0741813 ran TF's kernels: the same arithmetic,
            # rounded differently in the last bits (up to 10 ulp after two
            # steps, measured). A state that failed to load would be off by
            # far more. Resuming stays bit for bit within a version
            # (tests/test_resume.py).
            np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-7,
                                       err_msg=key)
        else:
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)


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
