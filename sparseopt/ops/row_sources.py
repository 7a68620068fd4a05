"""Where a table's row gradients come from, each step: a `RowGrads` for its trainer.

`LookupRows`: those a `SparseLookup` recorded in its backward pass (every
table a sparseopt layer reads, and keras-rs tables on JAX). `SlicedRows`:
the table's own sparse gradient (`tf.IndexedSlices`, keras-rs tables on
TensorFlow). Either hands `DispatchOptimizer.apply` the step's true
(unscaled) row gradients.
"""

from keras import ops

from sparseopt import backend
from sparseopt.records import RowGrads


class LookupRows:
    """Row gradients recorded by a `sparseopt.ops.SparseLookup` (JAX, and TF layers).

    The lookup's backward pass records a `RowGrads`, as scaled as the
    loss was; its probe gets a gradient that Keras' loss-scale check sees
    (NaN when the rows' is not finite).
    """

    def __init__(self, lookup):
        self.lookup = lookup

    @property
    def watched(self):
        """The variables whose gradients this source reads: the probe."""
        return [self.lookup.probe]

    @property
    def frozen(self):
        """Whether the lookup's layer is frozen (`layer.trainable = False`): then none of
        its tables trains, in a step or at the end of `fit`. Read here: a table that is
        no variable (int8 codes, a table on disk) is reached through the probe, which on
        JAX is layer state that Keras' `trainable` setter does not reach, so the probe
        alone would still lead to the table."""
        layer = self.lookup.layer
        return layer is not None and not layer.trainable

    @property
    def storage(self):
        """The `TableStorage` given on the table's lookup, or None (None before it exists)."""
        return getattr(self.lookup, "storage", None)

    def row_gradients(self, grads, table_name):
        """This step's true `RowGrads`, or None if the table was not looked up.

        Args:
            grads: `{id(variable): gradient}` of the watched variables.
            table_name: for messages.
        """
        record = self.lookup.take_row_gradients()
        marker = grads.get(id(self.lookup.probe))
        if record is None:
            return None  # not looked up (or not differentiated) in this step
        if self.frozen:
            return None
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
        return record.scaled(ops.cast(marker, "float32") / float(record.calls))

    def dropped_ids(self):
        return int(ops.convert_to_numpy(self.lookup.num_dropped_ids.value))

    def ids_per_step(self):
        """The ids one step looks up (`SparseLookup.ids_per_step`), or None if unknown."""
        return self.lookup.ids_per_step()


class SlicedRows:
    """Row gradients that arrive as the table's own sparse gradient (TF `IndexedSlices`)."""

    def __init__(self, table):
        self.table = table

    @property
    def watched(self):
        return [self.table]

    storage = None  # keras-rs tables: their updater's (TableConfig has no storage)

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
        return RowGrads(sliced[0], ops.cast(sliced[1], "float32"))

    def dropped_ids(self):
        return 0  # keras-rs tables on TF: Keras' gather never sees invalid ids here

    def ids_per_step(self):
        raise ValueError(
            f"DispatchOptimizer: gradient_accumulation_steps is not supported for the keras-rs "
            f"table '{self.table.path}' on TensorFlow (its row gradients arrive from Keras' "
            "gather, of unknown size when the optimizer is built). Train it on JAX, or "
            "without accumulation (a larger batch).")
