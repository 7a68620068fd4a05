"""Gradient accumulation: `gradient_accumulation_steps=k` micro-batches, one update.

Keras accumulates a full-size gradient per variable and applies the mean of
the k gradients on every k-th step. A table's dense gradient is the size of
the table, so a table keeps instead the ids and row gradients of each
micro-batch, in buffers of `k x (ids per step)` entries (never sized by the
vocabulary), and for an int8 table or a table on disk the rows its lookups
read too. On the
k-th micro-step the k micro-batches' rows are
deduplicated together and their mean applied once: per row, the sum of all
its gradients over the k micro-batches, divided by k, which is the row of
Keras' mean dense gradient. Dense variables are accumulated here too, one
accumulator per variable as in Keras, so that the update (and
`global_clipnorm`) sees the k-step mean of everything at once.

The buffers are state: a save in the middle of an accumulation holds them,
and the run resumes exactly. A micro-step that a `LossScaleOptimizer` skips
never reaches the optimizer, so it neither counts nor accumulates, as in
Keras.
"""

import keras
from keras import ops

from sparseopt import backend
from sparseopt.records import RowGrads


class Accumulator:
    """The accumulation state of one `DispatchOptimizer`.

    Args:
        steps: k, the micro-batches per update (`>= 2`).
    """

    def __init__(self, steps):
        self.steps = steps
        self.dense = {}  # var key -> accumulator variable (the variable's shape)
        self.tables = {}  # id(trainer) -> (capacity, ids buffer, grads buffer)

    def build(self, optimizer, dense_variables, trainers, capacities, key):
        """Creates the accumulators with `optimizer.add_variable(...)`.

        Args:
            optimizer: the `DispatchOptimizer`.
            dense_variables: the variables its Keras optimizers train.
            trainers: its `TableTrainer`s.
            capacities: `{id(trainer): ids its table looks up per step}`.
            key: the optimizer's `_var_key`.
        """
        for var in dense_variables:
            self.dense[key(var)] = optimizer.add_variable_from_reference(
                var, name="gradient_accumulator")
        for trainer in trainers:
            capacity = capacities[id(trainer)]
            prefix = trainer.name.replace("/", "_")
            size = self.steps * capacity
            ids = optimizer.add_variable(shape=(size,), dtype="int32",
                                         initializer=keras.initializers.Constant(-1),
                                         name=f"{prefix}_accumulated_ids")
            grads = optimizer.add_variable(shape=(size, trainer.table.shape[1]),
                                           dtype="float32", initializer="zeros",
                                           name=f"{prefix}_accumulated_grads")
            read = None
            if trainer.row_storage.reads_lookups:
                # The rows each lookup read: the table's rule starts from them
                # (an int8 table's, a table on disk's).
                read = optimizer.add_variable(shape=(size, trainer.table.shape[1]),
                                              dtype="float32", initializer="zeros",
                                              name=f"{prefix}_accumulated_rows")
            self.tables[id(trainer)] = (capacity, ids, grads, read)

    @property
    def variables(self):
        return [*self.dense.values(),
                *(v for _, *vs in self.tables.values() for v in vs if v is not None)]

    def add(self, micro, dense, rows, trainers, key):
        """Adds this micro-step's gradients: dense ones summed, rows into slot `micro`.

        Args:
            micro: the micro-step in the cycle, `0 .. k - 1` (scalar tensor).
            dense: `{id(Keras optimizer): (gradients, variables)}`.
            rows: `{id(trainer): RowGrads}` of the tables looked up.
            trainers: every `TableTrainer` (a table not looked up gets an empty slot).
            key: the optimizer's `_var_key`.
        """
        for grads, variables in dense.values():
            for grad, var in zip(grads, variables):
                acc = self.dense[key(var)]
                acc.assign(acc + ops.cast(ops.convert_to_tensor(grad), acc.dtype))
        for trainer in trainers:
            capacity, ids_buffer, grads_buffer, read_buffer = self.tables[id(trainer)]
            width = trainer.table.shape[1]
            read = None
            if id(trainer) in rows:
                record = rows[id(trainer)]
                ids = ops.reshape(ops.cast(record.ids, "int32"), (-1,))
                grads = ops.reshape(record.rows(), (-1, width))
                if read_buffer is not None:
                    read = ops.reshape(record.read, (-1, width))
            else:
                ids, grads = ops.zeros((0,), "int32"), ops.zeros((0, width), "float32")
            if read_buffer is not None and read is None:
                read = ops.zeros((0, width), "float32")
            start = micro * capacity
            if read_buffer is not None:
                _, read = _padded(ids, read, capacity, trainer.name)
                backend.write_rows(read_buffer, start, read)
            ids, grads = _padded(ids, grads, capacity, trainer.name)
            backend.write_rows(ids_buffer, start, ids)
            backend.write_rows(grads_buffer, start, grads)

    def mean(self, dense, trainers, key):
        """The k micro-steps' mean: `(dense, rows)` as `DispatchOptimizer._step` takes them.

        Args:
            dense: this micro-step's `{id(optimizer): (gradients, variables)}`
                (which variables each optimizer updates).
            trainers: every `TableTrainer`.
            key: the optimizer's `_var_key`.
        """
        means = {}
        for opt_key, (_, variables) in dense.items():
            means[opt_key] = ([self.dense[key(v)].value / self.steps for v in variables],
                              variables)
        rows = {}
        for trainer in trainers:
            _, ids_buffer, grads_buffer, read_buffer = self.tables[id(trainer)]
            read = read_buffer.value if read_buffer is not None else None
            # TF MirroredStrategy: every replica's micro-batches, applied by each.
            rows[id(trainer)] = backend.all_replicas(
                RowGrads(ids_buffer.value, grads_buffer.value / self.steps, read=read))
        return means, rows

    def reset(self):
        """Zeroes the dense accumulators (the tables' slots are all rewritten each cycle)."""
        for acc in self.dense.values():
            acc.assign(ops.zeros(acc.shape, acc.dtype))


def _padded(ids, grads, capacity, table):
    """`ids` and `grads` padded to `capacity` entries (id -1, zero gradient)."""
    n = ids.shape[0]
    message = (f"DispatchOptimizer: table '{table}' looks up more ids in this step than the "
               f"{capacity} its gradient accumulation buffers were sized for (the ids per "
               "step when the optimizer was built). Build the optimizer on the largest "
               "batch (it is built on the first one `fit` sees).")
    if n is not None:
        if n > capacity:
            raise ValueError(message)
        pad = capacity - n
    else:  # TF, a batch dimension unknown when traced: checked when it runs
        pad = backend.at_least_zero(capacity - ops.shape(ids)[0], message)
    ids = ops.pad(ids, [[0, pad]], constant_values=-1)
    grads = ops.pad(grads, [[0, pad], [0, 0]])
    return ids, grads
