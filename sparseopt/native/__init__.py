"""Native CPU kernels for the generic part of a table's step (issue "Native CPU kernels").

What is native, as XLA FFI custom calls on JAX's CPU backend:

- `bf16_writes` (on by default): in-place row writes of bfloat16 arrays
  (`set_rows.cc`). XLA:CPU has no bfloat16 scatter, so the pure path copies a
  bfloat16 table (and bfloat16 state) every step; this writes the step's rows
  only (measured: a bfloat16 DLRM step 2.9x float32's -> 0.96x).
- `dedup` (off by default): the dedup and sum of a step's ids and row
  gradients, per id or per pooled bag (`dedup_sum.cc`). Measured no faster
  than XLA's own dedup yet (both bound by the same random accesses;
  docs/benchmarks.md, "Native kernels"): the seam the next kernels plug into.

Rules stay `keras.ops` functions; everything else runs the pure path.
Results equal the pure path's bit for bit (tests/test_native.py).

How it is built: from source, with the system C++ compiler, against the XLA
FFI headers jaxlib ships (`jax.ffi.include_dir()`), on first use in a
process (`make env` builds it at install), into `sparseopt/native/_build/`
(or `~/.cache/sparseopt/native` where the package is not writable), keyed by
the sources, the flags and the JAX version. A build that fails (no compiler,
another OS) is logged once and the pure path runs: an import never fails.

The switch: `SPARSEOPT_NATIVE=1` in the environment turns every kernel on,
`SPARSEOPT_NATIVE=0` every kernel off (unset: each kernel's default);
`set_enabled(True / False / None)` and `disabled()` do the same in a process
(for steps traced afterwards). On GPUs and TensorFlow the pure path runs.
"""

import contextlib
import ctypes
import hashlib
import logging
import os
import pathlib
import shutil
import subprocess
import sys

_LOG = logging.getLogger("sparseopt.native")
HERE = pathlib.Path(__file__).parent
SOURCES = ("dedup_sum.cc", "set_rows.cc")
# No FMA contraction: each product is rounded before it is added, as XLA's
# pure path computes it.
FLAGS = ("-O3", "-std=c++17", "-fPIC", "-shared", "-ffp-contract=off", "-w")
TARGETS = {"sparseopt_dedup_sum": "SparseoptDedupSum",
           "sparseopt_dedup_sum_bags": "SparseoptDedupSumBags",
           "sparseopt_set_rows_bf16": "SparseoptSetRowsBf16"}

# Each kernel's default (`SPARSEOPT_NATIVE` unset): on where it was measured faster.
DEFAULTS = {"bf16_writes": True, "dedup": False}
_FORCED = {"1": True, "0": False}

_state = {"enabled": _FORCED.get(os.environ.get("SPARSEOPT_NATIVE", "")), "library": None,
          "tried": False, "error": None}


def set_enabled(flag):
    """Every native kernel on (True) or off (False), or each at its default (None), for
    steps traced from now on."""
    _state["enabled"] = None if flag is None else bool(flag)


@contextlib.contextmanager
def disabled():
    """A context in which steps are traced with the pure path."""
    before = _state["enabled"]
    _state["enabled"] = False
    try:
        yield
    finally:
        _state["enabled"] = before


def enabled(kernel):
    """Whether JAX steps traced now use native kernel `kernel` (`"bf16_writes"` or
    `"dedup"`): switched on (or on by default), built and loaded."""
    flag = _state["enabled"]
    on = DEFAULTS[kernel] if flag is None else flag
    return on and _load_jax() is not None


def available():
    """Whether the kernels are built and loaded here (switched on or not)."""
    return _load_jax() is not None


def build_error():
    """Why the kernels are not available (a string), or None."""
    _load_jax()
    return _state["error"]


def _key():
    import jax

    digest = hashlib.sha256()
    for name in SOURCES:
        digest.update((HERE / name).read_bytes())
    digest.update(" ".join(FLAGS).encode())
    digest.update(jax.__version__.encode())
    digest.update(sys.platform.encode())
    return digest.hexdigest()[:16]


def _target_dir():
    own = HERE / "_build"
    try:
        own.mkdir(exist_ok=True)
        if os.access(own, os.W_OK):
            return own
    except OSError:
        pass
    cache = pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache"))
    return cache / "sparseopt" / "native"


def build():
    """Compiles the kernels if needed; returns the library's path (raises on failure)."""
    import jax.ffi

    target = _target_dir()
    target.mkdir(parents=True, exist_ok=True)
    path = target / f"libsparseopt_kernels_{_key()}.so"
    if path.exists():
        return path
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++ or c++) on PATH")
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    command = [compiler, *FLAGS, f"-I{jax.ffi.include_dir()}",
               *(str(HERE / s) for s in SOURCES), "-o", str(partial)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    os.replace(partial, path)  # atomic: concurrent builders never load a partial file
    return path


def _load_jax():
    """The loaded library with its FFI targets registered (once), or None."""
    if _state["tried"]:
        return _state["library"]
    _state["tried"] = True
    try:
        import jax
        import jax.ffi

        if not sys.platform.startswith("linux"):
            raise RuntimeError(f"built on Linux only, not {sys.platform}")
        library = ctypes.cdll.LoadLibrary(str(build()))
        for name, symbol in TARGETS.items():
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(library, symbol)),
                                        platform="cpu")
        _state["library"] = library
    except Exception as e:  # noqa: BLE001 (any failure: the pure path, said once)
        _state["error"] = f"{type(e).__name__}: {e}"
        _LOG.warning("sparseopt: native kernels unavailable, using the pure path (%s)",
                     _state["error"])
    return _state["library"]

