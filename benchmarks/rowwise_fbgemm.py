"""Row-wise Adagrad on one table: the library's fused step against FBGEMM's fused CPU backward, on the same batches.

Run from the repository root::

    python benchmarks/rowwise_fbgemm.py           # into benchmarks/results/rowwise_fbgemm.json
    python benchmarks/rowwise_fbgemm.py --quick   # small tables, a few steps: checks that it all runs

Two configurations: a float32 table of 1e6 x 64 with 8,192 Zipf(1.2) ids a
step (ranks spread over the table by a fixed bijective hash), and one of
1e6 x 128 with 8,192 uniform ids. Each step applies one gradient row per id
(duplicates summed) with row-wise Adagrad (``lr`` 1e-2, ``eps`` 1e-8, the
accumulator starting at 0). The contenders, each on its own table, see the
same sequence of fresh batches and take turns in one process, ``--block``
steps at a time (each block's first ``--settle`` steps left out of the
medians):

- ``library``: ``osa.update_and_apply(osa.sparse_rowwise_adagrad(lr, eps=eps),
  IndexedRows(ids, g, rows), state, table)``, jitted, the table and state
  donated: the native kernel sums each row's duplicates and updates the rows
  in one pass;
- ``fbgemm``: FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen`` with the
  one table (CPU, ``HOST``, ``EXACT_ROWWISE_ADAGRAD``, ``SUM`` pooling, a bag
  per id), its ``backward`` of the same rows timed alone after an untimed
  forward: FBGEMM's backward groups the ids, sums each row's duplicates and
  updates the rows (the optimizer fused into it);
- ``floor``: the benchmark's kernel (``floor.py``) reading and writing each
  distinct touched row of the table and of the accumulator once, the distinct
  ids computed on the host beforehand.

Blocks of 50 steps, the first 20 left out: a contender's steps after
another's block are slower while the caches fill with its own table's rows
again, over some 10 to 20 steps of Zipf ids on a 2-core machine (the library's
most after FBGEMM's); with only a block's first step left out, the medians
held part of that refilling, and changed from run to run. Before timing,
one step of the library and of FBGEMM from the same small table is checked to
agree. FBGEMM and the library's kernels run on
``--threads`` threads (``torch.set_num_threads``, ``osa.use_kernels``);
``OMP_WAIT_POLICY`` is ``PASSIVE`` unless set (PyTorch's OpenMP threads
otherwise spin at their barriers, and collapse on a shared 2-core machine).
Figures are medians after warm-up. Writes ``--json`` and prints a Markdown
table.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch is imported; recorded

import floor
import jax
import jax.numpy as jnp
import numpy as np
import torch
from contenders import Config, fbgemm_unavailable, make_batches, release
from report import machine_info

import optax_sparse_adam as osa

LR, EPS = 1e-2, 1e-8
CONFIGS = (Config(10**6, 64, 8192, "zipf"), Config(10**6, 128, 8192, "uniform"))
QUICK = (Config(20_000, 64, 1024, "zipf"), Config(20_000, 128, 1024, "uniform"))
LABELS = {
    "library": "library `sparse_rowwise_adagrad` (`update_and_apply`)",
    "fbgemm": "FBGEMM TBE `EXACT_ROWWISE_ADAGRAD` (its backward)",
    "floor": "floor (the rows of p and of the accumulator)",
}
# A contender's step i: runs it and returns the seconds it timed.
Timed = Callable[[int], float]


def _tbe(rows: int, width: int, init: np.ndarray | None = None) -> Any:
    """FBGEMM's table-batched embedding with one table on the CPU, row-wise Adagrad fused into its backward."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(rows, width, EmbeddingLocation.HOST, ComputeDevice.CPU)],
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=LR,
        eps=EPS,
        pooling_mode=PoolingMode.SUM,
    )
    if init is not None:
        with torch.no_grad():
            tbe.split_embedding_weights()[0].copy_(torch.from_numpy(init))
    return tbe


def _forward(tbe: Any, ids: torch.Tensor) -> torch.Tensor:
    """A bag per id: the output's row i is the table's row ids[i]; its ``backward(g)`` applies row i of g there."""
    return tbe(ids, torch.arange(ids.numel() + 1, dtype=torch.int64))


def _library_step(rows: int) -> tuple[Any, Callable[..., Any]]:
    tx = osa.sparse_rowwise_adagrad(LR, eps=EPS)

    def step(p: jax.Array, state: Any, ids: jax.Array, g: jax.Array) -> tuple[jax.Array, Any]:
        return osa.update_and_apply(tx, osa.IndexedRows(ids, g, rows), state, p)

    return tx, jax.jit(step, donate_argnums=(0, 1))


def agreement(seed: int = 0) -> float:
    """The largest difference between one step of the library and one of FBGEMM from the same table, ids (with
    duplicates) and gradient rows."""
    rows, width, k = 50, 16, 40
    rng = np.random.default_rng(seed)
    init = rng.standard_normal((rows, width)).astype(np.float32)
    ids = rng.integers(0, rows, k).astype(np.int32)
    g = rng.standard_normal((k, width)).astype(np.float32)
    tbe = _tbe(rows, width, init)
    _forward(tbe, torch.from_numpy(ids.astype(np.int64))).backward(torch.from_numpy(g))
    theirs = tbe.split_embedding_weights()[0].detach().numpy()
    tx, step = _library_step(rows)
    p = jnp.asarray(init)
    ours, _ = step(p, tx.init(p), jnp.asarray(ids), jnp.asarray(g))
    return float(np.abs(np.asarray(ours) - theirs).max())


def _jax_timed(step: Callable[..., Any], tables: list[Any], inputs: list[tuple[jax.Array, ...]], threads: int) -> Timed:
    """A jitted, donated ``step(*tables, *inputs) -> tables``, timed until its results are ready."""

    def run(i: int) -> float:
        with osa.use_kernels(True, threads=threads):
            start = time.perf_counter()
            tables[:] = step(*tables, *inputs[i % len(inputs)])
            jax.block_until_ready(tables)
            return time.perf_counter() - start

    return run


def contenders(
    cfg: Config, ids: list[np.ndarray], values: np.ndarray, threads: int, fbgemm: bool = True
) -> dict[str, Timed]:
    """Each contender's timed step on its own table (FBGEMM's only with ``fbgemm``)."""
    out: dict[str, Timed] = {}
    g = jax.device_put(values)
    with osa.use_kernels(True, threads=threads):
        tx, step = _library_step(cfg.rows)
        p = jnp.zeros((cfg.rows, cfg.width), jnp.float32)
        inputs = [(jax.device_put(i), g) for i in ids]
        out["library"] = _jax_timed(step, [p, tx.init(p)], inputs, threads)
    if fbgemm and fbgemm_unavailable() is None:
        tbe, tg = _tbe(cfg.rows, cfg.width), torch.from_numpy(values)
        tids = [torch.from_numpy(i.astype(np.int64)) for i in ids]

        def backward(i: int) -> float:
            out = _forward(tbe, tids[i % len(tids)])  # untimed
            start = time.perf_counter()
            out.backward(tg)
            return time.perf_counter() - start

        out["fbgemm"] = backward
    if floor.unavailable() is None:

        def touch(p: jax.Array, acc: jax.Array, keys: jax.Array, values: jax.Array) -> tuple[jax.Array, ...]:
            return floor.touch_rows((p, acc), keys, values, threads=threads)

        distinct = [
            np.pad(u, (0, cfg.batch - u.size), constant_values=-1).astype(np.int32) for u in map(np.unique, ids)
        ]
        tables = [jnp.zeros((cfg.rows, cfg.width), jnp.float32), jnp.zeros((cfg.rows,), jnp.float32)]
        inputs = [(jax.device_put(d), g) for d in distinct]
        out["floor"] = _jax_timed(jax.jit(touch, donate_argnums=(0, 1)), tables, inputs, threads)
    return out


def _take_turns(runs: dict[str, Timed], steps: int, warmup: int, block: int, settle: int) -> dict[str, float]:
    """Medians (ms) of each contender's steps, the contenders taking turns in blocks of ``block`` steps (each
    block's first ``settle`` left out), every contender seeing the same fresh batch at each step."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for start in range(0, warmup + steps, block):
        for name, run in runs.items():
            for i in range(start, min(start + block, warmup + steps)):
                seconds = run(i)
                if i >= warmup and i >= start + settle:
                    times[name].append(seconds)
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}


def measure(cfg: Config, steps: int, warmup: int, block: int, settle: int, threads: int, seed: int) -> dict[str, Any]:
    """The contenders taking turns; before that, the library and the floor taking turns without FBGEMM in the
    process (its table not yet made), to show what FBGEMM's steps in between cost them."""
    batches = make_batches(cfg, warmup + steps, seed)
    alone = _take_turns(
        contenders(cfg, batches.ids, batches.values, threads, fbgemm=False), steps, warmup, block, settle
    )
    release()
    med = _take_turns(contenders(cfg, batches.ids, batches.values, threads), steps, warmup, block, settle)
    release()
    return {
        "config": {"rows": cfg.rows, "width": cfg.width, "batch": cfg.batch, "dist": cfg.dist, "label": cfg.label},
        "distinct": batches.distinct,
        "median_ms": med,
        "without_fbgemm_median_ms": alone,
    }


def markdown(doc: dict[str, Any]) -> str:
    """The results as a Markdown table, a row per configuration."""
    names = [n for n in LABELS if any(n in r["median_ms"] for r in doc["runs"])]
    lines = [
        "| configuration | distinct ids | "
        + " | ".join(LABELS[n] for n in names)
        + " | library vs FBGEMM | library vs floor | without FBGEMM: library, floor |",
        "| --- | ---: | " + " | ".join("---:" for _ in names) + " | ---: | ---: | ---: |",
    ]
    for r in doc["runs"]:
        med, alone = r["median_ms"], r["without_fbgemm_median_ms"]
        cells = [f"{med[n]:.2f} ms" if n in med else "" for n in names]
        vs = {o: f"{med['library'] / med[o]:.2f}x" if o in med else "" for o in ("fbgemm", "floor")}
        apart = ", ".join(f"{alone[n]:.2f} ms" for n in ("library", "floor") if n in alone)
        lines.append(
            f"| {r['config']['label']} | {r['distinct']:.0f} | "
            + " | ".join(cells)
            + f" | {vs['fbgemm']} | {vs['floor']} | {apart} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--block", type=int, default=50, help="consecutive steps of one contender")
    parser.add_argument("--settle", type=int, default=20, help="steps of each block left out of the medians")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="small tables and a few steps")
    parser.add_argument(
        "--json", type=pathlib.Path, default=pathlib.Path(__file__).parent / "results" / "rowwise_fbgemm.json"
    )
    args = parser.parse_args()
    if args.quick:
        args.steps, args.warmup, args.settle = 6, 3, 1
    if not 0 <= args.settle < args.block:
        parser.error(f"--settle ({args.settle}) must be at least 0 and less than --block ({args.block})")
    torch.set_num_threads(args.threads)
    machine = machine_info(threads=args.threads) | {"omp_wait_policy": os.environ["OMP_WAIT_POLICY"]}
    why = fbgemm_unavailable()
    doc: dict[str, Any] = {
        "machine": machine,
        "settings": {k: getattr(args, k) for k in ("steps", "warmup", "block", "settle", "threads", "seed")},
        "fbgemm": why or "fbgemm-gpu-cpu",
        "agreement_max_abs_diff": None if why else agreement(args.seed),
        "runs": [],
    }
    for cfg in QUICK if args.quick else CONFIGS:
        doc["runs"].append(measure(cfg, args.steps, args.warmup, args.block, args.settle, args.threads, args.seed))
    doc["machine"]["load_average_end"] = list(os.getloadavg())
    if doc["agreement_max_abs_diff"] is not None:
        print(f"one step from the same table: library and FBGEMM within {doc['agreement_max_abs_diff']:.1e}")
    print(markdown(doc), end="")
    if not args.quick or args.json != parser.get_default("json"):
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
