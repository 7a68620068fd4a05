"""sparseopt: sparse, in-place optimizers for the embedding tables of Keras 3 models.

Layers declare which updater trains each table (`variable_path_to_optimizer_map`);
`DispatchOptimizer` wraps a standard Keras optimizer for everything else.
"""

from sparseopt import callbacks, distribution, layers, ops, saving, updaters, vocabulary
from sparseopt.optimizer.dispatch import DispatchOptimizer
from sparseopt.storage import TableStorage
from sparseopt.engine.trainer import TableTrainer

__version__ = "0.2.0"

__all__ = ["DispatchOptimizer", "TableStorage", "TableTrainer", "callbacks", "distribution",
           "layers", "ops", "saving", "updaters", "vocabulary"]
