"""Which path a sparse step runs: the native CPU kernels or the portable XLA path.

The compiled library (``_kernels*.so``, built by ``pip install`` when a C++17
compiler is there; sources in ``csrc/``) holds XLA FFI handlers for the sparse
step; :mod:`._ffi` calls them. This module loads the library and registers
each handler once, at import, under a versioned name; holds the user's choice
(:func:`use_kernels`, part of jit's cache key); and decides, in one place,
where a kernel runs: :func:`supports` says whether the kernels handle a leaf,
and :func:`select` lowers the kernel on the CPU and the XLA path on every other
platform (``jax.lax.platform_dependent``). Without the library, or inside
``use_kernels(False)``, the XLA path runs everywhere.

The kernels cover float32 tables, moments and values with one sparse axis
(``IndexedRows``, BCOO with ``n_sparse == 1``) and fewer than 2**31 rows; the
XLA path handles everything else. Their moments are bitwise those of the XLA
path, and so is the step.

Environment: ``OPTAX_SPARSE_ADAM_KERNELS=0`` makes the XLA path the default;
``OPTAX_SPARSE_ADAM_THREADS=n`` (default: the CPUs this process may run on,
at most :data:`MAX_THREADS`) sets the threads a kernel call may use, taken
from XLA's intra-op pool. The numbers do not depend on it.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.machinery
import os
import pathlib
from collections.abc import Callable, Iterator
from typing import Any, Literal

import jax
import jax.extend.core as jex
import jax.numpy as jnp

from optax_sparse_adam._row_ops import explicit_sharding

__all__ = ["kernel_path", "use_kernels"]

MAX_THREADS = 16
PREFIX = "optax_sparse_adam_v1_"  # bump when a handler's operands or attributes change
_SYMBOLS = {
    "sparse_adam_rows": "OptaxSparseAdamRows",
    "sparse_adam_apply": "OptaxSparseAdamApply",
    "scatter_add": "OptaxSparseAdamScatterAdd",
}
_MAX_ROWS = 2**31 - 1  # keys are int32, and the padding key num_rows must be one too


def _default_threads() -> int:
    """The CPUs this process may run on (as XLA sizes its intra-op pool), at most ``MAX_THREADS``."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cpus, MAX_THREADS))


def _threads_from_env() -> int:
    raw = os.environ.get("OPTAX_SPARSE_ADAM_THREADS", str(_default_threads()))
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(f"OPTAX_SPARSE_ADAM_THREADS={raw!r}: it must be an integer from 1 to {MAX_THREADS}") from None
    if not 1 <= n <= MAX_THREADS:
        raise ValueError(f"OPTAX_SPARSE_ADAM_THREADS={raw!r}: it must be an integer from 1 to {MAX_THREADS}")
    return n


def _load() -> ctypes.CDLL | None:
    """Loads the compiled library next to this file and registers its targets, or returns None."""
    here = pathlib.Path(__file__).resolve().parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = here / f"_kernels{suffix}"
        if path.exists():
            lib = ctypes.CDLL(str(path))
            for name, symbol in _SYMBOLS.items():
                jax.ffi.register_ffi_target(PREFIX + name, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
            return lib
    return None


_LIB = _load()  # registration happens here, once per process
# Part of jit's cache key: a function traced with the kernels is traced again without them.
_CONFIG = jax.make_user_context(
    default_value=(os.environ.get("OPTAX_SPARSE_ADAM_KERNELS", "1") != "0", _threads_from_env())
)


def available() -> bool:
    """Whether the compiled kernels were built and loaded."""
    return _LIB is not None


def enabled() -> bool:
    """Whether code traced now uses the kernels on the CPU."""
    return _LIB is not None and bool(_CONFIG.value[0])


def kernel_path() -> Literal["native-cpu", "xla"]:
    """Which implementation a sparse step traced now runs on the CPU.

    ``"native-cpu"``: the compiled kernels (for float32 tables with one sparse
    axis; other leaves take the XLA path); ``"xla"``: the portable XLA path,
    because the kernels were not built (no C++ compiler at install time),
    ``OPTAX_SPARSE_ADAM_KERNELS=0`` is set, or inside ``use_kernels(False)``.
    On GPU and TPU the XLA path always runs.

    Returns:
      ``"native-cpu"`` or ``"xla"``.

    Examples:
      >>> import optax_sparse_adam as osa
      >>> with osa.use_kernels(False):
      ...     osa.kernel_path()
      'xla'
    """
    return "native-cpu" if enabled() else "xla"


@contextlib.contextmanager
def use_kernels(enabled: bool = True, *, threads: int | None = None) -> Iterator[None]:
    """Chooses, for code traced inside, between the native CPU kernels and the XLA path.

    The choice is part of :func:`jax.jit`'s cache key, so a jitted function is
    traced anew when it changes. Without compiled kernels, ``enabled=True``
    changes nothing.

    Args:
      enabled: Whether to use the kernels on the CPU.
      threads: Threads a kernel call may use (1 to 16, from XLA's intra-op
        pool; the numbers do not depend on it); ``None`` keeps the current
        number (at first ``OPTAX_SPARSE_ADAM_THREADS``, or the CPUs this
        process may run on, at most 16).

    Yields:
      Nothing; the choice holds inside the ``with`` block.

    Examples:
      >>> import jax.numpy as jnp
      >>> import optax_sparse_adam as osa
      >>> p = jnp.zeros((3, 2), jnp.float32)
      >>> u = osa.IndexedRows(jnp.array([2, 2]), jnp.ones((2, 2), jnp.float32), 3)
      >>> with osa.use_kernels(False):
      ...     osa.apply_updates(p, u)[2]
      Array([2., 2.], dtype=float32)
    """
    current_threads = _CONFIG.value[1]
    if threads is None:
        threads = current_threads
    elif isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= MAX_THREADS:
        raise ValueError(f"use_kernels: threads={threads!r}; it must be an integer from 1 to {MAX_THREADS}")
    with _CONFIG((bool(enabled), threads)):
        yield


def threads() -> int:
    """The threads a kernel call traced now may use."""
    return int(_CONFIG.value[1])


def select(native: Callable[[], Any], xla: Callable[[], Any]) -> Any:
    """The one place that picks an implementation: ``native()`` on the CPU, ``xla()`` elsewhere.

    Both are traced; the lowering keeps the branch of the platform it lowers
    for. Without kernels (or inside ``use_kernels(False)``) only ``xla`` is
    traced.
    """
    if not enabled():
        return xla()
    return jax.lax.platform_dependent(cpu=native, default=xla)


def supports(shape: tuple[int, ...], n_sparse: int, *arrays: Any) -> bool:
    """Whether the kernels handle a table of ``shape`` addressed by ``n_sparse`` axes, with these operands.

    The operands must be float32, and neither inside ``shard_map`` with values
    that vary over a manual axis nor sharded over an ``Explicit`` mesh axis:
    there the XLA path's sharding rules apply, which a custom call does not
    follow (the routed steps of ``RowSharding`` run the XLA path).
    """
    return (
        enabled()
        and n_sparse == 1
        and len(shape) >= 1
        and shape[0] <= _MAX_ROWS
        and all(jnp.dtype(a.dtype) == jnp.float32 for a in arrays)
        and not any(explicit_sharding(a) is not None for a in arrays)
        and not _in_manual_axes()
    )


def _in_manual_axes() -> bool:
    """Whether tracing happens inside ``shard_map`` (or another map over named axes).

    There every operand and result carries the axes it varies over, which the
    XLA path infers and a custom call cannot state, so the XLA path runs.
    """
    return bool(jex.unsafe_get_axis_names_DO_NOT_USE())
