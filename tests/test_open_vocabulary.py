"""Open vocabularies (`DynamicEmbedding`): the id -> row map against a plain Python
reference (`tests/vocabulary_reference.py`), rows trained by their own id only,
rows and optimizer state that start afresh when given to a new id, skipped
steps, checkpoints and refusals."""

import os

import keras
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sparseopt
from sparseopt.vocabulary import pending as pending_lib
from tests.conftest import to_np
from tests.helpers import THOROUGH, dot_loss, kinds, registered_cases
from tests.vocabulary_reference import ReferenceVocabulary, home

WIDTH, N_IDS, BATCH = 2, 3, 4
# Ids from a small pool, so that they repeat, collide and get evicted; the
# extremes of int32 among them.
POOL = np.array([0, 1, -1, 7, 2**31 - 1, -2**31, 123456789, -987654321, 42, 4096, 65536,
                 -65536, 31, 63, 5, 99, 1000, 2024, -7, 77], dtype=np.int64)


def dynamic_model(capacity, updater=None, n_ids=N_IDS, init="zeros", **options):
    shape = (n_ids, 2) if options.get("key_halves") else (n_ids,)
    ids = keras.Input(shape, dtype="int32")
    layer = sparseopt.layers.DynamicEmbedding(
        capacity, WIDTH, updater or sparseopt.updaters.SGD(0.5), embeddings_initializer=init,
        name="dyn", **options)
    model = keras.Model(ids, layer(ids))
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.1)),
                  loss=dot_loss)
    return model, layer


def map_state(layer):
    """`({row: id}, last_seen, counts, [(id, row, step, evicted)])` read from the layer."""
    v = layer.vocabulary
    held = np.asarray(keras.ops.convert_to_numpy(v.keys.value)).astype(np.int64)
    seen = np.asarray(keras.ops.convert_to_numpy(v.last_seen.value))
    keys = sparseopt.vocabulary.join_int64(held)
    rows = {int(r): int(keys[r]) for r in np.nonzero(seen >= 0)[0]}
    stats = layer.vocabulary_stats()
    counts = {name: stats[name] for name in sparseopt.vocabulary.COUNTS}
    high, low, row, step, evicted, valid, _ = (np.asarray(keras.ops.convert_to_numpy(x))
                                               for x in pending_lib.decode(v.pending.value))
    ids = sparseopt.vocabulary.join_int64(np.stack([high, low], axis=-1))
    handed = [(int(i), int(r), int(s), bool(e))
              for i, r, s, e, ok in zip(ids, row, step, evicted, valid) if ok]
    return rows, seen, counts, handed


def reference_state(ref):
    rows = {r: ref.key[r] for r in range(ref.capacity) if ref.seen[r] >= 0}
    return rows, np.array(ref.seen), ref.stats(), ref.pending


# Each example compiles a new model (a few seconds on TF): 6 in `make test`, 60 in
# `make test-all`.
settings_ = settings(max_examples=60 if THOROUGH else 6, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])


@settings_
@given(capacity=st.integers(4, 12), probes=st.integers(1, 4),
       eviction=st.sampled_from(["lru", "lfu", "none"]), ttl=st.sampled_from([None, 1, 3]),
       admissions=st.integers(1, 6), rounds=st.integers(1, 3), seed=st.integers(0, 5),
       admit_after=st.sampled_from([1, 2, 3]), count_capacity=st.sampled_from([None, 3, 8]),
       half_life=st.integers(1, 3), default_row=st.sampled_from(["zeros", "trained"]),
       data=st.data())
def test_the_map_follows_a_plain_python_reference_step_by_step(
        capacity, probes, eviction, ttl, admissions, rounds, seed, admit_after, count_capacity,
        half_life, default_row, data):
    """Lookups, LRU / LFU / TTL, placement in rounds, the hand-over, the totals and the
    delta since a random step, after every step; and each id's row holds what SGD on
    that id's own gradients gives (zero-initialized rows: -lr x the sum of its gradients
    since it was given the row), the trained default row what SGD on the gradients of
    every lookup of an id not held gives."""
    keras.backend.clear_session(free_memory=False)
    probes = min(probes, capacity)
    options = dict(probes=probes, eviction=eviction, ttl=ttl, seed=seed,
                   admissions_per_step=admissions, placement_rounds=rounds,
                   admit_after=admit_after, count_capacity=count_capacity,
                   lfu_half_life=half_life, default_row=default_row,
                   tombstone_log=64)  # (deltas since any step of the run)
    model, layer = dynamic_model(capacity, **options)
    ref = ReferenceVocabulary(capacity, probes, eviction, ttl, seed, admissions, rounds,
                              admit_after, count_capacity, half_life)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    trained = {}  # id -> its row's value by the reference (SGD, lr 0.5)
    default = np.zeros(WIDTH)  # the trained default row, by the reference
    for _ in range(6):
        x = rng.choice(POOL, size=(BATCH, N_IDS)).astype("int32")
        y = rng.normal(size=(BATCH, N_IDS, WIDTH)).astype("float32")
        rows = ref.train(x.reshape(-1).astype(np.int64).tolist())
        model.train_on_batch(x, y)
        got, want = map_state(layer), reference_state(ref)
        assert got[0] == want[0]
        np.testing.assert_array_equal(got[1], want[1])
        assert got[2] == want[2]
        assert got[3] == want[3]
        # Rows holding an id (live, or expired and not reused yet), the hand-over
        # to the next call included.
        assert layer.vocabulary_stats()["held"] == sum(s >= 0 for s in ref._next_view()[1])
        if eviction == "lfu":
            np.testing.assert_array_equal(to_np(layer.vocabulary.frequency.counts),
                                          ref.map.freq)
        since = int(rng.integers(0, ref.step + 1))
        delta, (changed, gone) = layer.delta(since), ref.delta(since)
        assert delta.step == ref.step
        assert dict(zip(delta.ids.tolist(), delta.rows.tolist())) == changed
        assert sorted(delta.tombstones.tolist()) == sorted(gone)
        np.testing.assert_array_equal(delta.values, to_np(layer.embeddings)[delta.rows])
        # SGD on the rows the step read (ids not held: nothing, or the default row).
        grads = {}
        for key, row, g in zip(x.reshape(-1).tolist(), rows, y.reshape(-1, WIDTH) / BATCH):
            if row >= 0:
                grads[key] = grads.get(key, 0.0) + g.astype(np.float64)
            elif default_row == "trained":
                default = default - 0.5 * g.astype(np.float64)
        for key, g in grads.items():
            trained[key] = trained.get(key, np.zeros(WIDTH)) - 0.5 * g
        for key, _, _, _ in ref.pending:  # given a row: starts at zero (the initializer)
            trained[key] = np.zeros(WIDTH)
    table = to_np(layer.embeddings)
    held = ref.held()
    assert layer.held_ids() == held
    assert len(set(held.values())) == len(held)  # zero collision
    for key, row in held.items():
        np.testing.assert_allclose(table[row], trained[key], rtol=1e-5, atol=1e-6)
    assert table.shape[0] == capacity + (default_row == "trained")
    if default_row == "trained":
        np.testing.assert_allclose(table[capacity], default, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(layer.delta().default, default, rtol=1e-5, atol=1e-6)


@settings_
@given(capacity=st.integers(3, 8), probes=st.integers(1, 3),
       eviction=st.sampled_from(["lru", "lfu", "none"]), ttl=st.sampled_from([None, 1, 2]),
       k=st.integers(2, 3), seed=st.integers(0, 5), data=st.data())
def test_gradient_accumulation_admits_per_micro_step_and_keeps_rows_with_waiting_gradients(
        capacity, probes, eviction, ttl, k, seed, data):
    """With `gradient_accumulation_steps=k`, the map follows the reference after every
    micro-step with rows seen since the cycle began never taken (their gradients wait
    in the buffers), and every row holds what SGD on the mean of its micro-steps'
    gradients gives, starting afresh when given to a new id."""
    keras.backend.clear_session(free_memory=False)
    probes = min(probes, capacity)
    ids = keras.Input((N_IDS,), dtype="int32")
    layer = sparseopt.layers.DynamicEmbedding(
        capacity, WIDTH, sparseopt.updaters.SGD(0.5), embeddings_initializer="zeros",
        name="dyn", probes=probes, eviction=eviction, ttl=ttl, seed=seed,
        admissions_per_step=3, placement_rounds=2, lfu_half_life=2)
    model = keras.Model(ids, layer(ids))
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.1),
                                                        gradient_accumulation_steps=k),
                  loss=dot_loss)
    ref = ReferenceVocabulary(capacity, probes, eviction, ttl, seed, 3, 2, half_life=2)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    value = np.zeros((capacity, WIDTH))  # each row, by the reference (SGD, lr 0.5)
    waiting, cycle_start = [], 1  # (row, gradient) of the cycle so far; its first step
    for micro in range(3 * k):
        x = rng.choice(POOL[:10], size=(BATCH, N_IDS)).astype("int32")
        y = rng.normal(size=(BATCH, N_IDS, WIDTH)).astype("float32")
        rows = ref.train(x.reshape(-1).astype(np.int64).tolist(), guard=cycle_start)
        model.train_on_batch(x, y)
        got, want = map_state(layer), reference_state(ref)
        assert got[0] == want[0] and got[2] == want[2] and got[3] == want[3]
        np.testing.assert_array_equal(got[1], want[1])
        waiting += [(r, g) for r, g in zip(rows, y.reshape(-1, WIDTH) / BATCH) if r >= 0]
        given = [r for _, r, _, _ in ref.pending]
        assert not set(given) & {r for r, _ in waiting}  # (the rule, in the reference)
        if micro % k == k - 1:  # the update: the mean of the k micro-steps
            for r, g in waiting:
                value[r] -= 0.5 * g.astype(np.float64) / k
            waiting, cycle_start = [], ref.step + 1
        value[given] = 0.0  # given to a new id: starts at the initializer's zeros
        np.testing.assert_allclose(to_np(layer.embeddings), value, rtol=1e-5, atol=1e-6)
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 3


def test_with_accumulation_a_row_seen_in_the_cycle_waits_for_its_update():
    """Two ids with one home row and one probe: without accumulation the second evicts
    the first at once; with 2 micro-steps per update it waits until the update that
    applies the first id's gradients, which then land on the first id's row."""
    a, b, c = _two_ids_sharing_a_home_row(capacity=4, seed=0)
    y = np.ones((1, 1, WIDTH), "float32")
    for k, want in ((None, {b, c}), (2, {a, c})):
        keras.backend.clear_session(free_memory=False)
        ids = keras.Input((1,), dtype="int32")
        layer = sparseopt.layers.DynamicEmbedding(4, WIDTH, sparseopt.updaters.SGD(1.0),
                                                  embeddings_initializer="zeros",
                                                  probes=1, name="dyn")
        model = keras.Model(ids, layer(ids))
        model.compile(optimizer=sparseopt.DispatchOptimizer(
            keras.optimizers.SGD(), gradient_accumulation_steps=k), loss=dot_loss)
        model.train_on_batch(np.array([[a]], "int32"), y)  # a is given its home row
        model.train_on_batch(np.array([[c]], "int32"), y)  # (k=2: the first update)
        model.train_on_batch(np.array([[a]], "int32"), y)  # a's gradient (k=2: waits)
        model.train_on_batch(np.array([[b]], "int32"), y)  # b wants a's row
        assert set(layer.held_ids()) == want, k
        if k == 2:
            # a's row: the mean of the second cycle's gradients (one of 1, one none).
            row = layer.held_ids()[a]
            np.testing.assert_allclose(to_np(layer.embeddings)[row], -0.5)
            assert layer.vocabulary_stats()["unplaced"] == 1


def _two_ids_sharing_a_home_row(capacity, seed):
    """`(a, b, c)`: a and b share a home row, c has another."""
    first = {}
    for key in range(1, 1000):
        at = home(key, seed, capacity)
        if at in first:
            a = first[at]
            c = next(k for k in range(1, 1000) if home(k, seed, capacity) != at)
            return a, key, c
        first[at] = key


CASES = registered_cases()


# One of each kind of state (`make test-all`: every configuration of every updater).
# (per entry, per row, integer per row, `lazy=False`'s last step, a moving average)
@pytest.mark.parametrize("case", kinds(sorted(CASES), [
    "Adam:ema", "Ftrl:default", "FrequencyAwareAdagrad:default", "RowwiseAdagrad:default",
    "SGD:dense_momentum_decay"]))
def test_every_updater_gives_a_reused_row_fresh_state(case):
    """Registry-driven: a table of 2 rows and 3 ids, so the third id evicts the row
    seen longest ago. Right after that step, the row holds the initializer's value
    and every per-row slot its initial value (the current step for `lazy=False`'s
    last update)."""
    cls, kwargs = CASES[case]
    model, layer = dynamic_model(2, cls(0.1, **kwargs), n_ids=1,
                                 init=keras.initializers.Constant(0.25), probes=2)
    y = np.ones((1, 1, WIDTH), "float32")
    for key in (10, 20, 10, 20, 10, 20):  # both rows trained (state away from its start)
        model.train_on_batch(np.array([[key]], "int32"), y)
    before = layer.held_ids()
    model.train_on_batch(np.array([[30]], "int32"), y)  # chosen: 10's row (seen longest ago)
    row = before[10]
    assert pending_rows(layer) == [row]
    state = model.optimizer.table_state(layer.embeddings)
    np.testing.assert_array_equal(to_np(layer.embeddings)[row], 0.25)
    step = int(keras.ops.convert_to_numpy(model.optimizer.iterations))
    for spec in cls(0.1, **kwargs).slots:
        if spec.per_row:
            want = step if spec.holds_step else spec.initial_value
            want = np.asarray(want, dtype=state[spec.name].dtype)
            np.testing.assert_array_equal(to_np(state[spec.name])[row], want, err_msg=spec.name)
    model.train_on_batch(np.array([[20]], "int32"), y)  # writes the hand-over
    assert layer.held_ids() == {20: before[20], 30: row}


def pending_rows(layer):
    return [r for _, r, _, _ in map_state(layer)[3]]


def test_a_skipped_step_admits_and_evicts_nothing():
    model, layer = dynamic_model(4, probes=4, eviction="none")
    y = np.ones((BATCH, N_IDS, WIDTH), "float32")
    model.train_on_batch(np.array([[1, 2, 3]] * BATCH, "int32"), y)
    # Writes 1, 2, 3; 4 takes the last free row, 5 and 6 none (no eviction).
    model.train_on_batch(np.array([[4, 5, 6]] * BATCH, "int32"), y)
    held, table = layer.held_ids(), to_np(layer.embeddings).copy()
    bad = y.copy()
    bad[0, 0, 0] = np.nan
    model.train_on_batch(np.array([[7, 8, 9]] * BATCH, "int32"), bad)  # skipped
    assert model.optimizer.skipped_steps() == {layer.embeddings.path: 1}
    assert pending_rows(layer) == []
    np.testing.assert_array_equal(to_np(layer.embeddings), table)
    model.train_on_batch(np.array([[1, 2, 3]] * BATCH, "int32"), y)
    # 4 was handed over before the skipped step; 7, 8, 9 never were.
    assert set(layer.held_ids()) == set(held) | {4}
    assert layer.vocabulary_stats()["evicted"] == 0


def test_ids_not_held_read_zeros_and_count_as_default_lookups():
    model, layer = dynamic_model(8, init="ones", admit_probability=1.0)
    x = np.array([[11, 12, 11]], "int32")
    assert np.all(to_np(model(x)) == 0)  # nothing held yet
    model.train_on_batch(x, np.ones((1, N_IDS, WIDTH), "float32"))
    assert layer.vocabulary_stats()["default_lookups"] == 3
    out = to_np(model(x))  # the hand-over is written: rows of ones
    np.testing.assert_array_equal(out, 1.0)
    model.predict(np.array([[13, 14, 15]], "int32"), verbose=0)  # not held: zeros
    # Ids an open vocabulary does not hold are not "dropped ids", in training or not.
    assert model.optimizer.dropped_ids() == {layer.embeddings.path: 0}


@pytest.mark.parametrize("combiner", ["sum", "mean"])
def test_pooled_bags_read_the_rows_of_the_ids_held(combiner):
    """Ids not held read nothing: they add zero to a sum and do not count in a mean."""
    model, layer = dynamic_model(16, combiner=combiner, init="uniform")
    x = np.array([[5, 6, 7], [5, 8, 9]], "int32")
    model.train_on_batch(x[:1], np.zeros((1, WIDTH), "float32"))  # admits 5, 6, 7
    out = to_np(model(x))
    table, held = to_np(layer.embeddings), layer.held_ids()
    assert sorted(held) == [5, 6, 7]
    first = table[[held[5], held[6], held[7]]]
    want = [first.sum(0), table[held[5]]] if combiner == "sum" else [first.mean(0),
                                                                      table[held[5]]]
    np.testing.assert_allclose(out, np.array(want), rtol=1e-6)


@pytest.mark.parametrize("combiner", ["sum", "mean"])
def test_a_trained_default_row_is_read_by_every_id_not_held_and_counts_in_a_mean(combiner):
    model, layer = dynamic_model(16, combiner=combiner, init="uniform", default_row="trained")
    x = np.array([[5, 6, 7], [5, 8, 9]], "int32")
    model.train_on_batch(x[:1], np.zeros((1, WIDTH), "float32"))  # admits 5, 6, 7
    out = to_np(model(x))
    table, held = to_np(layer.embeddings), layer.held_ids()
    assert table.shape == (17, WIDTH) and sorted(held) == [5, 6, 7]
    assert 16 not in held.values()
    second = table[[held[5], 16, 16]]  # 8 and 9 read the default row
    want = np.array([table[[held[5], held[6], held[7]]].sum(0), second.sum(0)])
    np.testing.assert_allclose(out, want if combiner == "sum" else want / 3, rtol=1e-6)
    config = layer.get_config()
    assert config["capacity"] == 16 and config["default_row"] == "trained"
    again = sparseopt.layers.DynamicEmbedding.from_config(config)
    assert again.capacity == 16 and again.default_row == "trained"
    with pytest.raises(ValueError, match="`default_row` must be one of"):
        sparseopt.layers.DynamicEmbedding(8, 2, sparseopt.updaters.SGD(0.1), default_row="mean")


def test_loss_scaling_and_table_health_see_the_vocabulary():
    """Under a `LossScaleOptimizer` whose first steps overflow (skipped for every
    variable), nothing is admitted until a step applies; `TableHealth` reports the
    map's totals in `fit`'s logs."""
    ids = keras.Input((N_IDS,), dtype="int32")
    # (Rounds enough for 5 ids in 8 rows to all be placed in one step: this test is
    # about skipped steps, not contention.)
    layer = sparseopt.layers.DynamicEmbedding(8, WIDTH, sparseopt.updaters.SGD(0.5), name="dyn",
                                              placement_rounds=5)
    model = keras.Model(ids, layer(ids))
    scaler = keras.optimizers.LossScaleOptimizer(
        sparseopt.DispatchOptimizer(keras.optimizers.SGD()), initial_scale=2.0**127)
    model.compile(optimizer=scaler, loss=dot_loss)
    x = np.array([[1, 2, 3], [3, 4, 5]] * 2, "int32")
    y = np.full((4, N_IDS, WIDTH), 1e10, "float32")  # x 2**127: inf
    model.train_on_batch(x, y)
    assert layer.held_ids() == {}
    y = np.ones((4, N_IDS, WIDTH), "float32")
    for _ in range(200):  # the scale halves on each overflow
        model.train_on_batch(x, y * 1e-30)
        if layer.held_ids():
            break
    assert sorted(layer.held_ids()) == [1, 2, 3, 4, 5]
    logs = model.fit(x, y, batch_size=4, verbose=0,
                     callbacks=[sparseopt.callbacks.TableHealth(warn=False)]).history
    assert logs["vocabulary_held"] == [5] and logs["vocabulary_admitted"] == [5]
    assert logs["vocabulary_evicted"] == [0]
    stats = layer.vocabulary_stats()
    assert logs["vocabulary_found"] == [stats["found"]] and stats["found"] >= 12
    assert logs["vocabulary_mean_probe_length"] == [stats["probe_length"] / stats["found"]]
    assert 1 <= logs["vocabulary_mean_probe_length"][0] <= 8  # the default probes


def test_64_bit_ids_as_halves_and_int64_on_tensorflow():
    big = np.array([[2**40 + 5, -(2**50), 2**40 + 5]], dtype=np.int64)
    halves = sparseopt.vocabulary.split_int64(big)
    np.testing.assert_array_equal(sparseopt.vocabulary.join_int64(halves), big)
    model, layer = dynamic_model(8, key_halves=True)
    y = np.ones((1, N_IDS, WIDTH), "float32")
    for _ in range(2):
        model.train_on_batch(halves, y)
    assert sorted(layer.held_ids()) == sorted({2**40 + 5, -(2**50)})
    assert model.output_shape == (None, N_IDS, WIDTH)
    if keras.backend.backend() == "jax":  # (without x64: int64 would be truncated)
        with pytest.raises(ValueError, match="split_int64.*key_halves=True"):
            sparseopt.layers.DynamicEmbedding(8, WIDTH, sparseopt.updaters.SGD(0.5))(
                keras.Input((N_IDS,), dtype="int64"))
    else:
        keras.backend.clear_session(free_memory=False)
        ids = keras.Input((N_IDS,), dtype="int64")
        layer = sparseopt.layers.DynamicEmbedding(8, WIDTH, sparseopt.updaters.SGD(0.5),
                                                  name="dyn")
        model = keras.Model(ids, layer(ids))
        model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD()),
                      loss=dot_loss)
        for _ in range(2):
            model.train_on_batch(big, y)
        assert sorted(layer.held_ids()) == sorted({2**40 + 5, -(2**50)})


def test_admission_after_n_sightings_counts_every_occurrence():
    """`admit_after=3`: 5, seen twice in one step and once in the next, qualifies in
    the second step; 1, seen once then three times, in the third; 0 (three times
    at once) in the fourth; 9, seen twice, waits. Admitted ids' counts are freed."""
    model, layer = dynamic_model(16, n_ids=3, admit_after=3)
    y = np.zeros((1, 3, WIDTH), "float32")
    for ids in ([5, 5, 9], [5, 9, 1], [1, 1, 1], [0, 0, 0]):
        model.train_on_batch(np.array([ids], "int32"), y)
    assert sorted(layer.held_ids()) == [0, 1, 5]  # 0: handed over, written next call
    assert layer.vocabulary_stats()["admitted"] == 3  # (the hand-over counted already)
    counted = layer.vocabulary.sightings
    live = to_np(counted.last_seen) >= 0
    waiting = sparseopt.vocabulary.join_int64(
        np.asarray(keras.ops.convert_to_numpy(counted.keys.value))[live])
    assert dict(zip(waiting.tolist(), to_np(counted.counts)[live].tolist())) == {9: 2, 0: 3}


def test_admission_by_probability_is_reproducible_and_near_its_rate():
    def run():
        keras.backend.clear_session(free_memory=False)
        model, layer = dynamic_model(4096, n_ids=256, admit_probability=0.25, probes=8)
        x = np.arange(256 * 4, dtype="int32").reshape(4, 256)
        for batch in x:
            model.train_on_batch(batch[None], np.zeros((1, 256, WIDTH), "float32"))
        model.train_on_batch(x[:1], np.zeros((1, 256, WIDTH), "float32"))
        return layer.held_ids()

    first = run()
    assert first == run()
    # 1,024 ids seen once each: about a quarter admitted (4 standard deviations).
    assert abs(len(first) - 256) < 4 * np.sqrt(1024 * 0.25 * 0.75)


@pytest.mark.parametrize("dtype", [None, "int8"])
def test_checkpoints_hold_the_map_and_resume_exactly(tmp_path, dtype):
    rng = np.random.default_rng(0)
    xs = rng.choice(POOL, size=(8, BATCH, N_IDS)).astype("int32")
    ys = rng.normal(size=(8, BATCH, N_IDS, WIDTH)).astype("float32")
    model, layer = dynamic_model(6, sparseopt.updaters.Adagrad(0.1), probes=3, init="uniform",
                                 dtype=dtype)
    for x, y in zip(xs[:4], ys[:4]):
        model.train_on_batch(x, y)
    path = os.path.join(tmp_path, "m.keras")
    model.save(path)
    for x, y in zip(xs[4:], ys[4:]):
        model.train_on_batch(x, y)
    keras.backend.clear_session(free_memory=False)
    loaded = keras.saving.load_model(path, custom_objects={"dot_loss": dot_loss})
    dyn = loaded.get_layer("dyn")
    for x, y in zip(xs[4:], ys[4:]):
        loaded.train_on_batch(x, y)
    if dtype == "int8":  # (the last step's rows, as the next call writes them)
        dyn.int8.flush(), layer.int8.flush()
        np.testing.assert_array_equal(to_np(dyn.embeddings_scale), to_np(layer.embeddings_scale))
    np.testing.assert_array_equal(to_np(dyn.embeddings), to_np(layer.embeddings))
    for a, b in zip(dyn.vocabulary.variables, layer.vocabulary.variables):
        np.testing.assert_array_equal(to_np(a), to_np(b))
    assert dyn.held_ids() == layer.held_ids()
    # Weights alone (inference): the same ids read the same rows.
    weights = os.path.join(tmp_path, "w.weights.h5")
    model.save_weights(weights)
    keras.backend.clear_session(free_memory=False)
    fresh, _ = dynamic_model(6, sparseopt.updaters.Adagrad(0.1), probes=3, init="uniform",
                             dtype=dtype)
    fresh.load_weights(weights)
    np.testing.assert_array_equal(to_np(fresh(xs[0])), to_np(model(xs[0])))


def test_an_int8_open_vocabulary_keeps_the_float32_map_and_its_rows_within_a_code():
    """`DynamicEmbedding(dtype="int8")`: the same admissions, evictions, hand-over and
    delta as float32 (the map never reads values); rows given to new ids start from
    the initializer's values quantized to nearest (written by the next call); each
    held row within a few code steps of the float32 run's (stochastic rounding's
    noise, one step at most per write)."""
    rng = np.random.default_rng(3)
    xs = rng.choice(POOL, size=(8, BATCH, N_IDS)).astype("int32")
    ys = rng.normal(size=(8, BATCH, N_IDS, WIDTH)).astype("float32")
    options = dict(probes=3, admit_after=2, default_row="trained", init="uniform",
                   tombstone_log=64)  # (deltas since step 0)
    runs = {}
    for dtype in (None, "int8"):
        keras.backend.clear_session(free_memory=False)
        keras.utils.set_random_seed(1)  # (the same initial table, the default row's start)
        model, layer = dynamic_model(6, sparseopt.updaters.SGD(0.5), dtype=dtype, **options)
        states = []
        for x, y in zip(xs, ys):
            model.train_on_batch(x, y)
            states.append(map_state(layer))
        # (At the end only: a delta writes an int8 table's hand-over itself, which
        # would hide a call that does not.)
        runs[dtype] = (layer, states, [layer.delta(since) for since in (0, 2, 7)])
    (flt, want, want_deltas), (q, got, got_deltas) = runs[None], runs["int8"]
    assert q.embeddings.dtype == "int8"
    for map_a, map_b in zip(want, got):
        assert map_a[0] == map_b[0] and map_a[2] == map_b[2] and map_a[3] == map_b[3]
        np.testing.assert_array_equal(map_a[1], map_b[1])
    for delta_a, delta_b in zip(want_deltas, got_deltas):
        np.testing.assert_array_equal(delta_a.ids, delta_b.ids)
        np.testing.assert_array_equal(delta_a.rows, delta_b.rows)
        np.testing.assert_array_equal(delta_a.tombstones, delta_b.tombstones)
        step = np.max(np.abs(delta_a.values), axis=1, keepdims=True) / 127
        assert np.all(np.abs(delta_b.values - delta_a.values) <= 4 * step + 1e-7)
        # The default row is written every step (every id not held reads it): up to
        # one code of noise per write (standard deviation at most half a code), 8 writes.
        step = np.max(np.abs(delta_a.default)) / 127
        assert np.all(np.abs(delta_b.default - delta_a.default) <= 8 * step + 1e-7)
    # The delta reads what the next call reads (the buffered rows written).
    ids = xs[-1]
    np.testing.assert_allclose(to_np(q(ids)), to_np(flt(ids)), atol=0.01)
    assert q.held_ids() == flt.held_ids()


def lfu_run(batches, seed=0, half_life=100, eviction="lfu"):
    """A 2-row table whose window is the whole table; `batches` of id pairs x 4 examples."""
    keras.backend.clear_session(free_memory=False)
    model, layer = dynamic_model(2, probes=2, eviction=eviction, n_ids=2, seed=seed,
                                 admissions_per_step=1, lfu_half_life=half_life)
    for batch in batches:
        x = np.array(batch * (4 // len(batch)), "int32")
        model.train_on_batch(x, np.ones((4, 2, WIDTH), "float32"))
    return layer


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_lfu_breaks_a_tie_by_the_row_seen_longest_ago(seed):
    """1 seen 8 times in step 1, 2 seen 8 times in step 2, then 3 needs a row: 1's goes.
    (Seeds move the ids' home rows, so that window order cannot stand in for the rule.)"""
    assert sorted(lfu_run([[[1, 1]], [[2, 2]], [[3, 3]]], seed).held_ids()) == [2, 3]


def test_lfu_evicts_the_least_frequent_counts_every_occurrence_and_halves():
    # 2 seen 4 times (with 5): fewer than 1's 8, though 1 is older: LFU keeps 1, LRU 2.
    lfu = lfu_run([[[1, 1]], [[2, 5]], [[3, 3]], [[1, 1]]])
    assert sorted(lfu.held_ids()) == [1, 3]
    assert sorted(lfu_run([[[1, 1]], [[2, 5]], [[3, 3]]],
                          eviction="lru").held_ids()) == [2, 3]
    # A reused row starts with its new id's own sightings (8), not the old id's (4);
    # 1 found 8 more times in the last step: 16.
    counts, held = to_np(lfu.vocabulary.frequency.counts), lfu.held_ids()
    assert counts[held[3]] == 8 and counts[held[1]] == 16
    # Counts halve at every multiple of the half life: 1's 8 (step 1) is 4 at step 3,
    # below 2's 6 (step 2; 3 occurrences a pair x 2 pairs), so 1 goes.
    batches = [[[1, 1]], [[2, 2], [2, 7]], [[3, 3]]]
    assert sorted(lfu_run(batches, half_life=2).held_ids()) == [2, 3]
    assert sorted(lfu_run(batches, half_life=100).held_ids()) == [1, 3]


def test_a_delta_past_the_tombstone_log_is_refused_and_a_recent_one_is_whole():
    """A log of 2 ids: after more replacements, a delta from before them would miss some,
    so it is refused naming the fix; one from the last step still lists its tombstones."""
    model, layer = dynamic_model(2, probes=2, admissions_per_step=2, tombstone_log=2,
                                 n_ids=2)
    y = np.ones((1, 2, WIDTH), "float32")
    for pair in [[1, 2], [3, 4], [5, 6], [7, 8]]:
        model.train_on_batch(np.array([pair], "int32"), y)
    # Steps 2, 3, 4 gave both rows to new ids: 1 and 2 lost theirs to 3, 4 (chosen
    # in step 2), 3 and 4 to 5, 6 (step 3), 5 and 6 to 7, 8 (step 4, handed over).
    with pytest.raises(ValueError, match=r"'dyn'.*tombstone log \(2 entries\).*held_ids"):
        layer.delta(1)
    recent = layer.delta(3)
    assert recent.step == 4
    assert sorted(recent.tombstones.tolist()) == [5, 6]  # replaced by the hand-over of 7, 8
    assert sorted(recent.ids.tolist()) == [7, 8]
    with pytest.raises(ValueError, match="`tombstone_log` \\(1\\) must hold"):
        sparseopt.layers.DynamicEmbedding(8, 2, sparseopt.updaters.SGD(0.1),
                                          admissions_per_step=2, tombstone_log=1)


def _features_model(combiner, as_dict):
    a, b = keras.Input((N_IDS,), dtype="int32"), keras.Input((2,), dtype="int32")
    layer = sparseopt.layers.DynamicEmbedding(
        6, WIDTH, sparseopt.updaters.Adagrad(0.5), embeddings_initializer="uniform",
        combiner=combiner, name="dyn", probes=2)
    features = {"a": a, "b": b} if as_dict else [a, b]
    out = layer(features)
    out = [out["a"], out["b"]] if as_dict else out
    model = keras.Model([a, b], keras.layers.Concatenate(axis=1)(out))
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.1)),
                  loss=dot_loss)
    return model, layer


@pytest.mark.parametrize("combiner,as_dict", [(None, False), pytest.param(
    "sum", True, marks=[] if keras.backend.backend() == "jax" else pytest.mark.thorough)])
def test_features_sharing_a_table_meet_the_map_in_one_call(combiner, as_dict):
    """`layer([a, b])` (or a dict) is one call: its map, admissions and table are
    those of one feature holding `a` then `b` (the map by the plain reference)."""
    model, layer = _features_model(combiner, as_dict)
    one, single = dynamic_model(6, sparseopt.updaters.Adagrad(0.5), n_ids=N_IDS + 2,
                                init="uniform", probes=2)
    single.set_weights(layer.get_weights())
    ref = ReferenceVocabulary(6, 2, seed=0)
    rng = np.random.default_rng(3)
    for _ in range(6):
        a, b = (rng.choice(POOL[:10], size=(BATCH, n)).astype("int32") for n in (N_IDS, 2))
        # The single feature holds all of `a`'s ids, then all of `b`'s.
        flat = np.concatenate([a.reshape(-1), b.reshape(-1)])
        if combiner is None:
            y = rng.normal(size=(BATCH, N_IDS + 2, WIDTH)).astype("float32")
            model.train_on_batch([a, b], y)
            y_flat = np.concatenate([y[:, :N_IDS].reshape(-1, WIDTH),
                                     y[:, N_IDS:].reshape(-1, WIDTH)])
        else:
            model.train_on_batch([a, b], rng.normal(size=(BATCH, 2 * WIDTH)).astype("float32"))
            y_flat = np.zeros((flat.size, WIDTH), "float32")
        one.train_on_batch(flat.reshape(BATCH, -1), y_flat.reshape(BATCH, -1, WIDTH))
        ref.train(flat.tolist())
    for got, want in zip(map_state(layer), reference_state(ref)):
        np.testing.assert_array_equal(np.asarray(got, dtype=object),
                                      np.asarray(want, dtype=object))
    for got, want in zip(map_state(layer), map_state(single)):
        np.testing.assert_array_equal(np.asarray(got, dtype=object),
                                      np.asarray(want, dtype=object))
    if combiner is None:  # the same rows trained by the same gradients (another
        # graph: XLA may fuse the loss's gradient differently, last bits apart)
        np.testing.assert_allclose(to_np(layer.embeddings), to_np(single.embeddings),
                                   rtol=1e-6, atol=1e-7)
    out = layer({"a": a, "b": b} if as_dict else [a, b])
    out = [out["a"], out["b"]] if as_dict else out
    want = (BATCH, WIDTH) if combiner else (BATCH, N_IDS, WIDTH)
    assert tuple(out[0].shape) == want


def test_running_totals_count_past_two_to_the_31():
    """The totals are int32 pairs with a carry: exact where one int32 would wrap."""
    from sparseopt.vocabulary import counters

    totals = keras.Variable(np.zeros((3, 2), "int32"), dtype="int32", trainable=False)
    want = [0, 0, 0]
    for i in range(20):
        amount = (2**30 - 1) if i % 2 else 123_456_789
        counters.add(totals, {i % 3: amount})
        want[i % 3] += amount
    assert counters.read(totals) == want
    assert max(want) > 2**32


def test_what_open_vocabularies_do_not_support_yet_is_refused_naming_the_table():
    with pytest.raises(ValueError, match="RandomUniform, RandomNormal"):
        sparseopt.layers.DynamicEmbedding(8, 2, sparseopt.updaters.SGD(0.1),
                                          embeddings_initializer="glorot_uniform")
    with pytest.raises(ValueError, match="`probes` must be in"):
        sparseopt.layers.DynamicEmbedding(8, 2, sparseopt.updaters.SGD(0.1), probes=9)
    with pytest.raises(ValueError, match="`lfu_half_life` must be at least 1"):
        sparseopt.layers.DynamicEmbedding(8, 2, sparseopt.updaters.SGD(0.1), eviction="lfu",
                                          lfu_half_life=0)
    with pytest.raises(ValueError, match="`eviction` must be one of"):
        sparseopt.layers.DynamicEmbedding(8, 2, sparseopt.updaters.SGD(0.1), eviction="fifo")
    ids = keras.Input((N_IDS,), dtype="int32")
    layer = sparseopt.layers.DynamicEmbedding(8, WIDTH, sparseopt.updaters.SGD(0.1), name="dyn")
    model = keras.Model(ids, keras.layers.Add()([layer(ids), layer(ids)]))
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD()), loss=dot_loss)
    with pytest.raises(ValueError, match="Layer 'dyn' .*'dyn/embeddings'.* called 2 times in "
                       "one training step.*one call"):
        model.fit(np.zeros((1, N_IDS), "int32"), np.zeros((1, N_IDS, WIDTH)), verbose=0)


@pytest.mark.parametrize("capacity", [0, -5, 2.5, None, "8"])
def test_a_capacity_that_is_not_a_positive_int_is_refused_by_its_name(capacity):
    with pytest.raises(ValueError, match="DynamicEmbedding 'dyn': `capacity` .* positive int"):
        sparseopt.layers.DynamicEmbedding(capacity, WIDTH, sparseopt.updaters.SGD(0.1),
                                          name="dyn")


def test_float_ids_are_refused_never_merged_into_one_row():
    """Raw ids 10**9 + k are distinct as integers; as float32 most of them round to
    the same value, so a cast would give distinct ids one row (the control below)."""
    raw = 10**9 + np.arange(300)
    assert len(np.unique(raw.astype("float32"))) < 30  # what a silent cast would merge
    layer = sparseopt.layers.DynamicEmbedding(512, WIDTH, sparseopt.updaters.SGD(0.1),
                                              name="dyn")
    with pytest.raises(TypeError, match="Layer 'dyn': ids for table 'dyn/embeddings' must "
                       "be integers, got dtype float32"):
        layer(keras.Input((N_IDS,), dtype="float32"))
    with pytest.raises(TypeError, match="must be integers"):
        layer(raw.astype("float32").reshape(-1, N_IDS))
    # As integers the same ids train 300 rows of their own, on the path users take.
    model, layer = dynamic_model(4096, n_ids=1, init="uniform")
    model.fit(raw.reshape(-1, 1).astype("int32"), np.ones((300, 1, WIDTH)), batch_size=50,
              verbose=0, shuffle=False)
    assert len(layer.held_ids()) == 300


def test_stats_read_right_after_fit_count_the_last_steps_admissions():
    """The last step's admissions are written into the map by the next call; the totals
    count them already (inference counts nothing, so an `evaluate` changes none)."""
    model, layer = dynamic_model(1024, n_ids=1)
    ids = np.arange(40, dtype="int32").reshape(-1, 1) * 7919
    model.fit(ids, np.ones((40, 1, WIDTH)), batch_size=8, shuffle=False, verbose=0)
    after_fit = layer.vocabulary_stats()
    assert after_fit["admitted"] == len(layer.held_ids()) == 40
    model.evaluate(ids, np.ones((40, 1, WIDTH)), batch_size=8, verbose=0)
    assert layer.vocabulary_stats() == after_fit


def test_the_summary_counts_the_table_and_the_defaults_are_sized_to_it():
    """`model.summary()`: the layer's Param # is its table (as Keras' Embedding); the
    map's bookkeeping is non-trainable, sized to the table, the same on both backends:
    keys 2V + last seen V + tombstones 3V + the step, 7 running totals (int32 pairs)
    and the tombstones' cursor and wrap flag."""
    ids = keras.Input((N_IDS,), dtype="int32")
    layer = sparseopt.layers.DynamicEmbedding(256, 8, sparseopt.updaters.SGD(0.1), name="dyn")
    model = keras.Model(ids, keras.layers.Dense(1)(keras.layers.Flatten()(layer(ids))))
    printed = []
    model.summary(print_fn=printed.append)
    assert layer.count_params() == 256 * 8
    assert "2,048" in "".join(printed)
    assert sum(int(np.prod(w.shape)) for w in model.non_trainable_weights) == 6 * 256 + 17
    assert layer.vocabulary.tombstones.size == 256
    big = sparseopt.layers.DynamicEmbedding(10**6, 8, sparseopt.updaters.SGD(0.1))
    assert big.vocabulary.tombstones.size == 65536


def test_a_file_with_another_tombstone_log_size_loads_keeping_its_newest_entries(tmp_path):
    """Files written before the log was sized to the table (65,536 entries whatever the
    capacity) load into today's layer: the newest entries kept, and a delta since a step
    whose entries were dropped refused rather than answered short."""
    xs = np.random.default_rng(5).choice(POOL, size=(12, BATCH, N_IDS)).astype("int32")
    ys = np.ones((BATCH, N_IDS, WIDTH), "float32")

    def trained(log):
        keras.backend.clear_session(free_memory=False)
        model, layer = dynamic_model(4, probes=2, tombstone_log=log)
        for x in xs:
            model.train_on_batch(x, ys)
        return model, layer

    old_model, old = trained(64)
    path = str(tmp_path / "old.weights.h5")
    old_model.save_weights(path)
    cursor = int(to_np(old.vocabulary.tombstones.cursor))
    assert cursor > 4  # more replaced ids than the new log keeps
    new_model, new = trained(4)
    new_model.load_weights(path)
    assert new.held_ids() == old.held_ids()
    log = to_np(old.vocabulary.tombstones.log)[:cursor]
    recent = int(log[-4, 2])  # the 4 newest entries are from this step on
    for since in range(recent, 13):
        assert sorted(new.delta(since).tombstones.tolist()) == sorted(
            old.delta(since).tombstones.tolist())
    if int(log[-5, 2]) < recent:  # an older entry was dropped: asking before it is refused
        with pytest.raises(ValueError, match="tombstone log"):
            new.delta(recent - 1)
