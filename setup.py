"""Build step of the wheel: the JAX kernels compiled with the package, where possible.

Everything else is in pyproject.toml. XLA's FFI is a stable C ABI, so the
kernels (sparseopt/native) are compiled once here, against the headers of
the jaxlib in the build environment (`[build-system] requires`), and ship in
the wheel: a user's first `fit` then compiles nothing for JAX. Where that
cannot be done (no C++ compiler, not Linux, no jaxlib), the wheel is built
without them and they are compiled on first use, as before. The TensorFlow
op needs the installed TensorFlow's headers: always built on first use. An
editable install (`make env`) builds nothing here (`make env` compiles both
into the per-user cache).
"""

import importlib.util
import os
import pathlib
import sys

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

HERE = pathlib.Path(__file__).parent


def _native_module():
    """sparseopt/native/__init__.py alone (the package imports Keras, absent here)."""
    spec = importlib.util.spec_from_file_location(
        "sparseopt_native_build", HERE / "sparseopt" / "native" / "__init__.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildWithKernels(build_py):
    """`build_py`, then the JAX kernels into the built package (skipped, said, if not)."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False) or not sys.platform.startswith("linux"):
            return
        try:
            import jaxlib

            include = os.path.join(os.path.dirname(jaxlib.__file__), "include")
            path = _native_module().build_prebuilt(
                os.path.join(self.build_lib, "sparseopt", "native"), include)
            print(f"sparseopt: JAX kernels built into the wheel: {path.name}")
        except Exception as e:  # noqa: BLE001 (then they are built on first use)
            print(f"sparseopt: JAX kernels not built into the wheel ({type(e).__name__}: "
                  f"{e}); they will be compiled on first use", file=sys.stderr)


class BinaryDistribution(Distribution):
    """A wheel for this platform: it may hold a compiled library."""

    def has_ext_modules(self):
        return sys.platform.startswith("linux")


setup(cmdclass={"build_py": BuildWithKernels}, distclass=BinaryDistribution)
