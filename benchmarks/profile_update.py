"""Where the JAX table update's time goes, piece by piece, at two table sizes.

    python benchmarks/profile_update.py              # 1e4 and 2e7 rows
    python benchmarks/profile_update.py 10000 4000000

Pure JAX on the benchmark's batch (16,384 ids from 8,192 hot rows, width 32,
Adagrad-sized state): each piece jitted alone (buffers donated where the
real step updates in place), median of 7 timings of 100 calls. All sizes are
alive at once and timed round-robin.
"""

import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from sparseopt.backend import jax as sparse_jax
from sparseopt.records import RowGrads

D, HOT = 32, 8192
N = int(os.environ.get("PROFILE_IDS", 16_384))  # ids per step


class Case:
    def __init__(self, rows):
        rng = np.random.default_rng(0)
        hot = rng.choice(rows, size=min(HOT, rows), replace=False)
        self.rows = rows
        self.ids = jnp.asarray(hot[rng.integers(0, hot.size, size=N)].astype("int32"))
        self.grads = jnp.asarray(rng.normal(size=(N, D)).astype("float32"))
        self.table = jnp.full((rows, D), 0.01, jnp.float32)
        self.state = jnp.ones((rows, D), jnp.float32)
        self.space = jnp.zeros((rows,), jnp.int32)
        (self.uniq, self.summed, _), _ = _dedup(jnp.zeros((rows,), jnp.int32), self.ids,
                                                self.grads, rows)


def _dedup(space, ids, grads, rows):
    class Var:  # the backend writes its workspace through a variable-like object
        value = space

        def assign(self, v):
            Var.value = v

    out = sparse_jax.dedup(RowGrads(ids, grads), rows, Var())
    return out, Var.value


def _sort_dedup(ids, grads):
    """The previous dedup: sort, then a binary search for each id's slot."""
    ordered = jnp.sort(ids)
    first = jnp.concatenate([jnp.ones((1,), bool), ordered[1:] != ordered[:-1]])
    slot = jnp.where(first, jnp.cumsum(first) - 1, N)
    uniq = jnp.full((N,), 2**30, ids.dtype).at[slot].set(ordered, mode="drop")
    inverse = jnp.searchsorted(uniq, ids, method="scan")
    return uniq, jax.ops.segment_sum(grads, inverse, num_segments=N)


def _adagrad(table, state, uniq, summed):
    rows = jnp.take(table, uniq, axis=0, mode="clip")
    acc = jnp.take(state, uniq, axis=0, mode="clip") + summed * summed
    rows = rows - 0.05 * summed / jnp.sqrt(acc + 1e-7)
    return (table.at[uniq].set(rows, mode="drop", unique_indices=True),
            state.at[uniq].set(acc, mode="drop", unique_indices=True))


def pieces(case):
    """name -> (function, args, donated argument indices)."""
    r = case.rows

    def full(table, state, space, ids, grads):
        (uniq, summed, _), space = _dedup(space, ids, grads, r)
        return (*_adagrad(table, state, uniq, summed), space)

    return {
        "forward gather (16k rows)": (lambda t, i: jnp.take(t, i, axis=0).sum(0),
                                      (case.table, case.ids), ()),
        "dedup, workspace (used)": (lambda s, i, g: _dedup(s, i, g, r)[::-1],
                                    (case.space, case.ids, case.grads), (0,)),
        "dedup, sort + search (before)": (_sort_dedup, (case.ids, case.grads), ()),
        "gather rows + state (7k distinct)": (
            lambda t, s, u: (jnp.take(t, u, axis=0, mode="clip")
                             + jnp.take(s, u, axis=0, mode="clip")).sum(0),
            (case.table, case.state, case.uniq), ()),
        "scatter rows + state (7k distinct)": (
            lambda t, s, u, g: (t.at[u].set(g, mode="drop", unique_indices=True),
                                s.at[u].set(g, mode="drop", unique_indices=True)),
            (case.table, case.state, case.uniq, case.summed), (0, 1)),
        "whole Adagrad update": (full, (case.table, case.state, case.space, case.ids,
                                        case.grads), (0, 1, 2)),
    }


def time_piece(fn, args, donate, calls=100):
    args = list(args)
    out = fn(*args)
    for k, d in enumerate(donate):
        args[d] = out[k]
    jax.block_until_ready(out)
    start = time.perf_counter()
    for _ in range(calls):
        out = fn(*args)
        for k, d in enumerate(donate):
            args[d] = out[k]
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / calls * 1e3, args


def main():
    sizes = [int(s) for s in sys.argv[1:]] or [10_000, 20_000_000]
    cases = [Case(rows) for rows in sizes]
    compiled = {}
    for case in cases:
        for name, (fn, args, donate) in pieces(case).items():
            compiled[(case.rows, name)] = [jax.jit(fn, donate_argnums=donate),
                                           [a + 0 if i in donate else a
                                            for i, a in enumerate(args)], donate, []]
    for _ in range(7):
        for entry in compiled.values():
            ms, entry[1] = time_piece(entry[0], entry[1], entry[2])
            entry[3].append(ms)
    names = list(pieces(cases[0]))
    print("| piece | " + " | ".join(f"{r:,} rows" for r in sizes) + " |")
    print("|---|" + "---|" * len(sizes))
    for name in names:
        print(f"| {name} | " + " | ".join(
            f"{np.median(compiled[(r, name)][3]):.3f} ms" for r in sizes) + " |")


if __name__ == "__main__":
    main()
