"""What carrying the update leaf's known facts saves: the optax-shaped step with and without them.

``python benchmarks/stage_handoff.py``: a 1e6 x 64 float32 table, 8,192 Zipf(1.2) ids a step (a fresh batch each
step), ``sparse_adam`` then ``apply_updates`` under one donated ``jit``. "without" hides the record an update leaf
carries, so the learning-rate stage and ``apply_updates`` validate, normalise and (for the learning rate) sum
duplicates again, as before the record existed. The two variants take turns step by step; medians of 200 steps.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

import optax_sparse_adam as osa
from optax_sparse_adam import _sparse_leaf

ROWS, DIM, IDS, STEPS = 1_000_000, 64, 8192, 200


def make_step(known: bool):
    tx = osa.sparse_adam(1e-3)

    def step(params, state, ids, rows):
        to_leaf = _sparse_leaf.SparseLeaf.to_leaf
        if not known:  # at trace time only: every emitted leaf loses its record

            def without_record(leaf):
                out = to_leaf(leaf)
                object.__delattr__(out, _sparse_leaf._KNOWN_ATTR)
                return out

            _sparse_leaf.SparseLeaf.to_leaf = without_record
        try:
            updates, state = tx.update({"t": osa.IndexedRows(ids, rows, ROWS)}, state, params)
            return osa.apply_updates(params, updates), state
        finally:
            _sparse_leaf.SparseLeaf.to_leaf = to_leaf

    return tx, jax.jit(step, donate_argnums=(0, 1))


def main() -> None:
    rng = np.random.default_rng(0)
    runs = {}
    for known in (True, False):
        tx, step = make_step(known)
        params = {"t": jnp.zeros((ROWS, DIM), jnp.float32)}
        runs[known] = [step, params, tx.init(params), []]
    for i in range(STEPS + 10):
        ids = jnp.asarray(((rng.zipf(1.2, IDS) - 1) % ROWS).astype(np.int32))
        rows = jnp.asarray(rng.standard_normal((IDS, DIM)).astype(np.float32))
        for run in runs.values():
            step, p, s, times = run
            t0 = time.perf_counter()
            p, s = step(p, s, ids, rows)
            jax.block_until_ready(p)
            if i >= 10:
                times.append(time.perf_counter() - t0)
            run[1], run[2] = p, s
    for known, (step, p, s, _) in runs.items():
        compiled = step.lower(p, s, ids, rows).compile()
        text = compiled.as_text()
        counts = ", ".join(f"{op} {text.count(f' {op}(')}" for op in ("while", "scatter", "gather"))
        temp = compiled.memory_analysis().temp_size_in_bytes / 1e6
        print(f"{'with' if known else 'without'} the record: {counts}; temporaries {temp:.2f} MB")
    with_, without = (1e3 * float(np.median(runs[k][3])) for k in (True, False))
    np.testing.assert_array_equal(runs[True][1]["t"], runs[False][1]["t"])
    print(f"median step: with the record {with_:.2f} ms, without {without:.2f} ms ({without / with_:.2f}x)")


if __name__ == "__main__":
    main()
