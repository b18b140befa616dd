"""The lazy-row engine: every optimizer of the library is a rule run by :func:`apply_rule`.

An optimizer (Adam, AMSGrad, row-wise Adam, row-wise Adagrad, lazy weight
decay) is a *rule*: a function of the touched rows of the gradient, of the
optimizer state and, where it needs them, of the parameters, returning the
step for those rows and their new state. :func:`apply_rule` runs a rule over
one leaf:

- a sparse leaf (:class:`IndexedRows`, BCOO) is summed into distinct rows, and
  the rule sees the gathered rows of each state array, chunk by chunk, whose
  new values are scattered back; untouched rows are bitwise unchanged;
- a dense leaf has every row touched: the rule sees whole arrays (a rule
  that treats dense leaves lazily, as Adam's ``lazy_dense``, selects the
  rows itself, with :func:`touched_rows`).

All row gathers and scatters go through :mod:`._row_ops`, so every rule runs
on ``Explicit`` meshes too. A :class:`Kernel` may take a rule's place on a
sparse leaf: where it supports the leaf, :func:`._kernel_path.select` lowers
it on the CPU and the rule everywhere else.

State arrays come in two layouts: *per entry* (the parameter's shape) and *per
row* (``shape[:1]``, one scalar per row). A rule that keeps per-row state
needs whole rows, so it takes sparse leaves that address rows only
(``IndexedRows``, or a BCOO with ``n_sparse == 1``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from optax_sparse_adam import _ffi, _kernel_path
from optax_sparse_adam._checks import check_dense_gradient
from optax_sparse_adam._coalesce import coalesce
from optax_sparse_adam._indexed_rows import is_sparse
from optax_sparse_adam._row_ops import explicit_sharding, replicate, scatter_rows, take_rows
from optax_sparse_adam._sparse_leaf import SparseLeaf, for_each_chunk, to_sparse_leaf
from optax_sparse_adam._tree import broadcast_rows, is_leaf, map_leaves, param_error

__all__ = ["Kernel", "Rule", "apply_rule", "map_rule", "row_mean_square", "row_shape", "stamp", "touched_rows"]

Arrays = tuple[jax.Array, ...]
# rule(g_rows, state_rows, read_rows) -> (step_rows, new_state_rows); see apply_rule.
Rule = Callable[[jax.Array, Arrays, Arrays], tuple[jax.Array, Arrays]]


class Kernel(NamedTuple):
    """A native kernel that can take a rule's place on a sparse leaf.

    Attributes:
      supports: ``supports(leaf, state, reads)``: whether the kernel handles
        this leaf with these operands (see :func:`._kernel_path.supports`).
      run: ``run(leaf, state, reads) -> (keys, values, new_state)``: the leaf
        as the engine's XLA path leaves it (distinct keys packed first, or a
        distinct leaf's keys in place) and the new state arrays.
    """

    supports: Callable[[SparseLeaf, Arrays, Arrays], bool]
    run: Callable[[SparseLeaf, Arrays, Arrays], tuple[jax.Array, jax.Array, Arrays]]


def elementwise_kernel(target: str, scalars: jax.Array, **flags: int) -> Kernel:
    """The element-wise rows kernel ``target`` (``csrc/elementwise.cc``) in a rule's place: its state arrays of the
    parameter's shape, updated, and the rule's reads (FTRL's parameters) passed on; ``flags`` are the handler's own
    attributes."""

    def supports(leaf: SparseLeaf, state: Arrays, reads: Arrays) -> bool:
        return _kernel_path.supports(leaf.shape, leaf.n_sparse, *state, *reads, leaf.values)

    def run(leaf: SparseLeaf, state: Arrays, reads: Arrays) -> tuple[jax.Array, jax.Array, Arrays]:
        unique = _kernel_path.unique_flag(leaf)
        *new, keys, step = _ffi.elementwise_rows(
            target, state, leaf.keys[:, 0], leaf.values, scalars, reads, unique=unique, **flags
        )
        return keys[:, None], step, tuple(new)

    return Kernel(supports, run)


def row_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of a per-row state array for a parameter of ``shape``: ``shape[:1]`` (``()`` for a scalar)."""
    return tuple(shape[:1])


def row_full(p: Any, fill_value: Any, dtype: Any) -> jax.Array:
    """``fill_value`` in ``row_shape(p.shape)`` (per-row state), placed as ``p``'s rows are: split by row like a
    row-sharded table (eagerly, under ``jit`` on an ``Explicit`` mesh, varying inside ``shard_map``), not
    replicated."""
    shape = jnp.shape(p)
    if not shape or 0 in shape[1:] or not isinstance(p, jax.Array):
        return jnp.full(row_shape(shape), fill_value, dtype)
    return jnp.full_like(p[(slice(None),) + (0,) * (len(shape) - 1)], fill_value, dtype)  # placement, not values


def row_mean_square(g: jax.Array) -> jax.Array:
    """``mean(|g|^2)`` over each row of ``g`` (all axes but the first), shaped ``g.shape[:1]``."""
    sq = jnp.real(g * jnp.conj(g)) if jnp.iscomplexobj(g) else g * g
    return jnp.mean(sq, axis=tuple(range(1, g.ndim))) if g.ndim > 1 else sq


def touched_rows(g: jax.Array) -> jax.Array:
    """Whether each row of a dense ``g`` holds a nonzero (or NaN), shaped to broadcast against ``g``."""
    if g.ndim <= 1:
        return g != 0
    # A float max, not an any() of a table-sized mask, so XLA fuses it into the moment updates.
    return jnp.max(jnp.abs(g), axis=tuple(range(1, g.ndim)), keepdims=True) != 0


def at_count(value: Any, count: Any) -> Any:
    """A hyperparameter (a learning rate) at step ``count``: a schedule called on it, as
    ``optax.scale_by_learning_rate`` calls it, a constant as it is."""
    return value(count) if callable(value) else value


def step_factor(scale: Any) -> Any:
    """What a rows kernel multiplies its step rows by for a rule scaled by ``scale`` (:func:`scaled_rule`): the
    scale, or 1 where there is none."""
    return 1.0 if scale is None else scale


def scaled_rule(rule: Rule, scale: Any) -> Rule:
    """``rule`` with its updates multiplied by ``scale`` as ``optax.scale`` multiplies them (``None``: as it is)."""
    if scale is None:
        return rule

    def scaled(g: jax.Array, state: Arrays, reads: Arrays) -> tuple[jax.Array, Arrays]:
        out, new = rule(g, state, reads)
        return jnp.asarray(scale, out.dtype) * out, new

    return scaled


def decayed_rule(rule: Rule, weight_decay: Any) -> Rule:
    """``rule`` followed by ``optax.add_decayed_weights(weight_decay)`` on its rows: each update plus
    ``weight_decay`` times the parameters' rows (the rule's one read, which ``rule`` does not see)."""

    def decayed(g: jax.Array, state: Arrays, reads: Arrays) -> tuple[jax.Array, Arrays]:
        out, new = rule(g, state, ())
        return out + weight_decay * reads[0], new

    return decayed


def stamp(last: jax.Array, count: jax.Array) -> jax.Array:
    """``count`` for each row of ``last`` (a per-row record of the step a row was last updated at, never above
    ``count``), written as ``max(last, count)``: a rule's new record then depends on the rows it read, so that XLA
    orders the gather of the record's rows before the scatter of the new ones and updates the record in place (with
    ``full_like(last, count)`` it copied the whole record twice a chunk)."""
    return jnp.maximum(last, jnp.asarray(count, last.dtype))


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
    kernel: Kernel | None = None,
    compute_dtype: Any = None,
) -> tuple[Any, Arrays]:
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
      kernel: A native kernel that may run instead of ``rule`` on a sparse leaf.
      compute_dtype: A float dtype (the state's) that a gradient of a narrower float dtype is converted to first,
        exactly: its duplicates are then summed, and the rule computes, in ``compute_dtype``, and the update comes
        out in it (a bfloat16 table's gradient with float32 state, as ``optax.adam`` with ``mu_dtype=float32``
        returns float32 updates).

    Returns:
      The update leaf (the gradient's type; padding slots zero) and the state, each array in its own dtype: the
      update in :func:`update_dtype`'s (the gradient's, or ``compute_dtype`` where that is wider, promoted with the
      floating state and reads, as optax's arithmetic promotes them).
    """
    state, reads = tuple(state), tuple(reads)
    if g is None:
        return None, state
    check_state_shapes(path, shape, state + reads, where)
    if not is_sparse(g):
        g = _widen(check_dense_gradient(path, g, shape, where), compute_dtype)
        step, new_state = rule(g, state, reads)
        dtype = update_dtype(g.dtype, state, reads)
        return step.astype(dtype), tuple(n.astype(s.dtype) for n, s in zip(new_state, state, strict=True))
    leaf = to_sparse_leaf(g, shape, path, where, emits=True)
    leaf = leaf._replace(values=_widen(leaf.values, compute_dtype))
    dtype = update_dtype(leaf.values.dtype, state, reads)
    if whole_rows and leaf.n_sparse != 1:
        raise param_error(
            ValueError,
            where,
            path,
            f"this optimizer keeps one state scalar per row, so a sparse gradient must address whole rows, but this "
            f"BCOO has n_sparse={leaf.n_sparse}; use an IndexedRows or a BCOO with n_sparse=1",
        )

    def xla() -> tuple[jax.Array, jax.Array, Arrays]:
        summed = coalesce(leaf)
        new_state, out = _run_rows(summed, shape, state, reads, rule, dtype)
        return summed.keys, out, new_state

    if kernel is not None and kernel.supports(leaf, state, reads):
        keys, values, new_state = _kernel_path.select(lambda: kernel.run(leaf, state, reads), xla)
    else:
        keys, values, new_state = xla()
    values = values.astype(dtype)
    # As coalescing leaves it: distinct keys packed first, or a distinct leaf's keys in place.
    out = leaf._replace(keys=keys, values=values, sorted=leaf.sorted) if leaf.distinct else leaf.repacked(keys, values)
    return out.to_leaf(), tuple(new_state)


def check_state_shapes(path: Any, shape: tuple[int, ...], arrays: Sequence[Any], where: str) -> None:
    """That each of a leaf's state arrays has its parameter's ``shape`` or the per-row ``row_shape(shape)``: a
    state built for another table would have its rows read and written out of place (past its end, dropped)."""
    for x in arrays:
        if hasattr(x, "shape") and tuple(x.shape) not in (tuple(shape), row_shape(shape)):
            raise param_error(
                ValueError,
                where,
                path,
                f"the optimizer state holds an array of shape {tuple(x.shape)} for a parameter of shape "
                f"{tuple(shape)}: the state was built for other parameters; build it with `tx.init(params)`",
            )


def _widen(x: jax.Array, dtype: Any) -> jax.Array:
    """``x`` in ``dtype`` where that is a wider float dtype than ``x``'s; else ``x``."""
    if dtype is None or x.dtype == dtype or not jnp.issubdtype(x.dtype, jnp.floating):
        return x
    return x.astype(dtype) if jnp.promote_types(x.dtype, dtype) == dtype else x


def update_dtype(grad_dtype: Any, state: Sequence[jax.Array], reads: Sequence[jax.Array]) -> Any:
    """The dtype of a leaf's update: the gradient's promoted with its floating state and what the rule reads, as
    optax's arithmetic promotes them (``optax.adam`` returns a bfloat16 gradient's update of a float32 parameter,
    whose moments are float32, in float32)."""
    floats = [x.dtype for x in (*state, *reads) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.result_type(grad_dtype, *floats) if floats else grad_dtype


def _run_rows(
    leaf: SparseLeaf, shape: tuple[int, ...], state: Arrays, reads: Arrays, rule: Rule, dtype: Any
) -> tuple[Arrays, Any]:
    """The XLA path: ``rule`` on each chunk of a coalesced leaf's rows, gathered and scattered back, the update's
    rows in ``dtype``."""

    def index_for(x: jax.Array, idx: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        return idx[: x.ndim] if x.ndim < len(shape) else idx

    def rows_update(start: Any, chunk: SparseLeaf, carry: Any) -> Any:
        arrays, out = carry
        idx = chunk.row_index()
        rows = tuple(take_rows(a, index_for(a, idx)) for a in arrays)
        read_rows = tuple(take_rows(r, index_for(r, idx)) for r in reads)
        step, new_rows = rule(chunk.values, rows, read_rows)
        step = jnp.where(broadcast_rows(chunk.valid(), step.ndim), step, jnp.zeros((), step.dtype))
        arrays = tuple(
            scatter_rows(a, index_for(a, idx), n.astype(a.dtype), "set", unique=True)
            for a, n in zip(arrays, new_rows, strict=True)
        )
        return arrays, jax.lax.dynamic_update_slice_in_dim(out, step.astype(out.dtype), start, 0)

    # On an Explicit mesh the rows come back replicated on it; the update they fill must live there too.
    on_mesh = [x for x in state + reads if explicit_sharding(x) is not None]
    out = replicate(jnp.zeros_like(leaf.values, dtype=dtype), like=on_mesh[0] if on_mesh else None)
    return for_each_chunk(leaf, rows_update, (state, out))


def map_rule(
    fn: Callable[..., tuple[Any, ...]],
    grads: Any,
    trees: Sequence[tuple[Any, str]],
    where: str,
    n_out: int,
    params: Any = None,
) -> tuple[Any, ...]:
    """:func:`map_leaves` over the gradient tree, with state subtrees checked to be arrays. With ``params`` (for
    rules that do not read them), each touched leaf's state arrays are checked against its parameter's shape
    (:func:`check_state_shapes`) before ``fn`` sees them."""
    try:  # parameters of another structure (which such a rule never reads) are left unchecked
        treedef: Any = jax.tree.structure(grads, is_leaf=is_leaf)  # jax's PyTreeDef, untyped methods
        treedef.flatten_up_to(params)
    except (ValueError, TypeError):
        params = None
    if params is not None:

        def with_params(path: Any, g: Any, *others: Any) -> tuple[Any, ...]:
            *state, p = others
            if g is not None and hasattr(p, "shape"):
                check_state_shapes(path, tuple(p.shape), state, where)
            return fn(path, g, *state)

        return map_rule(with_params, grads, [*trees, (params, "parameters")], where, n_out)

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
