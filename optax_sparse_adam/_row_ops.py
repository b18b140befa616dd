"""Every row gather and scatter of the library, including on meshes with ``Explicit`` axes.

The lazy-row engine, the leaf forms, applying updates, routing and the row
gradients read and write rows only through :func:`take_rows` and
:func:`scatter_rows` (coalescing's hash tables are its own).

``jax.make_mesh`` gives ``Explicit`` axes by default. On such a mesh a gather
from, or a scatter into, an array whose rows are sharded (``P("x", None)``)
needs its output sharding spelled out (``out_sharding=``), and ids or values
sharded over a batch axis must be made whole before they can index anything.
Here that is done once for the whole library; on a single device, an ``Auto``
mesh, or inside ``shard_map`` these are the plain ``.at[...]`` operations.
"""

from __future__ import annotations

import re
import warnings
from typing import Any, Literal

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

__all__ = ["explicit_sharding", "replicate", "scatter_rows", "take_rows"]

# The 16-bit float dtypes: tables the native kernel sets rows of, and that low-precision updates round to.
HALF_FLOATS = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

# jaxlib releases whose GPU scatter-add runs 450 to 2,000 times slower when its updates collide on one index (jax
# issue 38806, openxla issue 46225): from 0.10.2, the oldest the library supports, up to the fix in 0.11.1 (its
# pre-releases and nightlies included: they may predate the fix).
SLOW_GPU_SCATTER_ADD = ((0, 10, 2, 0), (0, 11, 1, 0))


def _release(version: str) -> tuple[int, ...]:
    """``major, minor, micro`` and 0 for a release, -1 for a pre-release or nightly of it (``0.11.1.dev2026``,
    ``0.11.1rc1``), which sorts before it."""
    numbers = re.match(r"(\d+)\.(\d+)\.(\d+)(.*)", version)
    if numbers is None:
        return (0, 0, 0, 0)
    rest = numbers.group(4)
    pre = re.match(r"[.-]?(dev|rc|a|b)", rest) is not None
    return (*(int(numbers.group(i)) for i in (1, 2, 3)), -1 if pre else 0)


def _platform() -> tuple[str, str]:
    """jax's default backend and jaxlib's version (a seam for the tests)."""
    return jax.default_backend(), jaxlib.__version__


def warn_if_gpu_scatter_add_is_slow(where: str) -> None:
    """Warn (once per call site, Python's default) where jax's default backend is a GPU and jaxlib is one of
    :data:`SLOW_GPU_SCATTER_ADD`'s releases: ``where`` runs a scatter-add whose updates collide (a bag's sum, the
    gradient of rows read at repeated ids), which the library cannot avoid, as autodiff writes it."""
    backend, version = _platform()
    first, fixed = SLOW_GPU_SCATTER_ADD
    if backend not in ("gpu", "cuda", "rocm") or not first <= _release(version) < fixed:
        return
    warnings.warn(
        f"{where} on a GPU with jaxlib {version}: this jaxlib runs a scatter-add whose updates collide "
        "450 to 2,000 times slower (jax issue 38806, fixed in jaxlib 0.11.1), and the sums over each bag's ids and "
        "the gradient of rows read at repeated ids are such scatter-adds. Install jaxlib 0.11.1 or newer.",
        RuntimeWarning,
        stacklevel=3,
    )


def explicit_sharding(x: Any) -> NamedSharding | None:
    """``x``'s sharding while tracing when it names an ``Explicit`` mesh axis, else ``None``."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    if not isinstance(sharding, NamedSharding) or sharding.mesh.empty:
        return None
    explicit = {
        name
        for name, kind in zip(sharding.mesh.axis_names, sharding.mesh.axis_types, strict=True)
        if kind == jax.sharding.AxisType.Explicit
    }
    for entry in sharding.spec:
        names = entry if isinstance(entry, tuple) else (entry,)
        if any(name in explicit for name in names if name is not None):
            return sharding
    return None


def replicate(x: jax.Array, like: jax.Array | None = None) -> jax.Array:
    """``x`` whole on every device when it (or ``like``) is sharded over an ``Explicit`` axis, else ``x``.

    For ``x`` itself sharded this is an all-gather; with ``like`` it puts ``x`` on ``like``'s mesh, so
    that it can receive rows gathered from ``like`` (``dynamic_update_slice`` wants one mesh).
    """
    sharding = explicit_sharding(x if like is None else like)
    if sharding is None:
        return x
    return jax.sharding.reshard(x, NamedSharding(sharding.mesh, PartitionSpec()))


def take_rows(x: jax.Array, index: Any, fill_value: Any = 0, *, native: bool = True) -> jax.Array:
    """``x.at[index].get(mode="fill")``, replicated when ``x`` is sharded over an ``Explicit`` axis.

    An out-of-range index (padding) reads ``fill_value``. On the CPU, rows read by one ``int32`` vector of ids
    with a zero fill come from the native gather kernel (the same bits; XLA:CPU's gather copies a row element by
    element), chosen where every kernel is (:func:`._kernel_path.select`). ``native=False`` keeps XLA's gather:
    XLA:CPU fuses a gather with the arithmetic that reads its rows and decides by that fusion which multiply-adds
    it contracts, so arithmetic on rows a kernel gathered may round an ulp apart from the XLA path's; where the
    numbers must equal the XLA path's bitwise (the ``sparse_aware`` stages beside a kernel), the gather stays XLA's.
    """
    x = jnp.asarray(x)
    sharding = explicit_sharding(x)
    out_sharding = None if sharding is None else NamedSharding(sharding.mesh, PartitionSpec())
    idx = index if isinstance(index, tuple) else (index,)
    if any(n == 0 for n in x.shape[: len(idx)]):  # an empty axis: every index is padding (XLA refuses the gather)
        shape = jnp.broadcast_shapes(*(jnp.shape(i) for i in idx)) + x.shape[len(idx) :]
        return jnp.full(shape, fill_value, x.dtype, device=out_sharding)

    def xla(x: jax.Array, index: Any) -> jax.Array:
        return x.at[index].get(mode="fill", fill_value=fill_value, out_sharding=out_sharding)

    if native and _native_gather(x, idx, fill_value):
        from optax_sparse_adam import _ffi, _kernel_path  # they import this module

        return _kernel_path.select(_ffi.gather, xla, x, idx[0])
    return xla(x, index)


def _bytes_rows(dtype: Any) -> bool:
    """Whether the kernel gathers ``dtype``: whole bytes an element (XLA packs narrower ones several to a byte),
    not a PRNG key (an extended dtype), not bool (a sharded table's shards are summed, and a sum of bools is an
    integer)."""
    return (
        not jax.dtypes.issubdtype(dtype, jax.dtypes.extended)
        and dtype != jnp.bool_
        and jax.dtypes.itemsize_bits(dtype) % 8 == 0
    )


def _native_rows(x: jax.Array, idx: tuple[Any, ...]) -> bool:
    """What the row kernels (gather, set) need of ``x`` and its index: one ``int32`` vector of ids, rows of at least
    one element, and a table the kernels take (:func:`._kernel_path.supports_rows`)."""
    from optax_sparse_adam import _kernel_path

    (i, *more) = idx
    return (
        not more
        and isinstance(i, jax.Array | np.ndarray)
        and i.ndim == 1
        and i.dtype == jnp.int32
        and i.shape[0] > 0
        and x.ndim >= 1
        and all(n > 0 for n in x.shape[1:])
        and _kernel_path.supports_rows(x.shape, x, i)
    )


def _native_gather(x: jax.Array, idx: tuple[Any, ...], fill_value: Any) -> bool:
    return (
        isinstance(fill_value, int | float)
        and fill_value == 0
        and not np.signbit(fill_value)  # the kernel fills +0.0
        and _bytes_rows(x.dtype)
        and _native_rows(x, idx)
    )


def scatter_rows(
    x: jax.Array, index: Any, values: jax.Array, op: Literal["set", "add"], *, unique: bool = False
) -> jax.Array:
    """``x.at[index].set(values)`` or ``.add(values)`` (out-of-range dropped), keeping ``x``'s sharding.

    ``unique`` promises that the in-range indices are distinct (padding may repeat: it is dropped).

    On the CPU, rows set into a bfloat16 or float16 table by one ``int32`` vector of ids are copied by the native
    kernel (the same bits): XLA:CPU scatters into a 16-bit float array by converting the whole array to float32
    and back, two passes over a table and a temporary twice its size at every step.
    """
    x = jnp.asarray(x)  # a NumPy array, as flax.serialization restores a checkpoint, has no .at
    idx = index if isinstance(index, tuple) else (index,)
    if any(n == 0 for n in x.shape[: len(idx)]):  # an empty axis: every index is padding, nothing is written
        return x
    if op == "set" and _native_set(x, idx):
        from optax_sparse_adam import _ffi, _kernel_path  # they import this module

        def xla(x: jax.Array, i: jax.Array, v: jax.Array) -> jax.Array:
            return x.at[i].set(v, mode="drop", unique_indices=unique)

        return _kernel_path.select(_ffi.set_rows, xla, x, idx[0], jnp.asarray(values).astype(x.dtype))
    ref = x.at[index]
    update = ref.set if op == "set" else ref.add
    sharding = explicit_sharding(x)
    return update(values, mode="drop", unique_indices=unique, out_sharding=sharding)


def _native_set(x: jax.Array, idx: tuple[Any, ...]) -> bool:
    """Whether the native kernel sets ``x``'s rows at ``idx``: a 16-bit float table (the kernel copies rows of any
    2-byte dtype; float32 tables XLA scatters into in place)."""
    return jnp.dtype(x.dtype) in HALF_FLOATS and _native_rows(x, idx)
