"""Step time of each optimizer variant next to the plain lazy Adam step.

Each variant runs one jitted step (``tx.update`` then ``apply_updates``, with
parameters and state donated) on a float32 table of ``--rows x --width`` with a
fresh batch of ``--batch`` Zipf(1.2) ids every step; the figure is the median of
``--steps`` steps after ``--warmup``, the variants taking turns ``--block`` steps
at a time, so that slow phases of a shared machine hit them alike (a step taken
right after another variant's pays for the switch between the native kernels'
threads and XLA's: about 0.3 ms, which a block of steps leaves to its first). It also prints each
variant's optimizer-state bytes, and with ``--json`` writes the run (machine,
commit, medians) for the docs' generated page.

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
}


def state_bytes(state: Any) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))


def make_stepper(tx: optax.GradientTransformation, rows: int, width: int) -> tuple[Callable[..., Any], Any]:
    params = jnp.zeros((rows, width), jnp.float32)
    state = tx.init(params)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params: jax.Array, state: Any, ids: jax.Array, values: jax.Array) -> tuple[jax.Array, Any]:
        updates, state = tx.update(osa.IndexedRows(ids, values, rows), state, params)
        return osa.apply_updates(params, updates), state

    return step, [params, state]


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
    steppers = {name: make_stepper(make(), args.rows, args.width) for name, make in VARIANTS.items()}
    sizes = {name: state_bytes(held[1]) for name, (_, held) in steppers.items()}
    times: dict[str, list[float]] = {name: [] for name in steppers}
    for start in range(0, len(pool), args.block):
        for name, (step, held) in steppers.items():
            for i in range(start, min(start + args.block, len(pool))):
                t0 = time.perf_counter()
                held[0], held[1] = step(held[0], held[1], pool[i], values)
                jax.block_until_ready(held)
                if i >= args.warmup and (i > start or args.block == 1):
                    times[name].append(time.perf_counter() - t0)

    base = statistics.median(times["sparse_adam (plain)"])
    print(
        f"{args.rows} x {args.width} float32 table, {args.batch} Zipf(1.2) ids a step "
        f"({distinct:.0f} distinct on average), median of the steps after {args.warmup} (each block's first left out); "
        f"jax {jax.__version__}"
    )
    print("| variant | step (ms) | vs plain | optimizer state (MB) |")
    print("| --- | ---: | ---: | ---: |")
    records = []
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med * 1e3:.2f} | {med / base:.2f}x | {sizes[name] / 1e6:.0f} |")
        records.append({"variant": name, "median_ms": med * 1e3, "state_bytes": sizes[name]})
    if args.json:
        machine["load_average_end"] = os.getloadavg()
        doc = {"machine": machine, "settings": vars(args) | {"json": str(args.json)}, "distinct": distinct}
        args.json.write_text(json.dumps(doc | {"results": records}, indent=1) + "\n")


if __name__ == "__main__":
    main()
