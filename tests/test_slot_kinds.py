"""Slots of every kind: per entry, per row, per column (`[D]`) and per table (a scalar).

A rule with whole-table state (Adafactor's column factor, a table's running
sums) declares it with `SlotSpec(kind="column" | "table")`, its per-row
contributions (`contributions`) and its once-per-step update
(`update_whole`). Checked against a NumPy replay of the same rule written
densely, on one device in one pass and in many chunks of distinct rows.
"""

import keras
import numpy as np
import pytest

import sparseopt
from sparseopt.updaters import SlotSpec
from tests.conftest import to_np
from tests.rules import ColumnScaledSGD
from tests.helpers import batches, dot_loss, table_model

VOCAB, WIDTH, IDS, STEPS, BATCH = 40, 3, 4, 6, 8


def numpy_replay(table, xs, ys, lr, beta, clipvalue=None):
    """The same rule on the dense `[V, D]` gradient (rows untouched have zero gradient)."""
    table = table.astype(np.float64)
    column, seen, row_sq = np.ones(WIDTH), 0.0, np.zeros(VOCAB)
    for x, y in zip(xs, ys):
        grad = np.zeros_like(table)
        np.add.at(grad, x.reshape(-1), y.reshape(-1, WIDTH).astype(np.float64) / x.shape[0])
        if clipvalue is not None:
            grad = np.clip(grad, -clipvalue, clipvalue)
        touched = np.unique(x)
        column = beta * column + (1 - beta) * np.sum(grad ** 2, axis=0) / VOCAB
        seen += touched.size
        row_sq[touched] += np.sum(grad[touched] ** 2, axis=-1)
        table[touched] -= lr * grad[touched] / np.sqrt(column + 1e-3)
    return table, {"column_sq": column, "rows_seen": seen, "row_sq": row_sq}


@pytest.mark.parametrize("chunks", ["one pass", "chunks of 3 rows",
                                    "one pass of more rows than a chunk (as on a GPU)"])
def test_column_and_table_slots_follow_the_dense_rule(chunks, monkeypatch):
    if chunks != "one pass":
        if keras.backend.backend() != "jax":
            pytest.skip("TF updates the distinct rows in one pass (no chunk loop)")
        from sparseopt.backend import jax_distinct
        monkeypatch.setattr(jax_distinct, "DISTINCT_CHUNK", 3)
        if "GPU" in chunks:  # tests/test_one_pass.py
            monkeypatch.setattr(jax_distinct, "loops_follow_count", lambda: False)
    keras.utils.set_random_seed(3)
    updater = ColumnScaledSGD(0.2, beta=0.5, clipvalue=0.05)
    model, emb = table_model(VOCAB, WIDTH, IDS, updater)
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.1)),
                  loss=dot_loss)
    xs, ys = batches(np.random.default_rng(0), STEPS, BATCH, IDS, VOCAB, WIDTH, dup_vocab=15)
    table0 = to_np(emb.embeddings).copy()
    for x, y in zip(xs, ys):
        model.train_on_batch(x, y)
    want_table, want = numpy_replay(table0, xs, ys, 0.2, 0.5, clipvalue=0.05)
    np.testing.assert_allclose(to_np(emb.embeddings), want_table, rtol=1e-5, atol=1e-6)
    state = model.optimizer.table_state(emb.embeddings)
    assert tuple(state["column_sq"].shape) == (WIDTH,) and tuple(state["rows_seen"].shape) == ()
    assert tuple(state["row_sq"].shape) == (VOCAB,)
    for name, value in want.items():
        np.testing.assert_allclose(to_np(state[name]), value, rtol=1e-5, atol=1e-7)


def test_a_non_finite_step_leaves_whole_slots_unchanged_too():
    model, emb = table_model(VOCAB, WIDTH, IDS, ColumnScaledSGD(0.2))
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.1)),
                  loss=dot_loss)
    xs, ys = batches(np.random.default_rng(1), 2, BATCH, IDS, VOCAB, WIDTH)
    model.train_on_batch(xs[0], ys[0])
    state = model.optimizer.table_state(emb.embeddings)
    before = {n: to_np(v).copy() for n, v in state.items()}
    table = to_np(emb.embeddings).copy()
    bad = ys[1].copy()
    bad[0, 0, 0] = np.nan
    model.train_on_batch(xs[1], bad)
    np.testing.assert_array_equal(to_np(emb.embeddings), table)
    for name, value in before.items():
        np.testing.assert_array_equal(to_np(state[name]), value)
    assert model.optimizer.skipped_steps() == {emb.embeddings.path: 1}


def test_slot_kinds_give_their_shapes_and_whole_state_refuses_catch_up():
    shapes = {kind: SlotSpec("s", kind=kind).shape((7, 3))
              for kind in ("entry", "row", "column", "table")}
    assert shapes == {"entry": (7, 3), "row": (7,), "column": (3,), "table": ()}
    assert SlotSpec("s", rowwise=True).kind == "row" and SlotSpec("s").kind == "entry"
    with pytest.raises(ValueError, match="kind must be one of"):
        SlotSpec("s", kind="diagonal")
    with pytest.raises(ValueError, match=r"whole-table state \['column_sq', 'rows_seen'\]"):
        ColumnScaledSGD(0.1, lazy=False)
    with pytest.raises(ValueError, match="whole-table state"):
        ColumnScaledSGD(0.1, ema_momentum=0.9)


def test_a_slots_initial_value_is_declared_like_any_rule_parameter():
    """`hyperparameter(..., state=False)`: checked, in the config, in the slot, never read
    by the step nor changed once made (every shipped rule with an initial accumulator)."""
    import inspect

    schedule = keras.optimizers.schedules.ExponentialDecay(0.5, 10, 0.9)
    found = []
    for name, cls in sparseopt.updaters.registry(shipped_only=True).items():
        if "initial_accumulator_value" not in inspect.signature(cls).parameters:
            continue
        found.append(name)
        updater = cls(0.1, initial_accumulator_value=0.25)
        assert updater.get_config()["initial_accumulator_value"] == 0.25
        again = cls.from_config(updater.get_config())
        assert [s.initial_value for s in again.slots if s.name == "accumulator"] == [0.25]
        assert "initial_accumulator_value" not in updater.hyperparameters
        assert "initial_accumulator_value" not in updater.state_hyperparameters
        with pytest.raises(ValueError, match="`initial_accumulator_value` must be"):
            cls(0.1, initial_accumulator_value=-1.0)
        with pytest.raises(TypeError, match="must be a float, got a schedule"):
            cls(0.1, initial_accumulator_value=schedule)
        with pytest.raises(ValueError, match="cannot change once the updater is made"):
            updater.initial_accumulator_value = 0.5
    assert sorted(found) == ["Adagrad", "AdagradMomentum", "FrequencyAwareAdagrad", "Ftrl",
                             "RowwiseAdagrad"]
