"""JAX: host calls from a compiled step, for tables kept in files (`sparseopt.disk`).

Reads are `jax.pure_callback`s: they write nothing, and the rows they read
feed the step, so each runs before the step's writes that depend on it.
Writes are ordered `io_callback`s: JAX threads one token through every
ordered effect, across steps too, so a step's writes are done before the
next step's reads start (its inputs are the previous step's outputs).
"""

import jax
import jax.numpy as jnp
from jax.experimental import io_callback


def host_read(fn, args, outputs):
    specs = tuple(jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))
                  for shape, dtype in outputs)
    return tuple(jax.pure_callback(fn, specs, *args, vmap_method="sequential"))


def host_write(fn, args):
    def run(*arrays):
        fn(*arrays)

    io_callback(run, None, *args, ordered=True)
HOST_CALLS_COMPILE = True  # (callbacks are part of the compiled program)
