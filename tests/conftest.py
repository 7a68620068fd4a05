import gc
import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# `make test` runs 40 examples of each property test per backend; `make
# test-all` runs the thorough 1000 (`pytest --hypothesis-profile=full`).
settings.register_profile("default", max_examples=40)
settings.register_profile("full", max_examples=1000)
settings.load_profile("default")

# The imports above (Keras, the backend, NumPy) leave ~400k objects that live
# for the whole session; frozen, no garbage collection scans them again. Each
# test resets Keras' state without a full collection (`free_memory=False`):
# collecting twice per test cost ~0.3-2 s each, minutes per session.
gc.freeze()


@pytest.fixture(autouse=True)
def _fresh_keras_state():
    keras.backend.clear_session(free_memory=False)
    keras.utils.set_random_seed(0)
    yield
    keras.backend.clear_session(free_memory=False)


def pytest_report_header(config):
    return f"keras backend: {keras.backend.backend()}"


def to_np(x):
    return np.asarray(keras.ops.convert_to_numpy(x), dtype=np.float64)
