"""The shared machinery around an updater's rule: dedup, gather, rule, scatter.

Written once with `keras.ops` plus the backend primitives; the cost is
proportional to the ids in the batch, never to the number of rows. Where the
backend has its own fused kernel for exactly the updater's rule (TensorFlow's
sparse-apply kernels), that kernel replaces gather, rule and scatter. Where a
table is split by rows over devices (`keras.distribution`), the same steps
run on each shard, on the ids that shard owns.
"""

from keras import ops

from sparseopt import backend


def sparse_apply(updater, table, slots, ids, grads, learning_rate, step, workspace=None):
    """Updates the touched rows of `table` and its `slots` in place.

    Args:
        updater: the `Updater` whose rule to apply.
        table: the `[V, D]` Keras variable.
        slots: dict slot name -> Keras variable (`[V, D]` or `[V]`).
        ids: int `[N]` ids, duplicates allowed; ids outside `[0, V)` are
            ignored.
        grads: `[N, D]` true (unscaled) gradient of each occurrence. If any
            entry is not finite, the table and its state are left unchanged.
        learning_rate: scalar tensor.
        step: scalar int tensor, the 1-based update count.
        workspace: where `backend.WORKSPACE` is true, an int32 variable with
            at least `V` entries for the dedup (contents do not matter).

    Returns:
        A boolean scalar tensor: whether the update was applied.
    """
    shards = backend.row_shards(table)
    if shards is not None:
        return backend.on_row_shards(_apply, shards, updater, table, slots, ids, grads,
                                     learning_rate, step, workspace)
    return _apply(updater, table, slots, ids, grads, learning_rate, step, workspace)


def _apply(updater, table, slots, ids, grads, learning_rate, step, workspace):
    num_rows = table.shape[0]
    grads = ops.cast(grads, "float32")
    uniq, summed, count = backend.dedup(ids, grads, num_rows, workspace)
    # A non-finite gradient skips the whole table for this step.
    finite = ops.all(ops.isfinite(grads))
    if backend.fused_apply(updater, table, slots, uniq, summed, learning_rate, finite):
        return finite
    names = sorted(slots)

    def update(variables, uniq, summed):
        table, state_vars = variables[0], dict(zip(names, variables[1:]))
        rows = ops.cast(backend.gather(table.value, uniq), "float32")
        state = {n: ops.cast(backend.gather(v.value, uniq), "float32")
                 for n, v in state_vars.items()}
        new_rows, new_state = updater.apply_rule(rows, state, summed, learning_rate, step)
        # Skipping selects the old rows back (cheap: only touched rows)
        # instead of branching.
        new_rows = ops.where(finite, new_rows, rows)
        new_state = {n: ops.where(finite, new_state[n], state[n]) for n in names}
        new_rows, new_state = backend.materialize((new_rows, new_state))
        backend.scatter(table, uniq, new_rows)
        for n, var in state_vars.items():
            backend.scatter(var, uniq, new_state[n])

    # Only the step's distinct rows: work follows them, not the batch.
    backend.for_distinct_rows(update, [table] + [slots[n] for n in names], uniq, summed, count)
    return finite
