"""Sharded tables with `keras.distribution` (JAX).

A table is sharded the way Keras shards any variable: by its path in a
`keras.distribution.LayoutMap`. `DispatchOptimizer` then places each
updater's state exactly like its table (`layout_like`). A table split by
rows is updated on each shard, in place, for the ids that shard owns
(`backend.on_row_shards`); other layouts are left to XLA's partitioner. No
device ever holds or receives a whole table. `row_sharded` builds the usual
recommender layout in one call; the functions at the end check what a
compiled step moves and holds.
"""

import collections
import dataclasses
import math
import re

import keras
import numpy as np

from sparseopt import compat


def layout_like(table, ndim):
    """The layout of an `ndim`-D array indexed by `table`'s rows, or None.

    For tables placed by a `keras.distribution` (a `TensorLayout`).

    Row-wise state (`[V]`) and the dedup workspace take the table's row
    sharding; full state (`[V, D]`) takes its whole layout.

    Args:
        table: the table's Keras variable.
        ndim: 1 or 2.
    """
    layout = compat.layout_of(table)
    if layout is None:
        return None  # no distribution (or a backend sharding given by hand: replicated)
    return keras.distribution.TensorLayout(layout.axes[:ndim], layout.device_mesh)


def rows_like(table, ndim):
    """The layout of an `ndim`-D array split by `table`'s rows only (or None).

    For arrays indexed by the table's rows but of another width (an open
    vocabulary's map): the table's row split, nothing else split.

    Args:
        table: the table's Keras variable, or its table on disk
            (`sparseopt.disk.DiskTable`: split by rows as the active
            distribution's `LayoutMap` says for its path, or None).
        ndim: the array's rank (1 or more).
    """
    layout = compat.layout_of(table)
    distribution = keras.distribution.distribution()
    if layout is None and not isinstance(table, keras.Variable) and distribution is not None:
        # A table on disk is no variable: its shards follow its path's layout
        # (`check_on_this_host`), and so do the arrays indexed by its rows. Where
        # its rows are not split, None, as for a variable of no layout.
        layout = _layout_of(distribution, table.path, table.shape)
        if layout.axes[0] is None:
            return None
    if layout is None:
        return None
    return keras.distribution.TensorLayout((layout.axes[0],) + (None,) * (ndim - 1),
                                           layout.device_mesh)


def row_parts(layout):
    """How many parts a `TensorLayout` splits its first dimension into (1: none)."""
    if layout is None or layout.axes[0] is None:
        return 1
    names = layout.axes[0] if isinstance(layout.axes[0], (tuple, list)) else (layout.axes[0],)
    sizes = dict(zip(layout.device_mesh.axis_names, layout.device_mesh.shape))
    return math.prod(sizes[n] for n in names)


def replicated_beside(table, ndim):
    """A replicated layout for an `ndim`-D array on `table`'s device mesh, or None.

    Whole-table state (a column factor, a table's running sums): every device
    holds all of it, whatever the table's split, so a row shard's update reads
    it locally. Given explicitly, so that no `LayoutMap` entry for the table
    can match the state's path by accident.

    Args:
        table: the table's Keras variable.
        ndim: the array's rank (0 for a scalar).
    """
    layout = compat.layout_of(table)
    if layout is None:
        return None
    return keras.distribution.TensorLayout((None,) * ndim, layout.device_mesh)


def check_on_this_host(layer_name, path, shape):
    """How many shards a table on disk is split into under the active distribution (1: none);
    refuses a distribution it cannot follow.

    A table on disk lives in files on this host and is read and written by the step's
    host calls (`sparseopt.disk`): under a distribution that keeps it whole
    (`keras.distribution.DataParallel`: the batch split over this process's devices,
    the variables replicated) it trains as on one device. A layout splitting its rows
    over a mesh axis (`row_sharded`) splits it into as many shards, each with its own
    files and cache (`sparseopt.disk.sharded`). A layout splitting its columns, and
    several processes (each would open its own files), are refused, naming the table.

    Args:
        layer_name: the owning layer's name, for the message.
        path: the table's path, as a `LayoutMap` would see it.
        shape: the table's shape.
    """
    distribution = keras.distribution.distribution()
    if distribution is None:
        return 1
    if keras.backend.backend() != "jax":
        raise ValueError(
            f"Layer '{layer_name}': a table on disk ('{path}') under a keras.distribution "
            f"on {keras.backend.backend()} is not supported; train it outside the "
            "distribution's scope (on JAX, data parallel works).")
    axes = tuple(_layout_of(distribution, path, shape).axes)
    if any(axis is not None for axis in axes[1:]):
        raise ValueError(
            f"Layer '{layer_name}': the distribution splits the columns of its table on disk "
            f"'{path}' over devices (layout {axes}); a table on disk is split by rows only "
            "(its rows are in files on this host). Split its rows (`row_sharded`), or leave "
            "its path out of the LayoutMap.")
    import jax  # (JAX's: checked above)

    if jax.process_count() > 1:
        raise ValueError(
            f"Layer '{layer_name}': a table on disk ('{path}') under a distribution over "
            f"{jax.process_count()} processes is not supported yet (each would open its "
            "own files); train it in one process, over its devices.")
    rows = axes[0] if axes else None
    names = rows if isinstance(rows, (tuple, list)) else (rows,)
    sizes = dict(zip(distribution.device_mesh.axis_names, distribution.device_mesh.shape))
    return math.prod(sizes[n] for n in names if n is not None)


def _layout_of(distribution, path, shape):
    """The `TensorLayout` `distribution` gives a variable of `path` and `shape` not yet
    created (its `LayoutMap`'s, or replicated)."""
    return distribution.get_variable_layout(compat.variable_stand_in(path, shape))


def check_even_split(layer_name, path, shape):
    """Refuses a variable the active distribution would split unevenly.

    JAX places an array on a mesh only when each split dimension divides
    evenly; this says so before the variable is created, with the fix.

    Args:
        layer_name: the owning layer's name, for the message.
        path: the variable's path, as the `LayoutMap` sees it.
        shape: the variable's shape.
    """
    distribution = keras.distribution.distribution()
    if distribution is None:
        return
    layout = _layout_of(distribution, path, shape)
    mesh = distribution.device_mesh
    sizes = dict(zip(mesh.axis_names, mesh.shape))
    for dim, axis in enumerate(getattr(layout, "axes", ()) or ()):
        names = axis if isinstance(axis, (tuple, list)) else (axis,)
        parts = math.prod(sizes[n] for n in names if n is not None)
        if shape[dim] % parts:
            fixed = -(-shape[dim] // parts) * parts
            raise ValueError(
                f"Layer '{layer_name}': the distribution splits dimension {dim} of "
                f"'{path}' ({shape[dim]}) over {parts} devices (mesh axes {names}), "
                f"which JAX requires to divide evenly. Use {fixed} (the next multiple "
                f"of {parts}; rows no id reaches are never read or updated), or leave "
                "this variable out of the LayoutMap."
            )


def row_sharded(tables, device_mesh=None, table_axis=None, batch_dim_name=None,
                layout_map=None, auto_shard_dataset=True):
    """A `keras.distribution.ModelParallel` with `tables` sharded by rows.

    Every other variable (the dense part) is replicated and trained
    data-parallel over `batch_dim_name`, unless `layout_map` says otherwise.
    With the default one-axis mesh over all devices, each of `n` devices
    holds `1/n` of each table's rows and of its optimizer state, and a
    `1/n` slice of each batch.

    Set it before the model is built:

    ```python
    keras.distribution.set_distribution(
        sparseopt.distribution.row_sharded(tables=[r".*/embeddings"]))
    model = build_model()  # tables are created sharded
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.Adam()))
    ```

    Args:
        tables: variable paths (regexes, matched whole, as `LayoutMap` does)
            of the tables to shard.
        device_mesh: a `keras.distribution.DeviceMesh`; defaults to one axis
            named `"batch"` over `keras.distribution.list_devices()` (every
            process's devices, multi-host included).
        table_axis: mesh axis to split rows over; defaults to the mesh's
            last axis.
        batch_dim_name: mesh axis to split batches over; defaults to the
            mesh's first axis.
        layout_map: an existing `LayoutMap` on `device_mesh` to add to (e.g.
            with layouts of dense layers).
        auto_shard_dataset: as in `ModelParallel`: with several processes,
            whether Keras splits a `tf.data.Dataset` between them. Set it to
            False when each process already reads its own part of the data
            (required for NumPy inputs).
    """
    if isinstance(tables, str):
        tables = [tables]
    if device_mesh is None:
        device_mesh = (layout_map.device_mesh if layout_map is not None else
                       keras.distribution.DeviceMesh(
                           (len(keras.distribution.list_devices()),), ["batch"]))
    table_axis = table_axis or device_mesh.axis_names[-1]
    batch_dim_name = batch_dim_name or device_mesh.axis_names[0]
    for axis in (table_axis, batch_dim_name):
        if axis not in device_mesh.axis_names:
            raise ValueError(
                f"row_sharded: axis '{axis}' is not in the device mesh's axes "
                f"{list(device_mesh.axis_names)}."
            )
    if layout_map is None:
        layout_map = keras.distribution.LayoutMap(device_mesh)
    for path in tables:
        layout_map[path] = (table_axis, None)
    return keras.distribution.ModelParallel(layout_map=layout_map,
                                            batch_dim_name=batch_dim_name,
                                            auto_shard_dataset=auto_shard_dataset)


# -- routing ids to their shard (JAX) -----------------------------------------

def routed_rounds(parts, rows, shards):
    """How many routed rounds a step of a row-sharded table takes (NumPy, no devices).

    Where ids are routed to their owner shard (4 row shards or more), each
    sender (a device holding part of the batch) sends each owner at most
    `route_capacity` distinct ids per round; a step whose senders hold more
    for one owner takes several rounds, each taking every sender's ids below
    the smallest id that follows a full bucket at any sender. Use it to see
    whether your batches fit one round (skew toward a few shards does not;
    hashing or permuting ids spreads them).

    Args:
        parts: one int array of ids per sender (its part of the batch;
            invalid ids are ignored).
        rows: the table's row count.
        shards: the number of row shards.
    """
    from sparseopt.backend.jax_sharding import route_capacity

    size = route_capacity(len(np.ravel(parts[0])), shards)
    per_shard = rows // shards
    most = 1
    for owner in range(shards):
        lo, hi = owner * per_shard, (owner + 1) * per_shard
        runs = [np.unique(p[(p >= lo) & (p < hi)]) for p in map(np.ravel, parts)]
        sent, count = [0] * len(runs), 0
        while any(s < len(r) for s, r in zip(sent, runs)):
            limit = min(r[s + size] if s + size < len(r) else np.inf
                        for s, r in zip(sent, runs))
            sent = [s + int(np.sum(r[s:] < limit)) for s, r in zip(sent, runs)]
            count += 1
        most = max(most, count)
    return most


# -- checking what a sharded step does (JAX) ----------------------------------

_COLLECTIVE = re.compile(
    r"=\s*(?P<shapes>\(.*?\)|\S+)\s+(?P<kind>all-gather|all-reduce|reduce-scatter|"
    r"all-to-all|collective-permute|collective-broadcast)(?:-start)?\(")
_ARRAY = re.compile(r"\b(?P<dtype>pred|[suf]\d+|bf16)\[(?P<dims>[\d,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2}


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a compiled step, as seen by one device.

    Args:
        kind: `"all-gather"`, `"all-reduce"`, `"reduce-scatter"`,
            `"all-to-all"`, `"collective-permute"` or `"collective-broadcast"`.
        shapes: the result's array shapes (one per operand).
        nbytes: the result's size in bytes on one device.
    """

    kind: str
    shapes: tuple
    nbytes: int


def collectives(hlo_text):
    """The collectives in a compiled module's HLO text, in program order.

    Args:
        hlo_text: `jax.stages.Compiled.as_text()` (e.g. of
            `compile_train_step(...)`); any post-optimization HLO module.
    """
    found = []
    for line in hlo_text.splitlines():
        match = _COLLECTIVE.search(line)
        if match is None:
            continue
        shapes, nbytes = [], 0
        for array in _ARRAY.finditer(match["shapes"]):
            dims = tuple(int(d) for d in array["dims"].split(",") if d)
            shapes.append(dims)
            dtype = array["dtype"]
            size = _BYTES[dtype] if dtype in _BYTES else int(dtype[1:]) // 8
            nbytes += size * math.prod(dims)
        found.append(Collective(match["kind"], tuple(shapes), nbytes))
    return found


def step_inputs(model, x, y=None, sample_weight=None):
    """The `(state, data)` pair that `fit` passes to the jitted train step (JAX).

    `state` holds the current values of the model's trainable, non-trainable,
    optimizer and metric variables; `data` is the batch placed as the active
    distribution places it.

    Args:
        model: a compiled Keras model whose optimizer is built.
        x, y, sample_weight: one batch, as `fit` would get it (with several
            processes: this process's part of it).
    """
    import jax

    distribution = keras.distribution.distribution()

    def place(value):
        if value is None or distribution is None:
            return value
        layout = distribution.get_data_layout(value.shape).backend_layout
        return jax.make_array_from_process_local_data(layout, np.asarray(value))

    data = tuple(jax.tree_util.tree_map(place, d) for d in (x, y, sample_weight))
    state = tuple([v.value for v in group] for group in _state_groups(model))
    return state, data


def compile_train_step(model, x, y=None, sample_weight=None, compiler_options=None):
    """`model`'s train step compiled for one batch, as `fit` compiles it (JAX).

    The result is the program each device runs: inspect it with
    `collectives(compiled.as_text())` and `compiled.memory_analysis()`, or
    run it, `logs, state = compiled(*step_inputs(model, x, y))` (the state
    is donated). Nothing is trained by compiling.

    Args:
        model: a compiled Keras model whose optimizer is built (e.g. after
            `model.optimizer.build(model.trainable_variables)`).
        x, y, sample_weight: one batch, as for `step_inputs`.
        compiler_options: XLA options for this compile only, over those of
            `XLA_FLAGS` (`jax.stages.Lowered.compile`'s argument), e.g.
            `{"xla_backend_optimization_level": 3}` to inspect the program
            at XLA's defaults in a process started with other flags.
    """
    import jax

    if keras.backend.backend() != "jax":
        raise ValueError("compile_train_step: needs the JAX backend.")
    shardings = tuple([v.value.sharding for v in group] for group in _state_groups(model))
    # Metrics Keras has not built yet (no fit so far) come out where XLA puts them.
    shardings = shardings[:3] + (None,)
    step = jax.jit(model.train_step, donate_argnums=0, out_shardings=(None, shardings))
    return step.lower(*step_inputs(model, x, y, sample_weight)).compile(compiler_options)


def _state_groups(model):
    return (model.trainable_variables, model.non_trainable_variables,
            model.optimizer.variables, model.metrics_variables)


def bytes_per_device(variables):
    """`{device: bytes of `variables` stored on it}` (JAX arrays' shards).

    Args:
        variables: Keras variables, e.g. a table and its optimizer state.
    """
    held = collections.Counter()
    for variable in variables:
        for shard in variable.value.addressable_shards:
            held[shard.device] += shard.data.nbytes
    return dict(held)
