"""The shared machinery around an updater's rule: dedup, gather, rule, scatter.

Written once with `keras.ops` plus the backend primitives; the cost is
proportional to the ids in the batch, never to the number of rows. Where the
backend has its own fused kernel for exactly the updater's rule (TensorFlow's
sparse-apply kernels), that kernel replaces gather, rule and scatter. Where a
table is split by rows over devices (`keras.distribution`), the same steps
run on each shard, on the ids that shard owns.
"""

from keras import ops

from sparseopt import backend, precision, row_grads


def sparse_apply(updater, table, slots, ids, grads, learning_rate, step, workspace=None,
                 rounding=None):
    """Updates the touched rows of `table` and its `slots` in place.

    Args:
        updater: the `Updater` whose rule to apply.
        table: the `[V, D]` Keras variable.
        slots: dict slot name -> Keras variable (`[V, D]` or `[V]`).
        ids: int `[N]` ids, duplicates allowed; ids outside `[0, V)` are
            ignored.
        grads: `[N, D]` true (unscaled) gradient of each occurrence, or the
            same as `row_grads.BagGrads`. If any entry is not finite, the
            table and its state are left unchanged.
        learning_rate: scalar tensor.
        step: scalar int tensor, the 1-based update count.
        workspace: where `backend.WORKSPACE` is true, an int32 variable with
            at least `V` entries for the dedup (contents do not matter).
        rounding: a `sparseopt.precision.Rounding`, how 16-bit rows and
            state are written; defaults to stochastic rounding with seed 0.

    Returns:
        A boolean scalar tensor: whether the update was applied.
    """
    rounding = rounding or precision.Rounding()
    shards = backend.row_shards(table)
    if shards is not None:
        return backend.on_row_shards(_apply, shards, updater, table, slots, ids, grads,
                                     learning_rate, step, workspace, rounding)
    return _apply(updater, table, slots, ids, grads, learning_rate, step, workspace, rounding)


def _apply(updater, table, slots, ids, grads, learning_rate, step, workspace, rounding):
    grads = row_grads.as_float32(grads)
    uniq, summed, count = backend.dedup(ids, grads, table.shape[0], workspace)
    # A non-finite gradient skips the whole table for this step.
    finite = row_grads.all_finite(grads)
    _update_distinct(updater, table, slots, uniq, summed, count, finite, learning_rate, step,
                     rounding)
    return finite


def sparse_apply_group(updater, members, learning_rate, step, workspace=None,
                       roundings=None):
    """Updates several tables that share one updater configuration, in one dedup.

    The ids of every table are shifted into one id space (table `t`'s rows
    follow table `t-1`'s) and deduplicated together; `dedup` keeps the
    distinct ids in order of first occurrence, so each table's distinct ids
    come out as one contiguous run, which `backend.split_by_table` hands to
    that table's gather, rule and scatter. Each table keeps its own
    finiteness check: a non-finite gradient skips its own table only.

    Args:
        updater: the `Updater` every member uses.
        members: list of `(table, slots, ids, grads)`, as for `sparse_apply`.
            Tables must not be split over devices.
        learning_rate: scalar tensor.
        step: scalar int tensor, the 1-based update count.
        workspace: where `backend.WORKSPACE` is true, an int32 variable with
            at least as many entries as the members have rows together.
        roundings: one `sparseopt.precision.Rounding` per member, or None
            for the default.

    Returns:
        A list of boolean scalar tensors: whether each member's update was applied.
    """
    offsets, total = [], 0
    for table, _, _, _ in members:
        offsets.append(total)
        total += table.shape[0]
    if total > MAX_GROUP_ROWS:
        raise ValueError(
            f"sparse_apply_group: the tables {[m[0].path for m in members]} have {total:,} "
            f"rows together, more than a group's {MAX_GROUP_ROWS:,}; update them in "
            "smaller groups.")
    shifted, all_grads, finite = [], [], []
    for (table, _, ids, grads), offset in zip(members, offsets):
        grads = row_grads.as_float32(grads)
        # Validity is judged on the ids as given, before they are narrowed.
        valid = ops.logical_and(ops.greater_equal(ids, 0), ops.less(ids, table.shape[0]))
        local = ops.cast(ops.where(valid, ids, 0), "int32")
        shifted.append(ops.where(valid, local + offset, total))  # invalid: in no table
        all_grads.append(grads)
        finite.append(row_grads.all_finite(grads))
    uniq, summed, count = backend.dedup(ops.concatenate(shifted, axis=0),
                                        row_grads.concatenate(all_grads), total, workspace)
    # Each table's distinct ids, in its own rows, as its own dedup result.
    sizes = [table.shape[0] if ids.shape[0] is None else min(ids.shape[0], table.shape[0])
             for table, _, ids, _ in members]  # static bounds (JAX slices by them)
    parts = backend.split_by_table(uniq, summed, offsets + [total], sizes)
    roundings = roundings or [precision.Rounding()] * len(members)
    for (table, slots, _, _), part, ok, rounding in zip(members, parts, finite, roundings):
        _update_distinct(updater, table, slots, *part, ok, learning_rate, step, rounding)
    return finite


def as_computed(values):
    """State as rules compute with it: float32, or its own dtype for integer state."""
    return values if "int" in str(values.dtype) else ops.cast(values, "float32")


# A group's shifted ids are int32 (JAX without x64 has no int64): its tables
# have at most this many rows together, which leaves room for `dedup`'s
# padding ids above them.
MAX_GROUP_ROWS = 2**30


def _update_distinct(updater, table, slots, uniq, summed, count, finite, learning_rate, step,
                     rounding):
    """Gather, rule and scatter on `dedup`'s distinct ids (skipped where not `finite`)."""
    if backend.fused_apply(updater, table, slots, uniq, summed, learning_rate, finite):
        return
    names = sorted(slots)
    index = precision.variable_indices(updater)  # each variable's own rounding bits

    def update(variables, uniq, summed):
        table, state_vars = variables[0], dict(zip(names, variables[1:]))
        rows = ops.cast(backend.gather(table.value, uniq), "float32")
        # Float state is computed in float32; integer state (the row's last
        # step where `lazy=False`) keeps its dtype.
        state = {n: as_computed(backend.gather(v.value, uniq)) for n, v in state_vars.items()}
        new_rows, new_state = updater.apply_rule(rows, state, summed, learning_rate, step)
        # Skipping selects the old rows back (cheap: only touched rows)
        # instead of branching.
        new_rows = ops.where(finite, new_rows, rows)
        new_state = {n: ops.where(finite, new_state[n], state[n]) for n in names}
        new_rows, new_state = backend.materialize((new_rows, new_state))
        # 16-bit variables: rounded here (stochastically unless turned off).
        backend.scatter(table, uniq, rounding.stored(new_rows, table.dtype, step, uniq))
        for n, var in state_vars.items():
            backend.scatter(var, uniq, rounding.stored(new_state[n], var.dtype, step, uniq,
                                                       index[n]))

    # Only the step's distinct rows: work follows them, not the batch.
    backend.for_distinct_rows(update, [table] + [slots[n] for n in names], uniq, summed, count)
