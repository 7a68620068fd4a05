"""The id -> row map of an open vocabulary: open addressing over the table's own rows.

Row `r` of the table holds at most one key: `keys[r]` (its `(high, low)`
halves) and `last_seen[r]`, the step it was last looked up in training
(`EMPTY` when no key holds it). A key may live only in its window: the
`probes` rows from its home row (`keys.home_rows`) on, wrapping around.
So a lookup reads `probes` entries per id, never more; two keys never share
a row (a key is placed only where it was not found, in a row no other key
holds or one whose key is evicted); and a row's identity is its index, so
the table, its optimizer state and the map stay aligned.

Every function here writes nothing (`keras.ops` plus `backend.lexsort`,
reading the map's variables only by gathers: never a copy of the whole),
and is sized by the batch's ids times `probes`, never by the table.
"""

import numpy as np
from keras import ops

from sparseopt import backend

EMPTY = -1  # last_seen of a row no key holds
_FAR = np.int32(np.iinfo(np.int32).max)


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
    rows = window(home, probes, keys.shape[0])
    flat = ops.reshape(rows, (-1,))
    held = ops.reshape(backend.gather_from_resource(keys, flat), (-1, probes, 2))
    alive = live(ops.reshape(backend.gather_from_resource(last_seen, flat), (-1, probes)),
                 step, ttl)
    match = ops.logical_and(
        ops.logical_and(ops.equal(held[..., 0], ops.expand_dims(high, 1)),
                        ops.equal(held[..., 1], ops.expand_dims(low, 1))), alive)
    first = ops.argmax(ops.cast(match, "int32"), axis=1)
    row = ops.take_along_axis(rows, ops.expand_dims(first, 1), axis=1)[:, 0]
    return ops.where(ops.any(match, axis=1), row, -1)


def distinct_missing(high, low, missing):
    """The distinct keys among those `missing`, each with its number of occurrences.

    Returns:
        `(high, low, occurrences, is_first)`, each `[N]`: the keys in sorted
        order (`backend.lexsort`), occurrences of each sorted entry's key
        among the missing ones, and whether the entry is its key's first
        (the distinct missing keys are those entries).
    """
    order = backend.lexsort([ops.cast(ops.logical_not(missing), "int32"), high, low])
    high, low = ops.take(high, order), ops.take(low, order)
    missing = ops.take(missing, order)
    same = ops.logical_and(ops.equal(high[1:], high[:-1]), ops.equal(low[1:], low[:-1]))
    same = ops.logical_and(same, missing[1:])
    is_first = ops.logical_and(
        missing, ops.concatenate([ops.ones((1,), "bool"), ops.logical_not(same)], axis=0))
    run = ops.cumsum(ops.cast(is_first, "int32")) - 1
    run = ops.where(missing, run, 0)
    counts = ops.segment_sum(ops.cast(missing, "int32"), run,
                             num_segments=ops.shape(high)[0])
    return high, low, ops.take(counts, run), is_first


def place(last_seen, home, wanted, probes, step, evict, ttl, rounds):
    """Rows for the keys `wanted`: in each key's window, a free row, else one to evict.

    A row is free when no key holds it (or its key expired, `ttl`); where
    `evict == "lru"` and a window has no free row, its least recently seen
    row is taken, unless it was seen in this step. Keys that want the same
    row go in order (the first wins; the others try their next best row in
    the next round). After `rounds` rounds, keys still without a row get
    none this step.

    Args:
        last_seen: the int32 `[V]` last-seen steps variable, with this
            step's lookups already marked (so that their rows are never taken).
        home: int32 `[C]` home rows of the candidate keys.
        wanted: bool `[C]`, which candidates to place.
        probes, step, ttl: as for `find`.
        evict: `"lru"` or `"none"`.
        rounds: placement rounds.

    Returns:
        `(rows, evicted)`: int32 `[C]` rows (-1: not placed) and bool `[C]`,
        whether the row taken held a live key.
    """
    capacity = last_seen.shape[0]
    rows = window(home, probes, capacity)
    seen = ops.reshape(backend.gather_from_resource(last_seen, ops.reshape(rows, (-1,))),
                       (-1, probes))
    alive = live(seen, step, ttl)
    # Lower is better: a free row (-1), else the oldest (lru); unusable: _FAR.
    score = ops.where(alive, seen, -1)
    usable = ops.logical_not(alive)
    if evict == "lru":
        usable = ops.logical_or(usable, ops.less(seen, step))
    score = ops.where(usable, score, _FAR)
    placed = ops.full(ops.shape(home), -1, "int32")
    pending = wanted
    for round_ in range(rounds):
        if round_:  # (nothing is taken before the first round)
            score = ops.where(_taken(rows, placed), _FAR, score)
        pick = ops.argmin(score, axis=1)
        best = ops.take_along_axis(score, ops.expand_dims(pick, 1), axis=1)[:, 0]
        row = ops.take_along_axis(rows, ops.expand_dims(pick, 1), axis=1)[:, 0]
        trying = ops.logical_and(pending, ops.less(best, _FAR))
        # The first candidate (in order) of each row wins it.
        order = backend.lexsort([ops.cast(ops.logical_not(trying), "int32"),
                                 ops.where(trying, row, 0)])  # stable: index order in a tie
        row_s, trying_s = ops.take(row, order), ops.take(trying, order)
        new = ops.concatenate([ops.ones((1,), "bool"),
                               ops.not_equal(row_s[1:], row_s[:-1])], axis=0)
        wins_s = ops.logical_and(trying_s, new)
        # Back to candidate order (`order` is a permutation: each entry once).
        wins = ops.greater(ops.scatter(ops.expand_dims(order, 1), ops.cast(wins_s, "int32"),
                                       ops.shape(wins_s)), 0)
        placed = ops.where(wins, row, placed)
        pending = ops.logical_and(pending, ops.logical_not(wins))
    got = ops.greater_equal(placed, 0)
    return placed, ops.logical_and(got, _at_placed(rows, alive, placed))


def _taken(rows, placed):
    """bool `[C, probes]`: whether each window row is one of the `placed` rows."""
    sorted_rows = ops.sort(ops.where(ops.greater_equal(placed, 0), placed, _FAR))
    flat = ops.reshape(rows, (-1,))
    at = ops.minimum(ops.cast(ops.searchsorted(sorted_rows, flat), "int32"),
                     ops.shape(sorted_rows)[0] - 1)
    return ops.reshape(ops.equal(ops.take(sorted_rows, at), flat), ops.shape(rows))


def _at_placed(rows, values, placed):
    """`values[c, j]` where `rows[c, j] == placed[c]` (False where not placed)."""
    here = ops.equal(rows, ops.expand_dims(placed, 1))
    return ops.any(ops.logical_and(here, values), axis=1)
