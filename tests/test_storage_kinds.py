"""A kind of row storage is a module and a registry entry: nothing else changes.

A test-only kind, `CountingRows` (the in-memory kind, counting each read and
write made through it), is registered here under a name of its own and chosen
by a `TableStorage` subclass naming it. It trains one table per registered
updater configuration (the registry drives the cases: a new updater is covered
without an edit) through the engine, the rules and the dispatcher as they
are, and every table ends bit for bit where the in-memory kind's ends, state
included; every step's rows went through it, and so did the end of `fit`'s
whole-table writes where an updater has them.
"""

import collections
import dataclasses

import keras
import numpy as np
import pytest

import sparseopt
from sparseopt import backend
from sparseopt.storage.memory import InMemory
from tests.conftest import to_np
from tests.helpers import optimizer_state, registered_cases


class CountingRows(InMemory):
    """The in-memory kind, counting what goes through it (per table path)."""

    seen = collections.Counter()

    def read(self, ids, context=None):
        CountingRows.seen["read", self.table.path] += 1
        return super().read(ids, context)

    def write(self, ids, rows, state, step, count=None, keep=None, row_stream=0,
              rounded=True):
        CountingRows.seen["write", self.table.path] += 1
        super().write(ids, rows, state, step, count, keep, row_stream, rounded)

    def assign_values(self, values, step):
        CountingRows.seen["whole", self.table.path] += 1
        super().assign_values(values, step)


sparseopt.storage.register("counting", CountingRows)


@dataclasses.dataclass(frozen=True)
class Counting(sparseopt.TableStorage):
    """Table settings that pick the counting kind."""

    kind = "counting"


CASES = registered_cases()
STORAGE_KEYS = ("state_dtype", "stochastic_rounding", "rounding_seed")


def _train(settings_class):
    """One table per registered configuration, trained by `fit`; its weights and state."""
    keras.backend.clear_session(free_memory=False)
    keras.utils.set_random_seed(5)
    n = len(CASES)
    ids = keras.Input((2 * n,), dtype="int32")
    outs = []
    for i, (entry, cfg) in enumerate(CASES.values()):
        # Storage settings belong to the table (an updater may give the older spelling).
        settings = {k: v for k, v in cfg.items() if k in STORAGE_KEYS}
        rule = {k: v for k, v in cfg.items() if k not in STORAGE_KEYS}
        layer = sparseopt.layers.SparseEmbedding(
            40, 3, updater=entry(0.05, **rule), storage=settings_class(**settings),
            name=f"t{i}")
        outs.append(keras.layers.Flatten()(layer(ids[:, 2 * i:2 * i + 2])))
    model = keras.Model(ids, keras.layers.Dense(1, name="head")(
        keras.layers.Concatenate()(outs)))
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.Adam(0.01)),
                  loss="mse")
    rng = np.random.default_rng(7)
    x = rng.integers(-2, 42, (32, 2 * n)).astype("int32")
    y = rng.normal(size=(32, 1)).astype("float32")
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    return ({v.path: to_np(v) for v in model.weights},
            {v.path: to_np(v) for v in optimizer_state(model.optimizer)})


# What this checks, that a kind plugs in through the registry with nothing else changed,
# is the same on either backend, whose plumbing every other storage test takes on both:
# once, in the JAX session (21 s of the TensorFlow session's time, 5 s of JAX's).
@pytest.mark.jax_session
def test_a_new_kind_of_storage_trains_every_updater_as_memory_does(monkeypatch):
    # The backend's fused kernels update plain in-memory variables directly, never
    # through a kind's `read` and `write`: both runs take the rules' own path here
    # (the kernels are checked against it in test_backends.py and test_native.py).
    monkeypatch.setattr(backend, "KERNELS", ())
    CountingRows.seen.clear()
    (weights, state), (want_weights, want_state) = _train(Counting), _train(sparseopt.TableStorage)
    assert sorted(weights) == sorted(want_weights) and sorted(state) == sorted(want_state)
    for got, want in ((weights, want_weights), (state, want_state)):
        for path in want:
            np.testing.assert_array_equal(got[path], want[path], err_msg=path)
    for i, (name, (entry, cfg)) in enumerate(CASES.items()):
        table = f"t{i}/embeddings"
        assert CountingRows.seen["read", table] > 0 and CountingRows.seen["write", table] > 0, \
            name
        if not cfg.get("lazy", True) or cfg.get("ema_momentum") is not None:
            assert CountingRows.seen["whole", table] > 0, name  # the end of `fit`


def test_a_kind_nobody_registered_is_refused_with_the_registered_ones():
    @dataclasses.dataclass(frozen=True)
    class Nowhere(sparseopt.TableStorage):
        kind = "nowhere"

    ids = keras.Input((2,), dtype="int32")
    layer = sparseopt.layers.SparseEmbedding(5, 2, sparseopt.updaters.SGD(0.1),
                                             storage=Nowhere())
    model = keras.Model(ids, layer(ids))
    model.compile(optimizer=sparseopt.DispatchOptimizer("sgd"), loss="mse")
    with pytest.raises(ValueError, match="no row storage of kind 'nowhere'.*'counting'"):
        model.fit(np.zeros((2, 2), "int32"), np.zeros((2, 2, 2), "float32"), verbose=0)
