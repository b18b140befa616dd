"""The public sparse leaf type, :class:`IndexedRows`, and :func:`is_sparse`."""

from __future__ import annotations

import dataclasses
import functools
import sys
from typing import TYPE_CHECKING, Any, TypeGuard

import jax
import jax.numpy as jnp
import numpy as np

from optax_sparse_adam._row_ops import replicate, scatter_rows

if TYPE_CHECKING:
    from jax.experimental import sparse as jsparse

__all__ = ["IndexedRows", "is_sparse"]


@dataclasses.dataclass(frozen=True)
class IndexedRows:
    """Row-sparse gradient or update for a parameter of shape ``(num_rows, *row_shape)``.

    Entry ``i`` adds ``values[i]`` to row ``indices[i]``. Duplicate indices are
    summed. An index ``< 0`` or ``>= num_rows``, compared in the index's own
    dtype, is padding and is ignored everywhere (the optimizer,
    :func:`apply_updates`, ``+`` and :meth:`todense` agree), so a batch can
    keep a fixed capacity under :func:`jax.jit`.

    Attributes:
      indices: Integer array of shape ``(k,)``, of any integer dtype.
      values: Array of shape ``(k, *row_shape)``.
      num_rows: Number of rows of the parameter (a static Python int below
        ``2**31``).
      unique_indices: Static promise that the in-range indices are distinct and
        that padding entries hold zeros; it lets the optimizer skip summing
        duplicates. Set it only where the promise holds, as in the gradients
        :meth:`RowLookup.grad` builds; an update keeps its gradient's flag.
        Where it does not hold, the duplicated rows get unspecified values
        on the XLA path (as with jax's own ``unique_indices``); the native
        CPU kernels check the promise (one hash pass over the indices) and
        sum a broken one's duplicates as without it.
      owner_axis: Static mark of a row-sharded table's gradient: the mesh axis
        whose devices each hold the entries of the rows they own (set by
        :meth:`RowSharding.value_and_row_grad` and
        :meth:`RowSharding.route`, kept on the updates built from it).
        :class:`RowSharding`'s steps take a table's sparse leaf only with
        their own axis here, as a gradient laid out otherwise would lose the
        entries each device does not own. ``None`` (default): entries in any
        layout, as anywhere else.

    Adding an ``IndexedRows`` to a dense array (``table + rows``) adds its
    values to their rows with one scatter, so :func:`optax.apply_updates`, and
    with it ``nnx.Optimizer`` and ``TrainState.apply_gradients``, take sparse
    updates as they are.
    """

    __array_ufunc__ = None  # NumPy defers ``ndarray + IndexedRows`` to __radd__

    indices: jax.Array
    values: jax.Array
    num_rows: int
    unique_indices: bool = False
    owner_axis: str | None = None

    def __post_init__(self) -> None:
        num_rows = self.num_rows
        if isinstance(num_rows, bool) or not isinstance(num_rows, int | np.integer):
            raise TypeError(
                f"IndexedRows: num_rows must be a static Python int (the table's row count), got "
                f"{type(num_rows).__name__} {num_rows!r}; use `table.shape[0]`, not a traced value"
            )
        if not 0 <= int(num_rows) < 2**31:
            raise ValueError(
                f"IndexedRows: num_rows={int(num_rows)} is out of range: row keys are int32, so tables may have "
                "up to 2**31 - 1 rows; split a larger table into several parameters"
            )
        object.__setattr__(self, "num_rows", int(num_rows))
        if not isinstance(self.unique_indices, bool | np.bool_):
            raise TypeError(f"IndexedRows: unique_indices must be a bool, got {self.unique_indices!r}")
        object.__setattr__(self, "unique_indices", bool(self.unique_indices))
        if self.owner_axis is not None and not isinstance(self.owner_axis, str):
            raise TypeError(f"IndexedRows: owner_axis must be a mesh axis name or None, got {self.owner_axis!r}")

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the dense parameter this addresses."""
        return (self.num_rows, *self.values.shape[1:])

    @property
    def dtype(self) -> Any:
        return self.values.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __radd__(self, other: Any) -> jax.Array:
        """``other + self`` for a dense ``other`` of this shape: a scatter-add into its rows."""
        from optax_sparse_adam import _apply  # the apply step sits above this module

        return _apply.apply_updates(jnp.asarray(other), self)

    __add__ = __radd__

    def todense(self) -> jax.Array:
        """The dense equivalent: duplicates summed, padding dropped."""
        rows = normalise_keys(as_index_array(self.indices)[:, None], (self.num_rows,))[:, 0]
        return scatter_rows(jnp.zeros(self.shape, self.values.dtype), replicate(rows), replicate(self.values), "add")


jax.tree_util.register_dataclass(
    IndexedRows, data_fields=["indices", "values"], meta_fields=["num_rows", "unique_indices", "owner_axis"]
)


def owner_axis(leaf: Any) -> str | None:
    """The mesh axis a sparse leaf's entries are split over by owner (see ``IndexedRows.owner_axis``), or None."""
    return getattr(leaf, "owner_axis", None)


@functools.cache
def _routed_bcoo_type() -> type:
    """A BCOO that carries ``owner_axis`` as static metadata: a routed BCOO gradient (made on first use, so that
    the package loads without ``jax.experimental.sparse``)."""
    from jax.experimental import sparse as jsparse

    @jax.tree_util.register_pytree_node_class
    class RoutedBCOO(jsparse.BCOO):
        """A BCOO gradient or update of a row-sharded table, its entries split over ``owner_axis`` by owner."""

        owner_axis: str

        def __init__(self, args: Any, *, shape: Any, owner_axis: str, **flags: Any) -> None:
            super().__init__(args, shape=shape, **flags)
            self.owner_axis = owner_axis

        def tree_flatten(self) -> tuple[Any, dict[str, Any]]:
            children, aux = super().tree_flatten()
            return children, {**aux, "owner_axis": self.owner_axis}

        @classmethod
        def tree_unflatten(cls, aux_data: dict[str, Any], children: Any) -> Any:
            aux = dict(aux_data)
            axis = aux.pop("owner_axis")
            obj = super().tree_unflatten(aux, children)
            obj.owner_axis = axis
            return obj

        def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
            # By the module's function: pickle and copy look a class up by its name, which this one, made in a
            # function, does not have.
            flags = (self.indices_sorted, self.unique_indices)
            return _routed_bcoo, (self.data, self.indices, self.shape, self.owner_axis, *flags)

    return RoutedBCOO


def _routed_bcoo(
    data: Any, indices: Any, shape: Any, owner_axis: str, indices_sorted: bool, unique_indices: bool
) -> jsparse.BCOO:
    """A routed BCOO rebuilt from its parts (its ``__reduce__``)."""
    flags = {"indices_sorted": indices_sorted, "unique_indices": unique_indices}
    return _routed_bcoo_type()((data, indices), shape=shape, owner_axis=owner_axis, **flags)


def bcoo_like(
    args: tuple[Any, Any],
    *,
    shape: Any,
    owner_axis: str | None,
    indices_sorted: bool = False,
    unique_indices: bool = False,
) -> jsparse.BCOO:
    """A BCOO, marked with ``owner_axis`` where it is not None."""
    flags = {"indices_sorted": indices_sorted, "unique_indices": unique_indices}
    if owner_axis is None:
        from jax.experimental import sparse as jsparse

        return jsparse.BCOO(args, shape=shape, **flags)
    return _routed_bcoo_type()(args, shape=shape, owner_axis=owner_axis, **flags)


def as_index_array(x: Any) -> jax.Array:
    """Indices as a jax array, a concrete index JAX cannot hold made padding rather than wrapped.

    With ``jax_enable_x64`` off (the default), ``jnp.asarray`` casts NumPy
    ``int64``/``uint64`` indices to ``int32``, wrapping ``2**32 + 5`` onto
    row 5; here such an index outside ``[0, 2**31)`` becomes ``-1`` (padding)
    first, as it is padding in its own dtype. Jax arrays (and tracers) are
    returned as they are: their dtype already is one JAX holds.
    """
    if isinstance(x, jax.Array):
        return x
    arr = np.asarray(x)
    if arr.dtype.kind in "iu" and arr.dtype.itemsize > 4 and not jax.config.read("jax_enable_x64"):
        # Not np.where(..., arr, -1): under NumPy 2's promotion rules -1 does not fit a uint64 array (an
        # OverflowError from NumPy 2.5 on).
        fits = (arr >= 0) & (arr <= np.iinfo(np.int32).max)
        arr = np.where(fits, arr, 0).astype(np.int32)
        arr[~fits] = -1
    return jnp.asarray(arr)


def normalise_keys(index: jax.Array, dims: tuple[int, ...]) -> jax.Array:
    """int32 ``(k, s)`` keys from ``(k, s)`` indices of any integer dtype, for axes of sizes ``dims``.

    An entry with any component out of range, compared in the index's own
    dtype before any cast, becomes the padding key ``dims``: a wide index
    never wraps into a real row.
    """
    if jnp.iinfo(index.dtype).bits < 32:  # so that comparing with dims cannot overflow
        index = index.astype(jnp.int32)
    upper = jnp.asarray(np.array(dims, dtype=index.dtype))[None, :]
    valid = jnp.all((index >= 0) & (index < upper), axis=1)
    return jnp.where(valid[:, None], index, upper).astype(jnp.int32)


def is_sparse(x: Any) -> bool:
    """Whether ``x`` is a sparse leaf this library understands (``IndexedRows`` or BCOO)."""
    return isinstance(x, IndexedRows) or is_bcoo(x)


def is_bcoo(x: Any) -> TypeGuard[jsparse.BCOO]:
    """Whether ``x`` is a ``jax.experimental.sparse.BCOO``.

    Without importing that module (and scipy with it) when nobody has: then no BCOO exists.
    """
    module = sys.modules.get("jax.experimental.sparse")
    return module is not None and isinstance(x, module.BCOO)
