"""The controls a user points at the optimizer, and what each does to tables.

`Controls`, a part of `DispatchOptimizer`: the wrapped optimizer's settings it
shares (`learning_rate`, which tables follow in proportion; `loss_scale_factor`)
and those it takes over from it (`global_clipnorm`, `gradient_accumulation_steps`),
each either acting on tables as documented or refused once the traced step has
read it; `exclude_from_weight_decay` for dense variables and tables alike.
"""

import keras
from keras import ops



class Controls:
    """The settings of `DispatchOptimizer` a user changes (see docs/api.md, "What each
    control does")."""

    @property
    def optimizer(self):
        """The Keras optimizer for variables that nothing else claims."""
        return self._default_optimizer

    @property
    def dense_optimizers(self):
        """The Keras optimizers of the dense variables (`optimizer` first)."""
        return list(self._dense_optimizers)

    @property
    def gradient_accumulation_steps(self):
        """k: the micro-batches whose mean gradient each update applies (None: 1).

        Set at construction (or on the wrapped optimizer). Keras' base class
        would build a full-size accumulator for every variable, tables too;
        it sees None while it builds, and `sparseopt.accumulation` keeps
        buffers sized by the ids instead.
        """
        if self.__dict__.get("_building_base"):
            return None
        return self.__dict__.get("_accumulation_steps")

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, value):
        self._check_settable("gradient_accumulation_steps", value,
                             self.__dict__.get("_accumulation_steps"))
        self.__dict__["_accumulation_steps"] = value

    def _check_settable(self, name, value, current):
        """Refuses a new `value` of `name` once built: the traced step has read it, so
        a change would be silently ignored (setting it again to the same is fine)."""
        if getattr(self, "built", False) and value != current:
            raise ValueError(
                f"DispatchOptimizer: `{name}` cannot change once the optimizer is built "
                "(its traced step has read it). Set it before the first `fit` (or build), "
                "or compile again with a new DispatchOptimizer.")

    @property
    def global_clipnorm(self):
        """One norm over the dense gradients and the tables' rows (`sparseopt.clipping`).

        May be set until the optimizer is built (between `compile` and `fit`
        too); the step reads it when traced, so a later change is refused
        rather than silently ignored.
        """
        return self.__dict__.get("_global_clipnorm")

    @global_clipnorm.setter
    def global_clipnorm(self, value):
        self._check_settable("global_clipnorm", value, self.__dict__.get("_global_clipnorm"))
        self.__dict__["_global_clipnorm"] = value

    @property
    def learning_rate(self):
        """The wrapped optimizer's learning rate: what Keras' callbacks read and set.

        Tables follow it in proportion (`learning_rate_scale`); the Keras
        optimizers of `optimizer_map` keep their own.
        """
        return self._default_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, value):
        if hasattr(self, "_default_optimizer"):
            self._default_optimizer.learning_rate = value

    def sync_training_state(self):
        """Writes the state `fit` holds outside the variables back into them (JAX).

        JAX's `fit` threads the state through its steps and writes it to the
        variables when a callback reads `self.model`; assigning a variable
        without that (an updater's hyperparameter set mid-epoch) would be
        overwritten by the stale state. This syncs first, so that the next
        step reads every variable afresh. Nothing to do on TensorFlow.
        """
        model = self._model() if getattr(self, "_model", None) is not None else None
        if model is not None and hasattr(model, "jax_state_sync"):
            model.jax_state_sync()

    def learning_rate_scale(self):
        """The wrapped optimizer's learning rate now over the rate the user gave it.

        A table whose updater has `follow_learning_rate=True` (the default)
        trains at its own rate times this: a callback that halves the model's
        rate halves the tables', one that sets it to 0 stops them, whether
        the change comes before the optimizer is built or after. The rate
        "given" is the wrapped optimizer's when the `DispatchOptimizer` was
        constructed (kept in its state, so a resumed run keeps the
        proportion). 1.0 where the wrapped rate is a schedule (no callback
        can set it; each table keeps its own schedule) or was given as 0.

        Returns:
            A Python float, on every backend.
        """
        return float(ops.convert_to_numpy(self._scale_of_rate()))

    def _scale_of_rate(self):
        """`learning_rate_scale()` as a float32 scalar tensor, read inside the step."""
        rate = self._default_optimizer.learning_rate
        start = getattr(self, "_rate_at_start", None)  # (the saved copy, once built)
        start = self._given_rate if start is None else start.value
        if start is None or not isinstance(rate, keras.Variable):
            return ops.ones((), "float32")
        start = ops.cast(start, "float32")
        now = ops.cast(rate.value, "float32")
        return ops.where(start > 0, now / ops.where(start > 0, start, 1.0), 1.0)

    def exclude_from_weight_decay(self, var_list=None, var_names=None):
        """Keras' `exclude_from_weight_decay`, for the dense optimizers and the tables.

        Forwarded to every Keras optimizer of the dense variables (those
        found when the optimizer is built too). A table it names (by Keras'
        rules: the variable itself, or a regex of `var_names` found in its
        name) is not decayed by its updater's `weight_decay`.

        Args:
            var_list: variables to exclude.
            var_names: substrings or regexes of the variable names to exclude.
        """
        if self.built:
            raise ValueError(
                "DispatchOptimizer: `exclude_from_weight_decay()` can only be configured "
                "before the optimizer is built.")
        # Tables that are no variables (on disk) are excluded here: Keras keys its
        # list by variable (on TF, by the tf.Variable), which they are not.
        self._decay_excluded_tables = {id(v) for v in var_list or []
                                       if not isinstance(v, keras.Variable)}
        if var_list is not None:
            var_list = [v for v in var_list if isinstance(v, keras.Variable)]
        # As Keras': each call replaces the previous one.
        self._decay_exclusion = (var_list, var_names)
        for opt in self._dense_optimizers:
            opt.exclude_from_weight_decay(var_list=var_list, var_names=var_names)

    @property
    def loss_scale_factor(self):
        return getattr(self, "_loss_scale_factor", None)

    @loss_scale_factor.setter
    def loss_scale_factor(self, value):
        # Keras scales the loss by it in the traced step, and the tables unscale
        # by it there: a change once built would reach neither.
        self._check_settable("loss_scale_factor", value,
                             getattr(self, "_loss_scale_factor", None))
        self._loss_scale_factor = value
        for opt in getattr(self, "_dense_optimizers", []):
            opt.loss_scale_factor = value

    @property
    def variables(self):
        out = self._variables[:]
        for opt in self._dense_optimizers:
            out.extend(opt.variables)
        return out
