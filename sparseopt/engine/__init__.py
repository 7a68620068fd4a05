"""The step engine: how one step trains a table, from its record to its rows.

- `stages.py`: the stages, written once (record -> distinct rows and summed
  gradients -> rows and state read -> rule -> written);
- `plans.py`: where they run (one table, a table split by rows, a group);
- `kernels.py`: the native seam (a kernel replacing consecutive stages);
- `trainer.py`: `TableTrainer` and `TableGroup`, what the dispatcher routes to;
- `clipping.py`, `accumulation.py`: `global_clipnorm` and
  `gradient_accumulation_steps` over tables and dense variables.
"""
