"""The benchmark's memory floors: native kernels that only read and write the rows a step touches.

The kernel (``floor/touch_rows.cc``, an XLA FFI handler) is not part of the
library. It is compiled on first use with the system C++ compiler (``$CXX``,
else ``c++`` or ``g++``), with the library's flags, against jaxlib's XLA FFI
headers and the library's ``rows.h`` (``optax_sparse_adam/csrc``, on the
include path), into ``floor/build/`` (git-ignored); it is rebuilt when the
source or a header is newer than the built library. It is loaded with ctypes
and registered, once per process, as the CPU targets ``osa_bench_touch_rows`` (:func:`touch_rows`: one gradient row a
distinct id) and ``osa_bench_sum_touch_rows`` (:func:`sum_touch_rows`: every entry of a batch with duplicate ids,
its grouping computed beforehand).
"""

from __future__ import annotations

import ctypes
import math
import os
import pathlib
import shutil
import subprocess
import tempfile
from typing import Any

import jax
import numpy as np

TARGET = "osa_bench_touch_rows"
SUM_TARGET = "osa_bench_sum_touch_rows"
_HERE = pathlib.Path(__file__).resolve().parent
SOURCE = _HERE / "floor" / "touch_rows.cc"
CSRC = _HERE.parent / "optax_sparse_adam" / "csrc"  # the library's headers (rows.h)
BUILD = _HERE / "floor" / "build"
LIBRARY = BUILD / "libosa_bench_floor.so"
# As setup.py builds the library's kernels (no fast-math, no contraction, no errno), plus a shared object.
FLAGS = ["-std=c++17", "-O3", "-ffp-contract=off", "-fno-fast-math", "-fno-math-errno", "-fPIC", "-shared", "-pthread"]

_registered = False


def _ffi_include() -> pathlib.Path | None:
    """jaxlib's XLA FFI headers, found as setup.py finds them, or None."""
    try:
        import jaxlib
    except ImportError:
        return None
    include = pathlib.Path(jaxlib.__file__).resolve().parent / "include"
    return include if (include / "xla" / "ffi" / "api" / "ffi.h").exists() else None


def _compiler() -> str | None:
    """The C++ compiler command: ``$CXX`` where it names one that exists, else ``c++`` or ``g++``; or None."""
    cxx = os.environ.get("CXX", "").strip()
    if cxx:
        return cxx if shutil.which(cxx.split()[0]) else None
    return shutil.which("c++") or shutil.which("g++")


def _inputs(include: pathlib.Path | None) -> list[pathlib.Path]:
    """The files the built library depends on."""
    deps = [SOURCE, *sorted(CSRC.glob("*.h"))]
    return [*deps, include / "xla" / "ffi" / "api" / "ffi.h"] if include is not None else deps


def _fresh() -> bool:
    if not LIBRARY.exists():
        return False
    built = LIBRARY.stat().st_mtime
    return all(p.stat().st_mtime <= built for p in _inputs(_ffi_include()))


def unavailable() -> str | None:
    """Why the floor kernel cannot be built here, or None when it is built or can be."""
    if _fresh():
        return None
    if _compiler() is None:
        return "the floor contender needs a C++17 compiler (c++ or g++, or $CXX) to build its kernel; none was found"
    if not (CSRC / "rows.h").exists():
        return f"the floor contender needs the library's headers ({CSRC / 'rows.h'}, in a checkout); none were found"
    if _ffi_include() is None:
        return "the floor contender needs jaxlib's XLA FFI headers (jaxlib/include/xla/ffi/api/ffi.h); none were found"
    return None


def build() -> pathlib.Path:
    """Compiles the kernel into ``floor/build/`` unless the built library is fresh; returns its path."""
    if _fresh():
        return LIBRARY
    why = unavailable()
    if why is not None:
        raise RuntimeError(why)
    cxx, include = _compiler(), _ffi_include()
    assert cxx is not None and include is not None
    BUILD.mkdir(parents=True, exist_ok=True)
    # Into a temporary file first, so that a concurrent run never loads a half-written library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=BUILD)
    os.close(fd)
    cmd = [*cxx.split(), "-isystem", str(include), "-I", str(CSRC), *FLAGS, str(SOURCE), "-o", tmp]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"building the floor kernel failed:\n{' '.join(cmd)}\n{proc.stderr[-4000:]}")
        os.replace(tmp, LIBRARY)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return LIBRARY


def _register() -> None:
    """Builds (if needed), loads and registers the kernel, once per process."""
    global _registered
    if not _registered:
        lib = ctypes.CDLL(str(build()))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.OptaxSparseAdamTouchRows), platform="cpu")
        jax.ffi.register_ffi_target(SUM_TARGET, jax.ffi.pycapsule(lib.OptaxSparseAdamSumTouchRows), platform="cpu")
        _registered = True


def touch_rows(
    tables: tuple[jax.Array, ...], keys: jax.Array, values: jax.Array, threads: int
) -> tuple[jax.Array, ...]:
    """Adds ``values[i]`` (its first entries, for a narrower table) to row ``keys[i]`` of every table (in place
    when donated); out-of-range keys are skipped.

    Args:
      tables: float32 tables with one row count, rows first: p, and the table-shaped parts of an optimizer's state
        (as wide as p, or one float a row for a row-wise accumulator).
      keys: ``(k,)`` int32 row indices.
      values: ``(k, ...)`` float32 rows, one per key, as wide as the widest table.
      threads: Threads the kernel may use, from XLA's intra-op pool.

    Returns:
      The updated tables.
    """
    return _call(TARGET, tables, (keys,), values, threads)


def group(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A batch's grouping, for :func:`sum_touch_rows`: its distinct non-negative ids (``-1``, skipped, past them,
    so that the keys are as long as the batch), and each entry's index among them (``-1`` for a negative id)."""
    ids = np.asarray(ids)
    keys, inverse = np.unique(ids, return_inverse=True)
    negative = int(np.count_nonzero(keys < 0))
    slots = np.where(ids >= 0, inverse - negative, -1).astype(np.int32)
    keys = keys[negative:]
    return np.pad(keys, (0, ids.size - keys.size), constant_values=-1).astype(np.int32), slots


def sum_touch_rows(
    tables: tuple[jax.Array, ...], keys: jax.Array, slots: jax.Array, values: jax.Array, threads: int
) -> tuple[jax.Array, ...]:
    """For each key ``keys[j]``, sums its entries (the rows ``values[i]`` with ``slots[i] == j``, in entry order)
    and adds the sum (its first entries, for a narrower table) to row ``keys[j]`` of every table (in place when
    donated): every entry read once, every touched row of every table once. Out-of-range keys are skipped.

    Args:
      tables: float32 tables with one row count, rows first, as for :func:`touch_rows`.
      keys: ``(k,)`` int32 distinct row indices (from :func:`group`).
      slots: ``(n,)`` int32: the index in ``keys`` of each entry's id, or ``-1``.
      values: ``(n, ...)`` float32 rows, one per entry of the batch, as wide as the widest table.
      threads: Threads the kernel may use, from XLA's intra-op pool.

    Returns:
      The updated tables.
    """
    return _call(SUM_TARGET, tables, (keys, slots), values, threads)


def _call(
    target: str, tables: tuple[jax.Array, ...], index: tuple[Any, ...], values: jax.Array, threads: int
) -> tuple[jax.Array, ...]:
    """``target`` on the index operands, the values as rows and the tables (aliased to its results)."""
    _register()
    rows = values.reshape(values.shape[0], math.prod(values.shape[1:]))
    operands = (*index, rows)
    out = jax.ffi.ffi_call(
        target,
        tuple(jax.ShapeDtypeStruct(t.shape, t.dtype) for t in tables),
        input_output_aliases={len(operands) + i: i for i in range(len(tables))},
        vmap_method="sequential",
    )(*operands, *tables, threads=np.int64(threads))
    return tuple(out)
