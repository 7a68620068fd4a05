"""A training step does no work and holds no memory proportional to the vocabulary.

Checked on the compiled step itself, not with timings: on JAX, XLA's memory
analysis of the jitted, state-donating train step (temporaries far below one
table, every output aliased to its input, i.e. updated in place); on
TensorFlow, no tensor in the traced step has a vocabulary-sized dimension.
Each check is first shown to flag plain Keras, so it can fail.
"""

import keras
import numpy as np
import pytest

import sparseopt
from tests.helpers import kinds, registered_cases, table_model, xla_production_options

V, D, N_IDS = 1_000_003, 8, 16  # an odd V that no other dimension matches
TABLE_BYTES = V * D * 4


def make_model(optimizer, sparse=True, updater=None, batch=128, dtype=None):
    ids = keras.Input((N_IDS,), dtype="int32")
    if sparse:
        emb = sparseopt.layers.SparseEmbedding(
            V, D, updater=updater or sparseopt.updaters.Adagrad(0.1), name="emb", dtype=dtype)
    else:
        emb = keras.layers.Embedding(V, D, name="emb")
    model = keras.Model(ids, keras.layers.Dense(1)(keras.layers.Flatten()(emb(ids))))
    model.compile(optimizer=optimizer, loss="mse")
    x = np.random.default_rng(0).integers(0, V, (batch, N_IDS)).astype("int32")
    return model, (x, np.ones((batch, 1), "float32"))


def vocab_sized_work(model, data):
    """JAX: (temp bytes, non-aliased output bytes). TF: vocab-shaped op outputs."""
    if keras.backend.backend() == "jax":
        import jax
        from sparseopt import compat

        state = compat.jax_train_state(model, data)
        compiled = jax.jit(model.train_step, donate_argnums=0).lower(state, data).compile(
            xla_production_options())
        mem = compiled.memory_analysis()
        return mem.temp_size_in_bytes, mem.output_size_in_bytes - mem.alias_size_in_bytes
    import tensorflow as tf
    model.train_on_batch(*data)
    fn = tf.function(model.train_step).get_concrete_function(tf.nest.map_structure(
        lambda a: tf.TensorSpec((None,) + a.shape[1:], a.dtype), data))
    from sparseopt import backend

    vocab = {V, V + backend.WORKSPACE_SINK}  # a table, or the dedup workspace
    found = set()

    def walk(graph):
        for op in graph.get_operations():
            for out in op.outputs:
                if out.shape.rank and vocab & set(out.shape.as_list()):
                    found.add((op.type, tuple(out.shape.as_list())))
        for f in graph._functions.values():
            walk(f.graph)

    walk(fn.graph)
    return sorted(found)


def assert_no_vocab_work(result):
    if keras.backend.backend() == "jax":
        temp, not_in_place = result
        assert temp < TABLE_BYTES / 20, f"temporaries {temp} B vs table {TABLE_BYTES} B"
        assert not_in_place < 1024, f"{not_in_place} B of state not updated in place"
    else:
        assert result == [], f"vocabulary-sized tensors in the step: {result}"


def test_check_flags_plain_keras():
    model, data = make_model(keras.optimizers.Adagrad(), sparse=False)
    with pytest.raises(AssertionError):
        assert_no_vocab_work(vocab_sized_work(model, data))


def _state_layouts():
    """Each updater's default, and each configuration with other state (momentum,
    `lazy=False`'s per-row record)."""
    out = {}
    for key, (entry, cfg) in registered_cases().items():
        default = entry(0.1, **entry.test_configs["default"])
        if key.endswith(":default") or [s.name for s in entry(0.1, **cfg).slots] != [
                s.name for s in default.slots]:
            out[key] = (entry, cfg)
    return out


STATE_LAYOUTS = _state_layouts()


# One of each kind of state: none, per row, per entry, integer per row, a
# per-row record (`lazy=False`), a moving average; `make test-all`: every layout.
@pytest.mark.parametrize("case", kinds(sorted(STATE_LAYOUTS), [
    "SGD:default", "RowwiseAdagrad:default", "Adam:default", "FrequencyAwareAdagrad:default",
    "SGD:dense_momentum_decay", "Adam:ema"]))
def test_sparse_step_does_no_vocab_work(case):
    entry, cfg = STATE_LAYOUTS[case]
    model, data = make_model(sparseopt.DispatchOptimizer(keras.optimizers.Adam()),
                             updater=entry(0.1, **cfg))
    assert_no_vocab_work(vocab_sized_work(model, data))


@pytest.mark.parametrize("factored", [True, False])
def test_dense_adafactor_keeps_its_table_statistics_without_vocab_work(factored):
    """Adafactor(lazy=False) is Keras' whole-table Adafactor through running sums
    (tests/test_adafactor.py): its step still reads and writes the step's rows only."""
    updater = sparseopt.updaters.Adafactor(0.1, lazy=False, factored=factored)
    model, data = make_model(sparseopt.DispatchOptimizer(keras.optimizers.Adam()),
                             updater=updater)
    assert_no_vocab_work(vocab_sized_work(model, data))


def test_lookaheads_window_and_sync_do_no_vocab_work():
    """`lookahead_period`: the window's list (a `[V]` array) is appended to and its
    rows synced by gathers and in-place writes; a period of 1 syncs every step,
    so the sync is in the step checked."""
    updater = sparseopt.updaters.Adam(0.1, lookahead_period=1)
    model, data = make_model(sparseopt.DispatchOptimizer(keras.optimizers.Adam()),
                             updater=updater)
    assert_no_vocab_work(vocab_sized_work(model, data))


def test_a_step_of_more_distinct_ids_than_one_pass_takes_is_in_place_too():
    """10,240 distinct ids: JAX updates them 8,192 at a time in a loop that carries the
    table, which must still be updated in place."""
    model, data = make_model(sparseopt.DispatchOptimizer(keras.optimizers.Adam()),
                             updater=sparseopt.updaters.RowwiseAdagrad(0.1), batch=640)
    assert_no_vocab_work(vocab_sized_work(model, data))


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_an_open_vocabulary_step_does_no_vocab_work(eviction):
    """`DynamicEmbedding`: its map (`[V, 2]` ids, `[V]` last-seen steps, with LFU `[V]`
    counts) is read by
    gathers and written in place like the table, ids admitted and evicted inside
    the step. (Its temporaries, sized by the batch's ids x `probes`, are kept well
    under the bound with a batch of 32.)"""
    ids = keras.Input((N_IDS,), dtype="int32")
    emb = sparseopt.layers.DynamicEmbedding(V, D, sparseopt.updaters.Adagrad(0.1), name="emb",
                                            admissions_per_step=512, eviction=eviction)
    model = keras.Model(ids, keras.layers.Dense(1)(keras.layers.Flatten()(emb(ids))))
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.Adam()), loss="mse")
    x = np.random.default_rng(0).integers(-2**31, 2**31 - 1, (32, N_IDS)).astype("int32")
    y = np.ones((32, 1), "float32")
    model.train_on_batch(x, y)
    model.train_on_batch(x[::-1], y)  # the first batch's ids are written, and found
    assert emb.vocabulary_stats()["admitted"] == 32 * N_IDS
    assert_no_vocab_work(vocab_sized_work(model, (x, y)))


def test_sparse_step_under_loss_scaling_does_no_vocab_work():
    opt = keras.optimizers.LossScaleOptimizer(
        sparseopt.DispatchOptimizer(keras.optimizers.Adam(global_clipnorm=1.0)))
    model, data = make_model(opt)
    assert_no_vocab_work(vocab_sized_work(model, data))


def test_keras_rs_fallback_table_step_does_no_vocab_work():
    import keras_rs

    table = keras_rs.layers.TableConfig(name="t", vocabulary_size=V, embedding_dim=D,
                                        optimizer=keras.optimizers.Adagrad(0.1))
    feature = keras_rs.layers.FeatureConfig(name="f", table=table, input_shape=(128, N_IDS),
                                            output_shape=(128, D))
    ids = keras.Input((N_IDS,), dtype="int32", name="f")
    out = keras_rs.layers.DistributedEmbedding({"f": feature})({"f": ids})["f"]
    model = keras.Model({"f": ids}, keras.layers.Dense(1)(out))
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.Adam()), loss="mse")
    x = np.random.default_rng(0).integers(0, V, (128, N_IDS)).astype("int32")
    assert_no_vocab_work(vocab_sized_work(model, ({"f": x}, np.ones((128, 1), "float32"))))


def _on_jax_cpu():
    import jax

    return jax.default_backend() == "cpu"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit_tables_with_stochastic_rounding_do_no_vocab_work(dtype):
    """bfloat16 on JAX's CPU backend, which has no bfloat16 scatter, by the native
    in-place writes (`sparseopt.native`, on by default); with the kernels off, the
    pure path there copies the table once each way per step (documented in
    docs/semantics.md): bounded here, so that XLA's float32 round trip (twice as
    large) fails. On a GPU (pure path; XLA:GPU scatters bfloat16 in place) the
    first check is the whole test."""
    from sparseopt import native

    model, data = make_model(sparseopt.DispatchOptimizer(keras.optimizers.Adam()),
                             updater=sparseopt.updaters.Adam(0.1, weight_decay=0.01),
                             dtype=dtype)
    assert_no_vocab_work(vocab_sized_work(model, data))
    if keras.backend.backend() == "jax" and dtype == "bfloat16" and _on_jax_cpu():
        assert native.enabled("bf16_writes")
        with native.disabled():
            model, data = make_model(sparseopt.DispatchOptimizer(keras.optimizers.Adam()),
                                     updater=sparseopt.updaters.Adam(0.1, weight_decay=0.01),
                                     dtype=dtype)
            temp, not_in_place = vocab_sized_work(model, data)
        assert V * D * 2 * 0.8 < temp < V * D * 2 * 1.2, (
            f"temporaries {temp} B vs one copy {V * D * 2} B")
        assert not_in_place < 1024


@pytest.mark.parametrize("layer", ["sparse_embedding", "user_table"])
def test_mixed_precision_does_not_cast_the_whole_table(layer):
    """Under mixed_float16 only the looked-up rows may be cast, never the table."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        if layer == "sparse_embedding":
            model, data = make_model(sparseopt.DispatchOptimizer(keras.optimizers.Adam()))
        else:
            from tests.test_dispatch import UserTable

            ids = keras.Input((N_IDS,), dtype="int32")
            x = keras.layers.Flatten()(UserTable(V, D, name="user")(ids))
            model = keras.Model(ids, keras.layers.Dense(1)(x))
            model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.Adam()),
                          loss="mse")
            x_data = np.random.default_rng(0).integers(0, V, (128, N_IDS)).astype("int32")
            data = (x_data, np.ones((128, 1), "float32"))
        assert_no_vocab_work(vocab_sized_work(model, data))
    finally:
        keras.mixed_precision.set_global_policy("float32")


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="XLA compiles JAX's whole step")
def test_compile_options_reach_the_compile_the_checks_read():
    """`compile_train_step(..., compiler_options=...)` applies them to that compile, whatever
    the process' XLA_FLAGS: XLA:CPU's two code emitters fuse the step differently,
    which is why the checks above pin the default one (`xla_production_options`)."""
    from sparseopt.distribution import compile_train_step

    if not _on_jax_cpu():
        pytest.skip("the option is XLA:CPU's (on a GPU the checks pass no option)")
    model, _ = table_model(50, D, N_IDS, sparseopt.updaters.Adagrad(0.1))
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD()), loss="mse")
    # Built first (a shortcut, not the users' path): compiles the step by hand, as Keras would after its build.
    model.optimizer.build(model.trainable_variables)
    x = np.random.default_rng(0).integers(0, 50, (8, N_IDS)).astype("int32")
    y = np.zeros((8, N_IDS, D), "float32")
    texts = {emitters: compile_train_step(
        model, x, y, compiler_options={"xla_cpu_use_fusion_emitters": emitters}).as_text()
        for emitters in (True, False)}
    assert texts[True] != texts[False]
