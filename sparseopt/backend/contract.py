"""The backend contract: what each backend module provides, written once.

`sparseopt.backend` loads the module of Keras' backend (`jax.py` or
`tensorflow.py`), checks that it defines every name below (none of them
None) and exposes those names, and only those. A capability one backend
lacks is a flag (`SPARSE_GRADIENTS`, `FILLS_IN_BLOCKS`, `ROW_SHARDS`) beside
a function that still does what its entry says where the flag is false.
"""

import dataclasses
from typing import Callable

# The stages of a table's step, in order (`sparseopt.engine.stages`).
STAGES = ("distinct", "read", "rule", "write")


@dataclasses.dataclass(frozen=True)
class Kernel:
    """A native kernel that replaces consecutive stages of a table's step.

    Args:
        name: what it is called in messages and switches.
        stages: the consecutive `STAGES` it does in one call.
        applies: `applies(**context) -> bool`, whether it runs for this step
            (the engine passes what it knows: `record`, `workspace`,
            `updater`, `storage`).
        run: the call; its arguments and result are those of the stages it
            replaces (`sparseopt.engine.kernels` documents each).
    """

    name: str
    stages: tuple
    applies: Callable
    run: Callable

    def __post_init__(self):
        start = STAGES.index(self.stages[0])
        if tuple(self.stages) != STAGES[start:start + len(self.stages)]:
            raise ValueError(f"Kernel '{self.name}': stages {self.stages} are not consecutive "
                             f"stages of {STAGES}.")


# name -> what it is. Functions unless the name is in capitals.
CONTRACT = {
    # The lookup.
    "tap": "`tap(rows, probe, ids, on_backward, aux=None, marks=True)`: identity on `rows`; "
           "its backward pass hands the row cotangent to `on_backward(ids, grads, aux)` and "
           "gives `probe` the cotangent 1 (where `marks`, NaN when the row cotangent is not "
           "finite).",
    "PROBE_IS_WEIGHT": "whether the probe must be a weight of its layer for Keras' train step "
                       "to differentiate it (TF), or can be layer state (JAX).",
    "read_rows": "`read_rows(table, ids)`: the forward lookup, with no gradient to `table`.",
    "read_pooled": "`read_pooled(table, ids, weight, dtype)`: the weighted sum of each bag's "
                   "rows (the last id axis), in `dtype`.",
    "SPARSE_GRADIENTS": "whether a gather's gradient is sparse (TF `IndexedSlices`).",
    "gradient_slices": "`gradient_slices(grad)`: a sparse gradient's `(ids, row grads)`, "
                       "None for a dense one.",
    "gather_from_resource": "`gather_from_resource(variable, ids)`: a gather of a variable's "
                            "rows whose gradient is sparse where `SPARSE_GRADIENTS`.",
    # The step, from record to rows.
    "KERNELS": "the backend's native kernels, a tuple of `Kernel`s (possibly empty), each "
               "replacing consecutive stages of the step where it applies "
               "(`sparseopt.engine.kernels`).",
    "dedup": "`dedup(record, num_rows, workspace)`: the `Distinct` rows of a `RowGrads` "
             "(gradients of equal ids summed, ids outside `[0, num_rows)` dropped, the `count` "
             "distinct ids first): the pure path, and the reference of any dedup kernel.",
    "scratch_workspace": "`scratch_workspace(n)`: a workspace for one `dedup` of ids below "
                         "`n` made inside the traced step (a table without a workspace of "
                         "its own), or None where `dedup` needs a variable (TF).",
    "trimmed": "`trimmed(distinct)`: a `Distinct` as `dedup` gives it: its `count` entries "
               "only where shapes may be dynamic (TF), unchanged (padded) where static (JAX).",
    "WORKSPACE": "whether `dedup` needs `workspace`, a persistent int32 variable with one "
                 "entry per row plus `WORKSPACE_SINK`.",
    "WORKSPACE_SINK": "extra workspace entries (TF: one, where invalid ids write).",
    "dedup_tables": "`dedup_tables(records, num_rows, workspace, dedup)`: one dedup of several "
                    "tables' `RowGrads` (a group; `workspace` has an entry per row of them "
                    "all): a `Stacked` with each table's `Distinct` in its own rows, as its "
                    "own `dedup` would give it. `dedup` is the stage that deduplicates one "
                    "record (the pure path or a kernel), for backends that dedup the tables' "
                    "ids concatenated.",
    "for_distinct_rows": "`for_distinct_rows(update, variables, distinct)`: runs the "
                         "gather-rule-scatter `update(variables, ids, grads)` on the `count` "
                         "distinct entries only (JAX: in chunks of `DISTINCT_CHUNK`).",
    "sum_over_distinct_rows": "`sum_over_distinct_rows(contribute, distinct, num_rows)`: "
                              "`contribute(ids, grads)` (`{name: [U, ...]}`) summed over the "
                              "`count` distinct entries only, in `for_distinct_rows`' chunks "
                              "(whole slots' updates; `num_rows`: the table's).",
    "materialize": "`materialize(values)`: `values` computed before their consumer (keeps the "
                   "rule out of XLA:CPU's scatter loop).",
    "gather": "`gather(value, ids)`: touched rows of an array (ids clamped).",
    "scatter": "`scatter(variable, ids, rows)`: rows written in place (ids past the end "
               "dropped).",
    "scatter_where": "`scatter_where(variable, ids, rows, keep)`: the rows where `keep` "
                     "written in place (the others not written; ids may repeat with equal "
                     "rows).",
    "scatter_min": "`scatter_min(variable, ids, values, keep)`: int32 `variable[ids] = "
                   "min(variable[ids], values)` in place where `keep` (ids may repeat: the "
                   "least value wins).",
    "first_occurrences": "`first_occurrences(high, low, active)`: for int32 `[N]` key "
                         "halves, the position of the first `active` entry with each entry's "
                         "key where `active`, else the entry's own (a hash dedup, no sort).",
    "first_true": "`first_true(mask, k)`: int32 positions of the first (at most) `k` True "
                  "entries of a bool `[N]` mask, in order: `[k]`, -1 past them, where shapes "
                  "are static (JAX); exactly those where they need not be (TF).",
    "for_listed_rows": "`for_listed_rows(update, variables, ids, count)`: runs "
                       "`update(variables, ids)` on the first `count` entries of an int32 "
                       "list; where shapes are static (JAX) in chunks of `DISTINCT_CHUNK` "
                       "that may also hold later entries or repeat earlier ones, so "
                       "`update` must leave out the entries it does not want and write "
                       "nothing new when run twice (TF: exactly the `count` first).",
    "STATEFUL_APPLY": "whether an optimizer step may write any variable (TF); where not "
                      "(JAX's stateless apply), only trainable and optimizer variables.",
    "bitcast": "`bitcast(values, dtype)`: the same bits as another 32-bit dtype (float32 and "
               "uint32, for stochastic rounding).",
    # Tables split by rows over devices (JAX `keras.distribution`).
    "ROW_SHARDS": "whether tables can be split by rows over devices.",
    "row_shards": "`row_shards(variable)`: `(mesh, axis)` where its rows are split over one "
                  "mesh axis, else None (always None where not `ROW_SHARDS`).",
    "on_row_shards": "`on_row_shards(run, shards, variables, record, carried)`: "
                     "`run(blocks, record, carried, first_row)` on each shard, with its blocks "
                     "of `variables` (each split by rows like the table), the ids it owns as "
                     "local rows and `carried` whole; returns the shards' (equal) result.",
    # Replicas that each hold a copy (TF distribution strategies).
    "replica_strategy": "`replica_strategy()`: `(name, replicas, supported)` of a strategy whose "
                        "replicas each run their own copy of the step and hold their own copy "
                        "of each table, or None.",
    "all_replicas": "`all_replicas(record)`: every replica's `RowGrads` of the step, gathered "
                    "(unchanged outside replicas).",
    "sum_over_replicas": "`sum_over_replicas(value)`: a value summed over the replicas.",
    "compiled": "`compiled(fn)`: `fn` (static shapes; Keras variables among its arguments) "
                "run as one compiled program where the backend otherwise runs op by op (TF: "
                "XLA, one program per `fn`, compiled per input shape); `fn` itself where the "
                "whole step is compiled (JAX).",
    "gather_over_replicas": "`gather_over_replicas(values)`: `([each of the arrays values "
                            "(one first dimension N_i), every replica's in replica order], "
                            "where this replica's start)` (`(values, 0)` outside replicas).",
    "replica_id": "`replica_id()`: the replica being traced (0 outside replicas).",
    # Traces and the loop.
    "outside_trace": "`outside_trace()`: a context that runs its block outside any trace, even "
                     "while a train step is being traced (TF builds optimizers there).",
    "trace_token": "`trace_token(value=None)`: equal for everything traced into one function, "
                   "None for eager code (or an eager `value`).",
    "trace_forward": "`trace_forward(model, batch)`: makes lookups learn their ids per step "
                     "before the train step is traced (JAX traces the model on the batch's "
                     "shapes; TF has traced the forward pass already when it builds the "
                     "optimizer).",
    "has_int64": "`has_int64()`: whether int64 arrays exist (JAX: only with "
                 "`jax_enable_x64`).",
    "run_if": "`run_if(pred, fn, variables)`: runs `fn` (assigning some of `variables`) only "
              "where `pred` holds, in place; host calls in `fn` keep program order with the "
              "step's others.",
    "write_rows": "`write_rows(variable, start, rows)`: rows written at a (traced) offset.",
    "at_least_zero": "`at_least_zero(value, message)`: a traced size checked when the step "
                     "runs.",
    "after": "`after(done, value)`: `value`, used only once `done` is computed (a check "
             "that must run before a write: TF runs independent ops in any order).",
    # Tables kept outside the backend's arrays (on disk).
    "host_read": "`host_read(fn, args, outputs)`: `fn(*arrays)` run on the host (NumPy in, "
                 "a tuple of arrays out, of `outputs`' `(shape, dtype)`s), in a trace or "
                 "eagerly; it writes nothing, and runs in program order with every other "
                 "host call, across steps too.",
    "HOST_CALLS_COMPILE": "whether a step with host calls can still be compiled whole (JAX); "
                          "where not (TF: XLA has no `numpy_function`), a layer making them "
                          "says `supports_jit = False`.",
    "host_write": "`host_write(fn, args)`: `fn(*arrays)` run on the host for its effect, "
                  "never dropped from a trace, in program order with every other host call.",
    "number_ids": "`number_ids(ids, num_rows)`: a step's valid int32 ids numbered in the "
                  "order of their last occurrence by a native call compiled into the step "
                  "(`sparseopt.engine.stages._Numbering`'s number, ids_of, positions, count), "
                  "or None where the backend has none here (a host call numbers them).",
    # Building tables.
    "FILLS_IN_BLOCKS": "whether `fill_in_blocks` writes blocks into one buffer in place "
                       "(JAX); where not, it builds the blocks and joins them.",
    "fill_in_blocks": "`fill_in_blocks(make_block, shape, dtype, block_rows)`: an array built "
                      "block by block.",
    "fills_variables_in_blocks": "`fills_variables_in_blocks()`: whether a variable created "
                                 "now can be written block by block in place after it is "
                                 "created (`write_rows`; TF, eager, outside a distribution "
                                 "strategy); False on JAX, whose tables `fill_in_blocks` "
                                 "builds.",
}
