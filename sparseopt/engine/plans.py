"""Plans: where the stages of a step run, for one table, a table split by rows, or a group.

Every plan runs the same stages (`sparseopt.engine.stages`) in two halves,
so that global clipping can take one norm over everything in between:

- `prepare`: the step's record checked and deduplicated (stages 1-2);
- `finish`: rows read, rule, rows written (stages 3-5), with the clipping
  factor if any; returns whether the step applied (per table).

What differs is only where they run:

- one table on one device: its own dedup, then its distinct rows in chunks;
- a table split by rows over devices (`keras.distribution`): the whole
  slots once from a global dedup, then each shard its own ids
  (`backend.on_row_shards`); an int8 table is deduplicated by a hash of the
  step's ids instead (its workspace is split like the table) and updated
  at once;
- a group of tables sharing width and updater configuration: one dedup for
  all of them (ids shifted into one id space), then each member's rows.
"""

import numpy as np
from keras import ops

from sparseopt import backend
from sparseopt.engine.stages import (
    Context, checked, distinct, distinct_by_hash, prepare, update_rows, update_whole)
from sparseopt.records import BagGrads, Distinct, RowGrads

# A group's shifted ids are int32 (JAX without x64 has no int64): its tables
# have at most this many rows together, which leaves room for `dedup`'s
# padding ids above them.
MAX_GROUP_ROWS = 2**30


def finish(updater, storage, prepared, values, step, factor=None):
    """Stages 3-5 of one table's `stages.prepare`d step, in place.

    Args:
        updater: the table's `Updater`.
        storage: its `RowStorage`.
        prepared: the `stages.Prepared` step.
        values: `{name: scalar tensor}`, the step's hyperparameters.
        step: scalar int tensor, the 1-based update count.
        factor: a scalar the gradients are multiplied by first (global
            clipping), or None. A non-finite factor skips the step.

    Returns:
        A boolean scalar tensor: whether the update was applied.
    """
    finite = checked(prepared.finite, factor)
    if prepared.distinct is None:
        if storage.reads_lookups:
            return _at_once_by_hash(updater, storage, prepared, values, step, factor, finite)
        return _on_row_shards(updater, storage, prepared, values, step, factor, finite)
    found = prepared.distinct if factor is None else prepared.distinct.scaled(factor)
    update_rows(updater, storage, found, finite, values, step, prepared.context())
    return finite


def _on_row_shards(updater, storage, prepared, values, step, factor, finite):
    """`finish` of a table split by rows over devices.

    Whole slots (replicated) are updated first, once, from the step's
    distinct rows over the whole table (deduplicated globally, as
    `Prepared.squared_norm` does), with the step's global finiteness; each
    shard then runs its own dedup and the row stages on the ids it owns,
    reading their new values. So every shard reads the same whole state,
    which is updated once per step however the ids are routed.
    """
    whole = {}
    if updater.whole_slots:
        found = prepared.global_distinct()
        if factor is not None:
            found = found.scaled(factor)
        whole = update_whole(updater, storage, found, finite, values, step)
    record = prepared.record if factor is None else prepared.record.scaled(factor)

    def run(blocks, local_record, carried, first_row):
        values, whole, step = carried
        view = storage.over(blocks[:-1], first_row)
        local = prepare(local_record, view.table.shape[0], blocks[-1])
        update_rows(updater, view, local.distinct, local.finite, values, step, whole=whole)
        return local.finite

    return backend.on_row_shards(run, backend.row_shards(storage.table),
                                 storage.variables() + [prepared.workspace], record,
                                 (values, whole, step))


def _at_once_by_hash(updater, storage, prepared, values, step, factor, finite):
    """`finish` of an int8 table split by rows: deduplicated here by a hash of the step's
    ids (batch-sized: its workspace is split like the table), then every distinct
    row at once, read from where the lookups read it."""
    found, positions = distinct_by_hash(prepared.record, prepared.num_rows)
    if factor is not None:
        found = found.scaled(factor)
    update_rows(updater, storage, found, finite, values, step,
                Context(prepared.record, None, positions=positions))
    return finite


class PreparedGroup:
    """A group's step after its one dedup: each member's `Distinct` rows.

    Args:
        stacked: the `Stacked` dedup of every member (`backend.dedup_tables`).
        finite: one boolean scalar per member.
        record: the members' records one after another (the rows an int8
            member's lookups read are found there).
        workspace: the group's dedup workspace.
        offsets: each member's first id in the workspace.
        owners: what the caller keeps per member, in order (a `TableGroup`:
            its members' `TableTrainer`s), for `finish_group`'s caller.
    """

    def __init__(self, stacked, finite, record, workspace, offsets, owners=()):
        self.stacked, self.finite, self.record = stacked, finite, record
        self.workspace, self.offsets = workspace, offsets
        self.owners = list(owners)

    def squared_norm(self):
        """The squared L2 norm of every member's summed row gradients."""
        return self.stacked.squared_norm()


def prepare_group(members, workspace=None, owners=()):
    """Stages 1-2 of a group, at once: a `PreparedGroup`.

    One dedup for every member's ids (`backend.dedup_tables`: shifted into
    one id space, one workspace). Each member keeps its own finiteness: a
    non-finite gradient skips its own table only.

    Args:
        members: list of `(num_rows, record)`.
        workspace: an int32 variable with at least as many entries as the
            members have rows together.
        owners: as for `PreparedGroup`.
    """
    num_rows = [rows for rows, _ in members]
    total = sum(num_rows)
    if total > MAX_GROUP_ROWS:
        raise ValueError(
            f"A table group has {total:,} rows together, more than a group's "
            f"{MAX_GROUP_ROWS:,}; update its tables in smaller groups.")
    records = [record.as_float32() for _, record in members]
    stacked = backend.dedup_tables(records, num_rows, workspace, distinct)
    offsets = [int(o) for o in np.cumsum([0] + num_rows[:-1])]
    record = RowGrads.concatenate(records)
    return PreparedGroup(stacked, finite_per_table(records, record), record, workspace,
                         offsets, owners)


def finite_per_table(records, joined):
    """Whether all of each record's gradients are finite: a boolean `[records]`.

    One check over the records' rows one after another (`joined`, their
    concatenation; for pooled ones, their bags), counted per record, where
    their sizes are static; else one check per record.
    """
    values = [r.grads.values if isinstance(r.grads, BagGrads) else r.grads for r in records]
    sizes = [v.shape[0] for v in values]
    if any(n is None for n in sizes) or len(records) == 1:
        return ops.stack([r.all_finite() for r in records])
    rows = joined.grads.values if isinstance(joined.grads, BagGrads) else joined.grads
    bad = 1 - ops.cast(ops.all(ops.isfinite(rows), axis=-1), "int32")
    starts = np.cumsum(sizes)[:-1].astype("int32")
    position = ops.arange(sum(sizes), dtype="int32")
    which = ops.sum(ops.cast(ops.greater_equal(ops.expand_dims(position, 1), starts[None, :]),
                             "int32"), axis=1)
    return ops.equal(ops.segment_sum(bad, which, num_segments=len(records)), 0)


def finish_group(updater, storages, prepared, values, step, factor=None):
    """Stages 3-5 of each member of a `prepare_group`ed step, in place.

    Each member reads, updates and writes its own rows (through its own
    storage, with its own hyperparameters and finiteness), exactly as it
    would alone.

    Args:
        updater: the shared `Updater`.
        storages: each member's `RowStorage`, in `prepare_group`'s order.
        prepared: the `PreparedGroup`.
        values: one `{name: scalar}` per member, its hyperparameters.
        step: scalar int tensor, the 1-based update count.
        factor: as for `finish`.

    Returns:
        A boolean `[members]`: whether each member's update was applied.
    """
    finite = checked(prepared.finite, factor)
    for t, (storage, part, offset) in enumerate(zip(storages, prepared.stacked.parts,
                                                    prepared.offsets)):
        if factor is not None:
            part = part.scaled(factor)
        update_rows(updater, storage, part, finite[t], values[t], step,
                    Context(prepared.record, prepared.workspace, offset))
    return finite
