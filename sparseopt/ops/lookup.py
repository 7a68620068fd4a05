"""`SparseLookup`: read rows of a table so that they can be updated sparsely."""

import warnings
import weakref

import keras
import numpy as np
from keras import ops

from sparseopt import backend, compat
from sparseopt import storage as storage_lib
from sparseopt.disk.serving import ExportedRows
from sparseopt.disk.table import DiskTable
from sparseopt.records import BagGrads, RowGrads


class SparseLookup:
    """Reads rows of a layer's table and routes their gradient to its updater.

    Create one in the owning layer's `build` and call it in `call`. The
    table receives no dense gradient: its row gradients go to
    `DispatchOptimizer` on the side. A scalar trainable `probe`
    (`<table>_sparse_grad`, value unused) gets the gradient 1 (NaN if the
    row gradients are not finite), which Keras' loss scaling and skip logic
    act on like any other: that is how the optimizer learns the true scale
    of the row gradients and whether they are finite.

    Ids outside `[0, num_rows)` read a zero row, get no update and are counted
    in `num_dropped_ids`.

    Neither is a weight where the backend allows it: `num_dropped_ids` is
    layer state (in `layer.variables`, which train steps thread, but not in
    `layer.weights`, `get_weights()` or weights files), and so is `probe` on
    JAX. Keras' TensorFlow train step differentiates `trainable_weights`
    only, so there `probe` is a weight of the layer (`SparseEmbedding` still
    leaves it out of its files).

    Rows are read as stored and then cast to the layer's compute dtype, so
    under mixed precision only the looked-up rows are cast, never the table.

    Args:
        layer: the `keras.layers.Layer` that owns `table`.
        table: a 2-D Keras variable of `layer`.
        storage: how the table stores its updater state and writes 16-bit
            values, a `sparseopt.TableStorage`; None: its updater's settings
            (by default float32 state, stochastic rounding, seed 0).
        int8: for an 8-bit table, its `sparseopt.storage.int8_table.Int8Table`
            (whose `codes` are `table`): rows are read as `codes / scale`,
            after the last step's buffered writes; None for float tables.
        vocabulary: for an open vocabulary (`DynamicEmbedding`), its
            `sparseopt.vocabulary.OpenVocabulary`: ids are rows its map gave;
            None for fixed tables.

    Example:

    ```python
    class MyTable(keras.layers.Layer):
        def build(self, input_shape):
            self.table = self.add_weight(shape=(1000, 16), name="table")
            self.lookup = sparseopt.ops.SparseLookup(self, self.table)

        def call(self, ids):
            return self.lookup(ids)

        @property
        def variable_path_to_optimizer_map(self):
            return {self.table.path: sparseopt.updaters.Adagrad(0.1)}
    ```
    """

    def __init__(self, layer, table, storage=None, int8=None, vocabulary=None):
        if len(table.shape) != 2:
            raise ValueError(
                f"SparseLookup: table '{table.path}' must be 2-D [rows, width], "
                f"got shape {table.shape}."
            )
        if getattr(table, "_sparseopt_lookup", None) is not None:
            raise ValueError(
                f"SparseLookup: table '{table.path}' already has a SparseLookup; "
                "create one per table and call it as often as needed (its row "
                "gradients from every call in a step are summed)."
            )
        self.table = table
        self.int8 = int8
        # A table on disk (`sparseopt.disk.table.DiskTable`): read through its cache,
        # or, while Keras exports the model, from a variable of its rows made for
        # the export (`sparseopt.disk.serving`).
        self.on_disk = isinstance(table, DiskTable)
        self.exported = ExportedRows(table, layer.name) if self.on_disk else None
        self.storage = storage_lib.from_argument(storage, f"SparseLookup of '{table.path}'")
        base = table.name.replace("/", "_")
        self.num_dropped_ids = layer_state(layer, f"{base}_dropped_ids", "int32", False)
        guard = PlainOptimizerGuard(layer.name, table.path)
        if backend.PROBE_IS_WEIGHT:
            self.probe = layer.add_weight(
                shape=(), initializer="zeros", trainable=True, name=f"{base}_sparse_grad",
                constraint=guard)
        else:
            self.probe = layer_state(layer, f"{base}_sparse_grad", layer.variable_dtype, True)
            self.probe.constraint = guard
        self.layer_name = layer.name
        self.compute_dtype = layer.compute_dtype
        # Weak: the optimizer finds the declaring layer through the lookup,
        # and a lookup must not keep a deleted model's layer alive.
        self._layer = weakref.ref(layer)
        # Per replica (TF MirroredStrategy traces its replicas into one graph):
        self._records = {}  # replica -> [(trace, RowGrads)] from backward passes
        self._dropped = {}  # replica -> records a forward pass of another trace discarded
        self._sizes = {}  # replica -> (trace, static id count of each call in it)
        self.vocabulary = vocabulary
        # Whether the probe's gradient is NaN where the row gradients are not
        # finite: what a `LossScaleOptimizer` sees of the table (it skips the
        # step and lowers its scale). The optimizer that trains the table says
        # whether one wraps it (`DispatchOptimizer.build`); until then, marked.
        # Unmarked, the check (a reduction over the step's row gradients, a few
        # kernels per table in a compiled step) is left out: the optimizer
        # checks the rows itself.
        self.marks_non_finite = True
        table._sparseopt_lookup = self
        self.probe._sparseopt_probe_of = self

    @property
    def layer(self):
        """The layer that owns the table (None once it is deleted)."""
        return self._layer()

    @property
    def beside_variables(self):
        """Whether the table is trained but is no trainable variable (an int8 table's
        codes, a table on disk): the optimizer reaches it through the probe."""
        return self.int8 is not None or self.on_disk

    def take_row_gradients(self):
        """The row gradients recorded since the last call, and forgets them.

        Returns:
            A `sparseopt.records.RowGrads` of every call whose backward pass
            ran (their ids one after another; `calls` counts them), with
            float32 gradients as scaled as the loss was (`BagGrads` where
            every call was pooled); None if none ran.

        Raises:
            ValueError: no row gradients reached this point, but some were
                recorded and then discarded by a forward pass of another trace
                (or an eager one): the table's update would be lost silently.
        """
        replica = backend.replica_id()
        records = self._records.pop(replica, [])
        dropped = self._dropped.pop(replica, 0)
        if not records and dropped:
            raise ValueError(
                f"DispatchOptimizer: table '{self.table.path}' (layer '{self.layer_name}') "
                f"had row gradients from {dropped} lookup(s), but a forward pass of the "
                "model in another traced function (or eagerly) ran between computing "
                "them and `optimizer.apply`, which discards them: the table would not be "
                "trained. Compute the gradients and apply them in the same traced step, "
                "without calling the model in another function in between."
            )
        if not records:
            return None
        return RowGrads.concatenate(
            [record.as_float32() for _, record in records],
            owner=f"Layer '{self.layer_name}' (open-vocabulary table '{self.table.path}')")

    def _forget_other_traces(self, ids):
        # Row gradients recorded in another trace were never applied (e.g.
        # computed and dropped); they are not this step's. Those of this
        # trace stay: a forward call between the gradient and `apply` (a
        # custom train step computing metrics) must not lose them. Eager
        # code has no trace to tell steps apart: a forward call starts anew.
        token, replica = backend.trace_token(ids), backend.replica_id()
        records = self._records.get(replica, [])
        kept = [r for r in records if token is not None and r[0] == token]
        self._dropped[replica] = self._dropped.get(replica, 0) + len(records) - len(kept)
        self._records[replica] = kept

    def valid(self, ids):
        """Boolean mask of the ids inside `[0, num_rows)`."""
        return ops.logical_and(ops.greater_equal(ids, 0), ops.less(ids, self.table.shape[0]))

    def __call__(self, ids, changed=None, training=False):
        """Returns `table[ids]`, shape `ids.shape + (width,)`; invalid ids give 0.

        Args:
            ids: int rows.
            changed: rows an open vocabulary gave to new ids in this call
                (`sparseopt.vocabulary.Proposals`), recorded with the row
                gradients (`RowGrads.changed`). (An open vocabulary's ids
                outside the table are ids it does not hold, never counted as
                dropped, in training or not.)
            training: whether this is a training call (the layer's `training`): a
                table on disk then reads its rows' per-row state with them, for the
                optimizer (`RowGrads.state`); otherwise the optimizer reads it from
                the host.
        """
        valid, safe_ids, update_ids = self._prepare(ids)
        read, state = self._read(safe_ids, valid, training)
        rows = ops.where(ops.expand_dims(valid, -1), ops.cast(read, self.compute_dtype), 0.0)
        # The rows of an int8 table or a table on disk travel with their gradients
        # (`RowGrads.read`): its step starts from them (`RowStorage.reads_lookups`); so
        # does the per-row state a training lookup of a table on disk read with them.
        kept = ops.reshape(read, (-1, self.table.shape[1])) if self.beside_variables else None
        if state is not None:
            state = {name: ops.reshape(value, (-1,) + tuple(value.shape[len(ids.shape):]))
                     for name, value in state.items()}
        return backend.tap(rows, self.probe.value, update_ids, self._on_backward,
                           aux=(None, changed, kept, state), marks=self.marks_non_finite)

    def pooled(self, ids, combiner="sum", changed=None, training=False):
        """The rows of each bag of ids (the last axis), summed or averaged.

        Same as reducing `self(ids)` over its id axis, but the backward pass
        records one gradient per bag (`sparseopt.records.BagGrads`) instead of one
        per id, and the dedup reads it from there: the `[ids, width]`
        gradient is never built. (A table placed by a `keras.distribution`
        is read id by id, as `self(ids)`, then reduced.)

        Args:
            ids: int ids `[..., bag]`; invalid ids read zero and count 0 in a mean.
            combiner: `"sum"` or `"mean"` (over the valid ids of a bag; an
                empty bag gives zeros).
            changed, training: as for `__call__`.

        Returns:
            `[..., width]` in the layer's compute dtype.
        """
        if compat.layout_of(self.table) is not None or self.int8 is not None or self.on_disk:
            # Placed by a keras.distribution: read id by id, so that what
            # crosses devices stays what the sharded update path expects.
            # (int8: each id's row must travel with its gradient; on disk:
            # the rows come from the host, read id by id.)
            rows = self(ids, changed=changed, training=training)
            weight = ops.cast(self.valid(ids), rows.dtype)
            if combiner == "mean":
                weight = weight / ops.maximum(ops.sum(weight, axis=-1, keepdims=True), 1.0)
            return ops.sum(rows * ops.expand_dims(weight, -1), axis=-2)
        valid, safe_ids, update_ids = self._prepare(ids)
        weight = ops.cast(valid, self.compute_dtype)
        if combiner == "mean":
            weight = weight / ops.maximum(ops.sum(weight, axis=-1, keepdims=True), 1.0)
        with compat.read_as_stored():
            pooled = backend.read_pooled(self.table, safe_ids, weight, self.compute_dtype)
        return backend.tap(pooled, self.probe.value, update_ids, self._on_backward_pooled,
                           aux=(ops.reshape(weight, (-1,)), changed),
                           marks=self.marks_non_finite)

    def ids_per_step(self):
        """How many ids the last forward pass with a known batch shape looked up.

        Summed over the lookup's calls in that pass (one trace), per replica;
        None before any. What gradient accumulation sizes its buffers by.
        """
        counts = self._sizes.get(backend.replica_id(), (None, []))[1]
        return sum(counts) if counts and None not in counts else None

    def _record_size(self, ids):
        token, replica = backend.trace_token(ids), backend.replica_id()
        # Symbolic dimensions (Keras' shape inference on JAX) are not known sizes.
        known = all(isinstance(d, (int, np.integer)) for d in ids.shape)
        count = int(np.prod(ids.shape)) if known else None
        if token is None or token != self._sizes.get(replica, (None,))[0]:
            self._sizes[replica] = (token, [])  # eager: each call is a pass
        self._sizes[replica][1].append(count)

    def _prepare(self, ids):
        """Checks `ids`, counts the dropped ones; `(valid, ids to read, ids to update)`."""
        check_ids_dtype(ids, self.layer_name, self.table.path)
        if self.int8 is not None:
            self.int8.flush()  # the last step's rows, before anything reads the table
        self._forget_other_traces(ids)
        self._record_size(ids)
        valid = self.valid(ids)
        if self.vocabulary is None:  # (an open vocabulary counts its own: default_lookups)
            dropped = ops.sum(ops.cast(ops.logical_not(valid), "int32"))
            # Every replica (TF MirroredStrategy) counts the whole step's, in its copy.
            self.num_dropped_ids.assign_add(backend.sum_over_replicas(dropped))
        safe_ids = ops.where(valid, ids, 0)
        update_ids = ops.reshape(ops.where(valid, ids, self.table.shape[0]), (-1,))
        return valid, safe_ids, update_ids

    def _read(self, safe_ids, valid, training=False):
        """`(rows, state)`: the rows `safe_ids` as stored (float32 for an int8 table), and
        for a table on disk in a training call, its per-row slots at them (read with the
        rows, in one host call: `{slot: values}`), else None.

        Args:
            safe_ids: the ids, invalid ones replaced by 0.
            valid: where the ids are valid (a table on disk reads no row for the
                others: no lookup of row 0 is counted or cached for them).
            training: whether this is a training call (`__call__`'s).
        """
        if self.int8 is not None:
            return self.int8.read(safe_ids), None
        if self.on_disk:
            archive = compat.exporting()
            if archive is not None:  # a SavedModel serves without the host
                with compat.read_as_stored():
                    return backend.read_rows(self.exported.read_by(archive), safe_ids), None
            ids = ops.where(valid, safe_ids, -1)
            if not training:  # (predict, evaluate: no state to carry)
                return self.table.read_rows(ids), None
            return self.table.read_rows_and_state(ids)
        with compat.read_as_stored():
            return backend.read_rows(self.table, safe_ids), None

    def _on_backward(self, ids, grads, aux):
        width = self.table.shape[1]
        self._record(grads, RowGrads(ops.reshape(ids, (-1,)), ops.reshape(grads, (-1, width)),
                                     changed=aux[1], read=aux[2], state=aux[3]))

    def _on_backward_pooled(self, ids, grads, aux):
        weight, changed = aux
        values = ops.reshape(grads, (-1, self.table.shape[1]))
        # Ids are flattened bag by bag: id i is in bag i // (ids per bag).
        n, bags = ops.shape(ids)[0], ops.shape(values)[0]
        per_bag = ops.maximum(ops.floor_divide(n, ops.maximum(bags, 1)), 1)
        bag = ops.floor_divide(ops.arange(n, dtype="int32"), ops.cast(per_bag, "int32"))
        self._record(grads, RowGrads(ids, BagGrads(values, bag, weight), changed=changed))

    def _record(self, traced, record):
        self._records.setdefault(backend.replica_id(), []).append(
            (backend.trace_token(traced), record))


def check_ids_dtype(ids, layer_name, table_path, row_ids=True):
    """Refuses non-integer ids; warns where int64 ids would be truncated.

    Raises a `TypeError` naming the layer unless `ids` has an integer dtype.
    `row_ids=False` (raw ids of an open vocabulary, which has its own
    refusal of truncated int64 ids): the dtype check only.
    Ids declared int64 on JAX without `jax_enable_x64` are converted to int32
    by JAX itself before any layer runs, so ids >= 2**31 would wrap into
    range: that gets a warning with the fix.
    """
    dtype = keras.backend.standardize_dtype(ids.dtype)
    if "int" not in dtype:
        raise TypeError(
            f"Layer '{layer_name}': ids for table '{table_path}' must be integers, "
            f"got dtype {dtype}. Cast them first, e.g. `keras.ops.cast(ids, "
            "'int32')`, or declare the input with `keras.Input(..., dtype='int32')`."
        )
    if row_ids and dtype in ("int64", "uint64", "uint32") and not backend.has_int64():
        warnings.warn(
            f"Layer '{layer_name}': ids for table '{table_path}' are declared "
            f"{dtype}, but JAX runs without 64-bit types and converts them to int32 "
            "before any layer sees them: ids >= 2**31 would wrap onto other rows. "
            "Map ids into [0, input_dim) in the input pipeline (e.g. "
            "keras.layers.Hashing) and declare int32, or set JAX_ENABLE_X64=1.",
            stacklevel=3,
        )


def layer_state(layer, name, dtype, trainable, shape=(), initializer="zeros"):
    """A variable that is state of `layer` but not one of its weights.

    Named like the layer's weights; trainable state is in the model's
    `trainable_variables` (so that JAX's stateless step passes it) without
    being a weight.
    """
    with keras.name_scope(layer.name, caller=layer):  # named like the layer's weights
        variable = keras.Variable(initializer=keras.initializers.get(initializer), shape=shape,
                                  dtype=dtype, trainable=trainable, name=name)
    compat.track_state(layer, variable)
    return variable


class PlainOptimizerGuard(keras.constraints.Constraint):
    """Constraint of the probe that refuses training by a plain optimizer.

    Keras optimizers call a variable's constraint right after updating it.
    `DispatchOptimizer` never hands the probe to an inner optimizer, so this
    runs (at trace time, before any step executes) only when some other
    optimizer is training the model: the table would silently not be trained.
    """

    def __init__(self, layer_name, table_path):
        self.layer_name = layer_name
        self.table_path = table_path

    def __call__(self, w):
        raise ValueError(
            f"Layer '{self.layer_name}' reads table '{self.table_path}' sparsely, "
            "but the model's optimizer is not a sparseopt.DispatchOptimizer, so the "
            "table would not be trained. Compile with "
            "`optimizer=sparseopt.DispatchOptimizer(<your Keras optimizer>)`."
        )
