"""Stochastic weight averaging of tables (`swa_period`) against TF Addons' dense definition.

The reference (NumPy) takes every snapshot of the whole table, as TF Addons'
`SWA` wrapper does: after the update of step `t` (1-based) with
`t - 1 >= start` and `(t - 1 - start) % period == 0`,
`average <- (k average + w) / (k + 1)` for every row, touched or not. The
updaters keep a per-row record instead; the tables here are small with few
ids a step, so most rows miss most snapshots between their changes.
"""

import keras
import numpy as np
import pytest

import sparseopt
from tests import reference
from tests.conftest import to_np
from tests.helpers import batches, dot_loss, kinds_by_backend, table_model

VOCAB, WIDTH, N_IDS, BATCH, STEPS = 40, 3, 2, 2, 23
START, PERIOD = 3, 4


def dense_swa(name, cfg, table0, xs, ys, lr, steps):
    """`(table after `steps` steps, its SWA average)` by TF Addons' definition."""
    table = np.asarray(table0, np.float64)
    state = reference.initial_state(name, table.shape, cfg)
    average, k = np.zeros_like(table), 0
    for t, (x, y) in enumerate(zip(xs[:steps], ys[:steps]), start=1):
        table, state = reference.sparse_step(name, table, state, x, y / x.shape[0], lr, cfg,
                                             step=t)
        if t - 1 >= START and (t - 1 - START) % PERIOD == 0:
            average = (k * average + table) / (k + 1)
            k += 1
    return table, (average if k else table)


CASES = {"SGD": {}, "Adam": {}, "Adagrad": {}, "SGD-momentum": {"momentum": 0.9},
         "Adafactor": {}}
# Adafactor's dense form moves no untouched row either (its reference is Keras'
# own optimizer, not `tests/reference.py`): checked against its run without SWA.


@pytest.mark.parametrize("case", kinds_by_backend(sorted(CASES), sorted(CASES), ["Adam"]))
def test_the_table_takes_the_dense_swa_average_at_the_end_of_fit(case):
    name = case.split("-")[0]
    cfg = CASES[case]
    rng = np.random.default_rng(4)
    xs, ys = batches(rng, STEPS, BATCH, N_IDS, VOCAB, WIDTH)
    updater = getattr(sparseopt.updaters, name)(0.05, swa_period=PERIOD, swa_start=START,
                                                **cfg)
    model, emb = table_model(VOCAB, WIDTH, N_IDS, updater)
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.1)),
                  loss=dot_loss)
    table0 = to_np(emb.embeddings).copy()
    # Half the steps, then the average read mid-training (the table itself is not
    # touched by reading it).
    half = STEPS // 2
    model.fit(xs[:half].reshape(-1, N_IDS), ys[:half].reshape(-1, N_IDS, WIDTH),
              batch_size=BATCH, shuffle=False, verbose=0)
    want_table, want_average = dense_swa(name, cfg, table0, xs, ys, 0.05, half)
    # (`fit` ended: the table took its average.)
    np.testing.assert_allclose(to_np(emb.embeddings), want_average, rtol=1e-5, atol=1e-6)
    assert np.any(np.abs(want_average - want_table) > 1e-4)  # the average is not the table
    np.testing.assert_allclose(to_np(model.optimizer.table_swa_average(emb.embeddings)),
                               want_average, rtol=1e-5, atol=1e-6)
    touched = np.unique(xs[:half])
    assert touched.size < VOCAB  # rows no step touched: their average is the row


def test_swa_average_mid_training_and_untouched_rows():
    """`table_swa_average` between steps equals the dense average; untouched rows
    average to themselves; before the first snapshot the average is the table."""
    rng = np.random.default_rng(5)
    xs, ys = batches(rng, STEPS, BATCH, N_IDS, VOCAB, WIDTH, dup_vocab=20)
    model, emb = table_model(VOCAB, WIDTH, N_IDS,
                             sparseopt.updaters.Adam(0.05, swa_period=PERIOD, swa_start=START))
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.1)),
                  loss=dot_loss)
    table0 = to_np(emb.embeddings).copy()
    for t in range(STEPS):
        model.train_on_batch(xs[t], ys[t])
        if t + 1 in (START, START + 1, 9, STEPS):
            want_table, want_average = dense_swa("Adam", {}, table0, xs, ys, 0.05, t + 1)
            np.testing.assert_allclose(to_np(emb.embeddings), want_table, rtol=1e-5, atol=1e-6)
            got = to_np(model.optimizer.table_swa_average(emb.embeddings))
            np.testing.assert_allclose(got, want_average, rtol=1e-5, atol=1e-6)
            np.testing.assert_array_equal(got[20:], table0[20:])


def test_swa_settings_are_checked_and_saved():
    updater = sparseopt.updaters.SGD(0.1, swa_period=5, swa_start=2)
    config = updater.get_config()
    assert config["swa_period"] == 5 and config["swa_start"] == 2
    assert sparseopt.updaters.SGD.from_config(config).swa == (2, 5)
    with pytest.raises(ValueError, match="`swa_period` with lazy=False is not supported"):
        sparseopt.updaters.SGD(0.1, momentum=0.9, lazy=False, swa_period=5)
    with pytest.raises(ValueError, match="`swa_period` with ema_momentum.*one or the other"):
        sparseopt.updaters.Adam(0.1, ema_momentum=0.9, swa_period=5)
    with pytest.raises(ValueError, match="`swa_period` must be a positive int"):
        sparseopt.updaters.Adam(0.1, swa_period=0)
    with pytest.raises(ValueError, match="`swa_start` must be an int >= 0"):
        sparseopt.updaters.Adam(0.1, swa_period=2, swa_start=-1)
    model, emb = table_model(VOCAB, WIDTH, N_IDS, sparseopt.updaters.Adam(0.1))
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.1)),
                  loss=dot_loss)
    # Built first (a shortcut, not the users' path): asks a built optimizer, without training.
    model.optimizer.build(model.trainable_variables)
    with pytest.raises(ValueError, match="keeps no weight average; give its updater"):
        model.optimizer.table_swa_average(emb.embeddings)


def test_swa_of_dense_adafactor_averages_the_steps_it_takes():
    """Adafactor(lazy=False) with SWA trains as without it, and its average is the
    average of its own tables at the snapshot steps."""
    rng = np.random.default_rng(7)
    xs, ys = batches(rng, 12, BATCH, N_IDS, VOCAB, WIDTH)
    runs = {}
    for averaged in (False, True):
        extra = {"swa_period": PERIOD, "swa_start": START} if averaged else {}
        model, emb = table_model(VOCAB, WIDTH, N_IDS, sparseopt.updaters.Adafactor(
            0.05, lazy=False, **extra), init="zeros")
        model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.1)),
                      loss=dot_loss)
        tables = []
        for t in range(12):
            model.train_on_batch(xs[t], ys[t])
            tables.append(to_np(emb.embeddings).copy())
        runs[averaged] = (model, emb, tables)
    np.testing.assert_array_equal(runs[True][2][-1], runs[False][2][-1])
    snaps = [tables for t, tables in enumerate(runs[False][2], start=1)
             if t - 1 >= START and (t - 1 - START) % PERIOD == 0]
    model, emb, _ = runs[True]
    np.testing.assert_allclose(to_np(model.optimizer.table_swa_average(emb.embeddings)),
                               np.mean(snaps, axis=0), rtol=1e-5, atol=1e-7)
