"""`DispatchOptimizer`: dense variables to a Keras optimizer, tables to updaters."""

import re
import weakref

import keras
from keras import ops
import numpy as np

from sparseopt import backend, checks, compat, row_grads
from sparseopt.discovery import declared_tables
from sparseopt.keras_rs_tables import read_by_gather, read_sparsely
from sparseopt.table_trainer import LookupRows, SlicedRows, TableTrainer, group_trainers
from sparseopt.updaters import Updater


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

    With `group_tables=True`, tables with the same width, dtype and updater
    configuration are updated together (`sparseopt.table_trainer.TableGroup`:
    one dedup pass for all of them), with the results, state and checkpoints
    of updating each alone.

    Under a `keras.distribution` (JAX), each table's state is split like the
    table, and a table split by rows is updated on each shard, in place (see
    `sparseopt.distribution`). Under a TensorFlow `MirroredStrategy`, every
    replica gathers the row gradients of all replicas and applies the same
    update to its own copy of each table; other TF strategies are refused.

    Args:
        optimizer: the Keras optimizer (instance or name) for dense variables.
        optimizer_map: optional dict from variable path (exact, else a regex
            matched with `re.fullmatch`, as in `keras.optimizers.OptimizerMap`)
            to a Keras optimizer or a `sparseopt.updaters.Updater`. It overrides
            what layers declare.
        group_tables: update tables that share width, dtype and updater
            configuration in one dedup pass (same results). Off by default:
            on CPU it is slower today at production shapes (one large dedup
            is costlier than many small ones; see docs/design.md).
        name: optional name.
    """

    def __init__(self, optimizer, optimizer_map=None, group_tables=False, name=None,
                 **kwargs):
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
        self.group_tables = bool(group_tables)
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
    def dense_optimizers(self):
        """The Keras optimizers of the dense variables (`optimizer` first)."""
        return list(self._dense_optimizers)

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

    @property
    def loss_scaling_wrapper(self):
        """The `LossScaleOptimizer` that built this optimizer (wraps it), or None."""
        ref = getattr(self, "_scaling_wrapper", None)
        return ref() if ref is not None else None

    def build(self, var_list):
        """Routes `var_list` and creates the state of every sparse table.

        Declared updaters are found through each table's `SparseLookup` (which
        knows its layer) and through the model being trained, when Keras'
        trainer builds the optimizer or `model.optimizer.build(...)` is called
        (see `sparseopt.discovery`).

        Args:
            var_list: the model's trainable variables.
        """
        if self.built:
            return
        given, var_list = var_list, list(var_list)
        wrapper = compat.wrapper_building(self)
        self._scaling_wrapper = weakref.ref(wrapper) if wrapper is not None else None
        declared = declared_tables(var_list, compat.model_building(self))
        added = {}  # id(table) -> probe made while building (keras-rs tables, JAX)
        self._trainers = {}  # var key -> TableTrainer
        self._watched = {}  # var key -> TableTrainer reading that variable's gradient
        dense = {id(opt): [] for opt in self._dense_optimizers}
        self._route = {}
        self._installed = {}  # var key -> variable whose "gradient" is its new value
        for var in var_list:
            key = self._var_key(var)
            lookup = getattr(var, "_sparseopt_lookup", None)
            if getattr(var, "_sparseopt_probe_of", None) is not None:
                continue  # watched by its table's trainer
            if getattr(var, "overwrite_with_gradient", False):
                # keras-rs SparseCore tables, slots and step counter: their
                # lookup's backward pass computes the new values.
                self._installed[key] = var
                continue
            target, owner = self._lookup_map(var.path), "optimizer_map"
            found = declared.get(id(var))
            if target is None and found is not None:
                target, owner = found.updater, found.owner
            if isinstance(target, Updater):
                if lookup is None and found is not None and found.keras_rs_layer is not None:
                    lookup = self._read_sparsely(found.keras_rs_layer, added, var)
                    if lookup is None:  # TF: the gradient is already sparse
                        self._add_trainer(TableTrainer(var, target, SlicedRows(var), owner))
                        continue
                checks.table(var, target, lookup, owner)
                self._add_trainer(TableTrainer(var, target, LookupRows(lookup), owner))
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
        if self._trainers:
            checks.dense_options(self._dense_optimizers, sorted(self.table_trainers))
            checks.replicas(sorted(self.table_trainers))
        if self._installed:
            scaled = self.loss_scale_factor is not None or self.loss_scaling_wrapper is not None
            checks.install_options(sorted(v.path for v in self._installed.values()), scaled,
                                   self._dense_optimizers)
        for opt in self._dense_optimizers:
            opt.build(dense[id(opt)])
        groups, _ = group_trainers(self._trainers.values()) if self.group_tables else ([], [])
        grouped = {id(t) for g in groups for t in g.trainers}
        self._groups = groups
        with keras.name_scope(self.name, caller=self):
            # Table by table in the order found, grouped or not: the saved
            # state keeps its order whatever the grouping.
            for index, trainer in enumerate(self._trainers.values()):
                trainer.build(self, workspace=id(trainer) not in grouped, index=index)
            for i, group in enumerate(groups):
                group.build(self, f"table_group_{i}")
        # Each new probe sits right after its table, where the layer's
        # variables (its one weight, then its state) put it in the model's
        # trainable_variables: stateless
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

    def _add_trainer(self, trainer):
        self._trainers[self._var_key(trainer.table)] = trainer
        for var in trainer.source.watched:
            self._watched[self._var_key(var)] = trainer

    def _read_sparsely(self, layer, added, var):
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
        return lookup

    # -- the tables ---------------------------------------------------------

    @property
    def table_trainers(self):
        """`{table path: TableTrainer}` of every sparsely trained table (once built)."""
        return {t.name: t for t in getattr(self, "_trainers", {}).values()}

    def table_trainer(self, table):
        """The `TableTrainer` of `table` (its Keras variable or its path)."""
        trainers = self.table_trainers
        path = table if isinstance(table, str) else table.path
        if path not in trainers or (not isinstance(table, str)
                                    and trainers[path].table is not table):
            raise KeyError(
                f"DispatchOptimizer '{self.name}': no sparse table '{path}' (built: "
                f"{self.built}); its tables are {sorted(trainers)}."
            )
        return trainers[path]

    def table_state(self, table):
        """`{slot name: Keras variable}`: the updater state of `table`.

        Args:
            table: the table's Keras variable, or its path.
        """
        return self.table_trainer(table).state()

    def state_variables(self):
        """Every variable a checkpoint holds: the Keras optimizers' and the tables' state."""
        scratch = {id(v) for v in self.scratch_variables()}
        return [v for v in self.variables if id(v) not in scratch]

    def scratch_variables(self):
        """Working memory that is not state (JAX's dedup workspaces): never saved."""
        owners = [*getattr(self, "_trainers", {}).values(), *getattr(self, "_groups", [])]
        return [v for owner in owners for v in owner.scratch_variables]

    @property
    def table_groups(self):
        """`[[table path, ...], ...]`: the tables updated together, one list per group."""
        return [[t.name for t in g.trainers] for g in getattr(self, "_groups", [])]

    def dropped_ids(self):
        """`{table path: ids seen outside [0, rows) so far}` (never written anywhere)."""
        return {path: t.dropped_ids() for path, t in self.table_trainers.items()}

    def skipped_steps(self):
        """`{table path: number of steps skipped for non-finite gradients}`."""
        return {path: t.skipped_steps() for path, t in self.table_trainers.items()}

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
        watched = {}
        for grad, var in zip(grads, trainable_variables):
            key = self._var_key(var)
            if key in self._watched:
                watched[id(var)] = grad
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
            rows = {}  # id(trainer) -> (ids, true row gradients) of this step
            for trainer in self._trainers.values():
                found = trainer.source.row_gradients(watched, trainer.name)
                if found is not None:
                    ids, grads = found
                    if self.loss_scale_factor is not None:
                        grads = row_grads.scale(grads, 1.0 / self.loss_scale_factor)
                    # TF MirroredStrategy: every replica's rows, applied by each.
                    rows[id(trainer)] = backend.all_replicas(ids, grads)
            grouped = set()
            for group in self._groups:
                looked_up = [(t, *rows[id(t)]) for t in group.trainers if id(t) in rows]
                if looked_up:
                    group.apply(looked_up, self._iterations)
                grouped.update(id(t) for t in group.trainers)
            for trainer in self._trainers.values():
                if id(trainer) in rows and id(trainer) not in grouped:
                    trainer.apply(*rows[id(trainer)], self._iterations)
        self._iterations.assign_add(1)

    # -- saving: everything but the dedup workspace ---------------------------

    # Keras' saver walks `dir(optimizer)` and would save each wrapped
    # optimizer a second time under its own path (and, loading into an
    # unbuilt one, warn that it skipped it). This optimizer saves their
    # variables itself, in `save_own_variables`.
    _WRAPPED = frozenset({"optimizer", "_default_optimizer", "_dense_optimizers",
                          "dense_optimizers",
                          "_optimizer_map", "_route", "loss_scaling_wrapper",
                          "_scaling_wrapper"})

    def __dir__(self):
        return [n for n in super().__dir__() if n not in self._WRAPPED]

    def save_own_variables(self, store):
        for i, variable in enumerate(self.state_variables()):
            store[str(i)] = variable.numpy()

    def load_own_variables(self, store):
        """Restores the state saved by `save_own_variables`.

        Loading into an optimizer that is not built yet (`load_weights` right
        after `compile`) keeps the values and assigns them when it is built,
        where Keras' optimizers would drop them with a warning. A checkpoint
        that does not match this optimizer's state is an error, never a
        partial load; one with no optimizer state leaves it as it is.
        """
        values = [np.array(store[str(i)]) for i in range(len(store.keys()))]
        if not values:
            # The file holds no optimizer state (written by a model without an
            # optimizer, or before compile): there is nothing to restore.
            return
        if not self.built:
            self._pending_state = values
            return
        self._assign_state(values)

    def _assign_state(self, values):
        saved = self.state_variables()
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

    def catch_up_tables(self):
        """Brings every row of `lazy=False` and `ema_momentum` tables up to the current step.

        Such tables apply the steps a row missed (decay, momentum, the
        average's decay) when the row is next touched; this applies them to
        every row now (whole-table work). Keras calls it at the end of `fit`;
        call it yourself before evaluating or exporting mid-training. Exact
        resume does not need it: the per-row record is saved with the state.
        """
        trainers = [t for t in self._trainers.values() if t.updater.tracks_rows]
        if not trainers:
            return
        steps_done = self._steps_done()
        with backend.outside_trace():
            for trainer in trainers:
                trainer.catch_up(steps_done)

    def _steps_done(self):
        return int(ops.convert_to_numpy(self._iterations.value))

    def table_moving_average(self, table):
        """The moving average of a table whose updater has `ema_momentum` (a tensor).

        Args:
            table: the table variable or its path.
        """
        trainer = self.table_trainer(table)
        if trainer.updater.ema_momentum is None:
            raise ValueError(f"DispatchOptimizer '{self.name}': table '{trainer.name}' keeps "
                             "no moving average; give its updater `ema_momentum`.")
        return trainer.moving_average(self._steps_done())

    def finalize_variable_values(self, var_list):
        """Catches up every row, then gives `ema_momentum` tables their average (Keras' hook,
        called at the end of `fit`)."""
        self.catch_up_tables()
        averaged = [t for t in self._trainers.values() if t.updater.ema_momentum is not None]
        if averaged:
            steps_done = self._steps_done()
            with backend.outside_trace():
                for trainer in averaged:
                    trainer.use_moving_average(steps_done)
        for opt in self._dense_optimizers:
            opt.finalize_variable_values(
                [v for v in var_list if self._route.get(self._var_key(v)) is opt]
            )

    def get_config(self):
        return {
            "name": self.name,
            "group_tables": self.group_tables,
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
