"""Hyperparameters as state: what a table's step reads, and what may change after build.

Every float an updater's step reads (its learning rate, each rule parameter
set with `Updater.hyperparameter`, each numeric option such as
`weight_decay`) is a hyperparameter. Once the optimizer is built, a constant
one lives in a scalar optimizer variable of each table the updater trains
(`TableTrainer.hyperparameters`): the traced step reads the variable, so
`updater.beta_1 = 0.8` after compile takes effect at the next step with no
retrace, and checkpoints save and restore it, like the learning-rate
variable of a Keras optimizer. A schedule stays a function of the step (it
has no variable; a callback changes it by changing the schedule's own
state, as in Keras).

A value that decides the shape of the step is fixed once built: a rule that
branches on it in Python (SGD's `momentum=0` has no momentum slot and runs
TF's plain scatter; FTRL's `learning_rate_power=-0.5` takes a square root),
or an option that was off (no transform to feed). Setting it after build is
an error that names the table and the fix.

A step's values reach its rule as an argument, `Values` (`hp`): the trainer
evaluates every hyperparameter once per step (variables, schedules, the
learning rate that follows the dense one) and hands them to the rule, its
options and its wrappers (`update(rows, state, grads, hp)`, `hp.epsilon`). A
rule reads nothing else: there is no context it could forget to set and so
read a stale constant.
"""

import collections.abc
import dataclasses
import numbers

import keras

_Schedule = keras.optimizers.schedules.LearningRateSchedule


@dataclasses.dataclass(frozen=True)
class Spec:
    """How one hyperparameter is checked and whether it may change once built.

    Args:
        check: predicate a constant value must satisfy (None: any number).
        rule: what `check` requires, for messages.
        fixed: `True` if the value is fixed once built; or a function of a
            value that the step's shape depends on (e.g. `lambda v: v == 0`
            for a momentum whose 0 means "no momentum slot"): the value may
            then change to any value of which it gives the same result.
        schedule: whether a `LearningRateSchedule` is allowed.
        state: whether the step reads it (then, constant and not `fixed`,
            it lives in a variable once built). False for a value that only
            sets up the state (an accumulator's initial value): fixed once
            built, never read by the step.
    """

    check: object = None
    rule: str = ""
    fixed: object = False
    schedule: bool = True
    state: bool = True

    def checked(self, owner, name, value):
        """`value` as stored: a float, or a schedule; raises naming `owner` otherwise."""
        if isinstance(value, _Schedule):
            if not self.schedule:
                raise TypeError(f"{owner}: `{name}` must be a float, got a schedule "
                                f"{value!r}.")
            return value
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            kinds = "a float or a LearningRateSchedule" if self.schedule else "a float"
            raise TypeError(f"{owner}: `{name}` must be {kinds}, got {value!r}.")
        if self.check is not None and not self.check(value):
            raise ValueError(f"{owner}: `{name}` must be {self.rule}, got {value!r}.")
        return float(value)

    def may_change(self, built, value):
        """Whether a hyperparameter built with `built` may take `value` afterwards."""
        if isinstance(built, _Schedule) or isinstance(value, _Schedule):
            return False  # a schedule is part of the traced step; a constant is a variable
        if callable(self.fixed):
            return self.fixed(built) == self.fixed(value)
        return not self.fixed

    def is_state(self, value):
        """Whether a hyperparameter with this `value` lives in a variable once built."""
        return self.state and not isinstance(value, _Schedule) and self.fixed is not True


class Values(collections.abc.Mapping):
    """The hyperparameters of one table's step, as its rule reads them: `hp`.

    `hp.epsilon` (or `hp["epsilon"]`): a float32 scalar, this step's value
    (a variable's, or a schedule's at the step); `hp.learning_rate`; and
    `hp.step`, the 1-based update count (an int scalar), or None where a rule
    is asked for the steps a row missed (`Updater.missed_steps`).

    Args:
        values: `{name: scalar}`, every hyperparameter of the updater.
        step: the step's 1-based update count, or None.
    """

    def __init__(self, values, step=None):
        self._values = dict(values)
        self.step = step

    def __getitem__(self, name):
        return self._values[name]

    def __iter__(self):
        return iter(self._values)

    def __len__(self):
        return len(self._values)

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(
                f"this step has no hyperparameter `{name}`; it has {sorted(self._values)} "
                "(declare it with `Updater.hyperparameter`)") from None

    def at(self, step):
        """The same values for another `step` (None: steps a row missed)."""
        return Values(self._values, step)
