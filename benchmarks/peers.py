"""The configurations `run.py` compares, and the child process that times them.

Every peer trains the same model on the same batches: ids `[batch, 16]` ->
table `[rows, 32]`, sum-pooled -> `Dense(1)` -> MSE, the dense part by Adam.

    framework   peer                      table trained by
    jax, tf     sparseopt-<updater>       SparseEmbedding + DispatchOptimizer(Adam)
    jax, tf     keras-adagrad/keras-adam  keras.layers.Embedding + MultiOptimizer
                                          (table -> Adagrad or Adam, rest -> Adam)
    torch       fbgemm-rowwise_adagrad    SplitTableBatchedEmbeddingBagsCodegen,
    torch       fbgemm-adagrad            EXACT_ROWWISE_ADAGRAD / EXACT_ADAGRAD (CPU)

A step is the framework's compiled training step called in a Python loop on
pre-made batches (JAX: `jax.jit(model.train_step)` with donated state, as
`fit` runs it; TF: `tf.function(model.train_step)`; torch: forward, backward
with FBGEMM's fused update, Adam step). `fit`'s own per-step overhead (data
iterator, callbacks) is left out for every peer alike.

A child hosts several configurations of one framework (`serve`); they are
built one after another (memory measured per configuration), then timed
round-robin on the parent's `time` commands.
"""

import json
import sys

import numpy as np

import common
from children import StepTimer, answer, memory_mb, reset_peak_memory

WIDTH = 32
IDS_PER_EXAMPLE = 16
HOT_ROWS = common.HOT_ROWS  # every batch draws its ids from this many rows: equal work
N_BATCHES = 8
TABLE_LR = 0.05
DENSE_LR = 1e-3

SPARSEOPT_UPDATERS = ["sgd", "adagrad", "rowwise_adagrad", "ftrl"]
FRAMEWORK_PEERS = {
    "jax": [f"sparseopt-{u}" for u in SPARSEOPT_UPDATERS] + ["keras-adagrad", "keras-adam"],
    "tensorflow": [f"sparseopt-{u}" for u in SPARSEOPT_UPDATERS] + ["keras-adagrad", "keras-adam"],
    "torch": ["fbgemm-rowwise_adagrad", "fbgemm-adagrad"],
}
# Table-sized arrays a configuration holds at its peak, in tables, for
# planning which configurations fit in memory together (measured, rounded up:
# Keras' random initializer peaks at ~4 tables on JAX and ~3 on TF; a dense
# table gradient and its temporaries add 2).
MEMORY_TABLES = {"sparseopt-sgd": 4, "sparseopt-adagrad": 5, "sparseopt-rowwise_adagrad": 4,
                 "sparseopt-sgd_momentum": 5, "sparseopt-adagrad_momentum": 6,
                 "sparseopt-adam": 6, "sparseopt-partial_rowwise_adam": 5,
                 "sparseopt-laprop": 6, "sparseopt-frequency_aware_adagrad": 6,
                 "sparseopt-adam_options": 6, "sparseopt-sgd_momentum_dense": 5,
                 "sparseopt-adam_ema": 7, "fbgemm-sgd": 1.2, "sparseopt-rmsprop": 5,
                 "sparseopt-adamax": 6, "sparseopt-nadam": 6, "sparseopt-lion": 5,
                 "sparseopt-lamb": 6, "sparseopt-adafactor": 5,
                 "sparseopt-adafactor_dense": 5, "sparseopt-adam_swa": 7,
                 "sparseopt-adam_lookahead": 7,
                 "sparseopt-ftrl": 6, "keras-adagrad": 6, "keras-adam": 7,
                 "fbgemm-rowwise_adagrad": 1.2, "fbgemm-adagrad": 2.2}
PROCESS_GB = {"jax": 1.0, "tensorflow": 1.2, "torch": 0.6}


def make_batches(rows, batch, seed=0):
    """`N_BATCHES` batches of hot ids (int32 `[batch, 16]`) and targets."""
    rng = np.random.default_rng(seed)
    hot = common.hot_set(rng, rows, HOT_ROWS)
    xs = [common.hot_ids(rng, rows, (batch, IDS_PER_EXAMPLE), hot=hot)
          for _ in range(N_BATCHES)]
    ys = [rng.normal(size=(batch, 1)).astype("float32") for _ in range(N_BATCHES)]
    return xs, ys


# -- Keras (JAX and TensorFlow) ----------------------------------------------


def _updater(name):
    import sparseopt

    u = sparseopt.updaters
    return {"sgd": lambda: u.SGD(TABLE_LR),
            "adagrad": lambda: u.Adagrad(TABLE_LR),
            "rowwise_adagrad": lambda: u.RowwiseAdagrad(TABLE_LR),
            "ftrl": lambda: u.Ftrl(TABLE_LR),
            # benchmarks/updaters.py: the other rules, options, lazy=False, EMA.
            "sgd_momentum": lambda: u.SGD(TABLE_LR, momentum=0.9),
            "adagrad_momentum": lambda: u.AdagradMomentum(TABLE_LR, momentum=0.9),
            "adam": lambda: u.Adam(TABLE_LR),
            "partial_rowwise_adam": lambda: u.PartialRowwiseAdam(TABLE_LR),
            "laprop": lambda: u.LaProp(TABLE_LR),
            "frequency_aware_adagrad": lambda: u.FrequencyAwareAdagrad(TABLE_LR),
            "adam_options": lambda: u.Adam(TABLE_LR, weight_decay=1e-4, clipnorm=1.0,
                                           max_norm=10.0),
            "sgd_momentum_dense": lambda: u.SGD(TABLE_LR, momentum=0.9, weight_decay=1e-4,
                                                lazy=False),
            "adam_ema": lambda: u.Adam(TABLE_LR, ema_momentum=0.99),
            "rmsprop": lambda: u.RMSprop(TABLE_LR),
            "adamax": lambda: u.Adamax(TABLE_LR),
            "nadam": lambda: u.Nadam(TABLE_LR),
            "lion": lambda: u.Lion(TABLE_LR / 10),  # (Lion's steps are all lr: smaller)
            "lamb": lambda: u.Lamb(TABLE_LR),
            "adafactor": lambda: u.Adafactor(TABLE_LR),
            "adafactor_dense": lambda: u.Adafactor(TABLE_LR, lazy=False),
            "adam_swa": lambda: u.Adam(TABLE_LR, swa_period=10),
            "adam_lookahead": lambda: u.Adam(TABLE_LR, lookahead_period=5)}[name]()


def build_keras(peer, rows, batch):
    """Model + optimizer for a `sparseopt-*` or `keras-*` peer."""
    import keras

    keras.utils.set_random_seed(0)
    kind, name = peer.split("-", 1)
    if kind == "sparseopt":
        rule = _updater(name)
    else:
        rule = {"adagrad": keras.optimizers.Adagrad, "adam": keras.optimizers.Adam}[name](TABLE_LR)
    return common.recommender({"emb": (rows, rule, IDS_PER_EXAMPLE)}, WIDTH,
                              sparse=kind == "sparseopt",
                              dense_optimizer=keras.optimizers.Adam(DENSE_LR))


def keras_state_bytes(model, rows):
    """Optimizer bytes by kind: table state, from the dense optimizer, scratch."""
    table_state = dense_for_table = workspace = other = 0
    optimizer = model.optimizer
    dense_opts = getattr(optimizer, "dense_optimizers", None)
    dense_ids = {id(v) for o in dense_opts for v in o.variables} if dense_opts else set()
    scratch = getattr(optimizer, "scratch_variables", list)()
    scratch_ids = {id(v) for v in scratch}
    for v in optimizer.variables:
        nbytes = int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize
        table_sized = len(v.shape) > 0 and v.shape[0] == rows
        if id(v) in scratch_ids:
            workspace += nbytes
        elif table_sized and id(v) in dense_ids:
            dense_for_table += nbytes
        elif table_sized:
            table_state += nbytes
        else:
            other += nbytes
    return {"table_state": table_state, "dense_optimizer_for_table": dense_for_table,
            "workspace": workspace, "other": other}


def jax_step(model, xs, ys, state=None):
    """`(run, sync)`: the jitted, state-donating train step over `xs`, `ys` in turn.

    Args:
        model: the compiled Keras model.
        xs, ys: the pre-made batches (arrays or dicts of arrays).
        state: a one-entry list holding the model's JAX state, to share it
            between steps of several batch shapes of one model (filled here
            if empty).
    """
    import jax

    from sparseopt import compat

    state = [] if state is None else state
    if not state:
        state.append(compat.jax_train_state(model, (xs[0], ys[0])))
    step = jax.jit(model.train_step, donate_argnums=0)
    data = [(jax.device_put(x), jax.device_put(y)) for x, y in zip(xs, ys)]
    counter = [0]

    def run():
        _, state[0] = step(state[0], data[counter[0] % len(data)])
        counter[0] += 1

    def sync():
        jax.block_until_ready(state[0])

    return run, sync


def tf_step(model, xs, ys):
    import tensorflow as tf

    if not model.optimizer.built:
        model.train_on_batch(xs[0], ys[0])  # builds the optimizer
    step = tf.function(model.train_step)
    data = [tf.nest.map_structure(tf.constant, (x, y)) for x, y in zip(xs, ys)]
    counter = [0]
    last = [None]

    def run():
        last[0] = step(data[counter[0] % len(data)])
        counter[0] += 1

    def sync():
        if last[0] is not None:
            tf.nest.map_structure(lambda t: t.numpy(), last[0])

    return run, sync


# -- TorchRec / FBGEMM ----------------------------------------------------------


def build_fbgemm(peer, rows, batch, xs, ys):
    import torch
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
        EmbeddingLocation, PoolingMode)
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen)

    torch.manual_seed(0)
    optim = {"fbgemm-rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
             "fbgemm-adagrad": EmbOptimType.EXACT_ADAGRAD,
             "fbgemm-sgd": EmbOptimType.EXACT_SGD}[peer]
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(rows, WIDTH, EmbeddingLocation.HOST, ComputeDevice.CPU)], optimizer=optim,
        learning_rate=TABLE_LR, eps=1e-7, pooling_mode=PoolingMode.SUM)
    head = torch.nn.Linear(WIDTH, 1)
    adam = torch.optim.Adam(head.parameters(), DENSE_LR)
    offsets = torch.arange(0, batch * IDS_PER_EXAMPLE + 1, IDS_PER_EXAMPLE, dtype=torch.int64)
    data = [(torch.from_numpy(x.reshape(-1).astype("int64")), torch.from_numpy(y))
            for x, y in zip(xs, ys)]
    counter = [0]

    def run():
        ids, y = data[counter[0] % N_BATCHES]
        counter[0] += 1
        loss = torch.mean((head(tbe(ids, offsets)) - y) ** 2)
        adam.zero_grad()
        loss.backward()  # FBGEMM applies the table update inside its backward
        adam.step()

    state = tbe.get_optimizer_state()
    table_state = sum(t.numel() * t.element_size() for s in state for t in s.values())
    return run, (lambda: None), {"table_state": table_state, "dense_optimizer_for_table": 0,
                                 "workspace": 0, "other": 0}


# -- the child process ----------------------------------------------------------


class Config:
    """One (peer, rows, batch) built in this process, with its timings."""

    def __init__(self, framework, slot):
        self.slot = slot
        peer, rows, batch = slot["peer"], slot["rows"], slot["batch"]
        rss_before = memory_mb("VmRSS:")
        reset_peak_memory()
        xs, ys = make_batches(rows, batch)
        if framework == "torch":
            self.run, self.sync, self.state = build_fbgemm(peer, rows, batch, xs, ys)
        else:
            model = build_keras(peer, rows, batch)
            self.run, self.sync = (jax_step if framework == "jax" else tf_step)(model, xs, ys)
            self.state = keras_state_bytes(model, rows)
            self.model = model
        self.timer = StepTimer(self.run, self.sync)
        self.build_peak_mb = memory_mb("VmHWM:") - rss_before
        self.distinct = float(np.mean([np.unique(x).size for x in xs]))

    def time(self, budget_s):
        self.timer.time(budget_s)

    def result(self):
        stats = self.timer.stats()
        return dict(self.slot, **stats, **{
            "examples_per_s": self.slot["batch"] / (stats["median_ms"] / 1e3),
            "distinct_ids_per_step": self.distinct,
            "table_bytes": self.slot["rows"] * WIDTH * 4,
            "state_bytes": self.state,
            # The framework's own process memory plus what this configuration
            # added at its peak (building, compiling, first steps).
            "peak_rss_mb": self.base_mb + self.build_peak_mb,
            "added_rss_mb": self.build_peak_mb,
        })


def serve(framework, slots, budget_s):
    """Builds `slots` (one framework), then answers `time` / `result` on stdin."""
    if framework == "torch":
        import os

        import torch

        torch.set_num_threads(os.cpu_count())
        import fbgemm_gpu  # noqa: F401
    else:
        import keras  # noqa: F401

        import sparseopt  # noqa: F401
    base_mb = memory_mb("VmRSS:")
    configs = [Config(framework, slot) for slot in slots]
    for config in configs:
        config.base_mb = base_mb
    def time_once():
        for config in configs:
            config.time(budget_s)

    answer(time_once, lambda: [c.result() for c in configs])


if __name__ == "__main__":
    serve(sys.argv[1], json.loads(sys.argv[2]), float(sys.argv[3]))
