"""Tables of keras-rs `DistributedEmbedding` placed on the default device (CPU/GPU).

There, keras-rs falls back to one `EmbedReduce` layer (a `keras.layers.Embedding`)
per table and leaves `TableConfig.optimizer` unused: the model's optimizer
trains the tables densely. `DispatchOptimizer` finds these tables when it is
built and trains each with the sparseopt updater converted from its
`TableConfig.optimizer`. It also changes how the `EmbedReduce` reads its rows
(keras-rs' weighting and combiners stay as they are):

- JAX: through a `SparseLookup`, since `jax.grad` of a dense `take` is a
  dense `[V, D]` array. Keras builds the optimizer before tracing the step.
- TensorFlow: with a gather from the variable's resource. Its gradient is
  `tf.IndexedSlices` (ids and row gradients), which the optimizer applies
  sparsely; a dense read would copy the whole table every step once the
  table is updated by scatter (TF then reads variables copy-on-read: 46 vs
  2.3 ms per step at 4M vs 10k rows, measured). Keras builds TF optimizers
  while tracing the first step, after that step's forward pass, but creating
  the optimizer's variables there makes `tf.function` trace the step again,
  with the sparse read (measured: 1.85 vs 1.94 ms per step at 4M vs 10k rows).

What keras-rs does not export is read through `sparseopt.compat`.
"""

import keras

from sparseopt import backend, compat
from sparseopt.ops.lookup import SparseLookup
from sparseopt.updaters.core.keras_conversion import from_keras_optimizer


def default_device_tables(layers, wanted):
    """`{id(table): (updater, owner, EmbedReduce layer)}` for keras-rs tables.

    Args:
        layers: layers of the model being trained (its `DistributedEmbedding`s
            among them).
        wanted: ids of the variables the optimizer is built for.
    """
    try:
        import keras_rs
    except ImportError:
        return {}
    found = {}
    for obj in layers:
        if not (isinstance(obj, keras_rs.layers.DistributedEmbedding) and obj.built):
            continue
        for feature, layer in compat.default_device_features(obj).values():
            var = layer.embeddings
            if id(var) in wanted and id(var) not in found:
                table = feature.table.name
                found[id(var)] = (
                    from_keras_optimizer(feature.table.optimizer, table=table),
                    f"keras_rs DistributedEmbedding '{obj.name}' (TableConfig '{table}')",
                    layer,
                )
    return found


def adapt(layer):
    """Makes an `EmbedReduce`'s table trainable sparsely by `DispatchOptimizer`.

    Args:
        layer: the built `EmbedReduce`.

    Returns:
        Its `SparseLookup` (JAX, `read_sparsely`), or None where the
        backend's gradient of a gather is already sparse (TF,
        `read_by_gather`). TF builds the optimizer while tracing the first
        step, after its forward pass; creating variables there makes
        `tf.function` trace the step again, and that trace reads sparsely.
    """
    if backend.SPARSE_GRADIENTS:
        read_by_gather(layer)
        return None
    return read_sparsely(layer)


def read_sparsely(layer):
    """JAX: makes an `EmbedReduce` read its table through a `SparseLookup`.

    keras-rs' `EmbedReduce.call` gets its rows from `super().call(ids)`
    (Keras' dense `take`) and then applies its weights and combiner. Giving
    the layer a class whose next method in that chain reads differently
    keeps keras-rs' own weighting and combiners unchanged (see `_swapped`).
    The lookup's probe and dropped-id count are layer state, not weights, so
    the layer's weights and files stay keras-rs' own.

    Args:
        layer: the built `EmbedReduce` (a `keras.layers.Embedding`).

    Returns:
        The `SparseLookup`.
    """
    lookup = getattr(layer.embeddings, "_sparseopt_lookup", None)
    if lookup is None:
        lookup = SparseLookup(layer, layer.embeddings)
        layer.__class__ = _swapped(type(layer), _LookupTake)
    return lookup


def read_by_gather(layer):
    """TF: makes an `EmbedReduce` gather its rows from the variable's resource.

    Args:
        layer: the built `EmbedReduce`.
    """
    if not isinstance(layer, _GatherTake):
        layer.__class__ = _swapped(type(layer), _GatherTake)


class _LookupTake(keras.layers.Embedding):
    def call(self, inputs):
        return compat.embedding_variable(self)._sparseopt_lookup(inputs)


class _GatherTake(keras.layers.Embedding):
    def call(self, inputs):
        return keras.ops.cast(backend.gather_from_resource(compat.embedding_variable(self), inputs),
                              self.compute_dtype)


_CLASSES = {}


def _swapped(cls, take):
    """`cls` with `take.call` next in its MRO, under `cls`'s own names.

    The names matter: Keras' saver keys the layers of a list (keras-rs keeps
    its `EmbedReduce`s in one) by class name, so a renamed class would move
    the table to another entry of the weights file.
    """
    if (cls, take) not in _CLASSES:
        # MRO: <new>, cls, take, Embedding: cls's `super().call` reaches take.call.
        _CLASSES[cls, take] = type(cls.__name__, (cls, take), {
            "__qualname__": cls.__qualname__, "__module__": cls.__module__})
    return _CLASSES[cls, take]
