"""The `Updater` base class: a sparse, row-wise update rule and its state.

An updater is data plus one pure function. It declares the state slots it
needs (full `[V, D]` or one scalar per row) and maps the touched rows of a
table, their state rows and their summed gradients to new rows and new state
rows. It never sees the whole table: the machinery around it (dedup, gather,
scatter in place) lives in `sparseopt.engine` and the backend modules.

Each updater class is also an entry of the rule table (`registry()`, after
FBGEMM's table of optimizers): it carries what it supports, namely its
slots, the TensorFlow kernel that computes exactly its rule (`tf_kernel`), its
Keras optimizer equivalent (`keras_optimizer`, `to_keras`, `from_keras`,
which keras-rs and SparseCore conversions go through), and the
hyperparameter sets the test suite runs it with (`test_configs`). Defining a
subclass registers it; the tests enumerate the registry.
"""

import functools

import keras

from sparseopt import storage
from sparseopt.updaters.core import hyperparameters, legacy
from sparseopt.updaters.core.slots import SlotSpec, SparseCoreSpec  # noqa: F401 (their home)
from sparseopt.updaters.wrappers import lookahead, swa
from sparseopt.updaters.wrappers.catch_up import CatchUp
from sparseopt.updaters.wrappers.ema import MovingAverage
from sparseopt.updaters.core.settings import Settings
from sparseopt.updaters.core.transforms import chain

_REGISTRY = {}
# How a table's values and state are stored (Updater's arguments) by default.
STORAGE_DEFAULTS = storage.DEFAULTS


def registry(shipped_only=False):
    """`{name: Updater class}` of every updater class defined so far.

    Args:
        shipped_only: only sparseopt's own (those in `sparseopt.updaters`),
            keyed by class name; else every subclass (users' too), keyed by
            module and name.
    """
    if shipped_only:
        return {c.__name__: c for k, c in _REGISTRY.items()
                if k.startswith("sparseopt.updaters.")}
    return dict(_REGISTRY)


class Updater(Settings):
    """Base class of sparse table updaters.

    Subclasses set `slots` and implement `update`, a pure function of the
    touched rows only. `learning_rate` is a float or a
    `keras.optimizers.schedules.LearningRateSchedule` evaluated at the
    optimizer's step count.

    Options every updater takes (`sparseopt.updaters.core.transforms`, which
    fixes their order), applied around the rule to the touched rows only:

    - `weight_decay` (with `weight_decay_mode="decoupled"` (default) or
      `"l2"`, and `multiply_weight_decay_by_learning_rate`, default True for
      decoupled, False for l2): decay of the touched rows.
    - `clipvalue`: clip each entry of a row's summed gradient to
      `[-clipvalue, clipvalue]` before the rule.
    - `clipnorm`: scale each row's summed gradient to L2 norm at most
      `clipnorm` (per row, not per table).
    - `clip_weight_min`, `clip_weight_max`: clip the updated rows' entries.
    - `max_norm`: scale each updated row to L2 norm at most `max_norm`.

    Numeric options, and every float hyperparameter a rule sets with
    `hyperparameter`, may be `LearningRateSchedule`s of the step. Once the
    optimizer is built, the constant ones are variables the step reads:
    setting one (`updater.beta_1 = 0.8`) takes effect at the next step
    (`sparseopt.updaters.core.hyperparameters`); settings that shape the step
    are fixed then, and setting one is an error naming the tables.

    Args:
        learning_rate: float or `LearningRateSchedule`.
        name: optional name, used in variable names and messages.
        lazy: `True` (default): a step changes the rows it touches only.
            `False`: rows catch up on the steps they missed (decoupled weight
            decay, momentum) when next touched, as a dense optimizer would
            have moved them (`sparseopt.updaters.wrappers.catch_up`).
        ema_momentum: `None` (default), or keep an exponential moving average
            of each row as Keras' `use_ema=True` does (`m` in `[0, 1)`), at
            sparse cost; at the end of `fit` the table takes its average.
        swa_period, swa_start: stochastic weight averaging (TF Addons' `SWA`:
            a snapshot after the update of every step `t` with
            `t - 1 >= swa_start` and `(t - 1 - swa_start) % swa_period == 0`),
            exact at sparse cost (`sparseopt.updaters.wrappers.swa`); at the end of
            `fit` the table takes the average. `None` (default): off.
        lookahead_period, lookahead_step_size: Lookahead (TF Addons'
            `Lookahead`: after the update of every step `t` with
            `t % lookahead_period == 0`, `slow <- slow + lookahead_step_size *
            (fast - slow)` and `fast <- slow`), exact at sparse cost: only
            the rows changed in the window are synced
            (`sparseopt.updaters.wrappers.lookahead`). The table always holds the
            fast weights. `None` (default): off; the step size defaults to 0.5.
        state_dtype, stochastic_rounding, rounding_seed: how the tables
            it trains store their state and write 16-bit values, for tables
            that do not say so themselves. They belong to the table: give
            them there (`SparseEmbedding(..., storage=sparseopt.TableStorage(
            ...))`, which documents them); here they are the older spelling,
            still honoured (configs and files of earlier versions load).
        follow_learning_rate: `True` (default): the table trains at
            `learning_rate` times the wrapped Keras optimizer's learning rate
            over the rate the user gave it (`DispatchOptimizer.learning_rate_scale`),
            so Keras' learning-rate
            callbacks reach it in proportion; `False`: at `learning_rate`.
        **options: the options above.
    """

    # True for a rule whose `lazy=False` form is its own (it keeps the state its
    # dense form needs, e.g. Adafactor's running sums; rows it does not touch
    # do not move), not the generic catch-up of missed steps
    # (`sparseopt.updaters.wrappers.catch_up`).
    dense_in_rule = False
    # The Keras optimizer class with the same rule (keras-rs TableConfig), if any.
    keras_optimizer = None
    # `{case name: constructor kwargs besides learning_rate}` the tests run.
    test_configs = {"default": {}}

    # Capabilities hold for the class that declares them only: a subclass may
    # change the rule, so it gets none it does not declare itself.
    _CAPABILITIES = ("keras_optimizer", "tf_kernel", "to_keras", "from_keras", "missed_steps",
                     "missed_steps_read_learning_rate", "sparsecore_spec")

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for name in cls._CAPABILITIES:
            if name not in cls.__dict__:
                setattr(cls, name, Updater.__dict__[name])
        legacy.adapt(cls)  # rules written for sparseopt 0.2's signatures
        _REGISTRY[f"{cls.__module__}.{cls.__qualname__}"] = cls
        # Every subclass, its own `__init__` or the one it inherits: settings
        # are checked once the outermost `__init__` returns.
        cls.__init__ = _checked_after(cls.__init__)

    def tf_kernel(self):
        """TF's fused sparse kernel computing exactly this rule: its name, or
        `(name, {argument: value})` with the kernel's fixed arguments; None if none.

        Known names: `"sgd"` (`ResourceScatterSub`), `"adagrad"`
        (`ResourceSparseApplyAdagradV2`), `"ftrl"` (`ResourceSparseApplyFtrl`;
        argument `multiply_linear_by_lr`), `"keras_momentum"`
        (`ResourceSparseApplyKerasMomentum`; argument `use_nesterov`).
        """
        return None

    def to_keras(self):
        """The Keras optimizer with this rule and hyperparameters.

        Raises:
            ValueError: where Keras has none (or not for these settings).
        """
        raise ValueError(
            f"sparseopt: {type(self).__name__} has no Keras optimizer equivalent (Keras "
            "and keras-rs TableConfig know SGD, Adagrad, Adam and FTRL); keep it on a "
            "sparseopt.layers.SparseEmbedding table."
        )

    @classmethod
    def from_keras(cls, learning_rate, config, where=""):
        """The updater for a `keras_optimizer` with this Keras `config`.

        Args:
            learning_rate: float or schedule, already converted.
            config: the Keras optimizer's `get_config()`.
            where: " for table '...'" or "", for messages.
        """
        raise NotImplementedError(cls.__name__)

    def __init__(self, learning_rate, name=None, lazy=True, ema_momentum=None,
                 state_dtype="float32", stochastic_rounding=True, rounding_seed=0,
                 follow_learning_rate=True, swa_period=None, swa_start=0,
                 lookahead_period=None, lookahead_step_size=0.5, **options):
        owner = type(self).__name__
        # Every float the step reads: the learning rate, the rule's
        # hyperparameters, the numeric options (`sparseopt.updaters.core.hyperparameters`).
        self._specs = {}
        self._trainers = []  # weak references to the `TableTrainer`s built with it
        self._set_hyperparameter("learning_rate", learning_rate,
                                 hyperparameters.Spec(lambda v: v >= 0, ">= 0"))
        self.name = name or _snake(owner)
        self._set_options(options)
        if not isinstance(lazy, bool):
            raise TypeError(f"{owner}: `lazy` must be True or False, got {lazy!r}.")
        self.lazy = lazy
        if ema_momentum is not None and (isinstance(ema_momentum, bool) or not isinstance(
                ema_momentum, (int, float)) or not 0 <= ema_momentum < 1):
            raise ValueError(f"{owner}: `ema_momentum` must be a number in "
                             f"[0, 1), got {ema_momentum!r}.")
        self.ema_momentum = None if ema_momentum is None else float(ema_momentum)
        # `(start, period)` of stochastic weight averaging, or None.
        self.swa = swa.check(owner, swa_start, swa_period)
        # `(period, step_size)` of Lookahead, or None.
        self.lookahead = lookahead.check(owner, lookahead_period, lookahead_step_size)
        # The table's storage, given here (the older spelling; `sparseopt.storage`).
        self.state_dtype, self.stochastic_rounding, self.rounding_seed = storage.checked(
            owner, state_dtype, stochastic_rounding, rounding_seed)
        if not isinstance(follow_learning_rate, bool):
            raise TypeError(f"{owner}: `follow_learning_rate` must be True or False, got "
                            f"{follow_learning_rate!r}.")
        self.follow_learning_rate = follow_learning_rate

    def _check_settings(self):
        """Checks that need the whole updater (run once its `__init__` is done): each
        wrapper's refusals (`sparseopt.updaters.wrappers`)."""
        for wrapper in self.wrappers:
            wrapper.check(self)

    @property
    def wrappers(self):
        """What wraps the rule, innermost first: the `lazy=False` catch-up
        (`wrappers.catch_up.CatchUp`) or the moving average (`wrappers.ema`), the weight
        average (`wrappers.swa`), Lookahead (`wrappers.lookahead`), each as its
        argument asks. Each brings its slots, refusals, part of the step and part of the
        end of `fit`."""
        out = []
        if not self.__dict__.get("lazy", True) and not self.dense_in_rule:
            out.append(CatchUp())
        if self.__dict__.get("ema_momentum") is not None:
            out.append(MovingAverage(self.ema_momentum))
        if self.__dict__.get("swa"):
            out.append(swa.WeightAverage(*self.swa))
        if self.__dict__.get("lookahead"):
            out.append(lookahead.Lookahead(*self.lookahead))
        return tuple(out)

    @property
    def rule_slots(self):
        """The rule's own `SlotSpec`s (its wrappers' not included)."""
        return self.__dict__.get("_rule_slots", ())

    @property
    def slots(self):
        """The state slots: the rule's (but `unread_slots`), then the row's last step where
        `lazy=False` or `ema_momentum` is set, then the moving average's offset where
        `ema_momentum` is, the SWA average and count where `swa_period` is, the
        offset from the slow copy where `lookahead_period` is."""
        unread = set(self.__dict__.get("_unread_slots", ()))
        return tuple(s for s in self.legacy_slots if s.name not in unread)

    @slots.setter
    def slots(self, value):
        self._rule_slots = tuple(value)

    @property
    def unread_slots(self):
        """Names of rule slots this configuration never reads (e.g. Adam's momentum
        where `beta_1=0`): they get no variable. A rule sets it after `slots`."""
        return self.__dict__.get("_unread_slots", ())

    @unread_slots.setter
    def unread_slots(self, names):
        self._unread_slots = tuple(names)

    @property
    def legacy_slots(self):
        """`slots` with the unread ones: what sparseopt 0.2 kept (its checkpoints load)."""
        return self.rule_slots + tuple(s for w in self.wrappers for s in w.slots)

    @property
    def tracks_rows(self):
        """Whether each row's last step is kept (`lazy=False` or `ema_momentum`; a rule
        whose dense form is its own keeps its own record)."""
        return any(w.tracks_rows for w in self.wrappers)

    def fused_kernel(self):
        """The TF kernel that computes this updater's whole step, or None.

        `tf_kernel()` where no option is set and the updater is lazy: kernels
        know the bare rule only.
        """
        if self.transforms or self.wrappers or self.scheduled:
            return None
        return self.tf_kernel()

    def apply_rule(self, rows, state, grads, hp):
        """The rule with the updater's options and wrappers around it (what the step calls).

        Same arguments and result as `update`: the options' transforms around
        `update` (`transforms.chain`), then each wrapper around that, innermost
        first (with `lazy=False` the rows first catch up on the steps they missed).
        """
        rule = functools.partial(chain, self.transforms, self.update)
        for wrapper in self.wrappers:
            rule = wrapper.around(self, rule)
        return rule(rows, state, grads, hp)

    # `missed_steps(self, rows, state, steps, decay, hp)`: `steps`
    # zero-gradient steps of the rule in closed form, what a dense optimizer
    # does to a row no batch touches (each step multiplies the row by `decay`,
    # decoupled weight decay, then applies the rule to a zero gradient);
    # returns `(rows, state)`. `steps` is int32 `[U]`, `state` the rule's own
    # slots, `hp` the step's hyperparameters (`hp.step` None). None: no exact
    # closed form, so `lazy=False` is refused. (`sparseopt.updaters.wrappers.catch_up`.)
    missed_steps = None
    # Whether `missed_steps` reads the learning rate (then it must be constant).
    missed_steps_read_learning_rate = False
    # The jax-tpu-embedding spec of a rule SparseCore has and Keras has not
    # (a `SparseCoreSpec`); None: converted through its Keras optimizer, if any.
    sparsecore_spec = None

    def learning_rate_at(self, step):
        """The learning rate at `step` (the optimizer's 0-based iteration)."""
        return self.value("learning_rate", step + 1)

    def update(self, rows, state, grads, hp):
        """Apply the rule to the touched rows.

        Args:
            rows: `[U, D]` current values of the touched rows.
            state: dict slot name -> `[U, D]` or `[U]` state rows; whole
                slots (`"column"`, `"table"`) as `update_whole` left them
                this step.
            grads: `[U, D]` summed gradient of each touched row.
            hp: the step's hyperparameters
                (`sparseopt.updaters.core.hyperparameters.Values`): `hp.learning_rate`,
                `hp.step` (int scalar, the 1-based count of this update) and
                every hyperparameter by name (`hp.epsilon`).

        Returns:
            `(new_rows, new_state)` with the same shapes (`new_state` holds
            the per-row slots; whole slots in it are ignored).
        """
        raise NotImplementedError

    def contributions(self, rows, state, grads, hp):
        """Each touched row's contribution to the sums the whole slots' update needs.

        For rules with `"column"` or `"table"` slots. The machinery sums
        them over every distinct row of the step (whatever chunks it is
        processed in) and hands the sums to `update_whole`.

        Args:
            rows: `[U, D]` the touched rows, as the rule will see them (after
                the options that act before it, e.g. decoupled weight decay).
            state: their per-row slots (`[U, D]` or `[U]`), and the whole
                slots as they are before this step.
            grads: `[U, D]` summed gradient of each touched row, as the rule
                will see it (after e.g. `clipvalue`).
            hp: the step's hyperparameters, as for `update`.

        Returns:
            `{name: [U, ...] array}`; `{}` (the default) where the rule keeps
            no whole slot.
        """
        return {}

    def update_whole(self, state, sums, num_rows, hp):
        """The whole slots' new values, once per step, before the row rule reads them.

        Args:
            state: `{name: value}` of the whole slots (`[D]` or scalars).
            sums: `{name: array}`, `contributions` summed over the step's
                distinct rows.
            num_rows: the table's row count (for means over all rows).
            hp: the step's hyperparameters, as for `update`.

        Returns:
            `{name: new value}` for every whole slot.
        """
        return {}

    @property
    def whole_slots(self):
        """The `SlotSpec`s of kind `"column"` or `"table"`."""
        return tuple(s for s in self.slots if not s.per_row)

    def get_config(self):
        options = {k: _serialized(v) for k, v in self.options.items()}
        options.update({k: _serialized(getattr(self, k))
                        for k in self.__dict__.get("_hyperparameters", ())})
        if not self.lazy:
            options["lazy"] = False
        if self.ema_momentum is not None:
            options["ema_momentum"] = self.ema_momentum
        if self.swa is not None:
            options.update(swa_start=self.swa[0], swa_period=self.swa[1])
        if self.lookahead is not None:
            options.update(lookahead_period=self.lookahead[0],
                           lookahead_step_size=self.lookahead[1])
        # Settings, where not the defaults (older configs load unchanged).
        for key, default in {**STORAGE_DEFAULTS, "follow_learning_rate": True}.items():
            if getattr(self, key) != default:
                options[key] = getattr(self, key)
        return {"learning_rate": _serialized(self.learning_rate), "name": self.name, **options}

    @classmethod
    def from_config(cls, config):
        config = {k: keras.saving.deserialize_keras_object(v) if isinstance(v, dict) else v
                  for k, v in config.items()}
        return cls(**config)

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items() if k != "name")
        return f"{type(self).__name__}({args})"


def _checked_after(init):
    """`init`, then `_check_settings` once the outermost `__init__` returns."""

    @functools.wraps(init)
    def wrapped(self, *args, **kwargs):
        depth = self.__dict__.get("_init_depth", 0)
        self._init_depth = depth + 1
        try:
            init(self, *args, **kwargs)
        finally:
            self._init_depth = depth
        if depth == 0:
            del self._init_depth
            self._check_settings()

    return wrapped


def _serialized(value):
    if isinstance(value, keras.optimizers.schedules.LearningRateSchedule):
        return keras.saving.serialize_keras_object(value)
    return value


def _snake(name):
    out = []
    for i, c in enumerate(name):
        if c.isupper() and i and not name[i - 1].isupper():
            out.append("_")
        out.append(c.lower())
    return "".join(out)
