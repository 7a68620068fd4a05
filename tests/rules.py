"""Rules the tests define, as a user would in their own file.

`ColumnScaledSGD` keeps state of every kind (per column, per table, per row):
`tests/test_slot_kinds.py` checks it against a dense NumPy replay, and the
sharded job (`tests/jobs/sharded_job.py`) trains it on tables split by rows.
"""

from keras import ops

import sparseopt
from sparseopt.updaters import SlotSpec


class ColumnScaledSGD(sparseopt.updaters.Updater):
    """SGD scaled per column by a running mean over all rows of squared gradients.

    Whole-table state: `column_sq` (`[D]`): `beta * c + (1 - beta) * sum_rows(g^2) / V`;
    `rows_seen` (scalar): distinct rows updated so far. Per row: `row_sq`
    (`[V]`), the row's summed squared gradients.
    """

    def __init__(self, learning_rate=0.1, beta=0.5, name=None, **options):
        super().__init__(learning_rate, name=name, **options)
        self.hyperparameter("beta", beta, lambda v: 0 <= v < 1, "in [0, 1)")
        self.slots = (SlotSpec("column_sq", kind="column", initial_value=1.0),
                      SlotSpec("rows_seen", kind="table"),
                      SlotSpec("row_sq", rowwise=True))

    def contributions(self, rows, state, grads, step):
        return {"column_sq": ops.square(grads), "rows_seen": ops.ones(ops.shape(grads)[:1])}

    def update_whole(self, state, sums, num_rows, step):
        beta = self.value("beta", step)
        return {"column_sq": beta * state["column_sq"] + (1 - beta) * sums["column_sq"] / num_rows,
                "rows_seen": state["rows_seen"] + sums["rows_seen"]}

    def update(self, rows, state, grads, learning_rate, step):
        scale = 1.0 / ops.sqrt(state["column_sq"] + 1e-3)  # this step's new column factor
        return (rows - learning_rate * grads * scale,
                {"row_sq": state["row_sq"] + ops.sum(ops.square(grads), axis=-1)})
