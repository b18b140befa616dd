"""The benchmark runs end to end at tiny sizes and writes its report (its timings are not checked)."""

import importlib
import json
import os
import pathlib
import subprocess
import sys
from typing import Any

import pytest

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run_script(script: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``benchmarks/<script>`` with ``args``, from the repository root; fails the test if it fails."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _page_modules(*names: str) -> list[Any]:
    """``docs/generate.py`` and the benchmark scripts that render its pages, imported by name."""
    sys.path[:0] = [str(ROOT / "docs"), str(ROOT / "benchmarks")]
    try:
        return [importlib.import_module(name) for name in names]
    finally:
        del sys.path[:2]


def test_benchmark_smoke_writes_report(tmp_path: pathlib.Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    _run_script("run.py", "--smoke", "--out", str(tmp_path), env=env)

    table = (tmp_path / "results.md").read_text()
    assert "| configuration |" in table
    assert "## End-to-end train step" in table
    for name in ("step_time_vs_rows.png", "step_time_vs_batch.png", "step_time_vs_width.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name

    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["smoke"] is True
    assert doc["configs"]
    for record in doc["configs"]:
        assert set(record["results"]) == set(doc["contenders"])
    assert doc["compiles_once"]["traces"] == 1


def test_gpu_benchmark_smoke_runs_on_the_cpu_and_renders(tmp_path: pathlib.Path) -> None:
    """benchmarks/gpu.py at tiny sizes on whatever device there is: every contender runs, the page renders."""
    out = tmp_path / "gpu.json"
    proc = _run_script("gpu.py", "--smoke", "--json", str(out), "--resident-gb", "1e-4")
    doc = json.loads(out.read_text())
    (record,) = doc["configs"]
    assert set(record["results"]) == {
        "osa_fused",
        "osa_two_calls",
        "xla_floor",
        "torch_sparse_adam",
        "optax_adam",
        "torch_adam",
    }
    assert "| configuration |" in proc.stdout and "Summing duplicate ids" in proc.stdout


def test_rowwise_fbgemm_benchmark_smoke_agrees_with_fbgemm(tmp_path: pathlib.Path) -> None:
    """benchmarks/rowwise_fbgemm.py at tiny sizes: every contender runs in both configurations, and one step of the
    library's row-wise Adagrad equals FBGEMM's (EXACT_ROWWISE_ADAGRAD) from the same table to float32 rounding."""
    out = tmp_path / "rowwise_fbgemm.json"
    proc = _run_script("rowwise_fbgemm.py", "--quick", "--json", str(out))
    doc = json.loads(out.read_text())
    assert doc["agreement_max_abs_diff"] < 1e-6
    assert [r["config"]["dist"] for r in doc["runs"]] == ["zipf", "uniform"]
    for record in doc["runs"]:
        assert set(record["median_ms"]) == {"library", "fbgemm", "floor"}
        assert set(record["without_fbgemm_median_ms"]) == {"library", "floor"}
    assert "| configuration |" in proc.stdout


def test_huge_pages_benchmark_smoke_moves_one_copy_of_each_contender_and_renders(tmp_path: pathlib.Path) -> None:
    """benchmarks/huge_pages.py at tiny sizes: every contender runs on 4 KiB pages and on 2 MiB pages, the second copy
    of each (the library's arrays, torch's tensors) moved onto huge pages where the system allows it, and the docs'
    page renders from the results."""
    out = tmp_path / "huge_pages.json"
    proc = _run_script("huge_pages.py", "--quick", "--json", str(out))
    doc = json.loads(out.read_text())
    names = ["sparse_adam, update_and_apply", "sparse_adam, two calls", "sparse_rowwise_adagrad, update_and_apply"]
    assert [r["contender"] for r in doc["results"]] == [*names, "floor (p, mu, nu rows)", "torch.optim.SparseAdam"]
    for r in doc["results"]:
        assert set(r["ms"]) == {"4 KiB", "2 MiB"} and all(t > 0 for t in r["ms"].values())
        if doc["machine"]["transparent_hugepage"] in ("always", "madvise"):
            assert r["huge_share"]["2 MiB"] >= 0.8, r  # the tables of 100,000 rows, but their ends
        if doc["machine"]["transparent_hugepage"] == "madvise":
            assert r["huge_share"]["4 KiB"] <= 0.2, r  # not asked for
    assert "| contender | 4 KiB pages (ms) |" in proc.stdout
    generate, huge_pages = _page_modules("generate", "huge_pages")
    page = generate.huge_pages_page(huge_pages, doc)
    assert page.startswith("# Tables on huge pages") and "--json benchmarks/results/huge_pages.json" in page, page


def test_sharding_benchmark_many_tables_smoke(tmp_path: pathlib.Path) -> None:
    """benchmarks/sharding.py's many-tables measurement at tiny sizes, on the first 6 of its 26 tables (each table
    a program of its own to compile): the tables share three all-to-alls a step, the buckets receive at least the
    ideal bytes, no step falls back at the suggested capacity, and the page renders."""
    out = tmp_path / "sharding.json"
    args = ("--tables-only", "--tables", "6", "--table-rows", "4000", "--table-batch", "256", "--steps", "3")
    args += ("--record", "8")
    _run_script("sharding.py", *args, "--json", str(out))
    doc = json.loads(out.read_text())
    tables = doc["tables"]
    assert tables["tables"] == 6 and tables["ideal_recv_bytes"] > 0
    runs = {(r["layout"], r["capacity"]): r for r in tables["runs"]}
    assert set(runs) == {(a, b) for a in ("6 tables", "collection, shards=8") for b in ("default", "suggested")}
    for run in tables["runs"]:
        assert run["collectives_on_path"].get("all-to-all") == 3, run  # ids, rows, gradients: shared by all tables
        assert run["vs_ideal"] >= 1.0, run
        assert run["fallback_steps"] == 0 or run["capacity"] == "default", run
    # One bucket per owner for all the tables receives less than a bucket per table and owner.
    assert runs["collection, shards=8", "suggested"]["recv_bytes"] < runs["6 tables", "suggested"]["recv_bytes"]
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import generate
    finally:
        sys.path.pop(0)
    page = generate.sharding_page(doc)
    assert "## Many tables: DLRM's 6" in page and "The first 6 of the 26 Criteo tables" in page


def test_dlrm_train_benchmark_smoke_agrees_with_pytorch_and_renders(tmp_path: pathlib.Path) -> None:
    """benchmarks/dlrm_train.py at tiny sizes: the library's whole DLRM step and the same model's in PyTorch agree
    over five steps from the same parameters (losses and tables, to float32 rounding), both are timed, and the
    page renders."""
    args = ("--quick", "--configs", "dlrmv2", "--contenders", "osa_adam", "torch", "--pool", "4")
    _run_script("dlrm_train.py", *args, "--out", str(tmp_path))
    doc = json.loads((tmp_path / "dlrm_train_quick.json").read_text())
    agreement = doc["agreement"]
    assert agreement["steps"] == 5
    assert agreement["max_rel_loss_diff"] < 1e-4 and agreement["max_abs_table_diff"] < 1e-4, agreement
    (record,) = doc["configs"]
    assert set(record["results"]) == {"osa_adam", "torch"}
    generate, dlrm_train = _page_modules("generate", "dlrm_train")
    page = generate.dlrm_train_page(dlrm_train, doc)
    assert "## dlrmv2: 256 examples" in page and "| PyTorch EmbeddingBag + SparseAdam" in page


def test_the_tune_malloc_figures_of_the_which_path_page_are_the_results_files() -> None:
    """The "Which path do I use" page's figures for ``osa.tune_malloc()`` are generated from the committed width-64
    DLRM results, without and with it: the run's commit, each configuration's median of the library's stacked Adam
    step, and torch's over it (they were copied by hand, and went stale when the benchmark ran again)."""
    (generate,) = _page_modules("generate")
    results = ROOT / "benchmarks" / "results"
    wide, tuned = (json.loads((results / n).read_text()) for n in ("dlrm_w64.json", "dlrm_w64_malloc.json"))
    sentence = generate.tune_malloc_sentence(wide, tuned)
    assert "](benchmarks/dlrm.md)" in sentence
    for doc in (wide, tuned):
        assert doc["machine"]["optax_sparse_adam"]["commit"][:7] in sentence
        for config in doc["configs"]:
            r = {k: v["median_ms"] for k, v in config["results"].items()}
            assert f"{generate._ms(r['osa_adam'])} " in sentence, (config["config"]["name"], sentence)
            assert f"{r['torch_sparse_adam'] / r['osa_adam']:.1f}x" in sentence, sentence
    assert "_generated/tune_malloc.md" in (ROOT / "docs" / "which_path.md").read_text()


def test_the_gpu_crossover_figures_of_the_which_path_page_are_the_last_gpu_run() -> None:
    """The "Which path do I use" page's GPU crossover (the lazy step against ``optax.adam``) is generated from the
    last run of the committed ``gpu.json``: its device, commit and each ratio (they were copied by hand from an
    older run)."""
    (generate,) = _page_modules("generate")
    doc = json.loads((ROOT / "benchmarks" / "results" / "gpu.json").read_text())
    sentence, run = generate.gpu_crossover_sentence(doc), doc["runs"][-1]
    assert run["commit"] in sentence and run["machine"]["jax_device"] in sentence
    for config in run["configs"]:
        if config["config"]["width"] != 64 or config["config"]["dist"] != "zipf":
            continue
        r = {k: v["median_ms"] for k, v in config["results"].items()}
        ratio = max(r["optax_adam"] / r["osa_fused"], r["osa_fused"] / r["optax_adam"])
        assert f"{ratio:.1f}x" in sentence, (config["label"], sentence)
    assert "_generated/gpu_crossover.md" in (ROOT / "docs" / "which_path.md").read_text()
