"""How a table stores its values and state: `TableStorage`, a setting of the table.

The dtype of the updater's float state, and how 16-bit values are written
(stochastic rounding or to nearest, and the seed of its bits), are facts about
one table's memory, not about its rule: two tables may share an updater and
store differently. They are given on the table (`SparseEmbedding(...,
storage=TableStorage(...))`, `SparseLookup(layer, table, storage=...)`).

An updater still takes the same three settings (`state_dtype`,
`stochastic_rounding`, `rounding_seed`): earlier versions kept them there, and
configs and files written then load unchanged. A table without storage of its
own uses its updater's; a table that has both must not disagree.
"""

import dataclasses
import numbers

import keras

from sparseopt.storage.dtypes import check_dtype

# The settings and their defaults (what an updater's config leaves out).
DEFAULTS = {"state_dtype": "float32", "stochastic_rounding": True, "rounding_seed": 0}


def checked(owner, state_dtype, stochastic_rounding, rounding_seed):
    """The three settings checked: `(state_dtype, stochastic_rounding, rounding_seed)`.

    Args:
        owner: who is given them (an updater's class name, a layer), for messages.
        state_dtype, stochastic_rounding, rounding_seed: as for `TableStorage`.
    """
    state_dtype = check_dtype(owner, "state_dtype", state_dtype)
    if not isinstance(stochastic_rounding, bool):
        raise TypeError(f"{owner}: `stochastic_rounding` must be True or False, got "
                        f"{stochastic_rounding!r}.")
    if isinstance(rounding_seed, bool) or not isinstance(rounding_seed, numbers.Integral) \
            or not 0 <= rounding_seed < 2**32:
        raise ValueError(f"{owner}: `rounding_seed` must be an int in [0, 2**32), got "
                         f"{rounding_seed!r}.")
    return state_dtype, stochastic_rounding, int(rounding_seed)


@keras.saving.register_keras_serializable(package="sparseopt")
@dataclasses.dataclass(frozen=True)
class TableStorage:
    """How one table stores its updater state and writes 16-bit values.

    Args:
        state_dtype: the dtype of the updater's float state slots:
            `"float32"` (default, whatever the table's dtype), `"bfloat16"`
            or `"float16"` (half the state memory; small increments are then
            rounded like a 16-bit table's rows). Rules always compute in
            float32.
        stochastic_rounding: for 16-bit tables and state: `True` (default)
            rounds each written value up or down at random so that its
            expectation is the float32 value (`sparseopt.precision`); `False`
            rounds to nearest. No effect on float32 variables.
        rounding_seed: int seed of the stochastic rounding's bits, in
            `[0, 2**32)` (same seed, same result, on either backend and any
            sharding).
    """

    state_dtype: str = "float32"
    stochastic_rounding: bool = True
    rounding_seed: int = 0

    # The row storage that keeps the table's rows and per-row state
    # (`sparseopt.storage.kinds`): in memory. A subclass names another kind.
    kind = "memory"

    def __post_init__(self):
        values = checked("TableStorage", self.state_dtype, self.stochastic_rounding,
                         self.rounding_seed)
        for field, value in zip(DEFAULTS, values):
            object.__setattr__(self, field, value)

    def get_config(self):
        return dataclasses.asdict(self)

    @classmethod
    def from_config(cls, config):
        return cls(**config)


def of_table(given, updater, table):
    """The storage a table is trained with: its own, else its updater's settings.

    Args:
        given: the `TableStorage` given on the table, or None.
        updater: its `Updater` (whose `state_dtype`, `stochastic_rounding`,
            `rounding_seed` are the older spelling).
        table: the table's path, for the message.

    Raises:
        ValueError: both say something and they differ.
    """
    from_updater = TableStorage(updater.state_dtype, updater.stochastic_rounding,
                                updater.rounding_seed)
    if given is None:
        return from_updater
    if from_updater != TableStorage() and from_updater != given:
        raise ValueError(
            f"Table '{table}': its storage {given} and its updater "
            f"{type(updater).__name__}'s storage settings {from_updater} differ. Give them "
            "on the table only (`storage=sparseopt.TableStorage(...)`), and leave the "
            "updater's `state_dtype`, `stochastic_rounding` and `rounding_seed` at their "
            "defaults.")
    return given


def from_argument(value, owner):
    """`value` (a `TableStorage`, its config dict, or None) as a `TableStorage` or None."""
    if value is None or isinstance(value, TableStorage):
        return value
    if isinstance(value, dict):
        return keras.saving.deserialize_keras_object(value) if "class_name" in value \
            else TableStorage(**value)
    raise TypeError(f"{owner}: `storage` must be a sparseopt.TableStorage, got {value!r}.")
