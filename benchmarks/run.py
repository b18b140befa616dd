"""Benchmarks one lazy Adam step against optax and PyTorch, and writes a report.

Run from the repository root::

    python benchmarks/run.py                   # the full comparison, into benchmarks/results/
    python benchmarks/run.py --smoke --out DIR # tiny sizes, seconds

It measures, in one process so that every ratio compares figures taken side by
side: the machine's memcpy bandwidth; one optimizer step of five contenders
over 1-D sweeps of the grid (table rows, row width, ids per batch, Zipf or
uniform ids) around a base configuration; the compiled sparse step's
temporary memory; that the sparse step compiles once for a fixed batch
capacity; and an end-to-end train step of an embedding model. Results go to
``results.md``, ``results.json`` and PNG plots in the output folder.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import statistics
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import report
import torch
import train_step
from contenders import (
    CONTENDERS,
    Batches,
    Config,
    Contender,
    JaxStepper,
    Stepper,
    TimingPlan,
    make_batches,
    release,
    sample_ids,
    sparse_step,
    time_steppers,
)
from tqdm import tqdm

import optax_sparse_adam as osa

# Bytes one sparse step must move per distinct touched row and float: read the
# gradient, the parameter and both moments, write the parameter and both moments.
TOUCHED_ARRAYS = 7


@dataclasses.dataclass(frozen=True)
class Grid:
    """The configurations to run: 1-D sweeps around ``base``, plus ``extra`` headline configurations."""

    base: Config
    rows: tuple[int, ...]
    rows_uniform: tuple[int, ...]
    widths: tuple[int, ...]
    batches: tuple[int, ...]
    extra: tuple[Config, ...]
    temp_memory: Config
    model: train_step.Model
    pool: int
    plan: TimingPlan
    e2e_plan: TimingPlan
    memcpy_bytes: int

    def sweeps(self) -> dict[str, list[Config]]:
        """Sweep name to its configurations, in sweep order."""
        b = self.base
        return {
            "rows (zipf)": [dataclasses.replace(b, rows=r) for r in self.rows],
            "rows (uniform)": [dataclasses.replace(b, rows=r, dist="uniform") for r in self.rows_uniform],
            "width": [dataclasses.replace(b, width=w) for w in self.widths],
            "batch": [dataclasses.replace(b, batch=k) for k in self.batches],
            "headline": [b, *self.extra],
        }


SWEEPS = ("rows (zipf)", "rows (uniform)", "width", "batch", "headline")

FULL = Grid(
    base=Config(rows=10**6, width=64, batch=8192, dist="zipf"),
    rows=(10**4, 10**5, 10**6, 10**7),
    rows_uniform=(10**4, 10**5, 10**6, 10**7),
    widths=(16, 64, 256),
    batches=(1024, 8192, 65536),
    extra=(Config(rows=10**6, width=128, batch=8192, dist="uniform"),),
    temp_memory=Config(rows=10**7, width=32, batch=8192, dist="zipf"),
    model=train_step.Model(rows=10**6, width=64, hidden=128, examples=1024, bag=8),
    pool=64,  # at least warmup + timed: a fresh batch every step
    plan=TimingPlan(warmup=5, timed=50, min_timed=5, budget_s=4.0, rounds=10),
    e2e_plan=TimingPlan(warmup=3, timed=30, min_timed=5, budget_s=6.0, rounds=5),
    memcpy_bytes=512 * 2**20,
)

SMOKE = Grid(
    base=Config(rows=10**4, width=16, batch=256, dist="zipf"),
    rows=(10**3, 10**4),
    rows_uniform=(10**4,),
    widths=(16,),
    batches=(256,),
    extra=(Config(rows=10**4, width=16, batch=256, dist="uniform"),),
    temp_memory=Config(rows=10**4, width=32, batch=256, dist="zipf"),
    model=train_step.Model(rows=10**4, width=16, hidden=32, examples=32, bag=8),
    pool=4,
    plan=TimingPlan(warmup=1, timed=2, min_timed=2, budget_s=1.0, rounds=1),
    e2e_plan=TimingPlan(warmup=1, timed=2, min_timed=2, budget_s=1.0, rounds=1),
    memcpy_bytes=16 * 2**20,
)


def summarize(samples_s: list[float]) -> dict[str, Any]:
    """Median, spread and the raw samples of step times, in milliseconds."""
    ms = sorted(1e3 * s for s in samples_s)
    q = statistics.quantiles(ms, n=4) if len(ms) > 1 else [ms[0]] * 3
    return {
        "median_ms": statistics.median(ms),
        "min_ms": ms[0],
        "q1_ms": q[0],
        "q3_ms": q[2],
        "n": len(ms),
        "samples_ms": [1e3 * s for s in samples_s],
    }


def memory_groups(contenders: list[Contender], table_bytes: int, resident_bytes: float) -> list[list[Contender]]:
    """Splits contenders, in order, into groups whose tables fit in memory together."""
    groups: list[list[Contender]] = []
    used = 0.0
    for c in contenders:
        need = c.tables * table_bytes
        if groups and used + need <= resident_bytes:
            groups[-1].append(c)
            used += need
        else:
            groups.append([c])
            used = need
    return groups


def run_config(
    cfg: Config, batches: Batches, plan: TimingPlan, args: argparse.Namespace, bar: tqdm
) -> dict[str, dict[str, Any]]:
    """Times every contender on one configuration; dense ones are skipped where they would not fit."""
    results: dict[str, dict[str, Any]] = {}
    runnable = []
    for c in CONTENDERS:
        need = c.tables * cfg.table_bytes
        if c.native and osa.kernel_path() != "native-cpu":
            results[c.name] = {"skipped": "needs the native CPU kernels, which were not built"}
            bar.update()
        elif c.dense and need > args.dense_gb * 1e9:
            results[c.name] = {
                "skipped": f"needs about {c.tables} table-sized arrays ({need / 1e9:.1f} GB), "
                f"over the {args.dense_gb:g} GB allowed to a dense contender"
            }
            bar.update()
        else:
            runnable.append(c)
    for group in memory_groups(runnable, cfg.table_bytes, args.resident_gb * 1e9):
        bar.set_postfix_str(f"{cfg.label}: {', '.join(c.name for c in group)}")
        steppers = {c.name: c.make(cfg, batches) for c in group}
        for name, samples in time_steppers(steppers, plan).items():
            results[name] = summarize(samples)
        del steppers
        release()
        bar.update(len(group))
    return results


def ratios_and_bandwidth(
    cfg: Config, distinct: float, results: dict[str, dict[str, Any]], memcpy_gbps: float
) -> dict[str, Any]:
    """Each contender's time over the sparse path's, and the sparse contenders' achieved bandwidth."""
    touched = distinct * cfg.width * 4 * TOUCHED_ARRAYS
    # The library's default step: the native kernels, or the XLA path where they were not built.
    base_name = "osa_sparse" if "median_ms" in results["osa_sparse"] else "osa_sparse_xla"
    base = results[base_name]["median_ms"]
    ratios = {name: r["median_ms"] / base for name, r in results.items() if "median_ms" in r and name != base_name}
    bandwidth = {}
    for c in CONTENDERS:
        if not c.dense and "median_ms" in results[c.name]:
            gbps = touched / (results[c.name]["median_ms"] * 1e-3) / 1e9
            bandwidth[c.name] = {"gbps": gbps, "fraction_of_memcpy": gbps / memcpy_gbps}
    return {"touched_bytes": touched, "ratios_vs_osa_sparse": ratios, "bandwidth": bandwidth}


def temp_memory(cfg: Config) -> dict[str, Any]:
    """Compiled memory of the donated sparse step, and of ``optax.adam``'s dense step, at ``cfg``'s shapes."""
    table = jax.ShapeDtypeStruct((cfg.rows, cfg.width), jnp.float32)
    ids = jax.ShapeDtypeStruct((cfg.batch,), jnp.int32)
    values = jax.ShapeDtypeStruct((cfg.batch, cfg.width), jnp.float32)
    tx, step = sparse_step(cfg.rows)
    sparse = jax.jit(step, donate_argnums=(0, 1)).lower(table, jax.eval_shape(tx.init, table), ids, values)
    tx, step = sparse_step(cfg.rows, fused=True)
    fused = jax.jit(step, donate_argnums=(0, 1)).lower(table, jax.eval_shape(tx.init, table), ids, values)

    adam = optax.adam(1e-3)

    def dense_step(params: jax.Array, state: Any, grad: jax.Array) -> tuple[jax.Array, Any]:
        updates, state = adam.update(grad, state, params)
        return optax.apply_updates(params, updates), state

    dense = jax.jit(dense_step, donate_argnums=(0, 1)).lower(table, jax.eval_shape(adam.init, table), table)
    out: dict[str, Any] = {"config": dataclasses.asdict(cfg), "table_bytes": cfg.table_bytes}
    for name, lowered in (("osa_sparse", sparse), ("osa_fused", fused), ("optax_adam", dense)):
        stats = lowered.compile().memory_analysis()
        if stats is None:
            raise RuntimeError("this backend does not report the memory of compiled executables")
        out[name] = {
            "temp_bytes": int(stats.temp_size_in_bytes),
            "alias_bytes": int(stats.alias_size_in_bytes),
            "argument_bytes": int(stats.argument_size_in_bytes),
            "output_bytes": int(stats.output_size_in_bytes),
            "temp_fraction_of_table": stats.temp_size_in_bytes / cfg.table_bytes,
        }
    return out


def compiles_once(cfg: Config, seed: int) -> dict[str, Any]:
    """Runs the jitted sparse step on batches of one capacity but very different distinct counts; counts traces."""
    traces = 0
    tx, step = sparse_step(cfg.rows)

    def counted(*args: Any) -> Any:
        nonlocal traces
        traces += 1
        return step(*args)

    rng = np.random.default_rng(seed)
    k = cfg.batch
    half_padding = sample_ids(rng, cfg.rows, k, "zipf")
    half_padding[: k // 2] = -1
    batches = {
        "zipf": sample_ids(rng, cfg.rows, k, "zipf"),
        "uniform": sample_ids(rng, cfg.rows, k, "uniform"),
        "one id repeated": np.full(k, 7, np.int32),
        "half padding": half_padding,
        "all padding": np.full(k, -1, np.int32),
    }
    values = rng.standard_normal((k, cfg.width), dtype=np.float32)
    params = jnp.zeros((cfg.rows, cfg.width), jnp.float32)
    inputs = [(ids, values) for ids in batches.values()]
    stepper = JaxStepper(jax.jit(counted, donate_argnums=(0, 1)), params, tx.init(params), inputs)
    for i in range(len(inputs)):
        stepper(i)
    distinct = {name: int(np.unique(ids[(ids >= 0) & (ids < cfg.rows)]).size) for name, ids in batches.items()}
    return {"config": dataclasses.asdict(cfg), "distinct_per_batch": distinct, "traces": traces}


def end_to_end(grid: Grid, args: argparse.Namespace, bar: tqdm) -> dict[str, Any]:
    """Times the embedding model's train step for each contender, interleaved round by round."""
    model = grid.model
    data = train_step.make_data(model, grid.pool, args.seed)
    bar.set_postfix_str("end-to-end train step")
    steppers: dict[str, Stepper] = {c.name: c.make(model, data) for c in train_step.E2E_CONTENDERS}
    samples = time_steppers(steppers, grid.e2e_plan)
    del steppers
    release()
    bar.update(len(train_step.E2E_CONTENDERS))
    results = {name: summarize(s) for name, s in samples.items()}
    base = results["osa_sparse"]["median_ms"]
    return {
        "model": dataclasses.asdict(model),
        "label": model.label,
        "labels": {c.name: c.label for c in train_step.E2E_CONTENDERS},
        "results": results,
        "ratios_vs_osa_sparse": {n: r["median_ms"] / base for n, r in results.items() if n != "osa_sparse"},
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes and 2 timed steps: checks that it all runs")
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        default=pathlib.Path(__file__).resolve().parent / "results",
        help="output folder (default: benchmarks/results)",
    )
    parser.add_argument(
        "--dense-gb",
        type=float,
        default=6.0,
        help="skip a dense contender where its table-sized arrays would exceed this many GB (default 6)",
    )
    parser.add_argument(
        "--resident-gb",
        type=float,
        default=8.0,
        help="contenders whose tables fit together in this many GB are timed round by round (default 8)",
    )
    parser.add_argument(
        "--sweeps",
        nargs="+",
        choices=SWEEPS,
        default=list(SWEEPS),
        help="run only these sweeps (default: all); the report's other sections are always written",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="threads of every contender: torch.set_num_threads, and the library's kernel threads "
        "(osa.use_kernels(threads=...), at most 16) (default: the core count)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the id batches and the model")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    with osa.use_kernels(True, threads=min(args.threads, 16)):
        run(args)


def run(args: argparse.Namespace) -> None:
    """The whole benchmark, with the threads already set."""
    grid = SMOKE if args.smoke else FULL
    threads = args.threads
    args.out.mkdir(parents=True, exist_ok=True)
    machine = report.machine_info(threads)

    sweeps = {name: cfgs for name, cfgs in grid.sweeps().items() if name in args.sweeps}
    configs = sorted({cfg for sweep in sweeps.values() for cfg in sweep})
    total = 1 + len(configs) * len(CONTENDERS) + 2 + len(train_step.E2E_CONTENDERS)
    started = time.perf_counter()
    with tqdm(total=total, unit="task", dynamic_ncols=True, file=sys.stderr) as bar:
        bar.set_postfix_str("memcpy bandwidth")
        memcpy = report.memcpy_bandwidth(grid.memcpy_bytes)
        bar.update()

        records = []
        for i, cfg in enumerate(configs):
            config_started = time.perf_counter()
            batches = make_batches(cfg, grid.pool, seed=args.seed + i)
            results = run_config(cfg, batches, grid.plan, args, bar)
            records.append(
                {
                    "config": dataclasses.asdict(cfg),
                    "label": cfg.label,
                    "sweeps": [name for name, sweep in sweeps.items() if cfg in sweep],
                    "distinct": batches.distinct,
                    "results": results,
                    **ratios_and_bandwidth(cfg, batches.distinct, results, memcpy["gbps"]),
                    "wall_s": time.perf_counter() - config_started,
                }
            )
            del batches
            release()

        bar.set_postfix_str("temporary memory")
        memory = temp_memory(grid.temp_memory)
        bar.update()
        bar.set_postfix_str("compile once")
        compiles = compiles_once(grid.base, args.seed)
        bar.update()
        e2e_started = time.perf_counter()
        e2e = end_to_end(grid, args, bar)
        e2e["wall_s"] = time.perf_counter() - e2e_started

    machine["load_average_end"] = os.getloadavg()
    doc = {
        "smoke": args.smoke,
        "machine": machine,
        "memcpy": memcpy,
        "settings": {
            "plan": dataclasses.asdict(grid.plan),
            "e2e_plan": dataclasses.asdict(grid.e2e_plan),
            "pool": grid.pool,
            "dense_gb": args.dense_gb,
            "resident_gb": args.resident_gb,
            "seed": args.seed,
            "torch_threads": threads,
            "touched_arrays": TOUCHED_ARRAYS,
            "wall_s": time.perf_counter() - started,
        },
        "contenders": {c.name: c.label for c in CONTENDERS},
        "kernel_path": osa.kernel_path(),
        "base": dataclasses.asdict(grid.base),
        "sweeps": {name: [dataclasses.asdict(c) for c in sweep] for name, sweep in sweeps.items()},
        "configs": records,
        "temp_memory": memory,
        "compiles_once": compiles,
        "end_to_end": e2e,
    }
    report.write_all(doc, args.out)
    print(f"wrote {args.out / 'results.md'}, results.json and plots in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
