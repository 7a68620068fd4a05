"""Checkpoints written before the TableTrainer redesign load and resume bit for bit."""

import os

import keras
import numpy as np

import sparseopt  # noqa: F401  (registers the classes the file names)
from tests.fixtures import make_checkpoint as fixture


def test_checkpoint_of_main_0741813_resumes_bit_for_bit():
    backend = keras.backend.backend()
    path = os.path.join(fixture.HERE, f"main_{backend}.keras")
    want = dict(np.load(os.path.join(fixture.HERE, f"main_{backend}_expected.npz")))
    model = keras.saving.load_model(path)
    x, y = fixture.data(5)
    model.fit(x[3 * fixture.BATCH:], y[3 * fixture.BATCH:], batch_size=fixture.BATCH,
              shuffle=False, verbose=0)
    got = fixture.snapshot(model)
    assert sorted(got) == sorted(want)
    assert sum(k.startswith("optimizer:") for k in got) > 10  # tables' state and Adam's
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
