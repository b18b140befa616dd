"""Making stateless optax transformations correct on sparse leaves."""

from __future__ import annotations

from typing import Any

import jax
import optax

from optax_sparse_adam import _rows

__all__ = ["sparse_aware"]

_WHERE = "sparse_aware"


def sparse_aware(
    inner: optax.GradientTransformation, *, coalesce: bool = True
) -> optax.GradientTransformationExtraArgs:
    """Lets a stateless optax transformation see sparse leaves as their dense equivalent.

    optax's transformations map over every array of a tree, so on a BCOO or an
    :class:`IndexedRows` they also scale, clip or count the integer indices.
    This wrapper hands ``inner`` each sparse leaf's values instead, after
    summing duplicates and zeroing padding, so that any norm, clip or scale it
    computes equals the one of the dense equivalent gradient; it then puts the
    new values back under the same indices. Parameters, where given, are
    handed over as the touched rows only (so ``add_decayed_weights`` decays the
    touched rows). Dense leaves pass through unchanged.

    Args:
      inner: A stateless transformation (its state may only hold scalars, such
        as a step count), e.g. ``optax.clip_by_global_norm(1.0)``.
      coalesce: Sum duplicates first. Only a transformation that is linear in
        each entry (a scale) may skip it.

    Returns:
      An :class:`optax.GradientTransformationExtraArgs`.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import optax_sparse_adam as osa
      >>> clip = osa.sparse_aware(optax.clip_by_global_norm(1.0))
      >>> g = osa.IndexedRows(jnp.array([0, 0]), jnp.full((2, 1), 3.0, jnp.float32), 2)
      >>> out, _ = clip.update(g, clip.init(jnp.zeros((2, 1), jnp.float32)))
      >>> out.todense()
      Array([[1.],
             [0.]], dtype=float32)
    """
    inner = optax.with_extra_args_support(inner)

    def init_fn(params: optax.Params) -> Any:
        state = inner.init(params)
        for path, leaf in jax.tree_util.tree_leaves_with_path(state):
            if getattr(leaf, "ndim", 0) > 0:
                raise ValueError(
                    f"{_WHERE}: the wrapped transformation keeps per-parameter state "
                    f"(state{_rows.path_str(path)} has shape {leaf.shape}); only stateless "
                    "transformations can be applied to the values of sparse leaves"
                )
        return state

    def update_fn(
        updates: optax.Updates, state: Any, params: optax.Params | None = None, **extra_args: Any
    ) -> tuple[optax.Updates, Any]:
        leaves, treedef = jax.tree_util.tree_flatten_with_path(updates, is_leaf=_rows.is_leaf)
        if params is None:
            param_leaves: list[Any] = [None] * len(leaves)
        else:
            try:
                param_leaves = treedef.flatten_up_to(params)
            except (ValueError, TypeError) as e:
                raise ValueError(f"{_WHERE}: the update tree does not match the parameters: {e}") from None
        sparse: dict[int, _rows.SparseLeaf] = {}
        values, rows = [], []
        for i, ((path, u), p) in enumerate(zip(leaves, param_leaves, strict=True)):
            if not _rows.is_sparse(u):
                values.append(u)
                rows.append(p)
                continue
            sp = _rows.to_sparse_leaf(u, u.shape if p is None else p.shape, path, _WHERE)
            sp = _rows.coalesce(sp) if coalesce else _rows.zero_padding(sp)
            sparse[i] = sp
            values.append(sp.values)
            rows.append(None if p is None else p.at[sp.index()].get(mode="fill", fill_value=0))
        new_values, state = inner.update(
            treedef.unflatten(values), state, None if params is None else treedef.unflatten(rows), **extra_args
        )
        out = treedef.flatten_up_to(new_values)
        out = [sparse[i].replace_values(v).to_leaf() if i in sparse else v for i, v in enumerate(out)]
        return treedef.unflatten(out), state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
