"""An int8 table's step: the rule on the rows the forward pass read, written back quantized.

The same rule as any table (`Updater.apply_rule` on float32 rows and float32
state), with two differences forced by where an int8 table lives
(`sparseopt.int8_table`):

- the rows the rule starts from are those the step's lookups read
  (`RowGrads.read`), picked for each distinct id at the position `dedup`
  left in the workspace for it (every occurrence of an id read the same
  row);
- the new rows are quantized here (seeded stochastic rounding, keyed like
  16-bit writes by seed, table, step, global row and column) and handed to
  the table's write buffer, which the layer's next call writes.

The updater's state is float32 (or `state_dtype`), updated in place as for
any table (whole slots first, from the step's rows, as `sparse_apply`
does). A skipped step (non-finite gradients) hands over nothing and leaves
the state as it was.
"""

from keras import ops

from sparseopt import backend, precision, quantization
from sparseopt.row_grads import Distinct
from sparseopt.sparse_apply import as_computed, whole_slot_values, write_whole_slots
from sparseopt.updaters import hyperparameters, transforms

# The stochastic-rounding stream of the table's codes (its slots use `1 + i`).
CODES_STREAM = 0


def finish_int8(updater, table, int8, slots, prepared, values, step, workspace, rounding,
                factor=None):
    """Applies the rule to a `prepare`d step of an int8 table.

    Args:
        updater: the table's `Updater`.
        table: the table's codes variable (for its shape and path).
        int8: its `sparseopt.int8_table.Int8Table`.
        slots: `{slot name: Keras variable}`.
        prepared: the `sparse_apply.Prepared` step (deduplicated on one device).
        values: the step's hyperparameters (`TableTrainer.values_at`).
        step: scalar int tensor, the 1-based update count.
        workspace: the dedup workspace `prepared` was deduplicated with.
        rounding: the table's `sparseopt.precision.Rounding`.
        factor: a scalar the gradients are multiplied by first (global
            clipping), or None.

    Returns:
        A boolean scalar tensor: whether the update was applied.
    """
    finite = prepared.finite
    if factor is not None:
        finite = ops.logical_and(finite, ops.isfinite(factor))
    if prepared.distinct is None:
        # Split by rows over devices: deduplicated here, by a hash of the step's ids
        # (batch-sized; the workspace is split like the table).
        distinct, positions = dedup_by_hash(prepared.record, table.shape[0])
        _check_read(prepared.record.read, table.path)
        rows = backend.gather(prepared.record.read, positions)
    else:
        distinct = prepared.distinct
        rows = rows_read(prepared.record.read, workspace, distinct.ids, table.path)
    if factor is not None:
        distinct = distinct.scaled(factor)
    update_int8(updater, table, int8, slots, distinct, rows, finite, values, step, rounding)
    return finite


def dedup_by_hash(record, num_rows):
    """`(Distinct, positions)` of `record` without a workspace: the distinct valid ids
    in order of first occurrence (then padding ids past the table), their summed
    gradients, and where in the record each first occurs.

    Args:
        record: the step's float32 `RowGrads`.
        num_rows: the table's rows.
    """
    ids = ops.cast(ops.reshape(record.ids, (-1,)), "int32")
    n = ids.shape[0]
    valid = ops.logical_and(ops.greater_equal(ids, 0), ops.less(ids, num_rows))
    first = backend.first_occurrences(ops.zeros_like(ids), ids, valid)
    position = ops.arange(n, dtype="int32")
    is_first = ops.logical_and(valid, ops.equal(first, position))
    slot = ops.cumsum(ops.cast(is_first, "int32")) - 1
    count = ops.sum(ops.cast(is_first, "int32"))
    size = min(n, num_rows)
    # Entries past `size` (invalid ids, and later occurrences' own slots) are cut off.
    segment = ops.where(valid, ops.take(slot, first), size)
    summed = ops.segment_sum(record.rows(), segment, num_segments=size + 1)[:size]
    at = ops.expand_dims(ops.where(is_first, slot, size), 1)
    padding = ops.arange(num_rows, num_rows + size + 1, dtype="int32")
    uniq = ops.scatter_update(padding, at, ids)[:size]
    positions = ops.scatter_update(ops.zeros((size + 1,), "int32"), at, position)[:size]
    return Distinct(uniq, summed, count), positions


def _check_read(read, table):
    if read is None:
        raise ValueError(f"Table '{table}' (int8): its step has no rows read by its lookup; "
                         "it can only be trained from `SparseLookup` calls.")


def rows_read(read, workspace, ids, table, offset=0):
    """The rows the step's lookups read for each distinct id: `[M, D]` float32.

    `dedup` left in `workspace[id]` the position of one occurrence of each id
    in the step's record (`read` holds that record's rows, in order); every
    occurrence read the same row.

    Args:
        read: float32 `[N, D]`, `RowGrads.read` of the step's record.
        workspace: the dedup workspace.
        ids: int32 `[M]` distinct ids (in the workspace's id space minus `offset`).
        table: the table's path, for the message.
        offset: the table's first id in the workspace (a group's shifted ids).
    """
    _check_read(read, table)
    positions = backend.gather(workspace.value, ids + offset)
    return backend.gather(read, positions)


def update_int8(updater, table, int8, slots, distinct, rows, finite, values, step, rounding):
    """The rule on `distinct`'s rows `rows` (as read), state in place, rows to the buffer.

    Args:
        distinct: the table's `Distinct` ids (in its own rows) and summed gradients.
        rows: float32 `[M, D]`, each distinct id's row as the step read it.
        finite: boolean scalar: whether to apply (else nothing changes).
        Others: as for `finish_int8`.
    """
    uniq, summed, count = distinct
    kinds = {spec.name: spec for spec in updater.slots}
    names = sorted(n for n in slots if kinds[n].per_row)
    state = {n: as_computed(backend.gather(slots[n].value, uniq)) for n in names}
    whole = _update_whole(updater, slots, rows, state, summed, count, finite, values, step,
                          table.shape[0])
    with hyperparameters.reading(updater, values):
        new_rows, new_state = updater.apply_rule(rows, {**state, **whole}, summed,
                                                 values["learning_rate"], step)
    index = precision.variable_indices(updater)
    for n in names:
        kept = ops.where(finite, new_state[n], state[n])
        backend.scatter(slots[n], uniq, rounding.stored(kept, slots[n].dtype, step, uniq,
                                                        index[n]))
    # (Padding entries, from `count` on, read real rows with zero gradient, and
    # are never written: the buffer keeps `count`.)
    codes, scale = quantized(new_rows, uniq, step, rounding)
    int8.hand_over(uniq, codes, scale, ops.where(finite, count, 0), table.path)


def _update_whole(updater, slots, rows, state, summed, count, finite, values, step,
                  num_rows):
    """Updates the whole slots (`"column"`, `"table"`) once from the step's rows, as
    `sparse_apply` does: the rule's contributions summed over the `count` distinct
    rows. Returns `{name: new float32 value}` (empty for most rules)."""
    specs = updater.whole_slots
    if not specs:
        return {}
    old = whole_slot_values(updater, slots)
    with hyperparameters.reading(updater, values):
        # The rows and gradients the rule will see (options applied first).
        seen, grads = transforms.before_rule(updater.transforms, rows, summed,
                                             values["learning_rate"], step)
        parts = updater.contributions(seen, {**state, **old}, grads, step)
    real = ops.less(ops.arange(ops.shape(rows)[0], dtype="int32"), count)
    sums = {k: ops.sum(ops.where(ops.reshape(real, (-1,) + (1,) * (len(v.shape) - 1)), v, 0.0),
                       axis=0) for k, v in parts.items()}
    return write_whole_slots(updater, slots, old, sums, num_rows, step, finite, values)


def quantized(rows, ids, step, rounding):
    """`(codes, scale)` of float32 `rows` (rows `ids`) written at `step` with `rounding`.

    Stochastic rounding draws the documented bits of (seed, table, stream 0,
    step, global row, column), as a 16-bit table's writes do; else to nearest.
    """
    bits = None
    if rounding.stochastic:
        global_ids = ops.cast(ids, "int32") + ops.cast(rounding.row_offset, "int32")
        bits = precision.random_bits(
            precision.stream_key(rounding.seed, rounding.table_index, CODES_STREAM), step,
            global_ids, rows.shape[1])
    return quantization.quantize(rows, bits)
