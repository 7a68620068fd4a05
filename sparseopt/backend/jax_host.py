"""JAX: host calls from a compiled step, for tables kept in files (`sparseopt.disk`).

Reads and writes are both ordered `io_callback`s: JAX threads one token
through every ordered effect of a program, in program order, and from one
program to the next, so a step's lookups read before its update writes and
after the previous step's (a `pure_callback` read would not be: it depends
on the ids only, and XLA may run it after a write where the gradients do
not need the rows, e.g. a loss linear in them, leaving the logged loss to
see updated rows).
"""

import jax
import jax.numpy as jnp
from jax.experimental import io_callback

HOST_CALLS_COMPILE = True  # (callbacks are part of the compiled program)


def host_read(fn, args, outputs):
    """`fn(*arrays)` on the host: a tuple of arrays of `outputs`' `(shape, dtype)`s.

    Args:
        fn: NumPy arrays in, a tuple of NumPy arrays out; writes nothing.
        args: its array arguments.
        outputs: `[(shape, dtype)]` of its results.
    """
    specs = tuple(jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))
                  for shape, dtype in outputs)
    return tuple(io_callback(fn, specs, *args, ordered=True))


def host_write(fn, args):
    """`fn(*arrays)` on the host, for its effect, in order with every host call.

    Args:
        fn: NumPy arrays in; its result is ignored.
        args: its array arguments.
    """
    def run(*arrays):
        fn(*arrays)

    io_callback(run, None, *args, ordered=True)
