"""JAX: the distinct keys of a batch in the order first seen, in a scratch hash table.

XLA:CPU sorts 16,384 ids with their positions in about 4 ms, and scatters
them in 0.1 ms; so instead of sorting, the keys are deduped by open
addressing over `2 N` scratch slots, built afresh each call (batch-sized
work, never sized by a table).
"""

import jax
import jax.numpy as jnp
import numpy as np

from sparseopt.hashing import mix32


def _slot_hash(high, low):
    """A uint32 hash of key pairs (murmur3's finalizer), for the scratch table only."""
    return mix32(mix32(high.astype(jnp.uint32) + np.uint32(0x5DEECE66)) * np.uint32(0x9E3779B9)
                 ^ low.astype(jnp.uint32))


def first_occurrences(high, low, active):
    # Rounds of linear probing: every entry still looking claims its slot if
    # it is free (the first of them by position wins it); an entry whose key
    # holds its slot is done (all entries of a key probe together, so the
    # key's first entry is the one that claimed); the others move on. At most
    # half the slots are held, so the rounds end after the longest probe run.
    n = high.shape[0]
    size = 2 * max(n, 1)
    index = jnp.arange(n, dtype=jnp.int32)
    slot = (_slot_hash(high, low) % np.uint32(size)).astype(jnp.int32)
    free_slot = np.int32(n)  # an owner is a position, or n

    def probe(state):
        slot, first, owner = state
        waiting = first < 0
        claiming = waiting & (owner[slot] == free_slot)
        owner = owner.at[jnp.where(claiming, slot, size)].min(index, mode="drop")
        held = jnp.minimum(owner[slot], n - 1)
        same = (high[held] == high) & (low[held] == low)
        first = jnp.where(waiting & same, held, first)
        slot = jnp.where(waiting & ~same, (slot + 1) % size, slot)
        return slot, first, owner

    start = (slot, jnp.where(active, -1, index), jnp.full((size,), free_slot, jnp.int32))
    return jax.lax.while_loop(lambda s: jnp.any(s[1] < 0), probe, start)[1]


def first_true(mask, k):
    return jnp.nonzero(mask, size=k, fill_value=-1)[0].astype(jnp.int32)
