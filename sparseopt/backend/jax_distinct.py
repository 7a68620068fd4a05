"""JAX: the step's distinct rows, from its record: one table's dedup, a group's, and the
loops that run a step's stages on them in chunks."""

import jax
import jax.numpy as jnp
import numpy as np

from sparseopt.backend.jax_rows import Held, distinct_padding, padding_ids
from sparseopt.records import Distinct, Stacked, concatenate, rows_of


# Dedup writes into a persistent int32 `workspace` with one entry per row
# (4 bytes a row, one per table: a shared one would chain the tables' updates
# one after another; measured 10.4 vs 8.6 ms per step on the 26-table demo).
WORKSPACE = True
WORKSPACE_SINK = 0  # extra entries (invalid ids are dropped by the scatter)


def dedup(record, num_rows, workspace):
    """The `Distinct` rows of `record`: the `count` distinct ids first.

    No sort: every occurrence writes its position into `workspace[id]`; the
    write that lands is one of that id's positions, so reading
    `workspace[id]` back gives every occurrence of an id the same
    representative position. Only the entries of this batch's ids are
    written and read, so what earlier steps left in the workspace never
    matters. It is 2.3x faster than sorting on XLA:CPU (0.55 vs 1.27 ms for a
    row-wise Adagrad update of 16k ids) and works the same on GPU, where the
    racing writes are equally harmless. A running count of representatives
    then packs the `count` distinct ids into the first entries, their
    gradients summed into the same slots, so that gather, rule and scatter
    can run on those entries only (`for_distinct_rows`).

    The result has `min(len(ids), num_rows)` entries (a table has at most
    `num_rows` distinct ids). Entries from `count` on are distinct ids
    `>= num_rows` with zero gradient, which `gather` clamps and `scatter`
    drops.

    Args:
        record: the `RowGrads` (ids outside `[0, num_rows)` are ignored).
        num_rows: the table's row count.
        workspace: int32 Keras variable with at least `num_rows` entries.
    """
    n = record.ids.shape[0]
    ids = record.ids.astype(jnp.int32)
    position = jnp.arange(n, dtype=jnp.int32)
    valid = (ids >= 0) & (ids < num_rows)
    space = workspace.value
    space = space.at[jnp.where(valid, ids, space.shape[0])].set(position, mode="drop")
    workspace.assign(space)
    representative = jnp.where(valid, jnp.take(space, ids, mode="clip"), n)
    is_first = representative == position
    slot = jnp.cumsum(is_first, dtype=jnp.int32) - 1
    count = jnp.sum(is_first, dtype=jnp.int32)
    size = min(n, num_rows)
    segment = jnp.where(valid, jnp.take(slot, representative, mode="clip"), size)
    # Bag gradients are expanded here, inside the sum that consumes them.
    summed = jax.ops.segment_sum(record.rows(), segment, num_segments=size)  # drops `size`
    # A zero sum is +0.0, whatever XLA's simplifier makes of a sum of one -0.0
    # (it depends on shapes): one result, the native kernel's too.
    summed = jnp.where(summed == 0, jnp.zeros((), summed.dtype), summed)
    uniq = padding_ids(num_rows, size).at[jnp.where(is_first, slot, size)].set(ids, mode="drop")
    return Distinct(uniq, summed, count)


def scratch_workspace(n):
    """A workspace for one dedup of ids numbered below `n`, inside the traced step.

    Args:
        n: the ids' bound (the batch's size).
    """
    return Held(jnp.zeros((n + WORKSPACE_SINK,), jnp.int32))


def trimmed(distinct):
    """`distinct` as the step works on it: padded to its static size (JAX's shapes are).

    Args:
        distinct: a `Distinct`.
    """
    return distinct


# Distinct rows handled per pass: gather, rule and scatter work on
# `DISTINCT_CHUNK` rows at a time, as many passes as the step has distinct
# ids, never on the (often many more) padding entries after them.
DISTINCT_CHUNK = 8192


def loops_follow_count():
    """Whether a step's distinct rows are taken in chunks, as many as it has distinct ids.

    On CPU (and TPU, whose loops run on the device) a loop whose trip count is
    traced lets the work follow the distinct ids, not the padded list. On a
    GPU it does not pay: XLA:GPU decides each trip of such a loop on the host
    (the condition is copied back, the host waits for the device), so every
    table's loop drained the GPU's queue. Measured on an H100
    (benchmarks/gpu_step.py, 26 Criteo tables, batch 16,384): 6.12 ms a step
    with the loops, 1.95 ms in one pass. On a GPU the whole list is one pass:
    the entries after `count` are padding ids past the table, which gather
    clamps and scatter drops, so the rows written are the same (their values
    may round differently in the last bit: another program).
    """
    return jax.default_backend() != "gpu"


# A listed-rows list up to this long goes in one pass on a GPU (an int8 table's
# write buffer: up to 16,384 rows); a longer one (Lookahead's window, a table's
# length) stays in chunks, since one pass would be work the size of the table.
LISTED_ONE_PASS = 1 << 16


def for_distinct_rows(update, variables, distinct):
    """Runs `update(variables, ids, grads)` on the `distinct.count` first entries only.

    `distinct` comes from `dedup`: `count` distinct ids first. They
    are taken `DISTINCT_CHUNK` at a time in a loop (one pass when they fit),
    so the work follows the step's distinct ids, with no bound that could
    lose one. `update` reads and writes `variables` (a list of objects with
    `value` and `assign`, the table first), which the loop carries.
    """
    chunks = _chunks(distinct, variables[0].shape[0])
    if chunks is None:
        update(variables, distinct.ids, distinct.grads)
        return
    take, trips = chunks

    def chunk(i, values):
        held = [Held(v) for v in values]
        update(held, *take(i)[1:])
        return [h.value for h in held]

    values = jax.lax.fori_loop(0, trips, chunk, [v.value for v in variables])
    for var, value in zip(variables, values):
        var.assign(value)


def sum_over_distinct_rows(contribute, distinct, num_rows):
    """`contribute(ids, grads)` summed over the `distinct.count` first entries.

    `contribute` returns `{name: [U, ...]}`, one contribution per entry; the
    entries are taken in the chunks `for_distinct_rows` takes, and padding
    entries (from `count` on, whose gathered rows are clamped real rows)
    add nothing. `num_rows`: the table's rows.
    """
    def masked(parts, start, length):
        keep = start + jnp.arange(length, dtype=jnp.int32) < distinct.count
        return {k: jnp.sum(jnp.where(keep.reshape((-1,) + (1,) * (v.ndim - 1)), v, 0), axis=0)
                for k, v in parts.items()}

    chunks = _chunks(distinct, num_rows)
    if chunks is None:
        return masked(contribute(distinct.ids, distinct.grads), 0, distinct.ids.shape[0])
    take, trips = chunks

    def chunk(i, total):
        start, ids, grads = take(i)
        part = masked(contribute(ids, grads), start, DISTINCT_CHUNK)
        return {k: total[k] + part[k] for k in total}

    shapes = jax.eval_shape(lambda: masked(contribute(*take(0)[1:]), 0, DISTINCT_CHUNK))
    zeros = {k: jnp.zeros(v.shape, v.dtype) for k, v in shapes.items()}
    return jax.lax.fori_loop(0, trips, chunk, zeros)


def _chunks(distinct, num_rows):
    """`distinct` in whole chunks of `DISTINCT_CHUNK` entries, or None for one pass.

    One pass (None) on a GPU (`loops_follow_count`). Where its entries do
    not fit one chunk, they are padded to whole chunks
    with more distinct padding ids (zero gradient). Returns `(take, trips)`:
    `take(i)` gives chunk `i`'s `(first entry, ids, grads)`, and `trips` (a
    traced count) the chunks that hold distinct ids.
    """
    uniq, summed, count = distinct
    n, size = uniq.shape[0], DISTINCT_CHUNK
    pad = -n % size
    if n <= size or not loops_follow_count() or not distinct_padding(num_rows, n + pad):
        return None
    uniq = jnp.concatenate([uniq, padding_ids(num_rows, n + pad)[n:]])
    summed = jnp.pad(summed, ((0, pad), (0, 0)))

    def take(i):
        start = i * size
        return (start, jax.lax.dynamic_slice_in_dim(uniq, start, size),
                jax.lax.dynamic_slice_in_dim(summed, start, size))

    return take, (count + size - 1) // size


def for_listed_rows(update, variables, ids, count):
    """`update(variables, chunk)` over the `count` first entries of `ids`, in place.

    Chunks of `DISTINCT_CHUNK` entries, as many as `count` takes, sliced out
    of `ids` as it is (no padded copy of a list that may have an entry per
    table row); the last chunk ends at the list's end, so it may repeat
    entries of the one before, and entries past `count` come along:
    `update` leaves those out itself and is idempotent. On a GPU a list of up
    to `LISTED_ONE_PASS` entries is one pass (`loops_follow_count`).
    """
    n, size = ids.shape[0], DISTINCT_CHUNK
    if n <= size or (not loops_follow_count() and n <= LISTED_ONE_PASS):
        update(variables, ids)
        return

    def chunk(i, values):
        held = [Held(v) for v in values]
        start = jnp.minimum(i * size, n - size)
        update(held, jax.lax.dynamic_slice_in_dim(ids, start, size))
        return [h.value for h in held]

    trips = (count + size - 1) // size
    values = jax.lax.fori_loop(0, trips, chunk, [v.value for v in variables])
    for var, value in zip(variables, values):
        var.assign(value)


def dedup_tables(records, num_rows, workspace, dedup=None):
    """One dedup of several tables' steps (a group), each table's result in a range of its own.

    `dedup`'s algorithm over all the tables' ids at once, shifted into one id
    space (table `t`'s rows after table `t-1`'s, one workspace), with each
    table's distinct ids numbered from the start of its own range of
    `size_t = min(ids_t, rows_t)` entries: table `t`'s `Distinct` is one
    static slice of one array, exactly what `dedup` of that table alone gives
    (the same ids in the same order, the same sums, the same padding ids),
    with no search and no split. One scatter, gather, running count and
    segment sum serve every table: a compiled step holds a few kernels for
    the group instead of a dozen per table.

    Args:
        records: one float32 `RowGrads` per table, in its own rows.
        num_rows: each table's row count.
        workspace: int32 Keras variable with at least `sum(num_rows)` entries.
        dedup: unused (the native dedup knows no ranges: a group takes this
            path either way).

    Returns:
        `Stacked`: each table's `Distinct`, and the whole arrays.
    """
    counts = [r.ids.shape[0] for r in records]
    sizes = [min(n, v) for n, v in zip(counts, num_rows)]
    offsets = np.cumsum([0] + list(num_rows))  # each table's first shifted id
    starts = np.cumsum([0] + counts)  # its first position in the step's ids
    ranges = np.cumsum([0] + sizes)  # its first entry in the result
    total, size = int(offsets[-1]), int(ranges[-1])
    shifted = []
    for record, rows, offset in zip(records, num_rows, offsets):
        ids = record.ids.astype(jnp.int32).reshape(-1)
        shifted.append(jnp.where((ids >= 0) & (ids < rows), ids + int(offset), total))
    ids = jnp.concatenate(shifted)
    n = ids.shape[0]
    position = jnp.arange(n, dtype=jnp.int32)
    table_of = _which(position, starts)
    valid = ids < total
    space = workspace.value
    space = space.at[jnp.where(valid, ids, space.shape[0])].set(position, mode="drop")
    workspace.assign(space)
    representative = jnp.where(valid, jnp.take(space, ids, mode="clip"), n)
    is_first = representative == position
    running = jnp.concatenate([jnp.zeros((1,), jnp.int32),
                               jnp.cumsum(is_first, dtype=jnp.int32)])
    base = running[starts[:-1]]  # each table's firsts before its first position
    found = running[starts[1:]] - base
    slot = running[1:] - 1 - base[table_of] + jnp.asarray(ranges[:-1], jnp.int32)[table_of]
    segment = jnp.where(valid, jnp.take(slot, representative, mode="clip"), size)
    grads = rows_of(concatenate([r.grads for r in records]))  # (bags expanded in the sum)
    summed = jax.ops.segment_sum(grads, segment, num_segments=size)
    # A zero sum is +0.0, as `dedup` makes it.
    summed = jnp.where(summed == 0, jnp.zeros((), summed.dtype), summed)
    entry = jnp.arange(size, dtype=jnp.int32)
    range_of = _which(entry, ranges)
    padding = (jnp.asarray(num_rows, jnp.int32)[range_of]
               + entry - jnp.asarray(ranges[:-1], jnp.int32)[range_of])
    local = ids - jnp.asarray(offsets[:-1], jnp.int32)[table_of]
    uniq = padding.at[jnp.where(is_first, slot, size)].set(local, mode="drop")
    parts = [Distinct(uniq[a:b], summed[a:b], found[t])
             for t, (a, b) in enumerate(zip(ranges[:-1], ranges[1:]))]
    return Stacked(parts, grads=summed)


def _which(index, starts):
    """For int32 `index` `[N]`, the part each falls in, of parts starting at `starts`
    (static, ascending, from 0, with the end last): one compare per part."""
    bounds = jnp.asarray(starts[1:-1], jnp.int32)
    return jnp.sum(index[:, None] >= bounds[None, :], axis=1, dtype=jnp.int32)
