"""`SparseEmbedding`: an embedding table trained by its own sparse updater."""

import keras

from sparseopt import compat
from sparseopt import storage as storage_lib
from sparseopt import updaters as updaters_lib
from sparseopt.distribution import check_even_split
from sparseopt.layers.block_init import blockwise
from sparseopt.ops.lookup import SparseLookup, check_ids_dtype

COMBINERS = (None, "sum", "mean")

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
            values (`sparseopt.TableStorage(state_dtype=..., stochastic_rounding=...,
            rounding_seed=...)`); None: the defaults (float32 state,
            stochastic rounding, seed 0), or the updater's own settings.
        **kwargs: base `Layer` arguments (`name`, `dtype`, ...).
    """

    def __init__(self, input_dim, output_dim, updater, embeddings_initializer="uniform",
                 combiner=None, storage=None, **kwargs):
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
                f"SparseEmbedding '{self.name}': `input_dim` and `output_dim` must "
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

    def build(self, input_shape=None):
        shape = (self.input_dim, self.output_dim)
        check_even_split(self.name, f"{compat.current_path()}/embeddings".lstrip("/"), shape)
        self.embeddings = self.add_weight(
            shape=shape,
            # Large random tables are drawn in blocks: memory peaks at one
            # table, not four (see block_init.py).
            initializer=blockwise(self.embeddings_initializer),
            name="embeddings",
            autocast=False,  # never cast the whole table; the lookup casts rows
        )
        self._lookup = SparseLookup(self, self.embeddings, storage=self.storage)

    @property
    def variable_path_to_optimizer_map(self):
        return {self.embeddings.path: self.updater}

    @property
    def num_dropped_ids(self):
        """Total ids outside `[0, input_dim)` seen so far (a Keras variable)."""
        return self._lookup.num_dropped_ids

    def call(self, ids):
        if self.combiner is None:
            return self._lookup(ids)
        # One gradient per bag reaches the updater (see SparseLookup.pooled).
        return self._lookup.pooled(ids, self.combiner)

    def compute_output_shape(self, input_shape):
        if self.combiner is None:
            return tuple(input_shape) + (self.output_dim,)
        return tuple(input_shape[:-1]) + (self.output_dim,)

    def compute_output_spec(self, ids):
        check_ids_dtype(ids, self.name, self.embeddings.path)
        return keras.KerasTensor(self.compute_output_shape(ids.shape), dtype=self.compute_dtype)

    def save_own_variables(self, store):
        """Saves what `keras.layers.Embedding` saves: the table only.

        The lookup's probe (a weight on TensorFlow, see `SparseLookup`) and
        dropped-id count are bookkeeping, not state to keep.
        """
        store["0"] = self.embeddings

    def load_own_variables(self, store):
        """Loads the table, also from files of sparseopt 0.1.0.

        Those also hold the lookup's probe and dropped-id count (entries "1"
        and "2"): they are skipped (the count restarts at 0).
        """
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

    def get_config(self):
        return {
            **super().get_config(),
            "input_dim": self.input_dim,
            "output_dim": self.output_dim,
            "updater": keras.saving.serialize_keras_object(self.updater),
            "embeddings_initializer": keras.initializers.serialize(self.embeddings_initializer),
            "combiner": self.combiner,
            # Only where given: configs without it load as before.
            **({"storage": self.storage.get_config()} if self.storage is not None else {}),
        }
