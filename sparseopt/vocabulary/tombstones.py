"""The ids that lost their row, for serving systems that follow training (`delta`).

When the hand-over gives a row to a new id, the id it held before (live or
expired) is written into a ring of `size` entries, `(high, low, step)`
each (12 bytes an entry), with the layer step it was replaced in. A reader
asks for the ids replaced after a step; if the ring has wrapped past
entries that may be newer than that step, it says so instead of answering
short.
"""

import numpy as np
from keras import ops

from sparseopt import backend


class TombstoneLog:
    """A ring of the ids replaced in the map, with their steps.

    Args:
        size: entries kept (at least one step's admissions: the
            vocabulary's `admissions_per_step`, or its capacity if smaller,
            so one step never wraps onto itself).
    """

    def __init__(self, size):
        self.size = int(size)

    def build(self, add_state):
        """Creates the variables (`add_state` as for `OpenVocabulary.build`)."""
        self.log = add_state("vocabulary_tombstones", (self.size, 3), "int32", -1, False)
        # The next entry to write, and whether the ring has been round once.
        self.cursor = add_state("vocabulary_tombstone_cursor", (), "int32", 0, False)
        self.wrapped = add_state("vocabulary_tombstones_wrapped", (), "int32", 0, False)

    @property
    def variables(self):
        return [self.log, self.cursor, self.wrapped]

    def record(self, high, low, step, replaced):
        """Writes the ids where `replaced` (int32 `[A]` halves and steps, bool `[A]`)."""
        at = self.cursor.value + ops.cumsum(ops.cast(replaced, "int32")) - 1
        backend.scatter_where(self.log, ops.mod(at, self.size),
                              ops.stack([high, low, step], axis=1), replaced)
        end = self.cursor.value + ops.sum(ops.cast(replaced, "int32"))
        self.wrapped.assign(ops.maximum(self.wrapped.value,
                                        ops.cast(ops.greater_equal(end, self.size), "int32")))
        self.cursor.assign(ops.mod(end, self.size))

    def since(self, step, name):
        """int32 `[K, 2]` halves of the ids replaced after `step` (NumPy).

        Raises:
            ValueError: entries newer than `step` may have been overwritten.
        """
        log = np.asarray(ops.convert_to_numpy(self.log.value))
        cursor = int(ops.convert_to_numpy(self.cursor.value))
        if int(ops.convert_to_numpy(self.wrapped.value)):
            oldest = int(log[cursor, 2])  # every entry overwritten is no newer than it
            if oldest > step:
                raise ValueError(
                    f"DynamicEmbedding '{name}': the tombstone log ({self.size} entries) holds "
                    f"ids replaced from step {oldest} on, so some replaced after step {step} "
                    "are lost. Export the whole map (`held_ids()`) instead, or ask for deltas "
                    "more often or with a larger `tombstone_log`.")
        else:
            log = log[:cursor]
        return log[log[:, 2] > step, :2]


def resized(log, cursor, wrapped, size):
    """A ring's saved values `(log [S, 3], cursor, wrapped)` as a ring of `size` entries.

    For files written with another size (files written before 2026-11-26 sized every
    ring 65,536 by default; now `capacity`): the newest `size` entries are
    kept, in order, and where older ones are dropped the ring says it has
    wrapped, so `since` refuses a step they would have answered. NumPy.

    Raises:
        ValueError: the saved ring had wrapped and is smaller than `size`
            (what it lost cannot be marked in a ring that is not full).
    """
    log = np.asarray(log)
    cursor, wrapped = int(cursor), int(wrapped)
    entries = np.concatenate([log[cursor:], log[:cursor]]) if wrapped else log[:cursor]
    kept = entries[-size:]
    lost = bool(wrapped) or len(entries) > size
    if lost and len(kept) < size:
        raise ValueError(f"the file's tombstone log ({len(log)} entries) has wrapped; it "
                         f"cannot become a log of {size} entries. Build the layer with "
                         f"`tombstone_log={len(log)}` to load it.")
    out = np.full((size, 3), -1, log.dtype)
    out[:len(kept)] = kept
    return out, np.asarray(len(kept) % size, "int32"), np.asarray(
        int(lost or len(kept) == size), "int32")
