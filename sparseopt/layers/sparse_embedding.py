"""`SparseEmbedding`: an embedding table trained by its own sparse updater."""

import json

import keras
import numpy as np

from sparseopt import backend, compat
from sparseopt import storage as storage_lib
from sparseopt import updaters as updaters_lib
from sparseopt.disk.sharded import ShardedDiskTable
from sparseopt.disk.table import DiskTable
from sparseopt.distribution import check_even_split, check_on_this_host
from sparseopt.storage.block_init import add_table
from sparseopt.storage.int8_table import Int8Table
from sparseopt.ops.lookup import PlainOptimizerGuard, SparseLookup, check_ids_dtype, layer_state

COMBINERS = (None, "sum", "mean")

# What a weights file holds of a table on disk: a record naming its snapshot.
_DISK_FORMAT = "sparseopt-disk-snapshot"


def disk_record(snapshot, shape, shards=1):
    """The uint8 array a weights file holds for a table on disk: JSON naming its snapshot.

    Args:
        snapshot: the snapshot's name (every shard's, for a table split in shards).
        shape: the table's shape.
        shards: how many shards it is split into (1: none; recorded where more).
    """
    record = {"format": _DISK_FORMAT, "snapshot": snapshot, "shape": list(shape)}
    if shards > 1:
        record["shards"] = int(shards)
    text = json.dumps(record)
    return np.frombuffer(text.encode(), np.uint8)


def snapshot_of(entry, layer_name, table):
    """The snapshot a file's record names for `table` (a `DiskTable`).

    Args:
        entry: the file's entry for the table (`disk_record`'s array), or None
            where the file holds none (another number of entries).
        layer_name: for messages.
        table: the layer's `DiskTable`.

    Raises:
        ValueError: the file holds something else (a table's values, another shape).
    """
    entry = None if entry is None else np.asarray(entry)
    record = None
    if entry is not None and entry.dtype == np.uint8 and entry.ndim == 1:
        try:
            record = json.loads(entry.tobytes().decode())
        except (UnicodeDecodeError, json.JSONDecodeError):
            record = None
    if not isinstance(record, dict) or record.get("format") != _DISK_FORMAT:
        raise ValueError(
            f"Layer '{layer_name}': table '{table.path}' is on disk (storage=OnDisk), and "
            "this file holds no snapshot of a table on disk (a table in memory's values, or "
            "another layer's). Load it into the same layer built without OnDisk.")
    if tuple(record["shape"]) != tuple(table.shape):
        raise ValueError(f"Layer '{layer_name}': the file's table on disk has shape "
                         f"{tuple(record['shape'])}, this layer's {tuple(table.shape)}.")
    saved, here = record.get("shards", 1), len(table.parts())
    if saved != here:
        raise ValueError(
            f"Layer '{layer_name}': the file's table on disk '{table.path}' was split into "
            f"{saved} shard(s) (one folder each), this layer's into {here}: the distribution "
            "that splits the table by rows must split it as when it was saved.")
    return record["snapshot"]

# keras.layers.Embedding options that have no sparse meaning, and the fix.
_REFUSED = {
    "embeddings_regularizer": (
        "a table regularizer has a dense gradient that the sparse updater never "
        "sees; use the updater's own regularization (e.g. "
        "`Ftrl(..., l2_regularization_strength=...)`)"),
    "embeddings_constraint": (
        "a table constraint would touch every row after each step; constrain the "
        "looked-up rows in your model instead"),
    "mask_zero": (
        "use an id outside [0, input_dim), e.g. -1, for padding: it reads a zero "
        "row, is left out of combiner='mean' and is never updated"),
    "lora_rank": "low-rank adapters on a sparsely updated table are not supported",
    "weights": "assign initial values after building: `layer.embeddings.assign(array)`",
}


@keras.saving.register_keras_serializable(package="sparseopt")
class SparseEmbedding(keras.layers.Layer):
    """An embedding table updated in place, row by row, by `updater`.

    Compile the model with `sparseopt.DispatchOptimizer`: the table is then
    trained by `updater` (cost per step proportional to the ids in the batch)
    while the rest of the model uses the wrapped Keras optimizer.

    Ids outside `[0, input_dim)` (for example `-1` padding in a bag) look up a
    zero vector, are left out of `"mean"`, receive no update and are counted in
    `num_dropped_ids`.

    Args:
        input_dim: number of rows (vocabulary size).
        output_dim: embedding width.
        updater: a `sparseopt.updaters.Updater` (e.g. `Adagrad(0.05)`).
        embeddings_initializer: initializer of the table; defaults to
            `"uniform"` like `keras.layers.Embedding`.
        combiner: `None` returns `[..., n, output_dim]` for ids `[..., n]`;
            `"sum"` or `"mean"` reduce the last id axis (multi-hot bags) to
            `[..., output_dim]`.
        storage: how the table stores its updater state and writes 16-bit
            and 8-bit values (`sparseopt.TableStorage(state_dtype=...,
            stochastic_rounding=..., rounding_seed=...)`); None: the
            defaults (float32 state, stochastic rounding, seed 0), or the
            updater's own settings. `sparseopt.storage.OnDisk(path,
            cache_rows=...)` keeps the table and its per-row state in files
            under `path`, with `cache_rows` rows in memory: the layer then
            holds no `[V, D]` variable (`embeddings` is a
            `sparseopt.disk.table.DiskTable`; see docs/disk.md).
        rows_per_step: int8 tables only: the most distinct rows one step may
            update (the size of the buffer that carries a step's writes to
            the table, `sparseopt.storage.int8_table`); None: `min(input_dim, 16384)`.
        **kwargs: base `Layer` arguments (`name`, `dtype`, ...). `dtype="int8"`
            stores the table as int8 codes with a float32 scale per row
            (Keras' int8 `Embedding` format, a quarter of float32's memory);
            the layer then computes in float32 (or the global policy's
            compute dtype).
    """

    def __init__(self, input_dim, output_dim, updater, embeddings_initializer="uniform",
                 combiner=None, storage=None, rows_per_step=None, **kwargs):
        self.int8 = None
        if kwargs.get("dtype") == "int8":
            # Not a Keras dtype policy: the table is int8, the layer computes in float.
            kwargs.pop("dtype")
            self.int8 = Int8Table(rows_per_step)
        elif rows_per_step is not None:
            raise ValueError(
                f"SparseEmbedding '{kwargs.get('name', '')}': `rows_per_step` sizes an int8 "
                "table's write buffer; this table is not int8 (`dtype='int8'`).")
        for option, fix in _REFUSED.items():
            if kwargs.pop(option, None) not in (None, False):
                raise ValueError(
                    f"SparseEmbedding '{kwargs.get('name', '')}': `{option}` is not "
                    f"supported: {fix}."
                )
        kwargs.pop("sparse", None)  # Embedding(sparse=True): always sparse here
        super().__init__(**kwargs)
        if int(input_dim) <= 0 or int(output_dim) <= 0:
            raise ValueError(
                f"{type(self).__name__} '{self.name}': `input_dim` and `output_dim` must "
                f"be positive, got {input_dim} and {output_dim}."
            )
        if combiner not in COMBINERS:
            raise ValueError(
                f"SparseEmbedding '{self.name}': `combiner` must be one of "
                f"{COMBINERS}, got {combiner!r}."
            )
        if isinstance(updater, dict):
            updater = keras.saving.deserialize_keras_object(updater)
        if not isinstance(updater, updaters_lib.Updater):
            raise TypeError(
                f"SparseEmbedding '{self.name}': `updater` must be a "
                "sparseopt.updaters.Updater such as sparseopt.updaters.Adagrad(0.05), "
                f"got {updater!r}."
            )
        self.input_dim = int(input_dim)
        self.output_dim = int(output_dim)
        self.updater = updater
        self.embeddings_initializer = keras.initializers.get(embeddings_initializer)
        self.combiner = combiner
        self.storage = storage_lib.from_argument(storage, f"SparseEmbedding '{self.name}'")
        if self.on_disk and rows_per_step is not None:
            raise ValueError(
                f"SparseEmbedding '{self.name}': `rows_per_step` sizes the write buffer of an "
                "int8 table in memory; a table on disk writes its rows through its cache. "
                "Leave it out.")
        if self.on_disk and not backend.HOST_CALLS_COMPILE:
            # Said before `compile` (where Keras resolves `jit_compile="auto"`): XLA
            # cannot compile the host calls that reach a table on disk.
            self.supports_jit = False

    @property
    def on_disk(self):
        """Whether the table is kept on disk (`storage=sparseopt.storage.OnDisk(...)`)."""
        return getattr(self.storage, "kind", None) == "disk"

    def build(self, input_shape=None):
        shape = (self.input_dim, self.output_dim)
        path = f"{compat.current_path()}/embeddings".lstrip("/")
        if self.on_disk:  # (no array on the devices: its shards need not be even)
            self._build_on_disk(path, shape)
            return
        check_even_split(self.name, path, shape)
        if self.int8 is not None:
            self.int8.build(self, shape, self.embeddings_initializer, self._add_int8_state)
            self.embeddings, self.embeddings_scale = self.int8.codes, self.int8.scale
            self._lookup = self._make_lookup(int8=self.int8)
            for written in self.int8.written_variables:
                # Written by the optimizer's step only.
                written.constraint = PlainOptimizerGuard(self.name, self.embeddings.path)
                written._sparseopt_bookkeeping_of = self._lookup
            return
        # Large random tables are drawn in blocks: memory peaks at one table,
        # not three or four (see block_init.py).
        self.embeddings = add_table(
            self.add_weight, shape, self.embeddings_initializer,
            name="embeddings",
            autocast=False,  # never cast the whole table; the lookup casts rows
        )
        self._lookup = self._make_lookup()

    def _build_on_disk(self, path, shape):
        """The table in files (`sparseopt.disk`): rows and each per-row slot of the updater."""
        # (DataParallel: one table; its rows split over devices: as many shards.)
        shards = check_on_this_host(self.name, path, shape)
        settings = storage_lib.of_table(self.storage, self.updater, path)
        # (An int8 table on disk keeps its codes and scales in its files: `self.int8`
        # stays unbuilt, for the layer's config.)
        dtype = "int8" if self.int8 is not None else self.variable_dtype
        args = (path, shape, dtype, self.embeddings_initializer,
                [s for s in self.updater.slots if s.per_row], settings)
        if shards > 1:
            self._check_shards(path, shards)
            self.embeddings = ShardedDiskTable(*args, shards=shards)
        else:
            self.embeddings = DiskTable(*args)
        self._lookup = self._make_lookup()

    def _check_shards(self, path, shards):
        """Raises where this layer's table on disk (`path`) cannot be split into `shards`
        (a subclass's: an open vocabulary's)."""

    def flush(self):
        """A table on disk: writes its cached rows to its files, and the files to disk.

        `fit` does at its end; call it before copying the folder. Nothing to
        do for a table in memory.
        """
        if self.on_disk:
            self.embeddings.flush()

    def disk_stats(self):
        """A table on disk: its cache's counts so far (hits, misses, hit rate, rows and
        bytes read from and written to its files) and where its host work went
        (`host_ms`, `waited_ms`, `beside_ms`, `flush_ms`: docs/disk.md, "What you can
        see"); None for a table in memory."""
        if self.on_disk:
            return self.embeddings.health()
        return None

    @property
    def variables(self):
        """Keras' `Layer.variables`; while Keras exports the model (`model.export`), a
        table on disk adds its rows as one variable (`sparseopt.disk.serving`)."""
        found = super().variables
        archive = compat.exporting() if self.on_disk and self.built else None
        if archive is not None:
            return found + [self._lookup.exported.made_for(archive)]
        return found

    def _make_lookup(self, **kwargs):
        """The table's `SparseLookup` (a subclass adds what its lookup reads)."""
        return SparseLookup(self, self.embeddings, storage=self.storage, **kwargs)

    def _add_int8_state(self, name, shape, dtype, trainable):
        return layer_state(self, name, dtype, trainable, shape=shape)

    @property
    def variable_path_to_optimizer_map(self):
        return {self.embeddings.path: self.updater}

    @property
    def num_dropped_ids(self):
        """Total ids outside `[0, input_dim)` seen so far (a Keras variable)."""
        return self._lookup.num_dropped_ids

    def call(self, ids, training=None):
        # (`training`: Keras gives a training call's, as to `Dropout`; a table on disk's
        # lookup then reads the rows' per-row state with them, for the optimizer.)
        if self.combiner is None:
            return self._lookup(ids, training=bool(training))
        # One gradient per bag reaches the updater (see SparseLookup.pooled).
        return self._lookup.pooled(ids, self.combiner, training=bool(training))

    def compute_output_shape(self, input_shape):
        if self.combiner is None:
            return tuple(input_shape) + (self.output_dim,)
        return tuple(input_shape[:-1]) + (self.output_dim,)

    def compute_output_spec(self, ids, training=None):
        check_ids_dtype(ids, self.name, self.embeddings.path)
        return keras.KerasTensor(self.compute_output_shape(ids.shape), dtype=self.compute_dtype)

    def count_params(self):
        """The table's parameters (rows x width; an int8 table's codes and row scales).

        What `model.summary()` shows for the layer, as for Keras' `Embedding`,
        the same on every backend. Bookkeeping is not counted here: the
        lookup's probe (a weight on TensorFlow only) and an open vocabulary's
        id map (non-trainable weights, in the summary's "Non-trainable
        params").
        """
        if not self.built:
            return super().count_params()  # (Keras' error for an unbuilt layer)
        if self.on_disk:  # (an int8 table's codes and row scales, as Keras' int8 Embedding)
            rows, width = self.embeddings.shape
            return rows * width + (rows if self.embeddings.int8 else 0)
        table = [self.embeddings] if self.int8 is None else [self.embeddings,
                                                              self.embeddings_scale]
        return int(sum(np.prod(v.shape) for v in table))

    def save_own_variables(self, store):
        """Saves what `keras.layers.Embedding` saves: the table only.

        The lookup's probe (a weight on TensorFlow, see `SparseLookup`) and
        dropped-id count are bookkeeping, not state to keep. An int8 table
        saves its codes and row scales, as Keras' int8 `Embedding` does,
        after writing the last step's rows into them.
        """
        if self.on_disk:
            store["0"] = self._snapshot_record()
            return
        if self.int8 is not None:
            with backend.outside_trace():
                self.int8.flush()
            store["0"], store["1"] = self.embeddings, self.embeddings_scale
            return
        store["0"] = self.embeddings

    def _snapshot_record(self):
        """A table on disk's entry in a weights file: a snapshot of its files (of every
        shard's, in its folder) taken now, named, with its shape and shards."""
        with backend.outside_trace():
            return disk_record(self.embeddings.snapshot(), self.embeddings.shape,
                               len(self.embeddings.parts()))

    def load_own_variables(self, store):
        """Loads the table, also from files of sparseopt 0.1.0.

        Those also hold the lookup's probe and dropped-id count (entries "1"
        and "2"): they are skipped (the count restarts at 0).
        """
        if self.on_disk:
            entry = store["0"] if len(store.keys()) == 1 else None
            self.embeddings.restore(snapshot_of(entry, self.name, self.embeddings))
            return
        if self.int8 is not None:
            self._load_int8(store)
            return
        legacy = len(store.keys()) == 3 and tuple(store["1"].shape) == ()
        if len(store.keys()) != 1 and not legacy:
            raise ValueError(
                f"Layer '{self.name}' expected 1 variable (its table), but received "
                f"{len(store.keys())} variables during loading.")
        if tuple(store["0"].shape) != tuple(self.embeddings.shape):
            raise ValueError(
                f"Layer '{self.name}': the file's table has shape {tuple(store['0'].shape)}, "
                f"this layer's {tuple(self.embeddings.shape)}.")
        self.embeddings.assign(store["0"])

    def _load_int8(self, store):
        if len(store.keys()) != 2:
            raise ValueError(
                f"Layer '{self.name}' (an int8 table) expected 2 variables (codes and row "
                f"scales), but received {len(store.keys())} variables during loading.")
        for i, variable in enumerate([self.embeddings, self.embeddings_scale]):
            if tuple(store[str(i)].shape) != tuple(variable.shape):
                raise ValueError(
                    f"Layer '{self.name}': the file's {variable.name} has shape "
                    f"{tuple(store[str(i)].shape)}, this layer's {tuple(variable.shape)}.")
            variable.assign(store[str(i)])
        self.int8.clear()  # the file's rows are current: nothing left to write

    def get_config(self):
        int8 = {}
        if self.int8 is not None:
            int8 = {"dtype": "int8", "rows_per_step": self.int8.rows_per_step}
        return {
            **super().get_config(),
            **int8,
            "input_dim": self.input_dim,
            "output_dim": self.output_dim,
            "updater": keras.saving.serialize_keras_object(self.updater),
            "embeddings_initializer": keras.initializers.serialize(self.embeddings_initializer),
            "combiner": self.combiner,
            # Only where given: configs without it load as before. A subclass
            # (OnDisk) with its class, so that it loads as itself.
            **({"storage": self.storage.get_config()
                if type(self.storage) is storage_lib.TableStorage
                else keras.saving.serialize_keras_object(self.storage)}
               if self.storage is not None else {}),
        }
