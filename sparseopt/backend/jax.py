"""JAX plumbing: a custom-VJP tap, sort-based dedup and in-place scatter.

`jax.grad` cannot return a sparse gradient, so the lookup's backward pass
records `(ids, row_grads)` on the side and the optimizer consumes them later
in the same trace. Under Keras' jitted, state-donating train step the scatter
below updates the donated table buffer in place.
"""

import jax
import jax.numpy as jnp


def tap(rows, probe, ids, on_backward):
    @jax.custom_vjp
    def _tap(rows, probe, ids):
        return rows

    def _fwd(rows, probe, ids):
        return rows, ids

    def _bwd(ids, g):
        on_backward(ids, g)
        marker = jnp.where(jnp.all(jnp.isfinite(g)), 1.0, jnp.nan)
        return None, marker.astype(probe.dtype), None

    _tap.defvjp(_fwd, _bwd)
    return _tap(rows, probe, ids)


def dedup(ids, grads, num_rows):
    """Returns `(unique_ids, summed_grads)` of static length `len(ids)`.

    Padding and invalid ids come back as distinct ids `>= num_rows`, which
    `gather` clamps and `scatter` drops.
    """
    n = ids.shape[0]
    ids = jnp.where((ids >= 0) & (ids < num_rows), ids, num_rows)
    uniq, inverse = jnp.unique(ids, size=n, fill_value=num_rows, return_inverse=True)
    summed = jax.ops.segment_sum(grads, inverse.reshape(-1), num_segments=n)
    # Give every padding slot its own out-of-range id so that the scatter's
    # `unique_indices` promise holds.
    pad = num_rows + jnp.arange(n, dtype=uniq.dtype)
    uniq = jnp.where(uniq < num_rows, uniq, pad)
    return uniq, summed


def read_rows(table, ids):
    """Forward lookup of valid `ids` in a Keras variable (no gradient to it)."""
    return jnp.take(jax.lax.stop_gradient(table.value), ids, axis=0)


def gather(value, ids):
    return jnp.take(value, ids, axis=0, mode="clip")


def scatter(variable, ids, rows):
    value = variable.value
    variable.assign(
        value.at[ids].set(rows.astype(value.dtype), mode="drop", unique_indices=True)
    )
