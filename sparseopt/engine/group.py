"""`TableGroup`: several tables trained with one dedup pass, and who may join whom.

Tables whose trainers share width, dtype and updater configuration
(`TableTrainer.group_key`) are updated together: one dedup for all of them
(`plans.prepare_group`), then each table's rows as it would alone, each
keeping its own state, counters and checkpoint entries.
"""

import numpy as np
from keras import ops

from sparseopt import backend
from sparseopt.engine import plans
from sparseopt.updaters.core.transforms import value_at


class TableGroup:
    """Trains several tables with one dedup pass, each table in place.

    The tables share width, dtype and updater configuration
    (`TableTrainer.group_key`). Each step their ids are shifted into one id
    space and deduplicated together (one pass, one workspace), then each
    table's distinct rows are read, updated and written back in place
    (`plans.finish_group`). Results are those of updating each table alone
    (up to float rounding: another compiled program); each member keeps its
    own state, skip count and checkpoint entries, so grouping never changes
    what is saved.

    Args:
        trainers: the member `TableTrainer`s (two or more).
    """

    def __init__(self, trainers):
        self.trainers = list(trainers)
        self.updater = self.trainers[0].updater
        self.workspace = None

    @property
    def num_rows(self):
        return sum(t.table.shape[0] for t in self.trainers)

    def build(self, optimizer, name):
        """Creates the group's int32 dedup workspace, one entry per row of its tables.

        The members' own state is built by each `TableTrainer` (with
        `workspace=False`), in the order the tables were found, so that
        checkpoints hold the same entries in the same order as without groups.
        """
        if backend.WORKSPACE:
            self.workspace = optimizer.add_variable(
                shape=(self.num_rows + backend.WORKSPACE_SINK,), dtype="int32",
                initializer="zeros",
                name=f"{name}_dedup_workspace")

    @property
    def scratch_variables(self):
        return [self.workspace] if self.workspace is not None else []

    def apply(self, rows, iteration, learning_rate_scale=1.0):
        """Applies the shared updater to each member looked up in this step.

        Args:
            rows: list of `(trainer, record)`, as for `TableTrainer.apply`.
            iteration: the optimizer's 0-based step count.
            learning_rate_scale: as for `TableTrainer.values_at`.
        """
        self.finish(self.prepare(rows), iteration, learning_rate_scale)

    def prepare(self, rows):
        """One dedup of the members looked up in this step (`plans.PreparedGroup`).

        Args:
            rows: as for `apply`.
        """
        return plans.prepare_group([(t.table.shape[0], record) for t, record in rows],
                                    self.workspace, owners=[t for t, _ in rows])

    def finish(self, prepared, iteration, learning_rate_scale=1.0, factor=None):
        """Applies the shared updater to a `prepare`d step, member by member.

        Args:
            prepared: from `prepare`.
            iteration, learning_rate_scale: as for `apply`.
            factor: as for `TableTrainer.finish`.
        """
        trainers = prepared.owners
        values = self.values_at(trainers, iteration, learning_rate_scale)
        applied = plans.finish_group(self.updater, [t.row_storage for t in trainers],
                                     prepared, values, iteration + 1, factor)
        for t, trainer in enumerate(trainers):
            trainer.after_step(None, applied[t], iteration)

    @staticmethod
    def values_at(trainers, iteration, learning_rate_scale=1.0):
        """`{name: float32 [members]}`: each member's hyperparameters of the step, stacked.

        Each member reads its own (its updater's variables, or its schedule),
        as `TableTrainer.values_at` gives them, in one array per name.

        Args:
            trainers: the members looked up in the step.
            iteration, learning_rate_scale: as for `TableTrainer.values_at`.
        """
        step = iteration + 1
        updater = trainers[0].updater  # (the members share its configuration)
        values = {}
        for name in updater.hyperparameters:
            values[name] = ops.stack([
                ops.cast(t.hyperparameters[name].value, "float32") if name in t.hyperparameters
                else value_at(getattr(t.updater, name), step)
                for t in trainers])
        if updater.follow_learning_rate:
            values["learning_rate"] = values["learning_rate"] * learning_rate_scale
        if "weight_decay" in values and not all(t.decays for t in trainers):
            decays = np.asarray([float(t.decays) for t in trainers], "float32")
            values["weight_decay"] = values["weight_decay"] * decays
        return values


def group_trainers(trainers):
    """Splits `trainers` into `TableGroup`s of two or more and trainers left alone.

    Groups keep the trainers' order and stay within `plans.MAX_GROUP_ROWS` rows.

    Returns:
        `(groups, alone)`.
    """
    by_key = {}
    for trainer in trainers:
        key = trainer.group_key()
        by_key.setdefault(key if key is not None else ("alone", id(trainer)), []).append(trainer)
    groups, alone = [], []
    for same in by_key.values():
        chunks, rows = [[]], 0
        for trainer in same:
            if chunks[-1] and rows + trainer.table.shape[0] > plans.MAX_GROUP_ROWS:
                chunks.append([])
                rows = 0
            chunks[-1].append(trainer)
            rows += trainer.table.shape[0]
        for chunk in chunks:
            if len(chunk) > 1:
                groups.append(TableGroup(chunk))
            else:
                alone += chunk
    return groups, alone
