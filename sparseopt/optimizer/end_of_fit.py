"""The end of `fit` for tables: catch-up, moving and weight averages, int8 writes.

`EndOfFit`, a part of `DispatchOptimizer`: Keras' `finalize_variable_values`
runs each table's end of `fit` (its updater's wrappers', then an int8 table's
last buffered rows); `catch_up_tables`, `table_moving_average` and
`table_swa_average` give the same mid-training.
"""

from keras import ops

from sparseopt import backend, compat


class EndOfFit:
    """Whole-table work between steps, for `DispatchOptimizer`."""

    def catch_up_tables(self):
        """Brings every row of `lazy=False` and `ema_momentum` tables up to the current step.

        Such tables apply the steps a row missed (decay, momentum, the
        average's decay) when the row is next touched; this applies them to
        every row now (whole-table work). Keras calls it at the end of `fit`;
        call it yourself before evaluating or exporting mid-training. Exact
        resume does not need it: the per-row record is saved with the state.
        """
        trainers = [t for t in self._trainers.values() if t.updater.tracks_rows]
        if not trainers:
            return
        steps_done = self._steps_done()
        with backend.outside_trace():
            scale = self._scale_of_rate()
            for trainer in trainers:
                trainer.catch_up(steps_done, scale)

    def _steps_done(self):
        """The updates applied so far (micro-batches / k with gradient accumulation)."""
        return int(ops.convert_to_numpy(self.iterations))

    def table_moving_average(self, table):
        """The moving average of a table whose updater has `ema_momentum` (a tensor).

        Args:
            table: the table variable or its path.
        """
        return self._average(table, lambda u: u.ema_momentum is not None, "moving average",
                             "ema_momentum",
                             lambda t: t.moving_average(self._steps_done(), self._scale_of_rate()))

    def table_swa_average(self, table):
        """The stochastic weight average of a table whose updater has `swa_period` (a tensor).

        Args:
            table: the table variable or its path.
        """
        return self._average(table, lambda u: u.swa is not None, "weight average",
                             "swa_period", lambda t: t.swa_average(self._steps_done()))

    def _average(self, table, keeps, what, argument, average):
        """`average(trainer)` of `table`'s trainer, outside any trace, where `keeps(updater)`."""
        trainer = self.table_trainer(table)
        if not keeps(trainer.updater):
            raise ValueError(f"DispatchOptimizer '{self.name}': table '{trainer.name}' keeps "
                             f"no {what}; give its updater `{argument}`.")
        with backend.outside_trace():
            return average(trainer)

    def finalize_variable_values(self, var_list):
        """Each table's end of `fit` (Keras' hook): its updater's wrappers' (every row
        caught up; `ema_momentum` and `swa_period` tables take their average), then its
        row storage's (an int8 table's last buffered rows written, a table on disk's
        cache written to its files: `TableTrainer.end_of_fit`)."""
        # Only tables with something to do. A failed first step leaves nothing to read:
        # no trainer, or (JAX) variables whose values Keras took out for the step and never
        # got back. Keras calls this in `fit`'s `finally`, where raising would hide that
        # failure.
        trainers = [t for t in getattr(self, "_trainers", {}).values()
                    if t.updater.wrappers or (t.row_storage is not None
                                              and t.row_storage.ends_fit)]
        if trainers and compat.holds_a_value(self._iterations):  # (the counter itself)
            steps_done = self._steps_done()
            with backend.outside_trace():
                scale = self._scale_of_rate()
                for trainer in trainers:
                    trainer.end_of_fit(steps_done, scale)
        for opt in self._dense_optimizers:
            opt.finalize_variable_values(
                [v for v in var_list if self._route.get(self._var_key(v)) is opt]
            )
