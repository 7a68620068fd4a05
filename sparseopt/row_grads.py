"""The older name of `sparseopt.records` (the step's record: `RowGrads`, `Distinct`, `BagGrads`).

Kept so that code written against it still runs; it warns once. Import from
`sparseopt.records`.
"""

import warnings

from sparseopt.records import *  # noqa: F401,F403
from sparseopt.records import BagGrads, Distinct, RowGrads, Stacked  # noqa: F401

warnings.warn("sparseopt.row_grads is now sparseopt.records; import from there.",
              DeprecationWarning, stacklevel=2)
