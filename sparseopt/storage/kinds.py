"""The registry of row-storage kinds: which `RowStorage` class keeps a table's rows.

A kind is picked per table from what the table is: an int8 table (its
lookup has an `Int8Table`) is `"int8"`; any other table is the kind its
`TableStorage` names (`kind`, by default `"memory"`). A new kind is a
`RowStorage` subclass in its own module, registered here under a name; a
`TableStorage` subclass whose `kind` is that name selects it for a table
(tests/test_storage_kinds.py adds one this way).

The classes are imported on first use, so that this module (which the
updaters' package reaches through `TableStorage`) loads no backend.
"""

import importlib

# name -> "module:Class" (imported when first asked for) or the class itself.
_KINDS = {"memory": "sparseopt.storage.memory:InMemory",
          "int8": "sparseopt.storage.int8:Int8Rows",
          "disk": "sparseopt.storage.disk_rows:DiskRows"}


def register(name, cls):
    """Makes `cls` (a `sparseopt.storage.rows.RowStorage` subclass) the kind `name`.

    Args:
        name: what a `TableStorage.kind` says to select it.
        cls: the class; registering a name again replaces it.
    """
    _KINDS[name] = cls


def registered():
    """The names of every registered kind."""
    return sorted(_KINDS)


def kind_for(settings, int8=False):
    """The `RowStorage` class of a table.

    Args:
        settings: its `TableStorage`.
        int8: whether the table is an int8 table.

    Raises:
        ValueError: the settings name a kind nobody registered.
    """
    name = "int8" if int8 else getattr(settings, "kind", "memory")
    if name not in _KINDS:
        raise ValueError(f"TableStorage: no row storage of kind {name!r}; registered: "
                         f"{registered()}.")
    found = _KINDS[name]
    if isinstance(found, str):
        module, cls = found.split(":")
        found = _KINDS[name] = getattr(importlib.import_module(module), cls)
    return found
