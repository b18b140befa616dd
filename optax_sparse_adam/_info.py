"""What a bug report needs: versions, platform, JAX's backend, and which path a sparse step runs, and why.

``python -m optax_sparse_adam`` prints it (:mod:`.__main__`). The kernel line
is :func:`.kernel_path`'s answer with its reason, from what
:mod:`._kernel_path` knows: whether the library was built and loaded, whether
``OPTAX_SPARSE_ADAM_KERNELS=0`` turns it off, and whether JAX has a CPU
backend for it to run on.
"""

from __future__ import annotations

import collections
import importlib.metadata
import os
import platform
import shutil
import sys
import sysconfig

import jax

import optax_sparse_adam
from optax_sparse_adam import _kernel_path
from optax_sparse_adam._huge_pages import transparent_huge_pages

_ENVIRONMENT = ("OPTAX_SPARSE_ADAM_KERNELS", "OPTAX_SPARSE_ADAM_THREADS", "JAX_PLATFORMS", "XLA_FLAGS")


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _kernels() -> str:
    """:func:`.kernel_path`'s answer for a step traced now, and why."""
    path, library = _kernel_path.kernel_path(), _kernel_path._LIB
    if library is None:
        compiler = (os.environ.get("CXX") or sysconfig.get_config_var("CXX") or "c++").split()[0]
        now = f"{compiler} is on PATH now: reinstall to build them" if shutil.which(compiler) else f"no {compiler} now"
        return (
            f"{path}: the native kernels were not built (at install time: no C++17 compiler, no XLA FFI headers in "
            f"jaxlib, or OPTAX_SPARSE_ADAM_BUILD_KERNELS=0); {now}"
        )
    if not _kernel_path.enabled():
        value = os.environ.get("OPTAX_SPARSE_ADAM_KERNELS")
        return f"{path}: the native kernels are built, but OPTAX_SPARSE_ADAM_KERNELS={value} turns them off"
    try:
        jax.devices("cpu")
    except RuntimeError:
        return "xla: the native kernels are built, but JAX has no CPU backend here for them to run on"
    if jax.default_backend() != "cpu":
        return (
            f"{path} for arrays on the CPU (built and loaded: {library._name}); arrays on the default backend, "
            f"{jax.default_backend()}, take the XLA path"
        )
    return f"{path}: built and loaded ({library._name})"


def _huge_pages() -> str:
    """The system's transparent huge page setting, and what it means for the tables."""
    mode = transparent_huge_pages()
    if mode == "always":
        return "always (large buffers are on 2 MiB pages from the start)"
    if mode == "madvise":
        return "madvise (tables are on 4 KiB pages unless asked: osa.advise_huge_pages)"
    return f"{mode} (tables stay on 4 KiB pages)" if mode else "none (not Linux)"


def info() -> list[tuple[str, str]]:
    """The report as ``(field, value)`` pairs, in the order printed."""
    cpus = os.cpu_count() or 1
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cpus
    kinds = collections.Counter((d.platform, d.device_kind) for d in jax.devices())
    rows = [
        ("optax_sparse_adam", f"{optax_sparse_adam.__version__} ({os.path.dirname(optax_sparse_adam.__file__)})"),
        ("python", f"{platform.python_version()} ({platform.python_implementation()}, {sys.executable})"),
        ("platform", platform.platform()),
        *((dist, _version(dist)) for dist in ("jax", "jaxlib", "optax", "numpy", "flax")),
        ("jax backend", jax.default_backend()),
        ("devices", ", ".join(f"{n} {p}" + (f" ({kind})" if kind != p else "") for (p, kind), n in kinds.items())),
        ("cpu threads", f"{usable} usable of {cpus}; a kernel call uses up to {_kernel_path.threads()}"),
        ("kernel path", _kernels()),
        ("huge pages", _huge_pages()),
    ]
    rows += [(name, os.environ[name]) for name in _ENVIRONMENT if name in os.environ]
    return rows


def main() -> None:
    rows = info()
    width = max(len(field) for field, _ in rows)
    for field, value in rows:
        print(f"{field + ':':<{width + 1}} {value}")
