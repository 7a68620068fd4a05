"""One table's step as it travels from a lookup to its updated rows: `RowGrads`.

A lookup's backward pass records a `RowGrads` (the ids it read and their
gradients); the optimizer's gradient source hands the true (unscaled)
record of the step to the table's trainer, which deduplicates it into a
`Distinct` (each distinct id once, its gradients summed) and applies the
rule to those rows. New per-step facts (e.g. rows that changed owner) are
new fields of `RowGrads`, not new arguments along the way.

Row gradients come one row per id, or one per bag. A lookup's backward
pass yields the gradient of every id it read. For a pooled lookup (`SparseEmbedding(combiner="sum"|"mean")`) those are the bag's
one gradient repeated for each id of the bag, times the id's pooling weight:
`BagGrads` keeps them in that form, so that the `[ids, width]` array is never
built; the dedup's segment sum reads each id's bag row directly. Everything
that handles row gradients goes through the functions below, which take
either form.
"""

import dataclasses
from typing import Any, NamedTuple

from keras import ops


@dataclasses.dataclass(frozen=True)
class RowGrads:
    """One table's row gradients of one step.

    Args:
        ids: int `[N]` ids, duplicates allowed (their gradients are summed);
            ids outside `[0, rows)` are ignored.
        grads: `[N, width]` gradient of each id, or `BagGrads`.
        calls: how many lookup calls' backward passes recorded them (a
            Python int; 1 where the gradients came another way).
        changed: for an open vocabulary, the rows its lookup gave to new ids
            in this step (`sparseopt.vocabulary.Proposals`), which the
            optimizer resets if it applies the step; None otherwise.
        read: for an int8 table or a table on disk, float32 `[N, width]`: each
            id's row as the forward pass read it (the optimizer updates those:
            `RowStorage.reads_lookups`); None otherwise.
        state: for a table on disk whose lookup ran in a training call,
            `{slot: [N, ...]}`: each id's per-row optimizer state as the same
            host call read it with its row (the optimizer starts from it, as
            from `read`, instead of reading it from the host again); None
            otherwise (the optimizer then reads it from the host).
    """

    ids: Any
    grads: Any
    calls: int = 1
    changed: Any = None
    read: Any = None
    state: Any = None

    def scaled(self, factor):
        """The same record with every gradient times the scalar `factor`."""
        return dataclasses.replace(self, grads=scale(self.grads, factor))

    def as_float32(self):
        """The same record with float32 gradients (what the update computes with)."""
        return dataclasses.replace(self, grads=as_float32(self.grads))

    def all_finite(self):
        """Whether every gradient is finite (a boolean scalar tensor)."""
        return all_finite(self.grads)

    def rows(self):
        """The `[N, width]` gradients, spelled out where they are kept per bag."""
        return rows_of(self.grads)

    @staticmethod
    def concatenate(records, owner="An open-vocabulary table"):
        """Several records of one table (or a group's tables) as one, in order.

        Args:
            records: the `RowGrads` to join.
            owner: who the records are of, for the error when two of them carry
                an open vocabulary's choices.
        """
        if len(records) == 1:
            return records[0]
        changed = [r.changed for r in records if r.changed is not None]
        if len(changed) > 1:
            # Each training call of an open vocabulary chooses rows for its new
            # ids on its own: two calls could give one row to two ids.
            raise ValueError(
                f"{owner} was called {len(changed)} times in one training step; its map "
                "admits ids once per step. Pass all of the step's features in one call "
                "(`layer([ids_a, ids_b])` returns one output per feature).")
        read = state = None
        if all(r.read is not None for r in records):
            read = ops.concatenate([r.read for r in records], axis=0)
        if all(r.state is not None for r in records):
            state = {name: ops.concatenate([r.state[name] for r in records], axis=0)
                     for name in records[0].state}
        return RowGrads(ops.concatenate([r.ids for r in records], axis=0),
                        concatenate([r.grads for r in records]),
                        sum(r.calls for r in records), changed[0] if changed else None, read,
                        state)


class Distinct(NamedTuple):
    """A step deduplicated: each distinct id once, with its gradients summed.

    Args:
        ids: int `[M]`: the `count` distinct ids first; a backend may pad
            the rest with ids past the table (zero gradient), which its
            gather clamps and its scatter drops.
        grads: float32 `[M, width]` summed gradient of each entry.
        count: int32 scalar, the number of distinct ids.
    """

    ids: Any
    grads: Any
    count: Any

    def scaled(self, factor):
        """The same rows with every summed gradient times `factor`."""
        return self._replace(grads=self.grads * factor)


class Stacked:
    """Several tables' steps deduplicated at once (a table group): each table's `Distinct`.

    Where the backend gives each table's distinct ids a range of their own
    in one array (JAX), their summed gradients are kept in one array too.

    Args:
        parts: one `Distinct` per table, in the table's own rows.
        grads: float32 `[ids, width]` every table's summed gradients one after
            another, or None.
    """

    def __init__(self, parts, grads=None):
        self.parts, self.grads = list(parts), grads

    def squared_norm(self):
        """The squared L2 norm of every table's summed gradients (a float32 scalar)."""
        if self.grads is not None:
            return ops.sum(ops.square(self.grads))
        return ops.sum(ops.stack([ops.sum(ops.square(p.grads)) for p in self.parts]))


class BagGrads:
    """Row gradients of pooled lookups, kept per bag.

    Id `i`'s gradient is `weight[i] * values[bag[i]]`.

    Args:
        values: `[bags, width]` gradient of each pooled bag.
        bag: int32 `[ids]`, the bag of each id.
        weight: float32 `[ids]`, each id's pooling weight (1 for `"sum"`,
            `1 / valid ids of its bag` for `"mean"`, 0 for a dropped id).
    """

    def __init__(self, values, bag, weight):
        self.values, self.bag, self.weight = values, bag, weight

    def rows(self):
        """The `[ids, width]` gradients (for consumers that need them spelled out)."""
        return ops.take(self.values, self.bag, axis=0) * ops.expand_dims(self.weight, -1)


def rows_of(grads):
    """`grads` as a `[ids, width]` array."""
    return grads.rows() if isinstance(grads, BagGrads) else grads


def scale(grads, factor):
    """`grads` times a scalar."""
    if isinstance(grads, BagGrads):
        return BagGrads(grads.values * factor, grads.bag, grads.weight)
    return grads * factor


def as_float32(grads):
    if isinstance(grads, BagGrads):
        return BagGrads(ops.cast(grads.values, "float32"), grads.bag,
                        ops.cast(grads.weight, "float32"))
    return ops.cast(grads, "float32")


def all_finite(grads):
    """Whether every gradient is finite (for bags: every bag's gradient)."""
    values = grads.values if isinstance(grads, BagGrads) else grads
    return ops.all(ops.isfinite(values))


def concatenate(parts):
    """The gradients of several lookups (or tables), one after another."""
    if len(parts) == 1:
        return parts[0]
    if all(isinstance(p, BagGrads) for p in parts):
        bags, offset = [], 0
        for p in parts:
            bags.append(p.bag + offset)
            offset = offset + ops.shape(p.values)[0]
        return BagGrads(ops.concatenate([p.values for p in parts], axis=0),
                        ops.concatenate(bags, axis=0),
                        ops.concatenate([p.weight for p in parts], axis=0))
    return ops.concatenate([rows_of(p) for p in parts], axis=0)
