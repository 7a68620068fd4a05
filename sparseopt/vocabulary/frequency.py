"""How often each row's id is looked up, with periodic halving: the score of LFU eviction.

Each row keeps an int32 count of its id's lookups (every occurrence counts,
duplicates in one batch too), halved every `half_life` steps of the layer's
clock (TinyLFU's aging: all counts halve at step `half_life`, `2 half_life`,
...). Halving every row at those steps would be work sized by the table, so
it is done lazily and exactly: a row's count is stored as of the step it was
last seen, and read as `count >> (epoch(now) - epoch(seen))` with
`epoch(t) = t // half_life`. A row given to a new id starts with that id's
own sightings in the step it was admitted (never the old id's count).
"""

import numpy as np
from keras import ops

from sparseopt import backend

_CAP = np.int32(2**30)  # counts saturate here (an hour of one hot id cannot wrap)


class Frequencies:
    """Per-row lookup counts for `eviction="lfu"` (4 bytes a row).

    Args:
        half_life: steps between halvings of every count.
    """

    def __init__(self, half_life):
        self.half_life = int(half_life)

    def build(self, capacity, add_state):
        """Creates the variable (`add_state` as for `OpenVocabulary.build`)."""
        self.counts = add_state("vocabulary_frequency", (capacity,), "int32", 0, False,
                                rows=True)

    def effective(self, counts, seen, step):
        """The counts `counts` of rows last seen at `seen`, as of `step` (halved since)."""
        halvings = ops.cast(step, "int32") // self.half_life - ops.maximum(seen, 0) // self.half_life
        return ops.right_shift(counts, ops.minimum(halvings, 31))

    def add_lookups(self, last_seen, rows, found, step):
        """Adds this step's lookups of the rows found (before `last_seen` is marked).

        Args:
            last_seen: the map's last-seen variable (not yet marked for this step).
            rows: int32 `[N]` rows of the lookups (any where not `found`).
            found: bool `[N]`.
            step: int32 scalar, the step now.

        Returns:
            int32 `[N]`: `last_seen` of `rows`, as read here.
        """
        safe = ops.where(found, rows, 0)
        zeros = ops.zeros_like(safe)
        first = backend.first_occurrences(zeros, safe, found)
        n = ops.shape(rows)[0]
        occurrences = ops.segment_sum(ops.cast(found, "int32"), first, num_segments=n)
        is_first = ops.logical_and(found, ops.equal(first, ops.arange(n, dtype="int32")))
        seen = backend.gather_from_resource(last_seen, safe)
        now = self.effective(backend.gather_from_resource(self.counts, safe), seen, step)
        backend.scatter_where(self.counts, safe,
                              ops.minimum(now + occurrences, _CAP), is_first)
        return seen

    def start(self, rows, occurrences, new):
        """Rows given to new ids start with their ids' sightings (int32 `[A]` each)."""
        backend.scatter_where(self.counts, ops.maximum(rows, 0),
                              ops.minimum(occurrences, _CAP), new)
