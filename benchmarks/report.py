"""The machine's description and memcpy bandwidth, and the written report: Markdown, JSON and plots."""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform
import statistics
import subprocess
import time
from typing import Any

import jax
import matplotlib
import numpy as np
import optax
import torch
from contenders import count_label

import optax_sparse_adam as osa

matplotlib.use("Agg")
import matplotlib.pyplot as plt

STYLES: dict[str, dict[str, Any]] = {
    "osa_sparse": {"color": "tab:blue", "marker": "o"},
    "osa_fused": {"color": "tab:cyan", "marker": "P"},
    "osa_sparse_xla": {"color": "tab:blue", "marker": "o", "linestyle": "--", "markerfacecolor": "none"},
    "floor": {"color": "black", "marker": "x", "linestyle": ":"},
    "torch_sparse_adam": {"color": "tab:orange", "marker": "s"},
    "optax_adam": {"color": "tab:red", "marker": "^"},
    "osa_dense": {"color": "tab:purple", "marker": "v"},
    "torch_adam": {"color": "tab:brown", "marker": "D"},
}
SHORT = {
    "osa_sparse": "sparse path",
    "osa_fused": "update_and_apply",
    "osa_sparse_xla": "sparse path, XLA",
    "floor": "floor",
    "torch_sparse_adam": "torch SparseAdam",
    "optax_adam": "optax.adam",
    "osa_dense": "dense path",
    "torch_adam": "torch Adam (fused)",
}
# The sparse contenders, and those each configuration's sparse path (native tx.update + apply_updates) is compared with.
SPARSE = ("osa_sparse", "osa_fused", "osa_sparse_xla", "floor", "torch_sparse_adam")
COMPARED = ("torch_sparse_adam", "optax_adam", "osa_sparse_xla", "floor")
# The library's own steps, judged against the targets.
OURS = ("osa_fused", "osa_sparse")
TARGET_TORCH, TARGET_FLOOR, TARGET_FLAT = 4.0, 1.5, 1.5
TARGET_OPTAX = {(10**6, 64, 8192, "zipf"): 50.0, (10**7, 64, 8192, "zipf"): 200.0}
TARGET_E2E = 3.0
# Plot file name to the sweeps it draws, one panel each.
PLOTS = {
    "step_time_vs_rows.png": ("rows (zipf)", "rows (uniform)"),
    "step_time_vs_batch.png": ("batch",),
    "step_time_vs_width.png": ("width",),
}
_AXES = {"rows (zipf)": "rows", "rows (uniform)": "rows", "batch": "batch", "width": "width"}


def _cpu_model() -> str:
    """The CPU's model name, with its family, model and stepping and its widest vector instructions: a virtual
    machine's name is often as bare as ``AMD EPYC``, and hosts behind one name can differ in their memory's
    latency and bandwidth several times over (whose figures the pages put side by side)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if not sep:
                    if fields:
                        break  # the first processor's entry is enough
                    continue
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or "unknown"
    flags = set(fields.get("flags", "").split())
    isa = next((i for f, i in (("avx512f", "AVX-512"), ("avx2", "AVX2"), ("avx", "AVX")) if f in flags), None)
    ids = [f"{k.removeprefix('cpu ')} {fields[k]}" for k in ("cpu family", "model", "stepping") if k in fields]
    return ", ".join([name, *ids, *([isa] if isa else [])])


def _ram_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def library_info() -> dict[str, Any]:
    """Version and (in a git checkout) commit of the ``optax_sparse_adam`` that was imported."""
    folder = pathlib.Path(osa.__file__).resolve().parent
    info: dict[str, Any] = {"version": osa.__version__}
    try:
        git = ["git", "-C", str(folder)]
        info["commit"] = subprocess.run(
            [*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        status = subprocess.run([*git, "status", "--porcelain", "."], capture_output=True, text=True, check=True)
        info["modified"] = bool(status.stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        pass
    return info


def machine_info(threads: int) -> dict[str, Any]:
    """What the run ran on: CPU, cores, memory, software versions, load and time."""
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "ram_bytes": _ram_bytes(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jax_backend": jax.default_backend(),
        "optax": optax.__version__,
        "optax_sparse_adam": library_info(),
        "torch": torch.__version__,
        "torch_threads": threads,
        "numpy": np.__version__,
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "load_average_start": os.getloadavg(),
        "nice": os.nice(0),
    }


def memcpy_bandwidth(nbytes: int, repeats: int = 10) -> dict[str, Any]:
    """Median bandwidth of a NumPy copy of ``nbytes``, counting the bytes read and the bytes written."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # touch every page first
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    return {"bytes": nbytes, "median_s": median, "gbps": 2 * nbytes / median / 1e9}


def _ms(x: float) -> str:
    return f"{x:.3f}" if x < 1 else f"{x:.2f}" if x < 100 else f"{x:.0f}"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}x" if x >= 10 else f"{x:.2f}x"


def _cell(result: dict[str, Any] | None) -> str:
    if not result:
        return "-"
    return _ms(result["median_ms"]) if "median_ms" in result else "skipped"


def _config_name(cfg: dict[str, Any]) -> str:
    return f"{count_label(cfg['rows'])} x {cfg['width']}, {cfg['batch']} ids, {cfg['dist']}"


def _find(doc: dict[str, Any], sweep: str) -> list[dict[str, Any]]:
    """The records of one sweep, in sweep order."""
    by_config = {json.dumps(r["config"], sort_keys=True): r for r in doc["configs"]}
    return [by_config[json.dumps(c, sort_keys=True)] for c in doc["sweeps"].get(sweep, [])]


def _machine_lines(doc: dict[str, Any]) -> list[str]:
    m, s = doc["machine"], doc["settings"]
    lib = m.get("optax_sparse_adam", {"version": "unknown"})
    load = "/".join(f"{x:.2f}" for x in m["load_average_start"][:1] + m["load_average_end"][:1])
    return [
        "| | |",
        "| --- | --- |",
        f"| CPU | {m['cpu']}, {m['cores']} cores |",
        f"| RAM | {m['ram_bytes'] / 2**30:.1f} GiB |",
        f"| memcpy | {doc['memcpy']['gbps']:.1f} GB/s (NumPy copy of {doc['memcpy']['bytes'] // 2**20} MiB, "
        "median of 10; bytes read + bytes written) |",
        f"| software | Python {m['python']}, jax {m['jax']} ({m['jax_backend']}), optax {m['optax']}, "
        f"torch {m['torch']} ({m['torch_threads']} threads), numpy {m['numpy']} |",
        f"| optax_sparse_adam | {lib['version']}, commit {lib.get('commit', 'unknown')[:12]}"
        f"{' (with local changes)' if lib.get('modified') else ''} |",
        f"| platform | {m['platform']} |",
        f"| run | {m['date_utc']}, {s['wall_s']:.0f} s; 1-minute load average {load} (start/end) |",
    ]


def _method_lines(doc: dict[str, Any]) -> list[str]:
    s = doc["settings"]
    plan = s["plan"]
    return [
        f"- Every figure is the median wall time of one optimizer step (in ms), over up to {plan['timed']} timed "
        f"steps that follow {plan['warmup']} untimed warm-up step(s), taken with `jax.block_until_ready` (JAX) or "
        f"on return (PyTorch). A slow dense contender runs fewer timed steps (at least {plan['min_timed']}, about "
        f"{plan['budget_s']:g} s in all).",
        f"- Every contender runs on {s['torch_threads']} thread(s): torch SparseAdam and torch Adam on "
        f"`torch.set_num_threads({s['torch_threads']})`, set once for the process, and the library's kernels (the "
        f"floor's included) on `osa.use_kernels(threads={min(s['torch_threads'], 16)})` (run again with "
        "`--threads 1` for one thread).",
        f"- Sparse path: `tx.update` + `osa.apply_updates` on the native CPU kernels; update_and_apply: "
        "`osa.update_and_apply` (one pass per touched row for p, m, v); sparse path, XLA: the same two calls inside "
        f"`osa.use_kernels(False)`; floor: a native kernel that reads and writes the row of p, m and v of every id "
        f"and does nothing else (kernel path of this run: {doc.get('kernel_path', 'xla')}).",
        f"- The contenders of one configuration that fit in {s['resident_gb']:g} GB together run in the same "
        f"process, taking turns in {plan['rounds']} round(s), so each ratio compares figures taken side by side.",
        "- Tables are float32. JAX steps are jitted with the parameters and the optimizer state donated. Each step "
        f"sees a fresh batch of ids: {s['pool']} batches are drawn per configuration, one per step (warm-up "
        "included), the same sequence for every contender, each on its own table. Zipf ids:"
        " ranks drawn from Zipf(1.2) truncated to "
        "the table, spread over it by a fixed bijective hash; uniform ids: uniform over the table. Dense "
        "contenders get the dense equivalent of one batch's gradient.",
        f"- Bytes touched by a sparse step: distinct rows x width x 4 bytes x {s['touched_arrays']} (read g, p, m, "
        "v; write p, m, v). Achieved bandwidth: those bytes over the median step time.",
    ]


def _with_min(result: dict[str, Any] | None) -> str:
    if not result or "median_ms" not in result:
        return _cell(result)
    return f"{_ms(result['median_ms'])} ({_ms(result['min_ms'])})"


def _ratio_with_min(results: dict[str, dict[str, Any]], slow_name: str, fast_name: str) -> str:
    slow, fast = results.get(slow_name, {}), results.get(fast_name, {})
    if "median_ms" not in slow or "median_ms" not in fast:
        return "-"
    return f"{_ratio(slow['median_ms'] / fast['median_ms'])} ({_ratio(slow['min_ms'] / fast['min_ms'])})"


# Headline ratios: (slower, faster), read "slower / faster".
HEADLINE_RATIOS = (
    ("torch_sparse_adam", "osa_fused"),
    ("torch_sparse_adam", "osa_sparse"),
    ("optax_adam", "osa_fused"),
    ("osa_fused", "floor"),
    ("osa_sparse", "floor"),
    ("osa_sparse_xla", "osa_fused"),
)


def _headline_lines(doc: dict[str, Any]) -> list[str]:
    timed = ("osa_fused", "osa_sparse", "osa_sparse_xla", "floor", "torch_sparse_adam", "optax_adam")
    lines = [
        "| configuration | distinct rows | "
        + " | ".join(f"{SHORT[n]} (ms)" for n in timed)
        + " | "
        + " | ".join(f"{SHORT[a]} / {SHORT[b]}" for a, b in HEADLINE_RATIOS)
        + " |",
        "| --- | ---: | " + " | ".join("---:" for _ in timed + HEADLINE_RATIOS) + " |",
    ]
    for r in _find(doc, "headline"):
        res = r["results"]
        lines.append(
            f"| {_config_name(r['config'])} | {r['distinct']:.0f} | "
            + " | ".join(_with_min(res.get(n)) for n in timed)
            + " | "
            + " | ".join(_ratio_with_min(res, a, b) for a, b in HEADLINE_RATIOS)
            + " |"
        )
    return lines


def _median(result: dict[str, Any] | None) -> float | None:
    return result["median_ms"] if result and "median_ms" in result else None


def _verdict(ok: bool | None) -> str:
    return "**not measured**" if ok is None else "**met**" if ok else "**not met**"


def targets(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target of the benchmark, with the figures that decide it (medians) and whether it is met."""
    out: list[dict[str, Any]] = []
    by_key = {
        (c["config"]["rows"], c["config"]["width"], c["config"]["batch"], c["config"]["dist"]): c
        for c in doc["configs"]
    }
    for r in _find(doc, "headline"):
        res, name = r["results"], _config_name(r["config"])
        for ours in OURS:
            fast, torch_ms, floor = (
                _median(res.get(ours)),
                _median(res.get("torch_sparse_adam")),
                _median(res.get("floor")),
            )
            ratio = None if fast is None or torch_ms is None else torch_ms / fast
            out.append(
                {
                    "target": f">= {TARGET_TORCH:g}x torch SparseAdam, {SHORT[ours]}, {name}",
                    "value": ratio,
                    "met": None if ratio is None else ratio >= TARGET_TORCH,
                }
            )
            over = None if fast is None or floor is None else fast / floor
            out.append(
                {
                    "target": f"within {TARGET_FLOOR:g}x of the floor, {SHORT[ours]}, {name}",
                    "value": over,
                    "met": None if over is None else over <= TARGET_FLOOR,
                }
            )
    for key, goal in TARGET_OPTAX.items():
        r = by_key.get(key)
        res = r["results"] if r else {}
        fast, dense = _median(res.get("osa_fused")), _median(res.get("optax_adam"))
        ratio = None if fast is None or dense is None else dense / fast
        name = f"{count_label(key[0])} x {key[1]}, {key[2]} ids, {key[3]}"
        out.append(
            {
                "target": f">= {goal:g}x optax.adam, update_and_apply, {name}",
                "value": ratio,
                "met": None if ratio is None else ratio >= goal,
            }
        )
    for key, f in flatness(doc).items():
        if any(key.endswith(n) for n in OURS):
            out.append(
                {
                    "target": f"<= {TARGET_FLAT:g}x growth over table sizes (max / min), {key}",
                    "value": f["max_over_min"],
                    "met": f["max_over_min"] <= TARGET_FLAT,
                }
            )
    e2e = doc.get("end_to_end", {}).get("ratios_vs_osa_sparse", {})
    ratio = e2e.get("torch_sparse")
    out.append(
        {
            "target": f">= {TARGET_E2E:g}x PyTorch end to end (fast path)",
            "value": ratio,
            "met": None if ratio is None else ratio >= TARGET_E2E,
        }
    )
    return out


def _target_lines(doc: dict[str, Any]) -> list[str]:
    return [
        f"- {t['target']}: {'-' if t['value'] is None else _ratio(t['value'])} {_verdict(t['met'])}"
        for t in targets(doc)
    ]


def losses(doc: dict[str, Any]) -> list[str]:
    """Every configuration where another contender beats the library's faster step (floor and XLA path aside)."""
    out = []
    for r in doc["configs"]:
        res = r["results"]
        ours = [m for m in (_median(res.get(n)) for n in OURS) if m is not None]
        if not ours:
            continue
        best = min(ours)
        for name in ("torch_sparse_adam", "optax_adam", "osa_dense", "torch_adam"):
            t = _median(res.get(name))
            if t is not None and t < best:
                out.append(
                    f"- {_config_name(r['config'])}: {SHORT[name]} {_ms(t)} ms against {_ms(best)} ms "
                    f"({_ratio(best / t)} slower)"
                )
    return out or ["- none: the library's faster step wins every configuration measured"]


def flatness(doc: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per rows sweep and sparse contender: step time at the largest table over the smallest, and max over min."""
    out: dict[str, dict[str, float]] = {}
    for sweep in ("rows (zipf)", "rows (uniform)"):
        records = _find(doc, sweep)
        for name in SPARSE:
            runs = [r["results"][name] for r in records if "median_ms" in r["results"].get(name, {})]
            if len(runs) > 1:
                times = [x["median_ms"] for x in runs]
                out[f"{sweep}: {name}"] = {
                    "largest_over_smallest": times[-1] / times[0],
                    "max_over_min": max(times) / min(times),
                    "largest_over_smallest_fastest_steps": runs[-1]["min_ms"] / runs[0]["min_ms"],
                }
    return out


def _flatness_lines(doc: dict[str, Any]) -> list[str]:
    by_rows: dict[int, dict[str, dict[str, Any]]] = {}
    for dist in ("zipf", "uniform"):
        for record in _find(doc, f"rows ({dist})"):
            by_rows.setdefault(record["config"]["rows"], {})[dist] = record
    header = [f"{dist}: {label}" for dist in ("zipf", "uniform") for label in [*(SHORT[n] for n in SPARSE), "distinct"]]
    lines = [
        "| table rows | " + " | ".join(header) + " |",
        "| --- | " + " | ".join("---:" for _ in header) + " |",
    ]
    for rows, records in sorted(by_rows.items()):
        cells = []
        for dist in ("zipf", "uniform"):
            r = records.get(dist)
            if r is None:
                cells += ["-"] * (len(SPARSE) + 1)
            else:
                cells += [_cell(r["results"].get(n)) for n in SPARSE] + [f"{r['distinct']:.0f}"]
        lines.append(f"| {count_label(rows)} | " + " | ".join(cells) + " |")
    lines.append("")
    for key, f in flatness(doc).items():
        sweep, name = key.split(": ")
        lines.append(
            f"- {sweep}, {SHORT[name]}: largest table / smallest = {f['largest_over_smallest']:.2f}x, "
            f"max / min = {f['max_over_min']:.2f}x; largest / smallest by the fastest step = "
            f"{f['largest_over_smallest_fastest_steps']:.2f}x"
        )
    return lines


def _bytes(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.2f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB"


def _all_lines(doc: dict[str, Any]) -> list[str]:
    names = list(doc["contenders"])
    header = (
        ["configuration", "distinct rows"]
        + [f"{SHORT[n]} (ms)" for n in names]
        + [f"{SHORT[n]} / sparse path" for n in COMPARED]
        + ["bytes touched"]
        + [f"{SHORT[n]} GB/s" + (" (of memcpy)" if n == "osa_sparse" else "") for n in SPARSE]
    )
    lines = ["| " + " | ".join(header) + " |", "| --- | " + " | ".join("---:" for _ in header[1:]) + " |"]
    skipped = []
    for r in doc["configs"]:
        res, ratios, bw = r["results"], r["ratios_vs_osa_sparse"], r["bandwidth"]
        cells = [_config_name(r["config"]), f"{r['distinct']:.0f}"]
        cells += [_cell(res.get(n)) for n in names]
        cells += [_ratio(ratios.get(n)) for n in COMPARED]
        cells.append(f"{r['touched_bytes'] / 1e6:.1f} MB")
        for n in SPARSE:
            b = bw.get(n)
            share = f" ({100 * b['fraction_of_memcpy']:.0f}%)" if b is not None and n == "osa_sparse" else ""
            cells.append("-" if b is None else f"{b['gbps']:.1f}{share}")
        lines.append("| " + " | ".join(cells) + " |")
        skipped += [
            f"- {_config_name(r['config'])}: {SHORT[n]} {res[n]['skipped']}." for n in names if "skipped" in res[n]
        ]
    if skipped:
        lines += ["", "Skipped (a dense step holds whole table-sized arrays):", "", *skipped]
    return lines


def _memory_lines(doc: dict[str, Any]) -> list[str]:
    m = doc["temp_memory"]
    cfg = m["config"]
    lines = [
        f"Compiled step at {count_label(cfg['rows'])} x {cfg['width']} float32 ({_bytes(m['table_bytes'])} per "
        f"table), {cfg['batch']} ids, params and state donated "
        "(`jax.jit(step, donate_argnums=(0, 1)).lower(...).compile().memory_analysis()`):",
        "",
        "| step | temporary | temporary / one table | aliased (updated in place) |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, label in (
        ("osa_sparse", "sparse path"),
        ("osa_fused", "update_and_apply"),
        ("optax_adam", "optax.adam (dense gradient)"),
    ):
        if name not in m:
            continue
        s = m[name]
        lines.append(
            f"| {label} | {_bytes(s['temp_bytes'])} | {100 * s['temp_fraction_of_table']:.2f}% "
            f"| {_bytes(s['alias_bytes'])} |"
        )
    return lines


def _compile_lines(doc: dict[str, Any]) -> list[str]:
    c = doc["compiles_once"]
    batches = ", ".join(f"{k} ({v} distinct)" for k, v in c["distinct_per_batch"].items())
    return [
        f"The jitted sparse step at {_config_name(c['config'])} ran on batches of the same capacity: {batches}. "
        f"It was traced **{c['traces']}** time(s)."
    ]


def _e2e_lines(doc: dict[str, Any]) -> list[str]:
    e = doc["end_to_end"]
    lines = [
        f"Model: {e['label']}. Median of each train step (forward, backward, optimizer), in ms.",
        "",
        "| train step | median (ms) | min (ms) | time / fast path |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, res in e["results"].items():
        ratio = e["ratios_vs_osa_sparse"].get(name, 1.0)
        lines.append(f"| {e['labels'][name]} | {_ms(res['median_ms'])} | {_ms(res['min_ms'])} | {_ratio(ratio)} |")
    res = e["results"]
    if "median_ms" in res.get("jax_grad_only", {}) and "median_ms" in res.get("torch_sparse", {}):
        bound = res["torch_sparse"]["median_ms"] / res["jax_grad_only"]["median_ms"]
        lines += [
            "",
            f"PyTorch's whole step over JAX's step without an optimizer: {_ratio(bound)}, the most an optimizer "
            "step costing nothing could give against PyTorch with this model.",
        ]
    return lines


def _plots_drawn(doc: dict[str, Any]) -> list[str]:
    return [name for name, sweeps in PLOTS.items() if any(_find(doc, s) for s in sweeps)]


def markdown(doc: dict[str, Any]) -> str:
    """The whole report as Markdown; sections of sweeps that were not run are left out."""
    title = "# optax_sparse_adam benchmark" + (" (smoke run: tiny sizes, not timings)" if doc["smoke"] else "")
    base = doc["base"]
    sections = [[title], _machine_lines(doc), ["## Method", "", *_method_lines(doc)]]
    if _find(doc, "headline"):
        sections.append(
            [
                "## Headline: one optimizer step",
                "",
                "Median step time in ms, and in parentheses the fastest step (less sensitive to other load on a "
                "shared machine); ratios likewise.",
                "",
                *_headline_lines(doc),
            ]
        )
    sections.append(["## Targets (medians)", "", *_target_lines(doc)])
    sections.append(["## Losses: where another step is faster", "", *losses(doc)])
    if _find(doc, "rows (zipf)") or _find(doc, "rows (uniform)"):
        sections.append(
            [
                "## Step time against table size",
                "",
                f"Width {base['width']}, {base['batch']} ids; median ms per step. "
                "Target: at most 1.5x growth from the smallest to the largest table.",
                "",
                *_flatness_lines(doc),
            ]
        )
    sections += [
        ["## All configurations", "", *_all_lines(doc)],
        ["## Temporary memory of the compiled step", "", *_memory_lines(doc)],
        ["## Compiles once for a fixed batch capacity", "", *_compile_lines(doc)],
        ["## End-to-end train step", "", *_e2e_lines(doc)],
    ]
    drawn = _plots_drawn(doc)
    if drawn:
        sections.append(["## Plots", "", *(f"![{name[:-4]}]({name})" for name in drawn)])
    return "\n\n".join("\n".join(s) for s in sections) + "\n"


def _plot_sweep(ax: Any, doc: dict[str, Any], sweep: str, key: str) -> None:
    records = _find(doc, sweep)
    xs = [r["config"][key] for r in records]
    for name in doc["contenders"]:
        pts = [
            (x, r["results"][name]["median_ms"])
            for x, r in zip(xs, records, strict=True)
            if "median_ms" in r["results"][name]
        ]
        if pts:
            ax.plot(*zip(*pts, strict=True), label=SHORT[name], **STYLES[name])
    gbps = doc["memcpy"]["gbps"]
    ax.plot(
        xs,
        [r["touched_bytes"] / (gbps * 1e9) * 1e3 for r in records],
        ":",
        color="gray",
        label="bytes touched / memcpy",
    )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_ylabel("step time (ms)")
    ax.grid(True, which="both", alpha=0.3)


def _title(doc: dict[str, Any], sweep: str) -> str:
    base = doc["base"]
    rows = count_label(base["rows"])
    return {
        "rows (zipf)": f"Zipf(1.2) ids, width {base['width']}, {base['batch']} ids per batch",
        "rows (uniform)": f"uniform ids, width {base['width']}, {base['batch']} ids per batch",
        "batch": f"{rows} x {base['width']}, Zipf(1.2) ids",
        "width": f"{rows} rows, {base['batch']} Zipf(1.2) ids per batch",
    }[sweep]


def plots(doc: dict[str, Any], out: pathlib.Path) -> None:
    """Step time against table rows (Zipf and uniform ids), ids per batch and row width; log-log."""
    xlabels = {"rows": "table rows", "batch": "ids per batch", "width": "row width"}
    for name in _plots_drawn(doc):
        sweeps = [s for s in PLOTS[name] if _find(doc, s)]
        fig, axes = plt.subplots(1, len(sweeps), figsize=(6.4 * len(sweeps), 4.8), sharey=True, squeeze=False)
        for ax, sweep in zip(axes[0], sweeps, strict=True):
            _plot_sweep(ax, doc, sweep, _AXES[sweep])
            ax.set_xlabel(xlabels[_AXES[sweep]])
            ax.set_title(_title(doc, sweep), fontsize=10)
        axes[0][0].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / name, dpi=120)
        plt.close(fig)


RESULTS = pathlib.Path(__file__).resolve().parent / "results"
README_BEGIN = "<!-- benchmarks/report.py: begin (generated from benchmarks/results/results.json by --readme) -->"
README_END = "<!-- benchmarks/report.py: end -->"


def readme_line(doc: dict[str, Any]) -> str:
    """The README's headline: the first headline configuration's medians, with the run's machine, date and commit."""
    r = _find(doc, "headline")[0]
    cfg, res, m = r["config"], r["results"], doc["machine"]
    fused, torch_ms, dense = (_median(res.get(n)) for n in ("osa_fused", "torch_sparse_adam", "optax_adam"))
    assert fused is not None and torch_ms is not None and dense is not None, "a headline contender was not timed"
    dist = "Zipf(1.2)" if cfg["dist"] == "zipf" else cfg["dist"]
    commit = m.get("optax_sparse_adam", {}).get("commit", "unknown")[:7]
    return (
        f"One optimizer step on a {count_label(cfg['rows'])} x {cfg['width']} float32 table, {cfg['batch']:,} "
        f"{dist} ids a batch ({r['distinct']:,.0f} distinct rows), median ms: `osa.update_and_apply` {_ms(fused)}, "
        f"`torch.optim.SparseAdam` {_ms(torch_ms)} ({_ratio(torch_ms / fused)} as long), `optax.adam` {_ms(dense)} "
        f"({_ratio(dense / fused)}). Measured at commit `{commit}` on {m['cores']} cores ({m['cpu']}), every "
        f"contender on {doc['settings']['torch_threads']} threads, jax {m['jax']}, {m['date_utc']}."
    )


def write_readme(doc: dict[str, Any], path: pathlib.Path) -> None:
    """Replaces the text between ``README_BEGIN`` and ``README_END`` in ``path`` with ``readme_line(doc)``."""
    text = path.read_text()
    begin, end = text.index(README_BEGIN) + len(README_BEGIN), text.index(README_END)
    path.write_text(text[:begin] + "\n" + readme_line(doc) + "\n" + text[end:])


def write_all(doc: dict[str, Any], out: pathlib.Path) -> None:
    """Writes ``results.json``, then ``results.md`` and the plots, into ``out``."""
    doc = {**doc, "flatness": flatness(doc)}
    doc["targets"] = targets(doc)
    (out / "results.json").write_text(json.dumps(doc, indent=1) + "\n")
    render(out)


def render(out: pathlib.Path) -> None:
    """Writes ``results.md`` and the plots from ``out / "results.json"``."""
    doc = json.loads((out / "results.json").read_text())
    (out / "results.md").write_text(markdown(doc))
    plots(doc, out)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Writes results.md and the plots from a folder's results.json.")
    parser.add_argument("out", nargs="?", type=pathlib.Path, default=RESULTS, help="default: benchmarks/results")
    parser.add_argument("--readme", type=pathlib.Path, default=None, help="also write the headline into this README")
    args = parser.parse_args()
    render(args.out)
    if args.readme is not None:
        write_readme(json.loads((args.out / "results.json").read_text()), args.readme)
