"""Sparse steps on tables on 4 KiB pages and on 2 MiB pages (``osa.advise_huge_pages``), in one run.

Each contender runs twice, on two copies of its table and state: one left on
the 4 KiB pages XLA's (or PyTorch's) allocator gives it, one moved onto
transparent huge pages after its first step (the library's arrays and
PyTorch's tensors, which ``SparseAdam`` makes at its first step, by the
``madvise`` calls ``osa.advise_huge_pages`` makes). After the timed steps,
the share of each copy on huge pages is read back. The contenders:

- ``osa.update_and_apply`` of ``sparse_adam`` and of ``sparse_rowwise_adagrad``;
- ``sparse_adam``'s two calls (``tx.update``, then ``osa.apply_updates``);
- the memory floor (``floor.py``: the rows of p, mu and nu of each distinct
  id, read and written once, nothing else; the ids deduplicated beforehand);
- ``torch.optim.SparseAdam``.

Every contender sees the same fresh batch of Zipf(1.2) ids at each step (and
the same gradient rows at every step); the contenders take turns ``--block``
steps at a time (each block's first step left out; a contender's two copies
one after the other, which one first alternating from round to round), and
the figure is the median of ``--steps`` steps after ``--warmup``.

    python benchmarks/huge_pages.py --json benchmarks/results/huge_pages.json
    python benchmarks/huge_pages.py --quick   # a small smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import statistics
import time
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch is imported; recorded

import jax
import numpy as np
import torch
from contenders import (
    LEARNING_RATE,
    Config,
    JaxStepper,
    Stepper,
    TorchSparseAdam,
    make_batches,
    make_floor,
    make_osa_fused,
    make_osa_sparse,
    sparse_stepper,
)
from report import machine_info

import optax_sparse_adam as osa
from optax_sparse_adam import _huge_pages

CONFIG = Config(10**6, 64, 8192, "zipf")
QUICK = Config(100_000, 64, 1024, "zipf")
PAGES = ("4 KiB", "2 MiB")


def _floor(cfg: Config, batches: Any) -> JaxStepper:
    """The memory floor (``contenders.make_floor``) on each batch's distinct ids (padded with -1, which it skips):
    the rows of p, mu and nu read and written once per distinct id."""
    distinct = [
        np.pad(u, (0, cfg.batch - u.size), constant_values=-1).astype(np.int32) for u in map(np.unique, batches.ids)
    ]
    return make_floor(cfg, dataclasses.replace(batches, ids=distinct))


def _rowwise_adagrad(cfg: Config, batches: Any) -> JaxStepper:
    return sparse_stepper(cfg, batches, fused=True, tx=osa.sparse_rowwise_adagrad(LEARNING_RATE))


CONTENDERS = {
    "sparse_adam, update_and_apply": make_osa_fused,
    "sparse_adam, two calls": make_osa_sparse,
    "sparse_rowwise_adagrad, update_and_apply": _rowwise_adagrad,
    "floor (p, mu, nu rows)": _floor,
    "torch.optim.SparseAdam": TorchSparseAdam,
}


def _spans(stepper: Stepper) -> list[tuple[int, int]]:
    """``(address, bytes)`` of a contender's table and state."""
    if isinstance(stepper, TorchSparseAdam):
        return [(t.data_ptr(), t.numel() * t.element_size()) for t in stepper.tensors()]
    assert isinstance(stepper, JaxStepper)
    leaves = jax.tree.leaves((stepper._params, stepper._state))
    return [(start, size) for x in leaves for _, start, size in _huge_pages.cpu_buffers(x)]


def measure(cfg: Config, steps: int, warmup: int, block: int) -> dict[str, Any]:
    batches = make_batches(cfg, warmup + steps, seed=0)
    # One gradient block for every step, as in the variants benchmark (a step's gradient rows are fresh from its
    # backward pass, in the cache): one device array shared by the JAX contenders, the NumPy one for torch.
    shared = dataclasses.replace(batches, values=jax.device_put(batches.values))
    runs = {
        (name, pages): make(cfg, batches if make is TorchSparseAdam else shared)
        for name, make in CONTENDERS.items()
        for pages in PAGES
    }
    for (_, pages), run in runs.items():
        run(0)  # compiles, and makes SparseAdam's state
        if pages == PAGES[1]:  # the library's arrays as osa.advise_huge_pages takes them, torch's tensors alike
            _huge_pages.advise_spans(_spans(run))
    times: dict[tuple[str, str], list[float]] = {key: [] for key in runs}
    for n, start in enumerate(range(1, warmup + steps, block)):
        # Each contender's two copies take turns, the one on 4 KiB pages first in every other round.
        order = [(name, PAGES[(j + n) % 2]) for name in CONTENDERS for j in range(2)]
        for key in order:
            for i in range(start, min(start + block, warmup + steps)):
                t0 = time.perf_counter()
                runs[key](i)
                if i >= warmup and i > start:
                    times[key].append(time.perf_counter() - t0)
    results = []
    for name in CONTENDERS:
        record: dict[str, Any] = {"contender": name, "ms": {}, "huge_share": {}}
        for pages in PAGES:
            spans = _spans(runs[name, pages])  # after the timed steps: still where they were advised
            record["ms"][pages] = statistics.median(times[name, pages]) * 1e3
            record["huge_share"][pages] = sum(_huge_pages.huge_bytes(spans)) / sum(n for _, n in spans)
        results.append(record)
    label = {"rows": cfg.rows, "width": cfg.width, "batch": cfg.batch, "dist": cfg.dist}
    return {"config": label, "distinct": batches.distinct, "results": results}


def markdown(doc: dict[str, Any]) -> str:
    cfg = doc["config"]
    lines = [
        f"{cfg['rows']:,} x {cfg['width']} float32 table, {cfg['batch']:,} Zipf(1.2) ids a step "
        f"({doc['distinct']:.0f} distinct on average); median step time in ms",
        "",
        "| contender | 4 KiB pages (ms) | 2 MiB pages (ms) | 4 KiB / 2 MiB | share on 2 MiB pages (each copy) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for r in doc["results"]:
        (small, huge), shares = (r["ms"][p] for p in PAGES), (r["huge_share"][p] for p in PAGES)
        share = ", ".join(f"{x:.0%}" for x in shares)
        lines.append(f"| {r['contender']} | {small:.3f} | {huge:.3f} | {small / huge:.2f}x | {share} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--block", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="a small table and a few steps")
    parser.add_argument("--json", type=pathlib.Path, help="write the run here (benchmarks/results/huge_pages.json)")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.warmup = 6, 3
    torch.set_num_threads(args.threads)
    machine = machine_info(threads=args.threads) | {"omp_wait_policy": os.environ["OMP_WAIT_POLICY"]}
    machine["transparent_hugepage"] = _huge_pages.transparent_huge_pages()
    with osa.use_kernels(True, threads=args.threads):
        run = measure(QUICK if args.quick else CONFIG, args.steps, args.warmup, args.block)
    machine["load_average_end"] = list(os.getloadavg())
    settings = {k: getattr(args, k) for k in ("steps", "warmup", "block", "threads")}
    doc = {"machine": machine, "settings": settings} | run
    print(markdown(doc), end="")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
