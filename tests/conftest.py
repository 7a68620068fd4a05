import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_keras_state():
    keras.backend.clear_session()
    keras.utils.set_random_seed(0)
    yield
    keras.backend.clear_session()


def pytest_report_header(config):
    return f"keras backend: {keras.backend.backend()}"


def to_np(x):
    return np.asarray(keras.ops.convert_to_numpy(x), dtype=np.float64)
