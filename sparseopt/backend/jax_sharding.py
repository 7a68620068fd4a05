"""JAX row sharding: tables split by rows over a mesh axis, updated shard by shard,
with each id routed to the shard that owns its row.

`sparseopt.engine.plans` runs a table's update on each shard (`on_row_shards`) with the
ids that shard owns; a lookup reads each id from its owner (`routed_read`).
Other layouts are left to XLA's partitioner (`row_shards` is None for them).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

from sparseopt import compat
from sparseopt.backend.jax_rows import Held, gather_rows
from sparseopt.records import RowGrads


# keras.distribution may split a table by rows over a mesh axis.
ROW_SHARDS = True


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


# Owner routing: each id goes only to the shard that owns its row, in rounds
# of fixed-size buckets (`route_capacity` entries from each device to each
# shard). Each shard then dedups and updates about `ROUTE_CAPACITY` / n of the
# global batch instead of all of it: cheaper once n > ROUTE_CAPACITY, i.e.
# from 4 row shards (benchmarks/sharded.py counts it per device). Below that,
# every shard takes every id.
ROUTE_MIN_SHARDS = 4
ROUTE_CAPACITY = 2.0


def replicated_on_mesh_of(variable):
    """A fully replicated `NamedSharding` on the mesh of `variable`'s layout, or None
    (no `keras.distribution` layout)."""
    sharding = getattr(compat.layout_of(variable), "backend_layout", None)
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return None
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())


def route_capacity(num_ids, shards):
    """Bucket size for `num_ids` ids over `shards` owners: `ROUTE_CAPACITY` times
    an even share, plus four standard deviations of a uniform draw (small
    batches), at most `num_ids`."""
    share = num_ids / shards
    return max(1, min(num_ids, math.ceil(ROUTE_CAPACITY * share + 4 * math.sqrt(share))))


def on_row_shards(run, shards, variables, record, carried):
    """Runs `run` on each row shard of `variables`, with the ids that shard owns.

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

    `run(blocks, record, carried, first_row)` updates the shard's blocks of
    `variables` in place (stand-ins with `value` and `assign`) from the
    `RowGrads` of the ids it owns, as local row numbers, and returns whether
    it applied them. `variables` are split by rows like the table (the table,
    its per-row state, its dedup workspace); `carried` (any pytree: the
    step's hyperparameters, its count) goes to every shard whole. Ids no
    shard owns (invalid) are dropped.
    """
    mesh, axis = shards
    n, rows = mesh.shape[axis], variables[0].shape[0] // mesh.shape[axis]
    ids, grads = record.ids, record.rows()
    batch_axis = _batch_axis(mesh, ids.shape[0])
    route = batch_axis is not None and n >= ROUTE_MIN_SHARDS

    def update(values, local_ids, local_grads, carried, start):
        blocks = [Held(v) for v in values]
        applied = run(blocks, RowGrads(local_ids, local_grads), carried, start)
        return [b.value for b in blocks], applied

    def local(blocks, ids, grads, carried):
        start = jax.lax.axis_index(axis) * rows
        ids = ids.astype(jnp.int32)
        if not route:
            if batch_axis is not None:  # this device's part of the batch -> all of it
                ids = jax.lax.all_gather(ids, batch_axis, tiled=True)
                grads = jax.lax.all_gather(grads, batch_axis, tiled=True)
            mine = (ids >= start) & (ids < start + rows)
            return update(blocks, jnp.where(mine, ids - start, -1), grads, carried, start)
        return _routed(update, blocks, ids, grads, carried, start, mesh, axis, batch_axis,
                       rows)

    split, whole = jax.sharding.PartitionSpec(axis), jax.sharding.PartitionSpec()
    batch = jax.sharding.PartitionSpec(batch_axis) if batch_axis is not None else whole
    blocks, applied = jax.shard_map(
        local, mesh=mesh, in_specs=([split] * len(variables), batch, batch, whole),
        out_specs=([split] * len(variables), whole), check_vma=False,
    )([v.value for v in variables], ids, grads, carried)
    for variable, block in zip(variables, blocks):
        variable.assign(block)
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


def _routed(update, values, ids, grads, carried, start, mesh, axis, batch_axis, rows):
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
                            carried, start)
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


def routed_read(table, value, ids):
    """`value[ids]` read from each id's owner shard, or None where that does not pay.

    Where `table`'s rows are split over a mesh axis that also splits the
    batch, from `ROUTE_MIN_SHARDS` shards, each device asks each id's owner
    for its row (`_routed_read`). Elsewhere None: the caller gathers, which
    XLA's partitioner splits (every shard reads its rows for every id; the
    results are summed).

    Args:
        table: the table's Keras variable (its layout decides).
        value: its value.
        ids: int ids, any shape.
    """
    shards = row_shards(table)
    if shards is None or ids.ndim == 0:
        return None
    mesh, axis = shards
    if mesh.shape[axis] >= ROUTE_MIN_SHARDS and _batch_axis(mesh, ids.shape[0]) == axis:
        return _routed_read(value, ids, mesh, axis)
    return None
