"""The older name of `sparseopt.optimizer.dispatch` (`DispatchOptimizer`, also
`sparseopt.DispatchOptimizer`). Kept so that code written against it still runs; it warns."""

import warnings

from sparseopt.optimizer.dispatch import DispatchOptimizer  # noqa: F401

warnings.warn("sparseopt.dispatch_optimizer is now sparseopt.optimizer.dispatch; use "
              "sparseopt.DispatchOptimizer.", DeprecationWarning, stacklevel=2)
