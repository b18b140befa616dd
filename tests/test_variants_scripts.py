"""The variants' example and benchmark run end to end at small sizes (their timings are not checked)."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run(*args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def test_bf16_example_runs_small_and_stochastic_rounding_tracks_float32(tmp_path: pathlib.Path) -> None:
    summary = tmp_path / "losses.json"
    out = _run(
        "examples/bf16_stochastic_rounding.py",
        "--steps",
        "300",
        "--out",
        str(tmp_path / "plot.png"),
        "--json",
        str(summary),
    )
    last = {
        m[1].strip(): float(m[2]) for m in re.finditer(r"^(.+?)loss: first [\d.]+, last \d+ steps ([\d.]+)$", out, re.M)
    }
    assert len(last) == 3, out
    f32, nearest, stochastic = (
        last["float32"],
        last["bfloat16, round to nearest"],
        last["bfloat16, stochastic rounding"],
    )
    assert abs(stochastic - f32) < 0.02 * f32, out
    assert nearest > 1.05 * f32, out
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The JSON the low-precision guide's table is generated from: the printed means, rendered.
    doc = json.loads(summary.read_text())
    assert doc["steps"] == 300 and set(doc["runs"]) == set(last)
    assert all(abs(doc["runs"][name]["last"] - value) < 1e-4 for name, value in last.items())
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import generate
    finally:
        sys.path.remove(str(ROOT / "docs"))
    page = generate.bf16_losses_page(doc)
    assert f"| float32 | {doc['runs']['float32']['first']:.3f} | {doc['runs']['float32']['last']:.3f} |" in page


def test_variants_benchmark_runs_small_and_its_page_renders(tmp_path: pathlib.Path) -> None:
    results = tmp_path / "variants.json"
    small = ("--rows", "1000", "--batch", "64", "--steps", "2", "--warmup", "1", "--json", str(results))
    out = _run("benchmarks/variants.py", *small)
    names = ("sparse_adam (plain)", "sparse_adamw, catch_up", "sparse_amsgrad, catch_up", "sparse_rowwise_adagrad")
    names += ("inject_hyperparams(sparse_adam)", "chain(sparse_aware(clip_by_global_norm), sparse_adam)")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import floor  # benchmarks/floor.py: whether the floor column can be there
        import generate  # docs/generate.py, which renders benchmarks/results/variants.json into the site
    finally:
        sys.path.remove(str(ROOT / "docs"))
        sys.path.remove(str(ROOT / "benchmarks"))
    doors = r"\| ([\d.]+) \| [\d.]+x \| ([\d.]+) \| [\d.]+x \|"
    with_floor = floor.unavailable() is None
    # then the distinct-ids door, the floor and both ratios to it (dashes without a floor)
    # then the floor on every entry and the ratio to it
    cells = r" [\d.]+ \| [\d.]+x \| [\d.]+x \| [\d.]+ \| [\d.]+x \|"
    row = doors + r" [\d.]+ \|" + (cells if with_floor else r" - \| - \| - \| - \| - \|")
    row += r" \d+ \|$"
    for name in names:
        assert re.search(rf"^\| {re.escape(name)} {row}", out, re.M), out
    doc = json.loads(results.read_text())
    assert all(("floor_ms" in r) == with_floor and r["distinct_ms"] > 0 for r in doc["results"]), doc["results"]
    assert all(("floor_entries_ms" in r) == with_floor for r in doc["results"]), doc["results"]
    if with_floor:  # the floor's tables: p and each table-shaped part of the state (row-wise Adagrad: one float)
        widths = {r["variant"]: r["floor_widths"] for r in doc["results"]}
        assert widths["sparse_adam (plain)"] == [64, 64, 64] and widths["sparse_rowwise_adagrad"] == [64, 1], widths
    page = generate.variants_page(doc)
    floor_cells = r" [\d.]+ \| [\d.]+x \| [\d.]+ \| [\d.]+x \| [\d, ]+ \| [\d.]+ \| [\d.]+x \|"
    row = doors + (floor_cells if with_floor else "") + r" \d+ \|$"
    for name in names:
        assert re.search(rf"^\| `{re.escape(name)}` {row}", page, re.M), page
    assert "--steps 2 --warmup 1 --json" in page, page  # the command that made the results
    assert doc["settings"]["batches"] == "per door" and "each door with fresh batches of its own" in page, page
    old = doc | {"settings": {k: v for k, v in doc["settings"].items() if k != "batches"}}  # a run before that
    assert "The doors took each batch in turn" in generate.variants_page(old)
    # A run on a GPU (no floor there) renders as a section of its own, its rows without the floor's cells.
    gpu = doc | {"results": [{k: v for k, v in r.items() if not k.startswith("floor")} for r in doc["results"]]}
    gpu["machine"] = doc["machine"] | {"jax_device": "a GPU"}
    section = generate.variants_page(doc, {"runs": [gpu]}).split("## On a GPU (a GPU)")[1]
    for name in names:
        assert re.search(rf"^\| `{re.escape(name)}` {doors}$", section, re.M), section
