"""`DispatchOptimizer`: dense variables to a Keras optimizer, tables to updaters."""

import dataclasses
import gc
import re

import keras
import numpy as np
from keras import ops

from sparseopt import backend
from sparseopt.declared import declared_updaters
from sparseopt.distribution import layout_like
from sparseopt.keras_rs_tables import default_device_tables, read_by_gather, read_sparsely
from sparseopt.sparse_apply import sparse_apply
from sparseopt.updaters import Updater


@dataclasses.dataclass
class _Table:
    """What the optimizer keeps per table: its rule, lookup, state and skip count."""

    updater: Updater
    variable: object  # the table
    lookup: object  # sparseopt.ops.SparseLookup, or None: gradient arrives as slices (TF)
    slots: dict = dataclasses.field(default_factory=dict)  # slot name -> variable
    skipped: object = None  # int32 variable: steps skipped for non-finite gradients
    workspace: object = None  # int32 [V] dedup scratch (JAX), not saved


class _Filled(keras.initializers.Initializer):
    """`Constant(value)` in one buffer.

    Keras' `Constant` computes `value * ones(shape)`: two table-sized arrays
    at its peak, which for a 2.5 GB accumulator is 2.5 GB more than needed.
    """

    def __init__(self, value):
        self.value = value

    def __call__(self, shape, dtype=None):
        return ops.full(shape, self.value, dtype=dtype)


def _wrapped_by_loss_scaling(optimizer):
    """Whether a live `LossScaleOptimizer` wraps `optimizer` (it cannot tell us)."""
    return any(isinstance(o, keras.optimizers.LossScaleOptimizer)
               and o.inner_optimizer is optimizer for o in gc.get_objects())


@keras.saving.register_keras_serializable(package="sparseopt")
class DispatchOptimizer(keras.optimizers.Optimizer):
    """Routes each variable to the optimizer or sparse updater meant for it.

    When built, it collects the updaters that layers declare in
    `variable_path_to_optimizer_map` (and those given in `optimizer_map`).
    Declared tables are updated in place on their touched rows only; every
    other variable goes to `optimizer` (or to the Keras optimizer that
    `optimizer_map` names for it), which creates slots for those variables
    only.

    Loss scaling (`loss_scale_factor`, `keras.optimizers.LossScaleOptimizer`)
    reaches the tables: they see the true gradient, and a step skipped for
    non-finite gradients leaves them untouched. Clipping, weight decay and EMA
    of the Keras optimizer act on dense variables only.

    Under a `keras.distribution` (JAX), each table's state is split like the
    table, and a table split by rows is updated on each shard, in place (see
    `sparseopt.distribution`). TensorFlow distribution strategies are refused.

    Args:
        optimizer: the Keras optimizer (instance or name) for dense variables.
        optimizer_map: optional dict from variable path (exact, else a regex
            matched with `re.fullmatch`, as in `keras.optimizers.OptimizerMap`)
            to a Keras optimizer or a `sparseopt.updaters.Updater`. It overrides
            what layers declare.
        name: optional name.
    """

    def __init__(self, optimizer, optimizer_map=None, name=None, **kwargs):
        optimizer = keras.optimizers.get(optimizer)
        if isinstance(optimizer, (DispatchOptimizer, keras.optimizers.LossScaleOptimizer)):
            raise ValueError(
                "DispatchOptimizer: wrap a plain Keras optimizer. To scale the loss, "
                "wrap the DispatchOptimizer instead: "
                "`LossScaleOptimizer(DispatchOptimizer(Adam()))`."
            )
        loss_scale_factor = kwargs.pop("loss_scale_factor", optimizer.loss_scale_factor)
        super().__init__(learning_rate=0.0, name=name, **kwargs)
        self._default_optimizer = optimizer
        self._optimizer_map = {}
        for key, value in (optimizer_map or {}).items():
            if isinstance(value, dict):
                value = keras.saving.deserialize_keras_object(value)
            if not isinstance(value, (Updater, keras.optimizers.Optimizer)):
                raise TypeError(
                    f"DispatchOptimizer: optimizer_map['{key}'] must be a Keras "
                    f"optimizer or a sparseopt updater, got {value!r}."
                )
            self._optimizer_map[key] = value
        self._dense_optimizers = [optimizer] + [
            v for v in self._optimizer_map.values()
            if isinstance(v, keras.optimizers.Optimizer) and v is not optimizer
        ]
        # One loss scale for everything, as MultiOptimizer does.
        self.loss_scale_factor = loss_scale_factor

    # -- configuration shared with the wrapped optimizer --------------------

    @property
    def optimizer(self):
        """The Keras optimizer for variables that nothing else claims."""
        return self._default_optimizer

    @property
    def learning_rate(self):
        return self._default_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, value):
        if hasattr(self, "_default_optimizer"):
            self._default_optimizer.learning_rate = value

    @property
    def loss_scale_factor(self):
        return getattr(self, "_loss_scale_factor", None)

    @loss_scale_factor.setter
    def loss_scale_factor(self, value):
        self._loss_scale_factor = value
        for opt in getattr(self, "_dense_optimizers", []):
            opt.loss_scale_factor = value

    @property
    def variables(self):
        out = self._variables[:]
        for opt in self._dense_optimizers:
            out.extend(opt.variables)
        return out

    # -- routing ------------------------------------------------------------

    def _lookup_map(self, path):
        if path in self._optimizer_map:
            return self._optimizer_map[path]
        hits = [k for k in self._optimizer_map if re.fullmatch(k, path)]
        if len(hits) > 1:
            raise ValueError(
                f"DispatchOptimizer: variable '{path}' matches several optimizer_map "
                f"keys {hits}; make them exclusive."
            )
        return self._optimizer_map[hits[0]] if hits else None

    def build(self, var_list):
        if self.built:
            return
        given, var_list = var_list, list(var_list)
        declared = declared_updaters(var_list)
        with backend.outside_trace():  # reads optimizer configs (TF builds in a trace)
            keras_rs_tables = default_device_tables(var_list)
        added = {}  # id(table) -> probe made while building (keras-rs tables, JAX)
        self._tables = {}  # var key -> _Table
        self._probes = {}  # var key -> lookup
        dense = {id(opt): [] for opt in self._dense_optimizers}
        self._route = {}
        self._installed = {}  # var key -> variable whose "gradient" is its new value
        for var in var_list:
            key = self._var_key(var)
            lookup = getattr(var, "_sparseopt_lookup", None)
            if getattr(var, "_sparseopt_probe_of", None) is not None:
                self._probes[key] = var._sparseopt_probe_of
                continue
            if getattr(var, "overwrite_with_gradient", False):
                # keras-rs SparseCore tables, slots and step counter: their
                # lookup's backward pass computes the new values.
                self._installed[key] = var
                continue
            target = self._lookup_map(var.path)
            owner = "optimizer_map"
            if target is None and id(var) in declared:
                target, owner = declared[id(var)][0], f"layer '{declared[id(var)][1]}'"
            elif target is None and id(var) in keras_rs_tables:
                target, owner, _ = keras_rs_tables[id(var)]
            if isinstance(target, Updater):
                if lookup is None and id(var) in keras_rs_tables:
                    lookup = self._read_sparsely(var, keras_rs_tables[id(var)][2], added)
                    if lookup is None:  # TF: the gradient is already sparse
                        self._tables[key] = _Table(target, var, None)
                        continue
                self._check_table(var, target, lookup, owner)
                self._tables[key] = _Table(target, var, lookup)
            elif lookup is not None:
                raise ValueError(
                    f"DispatchOptimizer: table '{var.path}' is read by a sparse lookup "
                    "but has no sparse updater (its dense gradient is always zero). "
                    "Declare one in the layer's `variable_path_to_optimizer_map` or "
                    "pass `optimizer_map={'%s': sparseopt.updaters.Adagrad(...)}`."
                    % var.path
                )
            else:
                opt = target or self._default_optimizer
                dense[id(opt)].append(var)
                self._route[key] = opt
        if self._tables:
            self._check_dense_options()
            self._check_replicas()
        if self._installed:
            self._check_install_options()
        for opt in self._dense_optimizers:
            opt.build(dense[id(opt)])
        with keras.name_scope(self.name, caller=self):
            for entry in self._tables.values():
                table = entry.variable
                for spec in entry.updater.slots:
                    shape = spec.shape(table.shape)
                    entry.slots[spec.name] = self.add_variable(
                        shape=shape,
                        initializer=_Filled(spec.initial_value),
                        dtype=table.dtype,
                        # Sharded like the table, so that updates stay local.
                        layout=layout_like(table, len(shape)),
                        name=f"{table.path.replace('/', '_')}_{spec.name}",
                    )
                entry.skipped = self.add_variable(
                    shape=(), dtype="int32", initializer="zeros",
                    name=f"{table.path.replace('/', '_')}_skipped_steps",
                )
                if backend.WORKSPACE:
                    # Scratch for the dedup, one per table so that the tables'
                    # updates stay independent. Not state: never saved.
                    entry.workspace = self.add_variable(
                        shape=(table.shape[0],), dtype="int32", initializer="zeros",
                        layout=layout_like(table, 1),
                        name=f"{table.path.replace('/', '_')}_dedup_workspace",
                    )
        # Each new probe sits right after its table, where the layer's weights
        # (table, probe) put it in the model's trainable_variables: stateless
        # steps (JAX) pair this list with the model's values by position.
        ordered = [w for v in var_list for w in ([v, added[id(v)]] if id(v) in added else [v])]
        if added and isinstance(given, list):
            # A wrapping LossScaleOptimizer builds itself from this same list
            # right after us, and pairs its gradients with it by position too.
            given[:] = ordered
        super().build(ordered)
        pending, self._pending_state = getattr(self, "_pending_state", None), None
        if pending is not None:
            self._assign_state(pending)

    def _read_sparsely(self, var, layer, added):
        """A keras-rs fallback table: read it sparsely where needed (JAX).

        Returns its `SparseLookup`, or None where the backend's gradient of
        the dense lookup is already sparse (TF's `IndexedSlices`).
        """
        if backend.SPARSE_GRADIENTS:
            # TF builds the optimizer while tracing the first step, after its
            # forward pass; creating variables there makes tf.function trace
            # the step again, and that trace reads sparsely.
            read_by_gather(layer)
            return None
        lookup = read_sparsely(layer)
        added[id(var)] = lookup.probe
        self._probes[self._var_key(lookup.probe)] = lookup
        return lookup

    def _check_table(self, var, updater, lookup, owner):
        if lookup is None:
            raise ValueError(
                f"DispatchOptimizer: {owner} assigns updater {updater!r} to "
                f"'{var.path}', but that variable is not read through "
                "sparseopt.ops.SparseLookup, so its gradient would be dense and the "
                "update would cost the whole table. Read it with "
                "`sparseopt.ops.SparseLookup(layer, variable)` (as "
                "sparseopt.layers.SparseEmbedding does), or give it a Keras optimizer."
            )
        # Both act on the whole table every step: a regularizer's dense
        # gradient would never reach the updater, a constraint would cost V.
        if getattr(var, "regularizer", None) is not None:
            raise ValueError(
                f"DispatchOptimizer: table '{var.path}' has a regularizer "
                f"({var.regularizer!r}); its gradient is dense and a sparse updater "
                "never sees it. Remove it and regularize in the updater instead "
                "(e.g. `sparseopt.updaters.Ftrl(..., l2_regularization_strength=...)`), "
                "or regularize only the looked-up rows in the loss."
            )
        if getattr(var, "constraint", None) is not None:
            raise ValueError(
                f"DispatchOptimizer: table '{var.path}' has a constraint "
                f"({var.constraint!r}); applying it after each step would touch every "
                "row. Remove it, or constrain the looked-up rows in the layer's call "
                "(e.g. normalize them)."
            )

    def _check_dense_options(self):
        for opt in self._dense_optimizers:
            if opt.gradient_accumulation_steps:
                tables = sorted(t.variable.path for t in self._tables.values())
                raise ValueError(
                    f"DispatchOptimizer: `gradient_accumulation_steps="
                    f"{opt.gradient_accumulation_steps}` on {opt.name} is not supported "
                    f"with sparse tables {tables}: accumulating their updates would "
                    "need table-sized buffers. Remove it and use a larger batch "
                    "(or accumulate in a custom train_step)."
                )

    def _check_install_options(self):
        names = sorted(v.path for v in self._installed.values())
        shown = names[:4] + (["..."] if len(names) > 4 else [])
        scaled = self.loss_scale_factor is not None or _wrapped_by_loss_scaling(self)
        if scaled:
            raise ValueError(
                f"DispatchOptimizer: loss scaling is not supported with keras-rs "
                f"SparseCore tables {shown}: their lookup's backward pass computes "
                "the updated tables from the scaled gradient, so every table update "
                "would be scaled too. Remove `loss_scale_factor` / the "
                "LossScaleOptimizer (SparseCore tables are float32), or place these "
                "tables with `placement='default_device'`."
            )
        for opt in self._dense_optimizers:
            if opt.gradient_accumulation_steps:
                raise ValueError(
                    f"DispatchOptimizer: `gradient_accumulation_steps="
                    f"{opt.gradient_accumulation_steps}` is not supported with keras-rs "
                    f"SparseCore tables {shown}: each step's backward pass already "
                    "applies the table update; accumulating would mix tables. Remove "
                    "it and use a larger batch."
                )

    def _check_replicas(self):
        replicas = backend.replicas_running_alone()
        if replicas > 1:
            tables = sorted(t.variable.path for t in self._tables.values())
            raise ValueError(
                f"DispatchOptimizer: the sparse tables {tables} would be trained by "
                f"{replicas} replicas of a TensorFlow distribution strategy, each "
                "running its own step and writing its own rows, which sparseopt does "
                "not support. Train on one device, or shard the tables on JAX with "
                "keras.distribution (see sparseopt.distribution.row_sharded)."
            )

    def dropped_ids(self):
        """`{table path: ids seen outside [0, rows) so far}` (never written anywhere)."""
        return {t.variable.path: int(ops.convert_to_numpy(t.lookup.num_dropped_ids.value))
                if t.lookup is not None else 0 for t in self._tables.values()}

    def skipped_steps(self):
        """`{table path: number of steps skipped for non-finite gradients}`."""
        return {t.variable.path: int(ops.convert_to_numpy(t.skipped.value))
                for t in self._tables.values()}

    # -- applying -----------------------------------------------------------

    def apply(self, grads, trainable_variables=None):
        if len(grads) == 0:
            return
        if trainable_variables is None:
            if not self.built:
                raise ValueError(
                    "DispatchOptimizer: call `build(variables)` or pass "
                    "`trainable_variables` on the first `apply`."
                )
            trainable_variables = self._trainable_variables
        trainable_variables = list(trainable_variables)
        if not self.built:
            self.build(trainable_variables)
        self._check_variables_are_known(trainable_variables)

        by_opt = {id(opt): ([], []) for opt in self._dense_optimizers}
        probe_grads, sliced_grads = {}, {}
        for grad, var in zip(grads, trainable_variables):
            key = self._var_key(var)
            if key in self._probes:
                probe_grads[id(self._probes[key])] = grad
            elif key in self._tables:
                sliced_grads[key] = grad
            elif key in self._installed and grad is not None:
                # Install only: no scaling, clipping, decay or accumulation.
                self._installed[key].assign(grad)
            elif key in self._route and grad is not None:
                gs, vs = by_opt[id(self._route[key])]
                gs.append(grad)
                vs.append(var)
        for opt in self._dense_optimizers:
            gs, vs = by_opt[id(opt)]
            if gs:
                opt.apply(gs, vs)
        with keras.name_scope(self.name, caller=self):
            for key, table in self._tables.items():
                if table.lookup is None:
                    self._apply_sliced(table, sliced_grads.get(key))
                else:
                    self._apply_table(table, probe_grads.get(id(table.lookup)))
        self._iterations.assign_add(1)

    def _apply_table(self, table, probe_grad):
        lookup = table.lookup
        records = lookup.take_records()
        if not records:
            return  # not looked up in this step
        if probe_grad is None:
            raise ValueError(
                f"DispatchOptimizer: table '{lookup.table.path}' was looked up but "
                "its probe weight got no gradient; pass all of the model's "
                "trainable variables to `apply`."
            )
        # The probe's cotangent is 1 per lookup (NaN if that lookup's row
        # gradients were not finite); whatever scaled it (loss scaling) scaled
        # the row gradients the other way round.
        multiplier = ops.cast(probe_grad, "float32") / float(len(records))
        if self.loss_scale_factor is not None:
            multiplier = multiplier / self.loss_scale_factor
        ids = ops.concatenate([r[0] for r in records], axis=0)
        grads = ops.concatenate([ops.cast(r[1], "float32") for r in records], axis=0)
        self._update(table, ids, grads * multiplier)

    def _apply_sliced(self, table, grad):
        """A table whose gradient arrives as slices: `(ids, row gradients)` (TF)."""
        if grad is None:
            return
        sliced = backend.gradient_slices(grad)
        if sliced is None:
            raise ValueError(
                f"DispatchOptimizer: table '{table.variable.path}' received a dense "
                "gradient; something before the optimizer (e.g. LossScaleOptimizer's "
                "finiteness check, or clipping in a custom train_step) densified it, "
                "which costs the whole table every step. Use "
                "`DispatchOptimizer(..., loss_scale_factor=...)` for loss scaling and "
                "pass the tape's gradients to the optimizer unchanged."
            )
        ids, grads = sliced
        grads = ops.cast(grads, "float32")
        if self.loss_scale_factor is not None:
            grads = grads / self.loss_scale_factor
        self._update(table, ids, grads)

    def _update(self, table, ids, grads):
        """The updater's sparse step on `table`; a skipped step is counted."""
        applied = sparse_apply(
            table.updater, table.variable, table.slots, ids, grads,
            table.updater.learning_rate_at(self._iterations), self._iterations + 1,
            workspace=table.workspace,
        )
        table.skipped.assign_add(1 - ops.cast(applied, "int32"))

    # -- saving: everything but the dedup workspace ---------------------------

    # Keras' saver walks `dir(optimizer)` and would save each wrapped
    # optimizer a second time under its own path (and, loading into an
    # unbuilt one, warn that it skipped it). This optimizer saves their
    # variables itself, in `save_own_variables`.
    _WRAPPED = frozenset({"optimizer", "_default_optimizer", "_dense_optimizers",
                          "_optimizer_map", "_route"})

    def __dir__(self):
        return [n for n in super().__dir__() if n not in self._WRAPPED]

    def _saved_variables(self):
        scratch = {id(t.workspace) for t in getattr(self, "_tables", {}).values()}
        return [v for v in self.variables if id(v) not in scratch]

    def save_own_variables(self, store):
        for i, variable in enumerate(self._saved_variables()):
            store[str(i)] = variable.numpy()

    def load_own_variables(self, store):
        """Restores the state saved by `save_own_variables`.

        Loading into an optimizer that is not built yet (`load_weights` right
        after `compile`) keeps the values and assigns them when it is built,
        where Keras' optimizers would drop them with a warning. A checkpoint
        that does not match this optimizer's state is an error, never a
        partial load.
        """
        values = [np.array(store[str(i)]) for i in range(len(store.keys()))]
        if not self.built:
            self._pending_state = values
            return
        self._assign_state(values)

    def _assign_state(self, values):
        saved = self._saved_variables()
        mismatch = len(values) != len(saved) or any(
            tuple(v.shape) != tuple(x.shape) for v, x in zip(saved, values))
        if mismatch:
            want = [(v.path, tuple(v.shape)) for v in saved]
            got = [tuple(x.shape) for x in values]
            raise ValueError(
                f"DispatchOptimizer '{self.name}': the checkpoint's optimizer state "
                f"does not match this optimizer. It holds {len(values)} variables "
                f"of shapes {got}; this optimizer has {want}. Build the model and "
                "compile it exactly as when it was saved (same tables, updaters and "
                "Keras optimizer), or load with `compile=False` / `skip_mismatch` "
                "to start the optimizer afresh."
            )
        with backend.outside_trace():  # TF builds optimizers inside the traced step
            for variable, value in zip(saved, values):
                variable.assign(value)

    def finalize_variable_values(self, var_list):
        for opt in self._dense_optimizers:
            opt.finalize_variable_values(
                [v for v in var_list if self._route.get(self._var_key(v)) is opt]
            )

    def get_config(self):
        return {
            "name": self.name,
            "optimizer": keras.saving.serialize_keras_object(self._default_optimizer),
            "optimizer_map": {
                k: keras.saving.serialize_keras_object(v)
                for k, v in self._optimizer_map.items()
            },
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        config["optimizer"] = keras.saving.deserialize_keras_object(
            config["optimizer"], custom_objects=custom_objects
        )
        return cls(**config)
