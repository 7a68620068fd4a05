"""The next batch's rows fetched while the current step runs (`fit`, JAX and TensorFlow).

A step reads its rows from the table's cache; rows the cache misses are
read from the files. Fetched in the step, they are on its critical path.
Fetched ahead, they are not: `fit`'s loop hands each batch to the tables
one step early (`compat.batches_seen_ahead`: the batch after the one a step
trains on is taken from the data when that step's batch is), each table on
disk works out the rows that batch will read (`RowsOf`: the model's own
layers between its inputs and the table's layer, run on the batch), and
the table's thread beside the step brings them into the cache as soon as
the current step has read its own, while that step computes (`Upcoming`,
used by `DiskTable`).

The cache is transparent: which rows it holds changes nothing a step reads
or writes (a row is in the cache or in the files, never both out of date),
so a fetch ahead changes when rows are read from the files, not what any
step computes. The fetch keeps the values it found; the step before writes
its rows after the fetch, and each write brings the fetch's values of the
rows it writes up to date (`Foreseen.take_written`), so the step takes its
rows as they are, without finding them in the cache again. (A fetch may evict
rows the step before still writes: that write caches them again, and a row
is in the cache or in the files, never lost.)
A batch whose ids the table did not foresee (another loop, a layer whose
ids are not a function of the model's inputs) is read as without look-ahead.

Keras' JAX trainer itself takes one batch ahead on accelerators
(`_one_batch_ahead_iterator`): the data is consumed as there. TensorFlow's
`fit` then takes its batches in Python rather than inside its compiled
function, and runs the same compiled step on each (`compat.batches_seen_ahead`).
On TensorFlow the optimizer, and so the tables' look-ahead, is built inside
the first call's compiled function, whose batches are taken there: the first
call of the first `fit` reads its rows in the step.
"""

import collections
import logging
import threading

import keras
import numpy as np

from sparseopt import compat

# Batches a table keeps foreseen. One is what `fit` gives (the next step's);
# with `steps_per_execution` a call takes several, and older ones are let go.
KEPT = 16


class Upcoming:
    """The batches a table will read next, oldest first, each fetched ahead in turn.

    The read of a batch names the next one to fetch (`reached`); the table
    starts that fetch then, on its thread beside the step, while the step
    computes. The read of that batch waits for it like any work there, and
    takes its distinct ids and values from it.

    Args:
        num_rows: the table's rows (ids outside are never fetched).
    """

    def __init__(self, num_rows):
        self.num_rows = num_rows
        self._batches = collections.deque()
        self._lock = threading.Lock()
        # Whether more than `KEPT` batches were foreseen that no read matched (the oldest
        # let go): the batches shown are not what the table reads.
        self.overflowed = False

    def add(self, ids):
        """Foresees a batch's ids; its `Foreseen` if it is to be fetched now (nothing is
        foreseen before it), else None.

        Args:
            ids: the ids the table's lookups will read in that step (any shape).
        """
        entry = Foreseen(valid_or_minus_one(ids, self.num_rows))
        with self._lock:
            self._batches.append(entry)
            while len(self._batches) > KEPT:
                self._batches.popleft().dropped = True
                self.overflowed = True
            if len(self._batches) == 1:
                entry.started = True
                return entry
        return None

    def reached(self, ids):
        """A read of `ids` is here: its `Foreseen` (or None), and the next one to fetch once
        the read is done (or None).

        The batches foreseen before the one read are let go (not read after all).

        Args:
            ids: the read's ids, as `valid_or_minus_one` gives them.
        """
        with self._lock:
            found = next((k for k, entry in enumerate(self._batches)
                          if np.array_equal(entry.ids, ids)), None)
            if found is None:
                return None, None
            entry = self._batches[found]
            for _ in range(found):  # (never read: no write need bring them up to date)
                self._batches.popleft().dropped = True
            self._batches.popleft()
            following = self._batches[0] if self._batches else None
            if following is None or following.started:
                return entry, None
            following.started = True
            return entry, following

    def clear(self):
        """Forgets every batch foreseen (a load, a new cache)."""
        with self._lock:
            for entry in self._batches:
                entry.dropped = True
            self._batches.clear()


class Foreseen:
    """A batch a table will read: its ids, whether its fetch was started, and once
    fetched (`counted`: its rows were looked up in the cache, and counted there)
    their `host_ops.Distinct`, their values as the fetch read them (`found`,
    `{column: values}`, as stored) and what they are current as of (`as_of`: the cache
    and the table's count of writes then; each write after the fetch brings them up
    to date, `take_written`), and whether it was let go unread (`dropped`: no write
    need bring it up to date).

    Args:
        ids: int64 `[N]`, the ids as `valid_or_minus_one` gives them.
    """

    def __init__(self, ids):
        self.ids, self.started, self.distinct, self.counted = ids, False, None, False
        self.found = self.as_of = None
        self.dropped = False

    def take_written(self, ids, values):
        """Its rows among `ids` take the values written to them.

        Args:
            ids: int64 `[M]`, distinct rows written.
            values: `{column: [M, *tail]}` of every column, as stored.
        """
        at = self.distinct.find(ids)
        written = np.flatnonzero(at >= 0)
        if written.size:
            at = at[written]
            for name, array in self.found.items():
                array[at] = values[name][written]


def valid_or_minus_one(ids, num_rows):
    """Int64 `[N]` ids, flat, those outside `[0, num_rows)` made -1 (as a lookup reads them).

    Args:
        ids: int ids, any shape.
        num_rows: the table's rows.
    """
    ids = np.asarray(ids).reshape(-1).astype(np.int64)
    return np.where((ids >= 0) & (ids < num_rows), ids, -1)


class RowsOf:
    """The ids a layer's lookups read, from a batch of its model's inputs.

    Where the layer is called on one of the model's inputs, that input's
    array in the batch; else the model's own layers from its inputs to the
    layer, run on the batch (compiled once: a step's worth of ids each call).
    Only stateless ones: a path through a layer with weights (another table, a
    learned hash) is not run ahead, since its result could change in the step
    before.

    Args:
        model: a functional Keras model.
        layer: a layer called once in it, on ids.
    """

    def __init__(self, model, layer):
        given = layer.input  # (raises for a layer called more than once)
        self._struct = model.input
        inputs = keras.tree.flatten(self._struct)
        self._at = next((k for k, t in enumerate(inputs) if t is given), None)
        self._count = len(inputs)
        path = keras.Model(model.input, given)
        if path.weights:
            raise ValueError("the layer's ids come through layers with weights")
        self._path = _compiled(lambda x: path(x, training=False))

    def __call__(self, x):
        """The ids of batch `x` (the model's inputs, as `fit` gives them), as NumPy."""
        if self._at is not None and self._same_structure(x):
            return np.asarray(keras.tree.flatten(x)[self._at])
        return np.asarray(self._path(x))  # (Keras maps the batch to the inputs, by name too)

    def _same_structure(self, x):
        """Whether `x` flattens as the model's inputs do (a dict given to a model of
        listed inputs is mapped by name, not by position: not the same)."""
        if isinstance(self._struct, dict) or isinstance(x, dict):
            return (isinstance(self._struct, dict) and isinstance(x, dict)
                    and sorted(self._struct) == sorted(x))
        return len(keras.tree.flatten(x)) == self._count


def _compiled(function):
    """`function` compiled by the backend, run on the host's processor (a step's worth of
    ids a call, the same shapes each step: compiled once, or twice with a last, smaller
    batch). On the host, not the default device: its ids are read back before the next
    step is dispatched, which on an accelerator would wait for the steps queued there."""
    if keras.backend.backend() == "jax":
        import jax

        compiled = jax.jit(function)
        try:
            cpu = jax.devices("cpu")[0]
        except RuntimeError:  # (JAX started without its CPU platform)
            return compiled

        def on_cpu(x):
            with jax.default_device(cpu):
                return compiled(x)

        return on_cpu
    import tensorflow as tf

    compiled = tf.function(function, reduce_retracing=True)

    def on_cpu(x):
        with tf.device("/CPU:0"):
            return compiled(x)

    return on_cpu


def rows_of(model, layer):
    """A `RowsOf` for `layer` in `model`, or None where its ids cannot be foreseen (a
    subclassed model, a layer called more than once, ids through layers with weights).

    Args:
        model: the Keras model being trained.
        layer: the table's layer.
    """
    try:
        return RowsOf(model, layer)
    except Exception as error:  # noqa: BLE001 (no look-ahead; the step reads as before)
        logging.getLogger("sparseopt.disk").warning(
            "Layer '%s': its table's rows are fetched in the step that reads them, not ahead "
            "(fetch_ahead=True): its ids cannot be worked out from a batch (%s).",
            layer.name, error)
        return None


def install(model, tables):
    """Makes `fit` of `model` show each table its next batch's ids one step ahead.

    Args:
        model: the Keras model being trained.
        tables: `[(DiskTable, layer)]`, the tables to fetch ahead and their layers.
    """
    if keras.backend.backend() not in ("jax", "tensorflow") or model is None:
        return
    seen = [(table, path) for table, layer in tables
            if (path := rows_of(model, layer)) is not None]
    # (None: a model compiled again without tables to fetch ahead lets its last ones go,
    # and Keras' own loop takes its batches again.)
    compat.batches_seen_ahead(model, _Foresee(seen) if seen else None)


class _Foresee:
    """`see(batch)`: each table told the ids it will read for that batch (a table whose
    ids cannot be worked out from it is let go: its rows are fetched in the step)."""

    def __init__(self, seen):
        self.seen = list(seen)

    def __call__(self, batch):
        x, _, _ = keras.utils.unpack_x_y_sample_weight(batch)
        for item in list(self.seen):
            table, path = item
            try:
                ids = path(x)
            except Exception as error:  # noqa: BLE001 (no look-ahead; nothing else changes)
                logging.getLogger("sparseopt.disk").warning(
                    "Table '%s': its rows are no longer fetched ahead: its ids could not be "
                    "worked out from a batch (%s).", table.path, error)
                self.seen.remove(item)
                continue
            table.ahead(ids)
