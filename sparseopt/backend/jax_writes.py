"""JAX in-place row writes of variables: on one device, or by each row shard on its own rows.

A variable split by rows over a mesh axis (`jax_sharding.row_shards`) is
written inside `shard_map`: every shard takes the (batch-sized) ids and
values whole and writes the ones in its own rows. Left to XLA's partitioner,
a scatter with batch-split ids into a row-split variable was computed on a
whole copy of the variable on every device and combined by an all-reduce of
it: vocabulary-sized work and traffic every step. For the same reason the
ids and values written into a replicated variable under a distribution are
first made whole on every device.
"""

import functools

import jax
import jax.numpy as jnp

from sparseopt.backend import jax_native, jax_sharding
from sparseopt.backend.jax_rows import bits_on_this_platform, distinct_padding, min_rows
from sparseopt.backend.jax_rows import set_rows as pure_set_rows


def set_rows(value, ids, rows, unique=False):
    """`value` with `value[ids] = rows` (ids past the end dropped), by the native call
    where it runs (in place, one call compiled once for every array; for bfloat16 arrays
    also where only `bf16_writes` is on: XLA:CPU would copy them), else the pure path."""
    if ids.ndim == 1 and value.ndim >= 1 and (
            jax_native.moves_rows() or (bits_on_this_platform(value.dtype) and value.ndim == 2
                                        and jax_native.writes_bf16())):
        return jax_native.put_rows(value, ids, rows)
    return pure_set_rows(value, ids, rows, unique)


def scatter(variable, ids, rows):
    value = variable.value
    unique = distinct_padding(value.shape[0], ids.shape[0])
    variable.assign(_written(variable, functools.partial(set_rows, unique=unique),
                             functools.partial(set_rows, unique=False), ids, rows))


def scatter_where(variable, ids, rows, keep):
    ids = jnp.where(keep, ids, variable.shape[0])  # past the end: dropped
    variable.assign(_written(variable, set_rows, set_rows, ids, rows))


def scatter_min(variable, ids, values, keep):
    ids = jnp.where(keep, ids, variable.shape[0])  # past the end: dropped
    variable.assign(_written(variable, min_rows, min_rows, ids, values))


def _written(variable, write, write_shard, ids, values):
    """`variable`'s new value: `write(value, ids, values)`, or, where its rows are
    split, `write_shard(block, local ids, values)` on each shard (ids of other
    shards' rows dropped)."""
    value = variable.value
    shards = jax_sharding.row_shards(variable)
    if shards is None:
        whole = jax_sharding.replicated_on_mesh_of(variable)
        if whole is not None:
            # Every device writes the same (batch-sized) ids and values into its
            # copy: batch-split ids would make each device write its own and
            # combine whole copies with an all-reduce.
            ids, values = (jax.lax.with_sharding_constraint(x, whole) for x in (ids, values))
        return write(value, ids, values)
    mesh, axis = shards
    rows = value.shape[0] // mesh.shape[axis]

    def local(block, ids, values):
        here = ids - jax.lax.axis_index(axis) * rows
        here = jnp.where((here >= 0) & (here < rows), here, rows)  # not this shard's: dropped
        return write_shard(block, here, values)

    split, whole = jax.sharding.PartitionSpec(axis), jax.sharding.PartitionSpec()
    return jax.shard_map(local, mesh=mesh, in_specs=(split, whole, whole), out_specs=split,
                         check_vma=False)(value, ids, values)
