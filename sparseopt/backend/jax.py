"""JAX plumbing: a custom-VJP tap, sort-free dedup and in-place scatter.

`jax.grad` cannot return a sparse gradient, so the lookup's backward pass
records its `RowGrads` on the side and the optimizer consumes them later
in the same trace. Under Keras' jitted, state-donating train step the scatter
below updates the donated table buffer in place.
"""

import contextlib
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from sparseopt import compat
from sparseopt.row_grads import Distinct, RowGrads


def tap(rows, probe, ids, on_backward, aux=None):
    @jax.custom_vjp
    def _tap(rows, probe, ids, aux):
        return rows

    def _fwd(rows, probe, ids, aux):
        return rows, (ids, aux)

    def _bwd(residuals, g):
        ids, aux = residuals
        on_backward(ids, g, aux)
        marker = jnp.where(jnp.all(jnp.isfinite(g)), 1.0, jnp.nan)
        return None, marker.astype(probe.dtype), None, None

    _tap.defvjp(_fwd, _bwd)
    return _tap(rows, probe, ids, aux)


# Keras' JAX train step differentiates `model.trainable_variables`: a lookup's
# probe can be layer state that is not a weight (see SparseLookup).
PROBE_IS_WEIGHT = False


# Dedup writes into a persistent int32 `workspace` with one entry per row
# (4 bytes a row, one per table: a shared one would chain the tables' updates
# one after another; measured 10.4 vs 8.6 ms per step on the 26-table demo).
WORKSPACE = True
WORKSPACE_SINK = 0  # extra entries (invalid ids are dropped by the scatter)


def dedup(record, num_rows, workspace):
    """The `Distinct` rows of `record`: the `count` distinct ids first.

    No sort: every occurrence writes its position into `workspace[id]`; the
    write that lands is one of that id's positions, so reading
    `workspace[id]` back gives every occurrence of an id the same
    representative position. Only the entries of this batch's ids are
    written and read, so what earlier steps left in the workspace never
    matters. It is 2.3x faster than sorting on XLA:CPU (0.55 vs 1.27 ms for a
    row-wise Adagrad update of 16k ids) and works the same on GPU, where the
    racing writes are equally harmless. A running count of representatives
    then packs the `count` distinct ids into the first entries, their
    gradients summed into the same slots, so that gather, rule and scatter
    can run on those entries only (`for_distinct_rows`).

    The result has `min(len(ids), num_rows)` entries (a table has at most
    `num_rows` distinct ids). Entries from `count` on are distinct ids
    `>= num_rows` with zero gradient, which `gather` clamps and `scatter`
    drops.

    Args:
        record: the `RowGrads` (ids outside `[0, num_rows)` are ignored).
        num_rows: the table's row count.
        workspace: int32 Keras variable with at least `num_rows` entries.
    """
    n = record.ids.shape[0]
    ids = record.ids.astype(jnp.int32)
    position = jnp.arange(n, dtype=jnp.int32)
    valid = (ids >= 0) & (ids < num_rows)
    space = workspace.value
    space = space.at[jnp.where(valid, ids, space.shape[0])].set(position, mode="drop")
    workspace.assign(space)
    representative = jnp.where(valid, jnp.take(space, ids, mode="clip"), n)
    is_first = representative == position
    slot = jnp.cumsum(is_first, dtype=jnp.int32) - 1
    count = jnp.sum(is_first, dtype=jnp.int32)
    size = min(n, num_rows)
    segment = jnp.where(valid, jnp.take(slot, representative, mode="clip"), size)
    # Bag gradients are expanded here, inside the sum that consumes them.
    summed = jax.ops.segment_sum(record.rows(), segment, num_segments=size)  # drops `size`
    uniq = padding_ids(num_rows, size).at[jnp.where(is_first, slot, size)].set(ids, mode="drop")
    return Distinct(uniq, summed, count)


# Distinct rows handled per pass: gather, rule and scatter work on
# `DISTINCT_CHUNK` rows at a time, as many passes as the step has distinct
# ids, never on the (often many more) padding entries after them.
DISTINCT_CHUNK = 8192


def for_distinct_rows(update, variables, distinct):
    """Runs `update(variables, ids, grads)` on the `distinct.count` first entries only.

    `distinct` comes from `dedup`: `count` distinct ids first. They
    are taken `DISTINCT_CHUNK` at a time in a loop (one pass when they fit),
    so the work follows the step's distinct ids, with no bound that could
    lose one. `update` reads and writes `variables` (a list of objects with
    `value` and `assign`, the table first), which the loop carries.
    """
    uniq, summed, count = distinct
    n, size = uniq.shape[0], DISTINCT_CHUNK
    num_rows = variables[0].shape[0]
    pad = -n % size  # to whole chunks, with more distinct padding ids
    if n <= size or not _distinct_padding(num_rows, n + pad):
        update(variables, uniq, summed)
        return
    uniq = jnp.concatenate([uniq, padding_ids(num_rows, n + pad)[n:]])
    summed = jnp.pad(summed, ((0, pad), (0, 0)))

    def chunk(i, values):
        start = i * size
        held = [_Shard(v) for v in values]
        update(held, jax.lax.dynamic_slice_in_dim(uniq, start, size),
               jax.lax.dynamic_slice_in_dim(summed, start, size))
        return [h.value for h in held]

    trips = (count + size - 1) // size
    values = jax.lax.fori_loop(0, trips, chunk, [v.value for v in variables])
    for var, value in zip(variables, values):
        var.assign(value)


def split_by_table(distinct, offsets, sizes):
    """Each table's part of a group's `dedup`, as that table's own `dedup` result.

    `uniq` holds the distinct shifted ids table by table (then padding ids
    `>= offsets[-1]`), so a binary search finds where each table's run
    starts. Table `t` gets `sizes[t]` entries (a static bound on its distinct
    ids): its ids less `offsets[t]`, then distinct padding ids `>=` its row
    count with zero gradient, as `for_distinct_rows` takes them.

    Returns:
        A list of `Distinct`, one per table.
    """
    uniq, summed, _ = distinct
    bounds = jnp.searchsorted(uniq, jnp.asarray(offsets, uniq.dtype), side="left")
    parts = []
    for t, size in enumerate(sizes):
        start, stop = bounds[t], bounds[t + 1]
        index = start + jnp.arange(size, dtype=jnp.int32)
        mine = index < stop
        ids = jnp.where(mine, jnp.take(uniq, index, mode="clip") - offsets[t],
                        padding_ids(offsets[t + 1] - offsets[t], size))
        grads = jnp.where(mine[:, None], jnp.take(summed, index, axis=0, mode="clip"), 0.0)
        parts.append(Distinct(ids, grads, (stop - start).astype(jnp.int32)))
    return parts


def materialize(values):
    """`values`, computed before whatever uses them next.

    XLA:CPU otherwise fuses the rule's arithmetic into the scatter that
    writes its result, and runs it there one row at a time.
    """
    return jax.lax.optimization_barrier(values)


def padding_ids(num_rows, n):
    """Out-of-range ids for the `n` non-row entries of `dedup`'s result.

    Distinct (`num_rows + i`), so that the scatter can promise unique
    indices, when they fit in int32. They must: a wrapped-around negative id
    would be taken by `.at[]` as counting from the end, i.e. a real row. Near
    2**31 rows every entry gets the single id `num_rows` instead, and the
    scatter makes no uniqueness promise.
    """
    if _distinct_padding(num_rows, n):
        return num_rows + jnp.arange(n, dtype=jnp.int32)
    return jnp.full((n,), num_rows, jnp.int32)


def _distinct_padding(num_rows, n):
    return num_rows + n <= np.iinfo(np.int32).max


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

    A table split by rows over a mesh axis that also splits the batch, from
    `ROUTE_MIN_SHARDS` shards: each device asks each id's owner for its row
    (`_routed_read`). Elsewhere a gather, which XLA's partitioner splits
    (every shard reads its rows for every id; the results are summed).
    """
    value = jax.lax.stop_gradient(table.value)
    shards = row_shards(table)
    if shards is not None and ids.ndim > 0:
        mesh, axis = shards
        if mesh.shape[axis] >= ROUTE_MIN_SHARDS and _batch_axis(mesh, ids.shape[0]) == axis:
            return _routed_read(value, ids, mesh, axis)
    return gather_rows(value, ids)


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


gather_from_resource = None  # JAX reads tables through the tap (SparseLookup)


def gather(value, ids):
    return gather_rows(value, ids, mode="clip")


def gather_rows(value, ids, mode=None):
    """`value[ids]` (rows); 16-bit floats gathered as their bits (see `_as_bits`)."""
    return _as_stored(jnp.take(_as_bits(value), ids, axis=0, mode=mode), value.dtype)


def bitcast(values, dtype):
    return jax.lax.bitcast_convert_type(values, dtype)


def scatter(variable, ids, rows):
    value = variable.value
    unique = _distinct_padding(value.shape[0], ids.shape[0])
    new = _as_bits(value).at[ids].set(_as_bits(rows.astype(value.dtype)), mode="drop",
                                      unique_indices=unique)
    variable.assign(_as_stored(new, value.dtype))


# XLA:CPU has no bfloat16 scatter: it converts the whole table to float32 and
# back around it, every step (2M x 8 rows: 22 ms and 64 MB, against 0.03 ms
# in float32; float16 is native). Scattering the bits as uint16 halves that,
# but the bitcast of the whole table is still a copy (5 ms, 32 MB): on CPU a
# bfloat16 table costs one copy of itself per step (docs/semantics.md). GPUs
# scatter bfloat16 natively, in place.
def _bits_on_this_platform(dtype):
    return dtype == jnp.bfloat16 and jax.default_backend() == "cpu"


def _as_bits(value):
    if _bits_on_this_platform(value.dtype):
        return jax.lax.bitcast_convert_type(value, jnp.uint16)
    return value


def _as_stored(bits, dtype):
    return jax.lax.bitcast_convert_type(bits, dtype) if _bits_on_this_platform(dtype) else bits


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


@functools.partial(jax.jit, donate_argnums=0)
def _put_rows(out, block, start):
    return jax.lax.dynamic_update_slice_in_dim(out, block.astype(out.dtype), start, axis=0)


def row_shards(variable):
    """`(mesh, axis)` if `variable`'s rows are split over one mesh axis.

    None otherwise (one device, replicated, split by columns): then the
    update is left to XLA's partitioner, which is also correct. (JAX places
    arrays only in equal blocks, so the split is even.)
    """
    # A keras.distribution TensorLayout (the state is laid out like it).
    sharding = getattr(compat.layout_of(variable), "backend_layout", None)
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return None
    spec = tuple(sharding.spec)
    axis = spec[0] if spec else None
    if not isinstance(axis, str) or any(s is not None for s in spec[1:]):
        return None
    return sharding.mesh, axis


class _Shard:
    """One device's block of a variable inside `shard_map`, used as the variable."""

    def __init__(self, value):
        self.value = value

    @property
    def shape(self):
        return self.value.shape

    @property
    def dtype(self):
        return self.value.dtype

    def assign(self, value):
        self.value = value


# Owner routing: each id goes only to the shard that owns its row, in rounds
# of fixed-size buckets (`route_capacity` entries from each device to each
# shard). Each shard then dedups and updates about `ROUTE_CAPACITY` / n of the
# global batch instead of all of it: cheaper once n > ROUTE_CAPACITY, i.e.
# from 4 row shards (benchmarks/sharded.py counts it per device). Below that,
# every shard takes every id.
ROUTE_MIN_SHARDS = 4
ROUTE_CAPACITY = 2.0


def route_capacity(num_ids, shards):
    """Bucket size for `num_ids` ids over `shards` owners: `ROUTE_CAPACITY` times
    an even share, plus four standard deviations of a uniform draw (small
    batches), at most `num_ids`."""
    share = num_ids / shards
    return max(1, min(num_ids, math.ceil(ROUTE_CAPACITY * share + 4 * math.sqrt(share))))


def on_row_shards(apply, shards, updater, table, slots, record, hyper, step,
                  workspace, rounding):
    """Runs `apply` on each row shard of `table`, with the ids that shard owns.

    Two ways, the same result (`ROUTE_MIN_SHARDS`):

    - routed: where the batch is split over a mesh axis, each device sums its
      own duplicates, then sends each distinct `(id, row gradient)` only to
      the shard owning the row: an all-to-all of fixed-size buckets when rows
      and batch are split over the same axis, else its own shard's ids
      gathered over the batch axis. A step with more ids for one shard than
      a bucket holds takes several rounds, split by id value so that all of
      an id's gradients arrive in the same round: each row is still updated
      once, with the sum of all its gradients;
    - every shard receives all of the step's `(ids, grads)` (one all-gather
      of the batch's rows, never of a table) and keeps its own.

    Each shard updates its blocks of the table, its state and its dedup
    workspace in place, on its ids as local row numbers. `hyper` (the step's
    hyperparameters, `{name: scalar}`) goes to every shard whole. Ids no shard owns
    (invalid) are dropped. Stochastic rounding keys its bits by global row
    (`rounding.at_offset`).
    """
    mesh, axis = shards
    n, rows = mesh.shape[axis], table.shape[0] // mesh.shape[axis]
    names = sorted(slots)
    ids, grads = record.ids, record.rows()
    batch_axis = _batch_axis(mesh, ids.shape[0])
    route = batch_axis is not None and n >= ROUTE_MIN_SHARDS

    def update(values, local_ids, local_grads, hyper, step, start):
        block, state, space = values
        block, space = _Shard(block), _Shard(space)
        state = {name: _Shard(v) for name, v in zip(names, state)}
        applied = apply(updater, block, state, RowGrads(local_ids, local_grads), hyper, step,
                        space, rounding.at_offset(start))
        return (block.value, [state[k].value for k in names], space.value), applied

    def local(block, state, space, ids, grads, hyper, step):
        start = jax.lax.axis_index(axis) * rows
        ids = ids.astype(jnp.int32)
        values = (block, state, space)
        if not route:
            if batch_axis is not None:  # this device's part of the batch -> all of it
                ids = jax.lax.all_gather(ids, batch_axis, tiled=True)
                grads = jax.lax.all_gather(grads, batch_axis, tiled=True)
            mine = (ids >= start) & (ids < start + rows)
            values, applied = update(values, jnp.where(mine, ids - start, -1), grads,
                                     hyper, step, start)
        else:
            values, applied = _routed(update, values, ids, grads, hyper, step, start,
                                      mesh, axis, batch_axis, rows)
        return (*values, applied)

    split, whole = jax.sharding.PartitionSpec(axis), jax.sharding.PartitionSpec()
    batch = jax.sharding.PartitionSpec(batch_axis) if batch_axis is not None else whole
    new_table, new_state, new_space, applied = jax.shard_map(
        local, mesh=mesh,
        in_specs=(split, [split] * len(names), split, batch, batch, whole, whole),
        out_specs=(split, [split] * len(names), split, whole), check_vma=False,
    )(table.value, [slots[n].value for n in names], workspace.value, ids, grads,
      hyper, step)
    table.assign(new_table)
    for name, value in zip(names, new_state):
        slots[name].assign(value)
    workspace.assign(new_space)
    return applied


def _batch_axis(mesh, num_ids):
    """The mesh axis the active distribution splits batches over, if the step's
    `num_ids` ids split evenly over it (then each device starts with its part)."""
    import keras

    name = getattr(keras.distribution.distribution(), "batch_dim_name", None)
    if name not in mesh.axis_names or num_ids % mesh.shape[name]:
        return None
    return name


_NO_ID = np.iinfo(np.int32).max  # sorts after every row; never sent


def _owner_runs(keys, first_row, owners, rows):
    """A device's distinct ids, ascending, and where each owner's run of them lies.

    Args:
        keys: int32 `[m]` ids, `_NO_ID` for those not to send.
        first_row: the first row of the first owner.
        owners: how many consecutive blocks of `rows` rows to split into.

    Returns:
        `(order, segment, distinct, begin, end)`: the stable sorting order of
        `keys`, each sorted key's entry in `distinct` (`[m]`, padded with
        `_NO_ID`), and each owner's run `[begin, end)` in `distinct`.
    """
    order = jnp.argsort(keys, stable=True)
    ordered = keys[order]
    first = jnp.concatenate([jnp.ones((1,), bool), ordered[1:] != ordered[:-1]])
    segment = jnp.cumsum(first, dtype=jnp.int32) - 1
    distinct = jnp.full(keys.shape, _NO_ID, jnp.int32).at[segment].set(ordered)
    bounds = first_row + jnp.arange(owners + 1, dtype=jnp.int32) * rows
    edge = jnp.searchsorted(distinct, bounds, side="left").astype(jnp.int32)
    return order, segment, distinct, edge[:-1], edge[1:]


def _routed(update, values, ids, grads, hyper, step, start, mesh, axis, batch_axis,
            rows):
    """The routed way of `on_row_shards`, inside `shard_map`: `(values, applied)`.

    `batch_axis` (not None) splits the batch; `axis` splits the rows.
    """
    n = mesh.shape[axis]
    same_axis = batch_axis == axis
    owners = n if same_axis else 1  # the shards this device sends to
    # This device's distinct ids (ascending: each owner's ids form one run)
    # and the sum of each one's gradients, in order of occurrence.
    valid = (ids >= 0) & (ids < n * rows)
    if not same_axis:
        valid &= (ids >= start) & (ids < start + rows)
    order, segment, distinct, begin, end = _owner_runs(
        jnp.where(valid, ids, _NO_ID), (0 if same_axis else start), owners, rows)
    summed = jax.ops.segment_sum(grads[order].astype(jnp.float32), segment,
                                 num_segments=ids.shape[0])
    capacity = route_capacity(ids.shape[0], n)
    # All of a step's gradients must be applied or none (a non-finite one skips it).
    finite = jax.lax.pmin(jnp.all(jnp.isfinite(summed)).astype(jnp.int32),
                          tuple(mesh.axis_names)) > 0
    slot = jnp.arange(capacity, dtype=jnp.int32)

    def round_(carry):
        values, sent, applied, _ = carry
        position = begin[:, None] + sent[:, None] + slot[None, :]  # [owners, capacity]
        in_run = position < end[:, None]
        candidate = jnp.where(in_run, jnp.take(distinct, position, mode="clip"), _NO_ID)
        # This round takes, for each owner, the ids below the smallest "next
        # id after a full bucket" over all senders: the same ids everywhere
        # go in the same round, and no bucket overflows.
        after = begin + sent + capacity
        limit = jnp.where(after < end, jnp.take(distinct, after, mode="clip"), _NO_ID)
        limit = jax.lax.pmin(limit, batch_axis)  # over the devices that send
        take = in_run & (candidate < limit[:, None])
        send_ids = jnp.where(take, candidate, -1)
        send_grads = jnp.where(take[..., None], jnp.take(summed, position, axis=0, mode="clip"),
                               0.0)
        if same_axis:
            got_ids = jax.lax.all_to_all(send_ids, axis, 0, 0)
            got_grads = jax.lax.all_to_all(send_grads, axis, 0, 0)
        else:
            got_ids = jax.lax.all_gather(send_ids, batch_axis, tiled=True)
            got_grads = jax.lax.all_gather(send_grads, batch_axis, tiled=True)
        got_ids = got_ids.reshape(-1)
        local = jnp.where(got_ids >= 0, got_ids - start, -1)
        values, ok = update(values, local, got_grads.reshape(local.shape[0], -1),
                            hyper, step, start)
        sent = sent + jnp.sum(take, axis=1, dtype=jnp.int32)
        more = jax.lax.pmax(jnp.any(begin + sent < end).astype(jnp.int32),
                            tuple(mesh.axis_names)) > 0
        return values, sent, applied & ok, more

    def again(carry):
        return carry[3]

    sent = jnp.zeros((owners,), jnp.int32)
    values, _, applied, _ = jax.lax.while_loop(
        again, round_, (values, sent, finite, finite))
    return values, applied


def _routed_read(value, ids, mesh, axis):
    """`value[ids]` where `value`'s rows and the batch are split over `axis`.

    Each device takes its part of the batch, dedups its ids (sorted, so
    each owner's ids form one run) and sends each owner at most
    `route_capacity` of them per round (an all-to-all of `[n, capacity]`
    ids); each owner gathers those rows from its block and sends them back
    (an all-to-all of `[n, capacity, width]` rows). More ids for one owner
    than a bucket holds take more rounds. Each device then spreads its
    distinct rows back over its ids. Invalid ids read zeros.
    """
    n = mesh.shape[axis]
    rows, width = value.shape[0] // n, value.shape[1]

    def local(block, ids):
        flat = ids.reshape(-1).astype(jnp.int32)
        m = flat.shape[0]
        start = jax.lax.axis_index(axis) * rows
        order, segment, distinct, begin, end = _owner_runs(
            jnp.where((flat >= 0) & (flat < n * rows), flat, _NO_ID), 0, n, rows)
        which = jnp.zeros((m,), jnp.int32).at[order].set(segment)  # each id's distinct entry
        capacity = route_capacity(m, n)
        slot = jnp.arange(capacity, dtype=jnp.int32)

        def round_(carry):
            found, sent, _ = carry
            position = begin[:, None] + sent[:, None] + slot[None, :]  # [owners, capacity]
            take = position < end[:, None]
            asked = jax.lax.all_to_all(
                jnp.where(take, jnp.take(distinct, position, mode="clip"), -1), axis, 0, 0)
            mine = gather_rows(block, jnp.where(asked >= 0, asked - start, 0).reshape(-1),
                               mode="clip").reshape(n, capacity, width)
            mine = jnp.where((asked >= 0)[..., None], mine, jnp.zeros((), block.dtype))
            back = jax.lax.all_to_all(mine, axis, 0, 0)
            found = found.at[jnp.where(take, position, m)].set(back, mode="drop")
            sent = sent + jnp.sum(take, axis=1, dtype=jnp.int32)
            more = jax.lax.pmax(jnp.any(begin + sent < end).astype(jnp.int32), axis) > 0
            return found, sent, more

        found = jnp.zeros((m, width), block.dtype)
        found, _, _ = jax.lax.while_loop(
            lambda carry: carry[2], round_,
            (found, jnp.zeros((n,), jnp.int32), jnp.array(True)))
        return found[which].reshape(ids.shape + (width,))

    spec = jax.sharding.PartitionSpec(axis)
    return jax.shard_map(local, mesh=mesh, in_specs=(spec, spec), out_specs=spec,
                         check_vma=False)(value, ids)


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


def trace_forward(model, batch):
    """Traces `model` on `batch`'s shapes without computing or changing anything.

    What lets each `SparseLookup` see how many ids a step looks up before
    the train step is traced (gradient accumulation sizes its buffers by it).
    """
    import keras

    x, _, _ = keras.utils.unpack_x_y_sample_weight(batch)
    spec = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(tuple(a.shape), a.dtype), x)
    with keras.StatelessScope():
        jax.eval_shape(lambda x: model(x, training=True), spec)


def native_step(updater, table, slots, record, values, step, workspace, rounding):
    """None: no native kernel replaces dedup, sums and writes on JAX (yet)."""
    return None


def fused_apply(updater, table, slots, distinct, values, finite):
    """XLA fuses gather, rule and scatter itself: there is no kernel to call."""
    return False
