"""Running a per-row optimizer rule lazily: the shared engine of the optimizer variants.

A variant (AMSGrad, row-wise Adam, row-wise Adagrad, lazy weight decay) is a
*rule*: a function of the touched rows of the gradient, of the optimizer state
and, where it needs them, of the parameters, returning the step for those rows
and their new state. :func:`apply_rule` runs a rule over one leaf:

- a sparse leaf (:class:`IndexedRows`, BCOO) is summed into distinct rows, and
  the rule sees the gathered rows of each state array, chunk by chunk, whose
  new values are scattered back; untouched rows are bitwise unchanged;
- a dense leaf has every row touched: the rule sees whole arrays.

State arrays come in two layouts: *per entry* (the parameter's shape) and *per
row* (``shape[:1]``, one scalar per row). A rule that keeps per-row state
needs whole rows, so it takes sparse leaves that address rows only
(``IndexedRows``, or a BCOO with ``n_sparse == 1``).

This is the only module of the variants that reads the library's internal
sparse form (``_keys``, ``_coalesce``); the variants' modules use what it
exports.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from optax_sparse_adam._coalesce import coalesce
from optax_sparse_adam._indexed_rows import is_sparse
from optax_sparse_adam._keys import SparseLeaf, for_each_chunk, to_sparse_leaf
from optax_sparse_adam._transform import _check_hparam as check_hparam
from optax_sparse_adam._tree import broadcast_rows, check_state, map_leaves, mask_tree, param_error

__all__ = [
    "Rule",
    "apply_rule",
    "broadcast_rows",
    "check_dtype",
    "check_hparam",
    "check_state",
    "coalesced_rows",
    "map_leaves",
    "map_rule",
    "mask_tree",
    "param_error",
    "row_mean_square",
    "row_shape",
]

# rule(g_rows, state_rows, read_rows) -> (step_rows, new_state_rows); see apply_rule.
Rule = Callable[[jax.Array, tuple[jax.Array, ...], tuple[jax.Array, ...]], tuple[jax.Array, tuple[jax.Array, ...]]]


def row_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of a per-row state array for a parameter of ``shape``: ``shape[:1]`` (``()`` for a scalar)."""
    return tuple(shape[:1])


def row_mean_square(g: jax.Array) -> jax.Array:
    """``mean(|g|^2)`` over each row of ``g`` (all axes but the first), shaped ``g.shape[:1]``."""
    sq = jnp.real(g * jnp.conj(g)) if jnp.iscomplexobj(g) else g * g
    return jnp.mean(sq, axis=tuple(range(1, g.ndim))) if g.ndim > 1 else sq


def check_dtype(dtype: Any, name: str) -> Any:
    """A canonical floating dtype, or ``None``; a clear error otherwise."""
    if dtype is None:
        return None
    try:
        dtype = jax.dtypes.canonicalize_dtype(dtype)
    except TypeError as e:
        raise TypeError(f"Invalid {name}: {dtype!r}; it must be a floating dtype such as jnp.float32") from e
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"Invalid {name}: {dtype}; it must be a floating dtype such as jnp.float32")
    return dtype


def _check_dense(path: Any, g: Any, shape: tuple[int, ...], where: str) -> jax.Array:
    g = jnp.asarray(g)
    if g.shape != shape:
        raise param_error(
            ValueError, where, path, f"gradient shape {g.shape} does not match the parameter shape {shape}"
        )
    if not jnp.issubdtype(g.dtype, jnp.inexact):
        raise param_error(
            TypeError,
            where,
            path,
            f"the gradient has dtype {g.dtype}; this optimizer needs floating-point gradients: cast the gradient, "
            "or give this parameter a None gradient if it is not trained",
        )
    return g


def coalesced_rows(leaf: Any, shape: tuple[int, ...], path: Any, where: str) -> tuple[tuple[jax.Array, ...], jax.Array]:
    """A sparse leaf's distinct keys as an index tuple for ``x.at[...]`` and their summed values.

    Padding slots hold zero values and an out-of-range key, which gathers with
    ``mode="fill"`` fill and scatters with ``mode="drop"`` drop.
    """
    sp = coalesce(to_sparse_leaf(leaf, shape, path, where))
    return sp.row_index(), sp.values


def apply_rule(
    path: Any,
    g: Any,
    shape: tuple[int, ...],
    state: Sequence[jax.Array],
    reads: Sequence[jax.Array],
    rule: Rule,
    where: str,
    *,
    whole_rows: bool,
) -> tuple[Any, tuple[jax.Array, ...]]:
    """Runs ``rule`` on the rows ``g`` touches; returns the update leaf and the new state arrays.

    Args:
      path: The leaf's path, for errors.
      g: The gradient leaf: dense, sparse, or ``None`` (nothing moves).
      shape: The parameter's shape.
      state: State arrays, each of the parameter's shape or of ``row_shape(shape)``;
        the rule returns them in the same order, row for row.
      reads: Arrays the rule reads but does not write (the parameters), of the
        parameter's shape or per row.
      rule: ``rule(g_rows, state_rows, read_rows) -> (step_rows, new_state_rows)``;
        on a dense leaf the "rows" are the whole arrays.
      where: The public function, for errors.
      whole_rows: Whether the rule needs whole rows (it keeps per-row state).

    Returns:
      The update leaf (the gradient's type; padding slots zero) and the state.
    """
    state = tuple(state)
    if g is None:
        return None, state
    if not is_sparse(g):
        g = _check_dense(path, g, shape, where)
        step, new_state = rule(g, state, tuple(reads))
        return step.astype(g.dtype), tuple(n.astype(s.dtype) for n, s in zip(new_state, state, strict=True))
    leaf = coalesce(to_sparse_leaf(g, shape, path, where, emits=True))
    if whole_rows and leaf.n_sparse != 1:
        raise param_error(
            ValueError,
            where,
            path,
            f"this optimizer keeps one state scalar per row, so a sparse gradient must address whole rows, but this "
            f"BCOO has n_sparse={leaf.n_sparse}; use an IndexedRows or a BCOO with n_sparse=1",
        )

    def index_for(x: jax.Array, idx: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        return idx[: x.ndim] if x.ndim < len(shape) else idx

    def rows_update(start: Any, chunk: SparseLeaf, carry: Any) -> Any:
        arrays, out = carry
        idx = chunk.row_index()
        rows = tuple(a.at[index_for(a, idx)].get(mode="fill", fill_value=0) for a in arrays)
        read_rows = tuple(r.at[index_for(r, idx)].get(mode="fill", fill_value=0) for r in reads)
        step, new_rows = rule(chunk.values, rows, read_rows)
        step = jnp.where(broadcast_rows(chunk.valid(), step.ndim), step, jnp.zeros((), step.dtype))
        arrays = tuple(
            a.at[index_for(a, idx)].set(n.astype(a.dtype), mode="drop", unique_indices=True)
            for a, n in zip(arrays, new_rows, strict=True)
        )
        return arrays, jax.lax.dynamic_update_slice_in_dim(out, step.astype(out.dtype), start, 0)

    new_state, out = for_each_chunk(leaf, rows_update, (state, jnp.zeros_like(leaf.values)))
    return leaf._replace(values=out).to_leaf(), new_state


def map_rule(
    fn: Callable[..., tuple[Any, ...]], grads: Any, trees: Sequence[tuple[Any, str]], where: str, n_out: int
) -> tuple[Any, ...]:
    """:func:`map_leaves` over the gradient tree, with state subtrees checked to be arrays."""

    def leaf_fn(path: Any, g: Any, *others: Any) -> tuple[Any, ...]:
        for (_, name), x in zip(trees, others, strict=True):
            structure: Any = jax.tree.structure(x)
            if g is not None and structure.num_nodes > 1:
                raise param_error(
                    ValueError,
                    where,
                    path,
                    f"the gradient is a leaf but the {name} hold a subtree {jax.tree.structure(x)} there",
                )
        return fn(path, g, *others)

    return map_leaves(leaf_fn, grads, trees, where=where, tree_name="gradient", n_out=n_out)
