"""The native kernels (`sparseopt.native`) against the pure path they replace, bit for bit.

JAX on CPU: the dedup and sum (`dedup_sum.cc`, an XLA FFI custom call) gives
the pure path's `Distinct` and workspace entries exactly, for Hypothesis-drawn
steps (bad ids, duplicates, empty batches, bags with their weights, signed
zeros, non-finite gradients); the row reads and writes (`rows.cc`) give
`jnp.take(mode="clip")` and `.at[].set(mode="drop")` exactly, for any dtype;
whole training runs (per id, pooled bags, table groups, an int8 table, a
bfloat16 table with bfloat16 state: the in-place writes of `rows.cc`) end
with the same tables and state bit for bit with every kernel on and every
kernel off; with them on, a step keeps the no-vocabulary-work property
(bfloat16 included, without the pure path's copy).
"""

import sys

import keras
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sparseopt
from sparseopt import native
from tests.conftest import to_np
from tests.helpers import batches, dot_loss

# JAX only (XLA FFI calls): `make test` runs them in its JAX session (and deselects
# them in the TensorFlow one); a TensorFlow session run by hand skips them.
pytestmark = [pytest.mark.jax_session,
              pytest.mark.skipif(keras.backend.backend() != "jax",
                                 reason="the native kernels are XLA FFI calls (JAX)")]


KERNELS = ("bf16_writes", "dedup", "rows", "disk_number")


def test_the_kernels_build_and_load_here():
    """On Linux with a C++ compiler (this project's machines) they must: a broken
    build would otherwise only show as a missing speed-up. Defaults: every JAX
    kernel on; the switch forces every kernel."""
    assert sys.platform.startswith("linux")
    assert native.build_error() is None and native.available()
    assert all(native.enabled(k) for k in KERNELS)
    try:
        native.set_enabled(False)
        assert not any(native.enabled(k) for k in KERNELS)
        native.set_enabled(True)
        assert all(native.enabled(k) for k in KERNELS)
        with native.disabled():
            assert not any(native.enabled(k) for k in KERNELS)
        assert native.enabled("dedup")
    finally:
        native.set_enabled(None)
    assert all(native.enabled(k) for k in KERNELS)


def _dedup(record, num_rows, use_native):
    import jax
    import jax.numpy as jnp

    from sparseopt.backend import jax as jax_backend
    from sparseopt.backend.jax_rows import Held

    native.set_enabled(use_native)
    try:
        @jax.jit
        def run(space):
            workspace = Held(space)
            distinct = jax_backend.dedup(record, num_rows, workspace)
            return tuple(distinct), workspace.value

        return jax.tree_util.tree_map(np.asarray, run(jnp.zeros((num_rows,), jnp.int32)))
    finally:
        native.set_enabled(None)


def _same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype
    if a.dtype.kind == "V" or (a.dtype.itemsize == 2 and a.dtype != np.int16):
        a, b = a.view(np.uint16), b.view(np.uint16)  # 16-bit floats: their bits
    if a.dtype == np.float32:
        nan = np.isnan(a)
        np.testing.assert_array_equal(nan, np.isnan(b))
        a, b = np.where(nan, 0, a), np.where(nan, 0, b)  # (NaN payloads may differ)
        np.testing.assert_array_equal(a.view(np.int32), b.view(np.int32))
    else:
        np.testing.assert_array_equal(a, b)


@st.composite
def records(draw):
    rows = draw(st.sampled_from([1, 5, 64, 1000]))
    n = draw(st.sampled_from([0, 1, 3, 17, 200]))
    width = draw(st.sampled_from([1, 3, 8]))
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    hot = rng.integers(0, min(rows, 3), n)
    ids = np.where(rng.random(n) < 0.5, hot, rng.integers(-3, rows + 3, n)).astype(np.int32)
    ids[rng.random(n) < 0.05] = draw(st.sampled_from([2**31 - 1, -(2**31)]))
    bags = draw(st.booleans())
    values = rng.normal(size=((max(n // 2, 1) if bags else n), width)).astype(np.float32)
    values[rng.random(values.shape) < 0.05] = -0.0
    poison = draw(st.sampled_from([None, None, np.nan, np.inf, -np.inf]))
    if poison is not None and values.size:
        values.flat[rng.integers(0, values.size)] = poison
    return rows, ids, values, (rng.integers(0, len(values), n).astype(np.int32), rng.random(
        n).astype(np.float32)) if bags else None


def drawn_record(case, array):
    """The `RowGrads` of a `records()` case, its arrays made by `array` (a backend's own)."""
    _, ids, values, bags = case
    grads = array(values)
    if bags is not None:
        grads = sparseopt.records.BagGrads(grads, array(bags[0]), array(bags[1]))
    return sparseopt.records.RowGrads(array(ids), grads)


def both_dedups(dedup, case, array):
    """`dedup(record, rows, use_native)` with the kernel and without, their `Distinct`s
    compared bit for bit; returns both workspaces."""
    record, rows = drawn_record(case, array), case[0]
    (got, got_space), (want, want_space) = dedup(record, rows, True), dedup(record, rows, False)
    for a, b in zip(got, want):
        _same_bits(a, b)
    return got_space, want_space


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=records())
def test_native_dedup_is_the_pure_dedup_bit_for_bit(case):
    import jax.numpy as jnp

    rows, ids = case[:2]
    got_space, want_space = both_dedups(_dedup, case, jnp.asarray)
    seen = np.unique(ids[(ids >= 0) & (ids < rows)])
    np.testing.assert_array_equal(got_space[seen], want_space[seen])


@st.composite
def row_moves(draw):
    """An array of any dtype the state may have, ids to read (any values) and distinct
    ids to write (some outside the array)."""
    rows = draw(st.sampled_from([1, 3, 40]))
    width = draw(st.sampled_from([None, 1, 5]))
    dtype = draw(st.sampled_from(["float32", "bfloat16", "float16", "int32"]))
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    shape = (rows,) if width is None else (rows, width)
    n = draw(st.sampled_from([0, 1, 7, 60]))
    read = rng.integers(-5, rows + 5, n).astype(np.int32)
    read[rng.random(n) < 0.1] = draw(st.sampled_from([2**31 - 1, -(2**31)]))
    written = rng.permutation(rows + 10)[:min(n, rows + 10)].astype(np.int32) - 5
    values = rng.normal(size=shape).astype(np.float32)
    new = rng.normal(size=(len(written),) + shape[1:]).astype(np.float32)
    return values, read, written, new, dtype


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=row_moves())
def test_native_row_reads_and_writes_are_the_pure_ones_bit_for_bit(case):
    import jax
    import jax.numpy as jnp

    from sparseopt.backend import jax_rows

    values, read, written, new, dtype = case
    values, new = jnp.asarray(values).astype(dtype), jnp.asarray(new).astype(dtype)

    def run(use_native):
        native.set_enabled(use_native)
        try:
            step = jax.jit(lambda v, r, w, x: (jax_rows.gather(v, r), jax_rows.set_rows(v, w, x)))
            return jax.tree_util.tree_map(np.asarray, step(values, jnp.asarray(read),
                                                           jnp.asarray(written), new))
        finally:
            native.set_enabled(None)

    for a, b in zip(run(True), run(False)):
        _same_bits(a, b)


def _train(use_native, dtype=None, combiner=None, group=False, state_dtype="float32"):
    native.set_enabled(use_native)
    try:
        keras.utils.set_random_seed(2)
        ids = [keras.Input((5,), dtype="int32", name=f"{n}_ids") for n in ("a", "b")]
        storage = sparseopt.TableStorage(state_dtype=state_dtype)
        layers = [sparseopt.layers.SparseEmbedding(
            300, 4, sparseopt.updaters.Adagrad(0.1), combiner=combiner, dtype=dtype, name=n,
            storage=storage) for n in ("a", "b")]
        outs = [keras.layers.Flatten()(layer(i)) for layer, i in zip(layers, ids)]
        model = keras.Model(ids, keras.layers.Concatenate()(outs))
        model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.SGD(0.1),
                                                            group_tables=group),
                      loss=dot_loss)
        rng = np.random.default_rng(1)
        xs, _ = batches(rng, 12, 8, 5, 300, 4, dup_vocab=40)
        x = xs.reshape(-1, 5)
        y = rng.normal(size=(len(x), 2 * (4 if combiner else 20))).astype("float32")
        model.fit({"a_ids": x, "b_ids": x[::-1].copy()}, y, batch_size=8, shuffle=False,
                  verbose=0)
        scratch = {id(v) for v in model.optimizer.scratch_variables()}
        return ([to_np(w) for w in model.weights]
                + [to_np(v) for v in model.optimizer.variables if id(v) not in scratch])
    finally:
        native.set_enabled(None)


@pytest.mark.parametrize("kind", ["ids", "bags", "groups", "int8", "bfloat16"])
def test_training_with_the_kernels_is_training_without_them_bit_for_bit(kind):
    """Every kernel on against every kernel off (bfloat16: the in-place writes of
    the table and of bfloat16 state, stochastically rounded)."""
    options = {"ids": {}, "bags": {"combiner": "sum"}, "groups": {"group": True},
               "int8": {"dtype": "int8", "group": True},
               "bfloat16": {"dtype": "bfloat16", "state_dtype": "bfloat16"}}[kind]
    got, want = _train(True, **options), _train(False, **options)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        _same_bits(a, b)


@pytest.mark.parametrize("dtype", [None, "int8", "bfloat16"])
def test_the_native_path_does_no_vocab_work_either(dtype):
    """`tests/test_no_vocab_work.py` checks the default path; every kernel on too:
    the workspace, aliased to the dedup's output, and a bfloat16 table, aliased to
    its writes' output, are written in place."""
    from tests.test_no_vocab_work import assert_no_vocab_work, make_model, vocab_sized_work

    native.set_enabled(True)
    try:
        model, data = make_model(sparseopt.DispatchOptimizer(keras.optimizers.Adam()),
                                 dtype=dtype)
        model.train_on_batch(*data)
        assert_no_vocab_work(vocab_sized_work(model, data))
    finally:
        native.set_enabled(None)


@pytest.mark.parametrize("value,expected", [("1", "True True True"),
                                            ("0", "False False False"),
                                            (None, "True True True")])
def test_the_environment_switch(value, expected):
    """`SPARSEOPT_NATIVE=1` turns every kernel on for a process, 0 every one off;
    unset: each at its default (on, for the JAX kernels)."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "SPARSEOPT_NATIVE"}
    if value is not None:
        env["SPARSEOPT_NATIVE"] = value
    code = ("from sparseopt import native; "
            "print(native.enabled('bf16_writes'), native.enabled('dedup'), "
            "native.enabled('rows'))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.strip().splitlines()
    assert out[-1] == expected


def test_a_failed_build_is_said_once_and_the_pure_path_runs():
    """No compiler (here: one that fails): importing and asking never raise; each
    library's failure is logged once, however often it is asked for, and every kernel
    reads as off (the pure path)."""
    import os
    import subprocess

    code = (
        "import logging, sparseopt\n"
        "from sparseopt import native\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        # Flags no build was made with: a fresh key, so a build is attempted.
        "native.FLAGS = native.FLAGS + ('-DSPARSEOPT_TEST_NO_SUCH_BUILD',)\n"
        "print([native.enabled(k) for k in ('bf16_writes', 'dedup', 'rows', 'tf_dedup',\n"
        "                                    'disk_host', 'disk_number', 'tf_disk_number')\n"
        "       * 2])\n"
        "print(native.build_error() is not None, native.build_error('tensorflow') is not None,\n"
        "      native.build_error('host') is not None)\n"
    )
    env = dict(os.environ, CXX="false", SPARSEOPT_NATIVE="1")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True)
    out = done.stdout.strip().splitlines()
    assert out[-2:] == [str([False] * 14), "True True True"]
    assert done.stderr.count("native kernels unavailable, using the pure path") == 1
    assert done.stderr.count("native TensorFlow ops unavailable, using the pure path") == 1
    assert done.stderr.count("native host library unavailable, using the pure path") == 1


def test_kernels_go_to_a_per_user_cache_never_a_shared_folder_others_can_write(
        tmp_path, monkeypatch):
    """`SPARSEOPT_NATIVE_DIR` wins; else `$XDG_CACHE_HOME/sparseopt/native`; where that
    cannot be written, a private folder in the temporary directory, refused if another
    user could have planted a library there (mode not 0700)."""
    monkeypatch.setenv("SPARSEOPT_NATIVE_DIR", str(tmp_path / "chosen"))
    assert native._target_dir() == tmp_path / "chosen"
    monkeypatch.delenv("SPARSEOPT_NATIVE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert native._target_dir() == tmp_path / "cache" / "sparseopt" / "native"
    blocked = tmp_path / "not_a_folder"
    blocked.write_text("")  # a cache under a file cannot be made
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    monkeypatch.setattr(native.tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    private = native._target_dir()
    assert private.parent == tmp_path / "tmp" and private.stat().st_mode & 0o777 == 0o700
    private.chmod(0o777)  # as if another user made it, open to all
    with pytest.raises(RuntimeError, match="no writable folder"):
        native._target_dir()
