"""An open vocabulary's state and its step: the lookup side and the optimizer side.

`OpenVocabulary` holds the settings (admission, eviction, probing) and the
layer's variables:

- `keys` (int32 `[V, 2]`) and `last_seen` (int32 `[V]`): the id -> row map
  (`id_map`), 12 bytes a row;
- `steps`: the layer's training calls so far (its clock for LRU and TTL);
- `pending`: the rows the last applied step gave to new ids (`pending`);
- `cycle_start`: the step the optimizer's current update began at (rows
  seen since are never given away: their gradients wait to be applied);
- `counts`: running totals of `COUNTS` (`counters`: int32 pairs, no wrap);
- `tombstones`: the ids replaced in the map, with their steps, for `delta`;
- with `admit_after`, the sighting counts (`sightings.SightingCounts`).

A training call (`rows_for(..., training=True)`) first writes `pending` into
the map, then finds each id's row, marks the rows it found as seen now,
picks the new ids to admit and rows for them (`id_map.place`) and hands
those choices, with the row gradients, to the optimizer
(`RowGrads.changed`). The optimizer's step (`accept`), if it applies,
resets each chosen row and its per-row optimizer state and puts the choices
in `pending`; a skipped step puts nothing there, so it admits and evicts
nothing. Ids not held read zeros and their gradients go nowhere.

With gradient accumulation every micro-batch that reaches the optimizer
is such a step for the map (its choices are accepted at once), but a row
seen since the update cycle began is never given to another id: its
gradients wait in the accumulation buffers for the cycle's update.
"""

from typing import Any, NamedTuple

import numpy as np
from keras import ops

from sparseopt import backend, compat, halves
from sparseopt.storage import precision
from sparseopt.vocabulary import counters, export, id_map, keys, new_rows, pending
from sparseopt.vocabulary.frequency import Frequencies
from sparseopt.vocabulary.sightings import SightingCounts
from sparseopt.vocabulary.tombstones import TombstoneLog

EVICTIONS = ("lru", "lfu", "none")
DEFAULT_PROBES = 8  # 16: 2% more rows held when full, 10-20% more step (docs)
# What `counts` totals: lookups of ids not held (they read zeros), lookups of
# ids held, and the rows those read into their windows to find them (1 at
# the home row), ids given a row, rows taken from another live id, rows
# taken from an expired id (TTL), and ids that qualified but found no row in
# their window (or were over `admissions_per_step`) in their step.
COUNTS = ("default_lookups", "found", "probe_length", "admitted", "evicted", "reclaimed",
          "unplaced")
DEFAULT_TOMBSTONE_LOG = 65536


class Proposals(NamedTuple):
    """The rows a training call chose for new ids (at most `admissions_per_step`).

    A JAX pytree: it travels with the row gradients (`RowGrads.changed`).
    `[A]` arrays where shapes are static (JAX), else `[M]`: the step's
    candidates only (`backend.first_true`).

    Args:
        high, low: int32 `[A]` the ids' halves.
        rows: int32 `[A]` the row chosen for each.
        evicted: bool `[A]`: whether the row held another live id.
        valid: bool `[A]`: which entries are choices.
        sightings: int32 `[A]`: each id's occurrences in the step.
        step: int32 scalar, the layer's step they were made in.
    """

    high: Any
    low: Any
    rows: Any
    evicted: Any
    valid: Any
    step: Any
    sightings: Any


class OpenVocabulary:
    """An open vocabulary's settings; `build` creates its variables on a layer.

    Args:
        capacity: the table's rows: at most this many ids hold a row at once.
        probes: the rows an id may live in, from its home row on (its
            window); None: 8, or `capacity` if smaller.
        admit_probability: the chance that one sighting of an id not held
            gives it a row (1: the first sighting does). An id seen `k` times
            in a step is admitted with `1 - (1 - p)^k`; the coin is a hash of
            the id, the step and `seed`.
        admit_after: sightings (every occurrence counts) before an id may be
            admitted; above 1, they are counted in a second map
            (`sightings.SightingCounts`, 16 bytes an entry).
        count_capacity: that map's entries (None: `capacity`).
        tombstone_log: how many replaced ids are kept for `delta` (None:
            `capacity` up to 65,536, or one step's admissions if more; 12
            bytes each).
        eviction: `"lru"`: an id whose window has no free row takes the row
            seen longest ago (never one seen in this step); `"lfu"`: the row
            whose id was looked up least often (`frequency.Frequencies`:
            every occurrence counts, all counts halve every
            `lfu_half_life` steps; ties: the row seen longest ago);
            `"none"`: it waits for a free row.
        lfu_half_life: steps between halvings of the LFU counts.
        ttl: steps after which an id not seen expires (its lookups miss and
            its row is free), or None.
        seed: for the hash that places ids and the admission coin.
        admissions_per_step: the most ids a step admits (the size of the
            hand-over to the next call): the first this many qualifying ids,
            in the order first seen in the batch, try for a row; the others
            wait for a later sighting.
        placement_rounds: rounds in which ids that want the same row try
            their next best one.
    """

    def __init__(self, capacity, probes=None, admit_probability=1.0, eviction="lru", ttl=None,
                 seed=0, admissions_per_step=1024, placement_rounds=2, admit_after=1,
                 count_capacity=None, tombstone_log=None, lfu_half_life=1000):
        probes = min(DEFAULT_PROBES, int(capacity)) if probes is None else probes
        if not 1 <= int(probes) <= int(capacity):
            raise ValueError(f"OpenVocabulary: `probes` must be in [1, capacity={capacity}], "
                             f"got {probes}.")
        if not 0.0 < float(admit_probability) <= 1.0:
            raise ValueError("OpenVocabulary: `admit_probability` must be in (0, 1], got "
                             f"{admit_probability}.")
        if eviction not in EVICTIONS:
            raise ValueError(f"OpenVocabulary: `eviction` must be one of {EVICTIONS}, got "
                             f"{eviction!r}.")
        if ttl is not None and int(ttl) < 1:
            raise ValueError(f"OpenVocabulary: `ttl` must be None or at least 1, got {ttl}.")
        if int(admissions_per_step) < 1 or int(placement_rounds) < 1:
            raise ValueError("OpenVocabulary: `admissions_per_step` and `placement_rounds` "
                             "must be at least 1.")
        if int(admit_after) < 1 or (count_capacity is not None and int(count_capacity) < 1):
            raise ValueError("OpenVocabulary: `admit_after` and `count_capacity` must be at "
                             f"least 1, got {admit_after} and {count_capacity}.")
        # A step replaces at most this many ids (each in a row of its own).
        per_step = min(int(admissions_per_step), int(capacity))
        # Sized to the table: past `capacity` replacements since a serving
        # copy's last delta, exporting the whole map costs no more.
        tombstone_log = (max(min(DEFAULT_TOMBSTONE_LOG, int(capacity)), per_step)
                         if tombstone_log is None else int(tombstone_log))
        if tombstone_log < per_step:
            raise ValueError(f"OpenVocabulary: `tombstone_log` ({tombstone_log}) must hold at "
                             f"least one step's admissions ({per_step}: `admissions_per_step`, "
                             "or `capacity` if smaller).")
        if int(lfu_half_life) < 1:
            raise ValueError(f"OpenVocabulary: `lfu_half_life` must be at least 1, got "
                             f"{lfu_half_life}.")
        if int(capacity) >= 2**30:
            raise ValueError(f"OpenVocabulary: `capacity` must be below 2**30, got {capacity}.")
        self.capacity, self.probes = int(capacity), int(probes)
        self.admit_probability = float(admit_probability)
        self.eviction, self.ttl = eviction, (None if ttl is None else int(ttl))
        self.seed = int(seed)
        self.admissions_per_step = int(admissions_per_step)
        self.placement_rounds = int(placement_rounds)
        self.admit_after = int(admit_after)
        self.count_capacity = None if count_capacity is None else int(count_capacity)
        self.tombstones = TombstoneLog(tombstone_log)
        self.frequency = Frequencies(lfu_half_life) if eviction == "lfu" else None
        self.sightings = None
        self.int8 = None  # (`build`)
        if self.admit_after > 1:
            self.sightings = SightingCounts(self.count_capacity or self.capacity, self.probes,
                                            self.seed, self.placement_rounds)

    def get_config(self):
        return {"probes": self.probes, "admit_probability": self.admit_probability,
                "eviction": self.eviction, "ttl": self.ttl, "seed": self.seed,
                "admissions_per_step": self.admissions_per_step,
                "placement_rounds": self.placement_rounds, "admit_after": self.admit_after,
                "count_capacity": self.count_capacity, "tombstone_log": self.tombstones.size,
                "lfu_half_life": self.frequency.half_life if self.frequency else 1000}

    # -- variables ----------------------------------------------------------

    def build(self, initializer, add_state, int8=None):
        """Creates the map's variables on its layer.

        Args:
            initializer: the table's initializer (rows given to new ids are
                drawn from it, `new_rows`).
            add_state: `add_state(name, shape, dtype, initial, trainable,
                rows=False, weight=True)`, which creates a variable of the
                layer (`rows`: indexed by the table's rows, and split like
                them; `weight=False`: state, not one of the layer's weights).
            int8: an int8 table's `Int8Table`, whose rows given to new keys
                the next call writes; None for float tables.
        """
        self.initializer, self.int8 = initializer, int8
        v = self.capacity
        # Indexed by the table's rows: split like them where the table is.
        self.keys = add_state("vocabulary_keys", (v, 2), "int32", 0, False, rows=True)
        self.last_seen = add_state("vocabulary_last_seen", (v,), "int32", id_map.EMPTY, False,
                                   rows=True)
        self.steps = add_state("vocabulary_steps", (), "int32", 0, False)
        self.counts = add_state("vocabulary_counts", (len(COUNTS), 2), "int32", 0, False)
        # Written by the optimizer's step: trainable where only trainable
        # variables can be (JAX); never trained (its gradient is ignored).
        # Not weights, on either backend (the step's hand-over, not the map):
        # the layer's weights, and so `model.summary()`, are the same on both.
        self.pending = add_state("vocabulary_pending",
                                 (self.admissions_per_step, pending.FIELDS), "float32", 0.0,
                                 not backend.STATEFUL_APPLY, weight=False)
        self.cycle_start = add_state("vocabulary_cycle_start", (2,), "float32", 0.0,
                                     not backend.STATEFUL_APPLY, weight=False)
        self.tombstones.build(add_state)
        if self.frequency is not None:
            self.frequency.build(v, add_state)
        if self.sightings is not None:
            self.sightings.build(add_state)

    @property
    def variables(self):
        """The map's variables, in the order a checkpoint stores them."""
        counted = self.sightings.variables if self.sightings is not None else []
        frequency = [self.frequency.counts] if self.frequency is not None else []
        return [self.keys, self.last_seen, self.steps, self.counts, self.pending,
                self.cycle_start, *self.tombstones.variables, *frequency, *counted]

    # -- the lookup's side ----------------------------------------------------

    def rows_for(self, high, low, training):
        """The rows of the ids `(high, low)` (int32 `[N]` each; -1: not held).

        Writes the hand-over of the last applied step into the map first
        (except in a model being exported: its layer wrote it before, so the
        served function only reads the map). In training also advances the
        clock, marks the rows found as seen and chooses rows for new ids:
        returns `(rows, Proposals)`; else `(rows, None)`.
        """
        # (A SavedModel serves one device: a map split by rows would be written
        # inside `shard_map` over the training's devices, which it cannot run.)
        if training or compat.exporting() is None:
            self._write_pending()
        step = self.steps.value
        if training:
            step = step + 1
            self.steps.assign(step)
            # TF MirroredStrategy: every replica works on every replica's ids, in
            # replica order (the global batch's), so that every copy of the map
            # stays the same, that of one device at the global batch.
            n = ops.shape(high)[0]
            (high, low), start = backend.gather_over_replicas((high, low))
        else:
            n, start = None, 0
        home = keys.home_rows(high, low, self.seed, self.capacity)
        rows = backend.compiled(id_map.find)(self.keys, self.last_seen, high, low, home,
                                             self.probes, step, self.ttl)
        if not training:
            return rows, None
        missing = ops.less(rows, 0)
        found = ops.logical_not(missing)
        length = ops.mod(rows - home, self.capacity) + 1
        self._count(default_lookups=ops.sum(ops.cast(missing, "int32")),
                    found=ops.sum(ops.cast(found, "int32")),
                    probe_length=ops.sum(ops.where(found, length, 0)))
        now = ops.full(ops.shape(rows), step, "int32")
        if self.frequency is not None:  # before `last_seen` moves on: it dates the counts
            before = self.frequency.add_lookups(self.last_seen, rows, found, step)
            # (`step` again, but read from what the counts read: XLA then orders
            # the write after that read and writes in place instead of copying.)
            now = ops.maximum(now, before)
        backend.scatter_where(self.last_seen, ops.maximum(rows, 0), now, found)
        proposals = self._propose(high, low, missing, step)
        if not isinstance(start, int):  # this replica's own ids' rows
            rows = ops.slice(rows, ops.expand_dims(start, 0), (n,))
        return rows, proposals

    def _propose(self, high, low, missing, step):
        n = ops.shape(high)[0]
        first = backend.first_occurrences(high, low, missing)
        # The distinct ids not held, each at its first entry, with its sightings.
        is_first = ops.logical_and(missing, ops.equal(first, ops.arange(n, dtype="int32")))
        occurrences = ops.segment_sum(ops.cast(missing, "int32"), first, num_segments=n)
        wanted = ops.logical_and(is_first, self._admitted(high, low, occurrences, step))
        if self.sightings is not None:
            seen = self.sightings.add(high, low, occurrences, is_first, step)
            wanted = ops.logical_and(wanted, ops.greater_equal(seen, self.admit_after))
        # The first `admissions_per_step` qualifying ids, in the order first seen.
        chosen = backend.first_true(wanted, self.admissions_per_step)
        valid = ops.greater_equal(chosen, 0)
        at = ops.maximum(chosen, 0)
        high, low = ops.take(high, at), ops.take(low, at)
        home = keys.home_rows(high, low, self.seed, self.capacity)
        rows, evicted = id_map.place(self.last_seen, home, valid, self.probes, step,
                                     self.eviction, self.ttl, self.placement_rounds,
                                     self.frequency,
                                     guard=halves.decode_step(self.cycle_start.value))
        placed = ops.greater_equal(rows, 0)
        self._count(unplaced=ops.sum(ops.cast(wanted, "int32"))
                    - ops.sum(ops.cast(placed, "int32")))
        return Proposals(high=high, low=low, rows=rows, evicted=evicted, valid=placed,
                         step=step, sightings=ops.take(occurrences, at))

    def _admitted(self, high, low, occurrences, step):
        """Whether each id's sightings in this step win it a row (the admission coin)."""
        if self.admit_probability >= 1.0:
            return ops.ones(ops.shape(high), "bool")
        bits = keys.hashed(ops.bitwise_xor(high, ops.cast(step, "int32")), low, self.seed + 1)
        draw = precision.uniform(bits)
        # p per sighting, `occurrences` sightings: 1 - (1 - p)^k.
        chance = 1.0 - ops.power(1.0 - self.admit_probability,
                                 ops.cast(occurrences, "float32"))
        return ops.less(draw, chance)

    def _write_pending(self):
        """Writes the last applied step's choices into the map (again is harmless)."""
        high, low, rows, step, evicted, valid, sightings = pending.decode(self.pending.value)
        safe = ops.where(valid, rows, 0)
        held = backend.gather_from_resource(self.keys, safe)
        seen = backend.gather_from_resource(self.last_seen, safe)
        # An entry's first write (its row was last seen before the step that
        # chose it; once written, it was seen then).
        first = ops.logical_and(valid, ops.less(seen, step))
        other = ops.logical_not(ops.logical_and(ops.equal(held[:, 0], high),
                                                ops.equal(held[:, 1], low)))
        had = ops.logical_and(first, ops.greater_equal(seen, 0))  # the row held an id
        # Another id (live or expired) loses its row: a tombstone. (An expired id
        # admitted again into its own row loses nothing.)
        self.tombstones.record(held[:, 0], held[:, 1], step, ops.logical_and(had, other))
        if self.frequency is not None:  # its own count, not the old id's
            self.frequency.start(safe, sightings, first)
        # Keys only where they change (which also orders this write after the
        # read above: XLA then writes in place instead of copying the map).
        backend.scatter_where(self.keys, safe, ops.stack([high, low], axis=1),
                              ops.logical_and(first, other))
        backend.scatter_where(self.last_seen, safe, ops.maximum(seen, step), valid)
        if self.sightings is not None:
            self.sightings.forget(high, low, first)
        self._write_int8_rows(safe, step, valid)
        self._count(admitted=ops.sum(ops.cast(first, "int32")),
                    evicted=ops.sum(ops.cast(ops.logical_and(first, evicted), "int32")),
                    reclaimed=ops.sum(ops.cast(
                        ops.logical_and(had, ops.logical_not(evicted)), "int32")))

    def _write_int8_rows(self, rows, step, keep):
        """An int8 table (`sparseopt.storage.int8_table`): the rows given to new keys start from
        the initializer's values (`new_rows`, deterministic), quantized to nearest,
        written here because its optimizer step cannot write the table (again is
        harmless: the same values)."""
        if self.int8 is None:
            return
        fresh = new_rows.initial_rows(self.initializer, rows, self.int8.codes.shape[1], step,
                                      self.seed)
        self.int8.write(rows, fresh, keep)

    def write_map_hand_over(self):
        """Between steps (export): the last applied step's choices written into the map,
        as the next call writes them (again is harmless)."""
        self._write_pending()

    def write_hand_over(self):
        """Between steps (export): an int8 table's buffered rows and rows given to new
        keys written, as the next call writes them (no other change)."""
        if self.int8 is None:
            return
        self.int8.flush()
        _, _, rows, step, _, valid, _ = pending.decode(self.pending.value)
        self._write_int8_rows(ops.where(valid, rows, 0), step, valid)

    def _count(self, **amounts):
        counters.add(self.counts, {COUNTS.index(name): a for name, a in amounts.items()})

    # -- the optimizer's side -------------------------------------------------

    def accept(self, proposals, applied, storage, step, cycle_ends=True):
        """After the table's update: the chosen rows start afresh, for the next call.

        Where `applied`, each chosen row of the table is drawn anew from
        `initializer` and each per-row slot set to its start (`SlotSpec`:
        its initial value, or the step for a slot that holds one), through
        the table's row storage (`RowStorage.start`); the choices go to
        `pending`. Else `pending` is emptied.

        Args:
            proposals: the step's `Proposals`.
            applied: boolean scalar: whether the step's update was applied.
            storage: the table's `sparseopt.storage.rows.RowStorage`.
            step: int scalar, the optimizer's updates so far, this one
                included (what a slot holding a step starts at).
            cycle_ends: boolean scalar: whether an update was made (or
                skipped) in this step; False for a micro-step of gradient
                accumulation before the cycle's last. Where True, rows seen
                from the next call on are the next cycle's.
        """
        valid = ops.logical_and(proposals.valid, applied)
        rows = ops.where(valid, proposals.rows, 0)
        fresh = None
        if self.int8 is None:  # (an int8 table's next call writes them: `_write_pending`)
            fresh = new_rows.initial_rows(self.initializer, rows, storage.table.shape[1],
                                          proposals.step, self.seed)
        storage.start(rows, fresh, valid, step)
        self.pending.assign(pending.encode(proposals.high, proposals.low, rows,
                                           proposals.step, proposals.evicted, valid,
                                           proposals.sightings, self.admissions_per_step))
        start = halves.decode_step(self.cycle_start.value)
        self.cycle_start.assign(halves.encode_step(
            ops.where(cycle_ends, ops.cast(proposals.step, "int32") + 1, start)))

    # -- reading it -----------------------------------------------------------

    def stats(self):
        """`{name: int}`: the running totals (`COUNTS`, the last step's admissions
        included), `held` (rows holding an id, or an expired one whose row is not
        reused yet, as the next lookup sees them) and
        `mean_probe_length` (rows read into its window per id found, 1 at its home row)."""
        out = dict(zip(COUNTS, counters.read(self.counts)))
        # The last step's hand-over is counted when the next call writes it
        # (`_write_pending`); counted here too, as that call will, so totals
        # read right after `fit` are whole (once written, it adds nothing).
        for name, amount in self._hand_over_counts().items():
            out[name] += amount
        out["held"] = out["admitted"] - out["evicted"] - out["reclaimed"]
        out["mean_probe_length"] = out["probe_length"] / max(out["found"], 1)
        return out

    def _hand_over_counts(self):
        """`{name: int}`: what writing the hand-over in `pending` would add to the
        totals (`_write_pending`'s counts, in NumPy; reads its rows of the map only)."""
        high, low, rows, step, evicted, valid, _ = (np.asarray(ops.convert_to_numpy(x))
                                                    for x in pending.decode(self.pending.value))
        safe = np.where(valid, rows, 0)
        seen = np.asarray(ops.convert_to_numpy(ops.take(self.last_seen.value, safe, axis=0)))
        first = valid & (seen < step)
        had = first & (seen >= 0)
        return {"admitted": int(first.sum()), "evicted": int((first & evicted).sum()),
                "reclaimed": int((had & ~evicted).sum())}

    # -- export (sparseopt.vocabulary.export) ------------------------------

    def ids(self):
        """`{id: row}` of every id holding a row, as the next lookup sees them (NumPy,
        reading the whole map: for export)."""
        return export.ids(self)

    def delta(self, since, table, name, trained_default=False):
        """What changed after layer step `since`: see `DynamicEmbedding.delta`."""
        return export.delta(self, since, table, name, trained_default)
