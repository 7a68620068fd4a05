"""Backend plumbing: the few operations that differ between JAX and TF.

The names each backend module provides, and what each does, are listed once
in `sparseopt.backend.contract.CONTRACT`. This package loads the module of
Keras' backend (`jax.py`, with `jax_rows.py` and `jax_sharding.py`, or
`tensorflow.py`), checks it against the contract and exposes exactly those
names: `backend.dedup(...)`, `backend.WORKSPACE`, and so on.
"""

import importlib

import keras

from sparseopt.backend.contract import CONTRACT

_NAME = keras.backend.backend()
if _NAME not in ("jax", "tensorflow"):
    raise ImportError(
        f"sparseopt supports the 'jax' and 'tensorflow' Keras backends; the "
        f"current backend is '{_NAME}'. Set KERAS_BACKEND."
    )


def check(module):
    """The names of `CONTRACT` that `module` lacks or leaves None (an empty list if none)."""
    return [name for name in CONTRACT if getattr(module, name, None) is None]


_module = importlib.import_module(f"sparseopt.backend.{_NAME}")
_missing = check(_module)
if _missing:
    raise ImportError(f"sparseopt.backend.{_NAME} does not provide {_missing} "
                      "(sparseopt.backend.contract).")
globals().update({name: getattr(_module, name) for name in CONTRACT})
