"""`DynamicEmbedding`: a table keyed by raw ids, with admission and eviction."""

import weakref

import keras
import numpy as np
from keras import ops

from sparseopt import backend, compat, distribution
from sparseopt.layers.sparse_embedding import SparseEmbedding, snapshot_of
from sparseopt.ops.lookup import PlainOptimizerGuard, check_ids_dtype, layer_state
from sparseopt.vocabulary import keys as keys_lib
from sparseopt.vocabulary import new_rows, tombstones
from sparseopt.vocabulary.open_vocabulary import OpenVocabulary

DEFAULT_ROWS = ("zeros", "trained")


def _is_shape(value):
    """Whether `value` is one shape (a tuple of ints or None), not a structure of shapes."""
    return isinstance(value, (tuple, list)) and all(
        d is None or isinstance(d, int) for d in value)


@keras.saving.register_keras_serializable(package="sparseopt")
class DynamicEmbedding(SparseEmbedding):
    """An embedding table for an open vocabulary: ids of any value, `capacity` rows.

    Each id that qualifies (`admit_after` sightings, `admit_probability`) gets a
    row of its own, found
    through a map kept in the layer's variables (open addressing in the
    table's own rows, `probes` rows per id); ids not held read zeros and
    their gradients go nowhere, or (`default_row="trained"`) all read one
    shared row, trained by all their gradients. When an id's window is full, the row seen
    longest ago is given to it (`eviction="lru"`), and that row and its
    per-row optimizer state start afresh. The map is updated inside the
    compiled step, after the optimizer's step: a skipped step admits and
    evicts nothing. See docs/open_vocabularies.md.

    Train with `sparseopt.DispatchOptimizer` (the layer declares its updater).

    Call it once per step: on one tensor of ids, or on a list or dict of
    them (features sharing the table, each of its own shape), which returns
    one output per feature in the same structure. A training call admits
    ids once, over all of its features; a second training call in one step
    is refused (two calls could give one row to two ids).

    Args:
        capacity: the table's rows: at most this many ids hold a row at once.
        output_dim: embedding width.
        updater: a `sparseopt.updaters.Updater` for the table.
        embeddings_initializer: how rows start, at build and when given to a
            new id: `RandomUniform` (`"uniform"`), `RandomNormal`, `Zeros`,
            `Ones` or `Constant`.
        combiner: None, `"sum"` or `"mean"`, as for `SparseEmbedding` (ids
            reading zeros count in no mean; ids reading the trained default
            row count like any).
        storage: as for `SparseEmbedding`; with `sparseopt.storage.OnDisk(...)`
            the rows and their per-row state are in files (a cache of them in
            memory), the map in memory (docs/disk.md).
        default_row: what ids not held read: `"zeros"` (their gradients go
            nowhere) or `"trained"` (one more row of the table, after the
            `capacity` rows ids are given, shared by every id not held and
            trained by all their gradients with the table's updater).
        key_halves: ids come as int32 `[..., 2]` `(high, low)` halves of
            64-bit ids (`sparseopt.vocabulary.keys.split_int64`): how to feed
            64-bit ids on JAX. Otherwise ids are int32 (or int64 on
            TensorFlow) of any value.
        probes, admit_probability, eviction, ttl, seed, admissions_per_step,
            placement_rounds, admit_after, count_capacity, tombstone_log,
            lfu_half_life: as for
            `sparseopt.vocabulary.OpenVocabulary`.
        **kwargs: base `Layer` arguments.
    """

    def __init__(self, capacity, output_dim, updater, embeddings_initializer="uniform",
                 combiner=None, storage=None, key_halves=False, probes=None, default_row="zeros",
                 admit_probability=1.0, eviction="lru", ttl=None, seed=0,
                 admissions_per_step=1024, placement_rounds=2, admit_after=1,
                 count_capacity=None, tombstone_log=None, lfu_half_life=1000, **kwargs):
        kwargs.pop("input_dim", None)
        if default_row not in DEFAULT_ROWS:
            raise ValueError(f"DynamicEmbedding '{kwargs.get('name', '')}': `default_row` must "
                             f"be one of {DEFAULT_ROWS}, got {default_row!r}.")
        self.default_row = default_row
        if (not isinstance(capacity, (int, np.integer, float)) or isinstance(capacity, bool)
                or int(capacity) != capacity or capacity <= 0):
            raise ValueError(f"DynamicEmbedding '{kwargs.get('name', '')}': `capacity` (the "
                             f"rows ids can hold) must be a positive int, got {capacity!r}.")
        if int(output_dim) <= 0:
            raise ValueError(f"DynamicEmbedding '{kwargs.get('name', '')}': `output_dim` "
                             f"must be positive, got {output_dim!r}.")
        self._capacity = int(capacity)
        # A trained default row is the table's last row, past every row the map gives.
        rows = self._capacity + (default_row == "trained")
        super().__init__(rows, output_dim, updater, embeddings_initializer, combiner,
                         storage, **kwargs)
        new_rows.check(self.embeddings_initializer, self.name)
        self.key_halves = bool(key_halves)
        self._exported_map = None  # (the export the map's hand-over was written for)
        self.vocabulary = OpenVocabulary(
            capacity, probes=probes, admit_probability=admit_probability, eviction=eviction,
            ttl=ttl, seed=seed, admissions_per_step=admissions_per_step,
            placement_rounds=placement_rounds, admit_after=admit_after,
            count_capacity=count_capacity, tombstone_log=tombstone_log,
            lfu_half_life=lfu_half_life)

    @property
    def capacity(self):
        """Rows ids can hold (the table has one more with `default_row="trained"`)."""
        return self._capacity

    def build(self, input_shape=None):
        super().build(input_shape)
        split = distribution.rows_like(self.embeddings, 1)
        # (On disk, no table variable is split: only the map's arrays, which an int8
        # table's rows and a trained default row leave alone.)
        in_memory_split = not self.on_disk and split is not None and split.axes[0] is not None
        if self.int8 is not None and in_memory_split:
            raise ValueError(
                f"DynamicEmbedding '{self.name}': an int8 open vocabulary split by rows over "
                "devices is not supported yet in memory. Split a float32 or bfloat16 one, keep "
                "the int8 one on each device (replicated), or keep it on disk "
                "(storage=OnDisk(...): split, its rows are shards there).")
        if self.default_row == "trained" and in_memory_split:
            raise ValueError(
                f"DynamicEmbedding '{self.name}': a trained default row makes the table "
                f"capacity + 1 rows, which its map (capacity rows) cannot be split by rows "
                f"with. On a table split by rows, use default_row='zeros', or keep the table "
                f"on disk (storage=OnDisk(...): only its map is split over the devices).")
        # (On disk, rows given to new ids are written by the optimizer's step, int8 ones
        # too: `DiskRows.start`; in memory, an int8 table's are written by the next call.)
        self.vocabulary.build(self.embeddings_initializer, self._add_state,
                              int8=self._int8_in_memory)
        for written in (self.vocabulary.pending, self.vocabulary.cycle_start):
            # Written by the optimizer's step only.
            written.constraint = PlainOptimizerGuard(self.name, self.embeddings.path)
            written._sparseopt_bookkeeping_of = self._lookup

    def _make_lookup(self, **kwargs):
        return super()._make_lookup(vocabulary=self.vocabulary, **kwargs)

    def _add_state(self, name, shape, dtype, initial, trainable, rows=False, weight=True):
        init = keras.initializers.Constant(initial)
        if trainable or not weight:
            # State, not a weight: written by the optimizer, never trained.
            return layer_state(self, name, dtype, trainable, shape=shape, initializer=init)
        layout = distribution.rows_like(self.embeddings, len(shape)) if rows else None
        parts = distribution.row_parts(layout)
        if rows and shape[0] % parts:  # (only the sightings map has a size of its own)
            raise ValueError(
                f"DynamicEmbedding '{self.name}': its {name} ({shape[0]} entries) is split "
                f"with the table's rows over {parts} devices, which must divide it evenly: "
                f"set `count_capacity` to a multiple of {parts}.")
        if layout is None:
            return self.add_weight(shape=shape, initializer=init, dtype=dtype,
                                   trainable=False, name=name)
        # The map's per-row arrays are split by rows like the table (a row
        # sharded table's map is split with it), whatever the LayoutMap says.
        with keras.name_scope(self.name, caller=self):
            variable = keras.Variable(init, shape=shape, dtype=dtype, trainable=False,
                                      name=name, layout=layout)
        setattr(self, f"_{name}", variable)  # (Keras tracks it as a weight)
        return variable

    def call(self, ids, training=None):
        # Every feature's ids meet the map together: one step's admissions
        # are chosen once, over all of them (a table shared by features).
        features = keras.tree.flatten(ids)
        for feature in features:
            # A float id would be cast to int32 below: raw ids float32 cannot
            # tell apart (above 2**24) would silently share a row.
            check_ids_dtype(feature, self.name, self.embeddings.path, row_ids=False)
        parts = [keys_lib.halves(f, self.key_halves) for f in features]
        sizes = [ops.shape(high)[0] for high, _ in parts]
        high = ops.concatenate([h for h, _ in parts], axis=0) if len(parts) > 1 else parts[0][0]
        low = ops.concatenate([lo for _, lo in parts], axis=0) if len(parts) > 1 else parts[0][1]
        rows, proposals = self.vocabulary.rows_for(high, low, bool(training))
        if self.default_row == "trained":
            rows = ops.where(ops.less(rows, 0), self._capacity, rows)
        outputs, start = [], 0
        for i, (feature, size) in enumerate(zip(features, sizes)):
            part = rows if len(features) == 1 else ops.slice(rows, (start,), (size,))
            start = start + size
            part = ops.reshape(part, keys_lib.key_shape(feature, self.key_halves))
            # The step's choices travel with one feature's row gradients.
            changed = proposals if i == 0 else None
            outputs.append(
                self._lookup(part, changed=changed, training=bool(training))
                if self.combiner is None else
                self._lookup.pooled(part, self.combiner, changed=changed,
                                    training=bool(training)))
        return keras.tree.pack_sequence_as(ids, outputs)

    def compute_output_shape(self, input_shape):
        def one(shape):
            shape = tuple(shape[:-1]) if self.key_halves else tuple(shape)
            return SparseEmbedding.compute_output_shape(self, shape)
        if keras.tree.is_nested(input_shape) and not _is_shape(input_shape):
            return keras.tree.map_shape_structure(one, input_shape)
        return one(input_shape)

    def compute_output_spec(self, ids, training=None):
        for feature in keras.tree.flatten(ids):
            check_ids_dtype(feature, self.name, self.embeddings.path, row_ids=False)
            if (not self.key_halves and "int64" in str(feature.dtype)
                    and not backend.has_int64()):
                # JAX would keep each id's low half: distinct ids would become one.
                raise ValueError(
                    f"DynamicEmbedding '{self.name}': int64 ids on JAX without x64 would be "
                    "truncated to their low 32 bits, so distinct ids would share a row. Feed "
                    "`sparseopt.vocabulary.split_int64(ids)` with `key_halves=True` (input "
                    "`[..., 2]` int32), or enable `jax_enable_x64`.")
        return keras.tree.map_structure(
            lambda f: keras.KerasTensor(self.compute_output_shape(f.shape),
                                        dtype=self.compute_dtype), ids)

    @property
    def variables(self):
        """Keras' `Layer.variables` (a table on disk's rows added in an export:
        `SparseEmbedding.variables`). When Keras exports the model, the map's hand-over
        is written first (once an export), so the exported map is current and the
        served function only reads it (`OpenVocabulary.rows_for`)."""
        archive = compat.exporting() if self.built else None
        if archive is not None and (self._exported_map is None
                                    or self._exported_map() is not archive):
            with backend.outside_trace():
                self.vocabulary.write_map_hand_over()
            self._exported_map = weakref.ref(archive)
        return super().variables

    @property
    def _int8_in_memory(self):
        """The `Int8Table` of an int8 table in memory; None otherwise (on disk, an int8
        table's codes and scales are columns of its files)."""
        return None if self.on_disk else self.int8

    def _table_variables(self):
        """The table's own variables in memory: the table, or an int8 table's codes and
        scales (a table on disk has none: its entry in a file is a record naming a
        snapshot, `save_own_variables`)."""
        if self.int8 is None:
            return [self.embeddings]
        return [self.embeddings, self.embeddings_scale]

    def save_own_variables(self, store):
        """The table (an int8 table's codes and scales, its buffered rows written
        first; a table on disk's snapshot, named), then the map
        (`OpenVocabulary.variables`, its hand-over with it), taken together between
        steps: a snapshot and the map of one moment."""
        if self.on_disk:
            table = [self._snapshot_record()]
        else:
            if self.int8 is not None:
                with backend.outside_trace():
                    self.int8.flush()
            table = self._table_variables()
        for i, variable in enumerate([*table, *self.vocabulary.variables]):
            store[str(i)] = variable

    def load_own_variables(self, store):
        table = [None] if self.on_disk else self._table_variables()
        variables = [*table, *self.vocabulary.variables]
        if len(store.keys()) != len(variables):
            raise ValueError(
                f"Layer '{self.name}' expected {len(variables)} variables (its table and "
                f"its id map), but received {len(store.keys())} variables during loading.")
        values = [store[str(i)] for i in range(len(variables))]
        snapshot = None
        if self.on_disk:  # (checked first: a load that fails changes nothing)
            snapshot = snapshot_of(values[0], self.name, self.embeddings)
        ring = self.vocabulary.tombstones
        at = next(i for i, v in enumerate(variables) if v is ring.log)
        if tuple(values[at].shape) != tuple(ring.log.shape):
            # Written with another tombstone log size (before 2026-11-26 the default was
            # 65,536 whatever the capacity): its newest entries are kept.
            try:
                values[at:at + 3] = tombstones.resized(*(np.asarray(v) for v in
                                                         values[at:at + 3]), ring.size)
            except ValueError as e:
                raise ValueError(f"Layer '{self.name}': {e}") from None
        for i, variable in enumerate(variables):
            if variable is not None and tuple(values[i].shape) != tuple(variable.shape):
                raise ValueError(
                    f"Layer '{self.name}': the file's {variable.name} has shape "
                    f"{tuple(values[i].shape)}, this layer's {tuple(variable.shape)}.")
        if snapshot is not None:
            self.embeddings.restore(snapshot)
        for variable, value in zip(variables, values):
            if variable is not None:
                variable.assign(value)
        if self._int8_in_memory is not None:
            self.int8.clear()  # the file's rows are current (the map's hand-over stays)

    def vocabulary_stats(self):
        """`{name: int}`: running totals of the map (`OpenVocabulary.stats`)."""
        return self.vocabulary.stats()

    def held_ids(self):
        """`{id: row}` of every id holding a row (reads the whole map: for export)."""
        return self.vocabulary.ids()

    def delta(self, since_step=0):
        """What a serving copy needs after it took this table at `since_step`.

        Reads the whole map (NumPy, between steps): for export, not for the
        training loop.

        Args:
            since_step: a `Delta.step` of an earlier call (the layer's
                training steps; 0: everything).

        Returns:
            `sparseopt.vocabulary.Delta`: the ids whose rows may have
            changed since, with their rows and values, the ids that lost
            their row since (tombstones), and the step to ask from next.

        Raises:
            ValueError: more ids were replaced since `since_step` than
                `tombstone_log` keeps.
        """
        with backend.outside_trace():
            self.vocabulary.write_hand_over()  # an int8 table's rows, as the next call would
        if self.on_disk:
            table = _DiskRows(self.embeddings)
        else:
            table = self.embeddings if self.int8 is None else _Int8Rows(self.int8)
        return self.vocabulary.delta(int(since_step), table, self.name,
                                     trained_default=self.default_row == "trained")

    def get_config(self):
        config = super().get_config()
        config.pop("input_dim")
        return {**config, "capacity": self.capacity, "key_halves": self.key_halves,
                "default_row": self.default_row, **self.vocabulary.get_config()}

    def _check_shards(self, path, shards):
        # The map's arrays (a row each) are split with the table's rows over the devices
        # (`_add_state`), which JAX requires to divide evenly; the table's shards on
        # disk need not (a trained default row makes it `capacity + 1` rows). Checked
        # here, before any of the shards' files is opened.
        sizes = {"capacity": self._capacity}
        if self.vocabulary.admit_after > 1:  # (`admit_after`'s sightings map, split too)
            sizes["count_capacity"] = self.vocabulary.count_capacity or self._capacity
        for name, size in sizes.items():
            if size % shards:
                fixed = -(-size // shards) * shards
                raise ValueError(
                    f"DynamicEmbedding '{self.name}': the distribution splits its open "
                    f"vocabulary on disk ('{path}') by rows over {shards} devices, and its "
                    f"map with it, which must divide its {name} ({size}) evenly. Use "
                    f"{name}={fixed} (the next multiple of {shards}), or leave its path out "
                    "of the LayoutMap (it then trains data parallel, as one table).")


class _DiskRows:
    """A table on disk as `OpenVocabulary.delta` reads it: rows by id, as its lookup
    reads them, without changing its cache."""

    def __init__(self, table):
        self.table = table
        self.shape = table.shape

    def rows(self, ids):
        """float32 (or 16-bit) rows `ids`, as the lookup reads them.

        Args:
            ids: int row ids (a tensor or array).
        """
        return self.table.rows_read(np.asarray(ops.convert_to_numpy(ids)))


class _Int8Rows:
    """An int8 table as `OpenVocabulary.delta` reads it: float32 rows by id."""

    def __init__(self, int8):
        self.int8 = int8
        self.shape = int8.codes.shape

    def rows(self, ids):
        return self.int8.read(ids)
