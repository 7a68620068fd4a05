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
