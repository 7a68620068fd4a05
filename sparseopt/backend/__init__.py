"""Backend plumbing: the few operations that differ between JAX and TF.

Each backend module provides:

- `tap(rows, probe, ids, on_backward)`: identity on `rows`; its backward pass
  hands the row cotangent to `on_backward(ids, grads)` and gives `probe` the
  cotangent 1 (NaN when the row cotangent is not finite).
- `dedup(ids, grads, num_rows, workspace)`: sum the gradients of equal ids;
  ids outside `[0, num_rows)` are dropped. `WORKSPACE` says whether it needs
  `workspace`, a persistent int32 variable with one entry per row (JAX).
- `read_rows(table, ids)`: the forward lookup, with no gradient to `table`.
- `gather(value, ids)` / `scatter(variable, ids, rows)`: read and write
  touched rows in place.
- `fill_in_blocks(make_block, shape, dtype, block_rows)`: a large array
  built block by block in place (`None` where the backend cannot).
- `outside_trace()`: a context that runs its block outside any trace, even
  while a train step is being traced (TF builds optimizers there).
- `has_int64()`: whether int64 arrays exist (JAX: only with `jax_enable_x64`).
- `SPARSE_GRADIENTS` / `gradient_slices(grad)` / `gather_from_resource(var,
  ids)`: whether a gather's gradient is sparse (TF), its `(ids, row_grads)`,
  and such a gather (`None` on JAX).
- `num_replicas()`: how many devices a distribution would train on.
- `fused_apply(updater, table, slots, ids, grads, lr, finite)`: apply the
  updater with the backend's own kernel if one computes exactly its rule
  (TensorFlow); returns `False` when there is none (always, on JAX).
"""

import keras

if keras.backend.backend() == "jax":
    from sparseopt.backend.jax import (  # noqa: F401
        SPARSE_GRADIENTS, WORKSPACE, dedup, fill_in_blocks, fused_apply, gather,
        gather_from_resource, gradient_slices, has_int64, num_replicas, outside_trace,
        read_rows, scatter, tap)
elif keras.backend.backend() == "tensorflow":
    from sparseopt.backend.tensorflow import (  # noqa: F401
        SPARSE_GRADIENTS, WORKSPACE, dedup, fill_in_blocks, fused_apply, gather,
        gather_from_resource, gradient_slices, has_int64, num_replicas, outside_trace,
        read_rows, scatter, tap)
else:
    raise ImportError(
        f"sparseopt supports the 'jax' and 'tensorflow' Keras backends; the "
        f"current backend is '{keras.backend.backend()}'. Set KERAS_BACKEND."
    )
