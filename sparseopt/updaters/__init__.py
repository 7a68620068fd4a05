"""Sparse row updaters: the rules that train embedding tables in place.

One module per rule here; the machinery they share in `core/` (the `Updater`
base class, hyperparameters, options, conversions) and what wraps a rule in
`wrappers/` (`lazy=False` catch-up, EMA, SWA, Lookahead). Every rule module of
this package is imported here, so that a new updater file is registered
(`registry()`) and covered by the registry-driven tests without editing any
list.
"""

import importlib
import pkgutil

from sparseopt.updaters.adafactor import Adafactor
from sparseopt.updaters.adagrad import Adagrad
from sparseopt.updaters.adagrad_momentum import AdagradMomentum
from sparseopt.updaters.adam import Adam
from sparseopt.updaters.adamax import Adamax
from sparseopt.updaters.core.base import SlotSpec, SparseCoreSpec, Updater, registry
from sparseopt.updaters.ftrl import Ftrl
from sparseopt.updaters.core.keras_conversion import (
    from_keras_optimizer, from_sparsecore_spec, to_keras_optimizer, to_sparsecore_spec)
from sparseopt.updaters.frequency_aware_adagrad import FrequencyAwareAdagrad
from sparseopt.updaters.lamb import Lamb
from sparseopt.updaters.laprop import LaProp
from sparseopt.updaters.lion import Lion
from sparseopt.updaters.nadam import Nadam
from sparseopt.updaters.partial_rowwise_adam import PartialRowwiseAdam
from sparseopt.updaters.rmsprop import RMSprop
from sparseopt.updaters.rowwise_adagrad import RowwiseAdagrad
from sparseopt.updaters.sgd import SGD

# (Their older paths, `sparseopt.updaters.catch_up` etc., still name them.)
from sparseopt.updaters.core import hyperparameters, transforms  # noqa: E402,F401
from sparseopt.updaters.wrappers import catch_up, lookahead, swa  # noqa: E402,F401

for _module in pkgutil.iter_modules(__path__):
    if not _module.ispkg:
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["Adafactor", "Adagrad", "AdagradMomentum", "Adam", "Adamax", "FrequencyAwareAdagrad", "Ftrl",
           "Lamb", "LaProp", "Lion", "Nadam", "PartialRowwiseAdam", "RMSprop",
           "RowwiseAdagrad", "SGD", "SlotSpec", "SparseCoreSpec", "Updater",
           "from_keras_optimizer", "from_sparsecore_spec", "registry", "to_keras_optimizer",
           "to_sparsecore_spec"]
