"""Building `DispatchOptimizer`: where each variable goes, and the tables' trainers.

`Routes`, a part of `DispatchOptimizer`: `build` finds the declaring layers
(`discovery`), asks `routing.plan` where every variable goes, builds the
wrapped optimizers on the dense variables only and one `TableTrainer` per
table (grouped where asked), and answers what trains which table.
"""

import weakref

import keras

from sparseopt import backend, compat
from sparseopt.disk import look_ahead
from sparseopt.disk.table import DiskTable
from sparseopt.engine import accumulation
from sparseopt.engine.group import group_trainers
from sparseopt.engine.trainer import TableTrainer
from sparseopt.ops.row_sources import LookupRows, SlicedRows
from sparseopt.optimizer import checks, routing
from sparseopt.optimizer.discovery import declared_tables, tables_beside
from sparseopt.optimizer.keras_rs_tables import adapt


class Routes:
    """Routing and the tables' trainers of `DispatchOptimizer`."""

    def _add_dense_optimizer(self, optimizer):
        """Keeps `optimizer` (if it is a Keras one) among the dense optimizers, once."""
        if isinstance(optimizer, keras.optimizers.Optimizer) and not any(
                optimizer is o for o in self._dense_optimizers):
            self._dense_optimizers.append(optimizer)
            optimizer.loss_scale_factor = self.loss_scale_factor

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
        (see `sparseopt.optimizer.discovery`).

        Args:
            var_list: the model's trainable variables.
        """
        if self.built:
            return
        given, var_list = var_list, list(var_list)
        wrapper = compat.wrapper_building(self)
        self._scaling_wrapper = weakref.ref(wrapper) if wrapper is not None else None
        model = compat.model_building(self)
        self._model = weakref.ref(model) if model is not None else None
        # int8 tables and tables on disk are no trainable variables: they are
        # reached through their lookups' probes, which are.
        tables = var_list + tables_beside(var_list)
        declared = declared_tables(tables, model)
        added = {}  # id(table) -> probe made while building (keras-rs tables, JAX)
        self._trainers = {}  # var key -> TableTrainer
        self._watched = {}  # var key -> TableTrainer reading that variable's gradient
        dense = {id(opt): [] for opt in self._dense_optimizers}
        self._route = {}
        self._installed = {}  # var key -> variable whose "gradient" is its new value
        for route in routing.plan(tables, declared, self._optimizer_map,
                                  self._default_optimizer):
            var = route.variable
            # (A table's trainer is keyed by `_add_trainer`: a table on disk is no
            # variable, which Keras' key on TF reads.)
            key = None if route.kind == routing.TABLE else self._var_key(var)
            if route.kind == routing.INSTALLED:
                self._installed[key] = var
            elif route.kind == routing.TABLE:
                source = self._row_source(route, added)
                if isinstance(source, LookupRows):  # (TF's sparse gradients need no lookup)
                    checks.table(var, route.target, source.lookup, route.owner)
                self._add_trainer(TableTrainer(var, route.target, source, route.owner))
            elif route.kind == routing.DENSE:
                self._add_dense_optimizer(route.target)
                dense.setdefault(id(route.target), []).append(var)
                self._route[key] = route.target
        if self._trainers:
            checks.dense_options(self._dense_optimizers, sorted(self.table_trainers))
            checks.replicas(sorted(self.table_trainers))
        # Every refusal before the first variable: a build that raises leaves the
        # optimizer as it was, so building again (`fit` after a refused
        # `optimizer.build`) creates each variable once.
        for trainer in self._trainers.values():
            trainer.check()
        ids_per_step = None
        if self.gradient_accumulation_steps:
            trainers = list(self._trainers.values())
            ids_per_step = self._ids_per_step(model, trainers, "gradient_accumulation_steps")
            self.accumulation_ids_per_step = {t.name: ids_per_step[id(t)] for t in trainers}
        listing = [t for t in self._trainers.values() if t.lists_window_rows]
        if listing:  # (Lookahead's list on disk: `engine.lookahead_list`)
            counts = self._ids_per_step(model, listing, "Lookahead on a table on disk")
            # (An accumulated update's rows are those of all its micro-steps.)
            updates_of = self.gradient_accumulation_steps or 1
            for trainer in listing:
                trainer.ids_per_step = counts[id(trainer)] * updates_of
        if self._installed:
            scaled = self.loss_scale_factor is not None or self.loss_scaling_wrapper is not None
            checks.install_options(sorted(v.path for v in self._installed.values()), scaled,
                                   [self, *self._dense_optimizers])
        exclusion = getattr(self, "_decay_exclusion", None)
        for opt in self._dense_optimizers:
            if exclusion is not None:  # again: some were found while building
                opt.exclude_from_weight_decay(var_list=exclusion[0], var_names=exclusion[1])
            opt.build(dense.get(id(opt), []))
        for trainer in self._trainers.values():
            # The wrapped optimizer's rules (set on it, or forwarded from here).
            trainer.decays = (
                id(trainer.table) not in getattr(self, "_decay_excluded_tables", ())
                and compat.uses_weight_decay(self._default_optimizer, trainer.table))
            # A loss-scale wrapper learns of non-finite row gradients from the
            # probe's gradient (NaN); without one, nothing reads it.
            if isinstance(trainer.source, LookupRows):
                trainer.source.lookup.marks_non_finite = wrapper is not None
        groups, _ = group_trainers(self._trainers.values()) if self.group_tables else ([], [])
        grouped = {id(t) for g in groups for t in g.trainers}
        self._groups = groups
        with keras.name_scope(self.name, caller=self):
            # The wrapped learning rate the user gave (read at construction):
            # tables follow it in proportion (`learning_rate_scale`); saved, so
            # a resumed run keeps the proportion.
            start = self._given_rate if self._given_rate is not None else 0.0
            self._rate_at_start = self.add_variable(
                shape=(), dtype="float32", initializer=keras.initializers.Constant(start),
                name="learning_rate_at_start")
            # Table by table in the order found, grouped or not: the saved
            # state keeps its order whatever the grouping. Outside any trace:
            # TF builds optimizers inside the traced step, where its variables'
            # initial values would all be computed together in the first call
            # (tables + twice their state at the peak; measured: a 26-table
            # model whose tables and Adagrad state fit in 17 GB was killed at
            # 24 GB). Eager, each state is created and its initial value freed
            # before the next.
            with backend.outside_trace():
                for index, trainer in enumerate(self._trainers.values()):
                    trainer.build(self, workspace=id(trainer) not in grouped, index=index)
                for i, group in enumerate(groups):
                    group.build(self, f"table_group_{i}")
            self._accumulator = None
            if self.gradient_accumulation_steps:
                self._accumulator = accumulation.Accumulator(self.gradient_accumulation_steps)
                self._accumulator.build(
                    self, [v for v in var_list if self._var_key(v) in self._route],
                    list(self._trainers.values()), ids_per_step, self._var_key)
        # Each new probe sits right after its table, where the layer's
        # variables (its one weight, then its state) put it in the model's
        # trainable_variables: stateless
        # steps (JAX) pair this list with the model's values by position.
        ordered = [w for v in var_list for w in ([v, added[id(v)]] if id(v) in added else [v])]
        if added and isinstance(given, list):
            # A wrapping LossScaleOptimizer builds itself from this same list
            # right after us, and pairs its gradients with it by position too.
            given[:] = ordered
        # Keras' base builds no full-size accumulators: `gradient_accumulation_steps`
        # reads None while it builds (the tables' are `self._accumulator`).
        self.__dict__["_building_base"] = True
        try:
            super().build(ordered)
        finally:
            self.__dict__["_building_base"] = False
        pending, self._pending_state = getattr(self, "_pending_state", None), None
        if pending is not None:
            self._assign_state(pending)
        look_ahead.install(model, self._tables_to_fetch_ahead())

    def _tables_to_fetch_ahead(self):
        """`[(DiskTable, layer)]`: the tables on disk whose rows `fit` may fetch one step
        ahead (`sparseopt.disk.look_ahead`): looked up by their layer's ids as they are
        (an open vocabulary's rows follow from its map, in the step)."""
        found = []
        for trainer in self._trainers.values():
            layer = (trainer.source.lookup.layer if isinstance(trainer.source, LookupRows)
                     else None)
            if (isinstance(trainer.table, DiskTable) and trainer.vocabulary is None
                    and layer is not None and trainer.table.settings.fetch_ahead):
                found.append((trainer.table, layer))
        return found

    def _ids_per_step(self, model, trainers, needs):
        """`{id(trainer): ids its table looks up per step}` of `trainers`, to size buffers.

        Each `SparseLookup` counts the ids of the last forward pass it saw
        with a known batch shape: the traced step's own shapes. TF builds the
        optimizer inside the traced step, after the forward pass; on JAX,
        Keras' trainer traces the model on the first batch's shapes just
        before it builds the optimizer (whenever the model, its loss or its
        metrics are unbuilt, as after `compile`), or an earlier call of the
        model on a batch counted them. Only where neither happened (a built
        model compiled with no loss or metrics) is the batch Keras holds
        found on the stack (`compat.training_batch`) and the model traced on
        it.

        Args:
            model: the model being trained, or None.
            trainers: the tables' `TableTrainer`s.
            needs: what needs the counts, for the error (`"gradient_accumulation_steps"`).
        """
        def counts():
            given = self.accumulation_ids_per_step
            return {id(t): given[t.name] if t.name in given else t.source.ids_per_step()
                    for t in trainers}

        found = counts()
        if None in found.values() and model is not None:
            backend.trace_forward(model, lambda: compat.training_batch(self))
            found = counts()
        missing = [t.name for t in trainers if found[id(t)] is None]
        if missing:
            raise ValueError(
                f"DispatchOptimizer: {needs} needs to know how many ids "
                f"tables {missing} look up per step, to size their buffers, but no batch of "
                "known shape has gone through them. Call the model on one training batch "
                "(`model(x)`) before building the optimizer yourself, let `fit` / "
                "`train_on_batch` build it, or pass `accumulation_ids_per_step={path: n}`.")
        return found

    def _add_trainer(self, trainer):
        table = trainer.table
        key = self._var_key(table) if isinstance(table, keras.Variable) else id(table)
        self._trainers[key] = trainer
        for var in trainer.source.watched:
            self._watched[self._var_key(var)] = trainer

    def _row_source(self, route, added):
        """Where the row gradients of a `TABLE` route's table come from.

        A keras-rs table read densely so far is adapted first
        (`keras_rs_tables.adapt`); where that makes a new probe (JAX), it is
        kept in `added`, `{id(table): probe}`.
        """
        if route.lookup is not None or route.keras_rs_layer is None:
            return LookupRows(route.lookup)
        lookup = adapt(route.keras_rs_layer)
        if lookup is None:  # TF: the gradient is already sparse
            return SlicedRows(route.variable)
        added[id(route.variable)] = lookup.probe
        return LookupRows(lookup)

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
