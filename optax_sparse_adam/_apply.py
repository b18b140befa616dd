"""Applying updates that may hold sparse leaves: :func:`apply_updates`."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from optax_sparse_adam import _ffi, _kernel_path
from optax_sparse_adam._coalesce import coalesce_unless_known
from optax_sparse_adam._indexed_rows import is_sparse
from optax_sparse_adam._row_ops import HALF_FLOATS, scatter_rows, take_rows
from optax_sparse_adam._sparse_leaf import SparseLeaf, for_each_chunk, to_sparse_leaf
from optax_sparse_adam._tree import map_leaves, param_error

__all__ = ["apply_updates"]

_WHERE = "apply_updates"


def _apply_leaf(path: Any, u: Any, p: Any) -> tuple[Any]:
    """``p + u`` for one leaf: a scatter-add for a sparse ``u``, optax's rule for a dense one."""
    if u is None or p is None:
        return (p,)
    p = jnp.asarray(p)
    if is_sparse(u):
        return (add_rows(p, to_sparse_leaf(u, p.shape, path, _WHERE)),)
    u = jnp.asarray(u)
    if u.shape != p.shape:
        raise param_error(
            ValueError, _WHERE, path, f"update shape {u.shape} does not match the parameter shape {p.shape}"
        )
    return (jnp.asarray(p + u).astype(p.dtype),)


def add_rows(p: jax.Array, leaf: SparseLeaf) -> jax.Array:
    """``p`` plus a sparse leaf: the native scatter-add on the CPU where it applies, else XLA's.

    A bfloat16 or float16 ``p`` with one sparse axis takes its touched rows' ``p + u`` as a dense update's
    (optax's ``(p + u).astype(p.dtype)``: formed in the wider dtype, rounded once), the duplicates summed first,
    and sets them: a scatter-add into the 16-bit table would round each update to it first, and XLA:CPU would
    convert the whole table to float32 and back to add them. On the CPU, float32 updates take one native pass
    over the touched rows (``add_rows_half``: that rule's bits), where the XLA path gathers, adds and sets them
    (within an ulp of it: inside its program XLA:CPU may add a row's summed entries onto ``p`` one by one).
    """
    if jnp.dtype(p.dtype) in HALF_FLOATS and leaf.n_sparse == 1:

        def add(start: Any, chunk: SparseLeaf, p: jax.Array) -> jax.Array:
            idx = chunk.row_index()
            new = jnp.asarray(take_rows(p, idx) + chunk.values).astype(p.dtype)
            return scatter_rows(p, idx, new, "set", unique=True)

        summed = coalesce_unless_known(leaf)

        def xla() -> jax.Array:  # summed, the rows fill the first slots: the chunks stop after the last
            return for_each_chunk(summed, add, p)

        # Distinct keys (coalesce_unless_known sums a user's unchecked promise too): the kernel splits them over its
        # threads by position.
        if _kernel_path.supports(p.shape, 1, summed.values, params=p):
            return _kernel_path.select(lambda: _ffi.add_rows_half(p, summed.keys[:, 0], summed.values), xla)
        return xla()
    if not _kernel_path.supports(p.shape, leaf.n_sparse, p, leaf.values):
        return leaf.add_to(p)
    unique = _kernel_path.unique_flag(leaf)
    return _kernel_path.select(
        lambda: _ffi.scatter_add(p, leaf.keys[:, 0], leaf.values, unique), lambda: leaf.add_to(p)
    )


def apply_updates(params: optax.Params, updates: optax.Updates) -> optax.Params:
    """Applies updates to parameters; a drop-in for :func:`optax.apply_updates`.

    Dense update leaves are added as optax does (``p + u`` cast to ``p``'s
    dtype). A sparse leaf (:class:`IndexedRows` or BCOO) adds its values to the
    rows it addresses only, with one scatter, so the cost is O(touched rows);
    duplicates add up and padding is dropped. Under :func:`jax.jit` with the
    parameters donated (``donate_argnums``) the scatter is done in place. A
    ``None`` update leaves its parameter as it is.

    Args:
      params: A tree of parameters.
      updates: A tree of updates with the structure of ``params``; leaves may be
        arrays, sparse leaves or ``None``.

    Returns:
      The updated parameters, with the structure, shapes and dtypes of ``params``.

    Examples:
      >>> import jax.numpy as jnp
      >>> import optax_sparse_adam as osa
      >>> p = jnp.zeros((3, 2), jnp.float32)
      >>> u = osa.IndexedRows(jnp.array([2, -1]), jnp.ones((2, 2), jnp.float32), 3)
      >>> osa.apply_updates(p, u)
      Array([[0., 0.],
             [0., 0.],
             [1., 1.]], dtype=float32)
    """
    (new_params,) = map_leaves(
        _apply_leaf, updates, [(params, "parameters")], where=_WHERE, tree_name="updates", n_out=1
    )
    return new_params
