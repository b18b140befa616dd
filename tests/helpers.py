"""What the tests share: one tree comparison, one check that a step compiles once, and the kernel tests' skip."""

from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
import pytest
from jax.extend.core import ClosedJaxpr, Jaxpr

from optax_sparse_adam import _kernel_path

# Comparisons with optax of steps that sum duplicate ids or contract multiply-adds: on the CPU both programs do
# these in one order; XLA:GPU sums the colliding ids of a scatter-add (optax's dense gradient) in another order
# than the library's sort and segmented sum, and fuses multiply-adds as it chooses per program.
ON_CPU = jax.default_backend() == "cpu"


def spread(names: list[str], combos: list[tuple[Any, ...]], per: int = 1) -> list[tuple[Any, ...]]:
    """Each of ``names`` with ``per`` consecutive ``combos``, the start rotating from name to name: every combo
    meets some names, and every name ``per`` combos (order ``combos`` so that neighbours differ in every option),
    in a fraction of the full product's cases."""
    return [(name, *combos[(i * per + j) % len(combos)]) for i, name in enumerate(names) for j in range(per)]


def assert_trees_equal(actual: Any, desired: Any, *, rtol: float = 0.0, atol: float = 0.0) -> None:
    """The same tree structure, and leaf by leaf the same dtype, shape and values.

    Values are compared bitwise (NaNs equal; a zero's sign too) unless ``rtol`` or ``atol`` is given. Sparse leaves
    (``IndexedRows``, BCOO) are pytrees: their indices and values are compared as they are.
    """
    structure, want_structure = jax.tree.structure(actual), jax.tree.structure(desired)
    assert structure == want_structure, f"tree structures differ:\n{structure}\n{want_structure}"
    for (path, a), d in zip(jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(desired), strict=True):
        where = jax.tree_util.keystr(path) or "the root"
        a, d = np.asarray(a), np.asarray(d)
        assert a.dtype == d.dtype, f"{where}: dtype {a.dtype}, expected {d.dtype}"
        assert a.shape == d.shape, f"{where}: shape {a.shape}, expected {d.shape}"
        if rtol or atol:
            if a.dtype.kind == "V" or a.dtype.itemsize < 2 or str(a.dtype) == "bfloat16":  # ml_dtypes floats
                a, d = a.astype(np.float32), d.astype(np.float32)
            np.testing.assert_allclose(a, d, rtol=rtol, atol=atol, err_msg=where)
        else:
            np.testing.assert_array_equal(a, d, err_msg=where, strict=True)
            _assert_zeros_signed_alike(a, d, where)


def _assert_zeros_signed_alike(a: np.ndarray, d: np.ndarray, where: str) -> None:
    """Where equal arrays hold zeros, the same signs (``assert_array_equal`` takes ``-0.0`` for ``0.0``)."""
    if a.dtype.kind == "c":
        parts = [(a.real, d.real), (a.imag, d.imag)]
    elif a.dtype.kind == "f":
        parts = [(a, d)]
    elif a.dtype.kind == "V":  # ml_dtypes' floats (bfloat16, float8): exact in float64
        parts = [(a.astype(np.float64), d.astype(np.float64))]
    else:
        return
    for x, y in parts:
        zero = x == 0
        if zero.any():
            np.testing.assert_array_equal(np.signbit(x[zero]), np.signbit(y[zero]), err_msg=f"{where}: signs of zeros")


def non_finite_values(values: np.ndarray) -> np.ndarray:
    """``values`` (a batch's gradient rows, at least 8 entries) with NaN, both infinities, the largest floats (their
    squares overflow), subnormals and -0.0 written into its first eight entries."""
    values = np.array(values, np.float32)
    flat = values.reshape(len(values), -1)
    flat[0, 0], flat[1, -1], flat[2, 0] = np.nan, np.inf, -np.inf
    flat[3], flat[4, -1], flat[5] = 3e38, -3e38, -0.0
    flat[6], flat[7] = 1e-40, np.float32(1.4e-45)
    return values


def non_finite_zeroed(actual: Any, desired: Any) -> tuple[Any, Any]:
    """Trees ``actual`` and ``desired`` with their NaNs at the same places and the same infinities in each float
    leaf, asserted, and those elements zeroed in both (for a test's own bounds on the rest)."""
    out_a, out_d = [], []
    for (path, a), d in zip(jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(desired), strict=True):
        where = jax.tree_util.keystr(path) or "the root"
        a, d = np.asarray(a), np.asarray(d)
        if a.dtype.kind == "f":
            np.testing.assert_array_equal(np.isnan(a), np.isnan(d), err_msg=f"{where}: NaNs")
            np.testing.assert_array_equal(np.where(np.isinf(a), a, 0), np.where(np.isinf(d), d, 0), err_msg=where)
            finite = np.isfinite(a) & np.isfinite(d)
            a, d = np.where(finite, a, 0), np.where(finite, d, 0)
        out_a.append(a)
        out_d.append(d)
    return jax.tree.unflatten(jax.tree.structure(actual), out_a), jax.tree.unflatten(jax.tree.structure(desired), out_d)


def assert_same_non_finite(actual: Any, desired: Any, *, rtol: float, ulps_of_largest: int = 0) -> None:
    """Leaf by leaf: NaN at the same places, the same infinities (:func:`non_finite_zeroed`), and the finite
    elements within ``rtol`` of ``desired`` plus ``ulps_of_largest`` ulps of the leaf's largest finite magnitude (a
    sum whose terms cancel is within the rounding of its terms, not of itself). The fine bounds are other tests'
    business; this one is about where the numbers stop being numbers."""
    zeroed_a, zeroed_d = non_finite_zeroed(actual, desired)
    for (path, a), d in zip(jax.tree_util.tree_leaves_with_path(zeroed_a), jax.tree.leaves(zeroed_d), strict=True):
        where = jax.tree_util.keystr(path) or "the root"
        if a.dtype.kind != "f":
            np.testing.assert_array_equal(a, d, err_msg=where)
            continue
        largest = np.max(np.abs(d), initial=0).astype(d.dtype)
        atol = ulps_of_largest * float(np.spacing(largest))
        np.testing.assert_allclose(a, d, rtol=rtol, atol=atol, err_msg=where)


@contextlib.contextmanager
def checking_leaks() -> Iterator[None]:
    """``jax.checking_leaks()`` with the objects made before it frozen (``gc.freeze``): on each trace it leaves, the
    leak check runs ``gc.collect()``, whose cost grows with every object the process holds (a test of eight traced
    steps took 20 s late in a suite's worker, 2 s alone). A tracer made inside and kept by any object, frozen or
    not, is still found: the collection treats the frozen objects' references as from outside."""
    gc.freeze()
    try:
        with jax.checking_leaks():
            yield
    finally:
        gc.unfreeze()


def jit_once(fn: Callable[..., Any], *, jit: Callable[..., Any] = jax.jit, **jit_kwargs: Any) -> Callable[..., Any]:
    """``jit(fn, **jit_kwargs)`` that fails the test as soon as ``fn`` is traced a second time (a recompile).

    The count belongs to this one wrapped function, unlike ``chex.assert_max_traces``'s global counter keyed
    by source, so parametrized tests need no reset. ``jit`` may be another tracing wrapper (``nnx.jit``).
    """
    traces = 0

    @functools.wraps(fn)
    def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal traces
        traces += 1
        assert traces == 1, f"{fn.__name__} was traced {traces} times: a later call recompiled it"
        return fn(*args, **kwargs)

    return jit(counted, **jit_kwargs)


def all_eqns(jaxpr: Jaxpr | ClosedJaxpr) -> Iterator[Any]:
    """Every equation of ``jaxpr`` at every depth: those of its sub-jaxprs (jit, while, cond branches,
    custom_jvp/vjp, the branches of a kernel's selection) follow the equation that holds them."""
    for eqn in (jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr).eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else (param,):
                if isinstance(sub, ClosedJaxpr | Jaxpr):
                    yield from all_eqns(sub)


# Why a test of the native kernels skips: they were not built (no C++ compiler at install time), or
# OPTAX_SPARSE_ADAM_KERNELS=0 turned them off for the run (the suite then tests the XLA path alone).
KERNELS_OFF = "the native kernels were not built, or OPTAX_SPARSE_ADAM_KERNELS=0 turned them off"
needs_kernels = pytest.mark.skipif(not _kernel_path.enabled(), reason=KERNELS_OFF)
