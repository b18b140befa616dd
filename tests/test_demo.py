"""``make demo`` runs end to end (small), and both optimizers learn."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

DEMO = pathlib.Path(__file__).resolve().parents[1] / "examples" / "demo.py"


def test_demo_runs_small_and_both_optimizers_learn():
    env = {**os.environ, "DEMO_ROWS": "20000", "DEMO_STEPS": "50"}
    out = subprocess.run(
        [sys.executable, str(DEMO)], env=env, capture_output=True, text=True, timeout=300, check=True
    ).stdout
    rows = [tuple(map(float, m.groups())) for m in re.finditer(r"^\s*\d+\s+([\d.]+)\s+([\d.]+)\s*$", out, re.M)]
    assert len(rows) == 3, out  # steps 1, 25 and 50
    (adam_first, sparse_first), (adam_last, sparse_last) = rows[0], rows[-1]
    assert adam_first == sparse_first, out  # same parameters, same batch
    assert adam_last < adam_first and sparse_last < sparse_first, out
    assert re.search(r"median step time: optax.adam [\d.]+ ms, sparse_adam [\d.]+ ms", out), out
