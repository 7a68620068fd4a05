"""Sightings of ids not held yet, for admission after `N` of them (`admit_after`).

A second open-addressing map (`id_map`), of `count_capacity` entries, each an
id, its sightings so far and the step it was last seen in: 16 bytes an
entry. Every occurrence counts (an id seen three times in a batch has three
more sightings). An id's entry is freed when it is admitted. When an id's
window in this map is full, the entry seen longest ago (never one seen in
this step) is given to it and that id's count is lost (it starts again):
counts are exact while the map has room for the ids waiting.
"""

from keras import ops

from sparseopt import backend
from sparseopt.vocabulary import id_map, keys


class SightingCounts:
    """The counts of ids waiting for admission.

    Args:
        capacity: entries of the map.
        probes: the entries an id may use, from its home entry on.
        seed: of the hash placing ids (the vocabulary's, salted).
        rounds: placement rounds, as for the vocabulary's map.
    """

    def __init__(self, capacity, probes, seed, rounds):
        self.capacity, self.probes = int(capacity), min(int(probes), int(capacity))
        self.seed, self.rounds = int(seed) + 7919, int(rounds)

    def build(self, add_state):
        """Creates the variables (`add_state` as for `OpenVocabulary.build`)."""
        c = self.capacity
        # Split like the table's rows where it is (each device holds its part
        # of the entries; an id's entry is placed by its hash, like its row).
        self.keys = add_state("vocabulary_sighting_keys", (c, 2), "int32", 0, False, rows=True)
        self.counts = add_state("vocabulary_sightings", (c,), "int32", 0, False, rows=True)
        self.last_seen = add_state("vocabulary_sighting_last_seen", (c,), "int32",
                                   id_map.EMPTY, False, rows=True)

    @property
    def variables(self):
        return [self.keys, self.counts, self.last_seen]

    def _home(self, high, low):
        return keys.home_rows(high, low, self.seed, self.capacity)

    def add(self, high, low, occurrences, distinct, step):
        """Adds this step's sightings; returns each id's total so far.

        Args:
            high, low: int32 `[C]` ids, in order (the first entries of new ids go first).
            occurrences: int32 `[C]` their sightings in this step.
            distinct: bool `[C]`: the entries that are distinct ids to count.
            step: int32 scalar, the vocabulary's step.

        Returns:
            int32 `[C]` sightings so far of each entry's id (this step's included).
        """
        home = self._home(high, low)
        rows = id_map.find(self.keys, self.last_seen, high, low, home, self.probes, step)
        known = ops.logical_and(distinct, ops.greater_equal(rows, 0))
        safe = ops.maximum(rows, 0)
        before = ops.where(known, backend.gather_from_resource(self.counts, safe), 0)
        total = before + occurrences
        backend.scatter_where(self.counts, safe, total, known)
        backend.scatter_where(self.last_seen, safe, ops.full(ops.shape(safe), step, "int32"),
                              known)
        # New entries for ids not counted yet (kept until the id is admitted:
        # one that qualifies but finds no row keeps its count).
        wanted = ops.logical_and(distinct, ops.logical_not(known))
        placed, _ = id_map.place(self.last_seen, home, wanted, self.probes, step, "lru", None,
                                 self.rounds)
        got = ops.greater_equal(placed, 0)
        at = ops.maximum(placed, 0)
        backend.scatter_where(self.keys, at, ops.stack([high, low], axis=1), got)
        backend.scatter_where(self.counts, at, total, got)
        backend.scatter_where(self.last_seen, at, ops.full(ops.shape(at), step, "int32"), got)
        return total

    def forget(self, high, low, admitted):
        """Frees the entries of ids just admitted (bool `[A]` `admitted`)."""
        rows = id_map.find(self.keys, self.last_seen, high, low, self._home(high, low),
                           self.probes, 0)
        free = ops.logical_and(admitted, ops.greater_equal(rows, 0))
        safe = ops.maximum(rows, 0)
        backend.scatter_where(self.last_seen, safe,
                              ops.full(ops.shape(safe), id_map.EMPTY, "int32"), free)
