"""TensorFlow: replicas that each hold a copy of every table (`MirroredStrategy`).

Each replica gathers every replica's row gradients and applies the same update to its
own copy; a replica reads and writes its own copy (`local`).
"""

import keras
import tensorflow as tf

from sparseopt.records import BagGrads, RowGrads


def replica_strategy():
    """`(strategy class name, replicas, supported)` of a TF strategy with several replicas.

    None with one replica. Supported: `tf.distribute.MirroredStrategy`, whose
    replicas run in one process and reach each other's ids and row
    gradients (`all_replicas`).
    """
    strategy = tf.distribute.get_strategy()
    count = strategy.num_replicas_in_sync
    if count == 1:
        return None
    return type(strategy).__name__, count, isinstance(strategy, tf.distribute.MirroredStrategy)


def all_replicas(record):
    """The `RowGrads` of every replica of the step, in replica order.

    Inside a replica of a strategy with several replicas, each replica's
    ids and row gradients are gathered (`ReplicaContext.all_gather`: ids and
    rows, never a table-sized gradient), so that every replica applies the
    same summed update to its own copy of the table. Elsewhere: unchanged.
    Keras divides each replica's loss by the number of replicas, so the
    gathered gradients sum to the global batch's.
    """
    context = replica_context()
    if context is None:
        return record
    ids, grads = context.all_gather(record.ids, axis=0), record.grads
    # (An open vocabulary's `changed` is the same on every replica: its map
    # works on every replica's ids, `gather_over_replicas`.) An int8 table's
    # rows as read travel with their ids.
    read = None if record.read is None else context.all_gather(record.read, axis=0)
    if isinstance(grads, BagGrads):
        # Bag numbers are per replica: shift them past the earlier replicas' bags.
        offset = _start(context, tf.shape(grads.values, out_type=grads.bag.dtype)[:1])
        return RowGrads(ids, BagGrads(context.all_gather(grads.values, axis=0),
                                      context.all_gather(grads.bag + offset, axis=0),
                                      context.all_gather(grads.weight, axis=0)), record.calls,
                        record.changed, read)
    return RowGrads(ids, context.all_gather(grads, axis=0), record.calls, record.changed, read)


def gather_over_replicas(values):
    """`([each of values, every replica's concatenated in replica order], this
    replica's start)`.

    `values`: arrays with the same first dimension. Outside a step with
    several replicas: `(values, 0)`. Replicas may hold different numbers of
    entries (a batch that does not split evenly).
    """
    context = replica_context()
    if context is None:
        return list(values), 0
    start = _start(context, tf.shape(values[0], out_type=tf.int32)[:1])
    return [context.all_gather(v, axis=0) for v in values], start


def _start(context, size):
    """Where this replica's entries begin among all replicas' (`size`: `[1]`, its own)."""
    sizes = context.all_gather(size, axis=0)
    return tf.reduce_sum(sizes[:context.replica_id_in_sync_group])


def sum_over_replicas(value):
    """`value` summed over the replicas of the step (unchanged outside replicas)."""
    context = replica_context()
    if context is None:
        return value
    return context.all_reduce(tf.distribute.ReduceOp.SUM, value)


def replica_context():
    """The replica context of a step with several replicas, else None."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return None
    return context


def local(variable):
    """The `tf.Variable` this replica reads and writes, of a Keras variable (or its value).

    A `MirroredStrategy` variable holds one copy per replica; inside a
    replica, its own copy, so that reads stay `ResourceGather`s (a
    `tf.gather` of the mirrored variable reads it whole) and writes stay in
    place on that copy. Elsewhere the variable itself.
    """
    var = variable.value if isinstance(variable, keras.Variable) else variable
    if (not isinstance(var, tf.distribute.DistributedValues)
            or tf.distribute.in_cross_replica_context()):
        return var
    return tf.distribute.get_strategy().experimental_local_results(var)[replica_id()]


def replica_id():
    """Which replica of a `MirroredStrategy` step is being traced (0 outside one).

    Its replicas are traced into one graph, interleaved: each must take its
    own lookups' row gradients.
    """
    context = tf.distribute.get_replica_context()
    if context is None:
        return 0
    return int(tf.get_static_value(context.replica_id_in_sync_group))
