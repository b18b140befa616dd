"""``examples/migrate_from_torch.py``: ``sparse_adam(eps_placement="torch")`` trains as SparseAdam + Adam."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "examples" / "migrate_from_torch.py"


def test_the_recipe_matches_torch():
    cmd = [sys.executable, str(SCRIPT), "--rows", "2000", "--steps", "100"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True).stdout
    found = re.search(r"loss within ([\d.e+-]+) of torch's \(relative\), parameters within ([\d.e+-]+)", out)
    assert found, out
    # Float32 rounding of two differently ordered forward passes, over 100 steps of Adam.
    assert float(found.group(1)) < 1e-5 and float(found.group(2)) < 1e-4, out
