"""`TableGroup`: several tables trained with one dedup pass, and who may join whom.

Tables whose trainers share width, dtype and updater configuration
(`TableTrainer.group_key`) are updated together: one dedup for all of them
(`plans.prepare_group`), then each table's rows as it would alone, each
keeping its own state, counters and checkpoint entries.
"""


from sparseopt import backend
from sparseopt.engine import plans


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
        # Each member's own hyperparameters, exactly as it would read them alone.
        values = [t.values_at(iteration, learning_rate_scale) for t in trainers]
        applied = plans.finish_group(self.updater, [t.row_storage for t in trainers],
                                     prepared, values, iteration + 1, factor)
        for t, trainer in enumerate(trainers):
            # (Lookahead and open vocabularies never join a group: `group_key`.)
            trainer.count_skipped(applied[t])


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
