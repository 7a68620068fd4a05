"""`DispatchOptimizer`: dense variables to a Keras optimizer, tables to updaters."""

import weakref

import keras
from keras import ops
import numpy as np

from sparseopt import backend, checks, compat, routing
from sparseopt.engine import accumulation, clipping
from sparseopt.discovery import declared_tables, int8_tables
from sparseopt.keras_rs_tables import adapt
from sparseopt.ops.row_sources import LookupRows, SlicedRows
from sparseopt.engine.trainer import TableTrainer, group_trainers


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
    non-finite gradients leaves them untouched. `global_clipnorm` is one norm
    over the dense gradients and the tables' (`sparseopt.clipping`). Keras'
    learning-rate callbacks reach the tables in proportion (each updater's
    `follow_learning_rate`), and every updater hyperparameter can change
    between steps (`sparseopt.updaters.core.hyperparameters`).
    `exclude_from_weight_decay` applies to the dense optimizers and to the
    tables' `weight_decay`. The wrapped optimizer's `clipnorm`, `clipvalue`,
    `weight_decay` and `use_ema` act on dense variables only (each updater
    has its own).

    With `group_tables=True`, tables with the same width, dtype and updater
    configuration are updated together (`sparseopt.engine.trainer.TableGroup`:
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
        global_clipnorm: clip all gradients, dense and tables', by one
            norm over all of them (Keras' `global_clipnorm` on the same model
            trained densely). A `global_clipnorm` on `optimizer` means the
            same (it is moved here).
        gradient_accumulation_steps: apply the mean gradient of this many
            micro-batches once (Keras' `gradient_accumulation_steps`, tables
            included, `sparseopt.accumulation`). On `optimizer` it means the
            same (it is moved here).
        accumulation_ids_per_step: `{table path: ids per step}`, the size of
            each table's accumulation buffers. Found from the first batch
            when built, and kept in the config (a loaded model rebuilds its
            buffers from it); give it only to build without a batch.
        loss_scale_factor: as Keras optimizers' (default: `optimizer`'s).
        learning_rate_reference: the wrapped rate tables' rates are in
            proportion to (`learning_rate_scale`); default: the wrapped
            optimizer's rate now. Kept in the config, so an optimizer made
            from it (a clone, a loaded model) keeps the proportion.
    """

    def __init__(self, optimizer, optimizer_map=None, group_tables=False, name=None,
                 accumulation_ids_per_step=None, learning_rate_reference=None, **kwargs):
        optimizer = keras.optimizers.get(optimizer)
        if isinstance(optimizer, (DispatchOptimizer, keras.optimizers.LossScaleOptimizer)):
            raise ValueError(
                "DispatchOptimizer: wrap a plain Keras optimizer. To scale the loss, "
                "wrap the DispatchOptimizer instead: "
                "`LossScaleOptimizer(DispatchOptimizer(Adam()))`."
            )
        checks.dispatch_arguments(kwargs)
        if optimizer.global_clipnorm:
            # One norm over everything, taken here (the wrapped optimizer
            # would clip the dense gradients by their own norm only).
            given = kwargs.get("global_clipnorm")
            if given and given != optimizer.global_clipnorm:
                raise ValueError(
                    f"DispatchOptimizer: global_clipnorm={given} and the wrapped "
                    f"optimizer's global_clipnorm={optimizer.global_clipnorm} differ; set one.")
            kwargs["global_clipnorm"] = optimizer.global_clipnorm
            optimizer.global_clipnorm = None
        if optimizer.gradient_accumulation_steps:
            # Accumulated here, tables and dense variables alike (`sparseopt.accumulation`).
            given = kwargs.get("gradient_accumulation_steps")
            if given and given != optimizer.gradient_accumulation_steps:
                raise ValueError(
                    f"DispatchOptimizer: gradient_accumulation_steps={given} and the "
                    "wrapped optimizer's gradient_accumulation_steps="
                    f"{optimizer.gradient_accumulation_steps} differ; set one.")
            kwargs["gradient_accumulation_steps"] = optimizer.gradient_accumulation_steps
            optimizer.gradient_accumulation_steps = None
        loss_scale_factor = kwargs.pop("loss_scale_factor", optimizer.loss_scale_factor)
        # The rate the user gave: tables follow the wrapped rate in proportion
        # to it (`learning_rate_scale`). Read now, not when built: a rate set
        # between compile and fit, or by a callback before the first step
        # (TensorFlow builds inside that step), is a change tables must see.
        given_rate = (_constant_rate(optimizer) if learning_rate_reference is None
                      else float(learning_rate_reference))
        super().__init__(learning_rate=0.0, name=name, **kwargs)
        self._given_rate = given_rate
        self._default_optimizer = optimizer
        self._accumulator = None  # gradient accumulation's buffers, once built
        self.accumulation_ids_per_step = dict(accumulation_ids_per_step or {})
        self.group_tables = bool(group_tables)
        self._optimizer_map = {}
        for key, value in (optimizer_map or {}).items():
            if isinstance(value, dict):
                value = keras.saving.deserialize_keras_object(value)
            checks.assigned(value, f"optimizer_map['{key}']")
            self._optimizer_map[key] = value
        # Each Keras optimizer once, however many entries name it: it builds
        # slots for the union of its variables and steps them once per step.
        self._dense_optimizers = [optimizer]
        for value in self._optimizer_map.values():
            self._add_dense_optimizer(value)
        # One loss scale for everything, as MultiOptimizer does.
        self.loss_scale_factor = loss_scale_factor

    @staticmethod
    def of(model_or_optimizer):
        """The `DispatchOptimizer` that trains a model, through any loss-scaling wrapper.

        Under `mixed_float16` Keras wraps the compiled optimizer in a
        `keras.optimizers.LossScaleOptimizer`, so `model.optimizer` has no
        `skipped_steps()`, `table_state()`, ...: this finds ours either way
        (`model.optimizer.inner_optimizer` is the same object).

        Args:
            model_or_optimizer: a compiled `keras.Model`, a `DispatchOptimizer`,
                or a `LossScaleOptimizer` wrapping one.

        Raises:
            ValueError: no `DispatchOptimizer` trains it.
        """
        optimizer = model_or_optimizer
        if isinstance(optimizer, keras.Model):
            optimizer = optimizer.optimizer
        inner = getattr(optimizer, "inner_optimizer", optimizer)
        if not isinstance(inner, DispatchOptimizer):
            raise ValueError(
                f"DispatchOptimizer.of: {model_or_optimizer!r} is not trained by a "
                f"sparseopt.DispatchOptimizer (found {optimizer!r}). Compile with "
                "`optimizer=sparseopt.DispatchOptimizer(<your Keras optimizer>)`.")
        return inner

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
    def gradient_accumulation_steps(self):
        """k: the micro-batches whose mean gradient each update applies (None: 1).

        Set at construction (or on the wrapped optimizer). Keras' base class
        would build a full-size accumulator for every variable, tables too;
        it sees None while it builds, and `sparseopt.accumulation` keeps
        buffers sized by the ids instead.
        """
        if self.__dict__.get("_building_base"):
            return None
        return self.__dict__.get("_accumulation_steps")

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, value):
        self._check_settable("gradient_accumulation_steps", value,
                             self.__dict__.get("_accumulation_steps"))
        self.__dict__["_accumulation_steps"] = value

    def _check_settable(self, name, value, current):
        """Refuses a new `value` of `name` once built: the traced step has read it, so
        a change would be silently ignored (setting it again to the same is fine)."""
        if getattr(self, "built", False) and value != current:
            raise ValueError(
                f"DispatchOptimizer: `{name}` cannot change once the optimizer is built "
                "(its traced step has read it). Set it before the first `fit` (or build), "
                "or compile again with a new DispatchOptimizer.")

    @property
    def global_clipnorm(self):
        """One norm over the dense gradients and the tables' rows (`sparseopt.clipping`).

        May be set until the optimizer is built (between `compile` and `fit`
        too); the step reads it when traced, so a later change is refused
        rather than silently ignored.
        """
        return self.__dict__.get("_global_clipnorm")

    @global_clipnorm.setter
    def global_clipnorm(self, value):
        self._check_settable("global_clipnorm", value, self.__dict__.get("_global_clipnorm"))
        self.__dict__["_global_clipnorm"] = value

    @property
    def learning_rate(self):
        """The wrapped optimizer's learning rate: what Keras' callbacks read and set.

        Tables follow it in proportion (`learning_rate_scale`); the Keras
        optimizers of `optimizer_map` keep their own.
        """
        return self._default_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, value):
        if hasattr(self, "_default_optimizer"):
            self._default_optimizer.learning_rate = value

    def sync_training_state(self):
        """Writes the state `fit` holds outside the variables back into them (JAX).

        JAX's `fit` threads the state through its steps and writes it to the
        variables when a callback reads `self.model`; assigning a variable
        without that (an updater's hyperparameter set mid-epoch) would be
        overwritten by the stale state. This syncs first, so that the next
        step reads every variable afresh. Nothing to do on TensorFlow.
        """
        model = self._model() if getattr(self, "_model", None) is not None else None
        if model is not None and hasattr(model, "jax_state_sync"):
            model.jax_state_sync()

    def learning_rate_scale(self):
        """The wrapped optimizer's learning rate now over the rate the user gave it.

        A table whose updater has `follow_learning_rate=True` (the default)
        trains at its own rate times this: a callback that halves the model's
        rate halves the tables', one that sets it to 0 stops them, whether
        the change comes before the optimizer is built or after. The rate
        "given" is the wrapped optimizer's when the `DispatchOptimizer` was
        constructed (kept in its state, so a resumed run keeps the
        proportion). 1.0 where the wrapped rate is a schedule (no callback
        can set it; each table keeps its own schedule) or was given as 0.

        Returns:
            A Python float, on every backend.
        """
        return float(ops.convert_to_numpy(self._scale_of_rate()))

    def _scale_of_rate(self):
        """`learning_rate_scale()` as a float32 scalar tensor, read inside the step."""
        rate = self._default_optimizer.learning_rate
        start = getattr(self, "_rate_at_start", None)  # (the saved copy, once built)
        start = self._given_rate if start is None else start.value
        if start is None or not isinstance(rate, keras.Variable):
            return ops.ones((), "float32")
        start = ops.cast(start, "float32")
        now = ops.cast(rate.value, "float32")
        return ops.where(start > 0, now / ops.where(start > 0, start, 1.0), 1.0)

    def exclude_from_weight_decay(self, var_list=None, var_names=None):
        """Keras' `exclude_from_weight_decay`, for the dense optimizers and the tables.

        Forwarded to every Keras optimizer of the dense variables (those
        found when the optimizer is built too). A table it names (by Keras'
        rules: the variable itself, or a regex of `var_names` found in its
        name) is not decayed by its updater's `weight_decay`.

        Args:
            var_list: variables to exclude.
            var_names: substrings or regexes of the variable names to exclude.
        """
        if self.built:
            raise ValueError(
                "DispatchOptimizer: `exclude_from_weight_decay()` can only be configured "
                "before the optimizer is built.")
        # As Keras': each call replaces the previous one.
        self._decay_exclusion = (var_list, var_names)
        for opt in self._dense_optimizers:
            opt.exclude_from_weight_decay(var_list=var_list, var_names=var_names)

    @property
    def loss_scale_factor(self):
        return getattr(self, "_loss_scale_factor", None)

    @loss_scale_factor.setter
    def loss_scale_factor(self, value):
        # Keras scales the loss by it in the traced step, and the tables unscale
        # by it there: a change once built would reach neither.
        self._check_settable("loss_scale_factor", value,
                             getattr(self, "_loss_scale_factor", None))
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
        (see `sparseopt.discovery`).

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
        # int8 tables are not trainable variables (JAX differentiates no integers):
        # they are reached through their lookups' probes, which are.
        tables = var_list + int8_tables(var_list)
        declared = declared_tables(tables, model)
        added = {}  # id(table) -> probe made while building (keras-rs tables, JAX)
        self._trainers = {}  # var key -> TableTrainer
        self._watched = {}  # var key -> TableTrainer reading that variable's gradient
        dense = {id(opt): [] for opt in self._dense_optimizers}
        self._route = {}
        self._installed = {}  # var key -> variable whose "gradient" is its new value
        for route in routing.plan(tables, declared, self._optimizer_map,
                                  self._default_optimizer):
            var, key = route.variable, self._var_key(route.variable)
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
        ids_per_step = (self._ids_per_step(model) if self.gradient_accumulation_steps
                        else None)
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
            trainer.decays = compat.uses_weight_decay(self._default_optimizer, trainer.table)
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

    def _ids_per_step(self, model):
        """`{id(trainer): ids its table looks up per step}`, for accumulation buffers.

        Each `SparseLookup` counts the ids of the last forward pass it saw
        with a known batch shape. TF builds the optimizer after the traced
        forward pass; on JAX the model is traced on the first batch `fit` (or
        `train_on_batch`) hands Keras' build, or counts come from an earlier
        call of the model on a batch.
        """
        def counts():
            given = self.accumulation_ids_per_step
            return {id(t): given[t.name] if t.name in given else t.source.ids_per_step()
                    for t in self._trainers.values()}

        found = counts()
        if None in found.values() and model is not None:
            backend.trace_forward(model, lambda: compat.training_batch(self))
            found = counts()
        missing = [t.name for t in self._trainers.values() if found[id(t)] is None]
        if missing:
            raise ValueError(
                f"DispatchOptimizer: gradient_accumulation_steps needs to know how many ids "
                f"tables {missing} look up per step, to size their buffers, but no batch of "
                "known shape has gone through them. Call the model on one training batch "
                "(`model(x)`) before building the optimizer yourself, let `fit` / "
                "`train_on_batch` build it, or pass `accumulation_ids_per_step={path: n}`.")
        self.accumulation_ids_per_step = {t.name: found[id(t)] for t in self._trainers.values()}
        return found

    def _add_trainer(self, trainer):
        self._trainers[self._var_key(trainer.table)] = trainer
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

        dense = {id(opt): ([], []) for opt in self._dense_optimizers}
        watched = {}
        for grad, var in zip(grads, trainable_variables):
            key = self._var_key(var)
            if key in self._watched:
                watched[id(var)] = grad
            elif key in self._installed and grad is not None:
                # Install only: no scaling, clipping, decay or accumulation.
                self._installed[key].assign(grad)
            elif key in self._route and grad is not None:
                gs, vs = dense[id(self._route[key])]
                gs.append(grad)
                vs.append(var)
        with keras.name_scope(self.name, caller=self):
            rows = {}  # id(trainer) -> the true RowGrads of this step
            for trainer in self._trainers.values():
                record = trainer.source.row_gradients(watched, trainer.name)
                if record is not None:
                    if self.loss_scale_factor is not None:
                        record = record.scaled(1.0 / self.loss_scale_factor)
                    if self._accumulator is None:
                        # TF MirroredStrategy: every replica's rows, applied by each.
                        record = backend.all_replicas(record)
                    rows[id(trainer)] = record
            if self._accumulator is None:
                self._step(dense, rows)
            else:
                self._accumulate(dense, rows)
        self._iterations.assign_add(1)

    def _accumulate(self, dense, rows):
        """A micro-step: adds its gradients, and on the k-th applies their mean.

        Args:
            dense, rows: as for `_step` (`rows` of this replica only).
        """
        steps, accumulator = self.gradient_accumulation_steps, self._accumulator
        trainers = list(self._trainers.values())
        micro = ops.mod(self._iterations, steps)
        accumulator.add(micro, dense, rows, trainers, self._var_key)

        def update():
            means, every_row = accumulator.mean(dense, trainers, self._var_key)
            self._step(means, every_row)
            accumulator.reset()

        # Everything the update reads or writes (JAX runs it as a cond over them).
        last = ops.equal(micro, steps - 1)
        backend.run_if(last, update, [*self._trainable_variables, *self.variables])
        # Open vocabularies admit per micro-step, after the update (a slot holding a
        # step starts at the updates made so far).
        updates = self.iterations + ops.cast(last, self.iterations.dtype)
        for trainer in trainers:
            if id(trainer) in rows:
                trainer.accept_micro_step(rows[id(trainer)], updates, last)

    def _step(self, dense, rows):
        """One update: dense gradients to their Keras optimizers, row gradients to tables.

        With `global_clipnorm`, every table's step is deduplicated first, one
        norm is taken over the dense gradients and the tables' summed rows,
        and all of them are scaled by Keras' factor (`sparseopt.clipping`).

        Args:
            dense: `{id(Keras optimizer): (gradients, variables)}`, gradients
                as the model computed them (a `loss_scale_factor` not undone).
            rows: `{id(TableTrainer): true RowGrads}`.
        """
        iteration = self.iterations
        scale = self._scale_of_rate() if self._trainers else None
        units, grouped = [], set()  # (TableGroup or TableTrainer, its step's rows)
        for group in self._groups:
            looked_up = [(t, rows[id(t)]) for t in group.trainers if id(t) in rows]
            if looked_up:
                units.append((group, looked_up))
            grouped.update(id(t) for t in group.trainers)
        units += [(t, rows[id(t)]) for t in self._trainers.values()
                  if id(t) in rows and id(t) not in grouped]
        factor = prepared = None
        if self.global_clipnorm:
            prepared = [unit.prepare(step) for unit, step in units]
            norms = [clipping.squared_norm(backend.sum_over_replicas(g), self.loss_scale_factor)
                     for gs, _ in dense.values() for g in gs]
            factor = clipping.factor(norms + [p.squared_norm() for p in prepared],
                                     self.global_clipnorm)
        for opt in self._dense_optimizers:
            gs, vs = dense[id(opt)]
            if gs:
                opt.apply(gs if factor is None else [clipping.scaled(g, factor) for g in gs], vs)
        for i, (unit, step) in enumerate(units):
            if prepared is None:
                unit.apply(step, iteration, scale)
            else:
                unit.finish(prepared[i], iteration, scale, factor)
        for trainer in self._trainers.values():  # (Lookahead's sync, looked up or not)
            trainer.end_step(iteration)

    # -- saving: everything but the dedup workspace ---------------------------

    # Keras' saver would save each wrapped optimizer a second time under its
    # own path (and, loading into an unbuilt one, warn that it skipped it).
    # This optimizer saves their variables itself, in `save_own_variables`.
    __dir__ = compat.unsaved_attributes({
        "optimizer", "_default_optimizer", "_dense_optimizers", "dense_optimizers",
        "_optimizer_map", "_route", "loss_scaling_wrapper", "_scaling_wrapper"})

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

    def _layouts(self):
        """The saved layouts this optimizer loads: `[[(variable or None, shape)], ...]`.

        Today's (`state_variables()`), then sparseopt 0.2's: no learning rate
        at start, no hyperparameter variables, and the slots a configuration
        never reads (`Updater.unread_slots`, skipped when loading).
        """
        current = self.state_variables()
        blocks = {id(t.saved_variables[0]): t for t in self._trainers.values()}
        legacy, i = [], 0
        while i < len(current):
            variable = current[i]
            trainer = blocks.get(id(variable))
            if trainer is not None:
                legacy += trainer.legacy_saved()
                i += len(trainer.saved_variables)
                continue
            if variable is not self._rate_at_start:
                legacy.append((variable, tuple(variable.shape)))
            i += 1
        return [[(v, tuple(v.shape)) for v in current], legacy]

    def _assign_state(self, values):
        layouts = self._layouts()
        found = [layout for layout in layouts if len(layout) == len(values) and all(
            tuple(shape) == tuple(x.shape) for (_, shape), x in zip(layout, values))]
        if not found:
            saved = self.state_variables()
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
            for (variable, _), value in zip(found[0], values):
                if variable is not None:
                    variable.assign(value)
            if found[0] is not layouts[0]:
                # Written before the start rate was kept: the tables trained at
                # their own rates, so they go on from the rate they stopped at.
                rate = self._default_optimizer.learning_rate
                if isinstance(rate, keras.Variable):
                    # A copy (JAX: two variables must not share a buffer the step donates).
                    self._rate_at_start.assign(float(ops.convert_to_numpy(rate.value)))
            for trainer in self._trainers.values():
                trainer.read_hyperparameters()

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
            scale = self._scale_of_rate()
            for trainer in trainers:
                trainer.catch_up(steps_done, scale)

    def _steps_done(self):
        """The updates applied so far (micro-batches / k with gradient accumulation)."""
        return int(ops.convert_to_numpy(self.iterations))

    def table_moving_average(self, table):
        """The moving average of a table whose updater has `ema_momentum` (a tensor).

        Args:
            table: the table variable or its path.
        """
        trainer = self.table_trainer(table)
        if trainer.updater.ema_momentum is None:
            raise ValueError(f"DispatchOptimizer '{self.name}': table '{trainer.name}' keeps "
                             "no moving average; give its updater `ema_momentum`.")
        with backend.outside_trace():
            return trainer.moving_average(self._steps_done(), self._scale_of_rate())

    def table_swa_average(self, table):
        """The stochastic weight average of a table whose updater has `swa_period` (a tensor).

        Args:
            table: the table variable or its path.
        """
        trainer = self.table_trainer(table)
        if trainer.updater.swa is None:
            raise ValueError(f"DispatchOptimizer '{self.name}': table '{trainer.name}' keeps "
                             "no weight average; give its updater `swa_period`.")
        with backend.outside_trace():
            return trainer.swa_average(self._steps_done())

    def finalize_variable_values(self, var_list):
        """Each table's end of `fit` (Keras' hook): its updater's wrappers' (every row
        caught up; `ema_momentum` and `swa_period` tables take their average), then an
        int8 table's last buffered rows written (`TableTrainer.end_of_fit`)."""
        # Only tables with something to do (a failed first step leaves nothing to read).
        trainers = [t for t in getattr(self, "_trainers", {}).values()
                    if t.updater.wrappers or t.int8 is not None]
        if trainers:
            steps_done = self._steps_done()
            with backend.outside_trace():
                scale = self._scale_of_rate()
                for trainer in trainers:
                    trainer.end_of_fit(steps_done, scale)
        for opt in self._dense_optimizers:
            opt.finalize_variable_values(
                [v for v in var_list if self._route.get(self._var_key(v)) is opt]
            )

    def get_config(self):
        extra = {k: getattr(self, k) for k in ("global_clipnorm", "gradient_accumulation_steps",
                                               "accumulation_ids_per_step") if getattr(self, k)}
        if self._given_rate is not None:
            extra["learning_rate_reference"] = self._given_rate
        return {
            **extra,
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


def _constant_rate(optimizer):
    """The constant learning rate of a Keras optimizer now (a float), or None for a schedule.

    Args:
        optimizer: a Keras optimizer.
    """
    rate = optimizer.learning_rate
    if not isinstance(rate, keras.Variable):
        return None
    with backend.outside_trace():
        return float(rate.numpy())  # (a mirrored variable's `.value` is per replica)
