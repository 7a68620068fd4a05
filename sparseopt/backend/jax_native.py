"""JAX: the native kernels' calls (`sparseopt.native`), where they replace the pure path.

`dedup` is `jax.py`'s `dedup` as one XLA FFI custom call: the same `Distinct`
and the same workspace entries, bit for bit, with no segment sum over an
`[ids, width]` buffer. The workspace is aliased to the call's output:
written in place. `take_rows` and `put_rows` are `jax_rows.gather` and
`jax_rows.set_rows` of any array, byte for byte, the writes in place (for
bfloat16 arrays too, which XLA:CPU would copy around its scatter).
"""

import jax
import jax.numpy as jnp
import numpy as np

from sparseopt import native
from sparseopt.backend import jax_sharding
from sparseopt.records import BagGrads, Distinct


def applies(workspace):
    """Whether the native dedup runs for a table with `workspace`: kernels on, JAX on
    CPU, and the workspace on one device (a custom call on an array split or
    replicated over a mesh would be computed on a whole copy)."""
    return (native.enabled("dedup") and jax.default_backend() == "cpu"
            and jax_sharding.row_shards(workspace) is None
            and jax_sharding.replicated_on_mesh_of(workspace) is None)


def moves_rows():
    """Whether a step's row reads and writes run natively (`rows.cc`): kernels on, JAX
    on CPU, no `keras.distribution` placing arrays (a custom call on an array split
    or replicated over a mesh would be computed on a whole copy)."""
    import keras

    return (native.enabled("rows") and jax.default_backend() == "cpu"
            and keras.distribution.distribution() is None)


def take_rows(value, ids):
    """`jnp.take(value, ids, axis=0, mode="clip")` by the native call (any dtype)."""
    ids = ids.astype(jnp.int32).reshape(-1)
    return jax.ffi.ffi_call("sparseopt_take_rows",
                            jax.ShapeDtypeStruct((ids.shape[0],) + value.shape[1:], value.dtype),
                            vmap_method="sequential")(value, ids)


def put_rows(value, ids, rows):
    """`value.at[ids].set(rows, mode="drop")` by the native call, in place (any dtype)."""
    return jax.ffi.ffi_call("sparseopt_put_rows", jax.ShapeDtypeStruct(value.shape, value.dtype),
                            input_output_aliases={0: 0}, vmap_method="sequential")(
        value, ids.astype(jnp.int32).reshape(-1), rows.astype(value.dtype))


def number_ids(ids, num_rows):
    """A table on disk's step ids numbered by the native FFI call (`number_ffi.cc`: the
    host library's numbering, in the compiled step, with no Python host call), or None
    where it does not run: kernels off or not built, JAX not on CPU (the call is the
    host's), or a `keras.distribution` placing arrays (a custom call on an array split
    or replicated over a mesh would be computed on a whole copy).

    Args:
        ids: int `[N]`, the step's ids (repeats and invalid ids allowed).
        num_rows: the table's rows.

    Returns:
        `(number, ids_of, positions, count)`: int32 `[N]` x 3 and an int32 scalar, as
        `sparseopt.disk.host_ops.number` gives them.
    """
    import keras

    if not (native.enabled("disk_number") and jax.default_backend() == "cpu"
            and keras.distribution.distribution() is None):
        return None
    ids = ids.astype(jnp.int32).reshape(-1)
    vector = jax.ShapeDtypeStruct(ids.shape, jnp.int32)
    return tuple(jax.ffi.ffi_call(
        "sparseopt_number_ids", (vector, vector, vector, jax.ShapeDtypeStruct((), jnp.int32)),
        vmap_method="sequential")(ids, num_rows=np.int64(num_rows)))


def writes_bf16():
    """Whether bfloat16 row writes run natively (kernels on; JAX on CPU, where XLA has no
    bfloat16 scatter)."""
    return native.enabled("bf16_writes") and jax.default_backend() == "cpu"


def dedup(record, num_rows, workspace):
    """`jax.dedup` by the native kernel (`dedup_sum.cc`)."""
    ids = record.ids.astype(jnp.int32).reshape(-1)
    n = ids.shape[0]
    size = min(n, num_rows)
    grads = record.grads
    space = workspace.value
    out = (jax.ShapeDtypeStruct((size,), jnp.int32),
           jax.ShapeDtypeStruct((size, _width(grads)), jnp.float32),
           jax.ShapeDtypeStruct((), jnp.int32),
           jax.ShapeDtypeStruct(space.shape, space.dtype))
    if isinstance(grads, BagGrads):
        inputs = (ids, grads.values.astype(jnp.float32), grads.bag.astype(jnp.int32),
                  grads.weight.astype(jnp.float32), space)
        target, alias = "sparseopt_dedup_sum_bags", {4: 3}
    else:
        inputs = (ids, grads.astype(jnp.float32), space)
        target, alias = "sparseopt_dedup_sum", {2: 3}
    uniq, summed, count, space = jax.ffi.ffi_call(
        target, out, input_output_aliases=alias, vmap_method="sequential")(
            *inputs, num_rows=int(num_rows))
    workspace.assign(space)
    return Distinct(uniq, summed, count)


def _width(grads):
    return (grads.values if isinstance(grads, BagGrads) else grads).shape[-1]
