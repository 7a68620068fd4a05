"""What a host call costs a compiled JAX step: Python `io_callback`s beside an XLA FFI call.

    python benchmarks/host_calls.py              # ~1 minute

A table on disk reads and writes its rows from its compiled step through
ordered `jax.experimental.io_callback`s into Python (`sparseopt.backend.jax_host`):
four per step for a `SparseEmbedding` with row-wise Adagrad (the lookup's rows,
the step's ids numbered, the per-row state, the write), until the numbering
became an XLA FFI call on JAX on CPU (three since). This measures what
such calls cost beside the work they do, on one compiled step over a model's
worth of small arrays (40 of 64 x 64, as a dense head and its Adam slots), each
step gathering 32,768 rows of 16 floats from a table of 200,000 (the rows
summed into the step's result):

- `XLA gather`: the table a device array, `jnp.take` in the step;
- `FFI call`: the same gather by sparseopt's native XLA FFI kernel
  (`sparseopt_take_rows`), a call from the compiled program into C++;
- `1 io_callback`: the gather in Python (NumPy) on a host table, one ordered call;
- `4 io_callbacks`: as a table on disk's step makes them: the rows, the ids
  numbered (NumPy's `unique`), the per-row state, and a write of the state back;
- `4 io_callbacks doing nothing`: the same four calls, their results made once
  ahead: what the crossing alone costs;
- `NumPy gather alone, no step`: the host call's own work (the gather), called
  from Python with no compiled step: what a call costs beyond it is crossing.

Prints each variant's median step and its ratio to `XLA gather`, measured in
one process, the variants interleaved over the repeats. An ordered host call
makes JAX run the program through its Python dispatch path (its C++ fast path
skips programs with host callbacks), and each call crosses into Python (the
GIL, arrays handed over as NumPy); an FFI call does neither.
"""

import argparse
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from sparseopt import native

HERE = pathlib.Path(__file__).resolve().parent


def variants(rows, width, batch):
    """`{name: (step function, its first argument)}`: each step takes `(state, ids)`."""
    rng = np.random.default_rng(0)
    host_table = rng.normal(size=(rows, width)).astype(np.float32)
    host_state = np.zeros((rows,), np.float32)
    device_table = jnp.asarray(host_table)
    spec_rows = jax.ShapeDtypeStruct((batch, width), jnp.float32)
    spec_ids = jax.ShapeDtypeStruct((batch,), jnp.int32)
    spec_state = jax.ShapeDtypeStruct((batch,), jnp.float32)

    def head(state, rows_read):
        total = jnp.sum(rows_read)
        return [s * 0.999 + total * 1e-9 for s in state]

    @jax.jit
    def xla(state, ids):
        return head(state, jnp.take(device_table, ids, axis=0))

    def gather(ids):
        return host_table[ids]

    @jax.jit
    def one_call(state, ids):
        return head(state, io_callback(gather, spec_rows, ids, ordered=True))

    def numbered(ids):  # (as the host numbers a step's ids: distinct, in an order)
        uniq = np.unique(ids)
        out = np.zeros(ids.shape, np.int32)
        out[:uniq.size] = uniq
        return out

    def state_of(ids):
        return host_state[ids]

    def write(ids, values):
        host_state[ids] = values

    @jax.jit
    def four_calls(state, ids):
        rows_read = io_callback(gather, spec_rows, ids, ordered=True)
        distinct = io_callback(numbered, spec_ids, ids, ordered=True)
        acc = io_callback(state_of, spec_state, distinct, ordered=True)
        io_callback(write, None, distinct, acc + 1.0, ordered=True)
        return head(state, rows_read)

    # The same four calls doing nothing (results made once, ahead): the crossing alone.
    ready = (np.zeros((batch, width), np.float32), np.zeros((batch,), np.int32),
             np.zeros((batch,), np.float32))

    @jax.jit
    def four_empty(state, ids):
        rows_read = io_callback(lambda i: ready[0], spec_rows, ids, ordered=True)
        distinct = io_callback(lambda i: ready[1], spec_ids, ids, ordered=True)
        acc = io_callback(lambda i: ready[2], spec_state, distinct, ordered=True)
        io_callback(lambda i, v: None, None, distinct, acc + 1.0, ordered=True)
        return head(state, rows_read)

    def numpy_alone(state, ids):  # (no step: the host call's own work, for scale)
        return state if gather(np.asarray(ids)) is not None else None

    out = {"XLA gather": xla}
    if native.available("jax"):  # (the FFI kernels built and registered with XLA)
        from sparseopt.backend import jax_native

        @jax.jit
        def ffi(state, ids):
            return head(state, jax_native.take_rows(device_table, ids))

        out["FFI call"] = ffi
    out["1 io_callback"] = one_call
    out["4 io_callbacks"] = four_calls
    out["4 io_callbacks doing nothing"] = four_empty
    out["NumPy gather alone, no step"] = numpy_alone
    return out


def timed(step, state, ids, steps):
    """Milliseconds per step over `steps` steps (after one to compile)."""
    state = step(state, ids[0])
    jax.block_until_ready(state)
    start = time.perf_counter()
    for k in range(steps):
        state = step(state, ids[k % len(ids)])
    jax.block_until_ready(state)
    return 1e3 * (time.perf_counter() - start) / steps


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--batch", type=int, default=32_768)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(HERE / "results" / "host_calls.json"))
    args = parser.parse_args()
    steps = variants(args.rows, args.width, args.batch)
    rng = np.random.default_rng(1)
    ids = [jnp.asarray(rng.integers(0, args.rows, args.batch, dtype=np.int32))
           for _ in range(8)]
    jax.block_until_ready(ids)
    state = [jnp.ones((64, 64), jnp.float32) for _ in range(40)]
    runs = {name: [] for name in steps}
    for _ in range(args.repeats):  # (interleaved: each repeat measures every variant)
        for name, step in steps.items():
            runs[name].append(timed(step, state, ids, args.steps))
    base = float(np.median(runs["XLA gather"]))
    print(f"a compiled step: 40 arrays of 64 x 64, {args.batch:,} rows of {args.width} "
          f"gathered from {args.rows:,}; median of {args.repeats} x {args.steps} steps")
    print("| variant | step ms (median) | / XLA gather | each run's ms |")
    print("|---|---|---|---|")
    results = []
    for name, times in runs.items():
        median = float(np.median(times))
        results.append({"variant": name, "step_ms": median, "ratio": median / base,
                        "runs_ms": times})
        print(f"| {name} | {median:.3f} | {median / base:.2f}x | "
              f"{', '.join(f'{t:.3f}' for t in times)} |")
    if "FFI call" not in steps:
        print(f"(no FFI row: the native kernels are not built here: "
              f"{native.build_error('jax')})")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    plot(results, out.with_suffix(".png"))


def plot(results, path):
    """Each variant's median step (bars, each run's as points)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.6, 3.0))
    names = [r["variant"] for r in results][::-1]
    ax.barh(names, [r["step_ms"] for r in results][::-1],
            color=["#4c72b0" if "io_callback" not in n else "#dd8452" for n in names])
    for k, r in enumerate(results[::-1]):
        ax.plot(r["runs_ms"], [k] * len(r["runs_ms"]), "|", c="k", ms=8)
    ax.tick_params(axis="y", labelsize=8)
    ax.set_xlabel("step (ms)")
    ax.set_title("a compiled JAX step: its rows from XLA, an FFI call or Python calls",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
