"""An open vocabulary written plainly: dicts, lists and Python ints, one id at a time.

Follows docs/open_vocabularies.md's rules, written without the library's
code: the hash (murmur3's 32-bit finalizer over both halves of the id), the
window, lookups, LRU / TTL, placement in rounds, the hand-over of an applied
step's choices to the next call, and the running totals.
"""

M = 0xFFFFFFFF


def _mix(x):
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & M
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & M
    return x ^ (x >> 16)


def home(key, seed, capacity):
    """The id's home row: its hash modulo `capacity`."""
    high, low = (key >> 32) & M, key & M
    start = _mix((high + ((seed * 0x9E3779B1) & M)) & M)
    return _mix(((start * 0x9E3779B9) & M) ^ low) % capacity


class _Map:
    """Open addressing: row -> id, row -> last seen step (-1: no id)."""

    def __init__(self, capacity, probes, seed, ttl=None, half_life=None):
        self.capacity, self.probes, self.seed, self.ttl = capacity, probes, seed, ttl
        self.key = {}  # row -> id (kept while the row is free again: only `seen` says)
        self.seen = [-1] * capacity
        self.half_life = half_life
        self.freq = [0] * capacity  # LFU: lookups, as of the row's last seen step

    def frequency(self, row, step):
        """The row's LFU count at `step`: halved at every multiple of `half_life` since
        it was last seen."""
        halvings = step // self.half_life - max(self.seen[row], 0) // self.half_life
        return self.freq[row] >> min(halvings, 31)

    def window(self, key):
        first = home(key, self.seed, self.capacity)
        return [(first + j) % self.capacity for j in range(self.probes)]

    def alive(self, row, step):
        seen = self.seen[row]
        return seen >= 0 and (self.ttl is None or seen > step - self.ttl)

    def find(self, key, step):
        for row in self.window(key):
            if self.alive(row, step) and self.key.get(row) == key:
                return row
        return -1

    def place(self, candidates, step, eviction, rounds, guard=None):
        """`[(row, held a live id) or None]` for `candidates`, in rounds; rows seen at or
        after step `guard` (default: this step) are never taken."""
        guard = step if guard is None else guard
        options = []
        for key in candidates:
            found = []
            for row in self.window(key):
                live = self.alive(row, step)
                usable = (not live or eviction != "none") and self.seen[row] < guard
                if eviction == "lfu":  # the least frequent; ties: the one seen longest ago
                    score = (self.frequency(row, step), self.seen[row]) if live else (-1, -1)
                else:
                    score = (self.seen[row],) if live else (-1,)
                found.append((row, score, usable, live))
            options.append(found)
        placed = [None] * len(candidates)
        for _ in range(rounds):
            taken = {p[0] for p in placed if p is not None}
            wants = {}
            for c, found in enumerate(options):
                if placed[c] is not None:
                    continue
                usable = [(score, j) for j, (row, score, ok, _) in enumerate(found)
                          if ok and row not in taken]
                if usable:
                    _, j = min(usable)
                    wants.setdefault(found[j][0], []).append((c, found[j][3]))
            for row, who in wants.items():
                c, live = min(who)
                placed[c] = (row, live)
        return placed


class ReferenceVocabulary:
    def __init__(self, capacity, probes, eviction="lru", ttl=None, seed=0,
                 admissions_per_step=4096, placement_rounds=4, admit_after=1,
                 count_capacity=None, half_life=1000):
        self.map = _Map(capacity, probes, seed, ttl, half_life)
        self.capacity, self.eviction, self.ttl = capacity, eviction, ttl
        self.admissions, self.rounds, self.admit_after = (admissions_per_step, placement_rounds,
                                                          admit_after)
        cc = count_capacity or capacity
        self.sightings = _Map(cc, min(probes, cc), seed + 7919)
        self.count = {}  # sightings map row -> count
        self.step = 0
        self.pending = []  # (id, row, step, evicted) of the last applied step
        self.sighted = {}  # (id, row) of `pending` -> the id's sightings in its step
        self.counts = {"default_lookups": 0, "found": 0, "probe_length": 0, "admitted": 0,
                       "evicted": 0, "reclaimed": 0, "unplaced": 0}
        self.lost = []  # (id, step): an id lost its row (taken by another, or expired)

    @property
    def key(self):
        return self.map.key

    @property
    def seen(self):
        return self.map.seen

    def _next_view(self):
        """`(row -> id, row -> last seen, [(id, step)] lost)` as the next lookup sees them."""
        key, seen, lost = dict(self.map.key), list(self.map.seen), []
        for k, row, step, _ in self.pending:
            if seen[row] >= 0 and key.get(row) != k:
                lost.append((key[row], step))
            key[row], seen[row] = k, max(seen[row], step)
        return key, seen, lost

    def held(self):
        """`{id: row}` of live ids as the next lookup sees them (the hand-over written)."""
        key, seen, _ = self._next_view()
        return {key[r]: r for r in range(self.capacity)
                if r in key and seen[r] >= 0
                and (self.ttl is None or seen[r] > self.step - self.ttl)}

    def delta(self, since):
        """`({id: row} seen or given a row after `since`, {ids lost after it, not held})`."""
        key, seen, lost = self._next_view()
        held = self.held()
        changed = {k: r for k, r in held.items() if seen[r] > since}
        gone = {k for k, step in self.lost + lost if step > since} - set(held)
        return changed, gone

    def stats(self):
        """The running totals as read between steps: the last step's hand-over counted
        (as the next call's `_commit` will count it)."""
        out = dict(self.counts)
        for _, row, step, evicted in self.pending:
            if self.map.seen[row] < step:  # (not written by an earlier call already)
                out["admitted"] += 1
                out["evicted"] += int(evicted)
                out["reclaimed"] += int(self.map.seen[row] >= 0 and not evicted)
        return out

    def _commit(self):
        for key, row, step, evicted in self.pending:
            if self.map.seen[row] >= step:
                continue  # written by an earlier call already
            if self.map.seen[row] >= 0:  # the row held an id: live (evicted) or expired
                if self.map.key[row] != key:
                    self.lost.append((self.map.key[row], step))
                self.counts["reclaimed"] += int(not evicted)
            self.map.freq[row] = min(self.sighted[(key, row)], 2**30)  # its own sightings
            self.map.key[row] = key
            self.map.seen[row] = step
            self.counts["admitted"] += 1
            self.counts["evicted"] += int(evicted)
            if self.admit_after > 1:  # admitted: its sightings are forgotten
                at = self.sightings.find(key, 0)
                if at >= 0:
                    self.sightings.seen[at] = -1

    def lookup(self, keys):
        """An inference call: `[rows]` (the hand-over written first)."""
        self._commit()
        return [self.map.find(k, self.step) for k in keys]

    def _sighted(self, missing, occurrences, s):
        """Counts this step's sightings of `missing` ids; their totals."""
        totals = []
        for key in missing:
            at = self.sightings.find(key, s)
            total = (self.count[at] if at >= 0 else 0) + occurrences[key]
            if at >= 0:
                self.count[at], self.sightings.seen[at] = total, s
            totals.append(total)
        new = [k for k in missing if self.sightings.find(k, s) < 0]
        for key, got in zip(new, self.sightings.place(new, s, "lru", self.rounds)):
            if got is not None:
                self.sightings.key[got[0]], self.sightings.seen[got[0]] = key, s
                self.count[got[0]] = totals[missing.index(key)]
        return totals

    def train(self, keys, applied=True, guard=None):
        """A training call then the optimizer's step: `[rows]` the call read. With
        gradient accumulation, `guard` is the step the update cycle began at."""
        self._commit()
        self.step += 1
        s = self.step
        if self.ttl is not None:  # ids not seen for `ttl` steps expire now
            self.lost += [(self.map.key[r], s) for r in range(self.capacity)
                          if self.map.seen[r] >= 0 and self.map.seen[r] + self.ttl == s]
        rows = [self.map.find(k, s) for k in keys]
        self.counts["default_lookups"] += sum(r < 0 for r in rows)
        looked = {}
        for r in rows:
            if r >= 0:
                looked[r] = looked.get(r, 0) + 1
        for r, n in looked.items():  # LFU counts, before the rows are marked seen
            self.map.freq[r] = min(self.map.frequency(r, s) + n, 2**30)
        for k, r in zip(keys, rows):
            if r >= 0:
                self.counts["found"] += 1
                self.counts["probe_length"] += (r - home(k, self.map.seed, self.capacity)) % \
                    self.capacity + 1
        for r in rows:
            if r >= 0:
                self.map.seen[r] = s
        occurrences = {}
        for k, r in zip(keys, rows):
            if r < 0:
                occurrences[k] = occurrences.get(k, 0) + 1
        missing = list(occurrences)  # in the order first seen in the batch
        wanted = missing
        if self.admit_after > 1:
            totals = self._sighted(missing, occurrences, s)
            wanted = [k for k, t in zip(missing, totals) if t >= self.admit_after]
        trying = wanted[:self.admissions]  # the first ones; the others wait
        placed = self.map.place(trying, s, self.eviction, self.rounds, guard)
        chosen = [c for c in range(len(trying)) if placed[c] is not None]
        self.counts["unplaced"] += len(wanted) - len(chosen)
        self.pending = ([(trying[c], placed[c][0], s, placed[c][1]) for c in chosen]
                        if applied else [])
        self.sighted = {(k, row): occurrences[k] for k, row, _, _ in self.pending}
        return rows
