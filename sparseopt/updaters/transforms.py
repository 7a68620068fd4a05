"""Options shared by every rule, written once and composed around any rule.

After optax's `chain`: each option is a small pure transform of the touched
rows, applied before the rule (to the summed row gradients) or after it (to
the new rows). `Updater` builds the chain from its keyword options, so a rule
file never handles an option itself, and every registered rule supports every
option (the registry-driven tests check each against the NumPy reference).

Transforms see only the rows touched in the step: what they do to a row
happens when that row is updated, never to untouched rows.
"""

from keras import ops


class RowTransform:
    """One option: pure functions of the touched rows. Subclasses override one or both."""

    def before_rule(self, rows, grads, learning_rate, step):
        """Returns the summed row gradients the rule sees (`[U, D]`)."""
        return grads

    def after_rule(self, rows, new_rows, learning_rate, step):
        """Returns the rows written back, given the rule's `new_rows` (`[U, D]`)."""
        return new_rows


class ClipValue(RowTransform):
    """Clips each entry of a row's summed gradient to `[-limit, limit]`.

    The summed gradient is what a dense optimizer sees for that row, so this is
    `keras.optimizers.Optimizer(clipvalue=limit)` for a table.

    Args:
        limit: `> 0`.
    """

    def __init__(self, limit):
        self.limit = float(limit)

    def before_rule(self, rows, grads, learning_rate, step):
        return ops.clip(grads, -self.limit, self.limit)


# Keyword options every updater takes -> (transform class, check, rule).
OPTIONS = {
    "clipvalue": (ClipValue, lambda v: v > 0, "> 0"),
}


def transforms_from(owner, options):
    """The transforms for `options` (`{name: value or None}`), checked.

    Args:
        owner: the updater's class name, for messages.
        options: keyword options given to the updater.
    """
    out = []
    for name, value in options.items():
        if name not in OPTIONS:
            raise TypeError(f"{owner}: unknown option `{name}`; options are {sorted(OPTIONS)}.")
        if value is None:
            continue
        make, check, rule = OPTIONS[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not check(value):
            raise ValueError(f"{owner}: `{name}` must be a number {rule}, got {value!r}.")
        out.append(make(value))
    return tuple(out)


def chain(transforms, rule, rows, state, grads, learning_rate, step):
    """Applies `rule` with `transforms` around it (before: in order; after: reversed)."""
    for t in transforms:
        grads = t.before_rule(rows, grads, learning_rate, step)
    new_rows, new_state = rule(rows, state, grads, learning_rate, step)
    for t in reversed(transforms):
        new_rows = t.after_rule(rows, new_rows, learning_rate, step)
    return new_rows, new_state
