"""Applying updates that may hold sparse leaves."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from optax_sparse_adam import _native, _rows

__all__ = ["apply_updates"]


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
    leaves, treedef = _rows.flatten(updates)
    param_leaves = _rows.flatten_up_to(treedef, params, "apply_updates", "parameters")
    out = []
    for (path, u), p in zip(leaves, param_leaves, strict=True):
        if u is None or p is None:
            out.append(p)
        elif _rows.is_sparse(u):
            p = jnp.asarray(p)
            out.append(add_rows(p, _rows.to_sparse_leaf(u, p.shape, path, "apply_updates")))
        else:
            p, u = jnp.asarray(p), jnp.asarray(u)
            if u.shape != p.shape:
                raise ValueError(
                    f"apply_updates: parameter {_rows.path_str(path)}: update shape {u.shape} "
                    f"does not match the parameter shape {p.shape}"
                )
            out.append(jnp.asarray(p + u).astype(p.dtype))
    return treedef.unflatten(out)


def add_rows(p: jax.Array, leaf: _rows.SparseLeaf) -> jax.Array:
    """``p`` plus a sparse leaf: the native scatter-add on the CPU where it applies, else XLA's."""
    if not _native.supports(p.shape, leaf.n_sparse, p.dtype, leaf.values.dtype):
        return leaf.add_to(p)
    return _native.select(lambda: _native.scatter_add(p, leaf.keys[:, 0], leaf.values), lambda: leaf.add_to(p))
