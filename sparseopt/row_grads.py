"""Row gradients as a table's trainer receives them: one row per id, or one per bag.

A lookup's backward pass yields the gradient of every id it read. For a
pooled lookup (`SparseEmbedding(combiner="sum"|"mean")`) those are the bag's
one gradient repeated for each id of the bag, times the id's pooling weight:
`BagGrads` keeps them in that form, so that the `[ids, width]` array is never
built; the dedup's segment sum reads each id's bag row directly. Everything
that handles row gradients goes through the functions below, which take
either form.
"""

from keras import ops


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
