"""Module paths the docs named before the step engine moved keep working, with a warning."""

import importlib
import sys
import warnings

import pytest

pytestmark = pytest.mark.backend_independent


@pytest.mark.parametrize("old,new,names", [
    ("sparseopt.row_grads", "sparseopt.records", ["RowGrads", "Distinct", "BagGrads"]),
    ("sparseopt.table_trainer", "sparseopt.engine.trainer", ["TableTrainer"]),
    ("sparseopt.table_trainer", "sparseopt.engine.group", ["TableGroup"]),
    ("sparseopt.dispatch_optimizer", "sparseopt.optimizer.dispatch", ["DispatchOptimizer"]),
])
def test_an_old_module_path_gives_the_same_objects_and_says_where_they_went(old, new, names):
    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    assert any(issubclass(w.category, DeprecationWarning) and new in str(w.message)
               for w in caught)
    target = importlib.import_module(new)
    for name in names:
        assert getattr(module, name) is getattr(target, name)
