"""The docs' generated pages and files, written from the repository's own files before each build (``conf.py``).

None of them is committed:

- ``docs/benchmarks/step.md`` and its plots: ``benchmarks/report.py`` (``markdown``, ``plots``) on
  ``benchmarks/results/results.json``, the same functions that write ``results.md``;
- ``docs/benchmarks/dlrm.md`` and ``dlrm.png``: ``benchmarks/dlrm.py`` (``results_markdown``, ``plot``) on
  ``benchmarks/results/dlrm.json``;
- ``docs/benchmarks/sharding.md``: the tables of ``benchmarks/results/sharding.json``;
- ``docs/benchmarks/gpu.md``: ``benchmarks/gpu.py`` (``render``) on ``benchmarks/results/gpu.json``;
- ``docs/benchmarks/rowwise_fbgemm.md``: ``benchmarks/rowwise_fbgemm.py`` (``markdown``) on
  ``benchmarks/results/rowwise_fbgemm.json``;
- ``docs/benchmarks/huge_pages.md`` and ``docs/_generated/huge_pages.md`` (its table, for the "Which path do I
  use" page): ``benchmarks/huge_pages.py`` (``markdown``) on ``benchmarks/results/huge_pages.json``;
- ``docs/_generated/costs.md``: the measured costs on the "Which path do I use" page, from ``results.json``;
- ``docs/_generated/gpu_crossover.md``: where the lazy step and ``optax.adam`` cross on a GPU, for the same page,
  from the last run of ``gpu.json``;
- ``docs/_generated/tune_malloc.md``: what ``osa.tune_malloc()`` changed on the DLRM benchmark at width 64, for the
  same page, from ``dlrm_w64.json`` and ``dlrm_w64_malloc.json``;
- ``docs/_generated/bf16_losses.md``: the mean losses of ``examples/bf16_stochastic_rounding.py``'s run, from the
  ``examples/bf16_stochastic_rounding.json`` it wrote;
- ``docs/gallery/*.ipynb``: the notebooks of ``notebooks/``, copied with their stored outputs (the build does not
  execute them);
- ``docs/_generated/static/mathjax/tex-svg.js``: MathJax 3, from the ``django-static-mathjax`` package, so that the
  site renders its math offline.

A file is rewritten only when its content changes, and the benchmark pages only when their inputs change, so that
Sphinx rebuilds only what changed.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import pathlib
import shutil
import sys
from collections.abc import Iterator
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
RESULTS = BENCHMARKS / "results"
DOCS = pathlib.Path(__file__).resolve().parent
OUT = DOCS / "_generated"
NOTEBOOKS = ("train_embeddings", "word_embeddings")
PUBLIC_MODULES = ("optax_sparse_adam", "optax_sparse_adam.nnx", "optax_sparse_adam.linen")


def public_api() -> list[str]:
    """The full name of every public name: each module's ``__all__``, or else the public names it defines."""
    names = []
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        public = getattr(module, "__all__", None)
        if public is None:
            public = [
                k
                for k, v in vars(module).items()
                if not k.startswith("_") and getattr(v, "__module__", None) == module_name
            ]
        names += [f"{module_name}.{name}" for name in public]
    return names


def write_if_changed(path: pathlib.Path, data: str | bytes) -> None:
    """Writes ``data`` to ``path`` unless it already holds exactly that (keeps its mtime for Sphinx)."""
    raw = data.encode() if isinstance(data, str) else data
    if path.exists() and path.read_bytes() == raw:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(raw)


def _commit(machine: dict[str, Any]) -> str:
    """The short commit a results file's run measured (``benchmarks/report.py``'s ``machine_info``)."""
    return machine.get("optax_sparse_adam", {}).get("commit", "unknown")[:7]


def _ms(x: float) -> str:
    return f"{x:.3f}" if x < 1 else f"{x:.2f}" if x < 100 else f"{x:.0f}"


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f}"


@contextlib.contextmanager
def _benchmark_modules() -> Iterator[tuple[Any, Any]]:
    """``benchmarks/report.py`` and ``benchmarks/dlrm.py``, imported as the benchmarks import each other."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import report

        spec = importlib.util.spec_from_file_location("dlrm_benchmark", BENCHMARKS / "dlrm.py")
        assert spec is not None and spec.loader is not None
        dlrm = importlib.util.module_from_spec(spec)
        sys.modules["dlrm_benchmark"] = dlrm  # its dataclasses look their module up
        spec.loader.exec_module(dlrm)
        yield report, dlrm
    finally:
        sys.path.remove(str(BENCHMARKS))
        sys.modules.pop("dlrm_benchmark", None)


def _retitle(markdown: str, title: str) -> str:
    """``markdown`` with its first line, a level-1 heading, replaced by ``title``."""
    first, rest = markdown.split("\n", 1)
    assert first.startswith("# "), first
    return f"# {title}\n{rest}"


def step_page(report: Any, doc: dict[str, Any], out: pathlib.Path) -> str:
    """The one-step benchmark: ``report.markdown`` of ``results.json``, with the plots ``report.plots`` draws."""
    report.plots(doc, out)
    head = (
        "This page is generated at build time from `benchmarks/results/results.json` by the functions of "
        "`benchmarks/report.py` that write `benchmarks/results/results.md`. "
        "`python benchmarks/run.py` (or `make bench`) runs the benchmark and rewrites the results; "
        "`--sweeps headline` runs only the two headline configurations, `--threads n` sets the threads of every "
        "contender, `--dense-gb` how large a dense contender may grow, and `--smoke` runs everything at tiny sizes."
    )
    page = _retitle(report.markdown(doc), "Benchmark: one optimizer step")
    title, rest = page.split("\n", 1)
    return f"{title}\n\n{head}\n{rest}"


def dlrm_page(
    dlrm: Any,
    doc: dict[str, Any],
    out: pathlib.Path,
    wide: dict[str, Any] | None = None,
    tuned: dict[str, Any] | None = None,
) -> str:
    """The DLRM embedding benchmark: ``dlrm.results_markdown`` of ``dlrm.json``, with ``dlrm.plot``; and of
    ``dlrm_w64.json`` (the same at width 64) and ``dlrm_w64_malloc.json`` (with ``tune_malloc``) where given."""
    dlrm.plot(doc, out / "dlrm.png")
    block = dlrm.results_markdown(doc).replace("\n#### ", "\n## ")
    if wide is not None:
        dlrm.plot(wide, out / "dlrm_w64.png")
        block += "\n\n## Width 64\n\n`python benchmarks/dlrm.py --width 64` (`benchmarks/results/dlrm_w64.json`): "
        block += dlrm.results_markdown(wide).replace("\n#### ", "\n### ")
        block += "\n\n![DLRM embedding step, width 64](dlrm_w64.png)"
    if tuned is not None:
        dlrm.plot(tuned, out / "dlrm_w64_malloc.png")
        block += (
            "\n\n## Width 64, `osa.tune_malloc()` first\n\nAt width 64 the library's steps build about 40 MiB of "
            "batch-sized temporaries, over glibc's 32 MiB mmap limit: XLA:CPU allocates them as one block a call, "
            "which glibc maps afresh, a page fault every 4 KiB of it, every step (`osa.step_report` says so). "
            "`osa.tune_malloc()`, called first, keeps the block in the heap. The same run with it, "
            "`python benchmarks/dlrm.py --width 64 --tune-malloc` (`benchmarks/results/dlrm_w64_malloc.json`; the "
            "call is process-wide, so every contender runs with it): "
        )
        block += dlrm.results_markdown(tuned).replace("\n#### ", "\n### ")
        block += "\n\n![DLRM embedding step, width 64, tune_malloc](dlrm_w64_malloc.png)"
    return "\n".join(
        [
            "# Benchmark: the embedding part of a DLRM step",
            "",
            "`benchmarks/dlrm.py` times the embedding part of a DLRM training step (pooled lookup of 26 features, "
            "backward of a fixed upstream gradient, optimizer update) on generated batches of the Criteo Kaggle "
            "shape (26 tables capped at 1,000,000 rows, width 16, Zipf ids), fresh each step, the contenders taking "
            "turns in one process: the library (one stacked collection, Adam through `update_and_apply`, row-wise "
            "Adagrad; 26 separate tables), FBGEMM's CPU table-batched embedding with fused `EXACT_ROWWISE_ADAGRAD` "
            "(FBGEMM has no Adam on the CPU), torch's `EmbeddingBag(sparse=True)` + `SparseAdam`, dense "
            "`optax.adam`, and a floor (each touched row of p, m and v read and written once). Before timing, one "
            "step on small tables checks that the library's row-wise Adagrad equals FBGEMM's and its Adam torch's.",
            "",
            "This page is generated at build time from `benchmarks/results/dlrm.json` by `benchmarks/dlrm.py`'s "
            "own `results_markdown` and `plot`.",
            "",
            block,
            "",
            "![DLRM embedding step](dlrm.png)",
            "",
        ]
    )


def dlrm_train_page(dlrm_train: Any, doc: dict[str, Any]) -> str:
    """The whole DLRM train step against PyTorch: ``dlrm_train.markdown`` of ``dlrm_train.json``."""
    return "\n".join(
        [
            "# Benchmark: the whole DLRM train step against PyTorch",
            "",
            "`benchmarks/dlrm_train.py` times the whole training step of `examples/dlrm.py`'s DLRM (bottom MLP, the "
            "26 pooled embeddings, the dot products of the 27 vectors' pairs, top MLP, binary cross-entropy; "
            "forward, backward and both optimizers) on the batches of the [embedding benchmark](dlrm.md): the "
            "library (one stacked collection; lazy Adam or row-wise Adagrad on the tables and Adam on the MLPs, "
            "through `partition_tables` and `update_and_apply`), the same model in PyTorch (26 "
            "`EmbeddingBag(sparse=True)` with `SparseAdam`, `Adam(fused=True)` on the MLPs), and dense `optax.adam` "
            "on every parameter. Every contender starts from the same parameters and takes the same batches, the "
            "contenders taking turns in one process.",
            "",
            "This page is generated at build time from `benchmarks/results/dlrm_train.json` by "
            "`benchmarks/dlrm_train.py`'s own `markdown`.",
            "",
            dlrm_train.markdown(doc).replace("\n### ", "\n## "),
            "",
        ]
    )


_ROUTES = {
    "plain jit": "plain `jit`",
    "replicated ids": "`batch_axis=None`",
    "all-gather": '`"all_gather"`',
    "all-to-all": '`"all_to_all"`',
}


def sharding_page(doc: dict[str, Any]) -> str:
    """The row-sharding measurements of ``sharding.json``, one table per table size and id distribution."""
    lines = [
        "# Benchmark: row-sharded tables",
        "",
        "`python benchmarks/sharding.py --rows 1e6 1e8 --steps 25 --json benchmarks/results/sharding.json` on 8 "
        "simulated CPU devices (`jax_num_cpu_devices=8`), a float32 table of width 64, 8,192 ids a step (Zipf(1.2) "
        "ids through a fixed random permutation of the rows, or uniform), one step = `value_and_row_grad`, the "
        "update and `apply_updates`, jitted with parameters and state donated. Bytes received per device are read "
        "from the compiled HLO's collectives; temporaries from the compiled `memory_analysis`; tables of 1e8 rows "
        "are compiled only. The step times come from 8 devices simulated on one machine: only a sanity check.",
        "",
        "This page is generated at build time from `benchmarks/results/sharding.json`. The routes are described "
        "in [Sharded tables and many processes](../guides/sharding.md).",
    ]
    m = doc.get("machine")
    if m is not None:
        load = ", ".join(f"{x:.2f}" for x in (*m["load_average_start"][:1], *m.get("load_average_end", [])[:1]))
        lines += [
            "",
            f"Measured at commit `{_commit(m)}` on {m['cores']} cores ({m['cpu']}), jax {m['jax']}, "
            f"{m['date_utc']}, 1-minute load average {load} (start/end).",
        ]
    groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for r in doc["measured"]:
        groups.setdefault((r["rows"], r["ids"]), []).append(r)
    for (rows, ids), records in groups.items():
        executed = any("step_ms" in r for r in records)
        lines += [
            "",
            f"## {rows:.0e} rows, {ids} ids".replace("e+0", "e") + ("" if executed else " (compiled only)"),
            "",
        ]
        head = (
            "| route | received per device (MB) | in the overflow branches (MB) | per loop trip (MB) | "
            "temporaries (MB) |"
        )
        rule = "| --- | ---: | ---: | ---: | ---: |"
        if executed:
            head += " table vs one device, max abs diff | overflowed ids | step (ms), sanity check only |"
            rule += " ---: | ---: | ---: |"
        lines += [head, rule]
        for r in records:
            row = (
                f"| {_ROUTES.get(r['variant'], r['variant'])} | {_mb(r['recv_bytes'])} | "
                f"{_mb(r['recv_fallback_bytes']) if r['recv_fallback_bytes'] else '-'} | "
                f"{_mb(r['recv_per_loop_trip_bytes']) if r['recv_per_loop_trip_bytes'] else '-'} | "
                f"{_mb(r['temp_bytes'])} |"
            )
            if executed:
                row += f" {r['max_abs_diff_table']:.0e} | {r['overflow_total']} | {_ms(r['step_ms'])} |"
            lines.append(row)
    lines += [
        "",
        "## On paper",
        "",
        "With 1,024 ids per device (the global batch grows with the devices), width 64, float32: bytes received "
        "per device per step, from the routes' message sizes (`benchmarks/sharding.py`'s `on_paper`).",
        "",
        '| devices | `batch_axis=None` (MB) | `"all_gather"` (MB) | `"all_to_all"` (MB) | all-to-all capacity |',
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for p in doc["on_paper"]:
        lines.append(
            f"| {p['devices']} | {_mb(p['replicated ids'])} | {_mb(p['all-gather'])} | {_mb(p['all-to-all'])} | "
            f"{p['all-to-all capacity']} |"
        )
    if "tables" in doc:
        lines += tables_section(doc["tables"])
    return "\n".join(lines) + "\n"


def tables_section(t: dict[str, Any]) -> list[str]:
    """The many-tables measurement of ``sharding.json`` (``run_tables``): bytes against the ideal, collectives, and
    the steps that overflowed."""
    which = "The" if t["tables"] == 26 else f"The first {t['tables']} of the"
    lines = [
        "",
        f"## Many tables: DLRM's {t['tables']}",
        "",
        f"{which} 26 Criteo tables capped at {max(t['rows']):,} rows (padded to a multiple of 8), width {t['width']}, "
        f"float32, one id per example and table, {t['batch']:,} examples a step split over 8 devices, Zipf(1.15) ids "
        'scattered over each table; `RowSharding(..., routing="all_to_all")` with `sparse_adam`, one step = '
        "`value_and_row_grad`, the update and `apply_updates`. Two layouts of the same rows: "
        f"{t['tables']} separate tables "
        "(each its own buckets), and one stack of an `EmbeddingCollection(..., shards=8)` (each device a share of "
        "every table; one bucket per owner for all of them; the features pooled from `coll.bags`). The ideal is the "
        "bytes a device must receive, averaged over the devices and the measured steps: each distinct id another "
        "device asks of it (4 bytes) with its gradient row, and the row of each of its own distinct ids another "
        f"device owns. The suggested capacity is `suggest_capacity` over {t['recorded_batches']} other batches; the "
        "steps are fresh batches of the same distribution. Step times (median) are of 8 simulated devices sharing "
        "the machine's cores: a sanity check, not a speed figure.",
        "",
        f"Ideal: {_mb(t['ideal_recv_bytes'])} MB received per device per step.",
        "",
        "| layout | capacity | received per device (MB) | vs ideal | collectives a step runs (no overflow) | "
        "in the overflow branches (MB) | steps with a second round | steps on the all-gather route | step (ms) |",
        "| --- | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in t["runs"]:
        label = "default" if r["capacity_value"] is None else f"suggested ({r['capacity_value']})"
        kinds = ", ".join(f"{v} {k}" for k, v in sorted(r["collectives_on_path"].items()))
        ms = "" if r.get("step_ms") is None else f"{r['step_ms']:.1f}"
        lines.append(
            f"| {r.get('layout', '26 tables')} | {label} | {_mb(r['recv_bytes'])} | {r['vs_ideal']:.2f}x | {kinds} | "
            f"{_mb(r['recv_fallback_bytes'])} | {r['second_round_steps']} of {r['steps']} | "
            f"{r['fallback_steps']} of {r['steps']} | {ms} |"
        )
    return lines


def costs_page(doc: dict[str, Any]) -> str:
    """The measured costs of the gradient forms and the apply forms, from ``results.json``."""
    m = doc["machine"]
    commit = _commit(m)
    source = (
        f"Measured at commit `{commit}` on {m['cores']} cores ({m['cpu']}), jax {m['jax']}, {m['date_utc']}; "
        "generated from `benchmarks/results/results.json`."
    )
    e = doc["end_to_end"]
    grad_rows = {
        "osa_sparse": "`jax.grad` with respect to the rows read, `IndexedRows(ids, d_rows)` built by hand",
        "osa_row_grad": "`osa.value_and_row_grad`",
        "optax_adam": "`jax.grad` with respect to the whole table, `optax.adam`",
    }
    lines = [
        "Whole train step (forward, backward, optimizer) of one model: " + e["label"] + ". " + source,
        "",
        "| gradient form | median (ms) | fastest (ms) |",
        "| --- | ---: | ---: |",
    ]
    for name, label in grad_rows.items():
        res = e["results"].get(name, {})
        if "median_ms" in res:
            lines.append(f"| {label} | {_ms(res['median_ms'])} | {_ms(res['min_ms'])} |")
    headline = next(r for r in doc["configs"] if "headline" in r["sweeps"])
    apply_rows = {
        "osa_fused": "`osa.update_and_apply` (native kernels)",
        "osa_sparse": "`tx.update` + `osa.apply_updates` (native kernels)",
        "osa_sparse_xla": "`tx.update` + `osa.apply_updates`, XLA path",
        "osa_dense": "`sparse_adam(lazy_dense=True)` on the dense gradient",
        "optax_adam": "`optax.adam` on the dense gradient",
    }
    lines += [
        "",
        f"One optimizer step alone, {headline['label']} ({headline['distinct']:,.0f} distinct rows a batch on "
        "average). " + source,
        "",
        "| apply form | median (ms) | fastest (ms) |",
        "| --- | ---: | ---: |",
    ]
    for name, label in apply_rows.items():
        res = headline["results"].get(name, {})
        if "median_ms" in res:
            lines.append(f"| {label} | {_ms(res['median_ms'])} | {_ms(res['min_ms'])} |")
    return "\n".join(lines) + "\n"


def variants_page(doc: dict[str, Any], gpu: dict[str, Any] | None = None) -> str:
    """The step time of each optimizer variant, from ``variants.json`` (``benchmarks/variants.py --json``), and on a
    GPU from ``variants_gpu.json`` (``{"runs": [...]}``, a section each) where given."""
    m, s = doc["machine"], doc["settings"]
    commit = _commit(m)
    load = ", ".join(f"{x:.2f}" for x in (*m["load_average_start"][:1], *m.get("load_average_end", [])[:1]))
    base = next(r["fused_ms"] for r in doc["results"] if r["variant"] == "sparse_adam (plain)")
    per_door = _per_door(s)
    lines = [
        "# Benchmark: optimizer variants",
        "",
        f"`python benchmarks/variants.py --steps {s['steps']} --warmup {s['warmup']} --json "
        f"benchmarks/results/variants.json`: a jitted step of each variant, the parameters and state donated, on a "
        f"{s['rows']:,} x {s['width']} float32 table, a fresh batch of {s['batch']:,} Zipf(1.2) ids each step "
        f"({doc['distinct']:,.0f} distinct rows a batch on average), through both doors: the two calls "
        "(`tx.update` then `apply_updates`) and `update_and_apply`, taking turns on the same table and state"
        + (
            ", each door with fresh batches of its own (given the batch another door had just taken, a door would "
            "find its rows in the cache, and under catch-up, caught up). "
            if per_door
            else ". "
        )
        + f"Variants and doors take turns {s['block']} steps at a time; the median of the steps after {s['warmup']} "
        "(the catch-up variants' rows have idle histories by then), each block's first step left out (it pays for "
        "the switch between the native kernels' threads and XLA's), each round of blocks starting one variant "
        "further on. Ratios are to the plain `sparse_adam` step "
        "through `update_and_apply`. The last rows wrap `sparse_adam` in optax's wrappers: `update_and_apply` "
        "fuses through those that pass its updates and state through untouched (see "
        "[optax pipelines](../guides/optax_pipelines.md#one-pass-through-optax-wrappers)). The variants on a "
        "bfloat16 table keep their state in float32; those with stochastic rounding take a new key each step "
        "(`apply_updates_stochastic` after the two calls' update, `update_and_apply(..., key=)`), the step's key of "
        "keys split once before the run, but for the row whose key comes from `jax.random.fold_in(key, step)` in "
        "the step, which XLA:CPU runs as threefry's rounds in a loop: see "
        "[Low precision](../guides/low_precision.md#a-new-key-every-step). Element-wise Adagrad (`sparse_adagrad`), "
        "FTRL (`sparse_ftrl`) and lazy momentum SGD (`sparse_sgd(..., momentum=)`) run the element-wise kernels at "
        "both doors; momentum SGD's catch-up (`catch_up=True`), and Adam's, AdamW's and AMSGrad's, run a kernel at "
        "both doors; under a schedule Adam's, AdamW's and momentum SGD's leave the long-idle rows whose "
        "coefficients the state's record does not hold, or that need their idle steps one by one, to the XLA rule, "
        "in a conditional branch."
        + (
            " Under a schedule, the coefficients of rows idle longer than the window come from the state's record "
            "of them by last step (`osa.IdleRecord`), which each step writes."
            if per_door
            else " The doors took each batch in turn on the same rows: under a schedule the first (the two calls) "
            "computed the coefficients of the batch's rows idle longer than the window, and the doors after it found "
            "those rows caught up, and in the cache. For the two variants under a schedule, the two calls' column is "
            "what a step on rows with idle histories costs; the `update_and_apply` columns are not."
        ),
        "",
        f"Measured at commit `{commit}` on {m['cores']} cores ({m['cpu']}), jax {m['jax']}, {m['date_utc']}, "
        f"1-minute load average {load} (start/end). This page is generated at build time from "
        "`benchmarks/results/variants.json`.",
        "",
    ]
    floors = all("floor_ms" in r for r in doc["results"])
    if floors:
        lines += [
            "The floor of each variant is a native kernel that only reads and writes, once for each distinct id of "
            "the batch (deduplicated beforehand, out of the timing), the row of p and of each table-shaped part of "
            "the variant's state (p, mu and nu for Adam; p and one float a row for row-wise Adagrad; the last step "
            "a row too for catch-up; the widths are listed, in floats: a bfloat16 row counts half its width), "
            "reading one gradient row per distinct id, and does "
            "nothing else, timed in the same turns. Unlike the main benchmark's floor, which visits the row of a "
            "repeated id once per occurrence, a step cannot come in under it: what it leaves out is the step's own "
            "work, summing the duplicates and the optimizer's arithmetic.",
            "",
            "The floor's input is not the step's: it reads one gradient row per distinct id, where the step reads "
            "every entry of the batch and sums the duplicates. So each variant also runs `update_and_apply` on the "
            "floor's own input (each batch's distinct ids, `unique_indices=True`, the entries past them padding with "
            "zero rows), in the same turns: its ratio to the floor is the row pass's own distance from the memory "
            "floor, and the gap to the `update_and_apply` column is what summing the batch's duplicates costs. A "
            "ratio a little under 1 is the run's noise: the floor of the same tables, timed in each variant's "
            "turns, spreads by about as much from one variant to the next.",
            "",
        ]
    entries = floors and all(r.get("floor_entries_ms") for r in doc["results"])
    if entries:
        lines += [
            "The second floor, *every entry*, takes the step's own batch: given each entry's place among the "
            "batch's distinct ids (computed beforehand, out of the timing), each thread reads the batch's entries "
            "in order, summing those of its share of the ids (split by their entries and rows, as the library's "
            "row loop splits them), then each of its ids' row of each table once, adding the sum, and does nothing "
            "else. Its bytes are those a step on the batch must move, so its ratio is the one to hold "
            "`update_and_apply` to: what a step costs above it is finding the grouping (coalescing the batch's "
            "ids) and the optimizer's arithmetic.",
            "",
        ]
    head = "| variant | two calls (ms) | vs plain | `update_and_apply` (ms) | vs plain |"
    rule = "| --- | ---: | ---: | ---: | ---: |"
    if floors:
        head += (
            " floor (ms) | `update_and_apply` vs floor | on distinct ids (ms) | on distinct ids vs floor |"
            " floor's tables (widths) |"
        )
        rule += " ---: | ---: | ---: | ---: | --- |"
    if entries:
        head += " floor, every entry (ms) | `update_and_apply` vs it |"
        rule += " ---: | ---: |"
    lines += [head + " optimizer state (MB) |", rule + " ---: |"]
    for r in doc["results"]:
        two, one = r["two_calls_ms"], r["fused_ms"]
        row = f"| `{r['variant']}` | {_ms(two)} | {two / base:.2f}x | {_ms(one)} | {one / base:.2f}x |"
        if floors:
            widths = ", ".join(str(w) for w in r["floor_widths"])
            low, uniq = r["floor_ms"], r["distinct_ms"]
            row += f" {_ms(low)} | {one / low:.2f}x | {_ms(uniq)} | {uniq / low:.2f}x | {widths} |"
        if entries:
            row += f" {_ms(r['floor_entries_ms'])} | {one / r['floor_entries_ms']:.2f}x |"
        lines.append(row + f" {r['state_bytes'] / 1e6:,.0f} |")
    for run in (gpu or {}).get("runs", []):
        lines += ["", *_variants_gpu_section(run)]
    return "\n".join(lines) + "\n"


def _per_door(settings: dict[str, Any]) -> bool:
    """Whether a variants run gave each door batches of its own (runs before that took each batch in turn)."""
    return settings.get("batches") == "per door"


def _variants_gpu_section(doc: dict[str, Any]) -> list[str]:
    """The same variants on a GPU (``variants_gpu.json``): the XLA path, no floor column."""
    m, s = doc["machine"], doc["settings"]
    base = next(r["fused_ms"] for r in doc["results"] if r["variant"] == "sparse_adam (plain)")
    lines = [
        f"## On a GPU ({m['jax_device']}), commit `{_commit(m)}`",
        "",
        f"`python benchmarks/variants.py --steps {s['steps']} --warmup {s['warmup']} --json "
        f"benchmarks/results/variants_gpu.json` with the GPU as jax's default device: the same variants, table and "
        f"batches ({s['rows']:,} x {s['width']}, {s['batch']:,} Zipf(1.2) ids, {doc['distinct']:,.0f} distinct on "
        "average"
        + ("" if _per_door(s) else "; the doors took each batch in turn on the same rows")
        + "), the library's XLA path (the only one on a GPU), no floor column (the floor is a CPU kernel). "
        f"Measured at commit `{_commit(m)}`, jax {m['jax']}, {m['date_utc']}. At this batch size a step moves a few "
        "MB, microseconds of a GPU's memory bandwidth: its time is kernel launches and the host's dispatch, which is "
        "why the variants sit so close together.",
        "",
    ]
    if doc.get("note"):
        lines += [doc["note"], ""]
    lines += [
        "| variant | two calls (ms) | vs plain | `update_and_apply` (ms) | vs plain |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for r in doc["results"]:
        two, one = r["two_calls_ms"], r["fused_ms"]
        lines.append(f"| `{r['variant']}` | {_ms(two)} | {two / base:.2f}x | {_ms(one)} | {one / base:.2f}x |")
    return lines


def dlrm_catch_up_page(doc: dict[str, Any]) -> str:
    """Dense, lazy and catch-up Adam training a DLRM's tables, from ``dlrm_catch_up.json`` (``examples/dlrm.py
    --compare --json``)."""
    m, s, runs = doc["machine"], doc["settings"], doc["runs"]
    names = list(runs)
    command = (
        f"python examples/dlrm.py --compare --max-rows {s['max_rows']} --steps {s['steps']} --batch {s['batch']}"
        + (" --multi-hot" if s["multi_hot"] else "")
        + " --json benchmarks/results/dlrm_catch_up.json"
    )
    lines = [
        "# Catch-up on a DLRM: dense, lazy and catch-up Adam side by side",
        "",
        f"`{command}`: the DLRM of `examples/dlrm.py` on generated Criteo-shaped data (26 tables, "
        f"{doc['table_rows']:,} rows in all, width {s['width']}; "
        f"{'DLRMv2 multi-hot bags' if s['multi_hot'] else 'one id a feature'}, {s['batch']:,} examples a step), its "
        f"tables trained three ways with Adam at learning rate {s['table_lr']} (the MLPs with `optax.adam` at 1e-3 "
        "each time), from the same initial parameters on the same batches: dense `optax.adam` on table-sized "
        "gradients, lazy `sparse_adam`, and `sparse_adam(catch_up=True)` (each row first takes the steps dense Adam "
        "gave it while no batch touched it; the loss reads it so). The held-out loss is the mean over "
        f"{doc['held_out_batches']} batches drawn from the same generator and never trained on; the catch-up run is "
        "brought up to the current step (`osa.catch_up`) before each evaluation. Training loss: the mean of the "
        "steps since the last evaluation.",
        "",
        f"Measured at commit `{m['commit'][:7]}{'-dirty' if m['commit'].endswith('-dirty') else ''}` on "
        f"{m['cores']} cores ({m['backend']}), jax {m['jax']}, {m['date_utc']}; 1-minute load average at the end "
        f"{m['load_average_end'][0]:.2f}. This page is generated at build time from "
        "`benchmarks/results/dlrm_catch_up.json`.",
        "",
        "| step | " + " | ".join(f"`{n}` train / held-out" for n in names) + " |",
        "| ---: | " + " | ".join("---:" for _ in names) + " |",
    ]
    for i, step in enumerate(runs[names[0]]["step"]):
        cells = [f"{runs[n]['train'][i]:.4f} / {runs[n]['held_out'][i]:.4f}" for n in names]
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    dense, lazy, caught = (runs[n]["held_out"] for n in names)
    gap = max(abs(a - b) for a, b in zip(dense, caught, strict=True))
    lazy_gap = max(abs(a - b) for a, b in zip(dense, lazy, strict=True))
    times = ", ".join(f"`{n}` {_ms(runs[n]['median_step_ms'])} ms" for n in names)
    lines += [
        "",
        f"Largest held-out difference from dense Adam: catch-up {gap:.1e}, lazy {lazy_gap:.1e}. Median step time "
        f"(forward, backward and update, after the first fifth of the steps): {times}. Why catch-up can cost "
        "more than the lazy step: [the catch-up section](../guides/variants.md) (rows with tiny second moments).",
    ]
    return "\n".join(lines) + "\n"


def rowwise_fbgemm_page(rowwise_fbgemm: Any, doc: dict[str, Any]) -> str:
    """Row-wise Adagrad on one table against FBGEMM's fused backward: ``rowwise_fbgemm.markdown`` of
    ``rowwise_fbgemm.json``."""
    m, s = doc["machine"], doc["settings"]
    agree = doc.get("agreement_max_abs_diff")
    return "\n".join(
        [
            "# Benchmark: row-wise Adagrad against FBGEMM",
            "",
            "`benchmarks/rowwise_fbgemm.py` times row-wise Adagrad's step on one float32 table, on the same fresh "
            "batches for every contender: the library's `sparse_rowwise_adagrad` through `update_and_apply` (one "
            "native pass: duplicates summed, rows updated), FBGEMM's CPU table-batched embedding with "
            "`EXACT_ROWWISE_ADAGRAD` (its `backward` of the same gradient rows timed alone, after an untimed "
            "forward: FBGEMM groups the ids, sums the duplicates and updates the rows in it), and a floor (each "
            "distinct touched row of the table and of the accumulator read and written once). The contenders take "
            f"turns in blocks of {s['block']} steps in one process, the first {s['settle']} of each block "
            "left out while the caches fill with the contender's rows again (medians of the steps after "
            f"{s['warmup']}). The library and the floor are also timed before FBGEMM's table is made (last column): "
            "the difference is what FBGEMM's steps in between cost them. FBGEMM's CPU backward updates "
            "the rows one after another on one thread, prefetching one row ahead, so its time follows how long the "
            "memory takes to answer a random read more than how much it moves: the hosts behind one CPU name (the "
            "machine line below gives the CPU's family and model) differ in that several times over, and the ratio "
            "to FBGEMM with them.",
            "",
            f"Measured at commit `{_commit(m)}` on {m['cores']} cores ({m['cpu']}), jax {m['jax']}, torch "
            f"{m['torch']} on {s['threads']} threads (`OMP_WAIT_POLICY={m['omp_wait_policy']}`), {m['date_utc']}, "
            f"1-minute load average {m['load_average_start'][0]:.2f} at the start: `python "
            "benchmarks/rowwise_fbgemm.py`."
            + (
                f" One step from the same table: the library and FBGEMM within {agree:.1e}."
                if agree is not None
                else ""
            ),
            "",
            "This page is generated at build time from `benchmarks/results/rowwise_fbgemm.json` by "
            "`benchmarks/rowwise_fbgemm.py`'s own `markdown`.",
            "",
            rowwise_fbgemm.markdown(doc),
        ]
    )


def huge_pages_table(huge_pages: Any, doc: dict[str, Any]) -> str:
    """``huge_pages.markdown`` of ``huge_pages.json``, with the run's commit and command (for the page and for the
    guide's section)."""
    m, s = doc["machine"], doc["settings"]
    return (
        huge_pages.markdown(doc)
        + f"\nAt {_commit(m)} on {m['cpu']} ({m['cores']} cores, {s['threads']} threads), transparent huge pages "
        f"`{m['transparent_hugepage']}`, {m['date_utc']}: `python benchmarks/huge_pages.py --steps {s['steps']} "
        f"--warmup {s['warmup']} --json benchmarks/results/huge_pages.json`.\n"
    )


def gpu_crossover_sentence(doc: dict[str, Any]) -> str:
    """Where the lazy step and ``optax.adam`` cross on a GPU, for the "Which path do I use" page: the last run of
    ``gpu.json`` (every configuration), the fused step against ``optax.adam`` at a million Zipf ids a step on
    10^7 and 10^6 rows and at 8,192 ids on 10^6 rows."""
    run = doc["runs"][-1]
    by_label = {c["label"]: {k: r["median_ms"] for k, r in c["results"].items()} for c in run["configs"]}

    def compare(label: str) -> str:
        r = by_label[label]
        ratio = r["optax_adam"] / r["osa_fused"]
        return f"{ratio:.1f}x faster than" if ratio >= 1 else f"{1 / ratio:.1f}x slower than"

    wide, small, few = "1e7 x 64, 1048576 ids, zipf", "1e6 x 64, 1048576 ids, zipf", "1e6 x 64, 8192 ids, zipf"
    return (
        f"Measured on an {run['machine']['jax_device']} at {run['commit']} with jaxlib {run['machine']['jaxlib']} "
        f"(see [One step on a GPU](benchmarks/gpu.md)): with a million Zipf ids a step, the lazy step is "
        f"{compare(wide)} `optax.adam` on a 10^7-row table of width 64 and {compare(small)} it on a 10^6-row one; at "
        f"8,192 ids a step it is {compare(few)} `optax.adam` there ({_ms(by_label[few]['osa_fused'])} ms against "
        f"{_ms(by_label[few]['optax_adam'])}).\n"
    )


def tune_malloc_sentence(wide: dict[str, Any], tuned: dict[str, Any]) -> str:
    """What ``osa.tune_malloc()`` changed on the DLRM benchmark at width 64, for the "Which path do I use" page: the
    library's Adam step on a stacked collection without (``dlrm_w64.json``) and with it (``dlrm_w64_malloc.json``),
    in ms and as torch's ``EmbeddingBag`` + ``SparseAdam`` over it, for each configuration both runs hold."""
    before, after = (
        {c["config"]["name"]: {k: r["median_ms"] for k, r in c["results"].items()} for c in doc["configs"]}
        for doc in (wide, tuned)
    )
    names = {"kaggle": "one-hot", "dlrmv2": "DLRMv2's bags"}
    times, speedups = [], []
    for name in (n for n in before if n in after):
        b, a = before[name], after[name]
        times.append(f"from {_ms(b['osa_adam'])} to {_ms(a['osa_adam'])} ms ({names.get(name, name)})")
        speedups.append((b["torch_sparse_adam"] / b["osa_adam"], a["torch_sparse_adam"] / a["osa_adam"]))
    commits = sorted({_commit(doc["machine"]) for doc in (wide, tuned)})
    return (
        f"On the [DLRM benchmark](benchmarks/dlrm.md) at width 64 (at {' and '.join(commits)}), without and with it, "
        f"the library's Adam step on a stacked collection went {' and '.join(times)}: from "
        f"{' and '.join(f'{x:.1f}x' for x, _ in speedups)} to {' and '.join(f'{y:.1f}x' for _, y in speedups)} "
        "faster than torch's `EmbeddingBag` + `SparseAdam`.\n"
    )


def huge_pages_page(huge_pages: Any, doc: dict[str, Any]) -> str:
    """Each contender on 4 KiB pages and on 2 MiB pages, from ``huge_pages.json``."""
    s = doc["settings"]
    return "\n".join(
        [
            "# Tables on huge pages",
            "",
            "`benchmarks/huge_pages.py` runs each contender twice in one process, on two copies of its table and "
            "state: one on the 4 KiB pages the allocator gives it, one moved onto 2 MiB transparent huge pages after "
            "its first step (by the `madvise` calls of `osa.advise_huge_pages`, PyTorch's tensors too). The "
            f"contenders take turns {s['block']} steps at a time (a contender's two copies one after the other, "
            f"which one first alternating), each on the same fresh batch of Zipf ids; the figures are medians of "
            f"{s['steps']} steps after {s['warmup']}. "
            "The floor reads and writes the rows of p, mu and nu of each distinct id once, and nothing else. "
            "See 'Tables on 4 KiB pages' in [Which path do I use](../which_path.md).",
            "",
            "This page is generated at build time from `benchmarks/results/huge_pages.json` by "
            "`benchmarks/huge_pages.py`'s own `markdown`.",
            "",
            huge_pages_table(huge_pages, doc),
        ]
    )


def _digest(paths: list[pathlib.Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(p.name.encode())
        h.update(p.read_bytes() if p.exists() else b"")
    return h.hexdigest()


def benchmarks(pages: pathlib.Path, out: pathlib.Path) -> None:
    """The benchmark pages (into ``pages``) and the costs table (into ``out``); skipped when neither the results nor
    their renderers changed."""
    names = ("results.json", "dlrm.json", "dlrm_catch_up.json", "sharding.json", "variants.json", "variants_gpu.json")
    names += ("rowwise_fbgemm.json", "dlrm_train.json", "dlrm_w64.json", "dlrm_w64_malloc.json", "huge_pages.json")
    inputs = [RESULTS / n for n in (*names, "gpu.json")]
    inputs += [BENCHMARKS / n for n in ("report.py", "dlrm.py", "contenders.py", "gpu.py", "rowwise_fbgemm.py")]
    inputs += [BENCHMARKS / "huge_pages.py"]
    inputs += [BENCHMARKS / "dlrm_train.py"]
    inputs += [pathlib.Path(__file__)]
    stamp = pages / ".inputs"
    digest = _digest(inputs)
    if (
        stamp.exists()
        and stamp.read_text() == digest
        and all((out / n).exists() for n in ("costs.md", "huge_pages.md", "tune_malloc.md", "gpu_crossover.md"))
    ):
        return
    results = json.loads((RESULTS / "results.json").read_text())
    with _benchmark_modules() as (report, dlrm):
        write_if_changed(pages / "step.md", step_page(report, results, pages))
        dlrm_doc = json.loads((RESULTS / "dlrm.json").read_text())
        wide, tuned = (
            json.loads((RESULTS / n).read_text()) if (RESULTS / n).exists() else None
            for n in ("dlrm_w64.json", "dlrm_w64_malloc.json")
        )
        write_if_changed(pages / "dlrm.md", dlrm_page(dlrm, dlrm_doc, pages, wide, tuned))
        if wide is not None and tuned is not None:
            write_if_changed(out / "tune_malloc.md", tune_malloc_sentence(wide, tuned))
        import gpu  # benchmarks/gpu.py, on the path here

        gpu_doc = json.loads((RESULTS / "gpu.json").read_text())
        write_if_changed(pages / "gpu.md", gpu.render(gpu_doc))
        write_if_changed(out / "gpu_crossover.md", gpu_crossover_sentence(gpu_doc))
        import rowwise_fbgemm  # benchmarks/rowwise_fbgemm.py

        doc = json.loads((RESULTS / "rowwise_fbgemm.json").read_text())
        write_if_changed(pages / "rowwise_fbgemm.md", rowwise_fbgemm_page(rowwise_fbgemm, doc))
        import dlrm_train  # benchmarks/dlrm_train.py

        doc = json.loads((RESULTS / "dlrm_train.json").read_text())
        write_if_changed(pages / "dlrm_train.md", dlrm_train_page(dlrm_train, doc))
        import huge_pages  # benchmarks/huge_pages.py

        doc = json.loads((RESULTS / "huge_pages.json").read_text())
        write_if_changed(out / "huge_pages.md", huge_pages_table(huge_pages, doc))
        write_if_changed(pages / "huge_pages.md", huge_pages_page(huge_pages, doc))
    write_if_changed(out / "costs.md", costs_page(results))
    sharding = json.loads((RESULTS / "sharding.json").read_text())
    write_if_changed(pages / "sharding.md", sharding_page(sharding))
    cpu_variants, gpu_variants = (json.loads((RESULTS / n).read_text()) for n in ("variants.json", "variants_gpu.json"))
    write_if_changed(pages / "variants.md", variants_page(cpu_variants, gpu_variants))
    catch_up = json.loads((RESULTS / "dlrm_catch_up.json").read_text())
    write_if_changed(pages / "dlrm_catch_up.md", dlrm_catch_up_page(catch_up))
    stamp.write_text(digest)


def bf16_losses_page(doc: dict[str, Any]) -> str:
    """The low-precision guide's table: each run's mean loss over its first and last steps."""
    commit = doc["commit"][:7] + (" with local changes" if doc.get("modified") else "")
    lines = [
        f"The mean losses of its {doc['steps']:,}-step run at {commit} "
        "(`python examples/bf16_stochastic_rounding.py`):",
        "",
        f"| tables | mean loss, first {doc['tail']} steps | mean loss, last {doc['tail']} steps |",
        "| --- | ---: | ---: |",
    ]
    labels = {
        "float32": "float32",
        "bfloat16, round to nearest": "bfloat16, round to nearest (`update_and_apply`)",
        "bfloat16, stochastic rounding": "bfloat16, stochastic rounding (`update_and_apply(..., key=)`)",
    }
    for name, run in doc["runs"].items():
        lines.append(f"| {labels.get(name, name)} | {run['first']:.3f} | {run['last']:.3f} |")
    return "\n".join(lines) + "\n"


def gallery(out: pathlib.Path) -> None:
    """The notebooks, as they are stored (with their outputs), into ``out`` (``docs/gallery``)."""
    for name in NOTEBOOKS:
        write_if_changed(out / f"{name}.ipynb", (ROOT / "notebooks" / f"{name}.ipynb").read_bytes())


def mathjax(out: pathlib.Path) -> str:
    """Copies MathJax's single-file SVG build into the site's static files; returns its path there."""
    spec = importlib.util.find_spec("mathjax")
    if spec is None or spec.origin is None:
        raise RuntimeError("MathJax is missing: install the docs extra, pip install -e '.[docs]'")
    source = pathlib.Path(spec.origin).parent / "static" / "mathjax" / "es5" / "tex-svg.js"
    target = out / "static" / "mathjax" / "tex-svg.js"
    if not target.exists() or target.stat().st_size != source.stat().st_size:
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
    return "mathjax/tex-svg.js"


def generate(out: pathlib.Path = OUT) -> None:
    """Everything above, into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    benchmarks(DOCS / "benchmarks", out)
    bf16 = json.loads((ROOT / "examples" / "bf16_stochastic_rounding.json").read_text())
    write_if_changed(out / "bf16_losses.md", bf16_losses_page(bf16))
    gallery(DOCS / "gallery")
    mathjax(out)
