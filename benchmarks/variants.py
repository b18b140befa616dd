"""Step time of each optimizer variant, and of the optax wrappers around ``sparse_adam``, through both doors.

Each variant runs a jitted step with parameters and state donated on a float32
table of ``--rows x --width`` (bfloat16 for the variants that say so, rounded
stochastically, with a new key each step, for those that say that: ``keys[i]`` of keys split once before the run,
or ``jax.random.fold_in(key, i)`` for the variant that says so, whose threefry XLA:CPU runs as a loop in the step)
with a fresh batch of ``--batch`` Zipf(1.2) ids
every step, through both doors: the two calls (``tx.update`` then
``apply_updates``) and ``update_and_apply``, the two taking turns on the same
table and state, each door with batches of its own (a door given the batch
another door had just taken would find its rows in the cache, and under
catch-up, caught up). The figure is the median of ``--steps`` steps after
``--warmup``; variants and doors take turns ``--block`` steps at a time, so that
slow phases of a shared machine hit them alike (a step taken right after
another function's pays for the switch between the native kernels' threads
and XLA's: about 0.3 ms, which a block of steps leaves to its first), and
each round of blocks starts one variant further on. It also
prints each variant's optimizer-state bytes, and with ``--json`` writes the run
(machine, commit, medians) for the docs' generated page.

A third door, ``update_and_apply`` on each batch's distinct ids (``unique_indices=True``, the floor's kind of
input), compares the step's row pass with the floor on the same kind of input; the gap between the two
``update_and_apply`` columns is what summing the batch's duplicates costs.

Each variant also has its memory floor (``floor.py``, a native kernel that
only reads and writes, once for each distinct id of the batch, the row of p
and of each table-shaped part of the variant's state: p, mu and nu for Adam;
p and one float a row for row-wise Adagrad; p, mu, nu and the last step a
row for catch-up; the ids deduplicated beforehand, out of the timing, so the
floor reads one gradient row per distinct id and sums nothing), timed in the
same turns; where the floor kernel cannot be built (no C++ compiler), or
where jax's default device is not the CPU (the floor is a CPU kernel; on a GPU
the library runs its XLA path and the table is the variants against each
other), that column is left out. A second floor, on the step's own input
(``floor.sum_touch_rows``): given each entry's place among the batch's distinct
ids (computed beforehand, out of the timing), it reads every entry of the batch
once, summing each distinct id's, then each of the id's rows once, so its bytes
are the Zipf batch's; what a step costs above it is finding the grouping
(coalescing the ids) and the optimizer's arithmetic.

    python benchmarks/variants.py --steps 200 --warmup 300 --json benchmarks/results/variants.json
    python benchmarks/variants.py --steps 200 --warmup 300 --json benchmarks/results/variants_gpu.json  # on a GPU
    python benchmarks/variants.py --rows 10000 --steps 5 --warmup 2   # smoke
    python benchmarks/variants.py --only "adamw" --steps 100 --warmup 100   # the plain step and the AdamW variants
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import pathlib
import re
import statistics
import time
from collections.abc import Callable
from typing import Any

import floor  # benchmarks/floor.py: builds its kernel on first use
import jax
import jax.numpy as jnp
import numpy as np
import optax
from contenders import sample_ids
from report import machine_info

import optax_sparse_adam as osa
from optax_sparse_adam import _kernel_path

LR = 1e-3
SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, LR, 100, 100_000)

VARIANTS: dict[str, Callable[[], optax.GradientTransformation]] = {
    "sparse_adam (plain)": lambda: osa.sparse_adam(LR),
    "sparse_adamw": lambda: osa.sparse_adamw(LR, weight_decay=1e-4),
    "sparse_adam, catch_up": lambda: osa.sparse_adam(LR, catch_up=True),
    "sparse_adamw, catch_up": lambda: osa.sparse_adamw(LR, weight_decay=1e-4, catch_up=True),
    # Under a schedule the kernels take the long-idle rows' coefficients per id, and leave those that need steps
    # one by one to the XLA rule.
    "sparse_adam, catch_up, schedule": lambda: osa.sparse_adam(SCHEDULE, catch_up=True),
    "sparse_adamw, catch_up, schedule": lambda: osa.sparse_adamw(SCHEDULE, weight_decay=1e-4, catch_up=True),
    "sparse_amsgrad": lambda: osa.sparse_amsgrad(LR),
    "sparse_amsgrad, catch_up": lambda: osa.sparse_amsgrad(LR, catch_up=True),
    "sparse_rowwise_adam": lambda: osa.sparse_rowwise_adam(LR),
    "sparse_rowwise_adam, per-row bias correction": lambda: osa.sparse_rowwise_adam(LR, per_row_bias_correction=True),
    "sparse_rowwise_adagrad": lambda: osa.sparse_rowwise_adagrad(LR),
    # Element-wise rules (csrc/elementwise.cc), momentum's catch-up among them.
    "sparse_adagrad": lambda: osa.sparse_adagrad(LR),
    "sparse_ftrl": lambda: osa.sparse_ftrl(LR),
    "sparse_sgd(momentum=0.9)": lambda: osa.sparse_sgd(LR, momentum=0.9),
    "sparse_sgd(momentum=0.9), catch_up": lambda: osa.sparse_sgd(LR, momentum=0.9, catch_up=True),
    "sparse_sgd(momentum=0.9), catch_up, schedule": lambda: osa.sparse_sgd(SCHEDULE, momentum=0.9, catch_up=True),
    "inject_hyperparams(sparse_adam)": lambda: optax.inject_hyperparams(osa.sparse_adam)(learning_rate=LR),
    "chain(sparse_aware(clip_by_global_norm), sparse_adam)": lambda: optax.chain(
        osa.sparse_aware(optax.clip_by_global_norm(1.0)), osa.sparse_adam(LR)
    ),
    "chain(sparse_aware(clip_by_global_norm), sparse_rowwise_adagrad)": lambda: optax.chain(
        osa.sparse_aware(optax.clip_by_global_norm(1.0)), osa.sparse_rowwise_adagrad(LR)
    ),
    "multi_transform(sparse_adam)": lambda: optax.multi_transform({"table": osa.sparse_adam(LR)}, "table"),
    "apply_if_finite(sparse_adam)": lambda: optax.apply_if_finite(osa.sparse_adam(LR), 3),
    "osa.apply_if_finite(sparse_adam)": lambda: osa.apply_if_finite(osa.sparse_adam(LR), 3),
    # bfloat16 tables, the optimizers' state in float32 (row-wise Adagrad's and row-wise Adam's nu a float a row)
    "sparse_rowwise_adagrad, bfloat16 table": lambda: osa.sparse_rowwise_adagrad(LR),
    "sparse_rowwise_adagrad, bfloat16 table, stochastic rounding": lambda: osa.sparse_rowwise_adagrad(LR),
    "sparse_rowwise_adam, bfloat16 table, stochastic rounding": lambda: osa.sparse_rowwise_adam(
        LR, mu_dtype=jnp.float32
    ),
    "sparse_rowwise_adam, bfloat16 table, stochastic rounding, key from fold_in": lambda: osa.sparse_rowwise_adam(
        LR, mu_dtype=jnp.float32
    ),
}
# The variants on bfloat16 tables (the rest are float32), and those whose doors round them stochastically: the two
# calls with apply_updates_stochastic, update_and_apply with a key (a new one each step).
BFLOAT16 = {name for name in VARIANTS if "bfloat16" in name}
STOCHASTIC = {name for name in VARIANTS if "stochastic rounding" in name}
# The stochastic variants' step i takes keys[i % STEP_KEYS] of keys split once, but for those that fold i in.
FOLD_IN = {name for name in VARIANTS if "fold_in" in name}
STEP_KEYS = 4096
DOORS = ("two calls", "update_and_apply")
# update_and_apply given the floor's input: each batch's distinct ids (padded with -1, zero rows there), promised
# distinct (unique_indices), so that its ratio to the floor compares the same work's inputs.
DISTINCT = "update_and_apply, distinct ids"
FLOOR = "floor"
# The floor on the step's own batch: every entry read, each id's entries summed (the grouping made beforehand).
FLOOR_ENTRIES = "floor, every entry"


def state_bytes(state: Any) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))


def table_widths(state: Any, rows: int) -> tuple[int, ...]:
    """The row widths of the table-shaped leaves of an optimizer's state (4-byte entries in every variant here: the
    bfloat16 tables' state is float32)."""
    return tuple(math.prod(x.shape[1:]) for x in jax.tree.leaves(state) if x.ndim >= 1 and x.shape[0] == rows)


def make_floor(widths: tuple[int, ...], rows: int) -> tuple[dict[str, Callable[..., Any]], list[Any]]:
    """The floors' jitted, donated steps over float32 tables of these widths (by door: the distinct ids' rows, and
    every entry of the batch grouped by id), and the tables they share; in the doors' calling convention (the
    tables in the first slot, nothing in the second)."""
    threads = _kernel_path.threads()

    @functools.partial(jax.jit, donate_argnums=(0,))
    def touch(tables: tuple[jax.Array, ...], unused: Any, ids: jax.Array, values: jax.Array, i: Any) -> Any:
        return floor.touch_rows(tables, ids, values, threads=threads), unused

    @functools.partial(jax.jit, donate_argnums=(0,))
    def sum_touch(tables: tuple[jax.Array, ...], unused: Any, grouped: Any, values: jax.Array, i: Any) -> Any:
        return floor.sum_touch_rows(tables, *grouped, values, threads=threads), unused

    steps = {FLOOR: touch, FLOOR_ENTRIES: sum_touch}
    return steps, [tuple(jnp.zeros((rows, w), jnp.float32) for w in widths), None]


def make_steppers(
    tx: optax.GradientTransformation,
    rows: int,
    width: int,
    dtype: Any = jnp.float32,
    stochastic: bool = False,
    fold_in: bool = False,
) -> tuple[dict[str, Callable[..., Any]], list[Any]]:
    """A jitted, donated step through each door, and the table and state they take turns on. With ``stochastic``,
    step ``i`` rounds with ``keys[i]`` of keys split once, or with ``fold_in``, with ``fold_in(key, i)``."""
    params = jnp.zeros((rows, width), dtype)
    state = tx.init(params)
    keys = jax.random.split(jax.random.key(0), STEP_KEYS)

    def key(i: jax.Array) -> jax.Array | None:
        if not stochastic:
            return None
        return jax.random.fold_in(jax.random.key(0), i) if fold_in else keys[i % STEP_KEYS]

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def two_calls(params: jax.Array, state: Any, ids: jax.Array, values: jax.Array, i: Any) -> tuple[jax.Array, Any]:
        updates, state = tx.update(osa.IndexedRows(ids, values, rows), state, params)
        if stochastic:
            return osa.apply_updates_stochastic(params, updates, key(i)), state
        return osa.apply_updates(params, updates), state

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def fused(params: jax.Array, state: Any, ids: jax.Array, values: jax.Array, i: Any) -> tuple[jax.Array, Any]:
        return osa.update_and_apply(tx, osa.IndexedRows(ids, values, rows), state, params, key=key(i))

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def distinct(params: jax.Array, state: Any, ids: jax.Array, values: jax.Array, i: Any) -> tuple[jax.Array, Any]:
        grads = osa.IndexedRows(ids, values, rows, unique_indices=True)
        return osa.update_and_apply(tx, grads, state, params, key=key(i))

    return dict(zip((*DOORS, DISTINCT), (two_calls, fused, distinct), strict=True)), [params, state]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=10**6)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--block", type=int, default=10, help="consecutive steps of one variant, timed after the first")
    parser.add_argument("--json", type=pathlib.Path, help="write the run here (benchmarks/results/variants.json)")
    parser.add_argument("--only", help="run the variants whose names match this regular expression (and the plain one)")
    args = parser.parse_args()
    machine = machine_info(threads=0) | {"jax_device": jax.devices()[0].device_kind}

    rng = np.random.default_rng(0)
    # Each door its own fresh batches: door d's step i takes batch i + d * steps_per_door.
    steps_per_door = args.warmup + args.steps
    all_doors = (*DOORS, DISTINCT, FLOOR, FLOOR_ENTRIES)
    pool = [jnp.asarray(sample_ids(rng, args.rows, args.batch, "zipf")) for _ in range(steps_per_door * len(all_doors))]
    values = jnp.asarray(rng.standard_normal((args.batch, args.width), dtype=np.float32))
    uniques = [np.unique(np.asarray(i)) for i in pool]
    distinct = np.mean([u.size for u in uniques])
    # The floor's batches: each batch's distinct ids, padded (-1, skipped) to the batch's length.
    floor_pool = [
        jnp.asarray(np.pad(u, (0, args.batch - u.size), constant_values=-1).astype(np.int32)) for u in uniques
    ]
    # The every-entry floor's batches: each batch's grouping (its distinct ids, and each entry's index among them).
    grouped_pool = [tuple(jnp.asarray(a) for a in floor.group(np.asarray(i))) for i in pool]
    # Their values for the distinct-ids door, made before each step out of the timing: zero on padding, as
    # unique_indices promises.
    zero_padding = jax.jit(lambda ids, values: jnp.where((ids >= 0)[:, None], values, 0.0))
    steppers = {
        name: make_steppers(
            make(),
            args.rows,
            args.width,
            jnp.bfloat16 if name in BFLOAT16 else jnp.float32,
            name in STOCHASTIC,
            name in FOLD_IN,
        )
        for name, make in VARIANTS.items()
        if args.only is None or name == "sparse_adam (plain)" or re.search(args.only, name)
    }
    sizes = {name: state_bytes(held[1]) for name, (_, held) in steppers.items()}
    # p's width in floats: a bfloat16 row moves half the bytes of a float32 one.
    widths = {
        name: (args.width * held[0].dtype.itemsize // 4, *table_widths(held[1], args.rows))
        for name, (_, held) in steppers.items()
    }
    backend = jax.default_backend()
    why_no_floor = floor.unavailable() if backend == "cpu" else f"the floor kernel runs on the CPU only, not {backend}"
    floors = {} if why_no_floor else {w: make_floor(w, args.rows) for w in set(widths.values())}
    if why_no_floor:
        print(f"no floor column: {why_no_floor}")
    doors_of = {name: [*DOORS, DISTINCT, *([FLOOR, FLOOR_ENTRIES] if floors else [])] for name in steppers}
    times: dict[tuple[str, str], list[float]] = {(name, door): [] for name in steppers for door in doors_of[name]}
    names = list(steppers)
    for cycle, start in enumerate(range(0, steps_per_door, args.block)):
        # Each cycle starts one variant further on, so that no variant always follows the same one.
        for name in names[cycle % len(names) :] + names[: cycle % len(names)]:
            doors, held = steppers[name]
            for door in doors_of[name]:
                floor_steps, floor_tables = floors.get(widths[name], ({}, None))
                step, state = (floor_steps[door], floor_tables) if door in floor_steps else (doors[door], held)
                for i in range(start, min(start + args.block, steps_per_door)):
                    batch = {FLOOR: floor_pool, DISTINCT: floor_pool, FLOOR_ENTRIES: grouped_pool}.get(door, pool)
                    ids, vals = batch[i + all_doors.index(door) * steps_per_door], values
                    if door == DISTINCT:
                        vals = jax.block_until_ready(zero_padding(ids, values))
                    t0 = time.perf_counter()
                    state[0], state[1] = step(state[0], state[1], ids, vals, i)
                    jax.block_until_ready(state)
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
        "| variant | two calls (ms) | vs plain fused | update_and_apply (ms) | vs plain fused | "
        "on distinct ids (ms) | floor (ms) | update_and_apply vs floor | on distinct ids vs floor | "
        "floor, every entry (ms) | update_and_apply vs it | optimizer state (MB) |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    records = []
    for name in steppers:
        two, one, uniq = (med[name, door] for door in (*DOORS, DISTINCT))
        low, every = med.get((name, FLOOR)), med.get((name, FLOOR_ENTRIES))
        cells = f"{low:.2f} | {one / low:.2f}x | {uniq / low:.2f}x" if low else "- | - | -"
        cells += f" | {every:.2f} | {one / every:.2f}x" if every else " | - | -"
        print(
            f"| {name} | {two:.2f} | {two / base:.2f}x | {one:.2f} | {one / base:.2f}x | {uniq:.2f} | {cells} | "
            f"{sizes[name] / 1e6:.0f} |"
        )
        record = {"variant": name, "two_calls_ms": two, "fused_ms": one, "distinct_ms": uniq}
        record["state_bytes"] = sizes[name]
        if low:
            record |= {"floor_ms": low, "floor_entries_ms": every, "floor_widths": list(widths[name])}
        records.append(record)
    if args.json:
        machine["load_average_end"] = os.getloadavg()
        settings = vars(args) | {"json": str(args.json), "batches": "per door"}  # each door its own batches
        doc = {"machine": machine, "settings": settings, "distinct": distinct}
        args.json.write_text(json.dumps(doc | {"results": records}, indent=1) + "\n")


if __name__ == "__main__":
    main()
