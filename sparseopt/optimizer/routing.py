"""Which variable goes where: a pure plan from the model's variables and declarations.

`plan` decides, for every trainable variable `DispatchOptimizer.build` is
given, one `Route`: a Keras optimizer trains it densely, an updater trains
it in place as a table, keras-rs installs its new value (SparseCore), or it
is a lookup's probe (read by its table's trainer, never trained). Nothing is
created or changed while planning; `DispatchOptimizer.build` then executes
the plan. Who assigns what, first match wins:

1. `optimizer_map` (an exact path, else one `re.fullmatch`ing key);
2. the variable's own `optimizer` attribute (Keras PR #21196);
3. what a layer declares (`variable_path_to_optimizer_map`) or keras-rs'
   `TableConfig.optimizer` (`sparseopt.optimizer.discovery`);
4. the wrapped (default) Keras optimizer.
"""

import dataclasses
import re

from sparseopt.optimizer import checks
from sparseopt.updaters import Updater

DENSE, TABLE, INSTALLED, PROBE = "dense", "table", "installed", "probe"
# State a table's lookup keeps that its trainer writes (an open vocabulary's
# hand-over, `DynamicEmbedding`): trainable only so that JAX's stateless step
# may write it; never trained.
BOOKKEEPING = "bookkeeping"


@dataclasses.dataclass(frozen=True)
class Route:
    """Where one trainable variable goes.

    Args:
        variable: the Keras variable.
        kind: `DENSE`, `TABLE`, `INSTALLED`, `PROBE` or `BOOKKEEPING`.
        target: the Keras optimizer (`DENSE`) or `Updater` (`TABLE`); None
            otherwise.
        owner: who assigned `target`, for messages (None for the default
            optimizer).
        lookup: the table's `SparseLookup` (`TABLE`), None where it has none
            yet (a keras-rs table, read densely until adapted).
        keras_rs_layer: the keras-rs `EmbedReduce` reading a `TABLE` that has
            no lookup yet, else None.
    """

    variable: object
    kind: str
    target: object = None
    owner: str = None
    lookup: object = None
    keras_rs_layer: object = None


def plan(variables, declared, optimizer_map, default_optimizer):
    """One `Route` per variable of `variables`, in their order.

    Args:
        variables: the trainable variables the optimizer is built for.
        declared: `{id(variable): sparseopt.optimizer.discovery.Declared}`.
        optimizer_map: `{path or regex: Keras optimizer or Updater}`.
        default_optimizer: the Keras optimizer of everything else.

    Raises:
        ValueError: a table read by a sparse lookup has no updater, or a
            path matches several `optimizer_map` keys.
        TypeError: something assigned is neither a Keras optimizer nor an
            updater.
    """
    routes = []
    for var in variables:
        if getattr(var, "_sparseopt_probe_of", None) is not None:
            routes.append(Route(var, PROBE))
            continue
        if getattr(var, "_sparseopt_bookkeeping_of", None) is not None:
            routes.append(Route(var, BOOKKEEPING))
            continue
        if getattr(var, "overwrite_with_gradient", False):
            # keras-rs SparseCore tables, slots and step counter: their
            # lookup's backward pass computes the new values.
            routes.append(Route(var, INSTALLED))
            continue
        found = declared.get(id(var))
        target, owner = assigned(var, found, optimizer_map)
        lookup = getattr(var, "_sparseopt_lookup", None)
        if isinstance(target, Updater):
            layer = found.keras_rs_layer if lookup is None and found is not None else None
            routes.append(Route(var, TABLE, target, owner, lookup, layer))
        elif lookup is not None:
            raise ValueError(
                f"DispatchOptimizer: table '{var.path}' is read by a sparse lookup "
                "but has no sparse updater (its dense gradient is always zero). "
                "Declare one in the layer's `variable_path_to_optimizer_map` or "
                "pass `optimizer_map={'%s': sparseopt.updaters.Adagrad(...)}`."
                % var.path
            )
        else:
            routes.append(Route(var, DENSE, target or default_optimizer, owner))
    return routes


def assigned(var, found, optimizer_map):
    """`(optimizer or updater, who assigned it)` for `var`, or `(None, None)`.

    Args:
        var: the variable.
        found: its `Declared` entry, or None.
        optimizer_map: as for `plan`.
    """
    target = map_entry(optimizer_map, var.path)
    if target is not None:
        return target, "optimizer_map"
    own = getattr(var, "optimizer", None)
    if own is not None:
        owner = f"variable '{var.path}' (its `optimizer` attribute)"
        checks.assigned(own, owner)
        return own, owner
    if found is not None:
        checks.assigned(found.updater, found.owner)
        return found.updater, found.owner
    return None, None


def map_entry(optimizer_map, path):
    """The `optimizer_map` value for `path` (exact key, else one regex match), or None."""
    if path in optimizer_map:
        return optimizer_map[path]
    hits = [k for k in optimizer_map if re.fullmatch(k, path)]
    if len(hits) > 1:
        raise ValueError(
            f"DispatchOptimizer: variable '{path}' matches several optimizer_map "
            f"keys {hits}; make them exclusive."
        )
    return optimizer_map[hits[0]] if hits else None
