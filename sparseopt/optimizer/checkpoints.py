"""What a checkpoint holds of `DispatchOptimizer`, and how it is loaded back.

`Checkpoints`, a part of `DispatchOptimizer`: its state is every table's
(state, skip count, hyperparameters, Lookahead window) and the wrapped
optimizers', in one flat list (never the dedup workspaces); a file written
by sparseopt 0.2 (another layout) loads too; a file that matches no layout
is an error, never a partial load.
"""

import keras
import numpy as np
from keras import ops

from sparseopt import backend, compat


class Checkpoints:
    """Saving and loading `DispatchOptimizer`'s state."""

    # Keras' saver would save each wrapped optimizer a second time under its
    # own path (and, loading into an unbuilt one, warn that it skipped it).
    # This optimizer saves their variables itself, in `save_own_variables`.
    __dir__ = compat.unsaved_attributes({
        "optimizer", "_default_optimizer", "_dense_optimizers", "dense_optimizers",
        "_optimizer_map", "_route", "loss_scaling_wrapper", "_scaling_wrapper"})

    def save_own_variables(self, store):
        for i, variable in enumerate(self.state_variables()):
            store[str(i)] = variable.numpy()

    def load_own_variables(self, store):
        """Restores the state saved by `save_own_variables`.

        Loading into an optimizer that is not built yet (`load_weights` right
        after `compile`) keeps the values and assigns them when it is built,
        where Keras' optimizers would drop them with a warning. A checkpoint
        that does not match this optimizer's state is an error, never a
        partial load; one with no optimizer state leaves it as it is.
        """
        values = [np.array(store[str(i)]) for i in range(len(store.keys()))]
        if not values:
            # The file holds no optimizer state (written by a model without an
            # optimizer, or before compile): there is nothing to restore.
            return
        if not self.built:
            self._pending_state = values
            return
        self._assign_state(values)

    def _layouts(self):
        """The saved layouts this optimizer loads: `[[(variable or None, shape)], ...]`.

        Today's (`state_variables()`), then sparseopt 0.2's: no learning rate
        at start, no hyperparameter variables, and the slots a configuration
        never reads (`Updater.unread_slots`, skipped when loading).
        """
        current = self.state_variables()
        blocks = {id(t.saved_variables[0]): t for t in self._trainers.values()}
        legacy, i = [], 0
        while i < len(current):
            variable = current[i]
            trainer = blocks.get(id(variable))
            if trainer is not None:
                legacy += trainer.legacy_saved()
                i += len(trainer.saved_variables)
                continue
            if variable is not self._rate_at_start:
                legacy.append((variable, tuple(variable.shape)))
            i += 1
        return [[(v, tuple(v.shape)) for v in current], legacy]

    def _assign_state(self, values):
        layouts = self._layouts()
        found = [layout for layout in layouts if len(layout) == len(values) and all(
            tuple(shape) == tuple(x.shape) for (_, shape), x in zip(layout, values))]
        if not found:
            saved = self.state_variables()
            want = [(v.path, tuple(v.shape)) for v in saved]
            got = [tuple(x.shape) for x in values]
            raise ValueError(
                f"DispatchOptimizer '{self.name}': the checkpoint's optimizer state "
                f"does not match this optimizer. It holds {len(values)} variables "
                f"of shapes {got}; this optimizer has {want}. Build the model and "
                "compile it exactly as when it was saved (same tables, updaters and "
                "Keras optimizer), or load with `compile=False` / `skip_mismatch` "
                "to start the optimizer afresh."
            )
        with backend.outside_trace():  # TF builds optimizers inside the traced step
            for (variable, _), value in zip(found[0], values):
                if variable is not None:
                    variable.assign(value)
            if found[0] is not layouts[0]:
                # Written before the start rate was kept: the tables trained at
                # their own rates, so they go on from the rate they stopped at.
                rate = self._default_optimizer.learning_rate
                if isinstance(rate, keras.Variable):
                    # A copy (JAX: two variables must not share a buffer the step donates).
                    self._rate_at_start.assign(float(ops.convert_to_numpy(rate.value)))
            for trainer in self._trainers.values():
                trainer.read_hyperparameters()
