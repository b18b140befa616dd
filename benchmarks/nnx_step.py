"""A jitted nnx training step: ``nnx.Optimizer`` (two calls) against ``optax_sparse_adam.nnx.Optimizer`` (fused).

A two-tower model (user and item tables, a dot product), ``value_and_row_grad`` for the gradients, fresh
Zipf batches, medians after warm-up; the two optimizers take turns in one process.

    python benchmarks/nnx_step.py --rows 1000000 --width 64 --batch 8192
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import optax_sparse_adam as osa
from optax_sparse_adam import nnx as osa_nnx


class TwoTower(nnx.Module):
    def __init__(self, rows: int, width: int, rngs: nnx.Rngs) -> None:
        self.user = nnx.Embed(rows, width, rngs=rngs)
        self.item = nnx.Embed(rows, width, rngs=rngs)

    def __call__(self, ids: tuple[jax.Array, jax.Array]) -> jax.Array:
        return jnp.sum(self.user(ids[0]) * self.item(ids[1]), axis=1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    batches = [
        tuple(jnp.asarray((rng.zipf(1.1, args.batch) - 1) % args.rows, jnp.int32) for _ in range(2)) for _ in range(32)
    ]
    labels = jnp.asarray(rng.standard_normal(args.batch), jnp.float32)

    def loss(model: TwoTower, ids: tuple[jax.Array, jax.Array]) -> jax.Array:
        return jnp.mean((model(ids) - labels) ** 2)

    @nnx.jit(donate_argnums=(0, 1))
    def step(model: TwoTower, optimizer: nnx.Optimizer, ids: tuple[jax.Array, jax.Array]) -> None:
        graphdef, params = nnx.split(model, nnx.Param)
        tables = lambda p: (p["user"]["embedding"], p["item"]["embedding"])  # noqa: E731
        _, grads = osa.value_and_row_grad(lambda p, i: loss(nnx.merge(graphdef, p), i), tables)(params, ids)
        optimizer.update(model, grads)

    runs = {}
    for name, cls in (("nnx.Optimizer", nnx.Optimizer), ("osa.nnx.Optimizer", osa_nnx.Optimizer)):
        model = TwoTower(args.rows, args.width, nnx.Rngs(0))
        runs[name] = (model, cls(model, osa.sparse_adam(1e-3), wrt=nnx.Param), [])
    for i in range(args.steps):
        for model, optimizer, times in runs.values():
            t0 = time.perf_counter()
            step(model, optimizer, batches[i % len(batches)])
            jax.block_until_ready(model.user.embedding[...])
            times.append(time.perf_counter() - t0)
    base = None
    for name, (_, _, times) in runs.items():
        ms = 1e3 * float(np.median(times[20:]))
        base = base or ms
        print(f"{name:20s} {ms:7.3f} ms  ({ms / base:.2f}x)")


if __name__ == "__main__":
    main()
