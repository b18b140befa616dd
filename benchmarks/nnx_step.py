"""A jitted Flax training step through each door, against the bare ``update_and_apply`` step on pytrees.

A two-tower model (user and item tables, a dot product), ``value_and_row_grad`` for the gradients, fresh
Zipf batches, ``sparse_adam``; the doors: ``nnx.Optimizer`` (two calls) and ``optax_sparse_adam.nnx.Optimizer``
(fused) in an ``nnx.jit`` step, the fused one also called through ``nnx.cached_partial`` (the Flax guide's
loop); flax's ``TrainState`` (two calls) and ``optax_sparse_adam.linen.TrainState`` (fused) in a ``jax.jit`` step
of the same model in linen; and ``update_and_apply`` on the nnx model's parameter pytree in a ``jax.jit`` step (the
bare door). The doors take turns ``--block`` steps at a time in one process
(each block's first step left out: it pays for switching between jitted functions); medians after ``--warmup``.

    python benchmarks/nnx_step.py --rows 1000000 --width 64 --batch 8192
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.training import train_state

import optax_sparse_adam as osa
from optax_sparse_adam import linen as osa_linen
from optax_sparse_adam import nnx as osa_nnx


class TwoTower(nnx.Module):
    def __init__(self, rows: int, width: int, rngs: nnx.Rngs) -> None:
        self.user = nnx.Embed(rows, width, rngs=rngs)
        self.item = nnx.Embed(rows, width, rngs=rngs)

    def __call__(self, ids: tuple[jax.Array, jax.Array]) -> jax.Array:
        return jnp.sum(self.user(ids[0]) * self.item(ids[1]), axis=1)


class LinenTwoTower(nn.Module):
    users: int
    items: int
    width: int

    @nn.compact
    def __call__(self, ids: tuple[jax.Array, jax.Array]) -> jax.Array:
        user = nn.Embed(self.users, self.width, name="user")(ids[0])
        return jnp.sum(user * nn.Embed(self.items, self.width, name="item")(ids[1]), axis=1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--block", type=int, default=10)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    batches = [
        tuple(jnp.asarray((rng.zipf(1.1, args.batch) - 1) % args.rows, jnp.int32) for _ in range(2)) for _ in range(32)
    ]
    labels = jnp.asarray(rng.standard_normal(args.batch), jnp.float32)
    tx = osa.sparse_adam(1e-3)

    def loss(model: Any, ids: tuple[jax.Array, jax.Array]) -> jax.Array:
        return jnp.mean((model(ids) - labels) ** 2)

    def tables(p: Any) -> tuple[Any, Any]:
        return p["user"]["embedding"], p["item"]["embedding"]

    @nnx.jit(donate_argnums=(0, 1))
    def nnx_step(model: TwoTower, optimizer: nnx.Optimizer, ids: tuple[jax.Array, jax.Array]) -> None:
        graphdef, params = nnx.split(model, nnx.Param)
        _, grads = osa.value_and_row_grad(lambda p, i: loss(nnx.merge(graphdef, p), i), tables)(params, ids)
        optimizer.update(model, grads)

    def nnx_door(cls: type, cached: bool = False) -> Callable[[tuple[jax.Array, jax.Array]], jax.Array]:
        model = TwoTower(args.rows, args.width, nnx.Rngs(0))
        optimizer = cls(model, tx, wrt=nnx.Param)
        # nnx.cached_partial: the model and optimizer's graph traversed once, not at every call.
        step = (
            nnx.cached_partial(nnx_step, model, optimizer) if cached else functools.partial(nnx_step, model, optimizer)
        )

        def run(ids: tuple[jax.Array, jax.Array]) -> jax.Array:
            step(ids)
            return model.user.embedding[...]

        return run

    def bare_door() -> Callable[[tuple[jax.Array, jax.Array]], jax.Array]:
        graphdef, params = nnx.split(TwoTower(args.rows, args.width, nnx.Rngs(0)), nnx.Param)
        params = nnx.to_pure_dict(params)
        held = [params, tx.init(params)]

        @functools.partial(jax.jit, donate_argnums=(0, 1))
        def step(params: Any, state: Any, ids: tuple[jax.Array, jax.Array]) -> tuple[Any, Any]:
            def pure_loss(p: Any, i: tuple[jax.Array, jax.Array]) -> jax.Array:
                return loss(nnx.merge(graphdef, nnx.State(p)), i)

            _, grads = osa.value_and_row_grad(pure_loss, tables)(params, ids)
            return osa.update_and_apply(tx, grads, state, params)

        def run(ids: tuple[jax.Array, jax.Array]) -> jax.Array:
            held[0], held[1] = step(held[0], held[1], ids)
            return held[0]["user"]["embedding"]

        return run

    def linen_door(cls: type) -> Callable[[tuple[jax.Array, jax.Array]], jax.Array]:
        model = LinenTwoTower(args.rows, args.rows, args.width)
        params = model.init(jax.random.key(0), batches[0])
        state = cls.create(apply_fn=model.apply, params=params, tx=tx)
        held = [state.replace(step=jnp.zeros((), jnp.int32))]  # an int step would compile the second step again

        def linen_loss(p: Any, ids: tuple[jax.Array, jax.Array]) -> jax.Array:
            users, items = (t.shape[0] for t in tables(p["params"]))  # the rows looked up (see the Flax guide)
            return loss(lambda i: model.clone(users=users, items=items).apply(p, i), ids)

        @functools.partial(jax.jit, donate_argnums=(0,))
        def step(state: Any, ids: tuple[jax.Array, jax.Array]) -> Any:
            _, grads = osa.value_and_row_grad(linen_loss, lambda p: tables(p["params"]))(state.params, ids)
            return state.apply_gradients(grads=grads)

        def run(ids: tuple[jax.Array, jax.Array]) -> jax.Array:
            held[0] = step(held[0], ids)
            return held[0].params["params"]["user"]["embedding"]

        return run

    doors = {
        "update_and_apply (bare, jax.jit)": bare_door(),
        "nnx.Optimizer (two calls)": nnx_door(nnx.Optimizer),
        "osa.nnx.Optimizer (fused)": nnx_door(osa_nnx.Optimizer),
        "osa.nnx.Optimizer (fused, nnx.cached_partial)": nnx_door(osa_nnx.Optimizer, cached=True),
        "flax TrainState (two calls)": linen_door(train_state.TrainState),
        "osa.linen.TrainState (fused)": linen_door(osa_linen.TrainState),
    }
    times: dict[str, list[float]] = {name: [] for name in doors}
    for start in range(0, args.warmup + args.steps, args.block):
        for name, run in doors.items():
            for i in range(start, start + args.block):
                t0 = time.perf_counter()
                jax.block_until_ready(run(batches[i % len(batches)]))
                if i >= args.warmup and i > start:
                    times[name].append(time.perf_counter() - t0)
    base = 1e3 * float(np.median(times["update_and_apply (bare, jax.jit)"]))
    print(
        f"two {args.rows} x {args.width} float32 tables, {args.batch} Zipf(1.1) ids each a step; jax {jax.__version__}"
    )
    for name, ts in times.items():
        ms = 1e3 * float(np.median(ts))
        print(f"{name:34s} {ms:7.3f} ms  ({ms / base:.2f}x the bare step)")


if __name__ == "__main__":
    main()
