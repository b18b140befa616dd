"""The package's namespace and import: only ``__all__`` is public, and importing it loads no more than it needs;
``python -m optax_sparse_adam`` reports what a bug report needs."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import types

import jax
import jaxlib
import numpy as np
import optax
import pytest

import optax_sparse_adam as osa
from optax_sparse_adam import _info, _kernel_path


def test_public_names_are_exactly_all():
    public = {n for n in dir(osa) if not n.startswith("_") and not isinstance(getattr(osa, n), types.ModuleType)}
    assert public == set(osa.__all__)
    assert isinstance(osa.__version__, str)


def test_import_does_not_load_jax_experimental_sparse():
    """BCOO support costs nothing until a BCOO exists (jax.experimental.sparse pulls scipy.sparse, ~0.4 s)."""
    code = (
        "import sys, optax_sparse_adam; "
        "print(sorted(m for m in sys.modules if m.startswith(('jax.experimental.sparse', 'scipy.sparse'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout


def _report(**env: str) -> dict[str, str]:
    """``python -m optax_sparse_adam``'s lines as {field: value}."""
    out = subprocess.run(
        [sys.executable, "-m", "optax_sparse_adam"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    return {field: value.strip() for field, value in (line.split(":", 1) for line in out.splitlines())}


@pytest.mark.parametrize("kernels", [None, "0"])
def test_main_prints_what_a_bug_report_needs(kernels):
    """The versions, the platform, the devices, and which kernel path runs, for the reason that holds here."""
    env = {"OPTAX_SPARSE_ADAM_KERNELS": kernels} if kernels else {}
    report = _report(**env)
    assert report["optax_sparse_adam"].startswith(osa.__version__ + " ("), report
    assert report["python"].startswith(platform.python_version()), report
    assert report["jax"] == jax.__version__ and report["jaxlib"] == jaxlib.__version__, report
    assert report["optax"] == optax.__version__ and report["numpy"] == np.__version__, report
    for field in ("platform", "jax backend", "devices", "cpu threads"):
        assert report[field], report
    disabled = (kernels or os.environ.get("OPTAX_SPARSE_ADAM_KERNELS")) == "0"
    line = report["kernel path"]
    if not _kernel_path.available():
        assert line.startswith("xla: the native kernels were not built"), line
    elif disabled:
        assert line.startswith("xla: the native kernels are built, but OPTAX_SPARSE_ADAM_KERNELS=0"), line
        assert report["OPTAX_SPARSE_ADAM_KERNELS"] == "0", report
    else:
        assert line.startswith("native-cpu: built and loaded ("), line


@pytest.mark.parametrize(
    ("name", "value"), [("OPTAX_SPARSE_ADAM_KERNELS", "false"), ("OPTAX_SPARSE_ADAM_THREADS", "0")]
)
def test_a_setting_in_the_environment_it_does_not_take_is_refused_at_import(name, value):
    """OPTAX_SPARSE_ADAM_KERNELS=false (or off, no) left the kernels on: only "0" turned them off."""
    run = subprocess.run(
        [sys.executable, "-c", "import optax_sparse_adam"],
        env={**os.environ, name: value},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode != 0 and f"ValueError: {name}={value!r}: it must be" in run.stderr, run.stderr


def test_kernel_line_without_a_cpu_backend(monkeypatch):
    """On a GPU host the kernels serve CPU arrays only; without a CPU backend, none."""
    if not _kernel_path.enabled():
        pytest.skip("the native kernels were not built, or are turned off")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert _info._kernels().startswith("native-cpu for arrays on the CPU")
    assert "the default backend, gpu, take the XLA path" in _info._kernels()

    def no_cpu(backend=None):
        raise RuntimeError(f"Unknown backend {backend}")

    monkeypatch.setattr(jax, "devices", no_cpu)
    assert _info._kernels() == "xla: the native kernels are built, but JAX has no CPU backend here for them to run on"
