"""The older name of `sparseopt.engine.trainer` (`TableTrainer`) and `sparseopt.engine.group`
(`TableGroup`).

Kept so that code written against it still runs; it warns once. Import from those
(or `sparseopt.TableTrainer`).
"""

import warnings

from sparseopt.engine.group import TableGroup, group_trainers  # noqa: F401
from sparseopt.engine.trainer import TableTrainer  # noqa: F401

warnings.warn("sparseopt.table_trainer is now sparseopt.engine.trainer and sparseopt.engine.group; "
              "import from there.",
              DeprecationWarning, stacklevel=2)
