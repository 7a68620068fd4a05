"""`python -m sparseopt.native`: compile the native kernels now (`make env` does).

The JAX kernels, the TensorFlow ops and the host library are built apart: either may fail (said
here, and the pure path runs) without the other. Each is a compiler run of its own, so they run
side by side (on the 2-core development machine, from an empty cache: 17-18 s, where one
after another took 26 s).
"""

import sys
from concurrent.futures import ThreadPoolExecutor

from sparseopt.native import build, build_host, build_tf

BUILDS = (("JAX kernels", build), ("TensorFlow ops", build_tf),
          ("host library (tables on disk)", build_host))

failed = False
with ThreadPoolExecutor(len(BUILDS)) as pool:
    started = [(name, pool.submit(make)) for name, make in BUILDS]
    for name, future in started:  # (said in this order, whichever ends first)
        try:
            print(f"{name}: {future.result()}")
        except Exception as e:  # noqa: BLE001 (each said, the pure path runs)
            print(f"{name}: not built ({type(e).__name__}: {e})", file=sys.stderr)
            failed = True
sys.exit(1 if failed else 0)
