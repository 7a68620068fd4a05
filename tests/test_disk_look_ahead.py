"""The next step's rows fetched ahead (`OnDisk(fetch_ahead=True)`, `fit` on JAX and TensorFlow).

What it must hold, through `fit` as users train:

- nothing a step computes changes: tables on disk end bit for bit where the
  same tables in memory end, and where the same tables on disk without
  look-ahead end (the cache is transparent);
- every step's rows were in the cache before the step read them
  (`missed_at_step` 0 with a cache that holds the table; on TensorFlow every
  step's but the first `fit`'s first, which builds the tables' look-ahead),
  counted once: the hits and misses are a NumPy count of each step's distinct
  ids (a row's first step misses, later ones hit);
- the data is consumed as Keras' own look-ahead on accelerators consumes it:
  a generator shared by epochs trains on the same batches, in order, and one
  batch more is taken from it by the end of `fit` (documented);
- ids a layer reads through layers of the model (a slice, a cast) are
  foreseen; ids through a layer with weights are not (fetched in the step).
"""

import keras
import numpy as np
import pytest

import sparseopt
from sparseopt.storage import OnDisk
from tests.conftest import to_np

ROWS, WIDTH = 50, 3
JAX = keras.backend.backend() == "jax"
# A cache no set of which overflows with these 50 rows (sets of 8, picked by a hash).
HOLDS_ALL = 1024


class Shift(keras.layers.Layer):
    """Ids plus a weight (0): ids a step could change, which are not foreseen."""

    def build(self, shape):
        self.shift = self.add_weight(shape=(), initializer="zeros", dtype="int32",
                                     trainable=False)

    def call(self, ids):
        return ids + self.shift


def _model(storages, through=("input", "slice", "weights"), steps_per_execution=1,
           updater=lambda: sparseopt.updaters.RowwiseAdagrad(0.1)):
    """Three tables: looked up on a model input, on a slice of one, and through `Shift`.

    Args:
        storages: each table's `storage=` (None: in memory).
        through: the tables kept, by how their ids reach them.
        steps_per_execution: the model's (`compile`).
        updater: makes each table's updater.
    """
    keras.utils.set_random_seed(3)
    first = keras.Input((2,), dtype="int32", name="first")
    rest = keras.Input((4,), dtype="int32", name="rest")
    ids = {"input": first, "slice": rest[:, 1:3], "weights": Shift()(rest[:, :2])}
    outs, layers = [], []
    for i, (how, storage) in enumerate(zip(through, storages)):
        layer = sparseopt.layers.SparseEmbedding(
            ROWS, WIDTH, updater(), storage=storage,
            embeddings_initializer=keras.initializers.RandomUniform(-0.5, 0.5, seed=i),
            name=f"t_{how}")
        layers.append(layer)
        outs.append(keras.layers.Dense(1, name=f"head_{how}")(
            keras.layers.Flatten()(layer(ids[how]))))
    model = keras.Model({"first": first, "rest": rest},
                        keras.layers.Concatenate()(outs) if len(outs) > 1 else outs[0])
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.Adam(0.01)),
                  loss="mse", steps_per_execution=steps_per_execution)
    return model, layers


def _batches(steps, batch=4, seed=0):
    """`steps` batches `({"first", "rest"}, y)`, ids with repeats and invalid ones."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        first = rng.integers(-2, ROWS + 3, (batch, 2)).astype("int32")
        rest = rng.integers(0, ROWS, (batch, 4)).astype("int32")
        y = rng.normal(size=(batch, len(("input", "slice", "weights")))).astype("float32")
        out.append(({"first": first, "rest": rest}, y))
    return out


def _joined(batches):
    x = {k: np.concatenate([b[0][k] for b in batches]) for k in ("first", "rest")}
    return x, np.concatenate([b[1] for b in batches])


def _disk(tmp_path, tag, cache_rows, fetch_ahead):
    return [OnDisk(str(tmp_path / f"{tag}{i}"), cache_rows=cache_rows, fetch_ahead=fetch_ahead)
            for i in range(3)]


def _ids_of(batch, how):
    x = batch[0]
    ids = {"input": x["first"], "slice": x["rest"][:, 1:3], "weights": x["rest"][:, :2]}[how]
    ids = ids.reshape(-1)
    return set(ids[(ids >= 0) & (ids < ROWS)].tolist())


def _expected_counts(batches, how):
    """`(hits, misses)` of a cache that holds every row: each step's distinct rows, a
    miss the first time a row is read, a hit after (NumPy, not the cache's code)."""
    seen, hits, misses = set(), 0, 0
    for batch in batches:
        step = _ids_of(batch, how)
        misses += len(step - seen)
        hits += len(step & seen)
        seen |= step
    return hits, misses


def _start_alike(memory, memory_layers, disk, disk_layers):
    """The tables in memory start from the rows on disk (drawn by sparseopt, not by
    Keras' initializer), the heads from the disk model's."""
    for m, d in zip(memory_layers, disk_layers):
        m.embeddings.assign(d.embeddings.numpy())
    for layer in disk.layers:
        if layer.name.startswith("head_"):
            memory.get_layer(layer.name).set_weights(layer.get_weights())


def _table_values(layer):
    if isinstance(layer.embeddings, keras.Variable):
        return to_np(layer.embeddings)
    return layer.embeddings.numpy()


def test_rows_fetched_ahead_change_nothing_a_step_computes_and_count_once(tmp_path):
    steps = 9
    batches = _batches(steps)
    x, y = _joined(batches)
    runs = {name: _model(storages) for name, storages in [
        ("memory", [None] * 3), ("ahead", _disk(tmp_path, "a", HOLDS_ALL, True)),
        ("in_step", _disk(tmp_path, "s", HOLDS_ALL, False))]}
    _start_alike(*runs["memory"], *runs["ahead"])
    for model, _ in runs.values():
        model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    for i, how in enumerate(("input", "slice", "weights")):
        expected = _table_values(runs["memory"][1][i])
        for name in ("ahead", "in_step"):
            np.testing.assert_array_equal(_table_values(runs[name][1][i]), expected,
                                          err_msg=f"{name} {how}")
        hits, misses = _expected_counts(batches, how)
        for name in ("ahead", "in_step"):
            stats = runs[name][1][i].disk_stats()
            assert (stats["hits"], stats["misses"]) == (hits, misses), (name, how, stats)
        ahead = runs["ahead"][1][i].disk_stats()
        in_step = runs["in_step"][1][i].disk_stats()
        # Without look-ahead every miss is the step's own; the accumulator's column
        # is read with the rows (per-row state: the same files, the same rows).
        assert (in_step["steps_fetched_ahead"], in_step["missed_at_step"]) == (0, misses)
        if how == "weights":  # (ids through a layer with weights are not foreseen)
            assert (ahead["steps_fetched_ahead"], ahead["missed_at_step"]) == (0, misses), how
        elif JAX:
            # Every step's rows were in the cache before the step read them.
            assert (ahead["steps_fetched_ahead"], ahead["missed_at_step"]) == (steps, 0), how
        else:
            # Every step's but the first: TensorFlow builds the optimizer, and the
            # tables' look-ahead, inside the first step, whose batch it took itself.
            first = len(_ids_of(batches[0], how))
            assert (ahead["steps_fetched_ahead"], ahead["missed_at_step"]) == (
                steps - 1, first), how


def _assert_as_in_memory(disk_layer, memory_layer, memory):
    """The table on disk and its accumulator are the table in memory's, bit for bit."""
    np.testing.assert_array_equal(_table_values(disk_layer), _table_values(memory_layer),
                                  err_msg=disk_layer.name)
    np.testing.assert_array_equal(
        disk_layer.embeddings.numpy("accumulator"),
        to_np(memory.optimizer.table_state(memory_layer.embeddings)["accumulator"]),
        err_msg=disk_layer.name)


def test_a_cache_smaller_than_a_step_serves_the_step_the_rows_its_fetch_read(tmp_path):
    # A cache smaller than one step's rows: the fetch ahead evicts rows it fetched itself
    # and rows the step before still writes, and that write evicts others. The step takes
    # its rows as the fetch read them, brought up to date by the write after it, not from
    # the cache or the files again; each write finds its rows wherever they are. Tables
    # as in memory.
    steps = 8
    batches = _batches(steps, batch=16, seed=1)
    x, y = _joined(batches)
    through = ("input", "slice")
    memory, m_layers = _model([None] * 2, through)
    disk, d_layers = _model(_disk(tmp_path, "d", 8, True)[:2], through)
    _start_alike(memory, m_layers, disk, d_layers)
    for model in (memory, disk):
        model.fit(x, y[:, :2], batch_size=16, shuffle=False, verbose=0)
    for m, d in zip(m_layers, d_layers):
        _assert_as_in_memory(d, m, memory)
        stats = d.disk_stats()
        assert stats["steps_fetched_ahead"] == steps - (not JAX), stats
        # (TensorFlow's first step reads its own rows: see the test above.)
        first = 0 if JAX else len(_ids_of(batches[0], d.name[2:]))
        assert stats["missed_at_step"] == first, stats


def test_rows_written_between_their_fetch_and_their_step_are_brought_up_to_date(tmp_path):
    # The next step's rows are fetched while the step computes: the step's write, and
    # Lookahead's sync after it, write rows the fetch found; each brings the fetch's
    # values of those rows up to date, and the next step takes them (counted once, at
    # the fetch: the cache holds them all). Tables and state as in memory, bit for bit.
    steps = 9
    batches = _batches(steps, seed=2)
    x, y = _joined(batches)
    through = ("input", "slice")
    updater = lambda: sparseopt.updaters.RowwiseAdagrad(  # noqa: E731
        0.1, lookahead_period=2, lookahead_step_size=0.5)
    memory, m_layers = _model([None] * 2, through, updater=updater)
    disk, d_layers = _model(_disk(tmp_path, "d", HOLDS_ALL, True)[:2], through,
                            updater=updater)
    _start_alike(memory, m_layers, disk, d_layers)
    for model in (memory, disk):
        model.fit(x, y[:, :2], batch_size=4, shuffle=False, verbose=0)
    for m, d in zip(m_layers, d_layers):
        _assert_as_in_memory(d, m, memory)
        hits, misses = _expected_counts(batches, d.name[2:])
        stats = d.disk_stats()
        assert (stats["hits"], stats["misses"]) == (hits, misses), stats
        assert stats["steps_fetched_ahead"] == steps - (not JAX), stats


def _generator(batches):
    def make():
        yield from batches
    return make()


def test_data_is_consumed_as_keras_own_look_ahead_consumes_it(tmp_path):
    # One generator shared by two epochs of three steps: the batch taken ahead at the
    # first epoch's end is the second epoch's first (the same batches, in order, as the
    # same table in memory, which looks nothing ahead, trains on). At the end of `fit`
    # one batch more was taken from the generator, never trained on: what Keras' own
    # look-ahead on accelerators (`_one_batch_ahead_iterator`) takes too.
    batches = _batches(8, seed=2)
    through = ("input",)
    memory, m_layers = _model([None], through)
    disk, d_layers = _model(_disk(tmp_path, "g", HOLDS_ALL, True)[:1], through)
    _start_alike(memory, m_layers, disk, d_layers)
    trained = {}
    for name, model in (("memory", memory), ("disk", disk)):
        source = _generator([(b[0], b[1][:, :1]) for b in batches])
        model.fit(source, steps_per_epoch=3, epochs=2, verbose=0)
        trained[name] = source
    np.testing.assert_array_equal(_table_values(d_layers[0]), _table_values(m_layers[0]))
    if JAX:  # (TensorFlow's own pipeline takes a generator's batches ahead on a thread
        # of its own, as many as it gets to, in memory as on disk)
        # The batch after the sixth: taken ahead, never trained on.
        left = {name: sum(1 for _ in source) for name, source in trained.items()}
        assert left == {"memory": 2, "disk": 1}


def test_several_steps_a_call_data_of_unknown_length_and_train_on_batch(tmp_path):
    # Three steps a call (`steps_per_execution`), from a generator whose length `fit`
    # learns at its end (7 batches: calls of 3, 3 and 1 steps, then one that finds no
    # batch and ends the epoch), then `train_on_batch`: every step trains on its batch,
    # as in memory, and every step's rows were fetched before its step read them but
    # those TensorFlow takes inside its first call (it builds the look-ahead there).
    batches = [(b[0], b[1][:, :1]) for b in _batches(8, seed=7)]
    through = ("input",)
    memory, m_layers = _model([None], through, steps_per_execution=3)
    disk, d_layers = _model(_disk(tmp_path, "e", HOLDS_ALL, True)[:1], through,
                            steps_per_execution=3)
    _start_alike(memory, m_layers, disk, d_layers)
    for model in (memory, disk):
        model.fit(_generator(batches[:7]), verbose=0)
        model.train_on_batch(*batches[7])
    np.testing.assert_array_equal(_table_values(d_layers[0]), _table_values(m_layers[0]))
    stats = d_layers[0].disk_stats()
    in_step = 0 if JAX else 3
    hits, misses = _expected_counts(batches, "input")
    first = _expected_counts(batches[:in_step], "input")[1]
    assert (stats["hits"], stats["misses"]) == (hits, misses), stats
    assert (stats["steps_fetched_ahead"], stats["missed_at_step"]) == (8 - in_step, first), \
        stats


@pytest.mark.skipif(JAX, reason="tf.distribute strategies are TensorFlow's")
def test_under_a_tf_distribute_strategy_rows_are_read_in_the_step_and_it_says_so(tmp_path,
                                                                               caplog):
    # A strategy's iterator gives each replica's batches: it is passed on to Keras as it
    # is, nothing is fetched ahead, a warning says so; the table trains as in memory.
    import tensorflow as tf

    batches = [(b[0], b[1][:, :1]) for b in _batches(5, seed=8)]
    x, y = _joined(batches)
    through = ("input",)
    memory, m_layers = _model([None], through)
    with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
        disk, d_layers = _model(_disk(tmp_path, "o", HOLDS_ALL, True)[:1], through)
    _start_alike(memory, m_layers, disk, d_layers)
    with caplog.at_level("WARNING", logger="sparseopt"):
        for model in (memory, disk):
            model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    assert "trains under a tf.distribute strategy" in caplog.text
    np.testing.assert_array_equal(_table_values(d_layers[0]), _table_values(m_layers[0]))
    stats = d_layers[0].disk_stats()
    assert (stats["steps_fetched_ahead"], stats["missed_at_step"]) == (
        0, _expected_counts(batches, "input")[1]), stats


def test_inputs_given_by_name_to_a_model_of_listed_inputs_are_foreseen(tmp_path):
    # A model made with a list of inputs, fed a dict (Keras maps it by the inputs'
    # names): the table's ids are the array of its input's name, not the dict's first.
    first = keras.Input((2,), dtype="int32", name="first")
    rest = keras.Input((4,), dtype="int32", name="rest")
    layer = sparseopt.layers.SparseEmbedding(
        ROWS, WIDTH, sparseopt.updaters.RowwiseAdagrad(0.1), name="t",
        storage=OnDisk(str(tmp_path / "t"), cache_rows=HOLDS_ALL, fetch_ahead=True))
    out = keras.layers.Dense(1)(keras.layers.Flatten()(layer(rest)))
    model = keras.Model([rest, first], keras.layers.Add()([out, keras.ops.zeros_like(out)]))
    model.compile(optimizer=sparseopt.DispatchOptimizer("adam"), loss="mse")
    batches = _batches(6, seed=4)
    x, y = _joined(batches)
    model.fit({"first": x["first"], "rest": x["rest"]}, y[:, :1], batch_size=4,
              shuffle=False, verbose=0)
    stats = layer.disk_stats()
    # (TensorFlow: every step but the first, whose batch it took inside its step.)
    ids = batches[0][0]["rest"]
    first = 0 if JAX else np.unique(ids).size
    assert (stats["steps_fetched_ahead"], stats["missed_at_step"]) == (6 - (not JAX), first), \
        stats


def test_batches_a_table_never_reads_stop_being_fetched_with_a_warning(tmp_path, monkeypatch,
                                                                       caplog):
    # Ids worked out wrong (here: made so): no lookup matches them. After `KEPT` such
    # batches the table stops fetching ahead and says so; it trains as before.
    from sparseopt.disk import look_ahead

    monkeypatch.setattr(look_ahead.RowsOf, "__call__", lambda self, x: np.full((4, 2), 7))
    model, layers = _model(_disk(tmp_path, "w", HOLDS_ALL, True)[:1], ("input",))
    memory, m_layers = _model([None], ("input",))
    _start_alike(memory, m_layers, model, layers)
    x, y = _joined(_batches(look_ahead.KEPT + 4, seed=5))
    with caplog.at_level("WARNING", logger="sparseopt.disk"):
        for m in (model, memory):
            m.fit(x, y[:, :1], batch_size=4, shuffle=False, verbose=0)
    assert "fetched in the step that reads them from now on" in caplog.text
    stats = layers[0].disk_stats()
    # (The first batch shown was fetched: row 7 alone, a miss; every other miss the steps'.)
    assert stats["steps_fetched_ahead"] == 1
    assert stats["missed_at_step"] == stats["misses"] - 1
    np.testing.assert_array_equal(_table_values(layers[0]), _table_values(m_layers[0]))


@pytest.mark.parametrize("where", ["lookup", "files"])
def test_a_failed_fetch_ahead_is_logged_and_the_step_reads_its_rows(tmp_path, monkeypatch,
                                                                    caplog, where):
    # A fetch only brings rows into the cache: where it fails (here: every fetch, made so
    # on the table's thread), the table is whole and each step reads its rows itself, and
    # counts them once: failing before the cache's lookup ("lookup"), or after it counted
    # hits and misses, reading the missed rows from the files ("files").
    import threading

    from sparseopt.disk import native_cache, row_cache, row_files

    def failing_on_the_tables_thread(cls, name):
        call = getattr(cls, name)

        def failing(self, *args, **kwargs):
            if threading.current_thread().name.startswith("sparseopt disk table"):
                raise OSError("no fetch here")
            return call(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, failing)

    if where == "lookup":
        for cls in (row_cache.RowCache, native_cache.NativeRowCache):
            failing_on_the_tables_thread(cls, "read_distinct")
    else:  # (the table's thread reads the files in its fetches alone here: no Lookahead)
        failing_on_the_tables_thread(row_files.RowFiles, "read")  # (the NumPy cache's read)
        failing_on_the_tables_thread(native_cache.NativeRowCache, "_from_files")
    model, layers = _model(_disk(tmp_path, "f", HOLDS_ALL, True)[:1], ("input",))
    memory, m_layers = _model([None], ("input",))
    _start_alike(memory, m_layers, model, layers)
    # (The last batch is the second again: every row of it cached before its fetch.)
    batches = _batches(5, seed=6)
    batches.append(batches[1])
    x, y = _joined(batches)
    with caplog.at_level("WARNING", logger="sparseopt.disk"):
        for m in (model, memory):
            m.fit(x, y[:, :1], batch_size=4, shuffle=False, verbose=0)
    assert "fetching the next step's rows ahead failed (no fetch here)" in caplog.text
    stats = layers[0].disk_stats()
    hits, misses = _expected_counts(batches, "input")
    assert (stats["hits"], stats["misses"]) == (hits, misses)
    # (Failing in the files, a fetch of a batch whose rows are all cached, every one read
    # by a step before, reads none there: it succeeds.)
    seen, cached = set(), 0
    for batch in batches:
        rows = _ids_of(batch, "input")
        cached += bool(seen) and rows <= seen
        seen |= rows
    assert cached >= 1 and stats["steps_fetched_ahead"] == (cached if where == "files" else 0)
    np.testing.assert_array_equal(_table_values(layers[0]), _table_values(m_layers[0]))


def test_a_load_keeps_nothing_of_the_cache_it_replaces(tmp_path):
    # A batch fetched ahead and never read holds the values it fetched and the cache it
    # fetched them from; a load replaces that cache and the files under it: nothing may
    # keep the old cache (its rows, and its maps of the files the load replaced, whose
    # disk would not be freed). Shortcut, marked: the batch left unread is shown to the
    # table directly (`ahead`, what `fit`'s look-ahead calls), since which batch `fit`
    # leaves so, if any, is its loop's (a stop between steps, the backend's prefetch).
    import gc
    import weakref

    model, layers = _model(_disk(tmp_path, "l", HOLDS_ALL, True)[:1], ("input",))
    x, y = _joined(_batches(4, seed=7))
    model.fit(x, y[:, :1], batch_size=4, shuffle=False, verbose=0)
    weights = tmp_path / "w.weights.h5"
    model.save_weights(weights)
    table = layers[0].embeddings
    table.ahead(x["first"][:4].reshape(-1))
    table.flush()  # (its fetch done)
    old = weakref.ref(table.cache)
    model.load_weights(weights)
    gc.collect()
    assert old() is None
