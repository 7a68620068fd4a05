"""TensorFlow: the step's distinct rows, from its record: one table's dedup (a workspace, an
XLA-compiled count and segment sum), a group's, and the loops over them."""

import tensorflow as tf

from sparseopt import compat
from sparseopt.backend.tensorflow_replicas import local
from sparseopt.records import BagGrads, Distinct, RowGrads, Stacked


# Dedup writes into a persistent int32 workspace, as on JAX (see
# `sparseopt.backend.jax.dedup`), with one more entry that invalid ids write
# to: TF's scatter has no "drop out-of-range" mode.
WORKSPACE = True
WORKSPACE_SINK = 1


def dedup(record, num_rows, workspace):
    """The `Distinct` rows of `record`'s valid ids only.

    Every occurrence writes its position into `workspace[id]`
    (`ResourceScatterUpdate`, in place) and reads it back
    (`ResourceGather`): every occurrence of an id gets the same
    representative. A running count of representatives then packs the
    distinct ids and their summed gradients in the order of the positions
    that landed (each id's last occurrence where TF's scatter runs serially,
    below 1,024 ids), in one XLA-compiled function. This replaces
    `tf.unique`, whose single-threaded hash table took 17 / 98 ms for
    327,680 / 1,310,720 skewed ids against 9.6 / 35 ms here (measured). The
    workspace never enters the XLA function: passed in, TF copied it whole on
    every call (42 ms for 200M rows, measured). Where the native op is on
    (`tensorflow_native`), one op does all of this.

    Args:
        record: the `RowGrads` (ids outside `[0, num_rows)` are ignored).
        num_rows: the table's row count.
        workspace: int32 Keras variable with `num_rows + WORKSPACE_SINK` entries.
    """
    grads = record.grads
    ids = tf.cast(record.ids, tf.int64)
    num_rows = tf.constant(num_rows, tf.int64)
    at = tf.where((ids >= 0) & (ids < num_rows), ids, num_rows)  # invalid: the sink
    space = local(workspace)
    space.scatter_update(tf.IndexedSlices(tf.range(tf.size(ids, out_type=tf.int32)), at))
    representative = tf.gather(space, at)
    # Few ids: op by op (an XLA compilation per shape costs more than it saves).
    few = ids.shape[0] is not None and ids.shape[0] < COMPILED_DEDUP_MIN_IDS
    if isinstance(grads, BagGrads):  # expanded inside the (compiled) sum
        run = _dedup_bags if few else _compiled_dedup_bags
        uniq, summed, count = run(ids, representative, num_rows, grads.values, grads.bag,
                                  grads.weight)
    else:
        run = _dedup_rows if few else _compiled_dedup_rows
        uniq, summed, count = run(ids, representative, num_rows, grads)
    return trimmed(Distinct(uniq[:-1], summed, count))


def scratch_workspace(n):
    """None: TF's dedup writes a workspace variable (one made in a step would be a
    new variable per trace).

    Args:
        n: the ids' bound (unused).
    """
    return None


def trimmed(distinct):
    """`distinct` with its `count` first entries only (what the step works on).

    Args:
        distinct: a `Distinct` padded past its `count` distinct entries.
    """
    count = distinct.count
    if compat.in_xla_context():
        # Inside an XLA cluster, slicing at a computed bound does not compile
        # (and boolean_mask returned wrong rows, TF 2.21); dynamic_partition
        # selects correctly in both modes.
        first = tf.cast(tf.range(tf.shape(distinct.grads)[0]) < count, tf.int32)
        return Distinct(tf.dynamic_partition(distinct.ids, first, 2)[1],
                        tf.dynamic_partition(distinct.grads, first, 2)[1], count)
    return Distinct(distinct.ids[:count], distinct.grads[:count], count)


# Dedups of fewer ids than this (known when traced) run op by op.
COMPILED_DEDUP_MIN_IDS = 4096


def _distinct(ids, representative, num_rows, rows):
    """The XLA part of `dedup`: distinct ids first and their summed gradients.

    TF's CPU `UnsortedSegmentSum` kernel is single-threaded (1.0 vs 0.4 ms
    compiled for 16k x 32, measured), hence XLA. Results have the static
    size `N`; the caller slices off the tail.
    """
    n = tf.shape(ids)[0]
    valid = (ids >= 0) & (ids < num_rows)
    is_first = valid & (representative == tf.range(n))
    slot = tf.cumsum(tf.cast(is_first, tf.int32)) - 1
    # -1 (dropped by the sum) for invalid ids.
    segment = tf.where(valid, tf.gather(slot, tf.where(valid, representative, 0)), -1)
    summed = tf.math.unsorted_segment_sum(rows(), segment, n)
    uniq = tf.tensor_scatter_nd_update(  # entry `n` takes the ids that are not first
        tf.zeros([n + 1], ids.dtype), tf.where(is_first, slot, n)[:, None], ids)
    return uniq, summed, tf.reduce_sum(tf.cast(is_first, tf.int32))


def _dedup_rows(ids, representative, num_rows, grads):
    return _distinct(ids, representative, num_rows, lambda: grads)


def _dedup_bags(ids, representative, num_rows, values, bag, weight):
    return _distinct(ids, representative, num_rows,
                     lambda: tf.gather(values, bag) * weight[:, None])


# The same two, compiled by XLA (`dedup` picks by the number of ids).
_compiled_dedup_rows, _compiled_dedup_bags = (
    tf.function(f, jit_compile=True, reduce_retracing=True, autograph=False)
    for f in (_dedup_rows, _dedup_bags))


def for_distinct_rows(update, variables, distinct):
    """`update(variables, ids, grads)`: `dedup`'s result is exactly the distinct ids."""
    update(variables, distinct.ids, distinct.grads)


def sum_over_distinct_rows(contribute, distinct, num_rows):
    """`contribute(ids, grads)` (`{name: [U, ...]}`) summed over the distinct rows:
    `dedup`'s result is exactly those."""
    parts = contribute(distinct.ids, distinct.grads)
    return {k: tf.reduce_sum(v, axis=0) for k, v in parts.items()}


def dedup_tables(records, num_rows, workspace, dedup):
    """One dedup of a group's records: their ids shifted into one id space (table
    `t`'s rows after table `t-1`'s; invalid ids in no table), `dedup` of them all
    (the pure path or the native op), then each table's part cut out by one
    `dynamic_partition` (which, unlike slicing at computed bounds, also compiles
    inside an XLA cluster). Its distinct ids are in the order `dedup` numbers
    them; the parts have no ranges (`stride` None)."""
    offsets, total = [], 0
    for rows in num_rows:
        offsets.append(total)
        total += rows
    shifted = []
    for record, rows, offset in zip(records, num_rows, offsets):
        ids = tf.cast(record.ids, tf.int64)
        valid = (ids >= 0) & (ids < rows)
        shifted.append(RowGrads(tf.where(valid, ids + offset, total), record.grads))
    found = dedup(RowGrads.concatenate(shifted), total, workspace)
    uniq = found.ids
    starts = tf.constant(offsets, uniq.dtype)
    table = tf.searchsorted(starts[1:], uniq, side="right")
    local = uniq - tf.gather(starts, table)
    ids = tf.dynamic_partition(local, table, len(records))
    grads = tf.dynamic_partition(found.grads, table, len(records))
    return Stacked([Distinct(i, g, tf.size(i)) for i, g in zip(ids, grads)])


def for_listed_rows(update, variables, ids, count):
    # A gather of the `count` first (a slice would read the whole list first).
    update(variables, tf.gather(local(ids), tf.range(count)))
