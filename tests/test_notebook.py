"""The notebook runs end to end at its small size and shows its plots (its timings are not checked).

The kernel is the interpreter running the tests, from a kernel spec written to a temporary folder, so the test
needs no registered kernel and ignores any the user has. ``python tests/test_notebook.py`` re-executes the notebook
at full size and saves it with its outputs.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import tempfile

import nbformat
from jupyter_client import AsyncKernelManager
from jupyter_client.kernelspec import KernelSpecManager
from nbclient import NotebookClient

NOTEBOOK = pathlib.Path(__file__).resolve().parents[1] / "notebooks" / "train_embeddings.ipynb"

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
    client = NotebookClient(nb, km=km, timeout=600, record_timing=False, resources={"metadata": {"path": str(cwd)}})
    return client.execute(cleanup_kc=True, env=env)


def kernel_env(small: bool) -> dict[str, str]:
    # conftest's XLA_FLAGS (8 host devices) is for the sharding tests, not for the notebook.
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "OSA_NOTEBOOK_SMALL")}
    if small:
        env["OSA_NOTEBOOK_SMALL"] = "1"
    return env


def test_notebook_runs_small(tmp_path: pathlib.Path) -> None:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nb.cells.insert(0, nbformat.v4.new_code_cell(STRICT))
    nb.cells.append(nbformat.v4.new_code_cell(REPORT))
    execute(nb, tmp_path, kernel_env(small=True))

    code_cells = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code_cells)
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


if __name__ == "__main__":
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    with tempfile.TemporaryDirectory() as tmp:
        execute(notebook, pathlib.Path(tmp), kernel_env(small=False))
    nbformat.write(notebook, NOTEBOOK)
    print(f"executed {NOTEBOOK} at full size and saved its outputs")
