"""The README's quick start runs as written, and its step touches only the rows the batch reads."""

from __future__ import annotations

import pathlib

import jax
import numpy as np
import pytest

pytestmark = pytest.mark.slow

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _quick_start() -> str:
    text = README.read_text()
    section = text[text.index("## Quick start") :]
    return section[section.index("```python\n") + len("```python\n") :].split("```", 1)[0]


def test_quick_start_runs_and_moves_only_the_rows_it_reads():
    scope: dict = {}
    exec(compile(_quick_start(), "README quick start", "exec"), scope)
    coll, params, loss = scope["coll"], scope["params"], scope["loss"]
    assert np.isfinite(float(loss))
    fresh = coll.init(jax.random.key(0))
    user = np.asarray(coll.table(params["emb"], "user") != coll.table(fresh, "user")).any(axis=1)
    item = np.asarray(coll.table(params["emb"], "item") != coll.table(fresh, "item")).any(axis=1)
    assert set(np.flatnonzero(user)) == {3, 7}
    assert set(np.flatnonzero(item)) == {1, 2, 4, 9}


def test_dlrm_benchmark_block_is_generated_from_its_results():
    """The README's DLRM figures are the results file's, rendered: a hand edit or a stale file fails here."""
    import importlib.util
    import json
    import sys

    root = README.parent
    sys.path.insert(0, str(root / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location("dlrm_benchmark", root / "benchmarks" / "dlrm.py")
        dlrm = importlib.util.module_from_spec(spec)
        sys.modules["dlrm_benchmark"] = dlrm  # its dataclasses look their module up
        spec.loader.exec_module(dlrm)
    finally:
        sys.path.remove(str(root / "benchmarks"))
        sys.modules.pop("dlrm_benchmark", None)
    doc = json.loads((root / "benchmarks" / "results" / "dlrm.json").read_text())
    text = README.read_text()
    block = text[text.index(dlrm.README_BEGIN) + len(dlrm.README_BEGIN) : text.index(dlrm.README_END)]
    assert block.strip() == dlrm.readme_block(doc).strip()
    assert not doc["quick"]
