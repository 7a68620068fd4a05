"""`lazy=False`: dense semantics at sparse cost, rows catch up on the steps they missed.

A dense optimizer moves rows that a batch did not touch: decoupled weight
decay shrinks every row every step, and momentum keeps moving a row after its
last gradient. A sparse step cannot touch every row, but for these rules the
steps a row missed have a closed form in their number `k`. With `lazy=False`
an updater keeps, per row, the last step it updated that row (int32,
4 bytes a row); when the row is next touched, it first applies its `k` missed
zero-gradient steps at once (`Updater.missed_steps`), then the step itself.
`DispatchOptimizer.catch_up_tables()` brings every row up to date (Keras
calls it at the end of `fit`, through `finalize_variable_values`).

The closed forms are exact for constant hyperparameters: `check` refuses
schedules of whatever the missed steps depend on, options that act on the
new rows (weight clips, `max_norm`: a dense optimizer would apply them at
every missed step) and L2 decay (its gradient is not zero on a missed step).

For one missed step of a momentum rule (decay factor `a`, momentum `b`, and
`c` the rule's weight on the old momentum):

    m <- b m
    w <- a w + c m_old

so after `k` steps `m_k = b^k m` and `w_k = a^k w + c m S_k` with
`S_k = sum_{j<k} a^(k-1-j) b^j`.
"""

from keras import ops

from sparseopt.updaters.core.slots import SlotSpec

LAST_STEP_SLOT = "last_step"
# The step that last updated each row (0: never): kept by `lazy=False` and by
# `ema_momentum` (`ema.py`), which never go together.
LAST_STEP = SlotSpec(LAST_STEP_SLOT, rowwise=True, initial_value=0, dtype="int32",
                     holds_step=True)
# (The moving average's slot, named here where earlier versions named it.)
EMA_OFFSET_SLOT = "ema_offset"


def power(base, steps):
    """`base ** steps` for a float or scalar-tensor `base` and int `steps` (a tensor)."""
    if isinstance(base, float) and base == 1.0:
        return ops.ones(ops.shape(steps), "float32")
    return ops.power(ops.convert_to_tensor(base, "float32"), ops.cast(steps, "float32"))


def _geometric(a, b, steps):
    """`sum_{j<k} a^(k-1-j) b^j` per row, stable when `a` and `b` are close.

    `a` and `b` are scalars (floats or tensors: the step's hyperparameters).
    """
    k = ops.cast(steps, "float32")
    a = ops.convert_to_tensor(a, "float32")
    lead = ops.exp((k - 1.0) * ops.log(a))  # a^(k-1)
    d = ops.convert_to_tensor(b, "float32") / a - 1.0
    exact = d == 0.0  # b == a: k equal terms
    safe = ops.where(exact, 1.0, d)
    terms = ops.where(exact, k, ops.expm1(k * ops.log1p(safe)) / safe)
    return ops.where(k > 0, lead * terms, 0.0)


def momentum_steps(rows, momentum, steps, a, b, c):
    """`steps` missed steps of a momentum rule (see the module docstring).

    Args:
        rows: `[U, D]`.
        momentum: `[U, D]` momentum before the missed steps.
        steps: int `[U]`.
        a: decay factor per step; `b`: momentum (not 0); `c`: the rule's
            weight on the old momentum (floats or scalar tensors).

    Returns:
        `(rows, momentum)` after the missed steps.
    """
    decayed = rows * power(a, steps)[:, None]
    return (decayed + c * _geometric(a, b, steps)[:, None] * momentum,
            momentum * power(b, steps)[:, None])


def decay_only(updater, rows, state, steps, decay, hp):
    """`Updater.missed_steps` of a rule that a zero gradient leaves alone.

    SGD without momentum, Adagrad, row-wise Adagrad: a missed step only
    decays the row; the state does not move.
    """
    return rows * power(decay, steps)[:, None], state


def decay_per_step(updater, hp):
    """The factor `1 - wd (* lr)` of decoupled weight decay per step, as the step reads it.

    A scalar tensor (1.0 without decay): `weight_decay` as the step's
    hyperparameters `hp` give it (0 for a table excluded from weight decay),
    times the step's learning rate unless
    `multiply_weight_decay_by_learning_rate=False`.
    """
    if "weight_decay" not in updater.options:
        return 1.0
    times_lr = updater.options.get("multiply_weight_decay_by_learning_rate", True)
    return 1.0 - hp.weight_decay * (hp.learning_rate if times_lr else 1.0)


def decay_factor(updater):
    """The per-step factor `1 - wd (* lr)` of the updater's own constants (1.0 without).

    A Python float, for `check`: the step reads `decay_per_step`.
    """
    wd = updater.options.get("weight_decay")
    if not wd:
        return 1.0
    times_lr = updater.options.get("multiply_weight_decay_by_learning_rate", True)
    return 1.0 - wd * (float(updater.learning_rate) if times_lr else 1.0)


def check(updater):
    """Refuses `lazy=False` where the catch-up would not be exact, naming the fix.

    Runs once the updater's `__init__` is done (its rule hyperparameters set).
    """
    owner = type(updater).__name__
    if type(updater).missed_steps is None:
        raise ValueError(
            f"{owner}(lazy=False): no exact catch-up for this rule (a row's state moves on "
            "steps without gradient in a way that has no closed form here). Use "
            "lazy=True (the default), or an updater with an exact one: SGD (with or "
            "without momentum), Adagrad, RowwiseAdagrad, AdagradMomentum, RMSprop.")
    options = updater.options
    for name in ("clip_weight_min", "clip_weight_max", "max_norm"):
        if name in options:
            raise ValueError(
                f"{owner}(lazy=False) with `{name}`: a dense optimizer would apply it at "
                "every missed step, which has no closed form. Remove it or use lazy=True.")
    if options.get("weight_decay_mode") == "l2":
        raise ValueError(
            f"{owner}(lazy=False) with weight_decay_mode='l2': L2 decay is a gradient, so a "
            "missed step is not a zero-gradient step. Use the decoupled mode (the default) "
            "or lazy=True.")
    schedules = [k for k, v in options.items() if not isinstance(v, (float, str, bool))]
    schedules += updater.scheduled
    if schedules:
        raise ValueError(
            f"{owner}(lazy=False) with schedules for {schedules}: the catch-up is exact for "
            "constant hyperparameters only. Use constants or lazy=True.")
    times_lr = "weight_decay" in options and options.get(
        "multiply_weight_decay_by_learning_rate", True)
    if not isinstance(updater.learning_rate, float) and (
            times_lr or type(updater).missed_steps_read_learning_rate):
        raise ValueError(
            f"{owner}(lazy=False) with a learning-rate schedule: the missed steps depend on "
            "the learning rate, and the catch-up is exact for a constant one only. Use a "
            "constant learning rate, multiply_weight_decay_by_learning_rate=False, or "
            "lazy=True.")
    if "weight_decay" in options:
        factor = decay_factor(updater)
        if not 0.0 < factor <= 1.0:
            raise ValueError(
                f"{owner}(lazy=False): the decay per step ({1 - factor:g}) must be below 1.")


def refuse_whole_state(updater):
    """Refuses a catch-up of a rule with whole-table state (its rows' missed steps would
    depend on every other row's); shared with `ema.py`."""
    whole = [spec.name for spec in updater.rule_slots if not spec.per_row]
    if whole and not updater.dense_in_rule:
        raise ValueError(
            f"{type(updater).__name__}: `lazy=False` and `ema_momentum` are not supported "
            f"with whole-table state {whole}: a row's missed steps would depend on every "
            "other row's. Use the default lazy=True without ema_momentum.")


def without(state, names):
    """`state` without the slots `names` (what the rule inside a wrapper reads)."""
    return {k: v for k, v in state.items() if k not in names}


class CatchUp:
    """`lazy=False`: each row keeps the step that last updated it (`last_step`); when
    touched, it first takes the steps it missed at once (`Updater.missed_steps`), then the
    step; the end of `fit` brings every row up to date."""

    slots = (LAST_STEP,)
    tracks_rows = True
    keeps_window = False

    def check(self, updater):
        refuse_whole_state(updater)
        check(updater)

    def around(self, updater, rule):
        """`rule` with each row's missed steps taken first: `(rows, state, grads, hp)`."""
        def step(rows, state, grads, hp):
            now = ops.cast(hp.step, "int32")
            last = state[LAST_STEP_SLOT]
            rows, own = self._missed(updater, rows, state, now - 1, hp)
            new_rows, new_state = rule(rows, own, grads, hp)
            return new_rows, {**new_state, LAST_STEP_SLOT: ops.full(ops.shape(last), now, "int32")}

        return step

    def caught_up(self, updater, rows, state, steps_done, hp):
        """`(rows, state)` of the whole table brought up to step `steps_done`.

        Args:
            rows: float32 `[V, D]`; `state`: every slot, as rules compute with it.
            steps_done: int, the optimizer's iteration count.
            hp: the last step's hyperparameters.
        """
        last = state[LAST_STEP_SLOT]
        rows, own = self._missed(updater, rows, state, ops.cast(steps_done, "int32"), hp)
        return rows, {**own, LAST_STEP_SLOT: ops.full(ops.shape(last), steps_done, "int32")}

    @staticmethod
    def _missed(updater, rows, state, until, hp):
        """`(rows, state without last_step)` after each row's steps after its last one up
        to step `until` (the rule's `missed_steps`)."""
        missed = ops.maximum(until - state[LAST_STEP_SLOT], 0)
        return updater.missed_steps(rows, without(state, (LAST_STEP_SLOT,)), missed,
                                    decay_per_step(updater, hp), hp.at(None))

    def end_of_fit(self, updater, storage, steps_done, hp):
        """Every row caught up, written through the table's row storage."""
        catch_up_whole(self, updater, storage, steps_done, hp)


def catch_up_whole(wrapper, updater, storage, steps_done, hp):
    """Writes `wrapper.caught_up` of the whole table (rows and every slot) through `storage`
    (whole-table work, between steps), rounded as a step's writes are."""
    read = {s.name: storage.state_values(s.name) for s in updater.slots}
    rows, state = wrapper.caught_up(updater, storage.values(), read, steps_done, hp)
    storage.assign_values(rows, steps_done)
    for spec in updater.slots:
        # (A whole slot the catch-up passed through unchanged is not written again: it
        # is the table's, and storage working part by part has only a part's rows.)
        if spec.per_row or state[spec.name] is not read[spec.name]:
            storage.assign_state(spec.name, state[spec.name], steps_done)
