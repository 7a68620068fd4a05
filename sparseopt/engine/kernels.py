"""The native seam: where a kernel replaces consecutive stages of a table's step.

A step runs the stages of `sparseopt.backend.contract.STAGES` (`distinct`,
`read`, `rule`, `write`; `sparseopt.engine.stages`). A backend lists its
native kernels (`backend.KERNELS`), each a `Kernel` that names the stages it
does in one call and when it applies, as FBGEMM's rule table says which
rules have a CPU kernel. The engine asks here at each stage boundary; where
no kernel applies, the stages run as written (`keras.ops` and the backend's
pure functions, the reference every kernel matches bit for bit):

- `("distinct",)`: `run(record, num_rows, workspace) -> Distinct` (the native
  dedup and sum: `sparseopt.native`);
- `("read", "rule", "write")`: `run(updater, storage, distinct, values,
  finite)`, the whole row update where `finite` (TensorFlow's fused
  sparse-apply kernels, for the rules whose entry names one:
  `Updater.tf_kernel`).
"""

from sparseopt import backend


def find(stages, **context):
    """The backend's kernel that does exactly `stages` for this step, or None.

    Args:
        stages: the stage names, in order.
        **context: what the kernels' `applies` may look at (`record`,
            `workspace`, `updater`, `storage`).
    """
    for kernel in backend.KERNELS:
        if tuple(kernel.stages) == tuple(stages) and kernel.applies(**context):
            return kernel
    return None
