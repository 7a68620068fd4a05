"""Options shared by every rule, written once and composed around any rule.

After optax's `chain`: each option is a small pure transform of the touched
rows, applied before the rule (to the rows and their summed gradients) or
after it (to the new rows). `Updater` builds the chain from its keyword
options, so a rule file never handles an option itself, and every registered
rule supports every option (the registry-driven tests check each against the
NumPy reference).

The chain runs in one fixed order, whatever order the options are given in:

    1. weight_decay, mode "l2":        g <- g + wd * w        (wd times lr if asked)
    2. clipvalue:                       g <- clip(g, -c, c)
    3. clipnorm:                        g <- g * min(1, c / ||g||)   (per row)
    4. weight_decay, mode "decoupled":  w <- w - wd * w       (wd times lr by default)
    5. the rule
    6. clip_weight_min / max:           w <- clip(w, min, max)
    7. max_norm:                        w <- w * min(1, c / ||w||)   (per row)

L2 decay is part of the gradient, so clipping sees it (as it sees a Keras
regularizer's gradient); decoupled decay is applied to the rows before the
rule, as `keras.optimizers.Optimizer(weight_decay=...)` does.

Transforms see only the rows touched in the step: what they do to a row
happens when that row is updated, never to untouched rows (decay included:
a row absent from a batch is not decayed in that step).

Every numeric option may be a `keras.optimizers.schedules.LearningRateSchedule`
(any schedule of the step), evaluated at the optimizer's step like the
learning rate.
"""

import dataclasses

import keras
from keras import ops

_Schedule = keras.optimizers.schedules.LearningRateSchedule


def value_at(value, step):
    """A numeric option at `step` (1-based): itself, or its schedule at `step - 1`."""
    if isinstance(value, _Schedule):
        return ops.cast(value(step - 1), "float32")
    return ops.convert_to_tensor(value, "float32")


def _row_norm(x):
    return ops.sqrt(ops.sum(ops.square(x), axis=-1, keepdims=True))


def _scale_to_norm(x, limit):
    """`x` with each row's norm brought down to `limit` where it exceeds it."""
    norm = _row_norm(x)
    return x * ops.where(norm > limit, limit / ops.maximum(norm, 1e-30), 1.0)


class RowTransform:
    """One option: pure functions of the touched rows. Subclasses override one or both."""

    def before_rule(self, rows, grads, hp):
        """Returns `(rows, grads)` as the rule sees them (each `[U, D]`); `hp`: the step's
        hyperparameters (`sparseopt.updaters.core.hyperparameters.Values`)."""
        return rows, grads

    def after_rule(self, rows, new_rows, hp):
        """Returns the rows written back, given the rule's `new_rows` (`[U, D]`)."""
        return new_rows


class ClipValue(RowTransform):
    """Clips each entry of a row's summed gradient to `[-limit, limit]`.

    The summed gradient is what a dense optimizer sees for that row, so this is
    `keras.optimizers.Optimizer(clipvalue=limit)` for a table.

    Reads `clipvalue` from the step's hyperparameters.
    """

    def before_rule(self, rows, grads, hp):
        return rows, ops.clip(grads, -hp.clipvalue, hp.clipvalue)


class ClipNorm(RowTransform):
    """Scales each row's summed gradient down to L2 norm `limit` where it is larger.

    Per row (FBGEMM's and TPU embedding's granularity), unlike Keras'
    `clipnorm`, which clips the norm of a variable's whole gradient. Reads
    `clipnorm`.
    """

    def before_rule(self, rows, grads, hp):
        return rows, _scale_to_norm(grads, hp.clipnorm)


class WeightDecay(RowTransform):
    """Weight decay of the touched rows.

    Reads `weight_decay`, the decay `wd` (`>= 0`).

    Args:
        mode: `"decoupled"`: `w <- w - wd * w` before the rule (Keras'
            `weight_decay`, AdamW); `"l2"`: `g <- g + wd * w` (an L2 penalty
            `wd / 2 * ||w||^2` on the touched rows, TPU embedding's
            `weight_decay_factor`).
        times_learning_rate: multiply `wd` by the learning rate. Default: yes
            for `"decoupled"` (as Keras), no for `"l2"` (a penalty's gradient).
    """

    def __init__(self, mode, times_learning_rate):
        self.mode = mode
        self.times_learning_rate = (mode == "decoupled" if times_learning_rate is None
                                    else times_learning_rate)

    def _amount(self, hp):
        return hp.weight_decay * hp.learning_rate if self.times_learning_rate else hp.weight_decay

    def before_rule(self, rows, grads, hp):
        amount = self._amount(hp)
        if self.mode == "l2":
            return rows, grads + amount * rows
        return rows - amount * rows, grads


class ClipWeight(RowTransform):
    """Clips each entry of the updated rows to `[low, high]` (whichever is set).

    Args:
        low, high: whether `clip_weight_min` / `clip_weight_max` are set.
    """

    def __init__(self, low, high):
        self.low, self.high = low, high

    def after_rule(self, rows, new_rows, hp):
        if self.low:
            new_rows = ops.maximum(new_rows, hp.clip_weight_min)
        if self.high:
            new_rows = ops.minimum(new_rows, hp.clip_weight_max)
        return new_rows


class MaxNorm(RowTransform):
    """Scales each updated row down to L2 norm `max_norm` where it is larger."""

    def after_rule(self, rows, new_rows, hp):
        return _scale_to_norm(new_rows, hp.max_norm)


@dataclasses.dataclass(frozen=True)
class Option:
    """One keyword option every updater takes.

    Args:
        kind: `"number"` (float or schedule), `"choice"` or `"bool"`.
        check: for numbers, a predicate on a constant value; for choices, the
            allowed values.
        rule: what `check` requires, for messages.
    """

    kind: str
    check: object = None
    rule: str = ""


OPTIONS = {
    "clipvalue": Option("number", lambda v: v > 0, "> 0"),
    "clipnorm": Option("number", lambda v: v > 0, "> 0"),
    "weight_decay": Option("number", lambda v: v >= 0, ">= 0"),
    "weight_decay_mode": Option("choice", ("decoupled", "l2")),  # decoupled when unset
    "multiply_weight_decay_by_learning_rate": Option("bool"),
    "clip_weight_min": Option("number", lambda v: True, ""),
    "clip_weight_max": Option("number", lambda v: True, ""),
    "max_norm": Option("number", lambda v: v > 0, "> 0"),
}


# Wrappers people ask for by another name: what to give instead.
REFUSED = {
    "swa": "stochastic weight averaging is the updater argument `swa_period` (with "
           "`swa_start`), exact at sparse cost",
    "lookahead": "Lookahead is the updater argument `lookahead_period` (with "
                 "`lookahead_step_size`), exact at sparse cost",
}


def check_options(owner, options):
    """`options` without the unset ones, checked; raises naming `owner` and the fix.

    Args:
        owner: the updater's class name, for messages.
        options: keyword options given to the updater (`{name: value or None}`).
    """
    out = {}
    for name, value in options.items():
        if name in REFUSED:
            raise ValueError(f"{owner}: `{name}` is not supported for tables: {REFUSED[name]}.")
        if name not in OPTIONS:
            raise TypeError(f"{owner}: unknown option `{name}`; options are {sorted(OPTIONS)}.")
        if value is None:
            continue
        option = OPTIONS[name]
        if option.kind == "number":
            if isinstance(value, _Schedule):
                out[name] = value
                continue
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not option.check(value)):
                rule = f"a number {option.rule}".rstrip()
                raise ValueError(f"{owner}: `{name}` must be {rule} or a "
                                 f"LearningRateSchedule, got {value!r}.")
            out[name] = float(value)
        elif option.kind == "choice":
            if value not in option.check:
                raise ValueError(f"{owner}: `{name}` must be one of {list(option.check)}, "
                                 f"got {value!r}.")
            out[name] = value
        else:
            if not isinstance(value, bool):
                raise ValueError(f"{owner}: `{name}` must be True or False, got {value!r}.")
            out[name] = value
    decay_settings = {"weight_decay_mode", "multiply_weight_decay_by_learning_rate"}
    if decay_settings & set(out) and "weight_decay" not in out:
        raise ValueError(f"{owner}: {sorted(decay_settings & set(out))} set without "
                         "`weight_decay`; set `weight_decay` or remove them.")
    low, high = out.get("clip_weight_min"), out.get("clip_weight_max")
    if isinstance(low, float) and isinstance(high, float) and low > high:
        raise ValueError(f"{owner}: `clip_weight_min` ({low}) is above `clip_weight_max` "
                         f"({high}).")
    return out


def transforms_from(options):
    """The transforms for checked `options` (from `check_options`), in the chain's order.

    Each reads its value from the step's hyperparameters (`hp`), so a value
    that changes (a variable of the step, or a schedule) reaches it.

    Args:
        options: the checked options.
    """
    out = []
    decay = None
    if "weight_decay" in options:
        decay = WeightDecay(options.get("weight_decay_mode", "decoupled"),
                            options.get("multiply_weight_decay_by_learning_rate"))
    if decay is not None and decay.mode == "l2":
        out.append(decay)
    if "clipvalue" in options:
        out.append(ClipValue())
    if "clipnorm" in options:
        out.append(ClipNorm())
    if decay is not None and decay.mode == "decoupled":
        out.append(decay)
    if "clip_weight_min" in options or "clip_weight_max" in options:
        out.append(ClipWeight("clip_weight_min" in options, "clip_weight_max" in options))
    if "max_norm" in options:
        out.append(MaxNorm())
    return tuple(out)


def before_rule(transforms, rows, grads, hp):
    """`(rows, grads)` as the rule sees them: after every transform's `before_rule`."""
    for t in transforms:
        rows, grads = t.before_rule(rows, grads, hp)
    return rows, grads


def chain(transforms, rule, rows, state, grads, hp):
    """Applies `rule(rows, state, grads, hp)` with `transforms` around it (before the rule,
    then after it, in order)."""
    rows, grads = before_rule(transforms, rows, grads, hp)
    new_rows, new_state = rule(rows, state, grads, hp)
    for t in transforms:
        new_rows = t.after_rule(rows, new_rows, hp)
    return new_rows, new_state
