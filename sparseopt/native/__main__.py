"""`python -m sparseopt.native`: compile the native kernels now (`make env` does).

The JAX kernels, the TensorFlow ops and the host library are built apart: either may fail (said
here, and the pure path runs) without the other.
"""

import sys

from sparseopt.native import build, build_host, build_tf

failed = False
for name, make in (("JAX kernels", build), ("TensorFlow ops", build_tf),
                     ("host library (tables on disk)", build_host)):
    try:
        print(f"{name}: {make()}")
    except Exception as e:  # noqa: BLE001 (each said, the pure path runs)
        print(f"{name}: not built ({type(e).__name__}: {e})", file=sys.stderr)
        failed = True
sys.exit(1 if failed else 0)
