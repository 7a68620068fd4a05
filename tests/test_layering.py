"""Which modules may import which: the rule package never reaches a backend."""

import ast
import pathlib

import pytest

pytestmark = pytest.mark.backend_independent

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "sparseopt"
BACKENDS = {"jax", "tensorflow", "sparseopt.backend"}


def _is_module(name):
    path = PACKAGE.parent / name.replace(".", "/")
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _module_level(tree):
    """The nodes that run when the module is imported (not inside functions)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        todo.extend(child for child in ast.iter_child_nodes(node)
                    if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))


def _imports(module):
    """The modules `module` (a dotted sparseopt name) imports when it is imported."""
    path = PACKAGE.parent / (module.replace(".", "/") + ".py")
    if not path.exists():
        path = PACKAGE.parent / module.replace(".", "/") / "__init__.py"
    out = set()
    for node in _module_level(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            # `from sparseopt import precision` imports the module sparseopt.precision.
            out.update(f"{node.module}.{alias.name}" for alias in node.names
                       if _is_module(f"{node.module}.{alias.name}"))
    return out


def _reaches(start):
    """Every module `start` imports, transitively through sparseopt's own modules."""
    seen, todo = set(), [start]
    while todo:
        for name in _imports(todo.pop()):
            if name not in seen:
                seen.add(name)
                if name.startswith("sparseopt.") and name not in BACKENDS and not any(
                        name.startswith(b + ".") for b in BACKENDS):
                    todo.append(name)
    return seen


def test_the_rule_package_imports_no_backend():
    rules = [f"sparseopt.updaters.{p.stem}" for p in (PACKAGE / "updaters").glob("*.py")
             if p.stem != "__init__"]
    assert len(rules) > 10
    for module in rules:
        reached = _reaches(module)
        hits = sorted(n for n in reached if n in BACKENDS or n.split(".")[0] in BACKENDS
                      or n.startswith("sparseopt.backend"))
        assert not hits, f"{module} imports {hits}"
    # The control: the machinery does reach a backend.
    assert "sparseopt.backend" in _reaches("sparseopt.engine.stages")


# The layers, lowest first: a module imports only from its own layer or below.
LAYERS = [
    ["sparseopt.records", "sparseopt.hashing", "sparseopt.halves", "sparseopt.compat",
     "sparseopt.durable"],
    ["sparseopt.native"],
    ["sparseopt.backend"],
    ["sparseopt.distribution"],
    ["sparseopt.storage", "sparseopt.disk"],
    ["sparseopt.vocabulary", "sparseopt.ops"],
    ["sparseopt.updaters.core.slots", "sparseopt.updaters.core.transforms",
     "sparseopt.updaters.core.hyperparameters", "sparseopt.updaters.core.legacy"],
    ["sparseopt.updaters.wrappers"],
    ["sparseopt.updaters.core"],  # (base, keras_conversion: they compose the wrappers)
    ["sparseopt.updaters"],  # (the rules)
    ["sparseopt.engine"],
    ["sparseopt.optimizer", "sparseopt.layers"],
    ["sparseopt.saving", "sparseopt.callbacks"],
    # The package and the older module names it keeps.
    ["sparseopt.dispatch_optimizer", "sparseopt.row_grads", "sparseopt.table_trainer",
     "sparseopt"],
]


def _modules():
    out = []
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        out.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


def _layer(module):
    """The index in `LAYERS` of the longest prefix naming `module`."""
    best = None
    for i, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and (
                    best is None or len(name) > len(best[1])):
                best = (i, name)
    assert best is not None, f"{module} is in no layer of LAYERS"
    return best[0]


def _all_imports(module):
    """The sparseopt modules `module` imports anywhere (functions too): a `from pkg import
    mod` names the submodule, not its package."""
    path = PACKAGE.parent / (module.replace(".", "/") + ".py")
    if not path.exists():
        path = PACKAGE.parent / module.replace(".", "/") / "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("sparseopt"))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sparseopt"):
            subs = [f"{node.module}.{a.name}" for a in node.names
                    if _is_module(f"{node.module}.{a.name}")]
            out.update(subs)
            if len(subs) < len(node.names):
                out.add(node.module)
    return out - {module}


def test_no_import_runs_back_up_a_layer_and_none_goes_round_in_a_circle():
    modules = _modules()
    graph = {m: _all_imports(m) & set(modules) for m in modules}
    upward = sorted(f"{m} -> {v}" for m, vs in graph.items() for v in vs
                    if _layer(v) > _layer(m))
    assert not upward, upward
    # A circle needs an import within a layer: look for one among all of them.
    done, stack = set(), []

    def visit(m):
        if m in stack:
            raise AssertionError(f"an import circle: {' -> '.join(stack[stack.index(m):] + [m])}")
        if m in done:
            return
        stack.append(m)
        for v in sorted(graph[m]):
            visit(v)
        stack.pop()
        done.add(m)

    for m in sorted(modules):
        visit(m)
    # The control: the layers are not all one.
    assert _layer("sparseopt.engine.stages") > _layer("sparseopt.backend.jax")
