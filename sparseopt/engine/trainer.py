"""`TableTrainer`: everything that trains one table in place.

`DispatchOptimizer` keeps one `TableTrainer` per sparsely trained table and
only routes to it. A trainer owns the table's updater, its row storage (the
rows and their state: `sparseopt.storage`), its counters and the source of
its row gradients, and answers `build`, `apply` and `state`; the step
itself is a plan's (`sparseopt.engine.plans`). Tables whose trainers share
width, dtype and updater configuration may be updated together
(`sparseopt.engine.group`).
"""

import json
import weakref

import keras
from keras import ops

from sparseopt import backend, compat, storage, updaters
from sparseopt.distribution import layout_like, replicated_beside
from sparseopt.engine import plans
from sparseopt.engine.stages import prepare
from sparseopt.storage import precision
from sparseopt.storage.kinds import kind_for
from sparseopt.updaters.core.hyperparameters import Values
from sparseopt.updaters.wrappers.catch_up import catch_up_whole
from sparseopt.updaters.wrappers.ema import MovingAverage
from sparseopt.updaters.wrappers.swa import WeightAverage
from sparseopt.engine.lookahead_list import LookaheadList
from sparseopt.engine.lookahead_window import LookaheadWindow


class _FromTable(keras.initializers.Initializer):
    """A whole slot's start computed from the table (`SlotSpec.from_table`).

    Args:
        fn: the slot's `from_table`.
        values: returns the table's float32 values (an int8 table's read back).
    """

    def __init__(self, fn, values):
        self.fn, self.values = fn, values

    def __call__(self, shape, dtype=None):
        return ops.cast(self.fn(self.values()), dtype)


class _Filled(keras.initializers.Initializer):
    """`Constant(value)` in one buffer.

    Keras' `Constant` computes `value * ones(shape)`: two table-sized arrays
    at its peak, which for a 2.5 GB accumulator is 2.5 GB more than needed.
    """

    def __init__(self, value):
        self.value = value

    def __call__(self, shape, dtype=None):
        return ops.full(shape, self.value, dtype=dtype)


# The stochastic-rounding stream of Lookahead's sync writes (the table's own
# writes are 0, its slots' `1 + i`).
SYNC_ROUNDING = 255


class TableTrainer:
    """Trains one table with its sparse updater, in place.

    Args:
        table: the `[V, D]` Keras variable.
        updater: the `sparseopt.updaters.Updater` that trains it.
        source: where its row gradients come from
            (`sparseopt.ops.row_sources.LookupRows` or `SlicedRows`).
        owner: who assigned the updater, for messages (a layer, `optimizer_map`
            or a keras-rs `TableConfig`).
    """

    def __init__(self, table, updater, source, owner):
        self.table = table
        self.updater = updater
        self.source = source
        self.owner = owner
        # How the table stores its state and 16-bit writes: its own, else its updater's.
        self.storage = storage.of_table(source.storage, updater, table.path)
        # Its rows and their state, as the step reads and writes them (set by `build`).
        self.row_storage = None
        self.skipped = None  # int32 scalar: steps skipped for non-finite gradients
        self.workspace = None  # int32 [V (+1 on TF)] dedup scratch, never saved
        self.rounding = None  # how 16-bit values are written (set by `build`)
        # hyperparameter name -> float32 scalar variable the step reads (set by `build`)
        self.hyperparameters = {}
        # False where `exclude_from_weight_decay` names the table: its updater's
        # `weight_decay` reads 0 for it.
        self.decays = True
        # `lookahead_period`: the rows changed in the current window (set by `build`).
        self.lookahead = None
        # The ids one step looks up, where the table's Lookahead list is sized by them
        # (`lists_window_rows`; set by `DispatchOptimizer.build`).
        self.ids_per_step = None
        # An int8 table's codes, scales and write buffer (`sparseopt.storage.int8_table`), or None.
        self.int8 = getattr(getattr(source, "lookup", None), "int8", None)
        self._optimizer = None  # weak reference to the optimizer that built it

    @property
    def slots(self):
        """`{slot name: Keras variable}`: the updater's state (empty before `build`)."""
        return self.row_storage.slots if self.row_storage is not None else {}

    @property
    def vocabulary(self):
        """The table's open vocabulary (`DynamicEmbedding`), or None."""
        return getattr(getattr(self.source, "lookup", None), "vocabulary", None)

    @property
    def name(self):
        """The table's path."""
        return self.table.path

    @property
    def lists_window_rows(self):
        """Whether the table's Lookahead window is a list sized by the ids a step looks up
        (`engine.lookahead_list`: its kind of rows keeps no entry per row in memory)."""
        return (self.updater.lookahead is not None
                and not kind_for(self.storage, self.int8 is not None).lookahead_per_row)

    def check(self):
        """Raises if the table cannot be trained as configured, before any state exists.

        `DispatchOptimizer.build` checks every table first, so that a refused
        configuration leaves the optimizer unbuilt (nothing half created).
        """
        if self.vocabulary is not None and any(s.from_table is not None
                                               for s in self.updater.slots):
            raise ValueError(
                f"Table '{self.table.path}': {type(self.updater).__name__}(lazy=False) keeps "
                "statistics of the whole table's values, which an open vocabulary changes "
                "outside the rule when it gives a row to a new id. Use lazy=True on a "
                "DynamicEmbedding.")
        kind = kind_for(self.storage, self.int8 is not None)  # (a kind nobody registered)
        kind.check(self.updater, self.table, self.vocabulary)
        for wrapper in self.updater.wrappers:  # what a wrapper needs of the rows' storage
            check_storage = getattr(wrapper, "check_storage", None)
            if check_storage is not None:
                check_storage(self.updater, self.table.path, kind)

    def build(self, optimizer, workspace=True, index=0):
        """Creates the state with `optimizer.add_variable`, named after the table.

        Call `check` first (`DispatchOptimizer.build` checks every table before
        it builds any).

        Args:
            optimizer: the optimizer that owns the variables.
            workspace: whether to create the table's own dedup workspace;
                a table updated by a `TableGroup` uses the group's.
            index: the table's position among the optimizer's tables (its
                stochastic rounding draws its own bits).
        """
        table, prefix = self.table, self.table.path.replace("/", "_")
        self.rounding = precision.Rounding(self.storage.stochastic_rounding,
                                           self.storage.rounding_seed, index)
        kind = kind_for(self.storage, self.int8 is not None)
        self.row_storage = kind(table, self.updater.slots, self.storage, self.rounding,
                                self.int8)

        def initializer_of(spec):
            if spec.from_table is None:
                return _Filled(spec.initial_value)
            return _FromTable(spec.from_table, self.row_storage.values_as_built)

        def layout_of(spec, shape):
            # Per-row state is sharded like the table, so that updates stay
            # local; whole state is replicated.
            return (layout_like(table, len(shape)) if spec.per_row
                    else replicated_beside(table, len(shape)))

        self.row_storage.build(optimizer, prefix, initializer_of, layout_of)
        self.skipped = optimizer.add_variable(
            shape=(), dtype="int32", initializer="zeros", name=f"{prefix}_skipped_steps")
        if backend.WORKSPACE and workspace and kind.uses_workspace:
            # One per table, so that the tables' updates stay independent.
            self.workspace = optimizer.add_variable(
                shape=(table.shape[0] + backend.WORKSPACE_SINK,), dtype="int32",
                initializer="zeros", layout=layout_like(table, 1),
                name=f"{prefix}_dedup_workspace")
        for name, value in self.updater.state_hyperparameters.items():
            self.hyperparameters[name] = optimizer.add_variable(
                shape=(), dtype="float32", initializer=_Filled(value),
                name=f"{prefix}_hyperparameter_{name}")
        for wrapper in self.updater.wrappers:
            if not wrapper.keeps_window:
                continue
            # Lookahead: the rows changed since its last sync, an entry per table row,
            # or (a table on disk) a list bounded by the window's steps' ids.
            if kind.lookahead_per_row:
                self.lookahead = LookaheadWindow(wrapper.period, wrapper.step_size)
                self.lookahead.build(optimizer, table, prefix)
            else:
                self.lookahead = LookaheadList(wrapper.period, wrapper.step_size)
                self.lookahead.build(optimizer, table, prefix, self.ids_per_step)
        self._optimizer = weakref.ref(optimizer)
        self.updater.bind(self)

    def set_hyperparameter(self, name, value):
        """Assigns the variable of hyperparameter `name` (the updater's setter calls it).

        On JAX, `fit` keeps the state outside the variables between its steps:
        the model's state is synced first, so that the next step reads the
        new value (what a Keras callback's `self.model` does).
        """
        optimizer = self._optimizer() if self._optimizer is not None else None
        if optimizer is not None:
            optimizer.sync_training_state()
        with backend.outside_trace():
            self.hyperparameters[name].assign(value)

    def read_hyperparameters(self):
        """Sets the updater's attributes to its variables' values (after a checkpoint load)."""
        for name, variable in self.hyperparameters.items():
            self.updater.restore_hyperparameter(
                name, float(ops.convert_to_numpy(variable.value)))

    def values_at(self, iteration, learning_rate_scale=1.0):
        """`{name: scalar tensor}`: every hyperparameter of the step after `iteration`.

        Args:
            iteration: the optimizer's 0-based step count.
            learning_rate_scale: the dense learning rate now over the rate the
                user gave it (`DispatchOptimizer`); multiplies this table's
                rate where its updater has `follow_learning_rate=True`.
        """
        values = self.updater.values_at(iteration + 1, self.hyperparameters)
        if self.updater.follow_learning_rate:
            values["learning_rate"] = values["learning_rate"] * learning_rate_scale
        if not self.decays and "weight_decay" in values:
            values["weight_decay"] = ops.zeros((), "float32")
        return values

    def state(self):
        """`{slot name: Keras variable}`: the updater's state of this table.

        Raises:
            ValueError: some of it is no variable (a table on disk keeps its
                per-row state in its files).
        """
        elsewhere = [n for n in (self.row_storage.per_row if self.row_storage else [])
                     if n not in self.slots]
        if elsewhere:
            raise ValueError(
                f"Table '{self.table.path}': its per-row state {elsewhere} is kept in its "
                "files (storage=OnDisk), not in variables. Read it with "
                "`layer.embeddings.numpy(column, ids)`.")
        return dict(self.slots)

    @property
    def saved_variables(self):
        """What a checkpoint holds for this table: its state, skip count,
        hyperparameters and Lookahead window, in the order they were created."""
        window = self.lookahead.variables if self.lookahead is not None else []
        return [*self.slots.values(), self.skipped, *self.hyperparameters.values(), *window]

    def legacy_saved(self):
        """What sparseopt 0.2 saved for this table, as `[(variable or None, shape)]`.

        Its state then also had the slots this configuration never reads
        (`Updater.unread_slots`, None here) and no hyperparameter variables.
        """
        out = [(self.slots.get(s.name), s.shape(self.table.shape))
               for s in self.updater.legacy_slots]
        return out + [(self.skipped, ())]

    @property
    def scratch_variables(self):
        """Working memory that is not state (never saved)."""
        return [self.workspace] if self.workspace is not None else []

    def apply(self, record, iteration, learning_rate_scale=1.0):
        """Applies the updater to the rows of `record` with their true gradients.

        Args:
            record: the step's `sparseopt.records.RowGrads`: ids, duplicates
                allowed (summed), ids outside `[0, V)` ignored, and their
                unscaled gradients. If any is not finite, nothing changes
                and the step is counted as skipped.
            iteration: the optimizer's 0-based step count (scalar tensor).
            learning_rate_scale: as for `values_at`.
        """
        self.finish(self.prepare(record), iteration, learning_rate_scale)

    def prepare(self, record):
        """The step's ids deduplicated and their gradients summed (`stages.Prepared`).

        Args:
            record: as for `apply`.
        """
        return prepare(record, self.table.shape[0], self.workspace,
                       split=backend.row_shards(self.table) is not None,
                       numbering=self.row_storage.numbering)

    def finish(self, prepared, iteration, learning_rate_scale=1.0, factor=None):
        """Applies the updater to a `prepare`d step, counting it if skipped.

        Args:
            prepared: from `prepare`.
            iteration, learning_rate_scale: as for `apply`.
            factor: scalar the gradients are multiplied by first (global
                clipping), or None.
        """
        values = self.values_at(iteration, learning_rate_scale)
        applied = plans.finish(self.updater, self.row_storage, prepared, values,
                               iteration + 1, factor)
        self.after_step(prepared, applied, iteration)

    def after_step(self, prepared, applied, iteration):
        """The table's own bookkeeping once its rows are written: its skip count,
        Lookahead's list of changed rows, an open vocabulary's new rows.

        Args:
            prepared: the step's `stages.Prepared`.
            applied: boolean scalar, whether the step applied.
            iteration: the optimizer's 0-based step count.
        """
        self.count_skipped(applied)
        if self.lookahead is not None:
            self.lookahead.record(prepared.global_distinct(), applied, iteration + 1,
                                  self.table.shape[0])
        self._accept(prepared.record, applied, iteration)

    def _accept(self, record, applied, iteration):
        """An open vocabulary's rows given to new ids start afresh (if `applied`)."""
        if self.vocabulary is not None and record.changed is not None:
            self.vocabulary.accept(record.changed, applied, self.row_storage, iteration + 1)

    def accept_micro_step(self, record, updates, cycle_ends):
        """Gradient accumulation: an open vocabulary takes a micro-step's choices.

        Its rows given to new ids start afresh now (none of them was seen
        in the cycle, so none has gradients waiting: `OpenVocabulary.accept`).

        Args:
            record: the micro-step's `RowGrads`.
            updates: int scalar, the optimizer's updates so far, including
                one made in this micro-step.
            cycle_ends: boolean scalar, whether this micro-step made the update.
        """
        if self.vocabulary is not None and record.changed is not None:
            self.vocabulary.accept(record.changed, ops.ones((), "bool"), self.row_storage,
                                   updates, cycle_ends)

    def end_step(self, iteration):
        """What follows every table's update in a step: Lookahead's sync where the
        step ends a window, whether or not the table was looked up in it.

        Args:
            iteration: the optimizer's 0-based step count (scalar tensor).
        """
        if self.lookahead is None:
            return
        step = iteration + 1
        rows = self.row_storage

        def sync():
            self.lookahead.sync(rows, updaters.lookahead.OFFSET_SLOT, step, SYNC_ROUNDING)

        backend.run_if(updaters.lookahead.syncs_at(step, self.lookahead.period), sync,
                       [*rows.variables(), *self.lookahead.variables])

    def count_skipped(self, applied):
        """Counts the step as skipped unless `applied` (a boolean scalar tensor)."""
        self.skipped.assign_add(1 - ops.cast(applied, "int32"))

    def _wrapper(self, kind):
        """The updater's wrapper of class `kind`, or None."""
        return next((w for w in self.updater.wrappers if isinstance(w, kind)), None)

    def _last_values(self, steps_done, learning_rate_scale):
        """The hyperparameters of the last step (what whole-table work reads)."""
        return Values(self.values_at(max(steps_done - 1, 0), learning_rate_scale), steps_done)

    def catch_up(self, steps_done, learning_rate_scale=1.0):
        """Brings every row up to step `steps_done` (`lazy=False` or `ema_momentum`).

        Applies the missed steps of `lazy=False` rows, and brings the moving
        averages' offsets up to date. Whole-table work: Keras calls it at the
        end of `fit` (`DispatchOptimizer.finalize_variable_values`); call
        `DispatchOptimizer.catch_up_tables()` before evaluating or exporting
        mid-training. Other updaters: nothing to do.

        Args:
            steps_done: int, the optimizer's iteration count.
            learning_rate_scale: as for `values_at`.
        """
        if self.frozen:  # (a frozen layer's table is not trained: nothing to catch up)
            return
        hp = self._last_values(steps_done, learning_rate_scale)
        wrappers = [w for w in self.updater.wrappers if w.tracks_rows]

        def work(storage):
            for wrapper in wrappers:
                catch_up_whole(wrapper, self.updater, storage, steps_done, hp)

        if wrappers:  # (on every row: part by part where the kind says, `each_part`)
            self.row_storage.each_part(work)

    def end_of_fit(self, steps_done, learning_rate_scale=1.0):
        """Each wrapper's end of `fit`, in order (every row caught up; the table takes its
        moving or weight average), then the row storage's (`RowStorage.end_of_fit`: an
        int8 table's last buffered rows written, a table on disk's cache flushed).

        Args:
            steps_done, learning_rate_scale: as for `catch_up`.
        """
        if not self.frozen and self.updater.wrappers:
            # (A frozen layer's table is not trained: nothing to catch up.)
            hp = self._last_values(steps_done, learning_rate_scale)

            def work(storage):
                for wrapper in self.updater.wrappers:
                    wrapper.end_of_fit(self.updater, storage, steps_done, hp)

            self.row_storage.each_part(work)  # (every row: part by part where it must be)
        self.row_storage.end_of_fit()

    @property
    def frozen(self):
        """Whether the layer that reads the table is frozen (`LookupRows.frozen`; a table
        whose gradient comes as its own is a variable, which Keras itself freezes)."""
        return getattr(self.source, "frozen", False)

    def moving_average(self, steps_done, learning_rate_scale=1.0):
        """The table's moving average at `steps_done` (`ema_momentum` only), a tensor."""
        return self._whole_average(MovingAverage, steps_done,
                                   self._last_values(steps_done, learning_rate_scale))

    def swa_average(self, steps_done):
        """The table's SWA average after `steps_done` steps (`swa_period` only), a tensor."""
        return self._whole_average(WeightAverage, steps_done, None)

    def _whole_average(self, kind, steps_done, hp):
        """The average of wrapper `kind` over every row (a tensor the table's size), read
        part by part where the kind says (`each_part`); nothing is written."""
        parts = []
        self.row_storage.each_part(lambda storage: parts.append(
            self._wrapper(kind).average(self.updater, storage, steps_done, hp)), writes=False)
        return parts[0] if len(parts) == 1 else ops.concatenate(parts, axis=0)

    def skipped_steps(self):
        return int(ops.convert_to_numpy(self.skipped.value))

    def dropped_ids(self):
        return self.source.dropped_ids()

    def group_key(self):
        """What tables updated together must share, or None if this one stays alone.

        Width, dtype, updater configuration and storage. A shipped updater's
        configuration is its `get_config()` (its name aside), and its
        learning-rate schedule object if it has one; a user's updater class
        is grouped only with tables that share the very same updater object.
        (A user's class or schedule may read more than its config holds.) A
        table placed by a `keras.distribution` stays alone: its update is
        laid out by its own sharding.
        """
        if (compat.layout_of(self.table) is not None or self.vocabulary is not None
                or self.updater.lookahead is not None
                or not kind_for(self.storage, self.int8 is not None).groups):
            # (An open vocabulary's step and Lookahead's window continue after the rule.)
            return None
        updater = self.updater
        cls = type(updater)
        if updaters.registry(shipped_only=True).get(cls.__name__) is cls:
            config = {k: v for k, v in updater.get_config().items() if k != "name"}
            schedule = None if isinstance(updater.learning_rate, float) else \
                id(updater.learning_rate)
            rule = (cls.__name__, json.dumps(config, sort_keys=True, default=repr), schedule)
        else:
            rule = ("object", id(updater))
        return (self.table.shape[1], keras.backend.standardize_dtype(self.table.dtype), rule,
                self.storage)
