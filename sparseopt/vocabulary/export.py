"""An open vocabulary read whole, for export: which ids hold which rows, and what changed.

Between steps (serving, checkpoints of a delta): the map as the next lookup
sees it (the last step's hand-over written), the ids alive in it, and
`delta(since)`: the ids whose rows may have changed after a layer step, their
rows and values, and the ids gone since (`Delta`).
"""

from typing import Any, NamedTuple

import numpy as np
from keras import ops

from sparseopt import backend
from sparseopt.vocabulary import keys, pending


class Delta(NamedTuple):
    """What changed in an open vocabulary after a step (`DynamicEmbedding.delta`).

    Args:
        step: the layer's step it is up to date with (ask for the next delta
            after it).
        ids: int64 `[K]` ids holding a row whose values may have changed
            (given the row, or looked up in training, after the step).
        rows: int64 `[K]` their rows.
        values: float32 `[K, D]` those rows of the table.
        tombstones: int64 `[T]` ids that lost their row after the step
            (taken by another id, or expired), none of which holds a row
            now; an id may be repeated from an earlier delta.
        default: float32 `[D]`, what ids not held read now (the trained
            default row, or zeros).
    """

    step: int
    ids: Any
    rows: Any
    values: Any
    tombstones: Any
    default: Any


def as_next_lookup_sees_it(vocabulary):
    """NumPy `(keys [V, 2], last_seen [V], step, hand-over)`: the map with the last
    step's hand-over written (it reads the whole map: for export)."""
    held = np.array(ops.convert_to_numpy(vocabulary.keys.value))
    seen = np.array(ops.convert_to_numpy(vocabulary.last_seen.value))
    high, low, rows, step, _, valid, _ = (np.asarray(ops.convert_to_numpy(x))
                                          for x in pending.decode(vocabulary.pending.value))
    given = (high[valid], low[valid], rows[valid], step[valid])
    before = held[given[2]].copy(), seen[given[2]].copy()
    held[given[2], 0], held[given[2], 1] = given[0], given[1]
    seen[given[2]] = np.maximum(seen[given[2]], given[3])
    now = int(ops.convert_to_numpy(vocabulary.steps.value))
    return held, seen, now, (given, before)


def alive(vocabulary, seen, now):
    """Whether each row holds a live id (held, and not expired at step `now`)."""
    live = seen >= 0
    if vocabulary.ttl is not None:
        live &= seen > now - vocabulary.ttl
    return live


def ids(vocabulary):
    """`{id: row}` of every id holding a row, as the next lookup sees them (NumPy,
    reading the whole map: for export)."""
    held, seen, now, _ = as_next_lookup_sees_it(vocabulary)
    rows = np.nonzero(alive(vocabulary, seen, now))[0]
    return dict(zip(keys.join_int64(held[rows]).tolist(), rows.tolist()))


def delta(vocabulary, since, table, name, trained_default=False):
    """What changed after layer step `since`: see `DynamicEmbedding.delta`."""
    held, seen, now, ((high, low, rows, step), (old, old_seen)) = (
        as_next_lookup_sees_it(vocabulary))
    live = alive(vocabulary, seen, now)
    changed = np.nonzero(live & (seen > since))[0]
    gone = [vocabulary.tombstones.since(since, name)]
    # Ids the hand-over replaces (not in the log until the next call writes it).
    replacing = (old_seen >= 0) & ~((old[:, 0] == high) & (old[:, 1] == low)) & (step > since)
    gone.append(old[replacing])
    if vocabulary.ttl is not None:  # ids that expired after `since`, still in their rows
        expired = (seen >= 0) & ~live & (seen + vocabulary.ttl > since)
        gone.append(held[expired])
    gone = np.setdiff1d(keys.join_int64(np.concatenate(gone)),
                        keys.join_int64(held[live]))
    # (An int8 table's layer hands over a reader of its rows as floats.)
    read = getattr(table, "rows", None) or (
        lambda ids: backend.gather_from_resource(table, ids))
    values = np.asarray(ops.convert_to_numpy(ops.cast(
        read(ops.convert_to_tensor(changed.astype("int32"))), "float32")))
    default = np.zeros((table.shape[1],), np.float32)
    if trained_default:  # the table's last row
        default = np.asarray(ops.convert_to_numpy(ops.cast(
            read(ops.convert_to_tensor([vocabulary.capacity])), "float32")))[0]
    return Delta(step=now, ids=keys.join_int64(held[changed]), rows=changed.astype(np.int64),
                 values=values, tombstones=gone, default=default)
