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
