"""The rows a step gave to new keys, held from the optimizer's step to the next lookup.

The optimizer decides (a skipped step gives nothing); the layer's next call
writes them into its map. On JAX the optimizer step can write only trainable
and optimizer variables, so the hand-over is a small float32 array of the
layer: each integer is stored as two 16-bit halves, which float32 holds
exactly.
"""

from typing import Any, NamedTuple

from keras import ops

from sparseopt.halves import join_halves, split_halves

FIELDS = 12  # high, low, row, step, sightings: two halves each; evicted; valid


class Entries(NamedTuple):
    """The hand-over's entries, int32 `[A]` each (bool `evicted`, `valid`)."""

    high: Any
    low: Any
    rows: Any
    step: Any
    evicted: Any
    valid: Any
    sightings: Any


def encode(high, low, rows, step, evicted, valid, sightings, size):
    """float32 `[size, FIELDS]` of `M <= size` entries (int32 `[M]` halves, rows, a scalar
    step; bool `[M]` evicted and valid; int32 `[M]` the ids' sightings in their step),
    padded with entries that are not valid."""
    step = ops.broadcast_to(ops.cast(step, "int32"), ops.shape(rows))
    columns = (split_halves(high) + split_halves(low) + split_halves(rows) + split_halves(step)
               + [ops.cast(evicted, "float32"), ops.cast(valid, "float32")]
               + split_halves(sightings))
    entries = ops.stack(columns, axis=1)
    if entries.shape[0] == size:
        return entries
    return ops.pad(entries, [[0, size - ops.shape(entries)[0]], [0, 0]])


def decode(values):
    """The `Entries` of an `encode`d array."""
    c = [values[:, i] for i in range(FIELDS)]
    return Entries(join_halves(c[0], c[1]), join_halves(c[2], c[3]), join_halves(c[4], c[5]),
                   join_halves(c[6], c[7]), ops.greater(c[8], 0.5), ops.greater(c[9], 0.5),
                   join_halves(c[10], c[11]))
