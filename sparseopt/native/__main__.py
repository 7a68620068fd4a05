"""`python -m sparseopt.native`: compile the native kernels now (`make env` does)."""

from sparseopt.native import build

print(build())
