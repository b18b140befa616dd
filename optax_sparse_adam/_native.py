"""Native CPU kernels: registration, and the one place that chooses them over the XLA path.

The compiled library (``_kernels*.so``, built by ``pip install`` when a C++17
compiler is there; sources in ``csrc/``) holds XLA FFI handlers for the sparse
step. Each is registered once, at import, under a versioned name. Under
:func:`jax.jit`, :func:`select` lowers the kernel on the CPU and the portable
XLA path on every other platform (``jax.lax.platform_dependent``); without the
library, or inside ``use_kernels(False)``, the XLA path runs everywhere.

The kernels cover float32 tables, moments and values with one sparse axis
(``IndexedRows``, BCOO with ``n_sparse == 1``) and fewer than 2**31 rows; the
XLA path handles everything else. Their ``m`` and ``nu`` are bitwise those of
the XLA path, and so is the step.

Environment: ``OPTAX_SPARSE_ADAM_KERNELS=0`` makes the XLA path the default;
``OPTAX_SPARSE_ADAM_THREADS=n`` (default: the CPUs this process may run on,
at most :data:`MAX_THREADS`) sets the threads a kernel call may use, taken
from XLA's intra-op pool. The numbers do not depend on it.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.machinery
import math
import os
import pathlib
from collections.abc import Callable, Iterator
from typing import Any, Literal

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import PartitionSpec as P

from optax_sparse_adam._explicit_sharding import explicit_sharding

__all__ = ["kernel_path", "use_kernels"]

MAX_THREADS = 16
_PREFIX = "optax_sparse_adam_v1_"  # bump when a handler's operands or attributes change
_SYMBOLS = {
    "sparse_adam_rows": "OptaxSparseAdamRows",
    "sparse_adam_apply": "OptaxSparseAdamApply",
    "scatter_add": "OptaxSparseAdamScatterAdd",
    "touch_rows": "OptaxSparseAdamTouchRows",
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
                jax.ffi.register_ffi_target(_PREFIX + name, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
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


def adam_scalars(
    b1: Any, b2: Any, eps: Any, eps_root: Any, bc1: jax.Array, bc2: jax.Array, neg_lr: Any = 0.0
) -> jax.Array:
    """The kernels' scalar operand, each value rounded to float32 as the XLA path rounds it.

    ``bc1`` and ``bc2`` are the bias corrections ``1 - b**count`` as the
    transformation computes them; ``neg_lr`` is the learning-rate scale of the
    fused step.
    """

    def f32(x: Any) -> jax.Array:
        return jnp.asarray(x).astype(jnp.float32)

    torch_scale = jnp.sqrt(bc2) / bc1
    return jnp.stack(
        [
            f32(b1),
            f32(1 - b1),
            f32(b2),
            f32(1 - b2),
            f32(eps),
            f32(eps_root),
            f32(bc1),
            f32(bc2),
            f32(torch_scale),
            f32(neg_lr),
        ]
    )


def _attrs(num_rows: int, **flags: bool) -> dict[str, np.int64]:
    attrs = {"num_rows": np.int64(num_rows), **{k: np.int64(v) for k, v in flags.items()}}
    attrs["threads"] = np.int64(_CONFIG.value[1])
    return attrs


def _rows2d(values: jax.Array) -> jax.Array:
    return values.reshape(values.shape[0], math.prod(values.shape[1:]))


_ROWS = "osa_rows"  # mesh axes of the row blocks of a sharded table, and of their replicas
_REPLICAS = "osa_replicas"


def _row_blocks(sharding: Any, shape: tuple[int, ...]) -> np.ndarray:
    """The devices of a table's sharding as a (row blocks, replicas) grid, block b holding the b-th rows.

    A table split otherwise (columns, uneven blocks) comes back as one block:
    the partitioner then gathers it, which is correct but not in place.
    """
    index = sharding.devices_indices_map(shape)
    devices = sorted(index, key=lambda d: d.id)
    starts: dict[int, list[Any]] = {}
    for d in devices:
        rows, *rest = index[d]
        if any(r.indices(n) != (0, n, 1) for r, n in zip(rest, shape[1:], strict=True)):
            return np.array(devices, dtype=object)[None, :]
        starts.setdefault(rows.start or 0, []).append(d)
    blocks = [starts[k] for k in sorted(starts)]
    if shape[0] % len(blocks) or len({len(b) for b in blocks}) != 1:
        return np.array(devices, dtype=object)[None, :]
    return np.array(blocks, dtype=object)


def _by_row_shards(fn: Callable[..., tuple[jax.Array, ...]], rule: str, summed: tuple[int, ...] = ()) -> Any:
    """``fn(row_begin, *tables, *rest)`` made to run on each row shard of its tables under SPMD partitioning.

    ``rule`` names the axes of the operands and results (Shardy's notation):
    ``n w`` for a 2-D table, ``k`` for keys, ``k w`` for rows, ``s`` for
    scalars. The tables come first among operands and results; the other operands
    are replicated, and so are the other results: those listed in ``summed``
    are summed over the shards (each shard writes zeros where it holds no
    row), the others come out alike on every shard. On one device, or inside
    ``shard_map``, ``fn`` runs as it is with ``row_begin = 0``.
    """

    @custom_partitioning
    def call(*args: jax.Array) -> tuple[jax.Array, ...]:
        return fn(jnp.zeros((), jnp.int32), *args)

    def partition(mesh: Any, arg_shapes: Any, result_shape: Any) -> Any:
        table = arg_shapes[0]
        grid = _row_blocks(table.sharding, table.shape)
        mesh = jax.sharding.Mesh(grid, (_ROWS, _REPLICAS))
        local_rows = table.shape[0] // grid.shape[0]
        rows = jax.sharding.NamedSharding(mesh, P(_ROWS))
        whole = jax.sharding.NamedSharding(mesh, P())

        def lower(*args: jax.Array) -> tuple[jax.Array, ...]:
            row_begin = jax.lax.axis_index(_ROWS).astype(jnp.int32) * local_rows
            out = list(fn(row_begin, *args))
            for i in summed:
                out[i] = jax.lax.psum(out[i], _ROWS)
            return tuple(out)

        ins, outs = (side.split(", ") for side in rule.split(" -> "))
        arg_shardings = tuple(rows if f == "n w" else whole for f in ins)
        out_shardings = tuple(rows if f == "n w" else whole for f in outs)
        return mesh, lower, out_shardings, arg_shardings

    call.def_partition(
        partition=partition,
        infer_sharding_from_operands=lambda mesh, args, result: partition(mesh, args, result)[2],
        sharding_rule=rule,
        need_replication_factors=tuple(f for f in ("w", "k", "s") if f in rule.split()),
    )
    # Under vmap (custom_partitioning has no batching rule), one call per batch element, in a loop.
    return jax.custom_batching.sequential_vmap(call)


def sparse_adam_rows(
    m: jax.Array,
    v: jax.Array,
    keys: jax.Array,
    values: jax.Array,
    scalars: jax.Array,
    *,
    torch_eps: bool,
    maximize: bool,
    unique: bool,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The sparse leaf rule on the CPU: ``(m, v, keys, step)``, moments updated in place.

    ``keys`` are ``(k,)`` int32 row indices (out of range: padding); the step
    rows come back packed as :func:`coalesce` packs them (each distinct key
    once, first, then padding keys ``num_rows`` with zero rows), or with
    ``unique`` in the entries' own slots.
    """
    attrs = _attrs(m.shape[0], torch_eps=torch_eps, maximize=maximize, unique=unique)
    shape = values.shape

    def fn(row_begin: jax.Array, m: jax.Array, v: jax.Array, keys: jax.Array, values: jax.Array, scalars: jax.Array):
        table = jax.ShapeDtypeStruct(m.shape, m.dtype)
        rows = (jax.ShapeDtypeStruct(keys.shape, jnp.int32), jax.ShapeDtypeStruct(values.shape, values.dtype))
        return jax.ffi.ffi_call(
            _PREFIX + "sparse_adam_rows",
            (table, table, *rows),
            input_output_aliases={0: 0, 1: 1},
            vmap_method="sequential",
        )(m, v, keys, values, scalars, row_begin, **attrs)

    rule = "n w, n w, k, k w, s -> n w, n w, k, k w"
    m2, v2, keys, step = _by_row_shards(fn, rule, summed=(3,))(_rows2d(m), _rows2d(v), keys, _rows2d(values), scalars)
    return m2.reshape(m.shape), v2.reshape(v.shape), keys, step.reshape(shape)


def sparse_adam_apply(
    p: jax.Array,
    m: jax.Array,
    v: jax.Array,
    keys: jax.Array,
    values: jax.Array,
    scalars: jax.Array,
    *,
    torch_eps: bool,
    maximize: bool,
    unique: bool,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The sparse leaf rule and ``p += neg_lr * step`` in one pass over each touched row: ``(p, m, v)``."""
    attrs = _attrs(p.shape[0], torch_eps=torch_eps, maximize=maximize, unique=unique)

    def fn(row_begin: jax.Array, p: jax.Array, m: jax.Array, v: jax.Array, *rest: jax.Array):
        table = jax.ShapeDtypeStruct(p.shape, p.dtype)
        return jax.ffi.ffi_call(
            _PREFIX + "sparse_adam_apply",
            (table, table, table),
            input_output_aliases={0: 0, 1: 1, 2: 2},
            vmap_method="sequential",
        )(p, m, v, *rest, row_begin, **attrs)

    rule = "n w, n w, n w, k, k w, s -> n w, n w, n w"
    out = _by_row_shards(fn, rule)(_rows2d(p), _rows2d(m), _rows2d(v), keys, _rows2d(values), scalars)
    new_p, new_m, new_v = (x.reshape(p.shape) for x in out)
    return new_p, new_m, new_v


def scatter_add(table: jax.Array, keys: jax.Array, values: jax.Array) -> jax.Array:
    """``table`` with ``values[i]`` added to row ``keys[i]`` in entry order, in place; padding dropped."""
    attrs = _attrs(table.shape[0])

    def fn(row_begin: jax.Array, table: jax.Array, keys: jax.Array, values: jax.Array):
        return (
            jax.ffi.ffi_call(
                _PREFIX + "scatter_add",
                jax.ShapeDtypeStruct(table.shape, table.dtype),
                input_output_aliases={0: 0},
                vmap_method="sequential",
            )(table, keys, values, row_begin, **attrs),
        )

    (out,) = _by_row_shards(fn, "n w, k, k w -> n w")(_rows2d(table), keys, _rows2d(values))
    return out.reshape(table.shape)


def touch_rows(
    p: jax.Array, m: jax.Array, v: jax.Array, keys: jax.Array, values: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The memory floor of a step (benchmarks only): adds ``values[i]`` to row ``keys[i]`` of p, m and v."""
    table = jax.ShapeDtypeStruct(p.shape, p.dtype)
    p, m, v = jax.ffi.ffi_call(
        _PREFIX + "touch_rows",
        (table, table, table),
        input_output_aliases={0: 0, 1: 1, 2: 2},
        vmap_method="sequential",
    )(p, m, v, keys, _rows2d(values), threads=np.int64(_CONFIG.value[1]))
    return p, m, v
