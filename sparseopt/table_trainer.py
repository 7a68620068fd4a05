"""`TableTrainer`: everything that trains one table in place.

`DispatchOptimizer` keeps one `TableTrainer` per sparsely trained table and
only routes to it. A trainer owns the table's updater, its state slots, its
counters and the source of its row gradients, and answers `build`, `apply`
and `state`. It is written so that a group of tables sharing width, dtype and
updater configuration can become one trainer (one dedup, gather, rule and
scatter for all of them) without changing the router.
"""

import keras
from keras import ops

from sparseopt import backend
from sparseopt.distribution import layout_like
from sparseopt.sparse_apply import sparse_apply


class _Filled(keras.initializers.Initializer):
    """`Constant(value)` in one buffer.

    Keras' `Constant` computes `value * ones(shape)`: two table-sized arrays
    at its peak, which for a 2.5 GB accumulator is 2.5 GB more than needed.
    """

    def __init__(self, value):
        self.value = value

    def __call__(self, shape, dtype=None):
        return ops.full(shape, self.value, dtype=dtype)


class TableTrainer:
    """Trains one table with its sparse updater, in place.

    Args:
        table: the `[V, D]` Keras variable.
        updater: the `sparseopt.updaters.Updater` that trains it.
        source: where its row gradients come from (`LookupRows` or
            `SlicedRows`).
        owner: who assigned the updater, for messages (a layer, `optimizer_map`
            or a keras-rs `TableConfig`).
    """

    def __init__(self, table, updater, source, owner):
        self.table = table
        self.updater = updater
        self.source = source
        self.owner = owner
        self.slots = {}  # slot name -> Keras variable, laid out like the table
        self.skipped = None  # int32 scalar: steps skipped for non-finite gradients
        self.workspace = None  # int32 [V] dedup scratch (JAX), never saved

    @property
    def name(self):
        """The table's path."""
        return self.table.path

    def build(self, optimizer):
        """Creates the state with `optimizer.add_variable`, named after the table."""
        table, prefix = self.table, self.table.path.replace("/", "_")
        for spec in self.updater.slots:
            shape = spec.shape(table.shape)
            self.slots[spec.name] = optimizer.add_variable(
                shape=shape, initializer=_Filled(spec.initial_value), dtype=table.dtype,
                # Sharded like the table, so that updates stay local.
                layout=layout_like(table, len(shape)), name=f"{prefix}_{spec.name}")
        self.skipped = optimizer.add_variable(
            shape=(), dtype="int32", initializer="zeros", name=f"{prefix}_skipped_steps")
        if backend.WORKSPACE:
            # One per table, so that the tables' updates stay independent.
            self.workspace = optimizer.add_variable(
                shape=(table.shape[0],), dtype="int32", initializer="zeros",
                layout=layout_like(table, 1), name=f"{prefix}_dedup_workspace")

    def state(self):
        """`{slot name: Keras variable}`: the updater's state of this table."""
        return dict(self.slots)

    @property
    def saved_variables(self):
        """What a checkpoint holds for this table: its state and skip count."""
        return [*self.slots.values(), self.skipped]

    @property
    def scratch_variables(self):
        """Working memory that is not state (never saved)."""
        return [self.workspace] if self.workspace is not None else []

    def apply(self, ids, grads, iteration):
        """Applies the updater to the rows `ids` with their true gradients.

        Args:
            ids: int `[N]` ids, duplicates allowed (summed); ids outside
                `[0, V)` are ignored.
            grads: `[N, D]` unscaled gradient of each occurrence. If any is
                not finite, nothing changes and the step is counted as skipped.
            iteration: the optimizer's 0-based step count (scalar tensor).
        """
        applied = sparse_apply(
            self.updater, self.table, self.slots, ids, grads,
            self.updater.learning_rate_at(iteration), iteration + 1,
            workspace=self.workspace)
        self.skipped.assign_add(1 - ops.cast(applied, "int32"))

    def skipped_steps(self):
        return int(ops.convert_to_numpy(self.skipped.value))

    def dropped_ids(self):
        return self.source.dropped_ids()


class LookupRows:
    """Row gradients recorded by a `sparseopt.ops.SparseLookup` (JAX, and TF layers).

    The lookup's backward pass records `(ids, row_grads)`, as scaled as the
    loss was; its probe gets a gradient that Keras' loss-scale check sees
    (NaN when the rows' is not finite).
    """

    def __init__(self, lookup):
        self.lookup = lookup

    @property
    def watched(self):
        """The variables whose gradients this source reads: the probe."""
        return [self.lookup.probe]

    def row_gradients(self, grads, table_name):
        """`(ids, grads)` of this step, or None if the table was not looked up.

        Args:
            grads: `{id(variable): gradient}` of the watched variables.
            table_name: for messages.
        """
        calls, ids, rows = self.lookup.take_row_gradients()
        marker = grads.get(id(self.lookup.probe))
        if ids is None:
            return None  # not looked up (or not differentiated) in this step
        if marker is None:
            raise ValueError(
                f"DispatchOptimizer: table '{table_name}' was looked up but "
                f"its probe '{self.lookup.probe.path}' got no gradient; pass all of the model's "
                "trainable variables (`model.trainable_variables`) to `apply`."
            )
        # The probe's gradient is 1 per call whose backward ran (NaN if that call's
        # row gradients were not finite); whatever scaled it (a wrapping
        # LossScaleOptimizer unscales it) scaled the row gradients the other
        # way round. (The wrapper's own scale cannot be read here: on JAX its
        # variables are outside this optimizer's stateless scope.)
        return ids, rows * (ops.cast(marker, "float32") / float(calls))

    def dropped_ids(self):
        return int(ops.convert_to_numpy(self.lookup.num_dropped_ids.value))


class SlicedRows:
    """Row gradients that arrive as the table's own sparse gradient (TF `IndexedSlices`)."""

    def __init__(self, table):
        self.table = table

    @property
    def watched(self):
        return [self.table]

    def row_gradients(self, grads, table_name):
        grad = grads.get(id(self.table))
        if grad is None:
            return None
        sliced = backend.gradient_slices(grad)
        if sliced is None:
            raise ValueError(
                f"DispatchOptimizer: table '{table_name}' received a dense gradient; "
                "something before the optimizer (e.g. LossScaleOptimizer's finiteness "
                "check, or clipping in a custom train_step) densified it, which costs "
                "the whole table every step. Use `DispatchOptimizer(..., "
                "loss_scale_factor=...)` for loss scaling and pass the tape's "
                "gradients to the optimizer unchanged."
            )
        return sliced[0], ops.cast(sliced[1], "float32")

    def dropped_ids(self):
        return 0  # keras-rs tables on TF: Keras' gather never sees invalid ids here
