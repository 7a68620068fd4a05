"""An updater's settings: its hyperparameters and options, and which may change once built.

`Settings` is the part of `Updater` that keeps every float the step reads
(`sparseopt.updaters.core.hyperparameters` says what they are) and every
option (`sparseopt.updaters.core.transforms`): it checks a value when it is
set, refuses a change the built step cannot take (naming the tables and the
fix), passes a change it can take to the tables' trainers (their variables),
and evaluates all of them for one step (`values_at`). Kept apart from the
rule machinery in `base.py` so either can be read alone.
"""

import weakref

from keras import ops

from sparseopt.updaters.core import hyperparameters
from sparseopt.updaters.core.transforms import (
    OPTIONS, check_options, transforms_from, value_at)


class Settings:
    """Mixin of `Updater`: its hyperparameters, options and the tables that read them.

    Expects `self._specs` (`{name: hyperparameters.Spec}`) and
    `self._trainers` (weak references) set first, and `_check_settings()`
    (the whole updater's checks) defined by the class it is mixed into.
    """

    def _set_options(self, options):
        """Checks `options` and makes their transforms (each reads its value by name)."""
        self.options = check_options(type(self).__name__, options)
        for name, option in OPTIONS.items():
            self._specs.pop(name, None)
            if option.kind == "number" and name in self.options:
                self._specs[name] = hyperparameters.Spec(option.check, option.rule)
        self.transforms = transforms_from(self.options)

    def hyperparameter(self, name, value, check=None, rule="", fixed=False, schedule=True,
                       state=True):
        """Sets the rule hyperparameter `name`: a float, or a schedule of the step.

        A schedule is any `keras.optimizers.schedules.LearningRateSchedule`,
        evaluated at the optimizer's iteration like the learning rate; the
        rule reads either as `hp.<name>` (its `hp` argument). Hyperparameters set
        this way are also the updater's config (`get_config`), and a constant
        one is state once the optimizer is built: set it then and the next
        step uses the new value (`sparseopt.updaters.core.hyperparameters`).

        Args:
            name: the attribute and config key.
            value: float or `LearningRateSchedule`.
            check: predicate a constant value must satisfy (schedules are
                checked by what they produce, not here).
            rule: what `check` requires, for messages.
            fixed: `True` if the rule reads the value in Python (a branch, a
                slot's existence), so it cannot change once built; or a
                predicate of the value when built (e.g. `lambda v: v == 0`).
            schedule: whether it may be a schedule.
            state: whether the step reads it. `state=False` is a value that
                only sets up the state (an accumulator's initial value, in
                `slots`): a float, checked and in the config like the others,
                fixed once built, never a variable.
        """
        if not state:
            fixed, schedule = True, False
        self._set_hyperparameter(name, value,
                                 hyperparameters.Spec(check, rule, fixed, schedule, state))
        self.__dict__.setdefault("_hyperparameters", []).append(name)

    def _set_hyperparameter(self, name, value, spec):
        self._specs[name] = spec
        object.__setattr__(self, name, spec.checked(type(self).__name__, name, value))

    @property
    def hyperparameters(self):
        """The names of every float the step reads: `learning_rate`, the rule's
        hyperparameters, the numeric options that are set."""
        return [n for n, spec in self._specs.items() if spec.state]

    def __getattr__(self, name):
        # Options read as attributes (`updater.clipvalue`, None when off), as a
        # Keras optimizer's do; they are kept in `options`.
        if name in OPTIONS:
            return self.__dict__.get("options", {}).get(name)
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def _store(self, name, value):
        if name in OPTIONS:
            self.options[name] = value
        else:
            object.__setattr__(self, name, value)

    def __setattr__(self, name, value):
        if name.startswith("_") or self.__dict__.get("_init_depth"):
            object.__setattr__(self, name, value)
            return
        tables = self.tables
        if name in OPTIONS:
            if tables and (name not in self._specs or value is None):
                raise self._fixed_error(name, tables, "it was off when the optimizer was "
                                        "built" if name not in self._specs else
                                        "it turns off a transform built into the step")
            if not tables:
                self._set_options({**self.options, name: value})
                return
        if name in self._specs:
            spec = self._specs[name]
            if not spec.state:
                why = "it sets up the state, which the slots were made with"
                if tables:
                    raise self._fixed_error(name, tables, why)
                raise ValueError(
                    f"{type(self).__name__}: `{name}` cannot change once the updater is made "
                    f"({why}); give it when making one: `{type(self).__name__}(..., "
                    f"{name}=...)`.")
            value = spec.checked(type(self).__name__, name, value)
            if tables and not spec.may_change(getattr(self, name), value):
                raise self._fixed_error(name, tables, f"the step was built for "
                                        f"{getattr(self, name)!r}; a schedule or a value "
                                        "that changes the step's shape cannot be swapped in")
            previous = getattr(self, name)
            self._store(name, value)
            try:
                self._check_settings()
            except Exception:
                self._store(name, previous)
                raise
            for trainer in self._live_trainers():
                trainer.set_hyperparameter(name, value)
            return
        if tables and name != "name":
            raise self._fixed_error(name, tables, "it decides the step's state and code")
        object.__setattr__(self, name, value)

    def _live_trainers(self):
        alive = [t for t in (ref() for ref in self.__dict__.get("_trainers", ())) if t is not None]
        self.__dict__["_trainers"] = [weakref.ref(t) for t in alive]
        return alive

    @property
    def tables(self):
        """The paths of the tables this updater trains in a built optimizer."""
        return sorted(t.name for t in self._live_trainers())

    def restore_hyperparameter(self, name, value):
        """Sets `name` to `value` read back from a trainer's variable (a checkpoint load)."""
        self._store(name, value)

    def bind(self, trainer):
        """Records that `trainer` (a built `TableTrainer`) reads this updater's values."""
        self._trainers.append(weakref.ref(trainer))

    def _fixed_error(self, name, tables, why):
        return ValueError(
            f"{type(self).__name__} '{self.name}': `{name}` cannot change once the optimizer "
            f"that trains {tables} is built ({why}). These can change: "
            f"{sorted(self.state_hyperparameters)}. To change `{name}`, make a new updater "
            "and compile the model again (the tables keep their values; the updater state "
            "starts afresh).")

    @property
    def state_hyperparameters(self):
        """The hyperparameters that live in variables once built: `{name: value}`."""
        return {n: getattr(self, n) for n, spec in self._specs.items()
                if spec.is_state(getattr(self, n))}

    @property
    def scheduled(self):
        """The names of the rule hyperparameters given as schedules."""
        return [n for n in self.__dict__.get("_hyperparameters", ())
                if not isinstance(getattr(self, n), float)]

    def value(self, name, step):
        """The updater's own hyperparameter `name` at `step` (1-based): a scalar tensor.

        Its constant, or its schedule at `step`. A table's step reads the
        trainer's values instead (its variables), which reach the rule as its
        `hp` argument.
        """
        return value_at(getattr(self, name), step)

    def values_at(self, step, variables=None):
        """`{name: scalar float32 tensor}`: every hyperparameter at `step` (1-based).

        Args:
            step: the 1-based update count (schedules are evaluated at `step - 1`).
            variables: `{name: Keras variable}` holding some of them (a trainer's).
        """
        variables = variables or {}
        return {n: (ops.cast(variables[n].value, "float32") if n in variables
                    else value_at(getattr(self, n), step)) for n in self.hyperparameters}

