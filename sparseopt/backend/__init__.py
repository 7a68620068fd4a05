"""Backend plumbing: the few operations that differ between JAX and TF.

Each backend module provides:

- `tap(rows, probe, ids, on_backward)`: identity on `rows`; its backward pass
  hands the row cotangent to `on_backward(ids, grads)` and gives `probe` the
  cotangent 1 (NaN when the row cotangent is not finite). `PROBE_IS_WEIGHT`:
  whether the probe must be a weight of its layer for Keras' train step to
  differentiate it (TF), or can be layer state (JAX).
- `dedup(ids, grads, num_rows, workspace)`: sum the gradients of equal ids;
  ids outside `[0, num_rows)` are dropped. Returns `(ids, grads, count)`,
  the `count` distinct ids first. `WORKSPACE` says whether it needs
  `workspace`, a persistent int32 variable with one entry per row plus
  `WORKSPACE_SINK` (TF: one, where invalid ids write).
- `for_distinct_rows(update, variables, ids, grads, count)`: runs the
  gather-rule-scatter `update` on the `count` distinct entries only (JAX: in
  chunks of `DISTINCT_CHUNK`); `materialize(values)`: computes `values`
  before their consumer (keeps the rule out of XLA:CPU's scatter loop).
- `split_by_table(ids, grads, offsets, sizes)`: a group's `dedup` result (ids
  shifted by table `offsets`) cut into each table's own `dedup` result, in
  its rows (`sizes`: static bounds on each table's distinct ids).
- `read_rows(table, ids)`: the forward lookup, with no gradient to `table`;
  `read_pooled(table, ids, weight, dtype)`: the weighted sum of each bag's
  rows (the last id axis), in `dtype`.
- `gather(value, ids)` / `scatter(variable, ids, rows)`: read and write
  touched rows in place.
- `bitcast(values, dtype)`: the same bits as another 32-bit dtype (float32
  and uint32, for stochastic rounding).
- `fill_in_blocks(make_block, shape, dtype, block_rows)`: a large array
  built block by block in place (`None` where the backend cannot).
- `outside_trace()`: a context that runs its block outside any trace, even
  while a train step is being traced (TF builds optimizers there).
- `trace_token(value=None)`: an object equal for everything traced into one
  function, None for eager code (or an eager `value`), to tell a step's
  lookups from stale ones.
- `has_int64()`: whether int64 arrays exist (JAX: only with `jax_enable_x64`).
- `SPARSE_GRADIENTS` / `gradient_slices(grad)` / `gather_from_resource(var,
  ids)`: whether a gather's gradient is sparse (TF), its `(ids, row_grads)`,
  and such a gather (`None` on JAX).
- `replica_strategy()`: `(name, replicas, supported)` of a strategy whose
  replicas each run their own copy of the train step and hold their own
  copy of each table (TF distribution strategies), or None (one replica, or
  JAX, where a distribution compiles one global program);
  `all_replicas(ids, grads)`: every replica's row gradients of the step,
  gathered (unchanged outside replicas); `sum_over_replicas(value)`: a
  value summed over them; `replica_id()`: the replica being traced (0
  outside replicas).
- `row_shards(variable)` / `on_row_shards(apply, shards, ...)`: where a
  table is split by rows over devices, `(mesh, axis)`, and running an update
  on each shard with the ids it owns (JAX; `None` / never on TF).
- `fused_apply(updater, table, slots, ids, grads, values, finite)`: apply the
  updater with the backend's own kernel if one computes exactly its rule
  (TensorFlow), with the step's hyperparameters `values`; returns `False`
  when there is none (always, on JAX).
- `run_if(pred, fn, variables)`: runs `fn` (assigning some of `variables`)
  only where `pred` holds, in place (gradient accumulation's k-th step);
  `write_rows(variable, start, rows)`: rows written at a (traced) offset;
  `at_least_zero(value, message)`: a traced size checked when the step runs;
  `trace_forward(model, batch)`: traces the model on a batch's shapes so that
  lookups learn their ids per step (JAX; `None` on TF, which builds its
  optimizer after the traced forward pass).
"""

import keras

if keras.backend.backend() == "jax":
    from sparseopt.backend.jax import (  # noqa: F401
        PROBE_IS_WEIGHT, SPARSE_GRADIENTS, WORKSPACE, WORKSPACE_SINK, at_least_zero, bitcast, dedup,
        fill_in_blocks, for_distinct_rows, fused_apply, gather, materialize, native_step, split_by_table,
        gather_from_resource, gradient_slices, has_int64, on_row_shards, outside_trace,
        read_pooled, read_rows, replica_strategy, all_replicas, replica_id, row_shards, run_if,
        scatter, sum_over_replicas, tap, trace_forward, trace_token, write_rows)
elif keras.backend.backend() == "tensorflow":
    from sparseopt.backend.tensorflow import (  # noqa: F401
        PROBE_IS_WEIGHT, SPARSE_GRADIENTS, WORKSPACE, WORKSPACE_SINK, at_least_zero, bitcast, dedup,
        fill_in_blocks, for_distinct_rows, fused_apply, gather, materialize, native_step, split_by_table,
        gather_from_resource, gradient_slices, has_int64, on_row_shards, outside_trace,
        read_pooled, read_rows, replica_strategy, all_replicas, replica_id, row_shards, run_if,
        scatter, sum_over_replicas, tap, trace_forward, trace_token, write_rows)
else:
    raise ImportError(
        f"sparseopt supports the 'jax' and 'tensorflow' Keras backends; the "
        f"current backend is '{keras.backend.backend()}'. Set KERAS_BACKEND."
    )
