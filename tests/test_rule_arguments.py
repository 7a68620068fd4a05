"""A rule gets its step's hyperparameters as an argument (`hp`), never from a context.

A user's rule reads `hp.learning_rate`, `hp.step` and its own hyperparameters
by name, and a value changed after compile (a variable of the step) reaches
it at the next step; a rule written with sparseopt 0.2's signatures
(`update(rows, state, grads, learning_rate, step)` reading `self.value`) still
trains the same, with a deprecation warning when its class is defined; a
name the updater never declared is an error naming the ones it has.
"""

import warnings

import keras
import numpy as np
import pytest

import sparseopt
from tests.conftest import to_np
from tests.helpers import dot_loss


class DampedSGD(sparseopt.updaters.Updater):
    """w <- w - lr * g / (1 + damping * t)."""

    def __init__(self, learning_rate=0.1, damping=0.5, **options):
        super().__init__(learning_rate, **options)
        self.hyperparameter("damping", damping, lambda v: v >= 0, ">= 0")
        self.slots = ()

    def update(self, rows, state, grads, hp):
        t = keras.ops.cast(hp.step, "float32")
        return rows - hp.learning_rate * grads / (1.0 + hp.damping * t), {}


with warnings.catch_warnings(record=True) as DEFINED:
    warnings.simplefilter("always")

    class OlderDampedSGD(sparseopt.updaters.Updater):
        """The same rule, written the older way."""

        def __init__(self, learning_rate=0.1, damping=0.5, **options):
            super().__init__(learning_rate, **options)
            self.hyperparameter("damping", damping, lambda v: v >= 0, ">= 0")
            self.slots = ()

        def update(self, rows, state, grads, learning_rate, step):
            t = keras.ops.cast(step, "float32")
            return rows - learning_rate * grads / (1.0 + self.value("damping", step) * t), {}


class Misspelt(DampedSGD):
    def update(self, rows, state, grads, hp):
        return rows - hp.dampnig * grads, {}


def _trained(updater, change=None):
    keras.utils.set_random_seed(4)
    ids = keras.Input((3,), dtype="int32")
    emb = sparseopt.layers.SparseEmbedding(10, 2, updater=updater, name="emb")
    model = keras.Model(ids, emb(ids))
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.1)),
                  loss=dot_loss)
    x = np.array([[1, 2, 2], [3, 1, 9]], "int32")
    y = np.ones((2, 3, 2), "float32")
    start = to_np(emb.embeddings).copy()
    model.train_on_batch(x, y)
    if change is not None:
        change(updater)
    model.train_on_batch(x, y)
    return start, to_np(emb.embeddings)


def _numpy(start, dampings):
    table = start.astype(np.float64)
    grads = np.zeros_like(table)
    for i, n in ((1, 2), (2, 2), (3, 1), (9, 1)):  # each id's occurrences in the batch
        grads[i] = n * 1.0 / 2  # dot_loss: y / batch
    for t, damping in enumerate(dampings, start=1):
        table = table - 0.1 * grads / (1.0 + damping * t)
    return table


def test_a_rule_reads_its_hyperparameters_from_its_argument_and_follows_changes():
    start, got = _trained(DampedSGD(0.1, damping=0.5),
                          change=lambda u: setattr(u, "damping", 2.0))
    np.testing.assert_allclose(got, _numpy(start, [0.5, 2.0]), rtol=1e-6)


def test_a_rule_written_the_older_way_trains_the_same_and_is_told_so():
    assert any(issubclass(w.category, DeprecationWarning) and "OlderDampedSGD" in str(w.message)
               and "hp" in str(w.message) for w in DEFINED)
    change = lambda u: setattr(u, "damping", 2.0)  # noqa: E731
    start, got = _trained(OlderDampedSGD(0.1, damping=0.5), change)
    want_start, want = _trained(DampedSGD(0.1, damping=0.5), change)
    np.testing.assert_array_equal(start, want_start)
    np.testing.assert_array_equal(got, want)


def test_a_name_the_updater_never_declared_is_an_error_listing_its_names():
    with pytest.raises(AttributeError, match=r"no hyperparameter `dampnig`.*'damping'"):
        _trained(Misspelt(0.1))
