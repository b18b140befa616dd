"""The cost of exact catch-up: ``sparse_adam(catch_up=True)`` against the plain fused ``sparse_adam`` step.

One table, ``update_and_apply`` under ``jit`` with the parameters and state donated, Zipf(1.2) ids
spread over the table as in ``benchmarks/contenders.py``; each contender first trains ``--warmup``
steps, so that its rows have idle histories as in training, then its steps are timed (medians). The
contenders run one after the other in one process.

    python benchmarks/catch_up.py --rows 1000000 --width 64 --batch 8192
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from contenders import sample_ids  # run as a script: benchmarks/ is on the path

import optax_sparse_adam as osa


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    batches = [jnp.asarray(sample_ids(rng, args.rows, args.batch, "zipf").astype(np.int32)) for _ in range(64)]
    values = jnp.asarray(rng.normal(size=(args.batch, args.width)).astype(np.float32))
    medians = {}
    for name, tx in [("plain", osa.sparse_adam(1e-3)), ("catch_up", osa.sparse_adam(1e-3, catch_up=True))]:
        params = jnp.zeros((args.rows, args.width), jnp.float32)
        state = tx.init(params)

        def step(p: jax.Array, s: object, ids: jax.Array, tx: object = tx) -> object:
            return osa.update_and_apply(tx, osa.IndexedRows(ids, values, args.rows), s, p)

        jitted = jax.jit(step, donate_argnums=(0, 1))
        for i in range(args.warmup):
            params, state = jitted(params, state, batches[i % len(batches)])
        jax.block_until_ready(params)
        times = []
        for i in range(args.steps):
            start = time.perf_counter()
            params, state = jitted(params, state, batches[(7 * i + 3) % len(batches)])
            jax.block_until_ready(params)
            times.append(time.perf_counter() - start)
        medians[name] = float(np.median(times)) * 1e3
        print(f"{name}: {medians[name]:.3f} ms median")
    print(f"catch_up / plain: {medians['catch_up'] / medians['plain']:.1f}x")


if __name__ == "__main__":
    main()
