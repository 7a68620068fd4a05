"""The older name of `sparseopt.engine.trainer` (`TableTrainer`, `TableGroup`).

Kept so that code written against it still runs; it warns once. Import from
`sparseopt.engine.trainer` (or `sparseopt.TableTrainer`).
"""

import warnings

from sparseopt.engine.trainer import TableGroup, TableTrainer, group_trainers  # noqa: F401

warnings.warn("sparseopt.table_trainer is now sparseopt.engine.trainer; import from there.",
              DeprecationWarning, stacklevel=2)
