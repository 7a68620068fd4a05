"""TensorFlow plumbing: a custom-gradient tap, dedup, in-place scatter.

The tap keeps the row gradients away from Keras' dense-gradient path (where
`LossScaleOptimizer` and friends would turn `IndexedSlices` into a dense
table) and hands them to the optimizer as a `RowGrads`, i.e. the two halves
of the lookup's `tf.IndexedSlices`.
"""

import keras
import tensorflow as tf
from sparseopt import compat
from sparseopt.backend import tensorflow_kernels, tensorflow_native
from sparseopt.backend.contract import Kernel
from sparseopt.backend.tensorflow_host import (  # noqa: F401 (the contract's)
    HOST_CALLS_COMPILE, host_read, host_write)
from sparseopt.backend.tensorflow_native import number_ids  # noqa: F401 (the contract's)
from sparseopt.backend.tensorflow_distinct import (  # noqa: F401 (the contract's)
    WORKSPACE, WORKSPACE_SINK, dedup, dedup_tables, for_distinct_rows, for_listed_rows,
    scratch_workspace, sum_over_distinct_rows, trimmed)
from sparseopt.backend.tensorflow_replicas import (  # noqa: F401 (the contract's)
    all_replicas, gather_over_replicas, local, replica_context, replica_id, replica_strategy,
    sum_over_replicas)


def tap(rows, probe, ids, on_backward, aux=None, marks=True):
    @tf.custom_gradient
    def _tap(rows, probe):
        def grad(g):
            on_backward(ids, g, aux)
            if not marks:
                return None, tf.ones_like(probe)
            # Over all replicas: Keras' LossScaleOptimizer decides on the
            # first replica's gradients only (MirroredStrategy).
            infinite = tf.cast(tf.logical_not(tf.reduce_all(tf.math.is_finite(g))), tf.int32)
            finite = tf.equal(sum_over_replicas(infinite), 0)
            marker = tf.where(finite, tf.constant(1.0, probe.dtype),
                              tf.constant(float("nan"), probe.dtype))
            return None, marker

        return tf.identity(rows), grad

    out = _tap(rows, probe)
    # (Its gradient comes from the tape: TF's global registration of it would keep
    # this trace's graph, and the model's tables it reads, alive for good.)
    compat.forget_custom_gradient(out)
    return out


# Keras' TF train step differentiates `model.trainable_weights` only: a
# lookup's probe must be a weight of its layer to get its gradient. (Nor can
# the table's own gradient carry the marker: a `tf.custom_gradient` that
# reads a variable reads all of it.)
PROBE_IS_WEIGHT = True


# TF copies an initial value into its variable: an initializer cannot build a
# table in place. Large tables are created as zeros and their blocks written
# into the variable afterwards instead (`fills_variables_in_blocks`).
FILLS_IN_BLOCKS = False


def fill_in_blocks(make_block, shape, dtype, block_rows):
    """The blocks `make_block(i, block_shape)` of a `shape` array, joined (no in-place writes)."""
    blocks = [make_block(i, (min(block_rows, shape[0] - start),) + tuple(shape[1:]))
              for i, start in enumerate(range(0, shape[0], block_rows))]
    return tf.cast(tf.concat(blocks, axis=0), dtype)


def fills_variables_in_blocks():
    """Whether a variable created now is a plain `tf.Variable` that `write_rows` fills in place.

    Eager and outside any `tf.distribute` strategy: a mirrored variable's
    copies are written through the strategy, and inside a trace the writes
    would be ops of the traced function.
    """
    return tf.executing_eagerly() and not tf.distribute.has_strategy()

def materialize(values):
    return values


# The gradient of a gather is `tf.IndexedSlices`: ids and row gradients.
SPARSE_GRADIENTS = True


def gradient_slices(grad):
    """`(ids, row_grads)` of a sparse gradient, or None for a dense one."""
    if isinstance(grad, tf.IndexedSlices):
        return grad.indices, grad.values
    return None


def has_int64():
    return True


# Tables are never split over devices on TF (replicas hold whole copies).
ROW_SHARDS = False


def row_shards(variable):
    return None


def on_row_shards(run, shards, variables, record, carried):
    raise ValueError(f"Table '{variables[0].path}': TensorFlow tables are never split by rows "
                     "over devices (`row_shards` is None for every table here).")

def outside_trace():
    return tf.init_scope()


def trace_token(value=None):
    """What identifies the trace being built now (its graph); None when eager."""
    if tf.executing_eagerly():
        return None
    return tf.compat.v1.get_default_graph()


def read_rows(table, ids):
    """Forward lookup of valid `ids` in a Keras variable (no gradient to it).

    Gathers from the resource directly: reading the whole variable would hold
    a second reference to its buffer and make the later in-place scatter copy
    the table first.
    """
    return tf.stop_gradient(tf.gather(local(table), ids))


# Pooled reads of fewer ids than this run op by op.
COMPILED_POOL_MIN_IDS = 4096


def read_pooled(table, ids, weight, dtype):
    """`sum_l weight[..., l] * table[ids[..., l]]`, in `dtype` (no gradient to `table`).

    XLA-compiled: the gather reads the table resource in place and fuses
    with the weighting and the sum, where TF's kernels gather all
    `[bags, ids, width]` rows first (8 -> 3 ms for 16,384 bags of 20 ids of
    a 10M x 16 table, in the whole step, measured).
    """
    size = ids.shape.num_elements()
    if (ids.shape[-1] == 1 or size is None or size < COMPILED_POOL_MIN_IDS
            or tf.executing_eagerly() or compat.in_xla_context()):
        # One id per bag: nothing to fuse; few ids: a compiled call costs
        # about 0.1 ms to launch and a compilation per shape. Eager:
        # compiling would cost more than it saves.
        return tf.stop_gradient(_pooled_sum(local(table), ids, weight, dtype))
    return tf.stop_gradient(_compiled_pooled_sum(local(table), ids, weight, dtype))


def _pooled_sum(table, ids, weight, dtype):
    rows = tf.cast(tf.gather(table, ids), dtype)
    return tf.reduce_sum(rows * tf.expand_dims(weight, -1), axis=-2)


# Its shapes are static for a batch shape (XLA compiles once per table and
# batch shape); the table is a resource, read in place, never copied. No
# `reduce_retracing`: with it, TF 2.21 ran a trace relaxed for one table's
# shape ([?, 3]) on a table of another ([200, 4]) and failed.
_compiled_pooled_sum = tf.function(_pooled_sum, jit_compile=True, autograph=False)


def compiled(fn):
    """`fn` (static shapes; Keras variables among its arguments) as one XLA program.

    TF runs a graph op by op (about 10 us each); XLA fuses a chain of small
    ops into a few loops: an open vocabulary's `find` at batch 16,384 took
    4.3 ms op by op and 1.2 ms compiled. Each variable argument is passed as
    this replica's copy (`local`), read in place. Eager, or inside an XLA
    cluster already: `fn` as it is.

    One program per `fn` for the process: a model traced after another of the
    same shapes reuses its compiled program (its variables are arguments, not
    captures, so it keeps no model alive).
    """
    program = _COMPILED.setdefault(fn, tf.function(fn, jit_compile=True, autograph=False))

    def call(*args):
        if tf.executing_eagerly() or compat.in_xla_context():
            return fn(*args)
        return program(*(local(a) if isinstance(a, keras.Variable) else a for a in args))

    return call


_COMPILED = {}


def gather_from_resource(variable, ids):
    """Rows of a Keras variable by `ResourceGather`; the gradient is `IndexedSlices`."""
    return tf.gather(local(variable), ids)


def gather(value, ids):
    return tf.gather(local(value), ids)


def bitcast(values, dtype):
    return tf.bitcast(values, dtype)


def scatter(variable, ids, rows):
    var = local(variable)
    var.scatter_update(tf.IndexedSlices(tf.cast(rows, var.dtype), ids))


def scatter_where(variable, ids, rows, keep):
    # TF's scatter refuses ids past the end: the rows not kept are left out.
    scatter(variable, tf.boolean_mask(ids, keep), tf.boolean_mask(rows, keep))


def scatter_min(variable, ids, values, keep):
    # The entries not kept write the dtype's largest value to row 0: a min
    # that changes nothing (cheaper than masking them out).
    var = local(variable)
    largest = var.dtype.max
    var.scatter_min(tf.IndexedSlices(tf.where(keep, tf.cast(values, var.dtype), largest),
                                     tf.where(keep, ids, tf.zeros_like(ids))))


def first_occurrences(high, low, active):
    # TF's own hash dedup (`tf.unique`: keys in the order first seen) of the
    # 64-bit keys, then each key's first active position.
    key = tf.bitwise.bitwise_or(tf.bitwise.left_shift(tf.cast(high, tf.int64), 32),
                                tf.cast(tf.bitcast(low, tf.uint32), tf.int64))
    _, which = tf.unique(key, out_idx=tf.int32)
    n = tf.shape(high)[0]
    position = tf.range(n, dtype=tf.int32)
    first = tf.math.unsorted_segment_min(tf.where(active, position, n), which, n)
    return tf.where(active, tf.gather(first, which), position)


def first_true(mask, k):
    # Exactly the ones found (a shape known when it runs): what follows works
    # on the step's candidates, not on `k` (padded, TF's step was 6 ms longer
    # at batch 16,384 with k = 4,096).
    return tf.cast(tf.where(mask)[:k, 0], tf.int32)

# Keras' TF optimizers run eagerly or in a graph on real variables: an
# optimizer step may write any variable.
STATEFUL_APPLY = True


def run_if(pred, fn, variables):
    """Runs `fn()` (which assigns variables) where `pred` holds, else nothing (`tf.cond`).

    Inside a `MirroredStrategy` replica, `fn`'s collectives (Keras' optimizers'
    merge calls, the replicas' row gathers) cannot sit in a `tf.cond` there:
    as Keras' `LossScaleOptimizer` does, the cond is taken in cross-replica
    context and runs `fn` in every replica. `fn` must read only variables
    (each replica then reads its own copy), and `pred` be the same everywhere.
    """
    context = replica_context()
    if context is None:
        # Host calls in `fn` (a table on disk) stay in program order with the step's
        # others. A `tf.function` orders stateful ops with no resource input among
        # themselves (the host calls: automatic control dependencies), and ops with
        # resource inputs by resource only: a cond over variables would not be ordered
        # after the host calls before it (measured: its host read ran before an earlier
        # host write). `tf.timestamp`, stateful with no resource input, stands in it
        # that order on each side of the cond.
        before = tf.timestamp()
        with tf.control_dependencies([before]):
            ran = tf.cond(pred, lambda: _ran(fn), lambda: tf.constant(False))
        with tf.control_dependencies([ran]):
            tf.timestamp()
        return

    def cross(strategy, pred):
        def taken():
            strategy.extended.call_for_each_replica(fn)
            return tf.constant(True)

        first = strategy.experimental_local_results(pred)[0]
        tf.cond(first, taken, lambda: tf.constant(False))

    context.merge_call(cross, args=(pred,))


def _ran(fn):
    fn()
    return tf.constant(True)


def write_rows(variable, start, rows):
    """`variable[start:start + len(rows)] = rows`, in place, on this replica's copy."""
    var = local(variable)
    start = tf.cast(start, tf.int32)
    rows = tf.cast(rows, var.dtype)
    if isinstance(var, tf.distribute.DistributedValues):  # every copy, through the strategy
        var[start:start + tf.shape(rows)[0]].assign(rows)
        return
    # The op on the handle: `var[a:b].assign(...)` first reads the variable,
    # and the assign then copies the whole variable before writing, eager or
    # traced (measured: 1 s per write into a 1.2 GB variable; 0.5 ms this way).
    ndim = len(var.shape)
    tf.raw_ops.ResourceStridedSliceAssign(
        ref=var.handle, begin=tf.stack([start] + [0] * (ndim - 1)),
        end=tf.stack([start + tf.shape(rows)[0]] + [0] * (ndim - 1)), strides=[1] * ndim,
        value=rows, end_mask=sum(1 << axis for axis in range(1, ndim)))


def at_least_zero(value, message):
    """`value`, checked when the step runs: an `InvalidArgumentError` with `message` if < 0."""
    with tf.control_dependencies([tf.debugging.assert_non_negative(value, message=message)]):
        return tf.identity(value)


def after(done, value):
    """`value`, used only once `done` is computed (graph ops run in any order otherwise)."""
    with tf.control_dependencies([done]):
        return tf.identity(value)


def trace_forward(model, find_batch):
    """Nothing to do: TF builds the optimizer inside the traced step, after the forward
    pass, so every lookup has seen the step's shapes by then."""

def _fused_applies(updater=None, storage=None, **_):
    """Whether TF's own sparse-apply kernel computes exactly this table's step: the
    updater names one (`Updater.fused_kernel`), the table and its state are float32
    variables in memory (16-bit values are rounded by sparseopt, not to nearest by a
    kernel), and not inside an XLA cluster (`jit_compile=True`, which has no
    sparse-apply kernels)."""
    if storage is None or not storage.plain() or compat.in_xla_context():
        return False
    return (tensorflow_kernels.kernel_for(updater) is not None
            and all(v.dtype == "float32" for v in storage.variables()))


def _fused_run(updater, storage, distinct, values, finite):
    """TF's kernel for `updater` on `distinct`'s rows of `storage`, where `finite`."""
    kernel = tensorflow_kernels.kernel_for(updater)
    var = local(storage.table)
    handles = {name: local(slot).handle for name, slot in storage.slots.items()}
    grads = tf.cast(distinct.grads, var.dtype)
    values = {name: tf.cast(value, var.dtype) for name, value in values.items()}

    def run():
        kernel(var.handle, handles, distinct.ids, grads, values)
        return tf.constant(True)

    tf.cond(finite, run, lambda: tf.constant(False))


# The native dedup op (`sparseopt.native`, `tf_ops.cc`; on by default), and
# TensorFlow's fused sparse-apply kernels for the rules they compute exactly.
KERNELS = (
    Kernel("native_dedup", ("distinct",),
           lambda record=None, **_: record is not None and tensorflow_native.applies(record),
           lambda record, num_rows, workspace: tensorflow_native.dedup(record, num_rows,
                                                                       local(workspace))),
    Kernel("sparse_apply", ("read", "rule", "write"), _fused_applies, _fused_run),
)
