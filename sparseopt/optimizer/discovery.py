"""Finding which updater trains which table, without searching the heap.

An optimizer is handed the model's variables, not its layers. The updaters
that layers declare (`variable_path_to_optimizer_map`) are reached three ways:

- through the table: a table read by a `sparseopt.ops.SparseLookup` knows
  its lookup, and the lookup keeps a weak reference to its layer;
- through the probe of the lookup of a table that is no trainable variable
  (`tables_beside`: an int8 table, a table on disk), which is not among
  those handed over;
- through the model being trained (`compat.model_building`): its layers,
  which is also where keras-rs `DistributedEmbedding` tables are found, and
  where a layer that declares an updater for a table it reads densely is
  caught.

Only layers of the model (or owning one of the given variables) are ever
read: another live model, broken or not, never matters.
"""

import dataclasses

from sparseopt import backend, compat
from sparseopt.optimizer.keras_rs_tables import default_device_tables


@dataclasses.dataclass
class Declared:
    """A table's updater and who declared it.

    Args:
        updater: the `sparseopt.updaters.Updater`.
        owner: who declared it, for messages.
        keras_rs_layer: the keras-rs `EmbedReduce` that reads the table, for
            keras-rs tables; else None.
    """

    updater: object
    owner: str
    keras_rs_layer: object = None


def declared_tables(variables, model=None):
    """`{id(variable): Declared}` for the declared tables among `variables`.

    Args:
        variables: the variables an optimizer is being built for.
        model: the Keras model they belong to, if known.
    """
    wanted = {id(v) for v in variables}
    model_layers = compat.sublayers(model) if model is not None else []
    layers = {}
    for var in variables:
        lookup = getattr(var, "_sparseopt_lookup", None)
        layer = lookup.layer if lookup is not None else None
        if layer is not None:
            layers[id(layer)] = layer
    for layer in model_layers:
        layers.setdefault(id(layer), layer)
    found = {}
    for layer in layers.values():
        for var, updater in _declared_by(layer):
            if id(var) in wanted:
                found[id(var)] = Declared(updater, f"layer '{layer.name}'")
    if model is not None:
        with backend.outside_trace():  # reads optimizer configs (TF builds in a trace)
            tables = default_device_tables(model_layers, wanted)
        for key, (updater, owner, reader) in tables.items():
            found.setdefault(key, Declared(updater, owner, reader))
    return found


def _declared_by(layer):
    """`[(variable, updater)]` that `layer` declares (checked against its variables)."""
    if not (hasattr(type(layer), "variable_path_to_optimizer_map") and layer.built):
        return []
    declared = layer.variable_path_to_optimizer_map or {}
    by_path = {v.path: v for v in layer.variables}
    for v in layer.variables:  # tables that are no variables, through their probes
        lookup = getattr(v, "_sparseopt_probe_of", None)
        if lookup is not None and lookup.beside_variables:
            by_path.setdefault(lookup.table.path, lookup.table)
    out = []
    for path, updater in declared.items():
        if path not in by_path:
            raise ValueError(
                f"Layer '{layer.name}' declares an updater for '{path}' in "
                "`variable_path_to_optimizer_map`, but it has no variable with "
                f"that path. Its variables are: {sorted(by_path)}."
            )
        out.append((by_path[path], updater))
    return out


def tables_beside(variables):
    """The tables that are no trainable variables, read by the lookups whose probes are
    among `variables`.

    An int8 table is layer state, not a trainable variable (JAX differentiates
    no integer array); a table on disk is no variable at all
    (`sparseopt.disk.table.DiskTable`). An optimizer is not handed either;
    its lookup's probe is, and leads to it.

    Args:
        variables: the trainable variables an optimizer is being built for.
    """
    given = {id(v) for v in variables}
    found = []
    for var in variables:
        lookup = getattr(var, "_sparseopt_probe_of", None)
        if getattr(lookup, "beside_variables", False) and id(lookup.table) not in given:
            found.append(lookup.table)
    return found
