"""Rules written for sparseopt 0.2's signatures, still run (with a warning).

Rules now get the step's hyperparameters as an argument, `hp`
(`sparseopt.updaters.core.hyperparameters.Values`): `update(rows, state, grads, hp)`,
`contributions(rows, state, grads, hp)`, `update_whole(state, sums, num_rows,
hp)`, `missed_steps(rows, state, steps, decay, hp)`. A user's rule written
the older way, `update(rows, state, grads, learning_rate, step)` reading
`self.value(name, step)` (and `step` / `learning_rate` as the last argument of
the others), is adapted when its class is defined: each call passes it the
older arguments and a view of the updater whose `value(name, step)` returns
this step's values (`Bound`), so it reads what a rule written today reads,
never a stale constant. Its class gets one `DeprecationWarning`.
"""

import functools
import inspect
import types
import warnings

# method -> (parameters after `self` in today's signature, the older last parameter)
METHODS = {"update": (4, "step"), "contributions": (4, "step"),
           "update_whole": (4, "step"), "missed_steps": (5, "learning_rate")}


def adapt(cls):
    """Wraps the rule methods `cls` itself defines in the older signatures."""
    older = [name for name in METHODS if name in cls.__dict__ and _older(cls.__dict__[name], name)]
    for name in older:
        setattr(cls, name, _adapted(cls.__dict__[name], name))
    if older:
        warnings.warn(
            f"{cls.__qualname__}: {older} use sparseopt 0.2's signatures. Rules now take the "
            "step's hyperparameters as their last argument, `hp` (`update(self, rows, state, "
            "grads, hp)`, reading `hp.learning_rate`, `hp.step`, `hp.<name>`); the older "
            "form still runs.", DeprecationWarning, stacklevel=3)


def _older(fn, name):
    if not callable(fn) or getattr(fn, "_sparseopt_adapted", False):
        return False
    params = list(inspect.signature(fn).parameters)[1:]
    count, last = METHODS[name]
    if name == "update":
        return len(params) == count + 1  # (rows, state, grads, learning_rate, step)
    return len(params) == count and params[-1] == last


def _adapted(fn, name):
    @functools.wraps(fn)
    def call(self, *args):
        *given, hp = args
        view = Bound(self, hp)
        if name == "update":
            return fn(view, *given, hp.learning_rate, hp.step)
        if name == "missed_steps":
            return fn(view, *given, hp.learning_rate)
        return fn(view, *given, hp.step)

    call._sparseopt_adapted = True
    return call


class Bound:
    """An updater as an older rule sees it during a step: `value(name, step)` reads the
    step's values `hp`; every other attribute is the updater's (its methods run on
    this view too, so they read the same values).

    Args:
        updater: the `Updater`.
        hp: the step's `Values`.
    """

    def __init__(self, updater, hp):
        object.__setattr__(self, "_updater", updater)
        object.__setattr__(self, "_hp", hp)

    def value(self, name, step):
        if name in self._hp:
            return self._hp[name]
        return self._updater.value(name, step)

    def __getattr__(self, name):
        found = inspect.getattr_static(type(self._updater), name, None)
        if isinstance(found, types.FunctionType):
            return types.MethodType(found, self)
        return getattr(self._updater, name)
