"""``examples/dlrm.py`` runs small, one-hot and multi-hot, and its loss falls."""

from __future__ import annotations

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
