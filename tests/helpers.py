"""Small models shared by the tests, and the environment of their child processes."""

import os
import subprocess
import sys

import keras
import numpy as np
import pytest
from keras import ops

import sparseopt


@keras.saving.register_keras_serializable(package="sparseopt_tests")
def dot_loss(y_true, y_pred):
    """Per-example loss whose gradient w.r.t. y_pred is y_true / batch_size."""
    return ops.sum(ops.reshape(y_true * y_pred, (ops.shape(y_pred)[0], -1)), axis=-1)


def table_model(vocab, width, n_ids, updater, combiner=None, name="emb", init=None,
                dtype=None, storage=None):
    ids = keras.Input((n_ids,), dtype="int32")
    emb = sparseopt.layers.SparseEmbedding(
        vocab, width, updater=updater, combiner=combiner, name=name,
        embeddings_initializer=init or "uniform", dtype=dtype, storage=storage)
    return keras.Model(ids, emb(ids)), emb


class OneHotEmbedding(keras.layers.Layer):
    """A dense-gradient reference embedding (one-hot matmul) for both backends.

    Plain `keras.layers.Embedding` on TF feeds `IndexedSlices` to Keras
    optimizers, which do not sum duplicate ids; this one gives the exact dense
    gradient everywhere.
    """

    def __init__(self, vocab, width, **kwargs):
        super().__init__(**kwargs)
        self.vocab, self.width = vocab, width

    def build(self, input_shape):
        self.embeddings = self.add_weight(shape=(self.vocab, self.width), name="embeddings",
                                          initializer="uniform")

    def call(self, ids):
        return ops.matmul(ops.one_hot(ids, self.vocab), self.embeddings)


def batches(rng, steps, batch, n_ids, vocab, width, dup_vocab=None):
    """Random id batches with duplicates in every batch, plus `y` for dot_loss."""
    hi = dup_vocab or vocab
    xs = rng.integers(0, hi, size=(steps, batch, n_ids)).astype("int32")
    xs[:, 0, :2] = xs[:, 1, :2]  # guaranteed duplicates
    ys = rng.normal(size=(steps, batch, n_ids, width)).astype("float32")
    return xs, ys


def registered_cases(paths_only=False):
    """`{"Name:case": (Updater class, kwargs)}` of every shipped updater's test configs.

    Args:
        paths_only: one case per code path instead of every configuration:
            each updater's default, plus its first configuration whose TF
            kernel differs from the default's (e.g. Adagrad without epsilon).
    """
    out = {}
    for name, entry in sparseopt.updaters.registry(shipped_only=True).items():
        configs = entry.test_configs
        default_kernel = entry(0.1, **configs["default"]).tf_kernel()
        other = [c for c, cfg in configs.items() if entry(0.1, **cfg).tf_kernel() != default_kernel]
        for case in (["default"] + other[:1]) if paths_only else configs:
            out[f"{name}:{case}"] = (entry, configs[case])
    return out


def numpy_replay(name, cfg, table0, xs, ys, lr_fn, final_catch_up=True, stored=None):
    """Replays `dot_loss` training with the NumPy reference rules (as `fit`
    does: ending with the catch-up of `lazy=False` updaters and the moving average
    of `ema_momentum` ones).

    `stored(table, step)`: the table as a 16-bit variable stores it after `step`
    (rows that did not change are stored unchanged)."""
    from tests import reference
    table = np.asarray(table0, np.float64)
    state = reference.initial_state(name, table.shape, cfg)
    stored = stored or (lambda table, step: table)
    for t, (x, y) in enumerate(zip(xs, ys)):
        grads = y.astype(np.float64) / x.shape[0]
        table, state = reference.sparse_step(name, table, state, x, grads, lr_fn(t), cfg,
                                             step=t + 1)
        table = stored(table, t + 1)
    if final_catch_up:  # `fit` ends with `finalize_variable_values`
        table, state = reference.finalize(name, table, state, lr_fn(len(xs) - 1), cfg,
                                          len(xs))
        table = stored(table, len(xs))
    return table, state


def optimizer_state(optimizer):
    """The optimizer's variables that are state (all but JAX's dedup scratch).

    `optimizer` is a `DispatchOptimizer`, or a `LossScaleOptimizer` around one.
    """
    dispatch = getattr(optimizer, "inner_optimizer", optimizer)
    scratch = {id(v) for v in dispatch.scratch_variables()}
    return [v for v in optimizer.variables if id(v) not in scratch]


# `make test` compiles with test-only XLA flags that cut compile time
# (Makefile, TEST_XLA): LLVM at -O0, which changes machine code only, and
# XLA:CPU's legacy emitters, which also change which fusions XLA forms, hence
# its buffers. The checks that read a compiled program (buffers, aliasing,
# temporaries, collectives) compile it with the emitters a user's process
# uses, so they see the program XLA builds by default (the same HLO, buffers
# and aliasing as at XLA's defaults: only the LLVM level differs).
def xla_production_options():
    """The compile options of the checks that read a compiled program (see above).

    XLA:CPU's emitter option on CPU; none on a GPU, whose compiler refuses
    XLA:CPU's options (and `make test`'s flags do not apply there).
    """
    import jax

    return {"xla_cpu_use_fusion_emitters": True} if jax.default_backend() == "cpu" else {}


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# `make test-all`: child jobs at their full scope too (see the Makefile).
THOROUGH = os.environ.get("SPARSEOPT_THOROUGH") == "1"


def child_env(backend=None, test_xla=True, **extra):
    """The environment of a child process the tests start.

    The repository on `PYTHONPATH`, TensorFlow's logs quiet, `KERAS_BACKEND`
    (this session's unless given), and for JAX children `tests/jax_children`,
    whose `sitecustomize` keeps Keras from importing TensorFlow only to seed it
    (5 s per child).

    Args:
        backend: the child's Keras backend (default: this session's).
        test_xla: keep the XLA flags `make test` adds to cut compile time
            (`SPARSEOPT_TEST_XLA_FLAGS`); False for a child that mostly runs
            steps, whose code they make slower.
        **extra: more variables.
    """
    backend = backend or keras.backend.backend()
    path = [ROOT] + ([os.path.join(ROOT, "tests", "jax_children")] if backend == "jax" else [])
    # The session's own entries stay after ours (a Keras installed on a path
    # of its own, as on a machine whose image already holds JAX).
    path += [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3",
               PYTHONPATH=os.pathsep.join(path))
    if not test_xla:
        dropped = set(os.environ.get("SPARSEOPT_TEST_XLA_FLAGS", "").split())
        env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                    if f not in dropped)
    flags = extra.pop("XLA_FLAGS", None)
    if flags:  # added to the session's own (see the Makefile)
        env["XLA_FLAGS"] = " ".join(f for f in (env.get("XLA_FLAGS"), flags) if f)
    env.update(extra)
    return env


def run_device_job(module, *args, devices=4):
    """`python -m module args...`, a JAX child with `devices` simulated CPU devices (XLA's
    default flags: a job that mostly runs steps); its `CompletedProcess` (text).

    Args:
        module: the job's module (`tests.jobs....`).
        *args: its arguments (strings).
        devices: how many devices it sees.
    """
    env = child_env("jax", test_xla=False, JAX_PLATFORMS="cpu",
                    XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)

def kinds(cases, keep):
    """`cases` as parameters: those in `keep` (one of each kind) run in `make test`.

    The others are marked `thorough`: `make test-all` runs them too.

    Args:
        cases: the parameter values, in order.
        keep: the values `make test` runs (each must be in `cases`).
    """
    keep = set(keep)
    missing = keep - set(cases)
    assert not missing, f"not cases: {sorted(missing)}"
    return [c if c in keep else pytest.param(c, marks=pytest.mark.thorough) for c in cases]


def kinds_by_backend(cases, keep, keep_on_tensorflow):
    """`kinds` with a shorter `make test` list on TensorFlow, whose steps compile in
    about three times JAX's time: each rule's arithmetic is checked on JAX, and its
    TensorFlow path on `keep_on_tensorflow` (`make test-all`: every case on both)."""
    on_jax = keras.backend.backend() == "jax"
    return kinds(cases, keep if on_jax else keep_on_tensorflow)


def crossed(first, second, more_first=(), more_second=()):
    """Every pair of two axes as parameters (`a-b` ids); `make test` runs a rotation.

    The rotation pairs `first[i]` with `second[i]` (each list cycled to the
    longer's length): each value of each axis runs once, and the leading
    pair is the two firsts (put the usual case first). The other pairs,
    and those with `more_*` values, are marked `thorough`.

    Args:
        first, second: the values `make test` covers, most common first.
        more_first, more_second: values only `make test-all` runs.
    """
    n = max(len(first), len(second))
    keep = {(first[i % len(first)], second[i % len(second)]) for i in range(n)}
    return [pytest.param(a, b, id=f"{a}-{b}",
                         marks=() if (a, b) in keep else pytest.mark.thorough)
            for a in list(first) + list(more_first) for b in list(second) + list(more_second)]


def backend_kind(backend):
    """This session's backend as a parameter, `thorough` unless it is `backend`.

    For a case `make test` runs on one backend only (`make test-all` on both).
    """
    here = keras.backend.backend()
    return kinds([here], [here] if here == backend else [])
