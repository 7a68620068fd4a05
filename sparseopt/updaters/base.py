"""The `Updater` base class: a sparse, row-wise update rule and its state.

An updater is data plus one pure function. It declares the state slots it
needs (full `[V, D]` or one scalar per row) and maps the touched rows of a
table, their state rows and their summed gradients to new rows and new state
rows. It never sees the whole table: the machinery around it (dedup, gather,
scatter in place) lives in `sparseopt.sparse_apply` and the backend modules.
"""

import dataclasses

import keras
from keras import ops


@dataclasses.dataclass(frozen=True)
class SlotSpec:
    """One optimizer state slot of a table.

    Args:
        name: slot name, e.g. `"accumulator"`.
        rowwise: `True` for one scalar per row (shape `[V]`), `False` for
            the table's own shape `[V, D]`.
        initial_value: constant the slot starts at.
    """

    name: str
    rowwise: bool = False
    initial_value: float = 0.0

    def shape(self, table_shape):
        return (table_shape[0],) if self.rowwise else tuple(table_shape)


class Updater:
    """Base class of sparse table updaters.

    Subclasses set `slots` and implement `update`, a pure function of the
    touched rows only. `learning_rate` is a float or a
    `keras.optimizers.schedules.LearningRateSchedule` evaluated at the
    optimizer's step count.

    Args:
        learning_rate: float or `LearningRateSchedule`.
        name: optional name, used in variable names and messages.
    """

    slots = ()

    def __init__(self, learning_rate, name=None):
        if isinstance(learning_rate, keras.optimizers.schedules.LearningRateSchedule):
            self.learning_rate = learning_rate
        elif isinstance(learning_rate, (int, float)) and not isinstance(learning_rate, bool):
            if learning_rate < 0:
                raise ValueError(
                    f"{type(self).__name__}: `learning_rate` must be >= 0, "
                    f"got {learning_rate}."
                )
            self.learning_rate = float(learning_rate)
        else:
            raise TypeError(
                f"{type(self).__name__}: `learning_rate` must be a float or a "
                "keras.optimizers.schedules.LearningRateSchedule, got "
                f"{learning_rate!r}."
            )
        self.name = name or _snake(type(self).__name__)

    def learning_rate_at(self, step):
        """The learning rate at `step` (the optimizer's 0-based iteration)."""
        if isinstance(self.learning_rate, keras.optimizers.schedules.LearningRateSchedule):
            return ops.cast(self.learning_rate(step), "float32")
        return ops.convert_to_tensor(self.learning_rate, "float32")

    def update(self, rows, state, grads, learning_rate, step):
        """Apply the rule to the touched rows.

        Args:
            rows: `[U, D]` current values of the touched rows.
            state: dict slot name -> `[U, D]` or `[U]` state rows.
            grads: `[U, D]` summed gradient of each touched row.
            learning_rate: scalar tensor.
            step: scalar int tensor, 1-based count of this update.

        Returns:
            `(new_rows, new_state)` with the same shapes.
        """
        raise NotImplementedError

    def get_config(self):
        lr = self.learning_rate
        if not isinstance(lr, float):
            lr = keras.saving.serialize_keras_object(lr)
        return {"learning_rate": lr, "name": self.name}

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        if isinstance(config.get("learning_rate"), dict):
            config["learning_rate"] = keras.saving.deserialize_keras_object(
                config["learning_rate"]
            )
        return cls(**config)

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items() if k != "name")
        return f"{type(self).__name__}({args})"


def _snake(name):
    out = []
    for i, c in enumerate(name):
        if c.isupper() and i and not name[i - 1].isupper():
            out.append("_")
        out.append(c.lower())
    return "".join(out)
