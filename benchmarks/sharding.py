"""Row-sharded tables on 8 simulated CPU devices: bytes received, temporaries, numerics, step time.

For each routing of :class:`optax_sparse_adam.RowSharding` and for the plain
``jit`` path (a table ``P("x", None)`` and a replicated optimizer step), one
training step (``value_and_row_grad``, the update, ``apply_updates``) is
compiled and its HLO read: every collective's bytes received per device
(all-gather and all-to-all: the output less the own part; reduce-scatter:
the input, n outputs, less the own part; all-reduce: twice the operand less the own
part, as a ring does it). Collectives inside a ``lax.cond`` are counted for
the branch a step takes without overflow; the other branches (the all-to-all's
second round of buckets, the all-gather fallback) are summed apart;
those inside a loop are counted once per trip and the trips are named.
Temporaries per device come from the compiled ``memory_analysis``. Tables of
1e6 rows are trained for a few steps and compared with one device; tables of
1e8 rows are compiled only. Step times are medians of fresh batches on 8
simulated devices sharing the machine's cores: a sanity check, not a speed
figure.

Many tables (``run_tables``): DLRM's 26 Criteo tables on the all-to-all route,
as 26 separate tables and as one ``EmbeddingCollection(..., shards=8)``
stack, the collectives a step runs and the bytes received per device against
the ids and rows a device must exchange (no padding), at the default
capacity and at ``suggest_capacity``'s, and the steps of fresh Zipf batches
that took a second round or the all-gather route.

Usage: ``python benchmarks/sharding.py [--rows 1e6 1e8] [--steps 20] [--json out.json]``
(``--tables-only`` for the many-tables measurement alone).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import re
import time
from typing import Any

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from dlrm import CARDINALITIES  # noqa: E402  (benchmarks/dlrm.py: the Criteo Kaggle tables)
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from report import machine_info  # noqa: E402

import optax_sparse_adam as osa  # noqa: E402

WIDTH, IDS = 64, 8192
_BYTES = {"f32": 4, "s32": 4, "u32": 4, "pred": 1, "f16": 2, "bf16": 2, "s64": 8, "f64": 8, "u8": 1, "s8": 1}
_SHAPE = re.compile(r"(f32|s32|u32|pred|f16|bf16|s64|f64|u8|s8)\[([0-9,]*)\]")
_COLLECTIVE = re.compile(r"\b(all-reduce|all-gather|all-to-all|reduce-scatter|collective-permute)(-start)?\(")


def _nbytes(text: str) -> int:
    total = 0
    for dtype, dims in _SHAPE.findall(text):
        total += _BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


def _received(line: str, n: int) -> int:
    """Bytes one device receives for one HLO collective instruction."""
    kind = _COLLECTIVE.search(line).group(1)  # type: ignore[union-attr]
    lhs, rhs = line.split("=", 1)
    out = _nbytes(rhs.split(kind)[0]) or _nbytes(lhs)
    if kind == "all-reduce":
        return 2 * out * (n - 1) // n
    if kind == "reduce-scatter":  # the input is n outputs
        return out * (n - 1)
    if kind == "collective-permute":
        return out
    return out * (n - 1) // n  # all-gather, all-to-all


def collective_bytes(hlo: str, n: int) -> dict[str, Any]:
    """Bytes received per device: the no-overflow path, the branches taken on overflow (summed), and per loop
    trip."""
    comps: dict[str, list[str]] = {}
    name = None
    entry = None
    for line in hlo.splitlines():
        m = re.match(r"^(ENTRY )?%?([\w.\-]+) ", line)
        if m and line.rstrip().endswith("{"):
            name = m.group(2)
            comps[name] = []
            if m.group(1):
                entry = name
        elif name is not None:
            comps[name].append(line)
    assert entry is not None

    out: dict[str, Any] = {"path": 0, "fallback": 0, "per_trip": 0, "kinds": {}, "path_counts": {}}

    def walk(comp: str, where: str) -> None:
        for line in comps.get(comp, []):
            if _COLLECTIVE.search(line) and "-done" not in line.split("=", 1)[-1][:40]:
                b = _received(line, n)
                out[where] += b
                kind = _COLLECTIVE.search(line).group(1)  # type: ignore[union-attr]
                out["kinds"][kind] = out["kinds"].get(kind, 0) + b
                if where == "path":  # collectives a step without overflow runs
                    out["path_counts"][kind] = out["path_counts"].get(kind, 0) + 1
            m = re.search(r"branch_computations=\{([^}]*)\}", line)
            if m:
                branches = [b.strip().lstrip("%") for b in m.group(1).split(",")]
                walk(branches[0], where)  # lax.cond(pred, fallback, common): index 0 is pred False
                for b in branches[1:]:
                    walk(b, "fallback")
                continue
            m = re.search(r"true_computation=%?([\w.\-]+), false_computation=%?([\w.\-]+)", line)
            if m:
                walk(m.group(2), where)
                walk(m.group(1), "fallback")
                continue
            m = re.search(r"body=%?([\w.\-]+)", line)
            if m:
                walk(m.group(1), "per_trip")
            for callee in re.findall(r"(?:to_apply|calls)=%?([\w.\-]+)", line):
                if not _COLLECTIVE.search(line):
                    walk(callee, where)

    walk(entry, "path")
    return out


def _zipf_ids(rng: np.random.Generator, rows: int, k: int, perm: np.ndarray | None) -> np.ndarray:
    ranks = np.minimum(rng.zipf(1.2, k) - 1, rows - 1)
    return (ranks if perm is None else perm[ranks]).astype(np.int32)


def loss_fn(p: Any, ids: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((p["emb"][ids] @ p["w"] - y) ** 2)


def build(variant: str, mesh: Any, tx: Any) -> Any:
    """A jitted step for one variant, taking (params, state, ids, y)."""
    if variant == "plain jit":

        def step(p: Any, s: Any, ids: jax.Array, y: jax.Array) -> Any:
            _, g = osa.value_and_row_grad(loss_fn, lambda p: p["emb"])(p, ids, y)
            u, s = tx.update(g, s, p)
            return osa.apply_updates(p, u), s, jnp.zeros((), jnp.int32)

        return jax.jit(step, donate_argnums=(0, 1))
    batch_axis = None if variant == "replicated ids" else "x"
    routing = "all_gather" if variant == "all-gather" else "all_to_all"
    rs = osa.RowSharding(mesh, "x", lambda p: p["emb"], batch_axis=batch_axis, routing=routing)

    def routed(p: Any, s: Any, ids: jax.Array, y: jax.Array) -> Any:
        _, g, info = rs.value_and_row_grad(loss_fn)(p, ids, y)
        u, s = rs.update(tx, g, s, p)
        return rs.apply_updates(p, u), s, info.overflow

    return jax.jit(routed, donate_argnums=(0, 1))


VARIANTS = ["plain jit", "replicated ids", "all-gather", "all-to-all"]


def run(rows: int, dist: str, steps: int, execute: bool) -> list[dict[str, Any]]:
    mesh = jax.make_mesh((8,), ("x",))
    tx = osa.sparse_adam(1e-3)
    n = 8
    table_sh = NamedSharding(mesh, P("x", None))
    rep = NamedSharding(mesh, P())
    abstract = {
        "emb": jax.ShapeDtypeStruct((rows, WIDTH), jnp.float32, sharding=table_sh),
        "w": jax.ShapeDtypeStruct((WIDTH,), jnp.float32, sharding=rep),
    }
    results = []
    rng = np.random.default_rng(0)
    perm = rng.permutation(rows).astype(np.int32) if dist == "zipf" and execute else None
    batches = []
    if execute:
        for _ in range(steps + 5):
            ids = _zipf_ids(rng, rows, IDS, perm) if dist == "zipf" else rng.integers(0, rows, IDS).astype(np.int32)
            batches.append((ids, rng.standard_normal(IDS).astype(np.float32)))
    reference = None
    for variant in VARIANTS:
        step = build(variant, mesh, tx)
        batch_sh = NamedSharding(mesh, P(None if variant == "replicated ids" else "x"))
        ids_abs = jax.ShapeDtypeStruct((IDS,), jnp.int32, sharding=batch_sh)
        y_abs = jax.ShapeDtypeStruct((IDS,), jnp.float32, sharding=batch_sh)
        state_abs = jax.eval_shape(tx.init, abstract)
        specs = osa.RowSharding(mesh, "x", lambda p: p["emb"]).state_specs(tx, state_abs, abstract)
        state_abs = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s)), state_abs, specs
        )
        compiled = step.lower(abstract, state_abs, ids_abs, y_abs).compile()
        comm = collective_bytes(compiled.as_text(), n)
        mem = compiled.memory_analysis()
        row = {
            "rows": rows,
            "ids": dist,
            "variant": variant,
            "recv_bytes": comm["path"],
            "recv_fallback_bytes": comm["fallback"],
            "recv_per_loop_trip_bytes": comm["per_trip"],
            "collectives": comm["kinds"],
            "temp_bytes": mem.temp_size_in_bytes,
        }
        if execute:
            init = {
                "emb": np.random.default_rng(1).standard_normal((rows, WIDTH)).astype(np.float32) * 0.01,
                "w": np.ones(WIDTH, np.float32),
            }
            params = jax.device_put(init, {"emb": table_sh, "w": rep})
            state = tx.init(params)
            times, overflow = [], 0
            for i, (ids, y) in enumerate(batches):
                ids_d, y_d = jax.device_put(ids, batch_sh), jax.device_put(y, batch_sh)
                jax.block_until_ready((ids_d, y_d))
                t0 = time.perf_counter()
                params, state, o = compiled(params, state, ids_d, y_d)
                jax.block_until_ready(params)
                if i >= 5:
                    times.append(time.perf_counter() - t0)
                overflow += int(o)
            row["step_ms"] = 1e3 * float(np.median(times))
            row["overflow_total"] = overflow
            final = (np.asarray(params["emb"]), np.asarray(state[0].mu["emb"]))
            if reference is None:
                reference = _one_device(init, tx, batches)
            row["max_abs_diff_table"] = float(np.max(np.abs(final[0] - reference[0])))
            row["max_abs_diff_mu"] = float(np.max(np.abs(final[1] - reference[1])))
            row["bitwise_table"] = bool(np.array_equal(final[0], reference[0]))
            del params, state
        results.append(row)
        print(json.dumps(row), flush=True)
    return results


def _table_batch(rng: np.random.Generator, rows: list[int], perms: list[np.ndarray], batch: int) -> dict[str, Any]:
    """One id per example and table: Zipf(1.15) ranks scattered over each table by its permutation (as
    examples/dlrm.py draws them)."""
    return {f"t{t}": perms[t][(rng.zipf(1.15, batch) - 1) % n].astype(np.int32) for t, n in enumerate(rows)}


def ideal_bytes(ids: dict[str, np.ndarray], rows: list[int], n: int, width: int) -> float:
    """Bytes a device receives in a step with no padding, averaged over the devices: as an owner, each distinct id
    another device asks of it (4 bytes) and that id's gradient row; as a requester, the row of each of its distinct
    ids another device owns (float32 rows of ``width``)."""
    total = 0
    for t, r in enumerate(rows):
        shares = np.array_split(ids[f"t{t}"], n)  # each device's share of the batch, as batch_axis splits it
        for d, share in enumerate(shares):
            owners = np.unique(share) // (r // n)
            remote = int(np.count_nonzero(owners != d))
            total += remote * (4 + 4 * width) + remote * 4 * width  # the owners receive ids and grads; d the rows
    return total / n


def run_tables(max_rows: int, width: int, batch: int, steps: int, record: int, count: int = 26) -> dict[str, Any]:
    """DLRM's 26 tables (the first ``count``, capped at ``max_rows``) on the all-to-all route, one id per example
    and table, laid out two ways: separate tables (each its own buckets) and an :class:`EmbeddingCollection` with
    ``shards=8`` (one stack, each device a share of every table, one bucket per owner for all). For each, the
    compiled step's collectives and bytes received per device (the common path), against :func:`ideal_bytes` over
    fresh batches, at the default capacity and at :meth:`RowSharding.suggest_capacity` learned from ``record``
    other batches; and over ``steps`` fresh batches, the steps that overflowed into a second round or fell back to
    the all-gather route."""
    n = 8
    mesh = jax.make_mesh((n,), ("x",))
    rows = [-(-min(c, max_rows) // n) * n for c in CARDINALITIES[:count]]  # capped, padded to a multiple of 8 rows
    rng = np.random.default_rng(0)
    perms = [rng.permutation(r).astype(np.int32) for r in rows]
    names = [f"t{t}" for t in range(len(rows))]
    tables = {k: rng.standard_normal((r, width)).astype(np.float32) * 0.01 for k, r in zip(names, rows, strict=True)}
    w = np.ones(width, np.float32)
    coll = osa.EmbeddingCollection({k: osa.TableSpec(r, width) for k, r in zip(names, rows, strict=True)}, shards=n)
    stacked = {k: np.array(v) for k, v in coll.init(jax.random.key(0)).items()}
    (stack_name,) = stacked
    for k in names:  # the same rows as the separate tables, in the stack's layout
        stacked[stack_name][np.asarray(coll.stack_ids(k, np.arange(tables[k].shape[0])))] = tables[k]
    bags = jax.jit(coll.bags)

    def loss(p: Any, ids: Any, y: jax.Array) -> jax.Array:
        pooled = sum(p["tables"][k][ids[k]] for k in names)
        return jnp.mean((pooled @ p["w"] - y) ** 2)

    def loss_stacked(p: Any, bags: Any, y: jax.Array) -> jax.Array:
        pooled = sum(coll.pool(p["emb"], bags).values())
        return jnp.mean((pooled @ p["w"] - y) ** 2)

    layouts = {
        f"{len(rows)} tables": (
            {"tables": tables, "w": w},
            osa.RowSharding(mesh, "x", lambda p: p["tables"], batch_axis="x", routing="all_to_all"),
            loss,
            lambda ids: ids,
        ),
        "collection, shards=8": (
            {"emb": stacked, "w": w},
            osa.RowSharding(mesh, "x", lambda p: p["emb"], batch_axis="x", routing="all_to_all"),
            loss_stacked,
            lambda ids: bags(ids),
        ),
    }
    tx = osa.sparse_adam(1e-3)
    recorded = [_table_batch(rng, rows, perms, batch) for _ in range(record)]
    batches = [
        (_table_batch(rng, rows, perms, batch), rng.standard_normal(batch).astype(np.float32)) for _ in range(steps)
    ]
    ideal = float(np.mean([ideal_bytes(ids, rows, n, width) for ids, _ in batches]))
    out: dict[str, Any] = {
        "tables": len(rows),
        "rows": rows,
        "width": width,
        "batch": batch,
        "ideal_recv_bytes": ideal,
        "recorded_batches": record,
        "runs": [],
    }
    batch_sh = NamedSharding(mesh, P("x"))
    for layout, (init, base, fn, as_ids) in layouts.items():
        suggested = base.suggest_capacity(init, [as_ids(ids) for ids in recorded])
        for label, capacity in (("default", None), ("suggested", suggested)):
            rs = dataclasses.replace(base, capacity=capacity)

            @functools.partial(jax.jit, donate_argnums=(0, 1))
            def step(p: Any, s: Any, ids: Any, y: jax.Array, rs: osa.RowSharding = rs, fn: Any = fn) -> Any:
                _, g, info = rs.value_and_row_grad(fn)(p, ids, y)
                u, s = rs.update(tx, g, s, p)
                return rs.apply_updates(p, u), s, info

            params = rs.shard(init)
            state = tx.init(params)
            put = [(jax.device_put(as_ids(ids), batch_sh), jax.device_put(y, batch_sh)) for ids, y in batches]
            compiled = step.lower(params, state, *put[0]).compile()  # measured and run: compiled once
            comm = collective_bytes(compiled.as_text(), n)
            second = fallback = overflow = 0
            times = []
            for i, (ids, y) in enumerate(put):
                t0 = time.perf_counter()
                params, state, info = compiled(params, state, ids, y)
                jax.block_until_ready(params)
                if i:
                    times.append(time.perf_counter() - t0)
                second += int(info.second_round)
                fallback += int(info.fallback)
                overflow += int(info.overflow)
            run = {
                "layout": layout,
                "capacity": label,
                "capacity_value": capacity,
                "recv_bytes": comm["path"],
                "recv_fallback_bytes": comm["fallback"],
                "vs_ideal": comm["path"] / ideal,
                "collectives_on_path": comm["path_counts"],
                "steps": len(batches),
                "second_round_steps": second,
                "fallback_steps": fallback,
                "overflowed_ids": overflow,
                "step_ms": 1e3 * float(np.median(times)) if times else None,
            }
            out["runs"].append(run)
            print(json.dumps(run), flush=True)
            del params, state
    return out


def _one_device(init: Any, tx: Any, batches: Any) -> tuple[np.ndarray, np.ndarray]:
    dev = jax.devices()[0]

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(p: Any, s: Any, ids: jax.Array, y: jax.Array) -> Any:
        _, g = osa.value_and_row_grad(loss_fn, lambda p: p["emb"])(p, ids, y)
        u, s = tx.update(g, s, p)
        return osa.apply_updates(p, u), s

    params = jax.device_put(init, dev)
    state = tx.init(params)
    for ids, y in batches:
        params, state = step(params, state, jax.device_put(ids, dev), jax.device_put(y, dev))
    return np.asarray(params["emb"]), np.asarray(state[0].mu["emb"])


def on_paper(n: int, ids_per_device: int, width: int = WIDTH) -> dict[str, float]:
    """Bytes received per device per step, from the routing's message sizes, for a float32 table."""
    k_global = n * ids_per_device
    share = ids_per_device / n
    capacity = min(ids_per_device, math.ceil(share + 4 * math.sqrt(share) + 4))
    slots = n * capacity
    f = (n - 1) / n
    return {
        "devices": n,
        "ids_per_device": ids_per_device,
        "replicated ids": 2 * k_global * width * 4 * f,  # all-reduce of the rows looked up
        "all-gather": k_global * (2 * width + 1) * 4 * f,  # ids; rows reduce-scattered; grads all-gathered
        "all-to-all": slots * (2 * width + 1) * 4 * f,  # ids, rows, grads through the buckets
        "all-to-all capacity": capacity,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", type=float, default=[1e6, 1e8])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", default=None)
    parser.add_argument("--table-rows", type=int, default=200_000, help="the 26 tables' cap (many tables)")
    parser.add_argument("--table-batch", type=int, default=2048, help="examples a step (many tables)")
    parser.add_argument("--record", type=int, default=200, help="batches suggest_capacity learns from")
    parser.add_argument("--tables-only", action="store_true", help="only the many-tables measurement")
    parser.add_argument("--tables", type=int, default=26, help="how many of the 26 tables (many tables)")
    args = parser.parse_args()
    if not 1 <= args.tables <= len(CARDINALITIES):
        parser.error(f"--tables must be between 1 and {len(CARDINALITIES)}")
    machine = machine_info(threads=0)
    print(f"jax {jax.__version__}, {jax.device_count()} devices, width {WIDTH}, {IDS} ids a step", flush=True)
    results = []
    for rows in [] if args.tables_only else args.rows:
        for dist in ("zipf", "uniform"):
            results += run(int(rows), dist, args.steps, execute=rows <= 1e7)
    paper = [on_paper(n, IDS // 8) for n in (8, 64, 512)]
    for p in paper:
        print(json.dumps(p), flush=True)
    tables = run_tables(args.table_rows, 16, args.table_batch, args.steps, args.record, args.tables)
    if args.json:
        with open(args.json, "w") as f:
            machine["load_average_end"] = os.getloadavg()
            json.dump({"machine": machine, "measured": results, "on_paper": paper, "tables": tables}, f, indent=1)


if __name__ == "__main__":
    main()
