"""The shared machinery around an updater's rule: dedup, gather, rule, scatter.

Written once with `keras.ops` plus the backend primitives; the cost is
proportional to the ids in the batch, never to the number of rows. Where the
backend has its own fused kernel for exactly the updater's rule (TensorFlow's
sparse-apply kernels), that kernel replaces gather, rule and scatter. Where a
table is split by rows over devices (`keras.distribution`), the same steps
run on each shard, on the ids that shard owns.
"""

from keras import ops

from sparseopt import backend, precision
from sparseopt.row_grads import RowGrads
from sparseopt.updaters import hyperparameters, transforms


def sparse_apply(updater, table, slots, record, learning_rate, step, workspace=None,
                 rounding=None, values=None):
    """Updates the touched rows of `table` and its `slots` in place.

    The backend's native step where it has one for this table
    (`backend.native_step`, which then does dedup, sums and writes itself);
    else `prepare` then `finish` (which is what a trainer runs, with global
    clipping in between when asked).

    Args:
        updater: the `Updater` whose rule to apply.
        table: the `[V, D]` Keras variable.
        slots: dict slot name -> Keras variable (`[V, D]` or `[V]`).
        record: the step's `sparseopt.row_grads.RowGrads`: ids (duplicates
            allowed; ids outside `[0, V)` are ignored) and their true
            (unscaled) gradients. If any is not finite, the table and its
            state are left unchanged.
        learning_rate: scalar tensor.
        step: scalar int tensor, the 1-based update count.
        workspace: where `backend.WORKSPACE` is true, an int32 variable with
            at least `V` entries for the dedup (contents do not matter).
        rounding: a `sparseopt.precision.Rounding`, how 16-bit rows and
            state are written; defaults to stochastic rounding with seed 0.
        values: `{name: scalar tensor}`, every hyperparameter of the updater
            for this step (a trainer's variables, `TableTrainer.values_at`);
            None: the updater's own (`Updater.values_at`).

    Returns:
        A boolean scalar tensor: whether the update was applied.
    """
    if values is None:
        values = {**updater.values_at(step), "learning_rate": learning_rate}
    rounding = rounding or precision.Rounding()
    applied = backend.native_step(updater, table, slots, record, values, step, workspace,
                                  rounding)
    if applied is not None:
        return applied
    return finish(updater, table, slots, prepare(table, record, workspace), values, step,
                  workspace, rounding)


class Prepared:
    """One table's step between its dedup and its rule.

    A table on one device is deduplicated here, once (`distinct`); a table
    whose rows are split over devices keeps the step's record as given
    (each shard deduplicates its own, `backend.on_row_shards`).

    Args:
        record: the step's `RowGrads`, float32.
        finite: boolean scalar: whether every gradient is finite.
        distinct: the `Distinct` rows from `backend.dedup`, or None.
        num_rows: the table's rows.
        workspace: the table's dedup workspace (or None).
    """

    def __init__(self, record, finite, distinct, num_rows, workspace):
        self.record, self.finite = record, finite
        self.distinct, self.num_rows, self.workspace = distinct, num_rows, workspace
        self._global = None  # `global_distinct`, once computed

    def global_distinct(self):
        """The step's `Distinct` rows over the whole table.

        A table split over devices is deduplicated globally for it, once
        (each shard also deduplicates its own ids when it updates them).
        """
        if self.distinct is None and self._global is None:
            self._global = backend.dedup(self.record, self.num_rows, self.workspace)
        return self.distinct if self.distinct is not None else self._global

    def squared_norm(self):
        """The squared L2 norm of the table's gradient: of each distinct row's summed one.

        What a dense optimizer's `global_clipnorm` sees of this table.
        """
        return ops.sum(ops.square(self.global_distinct().grads))


def prepare(table, record, workspace=None):
    """The step of `table` deduplicated (on one device) and checked: a `Prepared`.

    Args:
        table: the `[V, D]` Keras variable.
        record, workspace: as for `sparse_apply`.
    """
    record = record.as_float32()
    # A non-finite gradient skips the whole table for this step.
    finite = record.all_finite()
    distinct = None
    if backend.row_shards(table) is None:
        distinct = backend.dedup(record, table.shape[0], workspace)
    return Prepared(record, finite, distinct, table.shape[0], workspace)


def finish(updater, table, slots, prepared, values, step, workspace=None, rounding=None,
           factor=None):
    """Applies the rule to a `prepare`d step, in place.

    Args:
        updater, table, slots, values, step, workspace, rounding: as for `sparse_apply`.
        prepared: the `Prepared` step of `table`.
        factor: a scalar the gradients are multiplied by first (global
            clipping), or None. A non-finite factor skips the step.

    Returns:
        A boolean scalar tensor: whether the update was applied.
    """
    rounding = rounding or precision.Rounding()
    finite = prepared.finite
    if factor is not None:
        finite = ops.logical_and(finite, ops.isfinite(factor))
    if prepared.distinct is None:
        return _finish_on_row_shards(updater, table, slots, prepared, values, step, workspace,
                                     rounding, factor, finite)
    distinct = prepared.distinct
    if factor is not None:
        distinct = distinct.scaled(factor)
    _update_distinct(updater, table, slots, distinct, finite, values, step, rounding)
    return finite


def _finish_on_row_shards(updater, table, slots, prepared, values, step, workspace, rounding,
                          factor, finite):
    """`finish` of a table split by rows over devices.

    Whole slots (replicated) are updated first, once, from the step's
    distinct rows over the whole table (deduplicated globally, as
    `Prepared.squared_norm` does), with the step's global finiteness; each
    shard then runs the row rule on the ids it owns, reading their new values
    (`_apply_shard`). So every shard reads the same whole state, which is
    updated once per step however the ids are routed.
    """
    split = {n: v for n, v in slots.items() if _kinds(updater)[n].per_row}
    whole = {}
    if updater.whole_slots:
        distinct = prepared.global_distinct()
        if factor is not None:
            distinct = distinct.scaled(factor)
        whole = _update_whole(updater, table, slots, sorted(split), distinct, finite, values,
                              step)
    record = prepared.record if factor is None else prepared.record.scaled(factor)
    # `(values, whole)` go to every shard as they are (replicated).
    return backend.on_row_shards(_apply_shard, backend.row_shards(table), updater, table,
                                 split, record, (values, whole), step, workspace, rounding)


def _apply_shard(updater, table, slots, record, carried, step, workspace, rounding):
    """Dedup, rule and scatter of one row shard (in `on_row_shards`).

    `carried`: `(values, whole)`, the step's hyperparameters and the whole
    slots' new values.
    """
    values, whole = carried
    prepared = prepare(table, record, workspace)
    _update_distinct(updater, table, slots, prepared.distinct, prepared.finite, values, step,
                     rounding, whole=whole)
    return prepared.finite


def _kinds(updater):
    """`{slot name: SlotSpec}` of `updater`."""
    return {spec.name: spec for spec in updater.slots}


def sparse_apply_group(updater, members, learning_rate, step, workspace=None,
                       roundings=None, values=None):
    """Updates several tables that share one updater configuration, in one dedup.

    `prepare_group` then `finish_group`.

    Args:
        updater: the `Updater` every member uses.
        members: list of `(table, slots, record)`, as for `sparse_apply`.
            Tables must not be split over devices.
        learning_rate: scalar tensor (unused where `values` are given).
        step: scalar int tensor, the 1-based update count.
        workspace: where `backend.WORKSPACE` is true, an int32 variable with
            at least as many entries as the members have rows together.
        roundings: one `sparseopt.precision.Rounding` per member, or None
            for the default.
        values: one `{name: scalar tensor}` per member, as for `sparse_apply`,
            or None for the updater's own.

    Returns:
        A list of boolean scalar tensors: whether each member's update was applied.
    """
    if values is None:
        values = [{**updater.values_at(step), "learning_rate": learning_rate}] * len(members)
    prepared = prepare_group([(t, record) for t, _, record in members], workspace)
    return finish_group(updater, [(t, slots) for t, slots, _ in members], prepared, values,
                        step, roundings)


class PreparedGroup:
    """A table group's step after its one dedup: `distinct` over the shifted ids.

    Args:
        distinct: the `Distinct` rows from `backend.dedup` of the shifted ids.
        finite: one boolean scalar per member.
        offsets: each member's first shifted id, then the total row count.
        sizes: static bounds on each member's distinct ids.
    """

    def __init__(self, distinct, finite, offsets, sizes):
        self.distinct, self.finite, self.offsets, self.sizes = distinct, finite, offsets, sizes
        self.trainers = []  # the members' `TableTrainer`s, where a `TableGroup` prepared it

    def squared_norm(self):
        """The squared L2 norm of every member's summed row gradients."""
        return ops.sum(ops.square(self.distinct.grads))


def prepare_group(members, workspace=None):
    """Dedups a group's step at once: a `PreparedGroup`.

    The ids of every table are shifted into one id space (table `t`'s rows
    follow table `t-1`'s) and deduplicated together; `dedup` numbers the
    distinct ids in the order of their (representative) positions, so each
    table's distinct ids come out as one contiguous run, which `finish_group` hands to that
    table's gather, rule and scatter. Each table keeps its own finiteness
    check: a non-finite gradient skips its own table only.

    Args:
        members: list of `(table, record)`.
        workspace: as for `sparse_apply_group`.
    """
    offsets, total = [], 0
    for table, _ in members:
        offsets.append(total)
        total += table.shape[0]
    if total > MAX_GROUP_ROWS:
        raise ValueError(
            f"sparse_apply_group: the tables {[m[0].path for m in members]} have {total:,} "
            f"rows together, more than a group's {MAX_GROUP_ROWS:,}; update them in "
            "smaller groups.")
    shifted, finite = [], []
    for (table, record), offset in zip(members, offsets):
        ids = record.ids
        # Validity is judged on the ids as given, before they are narrowed.
        valid = ops.logical_and(ops.greater_equal(ids, 0), ops.less(ids, table.shape[0]))
        local = ops.cast(ops.where(valid, ids, 0), "int32")
        # Invalid: in no table.
        shifted.append(RowGrads(ops.where(valid, local + offset, total),
                                record.grads, read=record.read).as_float32())
        finite.append(shifted[-1].all_finite())
    record = RowGrads.concatenate(shifted)
    distinct = backend.dedup(record, total, workspace)
    sizes = [table.shape[0] if r.ids.shape[0] is None else min(r.ids.shape[0], table.shape[0])
             for table, r in members]  # static bounds (JAX slices by them)
    prepared = PreparedGroup(distinct, finite, offsets + [total], sizes)
    # int8 tables' rows as their lookups read them (`sparseopt.int8_apply`).
    prepared.read, prepared.workspace = record.read, workspace
    return prepared


def finish_group(updater, members, prepared, values, step, roundings=None, factor=None):
    """Applies the rule to each member of a `prepare_group`ed step, in place.

    Args:
        updater: the shared `Updater`.
        members: list of `(table, slots)`, in `prepare_group`'s order.
        prepared: the `PreparedGroup`.
        values: one `{name: scalar tensor}` per member.
        step: scalar int tensor, the 1-based update count.
        roundings: one `Rounding` per member, or None.
        factor: as for `finish`.

    Returns:
        A list of boolean scalar tensors: whether each member's update was applied.
    """
    distinct, finite = prepared.distinct, prepared.finite
    if factor is not None:
        distinct = distinct.scaled(factor)
        finite = [ops.logical_and(ok, ops.isfinite(factor)) for ok in finite]
    # Each table's distinct ids, in its own rows, as its own dedup result.
    parts = backend.split_by_table(distinct, prepared.offsets, prepared.sizes)
    roundings = roundings or [precision.Rounding()] * len(members)
    for (table, slots), part, ok, rounding, own in zip(members, parts, finite, roundings,
                                                        values):
        _update_distinct(updater, table, slots, part, ok, own, step, rounding)
    return finite


def as_computed(values):
    """State as rules compute with it: float32, or its own dtype for integer state."""
    return values if "int" in str(values.dtype) else ops.cast(values, "float32")


# A group's shifted ids are int32 (JAX without x64 has no int64): its tables
# have at most this many rows together, which leaves room for `dedup`'s
# padding ids above them.
MAX_GROUP_ROWS = 2**30


def _update_distinct(updater, table, slots, distinct, finite, values, step, rounding,
                     whole=None):
    """Gather, rule and scatter on the `Distinct` rows (skipped where not `finite`).

    Whole slots (`"column"`, `"table"`) are updated first, once, from the
    rule's contributions summed over every distinct row (`_update_whole`);
    the row rule then reads their new values.

    Args:
        values: the step's hyperparameters (`sparse_apply`), which the rule reads.
        whole: the whole slots' new values where they were updated already
            (a row shard's step: `_finish_on_row_shards`); None: update them here.
    """
    learning_rate = values["learning_rate"]
    if backend.fused_apply(updater, table, slots, distinct, values, finite):
        return
    kinds = _kinds(updater)
    names = sorted(n for n in slots if kinds[n].per_row)
    index = precision.variable_indices(updater)  # each variable's own rounding bits
    if whole is None:
        whole = _update_whole(updater, table, slots, names, distinct, finite, values, step)

    def update(variables, uniq, summed):
        table, state_vars = variables[0], dict(zip(names, variables[1:]))
        rows, state = _gathered(table.value, {n: v.value for n, v in state_vars.items()}, uniq)
        with hyperparameters.reading(updater, values):
            new_rows, new_state = updater.apply_rule(rows, {**state, **whole}, summed,
                                                     learning_rate, step)
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
    backend.for_distinct_rows(update, [table] + [slots[n] for n in names], distinct)


def _gathered(table_value, state_values, uniq):
    """`(rows, state)` of the rows `uniq`, as rules compute with them.

    Float state is computed in float32; integer state (the row's last step
    where `lazy=False`) keeps its dtype.
    """
    rows = ops.cast(backend.gather(table_value, uniq), "float32")
    return rows, {n: as_computed(backend.gather(v, uniq)) for n, v in state_values.items()}


def _update_whole(updater, table, slots, names, distinct, finite, values, step):
    """Updates the whole slots once for the step; `{name: new value}` (float32).

    Their contributions are summed over the distinct rows only (padding
    entries add nothing), in as many chunks as the rows take. `names`: the
    per-row slots, which the contributions may read.
    """
    specs = updater.whole_slots
    if not specs:
        return {}
    old = whole_slot_values(updater, slots)

    def contributions(values_, uniq, summed):
        rows, state = _gathered(values_[0], dict(zip(names, values_[1:])), uniq)
        with hyperparameters.reading(updater, values):
            # The rows and gradients the rule will see (options applied first).
            rows, grads = transforms.before_rule(updater.transforms, rows, summed,
                                                 values["learning_rate"], step)
            return updater.contributions(rows, {**state, **old}, grads, step)

    sums = backend.sum_over_distinct_rows(
        contributions, [table.value] + [slots[n].value for n in names], distinct)
    return write_whole_slots(updater, slots, old, sums, table.shape[0], step, finite, values)


def whole_slot_values(updater, slots):
    """`{name: float32 value}` of the updater's whole slots as they are now, before the step.

    Read explicitly (`convert_to_tensor`): on TensorFlow a Keras variable's
    `.value` is the live `tf.Variable`, read only where an op uses it; a rule
    that hands an old value on unchanged (Adafactor's `log_decay_before`)
    would then be written with the value assigned a moment earlier in
    `write_whole_slots`. With the optimizer built inside the traced step
    (Keras' default on TF) the reads came first, as meant; with it built
    before `fit` they came after the writes (tests/test_backends.py holds
    both builds equal).

    Args:
        updater: the `Updater`.
        slots: `{name: variable}`.
    """
    return {s.name: ops.cast(ops.convert_to_tensor(slots[s.name]), "float32")
            for s in updater.whole_slots}


def write_whole_slots(updater, slots, old, sums, num_rows, step, finite, values):
    """The whole slots' new values from the step's summed contributions, written where
    `finite` (else kept); `{name: new float32 value}`.

    Args:
        updater: the `Updater`.
        slots: `{name: variable}`.
        old: `{name: float32 value}` of the whole slots before the step.
        sums: the rule's contributions summed over the step's distinct rows.
        num_rows: the table's rows.
        step, finite, values: the step's count, whether it applies, hyperparameters.
    """
    with hyperparameters.reading(updater, values):
        new = updater.update_whole(dict(old), sums, num_rows, step)
    out = {}
    for spec in updater.whole_slots:
        value = ops.where(finite, ops.cast(new[spec.name], "float32"), old[spec.name])
        slots[spec.name].assign(ops.cast(value, slots[spec.name].dtype))
        out[spec.name] = value
    return out
