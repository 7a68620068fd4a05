"""Sparse row updaters: the rules that train embedding tables in place."""

from sparseopt.updaters.adagrad import Adagrad
from sparseopt.updaters.base import SlotSpec, Updater
from sparseopt.updaters.ftrl import Ftrl
from sparseopt.updaters.keras_conversion import (
    from_keras_optimizer, from_sparsecore_spec, to_keras_optimizer, to_sparsecore_spec)
from sparseopt.updaters.rowwise_adagrad import RowwiseAdagrad
from sparseopt.updaters.sgd import SGD

__all__ = ["Adagrad", "Ftrl", "RowwiseAdagrad", "SGD", "SlotSpec", "Updater",
           "from_keras_optimizer", "from_sparsecore_spec", "to_keras_optimizer",
           "to_sparsecore_spec"]
