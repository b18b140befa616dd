"""Benchmarks the lazy Adam step on a GPU: the library's XLA path against optax.adam and PyTorch on CUDA.

Run from the repository root on a machine with a CUDA GPU and jax's CUDA plugin::

    python benchmarks/gpu.py --json benchmarks/results/gpu.json   # the full run, a few minutes
    python benchmarks/gpu.py --smoke                               # tiny sizes on whatever device there is
    python benchmarks/gpu.py --render benchmarks/results/gpu.json  # the markdown tables of a results file

Each configuration runs in a process of its own (jax keeps the device memory it grew to until its process ends),
its contenders on the same device, each on a float32 table of its own, with a fresh batch of ids each step (a pool
of batches staged on the device beforehand), timed as medians after warm-up, taking turns round by round. The step
must move at least the distinct touched rows of p, m and v (read and write) and their gradient rows (read); the
bandwidth each contender reaches on those bytes is given as a fraction of the device-to-device copy bandwidth
measured in the same run. The headline configurations hold about 10^6 ids a step, so that a step is many
microseconds of memory traffic, not a kernel launch.

Contenders:

- ``osa_fused``: ``osa.update_and_apply(osa.sparse_adam(lr), IndexedRows, ...)``, jitted and donated (on a GPU the
  XLA path, the only one there);
- ``osa_two_calls``: ``tx.update`` and ``osa.apply_updates``, the same step in two calls;
- ``xla_floor``: XLA reading and writing only the distinct rows of p, m and v with gradient rows already summed
  (ids deduplicated and sorted on the host, out of the timing): what any lazy step costs before its own work of
  summing duplicates;
- ``torch_sparse_adam``: ``torch.optim.SparseAdam`` on CUDA with an uncoalesced COO gradient;
- ``optax_adam``: ``optax.adam`` on the dense gradient of the first batch;
- ``torch_adam``: ``torch.optim.Adam(fused=True)`` on CUDA, dense.

A second section times the summation of duplicate ids that the lazy step does first: the library's GPU branch (a
sort, a segmented scan and a scatter that writes each slot once) against a plain scatter-add, on Zipf ids whose hot
rows collide thousands of times (the pattern of jax issue 38806).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import platform
import statistics
import sys
import time
from typing import Any

# Each configuration runs in a child process; jax in this one (the machine's description) must not take the GPU's
# memory from them, as it does by default (75% at its first use).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
from contenders import LEARNING_RATE, Config, JaxStepper, Stepper, TimingPlan, sample_ids, sparse_step, time_steppers

import optax_sparse_adam as osa
from optax_sparse_adam import _coalesce

FULL_CONFIGS = (
    Config(rows=10**7, width=64, batch=2**20, dist="zipf"),
    Config(rows=10**7, width=64, batch=2**20, dist="uniform"),
    Config(rows=10**7, width=128, batch=2**20, dist="uniform"),
    Config(rows=10**6, width=64, batch=2**20, dist="zipf"),
    Config(rows=10**6, width=64, batch=8192, dist="zipf"),  # the CPU benchmark's base configuration
)
SMOKE_CONFIGS = (Config(rows=10**4, width=16, batch=512, dist="zipf"),)
FULL_PLAN = TimingPlan(warmup=4, timed=40, min_timed=5, budget_s=3.0, rounds=5)
SMOKE_PLAN = TimingPlan(warmup=1, timed=2, min_timed=2, budget_s=1.0, rounds=1)
SPARSE = ("osa_fused", "osa_two_calls", "xla_floor", "torch_sparse_adam")
LABELS = {
    "osa_fused": "optax_sparse_adam: update_and_apply",
    "osa_two_calls": "optax_sparse_adam: tx.update + apply_updates",
    "xla_floor": "XLA floor: distinct rows of p, m, v read and written (ids summed beforehand)",
    "torch_sparse_adam": "torch.optim.SparseAdam (CUDA)",
    "optax_adam": "optax.adam (dense)",
    "torch_adam": "torch.optim.Adam(fused=True) (CUDA, dense)",
}


def torch_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def torch_sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def summarize(samples_s: list[float]) -> dict[str, Any]:
    ms = sorted(1e3 * s for s in samples_s)
    return {"median_ms": statistics.median(ms), "min_ms": ms[0], "max_ms": ms[-1], "n": len(ms)}


def copy_bandwidth(nbytes: int) -> dict[str, float]:
    """Device-to-device copy bandwidth of jax and of torch, counting the bytes read and written."""
    n = nbytes // 4
    x = jnp.arange(n, dtype=jnp.float32)
    add = jax.jit(lambda a: a + 1.0)  # one read and one write of every element; not elided as a copy may be
    jax.block_until_ready(add(x))
    times = []
    for _ in range(20):
        start = time.perf_counter()
        jax.block_until_ready(add(x))
        times.append(time.perf_counter() - start)
    del x
    src = torch.ones(n, dtype=torch.float32, device=torch_device())
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch_sync()
    ttimes = []
    for _ in range(20):
        start = time.perf_counter()
        dst.copy_(src)
        torch_sync()
        ttimes.append(time.perf_counter() - start)
    del src, dst
    return {
        "bytes": float(2 * n * 4),
        "jax_gbps": 2 * n * 4 / statistics.median(times) / 1e9,
        "torch_gbps": 2 * n * 4 / statistics.median(ttimes) / 1e9,
    }


class TorchStepper:
    """Runs a torch step and waits for the device."""

    def __init__(self, run: Any):
        self._run = run

    def __call__(self, i: int) -> None:
        self._run(i)
        torch_sync()


@dataclasses.dataclass
class Inputs:
    """One configuration's batches, each on the device once and shared by every contender."""

    cfg: Config
    ids: list[jax.Array]
    values: jax.Array
    floor_rows: list[jax.Array]  # each batch's distinct ids, sorted, padded with ``rows`` (dropped)
    torch_ids: list[torch.Tensor]
    torch_values: torch.Tensor

    @staticmethod
    def make(cfg: Config, ids: list[np.ndarray], values: np.ndarray) -> Inputs:
        floor_rows = []
        for i in ids:
            rows = np.unique(i)
            padded = np.full(cfg.batch, cfg.rows, np.int32)
            padded[: rows.size] = rows
            floor_rows.append(jax.device_put(padded))
        dev = torch_device()
        return Inputs(
            cfg=cfg,
            ids=[jax.device_put(i) for i in ids],
            values=jax.device_put(values),
            floor_rows=floor_rows,
            torch_ids=[torch.from_numpy(i).long().to(dev)[None] for i in ids],
            torch_values=torch.from_numpy(values).to(dev),
        )


def _table(cfg: Config) -> jax.Array:
    return jnp.full((cfg.rows, cfg.width), 0.01, jnp.float32)


def make_osa(x: Inputs, fused: bool) -> Stepper:
    tx, step = sparse_step(x.cfg.rows, fused=fused)
    params = _table(x.cfg)
    inputs = [(i, x.values) for i in x.ids]
    return JaxStepper(jax.jit(step, donate_argnums=(0, 1)), params, tx.init(params), inputs)


def make_xla_floor(x: Inputs) -> Stepper:
    get = {"mode": "fill", "fill_value": 0, "unique_indices": True, "indices_are_sorted": True}
    put = {"mode": "drop", "unique_indices": True, "indices_are_sorted": True}

    def step(params: Any, state: Any, rows: jax.Array, grad: jax.Array) -> Any:
        m, v = state
        p_rows, m_rows, v_rows = params.at[rows].get(**get), m.at[rows].get(**get), v.at[rows].get(**get)
        return params.at[rows].set(p_rows + grad, **put), (
            m.at[rows].set(m_rows + grad, **put),
            v.at[rows].set(v_rows * grad, **put),
        )

    params = _table(x.cfg)
    state = (jnp.zeros_like(params), jnp.zeros_like(params))
    return JaxStepper(jax.jit(step, donate_argnums=(0, 1)), params, state, [(r, x.values) for r in x.floor_rows])


def make_torch_sparse_adam(x: Inputs) -> Stepper:
    param = torch.nn.Parameter(torch.full((x.cfg.rows, x.cfg.width), 0.01, dtype=torch.float32, device=torch_device()))
    opt = torch.optim.SparseAdam([param], lr=LEARNING_RATE)

    def run(i: int) -> None:
        ids = x.torch_ids[i % len(x.torch_ids)]
        param.grad = torch.sparse_coo_tensor(ids, x.torch_values, param.shape, check_invariants=False)
        opt.step()

    return TorchStepper(run)


def make_optax_adam(x: Inputs) -> Stepper:
    grad = jnp.zeros((x.cfg.rows, x.cfg.width), jnp.float32).at[x.ids[0]].add(x.values)
    adam = optax.adam(LEARNING_RATE)

    def step(params: Any, state: Any, grad: jax.Array) -> Any:
        updates, state = adam.update(grad, state, params)
        return optax.apply_updates(params, updates), state

    params = _table(x.cfg)
    return JaxStepper(jax.jit(step, donate_argnums=(0, 1)), params, adam.init(params), [(grad,)])


def make_torch_adam(x: Inputs) -> Stepper:
    param = torch.nn.Parameter(torch.full((x.cfg.rows, x.cfg.width), 0.01, dtype=torch.float32, device=torch_device()))
    opt = torch.optim.Adam([param], lr=LEARNING_RATE, fused=True)
    param.grad = torch.zeros_like(param).index_add_(0, x.torch_ids[0][0], x.torch_values)
    return TorchStepper(lambda i: opt.step())


# Name: (table-sized arrays it holds, its maker). Contenders that fit in --resident-gb together take turns.
CONTENDERS: dict[str, tuple[int, Any]] = {
    "osa_fused": (3, lambda x: make_osa(x, fused=True)),
    "osa_two_calls": (4, lambda x: make_osa(x, fused=False)),
    "xla_floor": (3, make_xla_floor),
    "torch_sparse_adam": (3, make_torch_sparse_adam),
    "optax_adam": (5, make_optax_adam),
    "torch_adam": (4, make_torch_adam),
}


def run_config(
    cfg: Config, plan: TimingPlan, pool: int, seed: int, copy_gbps: float, resident_gb: float
) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    ids = [sample_ids(rng, cfg.rows, cfg.batch, cfg.dist) for _ in range(pool)]
    values = rng.standard_normal((cfg.batch, cfg.width), dtype=np.float32)
    distinct = float(np.mean([np.unique(i).size for i in ids]))
    inputs = Inputs.make(cfg, ids, values)
    groups: list[list[str]] = [[]]
    used = 0
    for name, (tables, _) in CONTENDERS.items():
        need = tables * cfg.table_bytes
        if groups[-1] and used + need > resident_gb * 1e9:
            groups.append([])
            used = 0
        groups[-1].append(name)
        used += need
    results = {}
    for group in groups:
        steppers = {name: CONTENDERS[name][1](inputs) for name in group}
        for name, samples in time_steppers(steppers, plan).items():
            results[name] = summarize(samples)
        del steppers
        release()
    del inputs
    release()
    # Distinct rows of p, m, v read and written, and their summed gradient rows read; the ids and every
    # gradient entry are read once too.
    row_bytes = cfg.width * 4
    must_move = distinct * row_bytes * 7 + cfg.batch * (row_bytes + 4)
    for r in results.values():
        gbps = must_move / (r["median_ms"] * 1e-3) / 1e9
        r["gbps_on_must_move"] = gbps
        r["fraction_of_copy"] = gbps / copy_gbps
    base = results["osa_fused"]["median_ms"]
    return {
        "config": dataclasses.asdict(cfg),
        "label": cfg.label,
        "distinct": distinct,
        "must_move_bytes": must_move,
        "results": results,
        "ratio_to_osa_fused": {n: r["median_ms"] / base for n, r in results.items()},
    }


def duplicate_sums(batch: int, rows: int, width: int, seed: int) -> dict[str, Any]:
    """The library's GPU summation of duplicate ids against one scatter-add, on Zipf ids (many collisions)."""
    rng = np.random.default_rng(seed)
    target = jnp.asarray(sample_ids(rng, rows, batch, "zipf"))
    values = jnp.asarray(rng.standard_normal((batch, width), dtype=np.float32))
    fns = {
        "library (sum_into_slots)": jax.jit(_coalesce.sum_into_slots),
        "scatter-add": jax.jit(lambda t, v: jnp.zeros((rows, width), jnp.float32).at[t].add(v)),
    }
    out: dict[str, Any] = {"batch": batch, "rows": rows, "width": width, "hottest_id_count": 0}
    out["hottest_id_count"] = int(np.bincount(np.asarray(target)).max())
    for name, fn in fns.items():
        jax.block_until_ready(fn(target, values))
        times = []
        for _ in range(20):
            start = time.perf_counter()
            jax.block_until_ready(fn(target, values))
            times.append(time.perf_counter() - start)
        out[name] = summarize(times)
    return out


def release() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def commit() -> str:
    """The checkout's commit, with ``-dirty`` where it has changes."""
    import subprocess

    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return out.stdout.strip()


def machine() -> dict[str, Any]:
    dev = jax.devices()[0]
    info: dict[str, Any] = {
        "jax_device": str(dev.device_kind),
        "jax_platform": dev.platform,
        "jax": jax.__version__,
        "optax": optax.__version__,
        "torch": torch.__version__,
        "torch_device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "python": platform.python_version(),
        "kernel_path": osa.kernel_path(),
    }
    import jaxlib

    info["jaxlib"] = jaxlib.__version__
    return info


def render(doc: dict[str, Any]) -> str:
    """The markdown page of a results file: one section per run (its machine, step times, duplicate sums)."""
    runs = doc.get("runs", [doc])
    lines = [
        "# Benchmark: one step on a GPU",
        "",
        "`python benchmarks/gpu.py --json benchmarks/results/gpu.json` (through `tools/gpu_check.sh`). Float32 "
        "tables, a fresh batch of ids each step from a pool staged on the device, medians after warm-up, the "
        "contenders of a configuration taking turns in one process (since the second run below, each configuration "
        "in a process of its own).",
        "",
        "This page is generated at build time from `benchmarks/results/gpu.json`.",
        "",
    ]
    if "runs" in doc and doc.get("note"):
        lines += [doc["note"], ""]
    for run in runs:
        lines += render_run(run, heading=len(runs) > 1)
    lines += ["Contenders:", ""] + [f"- `{n}`: {label}" for n, label in LABELS.items()] + [""]
    return "\n".join(lines) + "\n"


def render_run(doc: dict[str, Any], heading: bool) -> list[str]:
    """One run's section: its machine and commit, one table of step times, the duplicate sums."""
    m, copy = doc["machine"], doc["copy"]
    lines = [f"## {m['jax_device']}, commit `{doc.get('commit', 'unknown')}`", ""] if heading else []
    lines += [
        f"At commit `{doc.get('commit', 'unknown')}`, on {m['jax_device']} with jax {m['jax']}, jaxlib "
        f"{m['jaxlib']}, optax {m['optax']}, torch {m['torch']}; the library's path: `{m['kernel_path']}` (the "
        "only one on a GPU). Device-to-device copy, bytes read and written: "
        f"{copy['jax_gbps']:,.0f} GB/s through jax, {copy['torch_gbps']:,.0f} GB/s through torch.",
        "",
    ]
    if doc.get("note"):
        lines += [f"Note on this run: {doc['note']}", ""]
    names = list(LABELS)
    lines += [
        "Median step time in ms, its ratio to `update_and_apply`, and for the sparse contenders the fraction of "
        "the measured copy bandwidth they reach on the bytes a lazy step must move (the distinct rows of p, m and "
        "v read and written, their summed gradient rows read, every id and gradient entry read once):",
        "",
        "| configuration | distinct rows | " + " | ".join(f"`{n}`" for n in names) + " |",
        "| --- | ---: | " + " | ".join("---:" for _ in names) + " |",
    ]
    for rec in doc["configs"]:
        cells = []
        for n in names:
            r = rec["results"].get(n)
            if r is None:
                cells.append("not run")
                continue
            cell = f"{r['median_ms']:.3f} ({rec['ratio_to_osa_fused'][n]:.2f}x)"
            if n in SPARSE:
                cell += f", {100 * r['fraction_of_copy']:.0f}%"
            cells.append(cell)
        lines.append(f"| {rec['label']} | {rec['distinct']:,.0f} | " + " | ".join(cells) + " |")
    lines.append("")
    d = doc.get("duplicate_sums")
    if d is None:
        lines.append("The summation of duplicate ids was not timed in this run.")
    else:
        lines.append(
            f"Summing duplicate ids ({d['batch']:,} Zipf ids over {d['rows']:,} rows, width {d['width']}, the "
            f"hottest id {d['hottest_id_count']:,} times), median ms: the library's summation "
            f"{d['library (sum_into_slots)']['median_ms']:.3f}, one scatter-add {d['scatter-add']['median_ms']:.3f}."
        )
    return [*lines, ""]


def sizes(smoke: bool) -> tuple[tuple[Config, ...], TimingPlan, int]:
    """The run's configurations, timing plan and pool of batches: tiny for ``--smoke``, else the full run's."""
    return (SMOKE_CONFIGS, SMOKE_PLAN, 4) if smoke else (FULL_CONFIGS, FULL_PLAN, 8)


def run_part(part: str, smoke: bool, seed: int, resident_gb: float) -> Any:
    """One part of the run, in this process: ``copy``, ``sums`` or a configuration's index."""
    configs, plan, pool = sizes(smoke)
    if part == "copy":
        return copy_bandwidth(2**24 if smoke else 2**31)
    if part == "sums":
        return duplicate_sums(2**10 if smoke else 2**20, 10**4 if smoke else 10**7, 64, seed)
    i = int(part)
    copy_gbps = json.loads(sys.stdin.read())["copy_gbps"]
    return run_config(configs[i], plan, pool, seed + i, copy_gbps, resident_gb)


def in_own_process(part: str, args: argparse.Namespace, stdin: str = "") -> Any:
    """Runs one part in a child process: jax's allocator keeps the device memory it grew to until its process
    ends, so the contenders of one configuration would leave too little for the next (1e7 x 128 ran out of memory
    after the 1e7 x 64 runs)."""
    import subprocess

    cmd = [sys.executable, __file__, "--part", part, "--seed", str(args.seed), "--resident-gb", str(args.resident_gb)]
    # The child's stderr (its progress and any error) goes straight to ours.
    out = subprocess.run(cmd + (["--smoke"] if args.smoke else []), input=stdin, stdout=subprocess.PIPE, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"part {part} failed with exit code {out.returncode}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, a few steps: checks that it all runs")
    parser.add_argument("--json", type=pathlib.Path, help="write the results here")
    parser.add_argument("--render", type=pathlib.Path, help="print the markdown of this results file and exit")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--resident-gb",
        type=float,
        default=36.0,
        help="contenders whose tables fit together in this many GB take turns; the others run after (default 36)",
    )
    parser.add_argument(
        "--configs", help="comma-separated indices of the configurations to run (default: all, then the sums)"
    )
    parser.add_argument("--part", help=argparse.SUPPRESS)  # one part, in a child process: its JSON on stdout
    args = parser.parse_args(argv)
    if args.render:
        print(render(json.loads(args.render.read_text())), end="")
        return
    if args.part is not None:
        print(json.dumps(run_part(args.part, args.smoke, args.seed, args.resident_gb)))
        return
    configs, plan, pool = sizes(args.smoke)
    started = time.perf_counter()
    doc: dict[str, Any] = {
        "smoke": args.smoke,
        "commit": commit(),
        "machine": machine(),
        "plan": dataclasses.asdict(plan),
        "pool": pool,
    }
    print(json.dumps(doc["machine"]), file=sys.stderr)
    doc["copy"] = in_own_process("copy", args)
    copy_gbps = max(doc["copy"]["jax_gbps"], doc["copy"]["torch_gbps"])
    doc["configs"] = []
    chosen = [int(c) for c in args.configs.split(",")] if args.configs else range(len(configs))
    for i in chosen:
        rec = in_own_process(str(i), args, json.dumps({"copy_gbps": copy_gbps}))
        doc["configs"].append(rec)
        print(
            json.dumps({"label": rec["label"], **{n: r["median_ms"] for n, r in rec["results"].items()}}),
            file=sys.stderr,
        )
        if args.json:  # what finished survives a run cut short
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(doc, indent=1))
    doc["duplicate_sums"] = in_own_process("sums", args)
    doc["wall_s"] = time.perf_counter() - started
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1))
    print(render(doc), end="")


if __name__ == "__main__":
    main()
