"""Step time of each optimizer variant, and of the optax wrappers around ``sparse_adam``, through both doors.

Each variant runs a jitted step with parameters and state donated on a float32
table of ``--rows x --width`` with a fresh batch of ``--batch`` Zipf(1.2) ids
every step, through both doors: the two calls (``tx.update`` then
``apply_updates``) and ``update_and_apply``, the two taking turns on the same
table and state. The figure is the median of ``--steps`` steps after
``--warmup``; variants and doors take turns ``--block`` steps at a time, so that
slow phases of a shared machine hit them alike (a step taken right after
another function's pays for the switch between the native kernels' threads
and XLA's: about 0.3 ms, which a block of steps leaves to its first), and
each round of blocks starts one variant further on. It also
prints each variant's optimizer-state bytes, and with ``--json`` writes the run
(machine, commit, medians) for the docs' generated page.

    python benchmarks/variants.py --steps 200 --warmup 300 --json benchmarks/results/variants.json
    python benchmarks/variants.py --rows 10000 --steps 5 --warmup 2   # smoke
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from contenders import sample_ids
from report import machine_info

import optax_sparse_adam as osa

LR = 1e-3

VARIANTS: dict[str, Callable[[], optax.GradientTransformation]] = {
    "sparse_adam (plain)": lambda: osa.sparse_adam(LR),
    "sparse_adamw": lambda: osa.sparse_adamw(LR, weight_decay=1e-4),
    "sparse_adam, catch_up": lambda: osa.sparse_adam(LR, catch_up=True),
    "sparse_adamw, catch_up": lambda: osa.sparse_adamw(LR, weight_decay=1e-4, catch_up=True),
    "sparse_amsgrad": lambda: osa.sparse_amsgrad(LR),
    "sparse_amsgrad, catch_up": lambda: osa.sparse_amsgrad(LR, catch_up=True),
    "sparse_rowwise_adam": lambda: osa.sparse_rowwise_adam(LR),
    "sparse_rowwise_adam, per-row bias correction": lambda: osa.sparse_rowwise_adam(LR, per_row_bias_correction=True),
    "sparse_rowwise_adagrad": lambda: osa.sparse_rowwise_adagrad(LR),
    "inject_hyperparams(sparse_adam)": lambda: optax.inject_hyperparams(osa.sparse_adam)(learning_rate=LR),
    "chain(sparse_aware(clip_by_global_norm), sparse_adam)": lambda: optax.chain(
        osa.sparse_aware(optax.clip_by_global_norm(1.0)), osa.sparse_adam(LR)
    ),
    "multi_transform(sparse_adam)": lambda: optax.multi_transform({"table": osa.sparse_adam(LR)}, "table"),
    "apply_if_finite(sparse_adam)": lambda: optax.apply_if_finite(osa.sparse_adam(LR), 3),
}
DOORS = ("two calls", "update_and_apply")


def state_bytes(state: Any) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))


def make_steppers(
    tx: optax.GradientTransformation, rows: int, width: int
) -> tuple[dict[str, Callable[..., Any]], list[Any]]:
    """A jitted, donated step through each door, and the table and state they take turns on."""
    params = jnp.zeros((rows, width), jnp.float32)
    state = tx.init(params)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def two_calls(params: jax.Array, state: Any, ids: jax.Array, values: jax.Array) -> tuple[jax.Array, Any]:
        updates, state = tx.update(osa.IndexedRows(ids, values, rows), state, params)
        return osa.apply_updates(params, updates), state

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def fused(params: jax.Array, state: Any, ids: jax.Array, values: jax.Array) -> tuple[jax.Array, Any]:
        return osa.update_and_apply(tx, osa.IndexedRows(ids, values, rows), state, params)

    return dict(zip(DOORS, (two_calls, fused), strict=True)), [params, state]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=10**6)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--block", type=int, default=10, help="consecutive steps of one variant, timed after the first")
    parser.add_argument("--json", type=pathlib.Path, help="write the run here (benchmarks/results/variants.json)")
    args = parser.parse_args()
    machine = machine_info(threads=0)

    rng = np.random.default_rng(0)
    pool = [jnp.asarray(sample_ids(rng, args.rows, args.batch, "zipf")) for _ in range(args.warmup + args.steps)]
    values = jnp.asarray(rng.standard_normal((args.batch, args.width), dtype=np.float32))
    distinct = np.mean([np.unique(np.asarray(i)).size for i in pool])
    steppers = {name: make_steppers(make(), args.rows, args.width) for name, make in VARIANTS.items()}
    sizes = {name: state_bytes(held[1]) for name, (_, held) in steppers.items()}
    times: dict[tuple[str, str], list[float]] = {(name, door): [] for name in steppers for door in DOORS}
    names = list(steppers)
    for cycle, start in enumerate(range(0, len(pool), args.block)):
        # Each cycle starts one variant further on, so that no variant always follows the same one.
        for name in names[cycle % len(names) :] + names[: cycle % len(names)]:
            doors, held = steppers[name]
            for door, step in doors.items():
                for i in range(start, min(start + args.block, len(pool))):
                    t0 = time.perf_counter()
                    held[0], held[1] = step(held[0], held[1], pool[i], values)
                    jax.block_until_ready(held)
                    if i >= args.warmup and (i > start or args.block == 1):
                        times[name, door].append(time.perf_counter() - t0)

    med = {key: statistics.median(ts) * 1e3 for key, ts in times.items()}
    base = med["sparse_adam (plain)", "update_and_apply"]
    print(
        f"{args.rows} x {args.width} float32 table, {args.batch} Zipf(1.2) ids a step "
        f"({distinct:.0f} distinct on average), median of the steps after {args.warmup} (each block's first left out); "
        f"jax {jax.__version__}; ratios to the plain step through update_and_apply"
    )
    print(
        "| variant | two calls (ms) | vs plain fused | update_and_apply (ms) | vs plain fused | optimizer state (MB) |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    records = []
    for name in steppers:
        two, one = med[name, "two calls"], med[name, "update_and_apply"]
        print(f"| {name} | {two:.2f} | {two / base:.2f}x | {one:.2f} | {one / base:.2f}x | {sizes[name] / 1e6:.0f} |")
        records.append({"variant": name, "two_calls_ms": two, "fused_ms": one, "state_bytes": sizes[name]})
    if args.json:
        machine["load_average_end"] = os.getloadavg()
        doc = {"machine": machine, "settings": vars(args) | {"json": str(args.json)}, "distinct": distinct}
        args.json.write_text(json.dumps(doc | {"results": records}, indent=1) + "\n")


if __name__ == "__main__":
    main()
