"""JAX plumbing: a custom-VJP tap, the lookups' reads, traces, replicas, the native seam.

The step's distinct rows come from `jax_distinct` (one table's dedup, a group's, the
chunked loops over them); rows are read by `jax_rows` and this module's `gather`
(native where it runs) and written by `jax_writes` (in-place scatter, 16-bit bits);
tables split by rows over devices by `jax_sharding`.

`jax.grad` cannot return a sparse gradient, so the lookup's backward pass
records its `RowGrads` on the side and the optimizer consumes them later
in the same trace. Under Keras' jitted, state-donating train step the scatter
below updates the donated table buffer in place.
"""

import contextlib
import functools

import jax
import jax.numpy as jnp

from sparseopt.backend import jax_native, jax_rows, jax_sharding
from sparseopt.backend.jax_host import (  # noqa: F401 (the contract's)
    HOST_CALLS_COMPILE, host_read, host_write)
from sparseopt.backend.jax_native import number_ids  # noqa: F401 (the contract's)
from sparseopt.backend.contract import Kernel
from sparseopt.backend.jax_dedup import first_occurrences, first_true  # noqa: F401
from sparseopt.backend.jax_distinct import (  # noqa: F401 (the contract's)
    WORKSPACE, WORKSPACE_SINK, dedup, dedup_tables, for_distinct_rows, for_listed_rows,
    scratch_workspace, sum_over_distinct_rows, trimmed)
from sparseopt.backend.jax_rows import bitcast, gather_rows  # noqa: F401 (bitcast: the contract's)
from sparseopt.backend.jax_writes import scatter, scatter_min, scatter_where  # noqa: F401
from sparseopt.backend.jax_sharding import ROW_SHARDS, on_row_shards, row_shards  # noqa: F401


def tap(rows, probe, ids, on_backward, aux=None, marks=True):
    @jax.custom_vjp
    def _tap(rows, probe, ids, aux):
        return rows

    def _fwd(rows, probe, ids, aux):
        return rows, (ids, aux)

    def _bwd(residuals, g):
        ids, aux = residuals
        on_backward(ids, g, aux)
        marker = jnp.where(jnp.all(jnp.isfinite(g)), 1.0, jnp.nan) if marks else jnp.ones(())
        return None, marker.astype(probe.dtype), None, None

    _tap.defvjp(_fwd, _bwd)
    return _tap(rows, probe, ids, aux)


# Keras' JAX train step differentiates `model.trainable_variables`: a lookup's
# probe can be layer state that is not a weight (see SparseLookup).
PROBE_IS_WEIGHT = False

# Keras' JAX train step applies the optimizer statelessly: it returns the new
# values of the trainable and optimizer variables only (a write to other
# layer state there would be lost).
STATEFUL_APPLY = False


def gather(value, ids):
    """`value[ids]`, ids clamped: by the native call where it runs (one call, compiled
    once for every array), else the pure path (`jax_rows.gather`)."""
    if ids.ndim == 1 and value.ndim >= 1 and jax_native.moves_rows():
        return jax_native.take_rows(value, ids)
    return jax_rows.gather(value, ids)


def materialize(values):
    """`values`, computed before whatever uses them next.

    XLA:CPU otherwise fuses the rule's arithmetic into the scatter that
    writes its result, and runs it there one row at a time.
    """
    return jax.lax.optimization_barrier(values)



# jax.grad of a gather is a dense array: tables are read through the tap.
SPARSE_GRADIENTS = False


def gradient_slices(grad):
    return None


def has_int64():
    return bool(jax.config.jax_enable_x64)  # else JAX truncates int64 to int32


def replica_strategy():
    # keras.distribution compiles one global program (GSPMD): a table and
    # its state are updated once, shard by shard, never per replica.
    return None


def all_replicas(record):
    return record


def sum_over_replicas(value):
    return value


def gather_over_replicas(values):
    return list(values), 0


def compiled(fn):
    return fn  # (Keras compiles JAX's whole step)


def replica_id():
    return 0


def outside_trace():
    return contextlib.nullcontext()  # JAX builds optimizers outside the traced step


def trace_token(value=None):
    """What identifies the trace being built now; None if `value` is not traced (eager)."""
    from jax.extend.core import get_opaque_trace_state

    if value is not None and not isinstance(value, jax.core.Tracer):
        return None
    return get_opaque_trace_state(convention="flax")


def read_rows(table, ids):
    """Forward lookup of valid `ids` in a Keras variable (no gradient to it).

    From each id's owner where the table's rows are split over devices and
    that pays (`jax_sharding.routed_read`); elsewhere a gather.
    """
    value = jax.lax.stop_gradient(table.value)
    routed = jax_sharding.routed_read(table, value, ids)
    return routed if routed is not None else gather_rows(value, ids)


# Bags up to this many ids are summed in an unrolled sequence of gathers.
UNROLL_BAG = 64


def read_pooled(table, ids, weight, dtype):
    """`sum_l weight[..., l] * table[ids[..., l]]`, in `dtype` (no gradient to `table`).

    One gather per bag position, each added into the running sum: XLA:CPU
    fuses each `[bags, width]` gather into the add, where gathering all
    `[bags, ids, width]` rows first and reducing them is 10x slower
    (1.0 vs 11-15 ms for 16,384 bags of 16 ids, width 32, measured).
    """
    value = jax.lax.stop_gradient(table.value)

    def position(i):
        return gather_rows(value, ids[..., i]).astype(dtype) * weight[..., i, None]

    size = ids.shape[-1]
    if size == 0:
        return jnp.zeros(ids.shape[:-1] + (value.shape[1],), dtype)
    if size <= UNROLL_BAG:
        pooled = position(0)
        for i in range(1, size):
            pooled = pooled + position(i)
        return pooled
    return jax.lax.fori_loop(1, size, lambda i, acc: acc + position(i), position(0))


def gather_from_resource(variable, ids):
    """`variable[ids]`; its gradient is dense on JAX, which reads tables through the tap
    (`SparseLookup`) instead."""
    return gather_rows(variable.value, ids)



FILLS_IN_BLOCKS = True


def fill_in_blocks(make_block, shape, dtype, block_rows):
    """A `shape` array whose row blocks are `make_block(i, block_shape)`.

    Written into one preallocated array with a donating update, so memory
    peaks at the array plus one block.
    """
    out = jnp.zeros(shape, dtype)
    for i, start in enumerate(range(0, shape[0], block_rows)):
        rows = min(block_rows, shape[0] - start)
        out = _put_rows(out, make_block(i, (rows,) + tuple(shape[1:])), start)
    return out


def fills_variables_in_blocks():
    """False: a table's initializer builds it in place (`fill_in_blocks`)."""
    return False


@functools.partial(jax.jit, donate_argnums=0)
def _put_rows(out, block, start):
    return jax.lax.dynamic_update_slice_in_dim(out, block.astype(out.dtype), start, axis=0)



def run_if(pred, fn, variables):
    """Runs `fn()` (which reads and assigns `variables`) where `pred` holds, else nothing.

    A `lax.cond` over the variables' values: `fn` runs in a stateless scope
    of its branch, whose assignments become the branch's results. Every
    variable `fn` reads must be in `variables` (others would read their
    stored value, not the step's). The untaken branch returns its operands:
    XLA updates the variables in place either way (a table is never copied;
    checked by tests/test_no_vocab_work.py).
    """
    import keras

    def taken(values):
        with keras.StatelessScope(state_mapping=list(zip(variables, values))) as scope:
            fn()
        return [scope.get_current_value(v) for v in variables]

    values = jax.lax.cond(pred, taken, lambda values: list(values),
                          [v.value for v in variables])
    for variable, value in zip(variables, values):
        variable.assign(value)


def write_rows(variable, start, rows):
    """`variable[start:start + len(rows)] = rows`, in place (`start` may be a tensor)."""
    value = variable.value
    start = jnp.asarray(start, jnp.int32)
    index = (start,) + (jnp.zeros((), jnp.int32),) * (value.ndim - 1)
    variable.assign(jax.lax.dynamic_update_slice(value, rows.astype(value.dtype), index))


def at_least_zero(value, message):
    """`value` (JAX shapes are static: callers check them when tracing)."""
    return value


def after(done, value):
    """`value` (JAX orders a step's effects by their data: nothing to add)."""
    return value


def trace_forward(model, find_batch):
    """Traces `model` on a batch's shapes without computing or changing anything.

    What lets each `SparseLookup` see how many ids a step looks up before
    the train step is traced (gradient accumulation sizes its buffers by it).

    Args:
        model: the model being trained.
        find_batch: returns a batch of its training data, or None (then
            nothing is traced).
    """
    import keras

    batch = find_batch()
    if batch is None:
        return
    x, _, _ = keras.utils.unpack_x_y_sample_weight(batch)
    spec = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(tuple(a.shape), a.dtype), x)
    with keras.StatelessScope():
        jax.eval_shape(lambda x: model(x, training=True), spec)


# The native kernels (`sparseopt.native`): the dedup and sum as one XLA FFI call,
# the same `Distinct` and workspace bit for bit (on by default: one call in the
# compiled step instead of about fourteen kernels per table). Row reads and
# writes are the rows' own (`gather` below, `jax_writes.set_rows`).
KERNELS = (Kernel("native_dedup", ("distinct",),
                  lambda workspace=None, **_: jax_native.applies(workspace),
                  jax_native.dedup),)
