"""What a slot of a table's optimizer state is: `SlotSpec` and its kinds; `SparseCoreSpec`.

A slot's kind gives its shape for a `[V, D]` table, where it lives under a
distribution, how a step reads and writes it (per row, through the table's
row storage, or whole), and whether it starts afresh with its row.
"""

import dataclasses


# What a slot holds, for a `[V, D]` table: its kind gives its shape, where
# it lives under a distribution, how a step reads and writes it, and whether
# it returns to its initial value with its row.
ENTRY = "entry"  # [V, D], one per entry: gathered and scattered by row
ROW = "row"  # [V], one per row: gathered and scattered by row
COLUMN = "column"  # [D], one per column: read whole, updated once per step
TABLE = "table"  # [], one per table: read whole, updated once per step
KINDS = (ENTRY, ROW, COLUMN, TABLE)


@dataclasses.dataclass(frozen=True)
class SlotSpec:
    """One optimizer state slot of a table.

    Per-row kinds (`"entry"`, `"row"`) are gathered at the step's distinct
    rows, updated by the rule's `update` and scattered back in place, and
    are laid out like the table's rows under a distribution. Whole kinds
    (`"column"`, `"table"`) are read whole: a step first sums the rule's
    per-row contributions (`Updater.contributions`) over all its distinct
    rows, then updates them once (`Updater.update_whole`), and the row rule
    reads their new value. They are replicated, never reset with a row, and
    kept in float32 unless `dtype` says otherwise. Per-row kinds start afresh
    (`initial_value`, or the step where `holds_step`) when an open
    vocabulary gives their row to a new id.

    Args:
        name: slot name, e.g. `"accumulator"`.
        rowwise: `True` for one scalar per row (the same as `kind="row"`),
            `False` for the kind given (by default one per entry).
        initial_value: constant the slot starts at.
        dtype: the slot's dtype; `None` (the default) for the table's
            storage `state_dtype` (`sparseopt.TableStorage`, float32 unless
            set) for per-row kinds, float32 for whole kinds.
        kind: `"entry"` (`[V, D]`, the default), `"row"` (`[V]`), `"column"`
            (`[D]`) or `"table"` (a scalar).
        holds_step: the slot holds a step number (`lazy=False`'s last update):
            a row given to a new id (an open vocabulary) starts it at the
            current step instead of `initial_value`.
        from_table: for a whole kind, `fn(table)` (float32 `[V, D]` -> the
            slot's value) computing where it starts from the table's values
            when the optimizer is built (whole-table work, once; e.g. the
            table's sum of squares). None: `initial_value`.
    """

    name: str
    rowwise: bool = False
    initial_value: float = 0.0
    dtype: str = None  # None: the table's state_dtype (per-row kinds), else float32
    kind: str = None  # None: "row" if rowwise else "entry"
    holds_step: bool = False
    from_table: object = None

    def __post_init__(self):
        kind = self.kind or (ROW if self.rowwise else ENTRY)
        if kind not in KINDS:
            raise ValueError(f"SlotSpec '{self.name}': kind must be one of {KINDS}, got "
                             f"{self.kind!r}.")
        if self.rowwise and kind != ROW:
            raise ValueError(f"SlotSpec '{self.name}': rowwise=True is kind='row', not "
                             f"{kind!r}.")
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "rowwise", kind == ROW)
        if self.from_table is not None and kind in (ENTRY, ROW):
            raise ValueError(f"SlotSpec '{self.name}': `from_table` is for whole kinds "
                             "('column', 'table') only.")

    @property
    def per_row(self):
        """Whether the slot has one entry (or row of entries) per table row."""
        return self.kind in (ENTRY, ROW)

    def shape(self, table_shape):
        """The slot's shape for a table of shape `[V, D]`."""
        return {ENTRY: tuple(table_shape), ROW: (table_shape[0],),
                COLUMN: (table_shape[1],), TABLE: ()}[self.kind]

    def dtype_for(self, state_dtype):
        """The slot's dtype for a table whose storage has this `state_dtype`."""
        return self.dtype or (state_dtype if self.per_row else "float32")


@dataclasses.dataclass(frozen=True)
class SparseCoreSpec:
    """A rule SparseCore has and Keras has not: its jax-tpu-embedding spec, field by field.

    An updater class declares one as `sparsecore_spec` (a capability: not
    inherited); `to_sparsecore_spec` / `from_sparsecore_spec` go through it.

    Args:
        spec: the jax-tpu-embedding `OptimizerSpec` class name.
        fields: updater attribute -> spec field, both ways.
        fixed: spec fields sparseopt cannot vary, with the only value it takes.
        why: what `fixed` stands for, for the refusal.
    """

    spec: str
    fields: dict
    fixed: dict
    why: str
