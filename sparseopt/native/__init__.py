"""Native CPU kernels for the generic part of a table's step (issue "Native CPU kernels").

What is native, as XLA FFI custom calls on JAX's CPU backend (each on by
default):

- `rows`: a step's row reads and writes of its tables and their state, any
  dtype (`rows.cc`): `jnp.take(mode="clip")` and `.at[].set(mode="drop")`
  byte for byte, the writes in place. XLA compiles each gather and scatter of
  each variable into a kernel of its own, for every table of a model: as one
  call compiled once, the compiled step is about half its size (a
  Criteo-shaped model's first step: docs/benchmarks.md, "The first step").
- `bf16_writes`: the row writes of bfloat16 arrays by the same call, where
  `rows` is off. XLA:CPU has no bfloat16 scatter, so the pure path copies a
  bfloat16 table (and bfloat16 state) every step; this writes the step's rows
  only (measured: a bfloat16 DLRM step 2.9x float32's -> 0.96x).
- `dedup`: the dedup and sum of a step's ids and row gradients, per id or per
  pooled bag (`dedup_sum.cc`, the algorithm in `dedup_core.h`). No faster
  than XLA's own dedup when it runs (both bound by the same random
  accesses; docs/benchmarks.md, "Native kernels"), but one call in place of
  a dozen kernels per table in the compiled step.
- `disk_number`: a table on disk's numbering of its step's ids (`number_ffi.cc`,
  the host library's code: `id_index.h`), compiled into the step where it was
  a Python host call (one crossing into Python a step fewer), with
  `disk_host` on (tests/test_disk_native.py).

as a TensorFlow op on CPU:

- `tf_dedup` (on by default): the same dedup and sum as one op on the
  workspace variable (`tf_ops.cc`), in place of the pure path's four to six
  ops, its outputs sized by the distinct ids (measured: 0.52-0.98x the pure
  step in 53 of 56 production cells, 1.02-1.12x in 3).
- `tf_disk_number` (on by default): `disk_number`'s numbering as an op
  (`tf_ops.cc`), where a `tf.numpy_function` host call did.

and, for tables on disk (`sparseopt.disk`) on either backend, as a C++ library
with a C interface, called from the host through ctypes:

- `disk_host` (on by default): the host's share of a step on disk
  (`disk_host.cc`): the batch's ids deduplicated and numbered, its rows found
  in the cache or read from the files, evicted rows written back, in one pass
  each where NumPy makes a dozen (measured: benchmarks/disk_tables.py,
  docs/benchmarks.md). Same results as the NumPy path
  (tests/test_disk_native.py).

Rules stay `keras.ops` functions; everything else runs the pure path.
Results equal the pure path's bit for bit (tests/test_native.py,
tests/test_native_tf.py).

How they are built: from source, with the system C++ compiler, against the
XLA FFI headers jaxlib ships (`jax.ffi.include_dir()`) or the headers and
library TensorFlow ships (`tf.sysconfig`). A wheel carries the JAX kernels
built (`prebuilt_path`, compiled by `setup.py`); otherwise, and for the
TensorFlow op always, on first use in a process (one logged line says so;
`make env` and `python -m sparseopt.native` build both ahead), into a
per-user cache (`$XDG_CACHE_HOME/sparseopt/native`, by default
`~/.cache/sparseopt/native`; `SPARSEOPT_NATIVE_DIR` to choose), keyed by the
sources, the flags and the JAX or TensorFlow version, never into the
installed package. A build that fails (no compiler, another OS) is logged
once and the pure path runs: an import never fails.

The switch: `SPARSEOPT_NATIVE=1` in the environment turns every kernel on,
`SPARSEOPT_NATIVE=0` every kernel off (unset: each kernel's default);
`set_enabled(True / False / None)` and `disabled()` do the same in a process
(for steps traced afterwards). On GPUs the pure path runs.
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
import tempfile

_LOG = logging.getLogger("sparseopt.native")
HERE = pathlib.Path(__file__).parent
SOURCES = ("dedup_sum.cc", "rows.cc", "number_ffi.cc")
HEADERS = ("dedup_core.h", "id_index.h")
TF_SOURCES = ("tf_ops.cc",)
HOST_SOURCES = ("disk_host.cc",)
# The host library's C functions (disk_host.cc): argument types, and whether each
# returns a count (int64) or nothing. Declared so that ctypes checks every call's
# arguments (their number, integers as 64 bits, typed pointers) instead of passing
# whatever it is given.
_I64, _P64, _P32 = ctypes.c_int64, ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int32)
_BYTES = ctypes.c_void_p  # uint8_t*, uint8_t** (arrays of row pointers), the cache struct
HOST_FUNCTIONS = {
    "so_unique": ((_P64, _I64, _I64, _P64, _P64, _P64, _P64, _P64, _I64), _I64),
    "so_find": ((_P64, _P64, _I64, _P64, _I64, _P64), _I64),
    "so_number": ((_P32, _I64, _I64, _P32, _P32, _P32), _I64),
    "so_gather": ((_BYTES, _I64, _P64, _I64, _BYTES), None),
    "so_unreserved": ((_P64, _I64, _I64, _I64, _BYTES, _P64), _I64),
    "so_cache_read": ((_BYTES, _P64, _I64, _BYTES, _P64), _I64),
    "so_cache_write": ((_BYTES, _P64, _I64, _BYTES, _P64), _I64),
    "so_cache_insert": ((_BYTES, _P64, _P64, _I64, _BYTES, _I64), _I64),
    "so_stage_flush": ((_BYTES,), _I64),
    "so_files_read": ((_BYTES, _P64, _P64, _I64, _BYTES, _P64), _I64),
    "so_uniform": ((_P64, _I64, _I64, ctypes.c_uint64, ctypes.c_double, ctypes.c_double,
                    ctypes.c_float, _BYTES), None),
    "so_cache_flush": ((_BYTES,), _I64),
}
# No FMA contraction: each product is rounded before it is added, as XLA's
# pure path computes it.
FLAGS = ("-O3", "-std=c++17", "-fPIC", "-shared", "-ffp-contract=off", "-w")
TARGETS = {"sparseopt_dedup_sum": "SparseoptDedupSum",
           "sparseopt_dedup_sum_bags": "SparseoptDedupSumBags",
           "sparseopt_take_rows": "SparseoptTakeRows",
           "sparseopt_put_rows": "SparseoptPutRows",
           "sparseopt_number_ids": "SparseoptNumberIds"}

# Each kernel's default (`SPARSEOPT_NATIVE` unset): on where it was measured faster.
DEFAULTS = {"bf16_writes": True, "dedup": True, "tf_dedup": True, "rows": True,
            "disk_host": True, "disk_number": True, "tf_disk_number": True}
# Each kernel's framework (its library); the others are JAX's.
FRAMEWORK = {"tf_dedup": "tensorflow", "tf_disk_number": "tensorflow", "disk_host": "host"}
_FORCED = {"1": True, "0": False}

_state = {"enabled": _FORCED.get(os.environ.get("SPARSEOPT_NATIVE", "")),
          "jax": {"library": None, "tried": False, "error": None},
          "tensorflow": {"library": None, "tried": False, "error": None},
          "host": {"library": None, "tried": False, "error": None}}


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
    """Whether steps traced now use native kernel `kernel` (`"bf16_writes"`, `"dedup"`,
    `"rows"` or `"disk_number"` (a table on disk's step ids numbered by an FFI call) on
    JAX, `"tf_dedup"` or `"tf_disk_number"` (the same numbering as an op) on TensorFlow,
    `"disk_host"` for tables on disk on either):
    switched on (or on by default), built and loaded; never while Keras exports a model
    (`model.export`): a SavedModel serves without sparseopt, so it holds no call into
    its kernels (and JAX's export refuses custom calls it does not know)."""
    from sparseopt import compat  # (here: compat imports Keras)

    # (The host library of tables on disk is called on every step, never in an
    # export, which reads its rows from a variable: no stack walk for it.)
    if kernel != "disk_host" and compat.exporting() is not None:
        return False
    flag = _state["enabled"]
    on = DEFAULTS[kernel] if flag is None else flag
    return on and available(FRAMEWORK.get(kernel, "jax"))


def available(framework="jax"):
    """Whether the kernels for `framework` (`"jax"`, `"tensorflow"` or `"host"`) are
    built and loaded here (switched on or not)."""
    return _LOADERS[framework]() is not None


def build_error(framework="jax"):
    """Why the kernels for `framework` are not available (a string), or None."""
    _LOADERS[framework]()
    return _state[framework]["error"]


def host_library():
    """The loaded host library (`disk_host.cc`, a ctypes `CDLL`), or None."""
    return _load_host()


def tf_ops():
    """The loaded TensorFlow op library (`tf_ops.cc`), or None."""
    return _load_tf()


def _key(sources, version, flags):
    digest = hashlib.sha256()
    for name in sources + HEADERS:
        digest.update((HERE / name).read_bytes())
    digest.update(" ".join(flags).encode())
    digest.update(version.encode())
    digest.update(sys.platform.encode())
    return digest.hexdigest()[:16]


def _target_dir():
    """Where compiled kernels live: `SPARSEOPT_NATIVE_DIR`, else a per-user cache.

    Never the package's own folder: an installed package may be read-only,
    shared by users, or replaced by the next install. The file names are
    keyed by the sources, flags, platform and JAX or TensorFlow version
    (`_key`), so one cache serves every version side by side. Where the
    cache cannot be written (a read-only or missing home), a private folder
    of this user's in the temporary directory (mode 0700, owned by this
    user: a shared directory must not let another user plant a library).
    """
    given = os.environ.get("SPARSEOPT_NATIVE_DIR")
    if given:
        return pathlib.Path(given)
    candidates = []
    try:
        home_cache = pathlib.Path.home() / ".cache"
    except (KeyError, RuntimeError):  # no home (a container's uid without an entry)
        home_cache = None
    cache = os.environ.get("XDG_CACHE_HOME") or home_cache
    if cache is not None:
        candidates.append((pathlib.Path(cache) / "sparseopt" / "native", False))
    user = os.getuid() if hasattr(os, "getuid") else os.getlogin()
    candidates.append((pathlib.Path(tempfile.gettempdir()) / f"sparseopt-native-{user}", True))
    for folder, shared in candidates:
        if _writable(folder, private=shared):
            return folder
    raise RuntimeError(f"no writable folder for the compiled kernels (tried "
                       f"{[str(f) for f, _ in candidates]}); set SPARSEOPT_NATIVE_DIR")


def _writable(folder, private=False):
    """Whether files can be created in `folder` (made if missing), tried for real:
    `os.access` says yes to root on a read-only file system. `private`: the
    folder must also be this user's alone (in a directory others can write)."""
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700 if private else 0o777)
        if private:
            info = folder.stat()
            if (hasattr(os, "getuid") and info.st_uid != os.getuid()) or info.st_mode & 0o077:
                return False
        with tempfile.NamedTemporaryFile(dir=folder):
            return True
    except OSError:
        return False


def build():
    """Compiles the JAX kernels into the cache if needed; returns the library's path
    (raises on failure). The loader tries the package's own build first
    (`prebuilt_path`), where the wheel has one."""
    import jax
    import jax.ffi

    return _compile("libsparseopt_kernels", SOURCES, f"JAX {jax.__version__}",
                    [f"-I{jax.ffi.include_dir()}"])


def prebuilt_path():
    """Where the wheel's own build of the JAX kernels sits in the package.

    Built when the wheel is built (`build_prebuilt`, called by `setup.py`),
    against the XLA FFI headers of the build's jaxlib: XLA's FFI is a stable
    C ABI, so one build serves every jaxlib in the supported range. Keyed by
    the sources and flags only.
    """
    return HERE / "prebuilt" / f"libsparseopt_kernels_{_key(SOURCES, 'prebuilt', FLAGS)}.so"


def build_prebuilt(package_dir, include_dir):
    """Compiles the JAX kernels into a package being built (`setup.py`'s step).

    Args:
        package_dir: the built package's `sparseopt/native` folder.
        include_dir: jaxlib's C headers (`<jaxlib>/include`).

    Returns:
        The library's path (raises on failure).
    """
    path = pathlib.Path(package_dir) / "prebuilt" / prebuilt_path().name
    path.parent.mkdir(parents=True, exist_ok=True)
    return _compile_to(path, SOURCES, [f"-I{include_dir}"])


def build_tf():
    """Compiles the TensorFlow ops if needed; returns the library's path (raises on
    failure)."""
    import tensorflow as tf

    # TensorFlow's own include path, ABI and link flags.
    flags = list(tf.sysconfig.get_compile_flags()) + list(tf.sysconfig.get_link_flags())
    return _compile("libsparseopt_tf_ops", TF_SOURCES, f"TensorFlow {tf.__version__}", flags)


def build_host():
    """Compiles the host library for tables on disk if needed; returns its path (raises
    on failure). Plain C++, no framework headers."""
    return _compile("libsparseopt_disk_host", HOST_SOURCES, "host", [])


def _compile(stem, sources, version, extra):
    target = _target_dir()
    target.mkdir(parents=True, exist_ok=True)
    path = target / f"{stem}_{_key(sources, version, FLAGS + tuple(extra))}.so"
    if path.exists():
        return path
    # Once per version of the framework: say what the wait is (a few seconds).
    _LOG.warning("sparseopt: compiling its native CPU kernels for %s into %s (once per "
                 "version, a few seconds; SPARSEOPT_NATIVE=0 runs the pure path instead)",
                 version, target)
    return _compile_to(path, sources, extra)


def _compile_to(path, sources, extra):
    """Compiles `sources` into the library `path` (atomically); returns `path`."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++ or c++) on PATH")
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    # Sources before the link flags: the linker resolves left to right.
    command = [compiler, *FLAGS, *(str(HERE / s) for s in sources), *extra, "-o", str(partial)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    os.replace(partial, path)  # atomic: concurrent builders never load a partial file
    return path


def _load_jax():
    """The loaded JAX library with its FFI targets registered (once), or None."""
    def load():
        import jax
        import jax.ffi

        library = None
        if prebuilt_path().exists():  # (the wheel's own build, see `prebuilt_path`)
            try:
                library = ctypes.cdll.LoadLibrary(str(prebuilt_path()))
            except OSError as e:
                _LOG.info("sparseopt: the package's JAX kernels do not load here (%s)", e)
        if library is None:
            library = ctypes.cdll.LoadLibrary(str(build()))
        for name, symbol in TARGETS.items():
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(library, symbol)),
                                        platform="cpu")
        return library

    return _load_once(_state["jax"], load, "kernels")


def _load_tf():
    """The loaded TensorFlow op library (once), or None."""
    def load():
        import tensorflow as tf

        return tf.load_op_library(str(build_tf()))

    return _load_once(_state["tensorflow"], load, "TensorFlow ops")


def _load_host():
    """The loaded host library (once), or None."""
    def load():
        library = ctypes.cdll.LoadLibrary(str(build_host()))
        for name, (arguments, result) in HOST_FUNCTIONS.items():
            function = getattr(library, name)
            function.argtypes, function.restype = arguments, result
        return library

    return _load_once(_state["host"], load, "host library")


def _load_once(state, load, what):
    """`load()`'s library, tried once per process (`state` keeps it or why not)."""
    if state["tried"]:
        return state["library"]
    state["tried"] = True
    try:
        if not sys.platform.startswith("linux"):
            raise RuntimeError(f"built on Linux only, not {sys.platform}")
        state["library"] = load()
    except Exception as e:  # noqa: BLE001 (any failure: the pure path, said once)
        state["error"] = f"{type(e).__name__}: {e}"
        _LOG.warning("sparseopt: native %s unavailable, using the pure path (%s)", what,
                     state["error"])
    return state["library"]


_LOADERS = {"jax": _load_jax, "tensorflow": _load_tf, "host": _load_host}
