"""The notebooks run end to end at their small size and show their plots (their timings are not checked).

The kernel is the interpreter running the tests, from a kernel spec written to a temporary folder, so the test
needs no registered kernel and ignores any the user has. ``python tests/test_notebook.py [NAME ...]`` re-executes the
named notebooks (all by default) at full size and saves them with their outputs, and the figure of the cell tagged
``readme-figure`` as ``notebooks/NAME.png``.
"""

from __future__ import annotations

import base64
import json
import os
import pathlib
import sys
import tempfile

import nbformat
import pytest
from jupyter_client import AsyncKernelManager
from jupyter_client.kernelspec import KernelSpecManager
from nbclient import NotebookClient

pytestmark = pytest.mark.slow

NOTEBOOKS = pathlib.Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOK = NOTEBOOKS / "train_embeddings.ipynb"
WORD_EMBEDDINGS = NOTEBOOKS / "word_embeddings.ipynb"

# Run first in the test: the suite's strictness (pytest's warnings as errors, conftest's rank promotion), applied to
# the notebook's code after the kernel has started.
STRICT = """\
import warnings
warnings.simplefilter("error")
import jax
jax.config.update("jax_numpy_rank_promotion", "raise")
"""

# Run last in the test: what the notebook computed, for the assertions.
REPORT = """\
import json
print(json.dumps({
    "small": SMALL, "steps": STEPS, "batch": BATCH, "table_rows": NUM_USERS + NUM_ITEMS, "eval_steps": eval_steps,
    "runs": {name: {k: run[k] for k in ("loss", "rows", "held_out", "seconds")} for name, run in runs.items()},
}))
"""

NAMES = ("optax.adam", "sparse_adam, dense path", "sparse_adam, fast path")

WORD_REPORT = """\
import json

print(json.dumps({
    "small": SMALL, "steps": STEPS, "batch": BATCH, "negatives": NEGATIVES, "vocab": VOCAB, "eval_steps": eval_steps,
    "queries": QUERIES, "probes": probes,
    "chance": [chance_error, chance_family],
    "runs": {name: {k: run[k] for k in ("loss", "rows", "held_out", "seconds")} for name, run in runs.items()},
}))
"""


def execute(nb: nbformat.NotebookNode, cwd: pathlib.Path, env: dict[str, str]) -> nbformat.NotebookNode:
    """Executes ``nb`` in place in a kernel running ``sys.executable``; raises on the first failing cell."""
    kernel_dir = cwd / "kernels" / "notebook-kernel"
    kernel_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python (tests)",
        "language": "python",
    }
    (kernel_dir / "kernel.json").write_text(json.dumps(spec))
    specs = KernelSpecManager(kernel_dirs=[str(kernel_dir.parent)], ensure_native_kernel=False)
    km = AsyncKernelManager(kernel_name=kernel_dir.name, kernel_spec_manager=specs)
    client = NotebookClient(nb, km=km, timeout=1800, record_timing=False, resources={"metadata": {"path": str(cwd)}})
    return client.execute(cleanup_kc=True, env=env)


def kernel_env(small: bool) -> dict[str, str]:
    # conftest's XLA_FLAGS (8 host devices) is for the sharding tests, not for the notebook.
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "OSA_NOTEBOOK_SMALL")}
    if small:
        env["OSA_NOTEBOOK_SMALL"] = "1"
    return env


def run_small(path: pathlib.Path, report: str, cwd: pathlib.Path) -> list[nbformat.NotebookNode]:
    """Executes the notebook at ``path`` small and strictly, ``report`` last; returns its code cells."""
    nb = nbformat.read(path, as_version=4)
    nb.cells.insert(0, nbformat.v4.new_code_cell(STRICT))
    nb.cells.append(nbformat.v4.new_code_cell(report))
    execute(nb, cwd, kernel_env(small=True))
    code_cells = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code_cells)
    return code_cells


def test_notebook_runs_small(tmp_path: pathlib.Path) -> None:
    code_cells = run_small(NOTEBOOK, REPORT, tmp_path)
    images = [o for c in code_cells for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) == 4  # Zipf check, loss curves, step time, rows moved

    text = "".join(o.get("text", "") for c in code_cells[:-1] for o in c.outputs if o.output_type == "stream")
    for name in NAMES:
        assert name in text
    assert "largest difference between the two sparse_adam paths" in text

    report = json.loads(code_cells[-1].outputs[-1]["text"])
    assert report["small"] is True
    steps, batch, runs = report["steps"], report["batch"], report["runs"]
    assert set(runs) == set(NAMES)
    for name, run in runs.items():
        assert len(run["loss"]) == len(run["rows"]) == len(run["seconds"]) == steps, name
        assert len(run["held_out"]) == len(report["eval_steps"]), name
        assert all(x == x and x < 10 for x in run["loss"] + run["held_out"]), name  # finite
        assert run["held_out"][-1] < run["held_out"][0], name  # it learns
    # The two sparse_adam paths are the same computation; the lazy steps move at most the batch's rows.
    for a, b in zip(runs["sparse_adam, dense path"]["loss"], runs["sparse_adam, fast path"]["loss"], strict=True):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(a))
    assert runs["sparse_adam, dense path"]["rows"] == runs["sparse_adam, fast path"]["rows"]
    for rows in runs["sparse_adam, fast path"]["rows"]:
        assert 0 < rows <= 2 * batch
    assert max(runs["optax.adam"]["rows"]) > max(runs["sparse_adam, fast path"]["rows"])
    assert max(runs["optax.adam"]["rows"]) <= report["table_rows"]


def test_word_embeddings_runs_small(tmp_path: pathlib.Path) -> None:
    code_cells = run_small(WORD_EMBEDDINGS, WORD_REPORT, tmp_path)
    outputs = [o for c in code_cells for o in c.outputs]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) == 5  # frequencies, loss curves, step time, rows touched, 2-D projection
    report = json.loads(code_cells[-1].outputs[-1]["text"])
    assert report["small"] is True

    # The neighbour table: one row per query, a column per path shown.
    tables = [o["data"]["text/markdown"] for o in outputs if "text/markdown" in o.get("data", {})]
    assert len(tables) == 1
    assert tables[0].count("\n") == len(report["queries"]) + 1
    for query in report["queries"]:
        assert f"| `{query}` |" in tables[0]
    assert "| `self` |" in tables[0] and "not in the vocabulary" not in tables[0].split("| `self` |")[1].split("\n")[0]

    names = ["optax.adam", "sparse_adam, fast path", "sparse_adam, fused", "sparse_adam, catch-up"]
    runs, steps, batch, vocab = report["runs"], report["steps"], report["batch"], report["vocab"]
    assert list(runs) == names
    for name, run in runs.items():
        assert len(run["loss"]) == len(run["rows"]) == len(run["seconds"]) == steps, name
        assert len(run["held_out"]) == len(report["eval_steps"]), name
        assert all(x == x and 0 < x < 10 for x in run["loss"] + run["held_out"]), name  # finite
        assert run["held_out"][-1] < run["held_out"][0], name  # it learns
        assert name in report["probes"], name
    # The sparse paths touch the batch's distinct ids only; optax.adam changes rows the batch did not look up.
    fast = runs["sparse_adam, fast path"]
    for rows_in, rows_out in fast["rows"]:
        assert 0 < rows_in <= batch and 0 < rows_out <= min(batch * (1 + report["negatives"]), vocab)
    assert max(r[0] for r in runs["optax.adam"]["rows"]) > batch
    for a, b in zip(fast["loss"], runs["sparse_adam, fused"]["loss"], strict=True):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(a))
    assert runs["sparse_adam, fused"]["rows"] == fast["rows"]
    # Catch-up trains as optax.adam does (its batch and held-out losses), touching the batch's rows only; lazy Adam
    # does not.
    caught, adam = runs["sparse_adam, catch-up"], runs["optax.adam"]
    assert caught["rows"] == fast["rows"]
    for key in ("loss", "held_out"):
        gap = max(abs(a - b) for a, b in zip(caught[key], adam[key], strict=True))
        lazy_gap = max(abs(a - b) for a, b in zip(fast[key], adam[key], strict=True))
        assert gap <= 1e-4 and lazy_gap > 100 * gap, (key, gap, lazy_gap)
    for probe in [*report["probes"].values(), report["chance"]]:
        assert all(0 <= x <= 1 for x in probe)


def save_readme_figure(nb: nbformat.NotebookNode, png: pathlib.Path) -> None:
    """Writes the figure of the cell tagged ``readme-figure`` to ``png``."""
    (cell,) = [c for c in nb.cells if "readme-figure" in c.metadata.get("tags", [])]
    (image,) = [o["data"]["image/png"] for o in cell.outputs if "image/png" in o.get("data", {})]
    png.write_bytes(base64.b64decode(image))


if __name__ == "__main__":
    for stem in sys.argv[1:] or ["train_embeddings", "word_embeddings"]:
        path = NOTEBOOKS / f"{stem}.ipynb"
        notebook = nbformat.read(path, as_version=4)
        with tempfile.TemporaryDirectory() as tmp:
            execute(notebook, pathlib.Path(tmp), kernel_env(small=False))
        nbformat.write(notebook, path)
        save_readme_figure(notebook, NOTEBOOKS / f"{stem}.png")
        print(f"executed {path} at full size and saved its outputs and README figure")
