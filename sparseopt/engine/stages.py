"""The stages of a table's step, written once for every plan and kind of row storage.

    record ─► distinct rows, summed gradients ─► rows and state read ─► rule ─► written
    (RowGrads)  (`prepare`: dedup, finiteness)   (`RowStorage.read`)          (`RowStorage.write`)

The cost follows the step's distinct ids, never the table's rows. A plan
(`sparseopt.engine.plans`: one table, a table split by rows, tables grouped)
decides where the stages run; a native kernel may replace consecutive stages
(`sparseopt.engine.kernels`); the table's `RowStorage` decides how rows are
read and written. Whole slots (a column's or the table's) are updated once
per step, from the rule's contributions summed over the distinct rows,
before the row rule reads them (`update_whole`).
"""

from typing import Any, NamedTuple

from keras import ops

from sparseopt import backend
from sparseopt.engine import kernels
from sparseopt.records import Distinct, RowGrads
from sparseopt.updaters.core import transforms
from sparseopt.updaters.core.hyperparameters import Values


class Prepared:
    """One table's step between its dedup and its rule.

    A table on one device is deduplicated here, once (`distinct`); a table
    whose rows are split over devices keeps the step's record as given
    (each shard deduplicates its own: `plans.finish`).

    Args:
        record: the step's `RowGrads`, float32.
        finite: boolean scalar: whether every gradient is finite.
        distinct: the `Distinct` rows, or None.
        num_rows: the table's rows.
        workspace: the table's dedup workspace (or None).
        numbering: how its storage numbers the step's ids, or None (`distinct`).
        positions: where in `record` each of `distinct`'s ids occurs, where the
            dedup gave them (a table without a workspace); else None.
    """

    def __init__(self, record, finite, distinct, num_rows, workspace, numbering=None,
                 positions=None):
        self.record, self.finite = record, finite
        self.distinct, self.num_rows, self.workspace = distinct, num_rows, workspace
        self.numbering, self.positions = numbering, positions
        self._global = None  # `global_distinct`, once computed

    def global_distinct(self):
        """The step's `Distinct` rows over the whole table.

        A table split over devices is deduplicated globally for it, once
        (each shard also deduplicates its own ids when it updates them).
        """
        if self.distinct is None and self._global is None:
            self._global = distinct(self.record, self.num_rows, self.workspace,
                                    self.numbering)
        return self.distinct if self.distinct is not None else self._global

    def squared_norm(self):
        """The squared L2 norm of the table's gradient: of each distinct row's summed one.

        What a dense optimizer's `global_clipnorm` sees of this table.
        """
        return ops.sum(ops.square(self.global_distinct().grads))

    def context(self):
        """What the table's storage may read of the step (`Context`)."""
        return Context(self.record, self.workspace, 0, self.positions)


class Context:
    """The step as a kind of row storage may need it: the rows its lookups read.

    Args:
        record: the step's `RowGrads` (whose `read` holds, for an int8 table
            or a table on disk, each id's row as its lookup read it).
        workspace: the dedup workspace the step was deduplicated with: it
            holds, for each distinct id, one of its positions in `record`.
        offset: the table's first id in the workspace (a group's shifted ids).
        positions: int32 positions of the distinct ids in `record`, one per
            entry of the step's `Distinct`, where the dedup gave them (no
            workspace); else None.
    """

    def __init__(self, record, workspace, offset=0, positions=None):
        self.record, self.workspace, self.offset = record, workspace, offset
        self.positions = positions

    def finds(self, ids):
        """Whether `rows_read` can find the rows of `ids`: with a workspace, any ids; with
        `positions`, the step's whole list of distinct ids only (not a chunk of it: a
        whole slot's sums over more rows than a chunk read theirs elsewhere)."""
        if self.positions is None:
            return self.workspace is not None
        return ids.shape[0] == self.positions.shape[0]

    def rows_read(self, ids):
        """float32 `[M, D]`: each id's row as the step's lookups read it.

        Every occurrence of an id read the same row; the dedup left one of
        its positions in the workspace (or gave them, `positions`).

        Raises:
            ValueError: `finds(ids)` does not hold.
        """
        return backend.gather(self.record.read, self._at(ids))

    def state_read(self, ids, names):
        """`{name: [M, ...]}`: each id's per-row slots `names` as the step's lookups read
        them with its row (`RowGrads.state`), or None where they did not read them all
        (the storage then reads them where they are kept).

        Args:
            ids: int `[M]`, the step's distinct ids (`finds(ids)`).
            names: the per-row slots' names.

        Raises:
            ValueError: `finds(ids)` does not hold.
        """
        state = self.record.state
        if state is None or any(name not in state for name in names):
            return None
        at = self._at(ids)
        return {name: backend.gather(state[name], at) for name in names}

    def _at(self, ids):
        """Where each of `ids` is in the step's record (one of its positions).

        Args:
            ids: int `[M]`, the step's distinct ids (`finds(ids)`).
        """
        if not self.finds(ids):
            raise ValueError("the rows of a chunk of a step's distinct ids cannot be found "
                             "by their positions; read them from where they are kept")
        return (self.positions if self.positions is not None
                else backend.gather(self.workspace.value, ids + self.offset))


def prepare(record, num_rows, workspace=None, split=False, numbering=None):
    """Stages 1-2 of one table: its step checked and (unless `split`) deduplicated.

    Args:
        record: the step's `RowGrads`: ids (duplicates allowed; ids outside
            `[0, num_rows)` are ignored) and their true gradients.
        num_rows: the table's rows.
        workspace: its dedup workspace, where `backend.WORKSPACE`.
        split: the table's rows are split over devices (each shard
            deduplicates its own ids).
        numbering: as for `distinct`.
    """
    record = record.as_float32()
    # A non-finite gradient skips the whole table for this step.
    finite = record.all_finite()
    found = positions = None  # (split: each shard deduplicates its own ids)
    if split:
        pass
    elif workspace is None and backend.WORKSPACE:
        found, positions = distinct_without_workspace(record, num_rows, numbering)
    else:
        found = distinct(record, num_rows, workspace)
    return Prepared(record, finite, found, num_rows, workspace, numbering, positions)


def distinct(record, num_rows, workspace, numbering=None):
    """Stage 2: the `Distinct` rows of `record` (by a native kernel where one applies).

    A table without a workspace where the backend's dedup needs one (a table on
    disk, whose one entry per row would take memory in proportion to the
    table) is deduplicated without one (`distinct_without_workspace`).

    Args:
        record: the step's float32 `RowGrads`.
        num_rows: the table's rows.
        workspace: its dedup workspace, or None where it has none.
        numbering: for a table without a workspace, its storage's way of
            numbering the step's ids (`RowStorage.numbering`), or None.
    """
    if workspace is None and backend.WORKSPACE:
        return distinct_without_workspace(record, num_rows, numbering)[0]
    kernel = kernels.find(("distinct",), record=record, workspace=workspace)
    if kernel is not None:
        return kernel.run(record, num_rows, workspace)
    return backend.dedup(record, num_rows, workspace)


def distinct_without_workspace(record, num_rows, numbering=None):
    """`(Distinct, positions)` of `record` with no workspace of the table's size: the same
    `Distinct` as `distinct` with one gives, bit for bit, and where in the record
    each of its ids occurs.

    The step's ids are numbered by a hash of the batch (`_numbered`), the
    backend's own dedup (its kernel where one applies) runs on the numbers
    with a scratch workspace of the batch's size, and the numbers are mapped
    back to ids: the very dedup a table with a workspace gets, so the same
    sums (XLA's own scatter-add, compiled at its default optimizations, may
    add duplicates' gradients otherwise than the native kernel). Where the
    backend has no scratch workspace (TF, whose dedup writes a variable),
    `distinct_by_hash`, whose sums are TF's dedup's.

    Args:
        record: the step's float32 `RowGrads`.
        num_rows: the table's rows.
        numbering: as for `_numbered`.
    """
    ids, n = _flat(record)
    scratch = backend.scratch_workspace(n)
    if scratch is None:
        return distinct_by_hash(record, num_rows, numbering)
    numbered = _numbered(ids, n, num_rows, numbering)
    found = distinct(RowGrads(numbered.number, record.grads), n, scratch)
    # Numbers back to ids; the entries from `count` on are padding past the table.
    number = ops.minimum(found.ids, n - 1)
    real = ops.where(ops.less(found.ids, n), ops.take(numbered.ids_of, number),
                     num_rows + (found.ids - n))
    positions = ops.take(numbered.positions, number)
    if num_rows >= n:  # (the dedup's own arrays, unsliced: nothing to cut)
        return Distinct(real, found.grads, found.count), positions
    return (Distinct(real[:num_rows], found.grads[:num_rows], found.count),
            positions[:num_rows])


def distinct_by_hash(record, num_rows, numbering=None):
    """`(Distinct, positions)` of `record` without a workspace: the distinct valid ids,
    their summed gradients, and where in the record each last occurs.

    The same `Distinct` as the workspace dedups give (`backend.dedup` and its
    kernels) where the backend's sums are in occurrence order (TF's; on
    JAX `distinct_without_workspace` runs the kernel itself): ids numbered in
    the order of their last occurrence, gradients added in occurrence order
    from +0.0, the padding ids past the table after them (TF: only the
    `count` distinct entries). The order matters beyond tidiness: TF's
    vectorized kernels may compute a value in its last bit differently at
    another position in a tensor.

    Args:
        record: the step's float32 `RowGrads`.
        num_rows: the table's rows.
        numbering: as for `_numbered`.
    """
    ids, n = _flat(record)
    numbered = _numbered(ids, n, num_rows, numbering)
    size = min(n, num_rows) if isinstance(n, int) else ops.minimum(n, num_rows)
    # Entries past `size` (invalid ids, and earlier occurrences' own slots) are cut off.
    segment = ops.where(ops.less(numbered.number, n), numbered.number, size)
    summed = ops.segment_sum(record.rows(), segment, num_segments=size + 1)[:size]
    # (A lone -0.0 sums to +0.0, as the workspace dedups' sums do.)
    summed = ops.where(ops.equal(summed, 0.0), ops.zeros((), summed.dtype), summed)
    uniq = ops.where(ops.arange(size, dtype="int32") < numbered.count,
                     numbered.ids_of[:size], num_rows + ops.arange(size, dtype="int32"))
    found = backend.trimmed(Distinct(uniq, summed, numbered.count))
    # (Cut as the backend cuts the `Distinct`: TF keeps its `count` entries only.)
    return found, numbered.positions[:size][:ops.shape(found.ids)[0]]


def _flat(record):
    """`(ids, n)`: the record's ids as int32 `[n]` (n a Python int where known)."""
    ids = ops.cast(ops.reshape(record.ids, (-1,)), "int32")
    return ids, (ids.shape[0] if ids.shape[0] is not None else ops.shape(ids)[0])


class _Numbering(NamedTuple):
    """The step's valid ids numbered `0..count-1` in the order of their last occurrence.

    number: int32 `[n]`, each entry's id's number (`n` for an invalid id).
    ids_of: int32 `[n]`, the id of each number (entries from `count` on: 0).
    positions: int32 `[n]`, each number's last position in the record.
    count: the number of distinct valid ids.
    """

    number: Any
    ids_of: Any
    positions: Any
    count: Any


def _numbered(ids, n, num_rows, numbering=None):
    """The `_Numbering` of int32 ids `[n]` (those outside `[0, num_rows)` invalid), by a
    hash of the batch's ids: no table-sized memory.

    Args:
        ids, n, num_rows: the step's ids, how many, the table's rows.
        numbering: a function of `ids` giving the `_Numbering`'s fields, or
            None where it has none (the host, where a table's rows are, numbers
            them in one pass: `RowStorage.numbering`); without one, or where
            it gives None, rounds of hashing on the device
            (`backend.first_occurrences`), to the same numbers.
    """
    given = None if numbering is None else numbering(ids)
    if given is not None:
        return _Numbering(*given)
    valid = ops.logical_and(ops.greater_equal(ids, 0), ops.less(ids, num_rows))
    # Each id's last occurrence: its first one in the ids reversed.
    backwards = backend.first_occurrences(ops.zeros_like(ids), ops.flip(ids, 0),
                                          ops.flip(valid, 0))
    last = (n - 1) - ops.flip(backwards, 0)
    position = ops.arange(n, dtype="int32")
    is_last = ops.logical_and(valid, ops.equal(last, position))
    slot = ops.cumsum(ops.cast(is_last, "int32")) - 1
    number = ops.where(valid, ops.take(slot, ops.where(valid, last, 0)), n)
    at = ops.expand_dims(ops.where(is_last, slot, n), 1)
    ids_of = ops.scatter_update(ops.zeros((n + 1,), "int32"), at, ids)[:n]
    positions = ops.scatter_update(ops.zeros((n + 1,), "int32"), at, position)[:n]
    return _Numbering(number, ids_of, positions, ops.sum(ops.cast(is_last, "int32")))


def checked(finite, factor):
    """`finite`, and false where the clipping `factor` (if any) is not finite."""
    return finite if factor is None else ops.logical_and(finite, ops.isfinite(factor))


def update_rows(updater, storage, found, finite, values, step, context=None, whole=None):
    """Stages 3-5 on `found`'s rows: read, rule, write (skipped where not `finite`).

    Whole slots are updated first, once (`update_whole`), unless `whole`
    holds their new values already (a shard's step). Where a kernel does
    the three stages at once (TF's fused sparse-apply), it runs instead.

    Args:
        updater: the table's `Updater`.
        storage: its `RowStorage`.
        found: the step's `Distinct` rows.
        finite: boolean scalar, whether the step applies.
        values: `{name: scalar tensor}`, the step's hyperparameters (`learning_rate` too).
        step: scalar int tensor, the 1-based update count.
        context: the step's `Context`, for storage that reads from it.
        whole: the whole slots' new values (`{name: float32}`), or None.
    """
    kernel = kernels.find(("read", "rule", "write"), updater=updater, storage=storage)
    if kernel is not None:
        kernel.run(updater, storage, found, values, finite)
        return
    if whole is None:
        whole = update_whole(updater, storage, found, finite, values, step, context)
    # Entries from `count` on are padding (or, skipped, the rows as read).
    count = ops.where(finite, found.count, 0)

    def update(variables, ids, grads):
        view = storage if variables is None else storage.over(variables)
        rows, state = view.read(ids, context)
        new_rows, new_state = rule(updater, rows, {**state, **whole}, grads, values, step)
        # Skipping hands back the rows as read (cheap: only touched rows)
        # instead of branching.
        new_rows = ops.where(finite, new_rows, rows)
        new_state = {n: ops.where(finite, new_state[n], state[n]) for n in state}
        new_rows, new_state = backend.materialize((new_rows, new_state))
        view.write(ids, new_rows, new_state, step, count)

    if storage.at_once:
        # (All at once: its rows come from the step or the host, not from
        # variables a loop carries.)
        update(None, found.ids, found.grads)
        return
    # Only the step's distinct rows: work follows them, not the batch.
    backend.for_distinct_rows(update, storage.variables(), found)


def rule(updater, rows, state, grads, values, step):
    """Stage 4: the updater's rule (its options and wrappers around it) on float32 rows.

    Returns:
        `(new_rows, new_state)`.
    """
    return updater.apply_rule(rows, state, grads, Values(values, step))


def update_whole(updater, storage, found, finite, values, step, context=None):
    """Updates the whole slots once for the step; `{name: new value}` (float32).

    Their contributions are summed over the distinct rows only (padding
    entries add nothing), in as many chunks as the rows take.

    Args:
        updater, storage, found, finite, values, step, context: as for `update_rows`.
    """
    if not updater.whole_slots:
        return {}
    old = whole_slot_values(updater, storage.slots)

    hp = Values(values, step)

    def contributions(ids, grads):
        # Read into buffers first, wherever the rows come from: the sums below then
        # compile to one reduction, whichever kind of storage the rows came from
        # (fused with a gather, XLA may add them in another order).
        rows, state = backend.materialize(storage.read(ids, context))
        # The rows and gradients the rule will see (options applied first).
        rows, grads = transforms.before_rule(updater.transforms, rows, grads, hp)
        return updater.contributions(rows, {**state, **old}, grads, hp)

    sums = backend.sum_over_distinct_rows(contributions, found, storage.table.shape[0])
    return write_whole_slots(updater, storage.slots, old, sums, storage.table.shape[0], step,
                             finite, values)


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
    new = updater.update_whole(dict(old), sums, num_rows, Values(values, step))
    out = {}
    for spec in updater.whole_slots:
        value = ops.where(finite, ops.cast(new[spec.name], "float32"), old[spec.name])
        slots[spec.name].assign(ops.cast(value, slots[spec.name].dtype))
        out[spec.name] = value
    return out
