"""The id -> row map of an open vocabulary: open addressing over the table's own rows.

Row `r` of the table holds at most one key: `keys[r]` (its `(high, low)`
halves) and `last_seen[r]`, the step it was last looked up in training
(`EMPTY` when no key holds it). A key may live only in its window: the
`probes` rows from its home row (`keys.home_rows`) on, wrapping around.
So a lookup reads `probes` entries per id, never more; two keys never share
a row (a key is placed only where it was not found, in a row no other key
holds or one whose key is evicted); and a row's identity is its index, so
the table, its optimizer state and the map stay aligned.

Every function here is `keras.ops` plus the backend's in-place gathers and
scatters (never a copy of the map), sized by the batch's ids times
`probes`, never by the table; only `place` writes, and it leaves the map as
it found it.
"""

import numpy as np
from keras import ops

from sparseopt import backend

EMPTY = -1  # last_seen of a row no key holds
_FAR = np.int32(np.iinfo(np.int32).max)
# Placement's claims in `last_seen`: the first candidate's is the least, and
# every claim is below EMPTY.
_CLAIMED = np.int32(np.iinfo(np.int32).min + 1)


def window(home, probes, capacity):
    """`[N, probes]` candidate rows of keys whose home rows are `home` (`[N]`)."""
    offsets = ops.arange(probes, dtype="int32")
    return ops.mod(ops.expand_dims(home, 1) + ops.expand_dims(offsets, 0), capacity)


def live(seen, step, ttl):
    """Whether rows with last-seen steps `seen` hold a key at `step`.

    Empty rows do not; with a `ttl`, neither do rows not seen in the last
    `ttl` steps (their key has expired: a lookup misses it, and its row is
    free to take).
    """
    held = ops.greater_equal(seen, 0)
    if ttl is None:
        return held
    return ops.logical_and(held, ops.greater(seen, step - ttl))


def find(keys, last_seen, high, low, home, probes, step, ttl=None):
    """Each key's row, or -1 where the map does not hold it.

    Args:
        keys: the map's int32 `[V, 2]` keys variable.
        last_seen: its int32 `[V]` last-seen steps variable.
        high, low: int32 `[N]` halves of the keys looked up.
        home: int32 `[N]` their home rows.
        probes: the window's length.
        step: int32 scalar, the step now (for `ttl`).
        ttl: steps after which an unseen key expires, or None.

    Returns:
        int32 `[N]` rows (-1: not held).
    """
    capacity = keys.shape[0]
    flat = ops.reshape(window(home, probes, capacity), (-1,))
    held = ops.reshape(backend.gather_from_resource(keys, flat), (-1, probes, 2))
    alive = live(ops.reshape(backend.gather_from_resource(last_seen, flat), (-1, probes)),
                 step, ttl)
    match = ops.logical_and(
        ops.logical_and(ops.equal(held[..., 0], ops.expand_dims(high, 1)),
                        ops.equal(held[..., 1], ops.expand_dims(low, 1))), alive)
    row = _row(home, ops.argmax(ops.cast(match, "int32"), axis=1), capacity)
    return ops.where(ops.any(match, axis=1), row, -1)


def place(last_seen, home, wanted, probes, step, evict, ttl, rounds, frequency=None,
          guard=None):
    """Rows for the keys `wanted`: in each key's window, a free row, else one to evict.

    A row is free when no key holds it (or its key expired, `ttl`); where a
    window has no free row, `evict == "lru"` takes its least recently seen
    row and `evict == "lfu"` its least frequently seen one (`frequency`;
    ties: the one seen longest ago), never one seen at or after step
    `guard` (this step's, or, with gradient accumulation, those since the
    update cycle began: their gradients wait to be applied to them). Keys that want the same
    row go in order (the first wins; the others try their next best row,
    leaving out every row taken so far, in the next round). After `rounds`
    rounds, keys still without a row get none this step.

    Contested rows are settled in place, without sorting: each key trying a
    row writes a claim into its `last_seen` entry (`backend.scatter_min`:
    the least claim, the first key's, stays), and reads it back to learn
    whether it won. Claims are below every real entry, so later rounds see
    the rows taken; every claimed row is one a key won, and all are given
    back their last-seen step before this returns (the map is unchanged).

    Args:
        last_seen: the int32 `[V]` last-seen steps variable, with this
            step's lookups already marked (so that their rows are never taken).
        home: int32 `[C]` home rows of the candidate keys, in order.
        wanted: bool `[C]`, which candidates to place.
        probes, step, ttl: as for `find`.
        evict: `"lru"`, `"lfu"` or `"none"`.
        rounds: placement rounds.
        frequency: the rows' `frequency.Frequencies` (for `"lfu"`).
        guard: int32 scalar, the first step whose rows are never taken
            (None: `step`).

    Returns:
        `(rows, evicted)`: int32 `[C]` rows (-1: not placed) and bool `[C]`,
        whether the row taken held a live key.
    """
    capacity = last_seen.shape[0]
    offsets = ops.arange(probes, dtype="int32")
    flat = ops.reshape(window(home, probes, capacity), (-1,))
    seen = ops.reshape(backend.gather_from_resource(last_seen, flat), (-1, probes))
    alive = live(seen, step, ttl)
    # Lower is better: a free row (-1), else the oldest (lru) or the least
    # frequent (lfu); unusable: _FAR.
    if evict == "lfu":
        counts = backend.gather_from_resource(frequency.counts, flat)
        score = ops.where(alive, frequency.effective(ops.reshape(counts, (-1, probes)), seen,
                                                     step), -1)
        older = ops.where(alive, seen, -1)  # ties: the row seen longest ago
    else:
        score = ops.where(alive, seen, -1)
    usable = ops.logical_not(alive)
    if evict != "none":
        usable = ops.ones_like(usable)
    # (An expired row seen since `guard` waits too: with `ttl` below the
    # accumulation steps, its gradients are still to be applied.)
    usable = ops.logical_and(usable, ops.less(seen, step if guard is None else guard))
    score = ops.where(usable, score, _FAR)
    claim = _CLAIMED + ops.arange(ops.shape(home)[0], dtype="int32")
    placed = ops.full(ops.shape(home), -1, "int32")
    held, before = ops.zeros(ops.shape(home), "bool"), ops.zeros(ops.shape(home), "int32")
    pending = wanted
    for round_ in range(rounds):
        if round_:  # rows won in earlier rounds hold claims (nothing is taken before)
            now = ops.reshape(backend.gather_from_resource(last_seen, flat), (-1, probes))
            score = ops.where(ops.less(now, EMPTY), _FAR, score)
        best = ops.min(score, axis=1)
        if evict == "lfu":
            tied = ops.equal(score, ops.expand_dims(best, 1))
            pick = ops.cast(ops.argmin(ops.where(tied, older, _FAR), axis=1), "int32")
        else:
            pick = ops.cast(ops.argmin(score, axis=1), "int32")
        at = ops.equal(offsets, ops.expand_dims(pick, 1))  # one-hot (cheaper than a gather)
        row = _row(home, pick, capacity)
        trying = ops.logical_and(pending, ops.less(best, _FAR))
        backend.scatter_min(last_seen, row, claim, trying)
        wins = ops.logical_and(
            trying, ops.equal(backend.gather_from_resource(last_seen, row), claim))
        placed = ops.where(wins, row, placed)
        held = ops.where(wins, ops.any(ops.logical_and(at, alive), axis=1), held)
        before = ops.where(wins, ops.sum(ops.where(at, seen, 0), axis=1), before)
        pending = ops.logical_and(pending, ops.logical_not(wins))
    got = ops.greater_equal(placed, 0)
    backend.scatter_where(last_seen, ops.maximum(placed, 0), before, got)
    return placed, ops.logical_and(got, held)


def _row(home, offset, capacity):
    """The row `offset` rows into the windows at `home` (int32 `[N]` each)."""
    return ops.mod(home + ops.cast(offset, "int32"), capacity)
