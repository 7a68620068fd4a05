"""16-bit tables: float32 state, stochastic rounding, saturation (docs/semantics.md, Precision).

The written values are checked bit for bit against the NumPy reference of the
documented hash and rounding (tests/reference.py), their expectation against
the float32 values with a bound that nearest rounding fails, and training
through `fit` against the float32 result.
"""

import keras
import ml_dtypes
import numpy as np
import pytest
from keras import ops

import sparseopt
from sparseopt.storage import precision
from tests import reference
from tests.conftest import to_np
from tests.helpers import batches, dot_loss, table_model

HALF = ["bfloat16", "float16"]


def _written(values, dtype, rows, step=1, stochastic=True, seed=0, table_index=0,
             variable_index=0):
    rounding = precision.Rounding(stochastic, seed, table_index)
    out = rounding.stored(np.asarray(values, np.float32), dtype, np.int32(step),
                          np.asarray(rows, np.int32), variable_index)
    assert keras.backend.standardize_dtype(out.dtype) == dtype
    return to_np(ops.cast(out, "float32"))


@pytest.mark.parametrize("dtype", HALF)
def test_written_values_are_the_documented_rounding_bit_for_bit(dtype):
    rng = np.random.default_rng(0)
    rows = rng.integers(0, 2**31 - 1, 300)
    # Normal values of every size, float16's subnormals, and values past
    # float16's largest (saturated).
    scales = [1.0, 1e-3, 3e-6, 1e-8, 2e4, 1e5]
    x = np.concatenate([rng.normal(size=(50, 8)) * s for s in scales]).astype(np.float32)
    for seed, table_index, variable_index, step in [(0, 0, 0, 1), (7, 3, 2, 123456)]:
        bits = reference.rounding_bits(seed, table_index, variable_index, step, rows, 8)
        key = precision.stream_key(seed, table_index, variable_index)
        np.testing.assert_array_equal(
            to_np(precision.random_bits(key, np.int32(step), rows.astype(np.int32), 8)), bits)
        got = _written(x, dtype, rows, step, True, seed, table_index, variable_index)
        np.testing.assert_array_equal(got, reference.stochastic_round(x, dtype, bits))
    # Nearest: saturated, then rounded to nearest.
    largest = float(ml_dtypes.finfo(getattr(ml_dtypes, dtype, np.float16)).max)
    want = np.clip(x, -largest, largest).astype(getattr(ml_dtypes, dtype, np.float16))
    np.testing.assert_array_equal(_written(x, dtype, rows, stochastic=False),
                                  want.astype(np.float64))


@pytest.mark.parametrize("dtype", HALF)
def test_stochastic_rounding_is_unbiased_and_nearest_is_not(dtype):
    """Each value's written mean over many (row, step) draws equals it.

    A written value is one of two neighbours `spacing` apart: its error has
    variance at most spacing^2 / 4, so the mean of `n` independent draws is
    within `3 spacing / sqrt(n)` (six standard deviations; a false failure
    has probability below 1e-8): 0.021 spacing here. Nearest rounding misses
    the values 0.2 and 0.7 of the way by 0.2 and 0.3 spacing, 10x that bound.
    """
    n_rows, steps = 500, 40  # 20,000 draws per value
    # Values at fractions 0.2, 0.5 and 0.7 of the way between two neighbours
    # (either sign), in the normal range and in float16's subnormal range.
    base = [1.0, -3.0, 0.0123, 2.0**-20]
    values, spacings = [], []
    for b in base:
        toward, away = reference.half_neighbours(b, dtype)
        if toward == b:  # exactly representable: step to the next pair
            toward, away = reference.half_neighbours(b + (away - toward) / 2, dtype)
        for f in (0.2, 0.5, 0.7):
            values.append(np.float32(toward + f * (away - toward)))
            spacings.append(abs(away - toward))
    values, spacings = np.array(values, np.float32), np.array(spacings)
    block = np.tile(values, (n_rows, 1))
    rows = np.arange(n_rows)
    total = np.zeros(values.shape)
    for step in range(1, steps + 1):
        total += _written(block, dtype, rows, step).sum(axis=0)
    error = np.abs(total / (n_rows * steps) - values.astype(np.float64)) / spacings
    bound = 3.0 / np.sqrt(n_rows * steps)
    assert np.all(error < bound), (error, bound)
    nearest = np.abs(_written(values[None], dtype, [0], stochastic=False)[0]
                     - values.astype(np.float64)) / spacings
    assert np.all(nearest[np.isin(np.arange(len(values)) % 3, [0, 2])] > 9 * bound)


def _constant_pull(dtype, stochastic, rows=64, width=8, steps=200, lr=4e-4):
    """Rows at 1.0, each moved by -lr per step (SGD, gradient 1), through `fit`.

    Each batch holds every row once; the loss is summed over the batch."""
    ids = keras.Input((1,), dtype="int32")
    emb = sparseopt.layers.SparseEmbedding(
        rows, width, embeddings_initializer="ones", dtype=dtype,
        updater=sparseopt.updaters.SGD(lr, stochastic_rounding=stochastic))
    model = keras.Model(ids, emb(ids))
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD()),
                  loss=lambda y, p: rows * ops.sum(ops.cast(p, "float32"), axis=-1))
    x = np.tile(np.arange(rows, dtype=np.int32), steps)[:, None]
    model.fit(x, np.zeros((len(x), width)), batch_size=rows, shuffle=False, verbose=0)
    return to_np(emb.embeddings), model


def test_nearest_rounding_loses_small_updates_that_stochastic_rounding_keeps():
    """The issue's case: updates of 4e-4 are under half a bfloat16 step at 1.0."""
    want, _ = _constant_pull("float32", True)
    np.testing.assert_allclose(want, 1.0 - 200 * 4e-4, rtol=1e-5)
    nearest, _ = _constant_pull("bfloat16", False)
    assert np.all(nearest == 1.0)  # not one update survived
    stochastic, model = _constant_pull("bfloat16", True)
    assert model.optimizer.table_state(model.layers[1].embeddings) == {}
    # Each entry is a sum of 200 independent rounding errors of variance at
    # most (2^-8)^2 / 4 (the spacing below 1.0): the mean of 512 entries is
    # within six standard deviations of 0.92.
    bound = 6 * np.sqrt(200 / 512) * 2.0**-8 / 2
    assert abs(stochastic.mean() - 0.92) < bound, (stochastic.mean(), bound)
    assert np.std(stochastic) > 0  # rows rounded independently


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("updater, slots", [
    (lambda: sparseopt.updaters.Adam(0.01), {"momentum": "float32", "velocity": "float32"}),
    (lambda: sparseopt.updaters.SGD(0.01, momentum=0.9, lazy=False, weight_decay=0.1),
     {"momentum": "float32", "last_step": "int32"}),
])
def test_state_is_float32_whatever_the_table_dtype(dtype, updater, slots):
    model, emb = table_model(32, 8, 2, updater(), dtype=dtype)
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD()),
                  loss=dot_loss)
    # Built first (a shortcut, not the users' path): reads the state's dtypes without training.
    model.optimizer.build(model.trainable_variables)
    assert emb.embeddings.dtype == dtype
    state = model.optimizer.table_state(emb.embeddings)
    assert {k: v.dtype for k, v in state.items()} == slots


@pytest.mark.parametrize("given_on", ["table", "updater"])
def test_state_dtype_stores_the_state_in_16_bits_rounded_the_same_way(given_on):
    """`state_dtype="bfloat16"`: half the state memory; the accumulator is
    written with its own stream of bits (variable index 1). Given on the table
    (`TableStorage`), or on the updater (the older spelling)."""
    rng = np.random.default_rng(3)
    vocab, width, n_ids, batch = 40, 4, 3, 4
    xs, ys = batches(rng, 15, batch, n_ids, vocab, width)
    ys = ys.astype(ml_dtypes.bfloat16).astype(np.float32)
    settings = {"state_dtype": "bfloat16", "rounding_seed": 11}
    if given_on == "updater":
        updater, storage = sparseopt.updaters.Adagrad(0.05, **settings), None
    else:
        updater, storage = sparseopt.updaters.Adagrad(0.05), sparseopt.TableStorage(**settings)
    model, emb = table_model(vocab, width, n_ids, updater, dtype="bfloat16", storage=storage)
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD()),
                  loss=dot_loss)
    table0 = to_np(emb.embeddings)
    model.fit(xs.reshape(-1, n_ids), ys.reshape(-1, n_ids, width), batch_size=batch,
              shuffle=False, verbose=0)
    accumulator = model.optimizer.table_state(emb.embeddings)["accumulator"]
    assert accumulator.dtype == "bfloat16"

    # The reference, rounding table and accumulator after every step.
    table = np.asarray(table0, np.float64)
    state = reference.initial_state("Adagrad", table.shape, {})
    for t, (x, y) in enumerate(zip(xs, ys)):
        table, state = reference.sparse_step("Adagrad", table, state, x, y / batch, 0.05, {},
                                             step=t + 1)
        for i, name in [(0, None), (1, "accumulator")]:
            bits = reference.rounding_bits(11, 0, i, t + 1, np.arange(vocab), width)
            if name is None:
                table = reference.stochastic_round(table, "bfloat16", bits)
            else:
                state[name] = reference.stochastic_round(state[name], "bfloat16", bits)
    got = to_np(emb.embeddings)
    # A rounding flip in the accumulator (float32 here, float64 there) moves
    # its row's later steps a little: most entries equal, all within 2 steps
    # (of the size of the table's values, 0.05: entries may have crossed zero).
    assert np.mean(got == table) > 0.9
    np.testing.assert_allclose(got, table, rtol=2 * 2.0**-7, atol=2 * 2.0**-7 * 0.05)
    np.testing.assert_allclose(to_np(accumulator), state["accumulator"], rtol=2 * 2.0**-7)


def _two_tables(seed, dtype="bfloat16", group_tables=False):
    keras.utils.set_random_seed(5)
    inputs, outs = [], []
    for name in ("a", "b"):
        ids = keras.Input((3,), dtype="int32", name=f"{name}_ids")
        layer = sparseopt.layers.SparseEmbedding(
            50, 4, name=name, dtype=dtype,
            updater=sparseopt.updaters.Adagrad(0.05, rounding_seed=seed))
        inputs.append(ids)
        outs.append(keras.layers.Flatten()(layer(ids)))
    model = keras.Model(inputs, keras.layers.Concatenate()(outs))
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD(),
                                                        group_tables=group_tables),
                  loss=dot_loss)
    rng = np.random.default_rng(0)
    x = [rng.integers(0, 50, (64, 3)).astype("int32") for _ in range(2)]
    y = rng.normal(size=(64, 24)).astype("float32")
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    return [to_np(v) for v in model.weights], model


def test_same_seed_same_result_another_seed_another():
    first, _ = _two_tables(seed=0)
    again, _ = _two_tables(seed=0)
    other, _ = _two_tables(seed=1)
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    assert any(not np.array_equal(a, b) for a, b in zip(first, other))


def test_grouped_bfloat16_tables_round_as_tables_alone():
    """Bits are keyed by each table's own index and rows: grouping changes nothing
    but float rounding (one bfloat16 step, rarely)."""
    grouped, model = _two_tables(seed=0, group_tables=True)
    alone, _ = _two_tables(seed=0)
    assert model.optimizer.table_groups == [["a/embeddings", "b/embeddings"]]
    for a, b in zip(grouped, alone):
        assert np.mean(a == b) > 0.99
        np.testing.assert_allclose(a, b, rtol=2.0**-7, atol=1e-30)


@pytest.mark.parametrize("stochastic", [True, False])
def test_float16_values_beyond_its_range_are_saturated_never_inf(stochastic):
    ids = keras.Input((1,), dtype="int32")
    emb = sparseopt.layers.SparseEmbedding(
        4, 2, dtype="float16", embeddings_initializer=keras.initializers.Constant(6e4),
        updater=sparseopt.updaters.SGD(1.0, stochastic_rounding=stochastic))
    model = keras.Model(ids, emb(ids))
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD()),
                  loss=lambda y, p: -3e4 * ops.sum(ops.cast(p, "float32"), axis=-1))
    model.fit(np.zeros((3, 1), np.int32), np.zeros((3, 2)), batch_size=1, verbose=0)
    table = to_np(emb.embeddings)
    assert np.all(np.isfinite(table))
    np.testing.assert_array_equal(table[0], 65504.0)  # 6e4 + 3e4 saturated
    np.testing.assert_array_equal(table[1:], 6e4)  # untouched (6e4 is a float16 value)


def test_float16_tables_train_under_loss_scaling_as_without():
    """The row gradients reach the rule unscaled (power-of-two scales are exact)."""
    rng = np.random.default_rng(4)
    xs, ys = batches(rng, 6, 8, 3, 60, 4)

    def run(**kwargs):
        keras.utils.set_random_seed(2)
        model, emb = table_model(60, 4, 3, sparseopt.updaters.Adagrad(0.05), dtype="float16")
        model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD(), **kwargs),
                      loss=dot_loss)
        model.fit(xs.reshape(-1, 3), ys.reshape(-1, 3, 4), batch_size=8, shuffle=False,
                  verbose=0)
        return to_np(emb.embeddings), to_np(model.optimizer.table_state(
            emb.embeddings)["accumulator"])

    plain, scaled = run(), run(loss_scale_factor=2.0**10)
    for a, b in zip(plain, scaled):
        assert np.all(np.isfinite(b))
        np.testing.assert_array_equal(a, b)


@pytest.mark.backend_independent
def test_storage_settings_are_checked_and_part_of_the_config():
    updater = sparseopt.updaters.Adagrad(0.1, state_dtype="bfloat16",
                                         stochastic_rounding=False, rounding_seed=3)
    config = updater.get_config()
    assert (config["state_dtype"], config["stochastic_rounding"], config["rounding_seed"]) \
        == ("bfloat16", False, 3)
    assert type(updater).from_config(config).get_config() == config
    assert "state_dtype" not in sparseopt.updaters.Adagrad(0.1).get_config()
    with pytest.raises(ValueError, match="Adagrad: `state_dtype` must be one of"):
        sparseopt.updaters.Adagrad(0.1, state_dtype="int8")
    with pytest.raises(TypeError, match="SGD: `stochastic_rounding` must be True or False"):
        sparseopt.updaters.SGD(0.1, stochastic_rounding=1)
    with pytest.raises(ValueError, match="Ftrl: `rounding_seed` must be an int"):
        sparseopt.updaters.Ftrl(0.1, rounding_seed=-1)


@pytest.mark.backend_independent
def test_table_storage_is_checked_saved_with_its_layer_and_refuses_a_disagreeing_updater():
    storage = sparseopt.TableStorage(state_dtype="float16", stochastic_rounding=False,
                                     rounding_seed=5)
    layer = sparseopt.layers.SparseEmbedding(10, 4, sparseopt.updaters.Adagrad(0.1),
                                             storage=storage, name="t")
    config = layer.get_config()
    assert config["storage"] == {"state_dtype": "float16", "stochastic_rounding": False,
                                 "rounding_seed": 5}
    assert type(layer).from_config(config).storage == storage
    assert "storage" not in sparseopt.layers.SparseEmbedding(
        10, 4, sparseopt.updaters.Adagrad(0.1)).get_config()  # older configs: the same
    with pytest.raises(ValueError, match="TableStorage: `state_dtype` must be one of"):
        sparseopt.TableStorage(state_dtype="int8")
    with pytest.raises(TypeError, match="`storage` must be a sparseopt.TableStorage"):
        sparseopt.layers.SparseEmbedding(10, 4, sparseopt.updaters.SGD(0.1), storage="bf16")

    def trained(updater, storage):
        model, emb = table_model(10, 4, 2, updater, dtype="bfloat16", storage=storage)
        model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD()),
                      loss=dot_loss)
        # Built first (a shortcut, not the users' path): reads the state's dtypes without training.
        model.optimizer.build(model.trainable_variables)
        return model.optimizer.table_state(emb.embeddings)["accumulator"]

    # The table's storage wins over an updater at its defaults; one that agrees is fine.
    assert trained(sparseopt.updaters.Adagrad(0.1), storage).dtype == "float16"
    assert trained(sparseopt.updaters.Adagrad(0.1, state_dtype="float16",
                                              stochastic_rounding=False, rounding_seed=5),
                   storage).dtype == "float16"
    assert trained(sparseopt.updaters.Adagrad(0.1, state_dtype="bfloat16"),
                   None).dtype == "bfloat16"
    with pytest.raises(ValueError, match="Table 'emb/embeddings': its storage .* and its "
                                         "updater Adagrad's storage settings .* differ"):
        trained(sparseopt.updaters.Adagrad(0.1, state_dtype="bfloat16"), storage)
