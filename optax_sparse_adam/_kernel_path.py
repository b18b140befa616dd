"""Which path a sparse step runs: the native CPU kernels or the portable XLA path.

The compiled library (``_kernels*.so``, built by ``pip install`` when a C++17
compiler is there; sources in ``csrc/``) holds XLA FFI handlers for the sparse
step; :mod:`._ffi` calls them. This module loads the library and registers
each handler once, at import, under a versioned name; holds the user's choice
(:func:`use_kernels`, part of jit's cache key); and decides, in one place,
where a kernel runs: :func:`supports` says whether the kernels handle a leaf,
and :func:`select` stages both out as one :data:`select_p`, whose lowering
keeps the kernel when lowering for the CPU alone and the XLA path for every
other platform and for :func:`jax.export`; differentiated, the XLA path runs.
Without the library, or inside ``use_kernels(False)``, the XLA path runs
everywhere.

The kernels cover float32 tables, moments and values with one sparse axis
(``IndexedRows``, BCOO with ``n_sparse == 1``) and fewer than 2**31 rows (the
fused row-wise Adagrad and row-wise Adam steps also bfloat16 and float16
tables, with float32 state); the XLA path handles everything else. They are not bitwise the XLA path: they
compute its expressions in its order and with the multiply-adds fused as
XLA:CPU usually fuses them, but XLA:CPU chooses its fusions (and so which
multiply-adds it contracts, and where ``maximize`` negates the gradient) by
shape. One step from the same state, measured over widths 1 to 513: ``nu``
bitwise; ``mu`` within one ulp of the larger of its old and new values (seen
with ``maximize`` on one-wide tables); the step, the update and the
parameters within two ulps of themselves plus one of the largest update
(XLA may compute the step from a moment rounded apart from the one it
stores, which where the moment nearly cancels is many ulps of the step).
``tests/test_kernels.py`` holds the fuzz test of these bounds. Row-wise
Adagrad's kernels sum each row's squares in a fixed order of their own (XLA
chooses its order by shape and CPU); :func:`scale_by_rowwise_adagrad` states
what that changes, and ``tests/test_rowwise_kernels.py`` tests it.

Environment: ``OPTAX_SPARSE_ADAM_KERNELS=0`` makes the XLA path the default;
``OPTAX_SPARSE_ADAM_THREADS=n`` (default: the CPUs this process may run on,
at most :data:`MAX_THREADS`) sets the threads a kernel call may use, taken
from XLA's intra-op pool. The numbers do not depend on it.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.machinery
import math
import os
import pathlib
from collections.abc import Callable, Iterator
from typing import Any, Literal

import jax
import jax.extend.core as jex
import jax.numpy as jnp
from jax.interpreters import batching, mlir

from optax_sparse_adam._row_ops import HALF_FLOATS, explicit_sharding

__all__ = ["kernel_path", "use_kernels"]

MAX_THREADS = 16
PREFIX = "optax_sparse_adam_v9_"  # bump when a handler's operands or attributes change
_SYMBOLS = {
    "sparse_adam_rows": "OptaxSparseAdamRows",
    "sparse_adam_apply": "OptaxSparseAdamApply",
    "sparse_adamw_apply": "OptaxSparseAdamWApply",
    "sparse_adamw_rows": "OptaxSparseAdamWRows",
    "sparse_amsgrad_apply": "OptaxSparseAmsgradApply",
    "sparse_amsgrad_rows": "OptaxSparseAmsgradRows",
    "catch_up_amsgrad_apply": "OptaxSparseAdamCatchUpAmsgradApply",
    "catch_up_amsgrad_rows": "OptaxSparseAdamCatchUpAmsgradRows",
    "catch_up_adam_apply": "OptaxSparseAdamCatchUpApply",
    "catch_up_adam_steps": "OptaxSparseAdamCatchUpSteps",
    "catch_up_adam_replay": "OptaxSparseAdamCatchUpReplay",
    "catch_up_adam_rows": "OptaxSparseAdamCatchUpRows",
    "scatter_add": "OptaxSparseAdamScatterAdd",
    "add_rows_half": "OptaxSparseAdamAddRowsHalf",
    "add_rows_half_stochastic": "OptaxSparseAdamAddRowsHalfStochastic",
    "set_rows": "OptaxSparseAdamSetRows",
    "coalesce": "OptaxSparseAdamCoalesce",
    "distinct": "OptaxSparseAdamDistinct",
    "coalesce_squares": "OptaxSparseAdamCoalesceSquares",
    "sum_squares": "OptaxSparseAdamSumSquares",
    "all_finite": "OptaxSparseAdamAllFinite",
    "gather": "OptaxSparseAdamGather",
    "rowwise_adagrad_rows": "OptaxSparseAdamRowwiseAdagradRows",
    "rowwise_adagrad_apply": "OptaxSparseAdamRowwiseAdagradApply",
    "rowwise_adam_rows": "OptaxSparseAdamRowwiseAdamRows",
    "rowwise_adam_apply": "OptaxSparseAdamRowwiseAdamApply",
    "adagrad_rows": "OptaxSparseAdamAdagradRows",
    "adagrad_apply": "OptaxSparseAdamAdagradApply",
    "momentum_rows": "OptaxSparseAdamMomentumRows",
    "momentum_apply": "OptaxSparseAdamMomentumApply",
    "ftrl_rows": "OptaxSparseAdamFtrlRows",
    "ftrl_apply": "OptaxSparseAdamFtrlApply",
    "catch_up_momentum_apply": "OptaxSparseAdamCatchUpMomentumApply",
    "catch_up_momentum_rows": "OptaxSparseAdamCatchUpMomentumRows",
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


def _kernels_from_env() -> bool:
    raw = os.environ.get("OPTAX_SPARSE_ADAM_KERNELS", "1")
    if raw not in ("0", "1"):
        raise ValueError(f"OPTAX_SPARSE_ADAM_KERNELS={raw!r}: it must be 1 (the native kernels) or 0 (the XLA path)")
    return raw == "1"


_LIB = _load()  # registration happens here, once per process
# (kernels enabled, threads, tracing a kernel's branch of a selection: see select). Part of the key of jit's caches
# and of JAX's other trace caches (cond's, loops'): a function traced with the kernels is traced again without them,
# and one traced inside a kernel's branch again outside it.
_CONFIG = jax.make_user_context(default_value=(_kernels_from_env(), _threads_from_env(), False))


def available() -> bool:
    """Whether the compiled kernels were built and loaded."""
    return _LIB is not None


def enabled() -> bool:
    """Whether code traced now uses the kernels on the CPU."""
    return _LIB is not None and bool(_CONFIG.value[0])


def kernel_path() -> Literal["native-cpu", "xla"]:
    """Which implementation a sparse step traced now runs on the CPU.

    ``"native-cpu"``: the compiled kernels (for float32 tables with one sparse
    axis, and 16-bit float ones in the fused row-wise steps; other leaves take
    the XLA path); ``"xla"``: the portable XLA path,
    because the kernels were not built (no C++ compiler at install time),
    ``OPTAX_SPARSE_ADAM_KERNELS=0`` is set, or inside ``use_kernels(False)``.
    On GPU and TPU the XLA path always runs, and so it does wherever the
    step is differentiated (:func:`jax.grad`, :func:`jax.jvp`, hypergradients
    through ``optax.inject_hyperparams``: the derivatives, and the values
    computed with them, are the XLA path's) and in what
    :func:`jax.export.export` exports: an exported artifact must run where
    this library and its custom calls are not (a server, another machine),
    so it holds the XLA path only, on every platform it is exported for. The
    same jitted step, called as usual, still runs the kernels.

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
    changes nothing. Nothing is needed for :func:`jax.export`: exported steps
    hold the XLA path alone, so that they carry no custom call of this library
    (see :func:`kernel_path`).

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
    with _CONFIG((bool(enabled), threads, _CONFIG.value[2])):
        yield


def threads() -> int:
    """The threads a kernel call traced now may use."""
    return int(_CONFIG.value[1])


def select(native: Callable[..., Any], xla: Callable[..., Any], *operands: Any) -> Any:
    """The one place that picks an implementation: ``native(*operands)`` on the CPU, ``xla(*operands)`` elsewhere.

    Both are traced to jaxprs, every array they close over (traced or not)
    made an explicit operand, and staged out as one :data:`select_p` whose
    lowering keeps the kernel only when lowering for the CPU alone and not
    for :func:`jax.export` (see :func:`kernel_path`). The choice is wrapped in
    a :func:`jax.custom_jvp` whose rule is ``xla``'s own JVP: undifferentiated,
    the kernel runs; differentiated (forward, and reverse by JAX's
    transposition of that JVP; hypergradients through closed-over
    hyperparameters included), the XLA path runs, primal and tangents, as it
    would inside ``use_kernels(False)``. (A kernel may pack a sparse result's
    rows in another order, and a tangent must sit in its primal's slot.)
    Without kernels (or inside ``use_kernels(False)``) only ``xla`` is traced,
    and called as it is. ``xla`` itself is traced without kernels: wherever its
    branch runs (another platform, an export, a derivative) every selection
    inside it runs its own XLA path too, so a selection nested in it traces
    that alone (tracing the kernel's branch there as well made a step's trace
    grow with each level of nesting). Likewise a selection nested in the
    kernel's branch traces its kernel alone: that branch is lowered only for
    the CPU alone, and never differentiated, so the XLA path of a selection
    inside it would never run.
    """
    if not enabled():
        return xla(*operands)
    if _CONFIG.value[2]:
        return native(*operands)
    n_jaxpr, n_consts, out_tree = _to_jaxpr(_as_native(native), operands)
    x_jaxpr, x_consts, x_tree = _to_jaxpr(_without_kernels(xla), operands)
    if out_tree != x_tree or [_aval_key(a) for a in n_jaxpr.out_avals] != [_aval_key(a) for a in x_jaxpr.out_avals]:
        raise TypeError(f"select: the kernel returns {n_jaxpr.out_avals}, the XLA path {x_jaxpr.out_avals}")
    flat = jax.tree.leaves(operands)
    # Both jaxprs take (native's consts, xla's consts, operands); each ignores the other's consts.
    args = (*n_consts, *x_consts, *flat)
    native_all = _retrace(n_jaxpr, args, skip=(len(n_consts), len(n_consts) + len(x_consts)))
    xla_all = _retrace(x_jaxpr, args, skip=(0, len(n_consts)))
    return jax.tree.unflatten(out_tree, _choose(native_all, xla_all, *args))


def _as_native(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` traced as a kernel's branch: selections inside it trace their kernel alone."""

    def traced(*args: Any) -> Any:
        with _CONFIG((*_CONFIG.value[:2], True)):
            return fn(*args)

    return traced


def _without_kernels(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` traced inside ``use_kernels(False)``."""

    def traced(*args: Any) -> Any:
        with use_kernels(False):
            return fn(*args)

    return traced


def _aval_key(aval: Any) -> tuple[Any, ...]:
    return (aval.shape, aval.dtype)


def _to_jaxpr(fn: Callable[..., Any], operands: tuple[Any, ...]) -> tuple[jex.ClosedJaxpr, list[Any], Any]:
    """``fn`` traced on ``operands``' leaves: its jaxpr, the values it closes over, and its output tree."""
    flat, in_tree = jax.tree.flatten(operands)
    out_tree: list[Any] = []

    def flat_fn(*leaves: Any) -> list[Any]:
        out, tree = jax.tree.flatten(fn(*jax.tree.unflatten(in_tree, leaves)))
        out_tree.append(tree)
        return out

    closed = jax.make_jaxpr(flat_fn)(*flat)
    return closed, list(closed.consts), out_tree[0]


def _retrace(closed: jex.ClosedJaxpr, args: tuple[Any, ...], skip: tuple[int, int]) -> jex.ClosedJaxpr:
    """``closed`` as a jaxpr of ``args`` (its consts, then values in ``args[skip[0]:skip[1]]`` it ignores, then
    its operands), closing over nothing traced."""
    n_consts = len(closed.consts)

    def fn(*all_args: Any) -> list[Any]:
        rest = all_args[: skip[0]] + all_args[skip[1] :]
        return jex.jaxpr_as_fun(jex.ClosedJaxpr(closed.jaxpr, rest[:n_consts]))(*rest[n_consts:])

    return jax.make_jaxpr(fn)(*args)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _choose(native: jex.ClosedJaxpr, xla: jex.ClosedJaxpr, *args: Any) -> list[Any]:
    return select_p.bind(*args, native=native, xla=xla)


@_choose.defjvp
def _choose_jvp(
    native: jex.ClosedJaxpr, xla: jex.ClosedJaxpr, primals: tuple[Any, ...], tangents: tuple[Any, ...]
) -> tuple[list[Any], list[Any]]:
    # The XLA path's primal too: a kernel may pack a sparse result's rows in another order than the XLA
    # path, and a tangent must sit in its primal's slot (float0 tangents for integer operands and results).
    return jax.jvp(jex.jaxpr_as_fun(xla), primals, tangents)


def _lowers_native(ctx: mlir.LoweringRuleContext) -> bool:
    """The kernel is lowered for the CPU alone, and never into a :func:`jax.export` artifact."""
    platforms = tuple(ctx.platforms or ctx.module_context.platforms)
    return platforms == ("cpu",) and not ctx.module_context.lowering_parameters.for_export


def _select_lowering(ctx: mlir.LoweringRuleContext, *args: Any, native: Any, xla: Any) -> Any:
    chosen = native if _lowers_native(ctx) else xla
    return mlir.lower_fun(jex.jaxpr_as_fun(chosen), multiple_results=True)(ctx, *args)


def _select_impl(*args: Any, native: Any, xla: Any) -> Any:
    """Eagerly: the kernel where the operands live on the CPU (as ``platform_dependent`` would choose)."""
    devices = {d for a in args if isinstance(a, jax.Array) for d in a.devices()}
    on_cpu = all(d.platform == "cpu" for d in devices) if devices else jax.default_backend() == "cpu"
    return jex.jaxpr_as_fun(native if on_cpu else xla)(*args)


def _select_batch(args: Any, dims: Any, *, native: Any, xla: Any) -> tuple[Any, list[int]]:
    """Under vmap, each branch vmapped (the kernel's own rule runs it once per batch element)."""
    in_axes = tuple(dims)  # None where an operand is not batched

    def batched(closed: jex.ClosedJaxpr) -> jex.ClosedJaxpr:
        return jax.make_jaxpr(jax.vmap(jex.jaxpr_as_fun(closed), in_axes=in_axes))(*args)

    outs = select_p.bind(*args, native=batched(native), xla=batched(xla))
    return outs, [0] * len(outs)


# native-or-xla(*args): a branch per implementation, kept at lowering (see _lowers_native).
select_p = jex.Primitive("optax_sparse_adam_select")
select_p.multiple_results = True
select_p.def_impl(_select_impl)
select_p.def_abstract_eval(lambda *args, native, xla: xla.out_avals)
mlir.register_lowering(select_p, _select_lowering)
batching.primitive_batchers[select_p] = _select_batch


def supports(shape: tuple[int, ...], n_sparse: int, *arrays: Any, params: Any = None) -> bool:
    """Whether the kernels handle a table of ``shape`` addressed by ``n_sparse`` axes, with these operands.

    The operands must be float32 (``params``, the parameters of a kernel that
    also takes 16-bit float ones, float32, bfloat16 or float16) and not sharded over an ``Explicit`` mesh
    axis: there the XLA path's sharding rules apply, which a custom call does
    not follow. Inside a ``shard_map`` manual over every mesh axis (the routed
    steps of ``RowSharding``) each device runs the kernel on its own block, the
    results typed as varying where the operands are (see ``_ffi._ffi_call``);
    inside one that leaves some axes automatic the XLA path runs.
    """
    if params is not None and jnp.dtype(params.dtype) not in (jnp.float32, *HALF_FLOATS):
        return False
    operands = arrays if params is None else (*arrays, params)
    return n_sparse == 1 and all(jnp.dtype(a.dtype) == jnp.float32 for a in arrays) and supports_rows(shape, *operands)


def supports_rows(shape: tuple[int, ...], *arrays: Any) -> bool:
    """Whether the row kernels that copy rows of any dtype (the gather) handle a table of ``shape`` with these
    operands: :func:`supports` without its dtype and sparse-axis conditions."""
    return (
        enabled()
        and len(shape) >= 1
        and math.prod(shape[1:]) > 0  # rows of no entries: nothing to read or write, the XLA path's no-op
        and shape[0] <= _MAX_ROWS
        and not any(explicit_sharding(a) is not None for a in arrays)
        and not _partly_manual()
    )


def unique_flag(leaf: Any) -> int:
    """The kernels' ``unique`` flag for a sparse leaf: 0 keys may repeat, 1 the user's promise (the kernel checks
    it), 2 keys the library made distinct."""
    return (1 if leaf.promised else 2) if leaf.distinct else 0


def _partly_manual() -> bool:
    """Whether tracing happens inside a ``shard_map`` that leaves some mesh axes automatic.

    There an operand may still be sharded over the automatic axes, which the
    kernels' row partitioning (``_ffi._by_row_shards``) cannot split, so the
    XLA path runs.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return False
    manual = set(getattr(mesh, "manual_axes", ()))
    return bool(manual) and len(manual) < len(mesh.axis_names)
