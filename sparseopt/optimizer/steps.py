"""One step of `DispatchOptimizer`: dense gradients to Keras optimizers, rows to tables.

`Steps`, a part of `DispatchOptimizer`: `apply` sorts the step's gradients
(dense, installed, each table's row gradients through its source), then
either runs the update (`_step`: global clipping's one norm over everything
between the tables' two halves) or, with `gradient_accumulation_steps`, adds a
micro-step and updates on the k-th (`_accumulate`).
"""

import keras
from keras import ops

from sparseopt import backend
from sparseopt.engine import clipping


class Steps:
    """Applying a step, for `DispatchOptimizer`."""

    def apply(self, grads, trainable_variables=None):
        if len(grads) == 0:
            return
        if trainable_variables is None:
            if not self.built:
                raise ValueError(
                    "DispatchOptimizer: call `build(variables)` or pass "
                    "`trainable_variables` on the first `apply`."
                )
            trainable_variables = self._trainable_variables
        trainable_variables = list(trainable_variables)
        if not self.built:
            self.build(trainable_variables)
        self._check_variables_are_known(trainable_variables)

        dense = {id(opt): ([], []) for opt in self._dense_optimizers}
        watched = {}
        for grad, var in zip(grads, trainable_variables):
            key = self._var_key(var)
            if key in self._watched:
                watched[id(var)] = grad
            elif key in self._installed and grad is not None:
                # Install only: no scaling, clipping, decay or accumulation.
                self._installed[key].assign(grad)
            elif key in self._route and grad is not None:
                gs, vs = dense[id(self._route[key])]
                gs.append(grad)
                vs.append(var)
        with keras.name_scope(self.name, caller=self):
            rows = {}  # id(trainer) -> the true RowGrads of this step
            for trainer in self._trainers.values():
                record = trainer.source.row_gradients(watched, trainer.name)
                if record is not None:
                    if self.loss_scale_factor is not None:
                        record = record.scaled(1.0 / self.loss_scale_factor)
                    if self._accumulator is None:
                        # TF MirroredStrategy: every replica's rows, applied by each.
                        record = backend.all_replicas(record)
                    rows[id(trainer)] = record
            if self._accumulator is None:
                self._step(dense, rows)
            else:
                self._accumulate(dense, rows)
        self._iterations.assign_add(1)

    def _accumulate(self, dense, rows):
        """A micro-step: adds its gradients, and on the k-th applies their mean.

        Args:
            dense, rows: as for `_step` (`rows` of this replica only).
        """
        steps, accumulator = self.gradient_accumulation_steps, self._accumulator
        trainers = list(self._trainers.values())
        micro = ops.mod(self._iterations, steps)
        accumulator.add(micro, dense, rows, trainers, self._var_key)

        def update():
            means, every_row = accumulator.mean(dense, trainers, self._var_key)
            self._step(means, every_row)
            accumulator.reset()

        # Everything the update reads or writes (JAX runs it as a cond over them).
        last = ops.equal(micro, steps - 1)
        backend.run_if(last, update, [*self._trainable_variables, *self.variables])
        # Open vocabularies admit per micro-step, after the update (a slot holding a
        # step starts at the updates made so far).
        updates = self.iterations + ops.cast(last, self.iterations.dtype)
        for trainer in trainers:
            if id(trainer) in rows:
                trainer.accept_micro_step(rows[id(trainer)], updates, last)

    def _step(self, dense, rows):
        """One update: dense gradients to their Keras optimizers, row gradients to tables.

        With `global_clipnorm`, every table's step is deduplicated first, one
        norm is taken over the dense gradients and the tables' summed rows,
        and all of them are scaled by Keras' factor (`sparseopt.clipping`).

        Args:
            dense: `{id(Keras optimizer): (gradients, variables)}`, gradients
                as the model computed them (a `loss_scale_factor` not undone).
            rows: `{id(TableTrainer): true RowGrads}`.
        """
        iteration = self.iterations
        scale = self._scale_of_rate() if self._trainers else None
        units, grouped = [], set()  # (TableGroup or TableTrainer, its step's rows)
        for group in self._groups:
            looked_up = [(t, rows[id(t)]) for t in group.trainers if id(t) in rows]
            if looked_up:
                units.append((group, looked_up))
            grouped.update(id(t) for t in group.trainers)
        units += [(t, rows[id(t)]) for t in self._trainers.values()
                  if id(t) in rows and id(t) not in grouped]
        factor = prepared = None
        if self.global_clipnorm:
            prepared = [unit.prepare(step) for unit, step in units]
            norms = [clipping.squared_norm(backend.sum_over_replicas(g), self.loss_scale_factor)
                     for gs, _ in dense.values() for g in gs]
            factor = clipping.factor(norms + [p.squared_norm() for p in prepared],
                                     self.global_clipnorm)
        for opt in self._dense_optimizers:
            gs, vs = dense[id(opt)]
            if gs:
                opt.apply(gs if factor is None else [clipping.scaled(g, factor) for g in gs], vs)
        for i, (unit, step) in enumerate(units):
            if prepared is None:
                unit.apply(step, iteration, scale)
            else:
                unit.finish(prepared[i], iteration, scale, factor)
        for trainer in self._trainers.values():  # (Lookahead's sync, looked up or not)
            trainer.end_step(iteration)
