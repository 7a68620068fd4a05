"""Finding the updaters that layers declare for their variables.

A layer declares `variable_path_to_optimizer_map` (`{variable.path:
updater}`). An optimizer is only handed variables, not layers, so
`DispatchOptimizer.build` looks the declaring layers up among live Keras
layers and keeps the entries whose variable (by identity, not just path) is
one it was asked to build for.
"""

import gc

import keras


def declared_updaters(variables):
    """Returns `{id(variable): (updater, layer_name)}` for declared variables.

    Args:
        variables: the variables an optimizer is being built for.
    """
    wanted = {id(v) for v in variables}
    found = {}
    for obj in gc.get_objects():
        if not (isinstance(obj, keras.layers.Layer)
                and hasattr(type(obj), "variable_path_to_optimizer_map")
                and obj.built):
            continue
        declared = obj.variable_path_to_optimizer_map or {}
        by_path = {v.path: v for v in obj.variables}
        for path, updater in declared.items():
            if path not in by_path:
                raise ValueError(
                    f"Layer '{obj.name}' declares an updater for '{path}' in "
                    "`variable_path_to_optimizer_map`, but it has no variable with "
                    f"that path. Its variables are: {sorted(by_path)}."
                )
            var = by_path[path]
            if id(var) in wanted:
                found[id(var)] = (updater, obj.name)
    return found
