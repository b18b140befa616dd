"""``examples/dlrm.py`` runs small, one-hot and multi-hot, and its loss falls."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

DLRM = pathlib.Path(__file__).resolve().parents[1] / "examples" / "dlrm.py"


@pytest.mark.parametrize("extra", [[], ["--multi-hot", "--batch", "128"]])
def test_dlrm_trains_small(extra):
    cmd = [sys.executable, str(DLRM), "--max-rows", "5000", "--steps", "80", "--batch", "512", *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True).stdout
    losses = [float(m.group(1)) for m in re.finditer(r"^\s+\d+\s+([\d.]+)\s*$", out, re.M)]
    assert len(losses) == 6, out  # step 1 and five more
    assert losses[-1] < 0.9 * losses[0], out
    assert "generated Criteo-shaped data" in out and re.search(r"median step time [\d.]+ ms", out), out


def test_dlrm_compare_catch_up_trains_as_dense_adam(tmp_path):
    """``--compare``: on the same batches, catch-up Adam's training and held-out losses are dense ``optax.adam``'s
    (to the printed digits, float32 rounding apart), while lazy Adam's differ somewhere; step times printed; the
    results file renders as the docs' page, the same numbers in its table."""
    results = tmp_path / "dlrm_catch_up.json"
    cmd = [sys.executable, str(DLRM), "--compare", "--max-rows", "5000", "--steps", "60", "--batch", "256"]
    cmd += ["--json", str(results)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True).stdout
    pair = r"([\d.]+) / ([\d.]+)"
    rows = [[float(x) for x in m.groups()] for m in re.finditer(rf"^\s+\d+\s+{pair}\s+{pair}\s+{pair}\s*$", out, re.M)]
    assert len(rows) == 6, out
    for row in rows:
        dense, caught = row[0:2], row[4:6]
        assert max(abs(a - b) for a, b in zip(dense, caught, strict=True)) <= 2e-4, out
    assert any(abs(r[1] - r[3]) > 5e-4 for r in rows), out  # lazy Adam's held-out loss is not dense Adam's
    assert re.search(r"median step time: optax.adam [\d.]+ ms, sparse_adam [\d.]+ ms, sparse_adam\(catch_up", out), out
    sys.path.insert(0, str(DLRM.parents[1] / "docs"))
    try:
        import generate  # docs/generate.py

        page = generate.dlrm_catch_up_page(json.loads(results.read_text()))
    finally:
        sys.path.remove(str(DLRM.parents[1] / "docs"))
    table = [
        [float(x) for x in m.groups()] for m in re.finditer(rf"^\| \d+ \| {pair} \| {pair} \| {pair} \|$", page, re.M)
    ]
    assert table == rows, page
    assert "--compare --max-rows 5000 --steps 60 --batch 256 --json" in page, page
