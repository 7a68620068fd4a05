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


def _built_before_the_step(method):
    """`keras.Model.fit` / `train_on_batch` building the optimizer first, as a user can."""
    def run(model, *args, **kwargs):
        optimizer = getattr(model, "optimizer", None)
        # Accumulation sizes its buffers from a batch seen, which an unbuilt
        # model has not: Keras builds those optimizers (its default) in the step.
        inner = getattr(optimizer, "inner_optimizer", optimizer)  # (loss scaling)
        if (model.built and optimizer is not None and not optimizer.built
                and not getattr(inner, "gradient_accumulation_steps", None)):
            optimizer.build(model.trainable_variables)
        return method(model, *args, **kwargs)
    return run


@pytest.fixture(autouse=True)
def _optimizer_built_before_the_first_step(request, monkeypatch):
    """On TensorFlow, `fit` and `train_on_batch` build the optimizer before the step.

    Without a distribution strategy Keras builds it inside the first traced step,
    so TensorFlow traces the step a second time once the variables exist (Keras'
    own behavior, for dense models too); built first, as docs/backends.md shows,
    one trace. Tracing dominates the TensorFlow session: building first took
    tests/test_open_vocabulary.py there from 132 s to 86 s (alone), and the
    session in a fresh clone's `make test` from 723 to 522 s (beside the JAX
    session, 2 cores). Keras' default stays tested: tests marked
    `keras_builds_optimizer` (all of tests/test_dispatch.py), accumulation (see
    `_built_before_the_step`), child processes, and
    `test_an_optimizer_built_before_fit_trains_exactly_as_one_built_by_fit`,
    which holds both builds equal bit for bit for every updater.
    """
    if (keras.backend.backend() == "tensorflow"
            and request.node.get_closest_marker("keras_builds_optimizer") is None):
        for name in ("fit", "train_on_batch"):
            monkeypatch.setattr(keras.Model, name,
                                _built_before_the_step(getattr(keras.Model, name)))
    yield
