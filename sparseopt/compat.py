"""Every use of a private Keras, TensorFlow or keras-rs API, in one place.

sparseopt needs a few things these libraries do not export. Each is wrapped
here, with what it relies on, so that an upgrade that changes one fails in
this module (and in tests/test_compat.py) instead of somewhere deep in a step.

Checked against: keras 3.15.1, tensorflow 2.21.0, jax 0.10.2, keras-rs 0.4.0
(the ranges pinned in pyproject.toml).
"""

import contextlib
import os
import re
import sys

import keras

CHECKED = {"keras": "3.15", "tensorflow": "2.21", "keras_rs": "0.4"}


# -- Keras -------------------------------------------------------------------

def read_as_stored():
    """A context in which variables are read in their stored dtype (no autocast).

    What a layer with `autocast=False` uses: the lookup casts the few rows it
    reads, never the table.
    """
    from keras.src.backend import AutocastScope

    return AutocastScope(None)


def current_path():
    """Keras' name-scope path of a variable created here (what a LayoutMap matches)."""
    from keras.src.backend.common.name_scope import current_path as path

    return path()


def layout_of(variable):
    """The `keras.distribution.TensorLayout` a variable was created with, or None."""
    layout = getattr(variable, "_layout", None)
    return layout if isinstance(layout, keras.distribution.TensorLayout) else None


def variable_stand_in(path, shape):
    """What `Distribution.get_variable_layout` reads of a variable not yet created."""
    import types

    return types.SimpleNamespace(path=path, shape=tuple(shape), _layout=None)


def track_state(layer, variable):
    """Makes `variable` state of `layer` that is not one of its weights.

    Keras 3 keeps two lists: `layer.weights` (what `get_weights`,
    `set_weights` and weights files hold) and `layer.variables`, which adds
    the state of the layer's `SeedGenerator`s. Trainers thread and
    differentiate `variables` (`trainable_variables`,
    `non_trainable_variables`); nothing saves or lists that extra state as
    weights. A lookup's bookkeeping (probe, dropped-id count) belongs there:
    it must reach the train step but never a user's weights. Keras only
    reads `.state` of the entries; it works on built layers too (keras-rs
    builds its layers before the optimizer reads them sparsely).
    """
    import types

    layer._seed_generators.append(types.SimpleNamespace(state=variable))


@contextlib.contextmanager
def saved_as(layers, class_name):
    """Within: Keras' weights files key `layers` as if their class were `class_name`.

    Keras' saver names the layers of a list (a functional model's layers,
    keras-rs' `EmbedReduce`s) by their class name, snake-cased and numbered
    in order (`embedding`, `embedding_1`, ...); attributes by attribute
    name. Giving each layer, for the duration, a subclass of its own class
    with that name reads a file written when those layers had that class.
    """
    originals = [(layer, type(layer)) for layer in layers]
    aliases = {}
    for layer, cls in originals:
        if cls not in aliases:
            aliases[cls] = type(class_name, (cls,), {"__module__": cls.__module__})
        layer.__class__ = aliases[cls]
    try:
        yield
    finally:
        for layer, cls in originals:
            layer.__class__ = cls


def holds_a_value(variable):
    """Whether a Keras variable holds a value (reading one that does not calls its spent
    initializer: a TypeError).

    False where Keras' JAX trainer took the values out of the model's variables
    for its compiled step (`_get_jax_state(purge_model_variables=True)`) and the
    step failed before any state came back (`fit`'s `finally` then finds none to
    put back), and for a variable whose initialization was deferred and never done.
    """
    return getattr(variable, "_value", None) is not None


def embedding_variable(layer):
    """The table variable of a `keras.layers.Embedding` (its `_embeddings`)."""
    return layer._embeddings


def uses_weight_decay(optimizer, variable):
    """Whether `optimizer`'s `exclude_from_weight_decay` rules leave `variable` decayed.

    Keras' own test (`Optimizer._use_weight_decay`): the variable is not in
    the excluded list and no excluded name pattern is found in its name. A
    table that is no variable (on disk) cannot be in the list (Keras keys it
    by its `tf.Variable` on TF): its name is checked against the patterns.
    """
    if not isinstance(variable, keras.Variable):
        pattern = getattr(optimizer, "_exclude_from_weight_decay_pattern", None)
        return pattern is None or re.search(pattern, variable.name) is None
    return bool(optimizer._use_weight_decay(variable))


def sublayers(model):
    """Every layer inside `model`, recursively (Keras' own traversal)."""
    return list(model._flatten_layers(include_self=False, recursive=True))


def set_initial_epoch(model, epoch):
    """Makes `fit` start at `epoch`, as Keras' own `BackupAndRestore` does."""
    model._initial_epoch = epoch


def jax_train_state(model, batch):
    """Builds `model` for `batch` and returns the state tuple its JAX train step takes.

    What `fit` threads through `jax.jit(model.train_step, donate_argnums=0)`:
    trainable, non-trainable, optimizer and metrics variables.
    """
    model._symbolic_build(data_batch=batch)
    return tuple(model._get_jax_state(trainable_variables=True, non_trainable_variables=True,
                                      optimizer_variables=True, metrics_variables=True))


def model_building(optimizer):
    """The Keras model that `optimizer` is being built for, or None.

    Keras hands an optimizer the model's variables, never the model. The
    model is found on the call stack: the nearest frame holding (as `self`,
    when Keras' trainer builds it in `fit`, `evaluate`, `train_on_batch` or
    `compile_from_config`, or as a local, when code calls
    `model.optimizer.build(model.trainable_variables)`) a model whose
    optimizer is `optimizer` or wraps it. This reads a few dozen frames,
    never the heap, and only ever a model compiled with this optimizer.
    """
    frame = sys._getframe(1)
    while frame is not None:
        local = frame.f_locals
        owner = local.get("self")
        candidates = [owner] if isinstance(owner, keras.Model) else []
        candidates += [v for v in local.values() if isinstance(v, keras.Model) and v is not owner]
        for model in candidates:
            if _wraps(getattr(model, "optimizer", None), optimizer):
                return model
        frame = frame.f_back
    return None


def training_batch(optimizer):
    """A batch of the data `optimizer` is being built to train on, or None.

    Keras' trainer builds the optimizer in `Model._symbolic_build(iterator=...,
    data_batch=...)`, where `data_batch` (or the epoch iterator's first
    batch, which `fit` rewinds right after, as Keras itself reads it there)
    is at hand. Found on the call stack, like `model_building`.
    """
    frame = sys._getframe(1)
    while frame is not None:
        local = frame.f_locals
        owner = local.get("self")
        if frame.f_code.co_name == "_symbolic_build" and isinstance(owner, keras.Model) \
                and _wraps(getattr(owner, "optimizer", None), optimizer):
            batch = local.get("data_batch")
            iterator = local.get("iterator")
            if batch is None and iterator is not None:
                for _, _, data in iterator:  # Keras' own peek
                    batch = data[0] if isinstance(data, (list, tuple)) else next(data)
                    break
            return batch
        frame = frame.f_back
    return None


def batches_seen_ahead(model, see):
    """Makes `fit` of `model` call `see(batch)` on each batch one step before the step
    that trains on it (`sparseopt.disk.look_ahead`).

    Keras' JAX trainer takes a step's batch inside `model.train_function(state,
    iterator)` (`next(iterator)`, once per step of a call), which `fit` gets from
    `model.make_train_function()`. The function made is wrapped once: each
    iterator it is given is read one batch ahead, as Keras' own
    `_one_batch_ahead_iterator` reads it on accelerators (the batch after is
    taken when a step's is, and handed to that next step), across calls and
    epochs that pass the same iterator. `see` is the latest given.

    Keras' TensorFlow trainer calls `model.train_function(iterator)`: given a
    `tf.data` iterator it takes the batches inside its compiled function
    (where no batch can be seen ahead), given any other iterator it takes them
    in Python and runs its compiled one-step function on each (as for
    `train_on_batch`). The wrapper hands it the one-batch-ahead reader, so the
    steps are the same compiled step, fed the same batches from Python. Under a
    `tf.distribute` strategy (a distributed iterator, whose batches are the
    replicas') the iterator is passed on as it is: nothing is seen ahead (a
    warning says so, once per model).

    Args:
        model: a Keras model (JAX or TensorFlow backend).
        see: a function of one batch (what `next(iterator)` gives), or None: nothing
            is seen from the next iterator on (a model compiled again without tables
            to fetch ahead: its iterators are passed on as they are).
    """
    model.__dict__["_sparseopt_see_ahead"] = see
    if see is None or "_sparseopt_make_train_function" in model.__dict__:
        return
    made = type(model).make_train_function.__get__(model)

    def make_train_function(force=False):
        made(force=force)  # (sets `model.train_function`; Keras returns nothing)
        function = model.train_function
        if function is not None and not getattr(function, "_sparseopt_ahead", False):
            model.train_function = _AheadCall(function, model)

    # (In the instance's dict, past Keras' attribute tracking: a function, no state.)
    model.__dict__["_sparseopt_make_train_function"] = made
    model.__dict__["make_train_function"] = make_train_function
    if getattr(model, "train_function", None) is not None:
        make_train_function()  # (one made by an earlier `fit`)


class _AheadCall:
    """`model.train_function`, reading each iterator it is given one batch ahead.

    Args:
        function: the train function Keras made.
        model: its model (held weakly).
    """

    _sparseopt_ahead = True

    def __init__(self, function, model):
        import functools
        import weakref

        self.function = function
        # No reference back to this object from its reader: freed as soon as Keras drops
        # it (a new `compile`), its jitted step goes with it. (JAX keys its trace cache
        # by the step's function, a bound method equal to the next compile's: a trace
        # kept alive by a cycle would be reused for a model whose layers' `trainable`
        # changed, with no variable to tell them apart.)
        self._model = weakref.ref(model)
        self._see = functools.partial(_see_ahead, self._model)
        self._iterator = self._reader = None

    def __call__(self, *args):
        # JAX: `(state, iterator)`; TensorFlow: `(iterator)`.
        *state, iterator = args
        if iterator is not self._iterator:
            # A new iterator (a new `fit`, epoch or `train_on_batch`): read ahead while
            # something is to be seen; an iterator read ahead stays so to its end.
            self._iterator, self._reader = iterator, self._reader_of(iterator, state)
        if self._reader is None:
            return self.function(*state, iterator)
        reader = self._reader
        if not state and not reader.has_next():
            # (Keras' TensorFlow function raises this itself for a tf.data iterator
            # at its end; for a Python iterator it would run no step and fail.)
            self._iterator = self._reader = None
            raise StopIteration
        result = self.function(*state, reader)
        if reader.exhausted():
            self._iterator = self._reader = None  # (nothing of the data kept past its end)
        return result

    def _reader_of(self, iterator, state):
        """An `_AheadReader` over a new `iterator`, or None where it is passed on as it is."""
        model = self._model()
        if model is None or model.__dict__.get("_sparseopt_see_ahead") is None:
            return None
        if not state and _distributed(iterator):
            if not model.__dict__.get("_sparseopt_told_distributed"):
                model.__dict__["_sparseopt_told_distributed"] = True
                import logging

                logging.getLogger("sparseopt").warning(
                    "Model '%s' trains under a tf.distribute strategy: its tables on disk "
                    "read their rows in the step (fetch_ahead=True applies to fit without "
                    "a strategy).", model.name)
            return None
        return _AheadReader(iterator, self._see)


def _distributed(iterator):
    """Whether `iterator` is a `tf.distribute` iterator (TensorFlow, under a strategy)."""
    if keras.backend.backend() != "tensorflow":
        return False
    import tensorflow as tf

    return (isinstance(iterator, tf.distribute.DistributedIterator)
            and not isinstance(iterator, tf.data.Iterator))


def _see_ahead(model_ref, batch):
    """The latest `see` given for the model (`batches_seen_ahead`), on `batch`.

    Args:
        model_ref: a weak reference to the model.
        batch: the batch taken.
    """
    model = model_ref()
    see = None if model is None else model.__dict__.get("_sparseopt_see_ahead")
    if see is not None:
        see(batch)


class _AheadReader:
    """An iterator giving `iterator`'s batches, each taken one batch early.

    Args:
        iterator: the iterator Keras gave its train function.
        see: called on each batch as it is taken.
    """

    def __init__(self, iterator, see):
        self._iterator, self._see = iterator, see
        self._next, self._ended = None, False

    def __iter__(self):
        return self

    def exhausted(self):
        """Whether the iterator ended and every batch taken was given."""
        return self._ended and self._next is None

    def has_next(self):
        """Whether a batch is left (the first is taken, and seen, if none was yet)."""
        if self._next is None and not self._ended:
            self._next = self._take()
        return self._next is not None

    def __next__(self):
        if self._next is None:
            if self._ended:
                raise StopIteration
            self._next = self._take()  # (the first: seen as it is taken)
            if self._next is None:
                raise StopIteration
        batch, self._next = self._next, self._take()
        return batch

    def _take(self):
        """The iterator's next batch, seen; None at its end (and after)."""
        if self._ended:
            return None
        try:
            batch = next(self._iterator)
        except StopIteration:
            self._ended = True
            return None
        try:
            self._see(batch)
        except Exception as error:  # noqa: BLE001 (a batch taken is never lost for it)
            import logging

            logging.getLogger("sparseopt").warning(
                "A batch could not be shown ahead to the tables on disk (%s); their rows "
                "are fetched in the step.", error)
        return batch


def wrapper_building(optimizer):
    """The `LossScaleOptimizer` whose `build` is building `optimizer`, or None.

    `LossScaleOptimizer.build` builds its inner optimizer: the wrapper is the
    `self` of a frame on the call stack (read up to the model, a few dozen
    frames) whose `inner_optimizer` is `optimizer`.
    """
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if (isinstance(owner, keras.optimizers.LossScaleOptimizer)
                and getattr(owner, "inner_optimizer", None) is optimizer):
            return owner
        if isinstance(owner, keras.Model):
            return None
        frame = frame.f_back
    return None


def exporting():
    """The Keras export archive (`model.export`, `keras.export.ExportArchive`) at work on
    the call stack, or None.

    Keras tells a layer nothing of an export: it reads the layer's variables
    (`ExportArchive.track`), then traces its call (`add_endpoint`, `write_out`). Both run
    inside a method of the archive, so it is the `self` of a frame on the
    call stack. Recognized by its classes' names and modules (`ExportArchive`,
    `SavedModelExportArchive`, each backend's `TFExportArchive`,
    `JaxExportArchive`), without importing them: they import TensorFlow.

    Only the frames of Keras' export modules are read: reading a frame's
    locals makes Python keep a copy of them with the frame, so a caller's
    `del model` would no longer free its model while that frame lives (this
    runs often, for every check of a native kernel while a step is traced).
    """
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not (filename.startswith(_KERAS_SOURCES)
                and "export" in filename[len(_KERAS_SOURCES):]):
            frame = frame.f_back
            continue
        owner = frame.f_locals.get("self")
        if owner is not None and any(
                c.__name__.endswith("ExportArchive") and c.__module__.startswith("keras.")
                for c in type(owner).__mro__):
            return owner
        frame = frame.f_back
    return None


# Where Keras' own modules are (its export archives' methods among them).
_KERAS_SOURCES = os.path.dirname(os.path.abspath(keras.__file__)) + os.sep


def _wraps(outer, inner):
    while outer is not None:
        if outer is inner:
            return True
        outer = getattr(outer, "inner_optimizer", None)
    return False


def unsaved_attributes(names):
    """A `__dir__` for a class whose attributes `names` Keras' saver must not walk.

    Keras' saver finds the state to save by walking `dir(obj)` (keras
    `saving_lib`'s `_walk_saveable`): attributes left out of `dir` are not
    saved from there (the object saves them itself, if at all).

    Args:
        names: attribute names to leave out.
    """
    names = frozenset(names)

    def __dir__(self):
        return [n for n in object.__dir__(self) if n not in names]

    return __dir__


# -- TensorFlow --------------------------------------------------------------

def in_xla_context():
    """Whether TF is building an XLA cluster (`jit_compile=True`) right now."""
    import tensorflow as tf
    from tensorflow.python.ops import control_flow_util

    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


def forget_custom_gradient(output):
    """Drops TensorFlow's global registration of the `tf.custom_gradient` whose result
    is `output`, traced in a graph (nothing eager).

    In a graph, `tf.custom_gradient` registers its gradient function under a
    name of its own (`CustomGradient-<n>`) in TensorFlow's gradient registry,
    for good: the function holds the forward's result tensors, hence their
    graph and every model traced through it, for the process's life. A
    `GradientTape` in the same graph (how Keras and training loops
    differentiate a step) takes the function from the tape, and a SavedModel
    skips an op type the registry does not know. Only a gradient taken
    symbolically through the op needs the entry (an outer tape over a
    `tf.function` or `tf.cond` that holds it, `tf.gradients`): that raises
    TensorFlow's `LookupError` now (docs/backends.md).

    Relies on: the IdentityN op that makes `output` naming the registered
    function in its `_gradient_op_type` attribute, and the registry's
    `_registry` dict (`tensorflow.python.framework.ops.gradient_registry`);
    where either differs, the registration is left as TensorFlow made it.
    """
    import tensorflow as tf
    from tensorflow.python.framework import ops

    if tf.executing_eagerly() or not hasattr(output, "op"):
        return
    try:
        name = output.op.get_attr("_gradient_op_type")
    except ValueError:  # (not a custom gradient's op)
        return
    name = name.decode() if isinstance(name, bytes) else name
    registry = getattr(ops.gradient_registry, "_registry", None)
    if isinstance(registry, dict):
        registry.pop(name, None)


# -- keras-rs ----------------------------------------------------------------

def default_device_features(layer):
    """`{feature path: (FeatureConfig, EmbedReduce layer)}` of a built
    `keras_rs.layers.DistributedEmbedding` placed on the default device (CPU/GPU)."""
    configs = layer._placement_to_path_to_feature_config.get("default_device", {})
    return {path: (feature, layer._default_device_embedding_layers[path])
            for path, feature in configs.items()}


def sparsecore_config_conversion():
    """keras-rs' conversion between Keras optimizers and SparseCore optimizer specs."""
    from keras_rs.src.layers.embedding.jax import config_conversion

    return config_conversion
