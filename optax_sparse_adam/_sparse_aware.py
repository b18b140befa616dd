"""Making stateless optax transformations correct on sparse leaves: :func:`sparse_aware`."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from optax_sparse_adam import _kernel_path
from optax_sparse_adam._coalesce import coalesce as coalesce_leaf
from optax_sparse_adam._coalesce import coalesce_with_squares, sum_of_squares
from optax_sparse_adam._fusion import record_clip, recording_active
from optax_sparse_adam._indexed_rows import is_sparse
from optax_sparse_adam._row_ops import take_rows
from optax_sparse_adam._sparse_leaf import SparseLeaf, to_sparse_leaf
from optax_sparse_adam._tree import is_leaf, map_leaves, path_str

__all__ = ["sparse_aware"]

_WHERE = "sparse_aware"
# The update function of every optax.clip_by_global_norm(max_norm) shares this code, its max_norm a closure cell.
_CLIP_CODE: Any = optax.clip_by_global_norm(1.0).update.__code__
_CLIP_CELLS: tuple[str, ...] = _CLIP_CODE.co_freevars


def sparse_aware(
    inner: optax.GradientTransformation, *, coalesce: bool = True
) -> optax.GradientTransformationExtraArgs:
    """Lets a stateless optax transformation see sparse leaves as their dense equivalent.

    optax's transformations map over every array of a tree, so on a BCOO or an
    :class:`IndexedRows` they also scale, clip or count the integer indices.
    This wrapper hands ``inner`` each sparse leaf's values instead, after
    summing duplicates and zeroing padding, and then puts the new values back
    under the same indices. Parameters, where given, are handed over as the
    touched rows only. Dense leaves pass through unchanged. An update leaf
    that :func:`sparse_adam` emitted is already summed and is used as it is.

    ``optax.clip_by_global_norm(c)`` itself is recognized (by its update
    function's code) and run as written there, with one difference on the
    CPU's native path: the coalescing kernel adds the squares of the summed
    rows in double (a kernel those of the entries, where the ids are known
    distinct), so the norm may differ from the XLA path's by that path's
    float32 summation error; under :func:`update_and_apply` the fused optimizer
    kernels clip each row as they read it (see there).

    The result equals that of ``inner`` on the dense equivalent gradient when
    ``inner`` works entry by entry or through sums over entries:
    ``clip_by_global_norm``, ``clip``, ``scale``, ``scale_by_learning_rate``,
    ``scale_by_schedule``, ``zero_nans``, ``normalize_by_update_norm``. One
    that reads the parameters entry by entry (``add_decayed_weights``) acts
    on the touched rows only: untouched rows get no update. One that counts
    entries or reads whole parameters gives another result, silently:
    ``clip_by_block_rms`` (a mean over the leaf's entries) and
    ``scale_by_trust_ratio`` (the norm of the touched rows, not of the
    parameter). Transformations with per-parameter state (``trace``,
    ``adam``) are refused at ``init``.

    optax's wrappers around a whole optimizer built from
    :func:`sparse_adam`:

    - ``optax.partition`` / ``optax.multi_transform`` and ``optax.masked``: a
      label (or mask) tree works as it is. A label *function* is called on the
      parameters at init but on the updates at each step, so it must take a
      sparse leaf as one leaf: map with ``is_leaf=osa.is_sparse`` (a sparse
      leaf has its parameter's ``shape``, ``ndim`` and ``dtype``, so both
      calls agree), or walk the dicts by path
      (``flax.traverse_util.path_aware_map``).
    - ``optax.apply_if_finite(tx, ...)`` (or :func:`apply_if_finite`, the same
      transformation, which :func:`update_and_apply` fuses) skips a step whose gradient holds a
      non-finite value, state untouched. It inspects every array, padding
      entries included; put ``sparse_aware(optax.zero_nans())`` in front to
      look at the dense equivalent only.
    - ``optax.MultiSteps(tx, k)`` accumulates into dense buffers before ``tx``
      runs, so it refuses sparse leaves. Hand it dense gradients
      (``g.todense()`` for each sparse leaf) and mark those tables
      ``lazy_dense``: rows that no mini-batch touched stay exactly zero in the
      accumulated mean and are skipped. The accumulation costs O(table) per
      mini-step.
    - ``optax.inject_hyperparams(sparse_adam)``: the learning rate, ``b1``,
      ``b2``, ``eps`` and ``eps_root`` become state, and changing them does
      not recompile. Name ``mu_dtype`` and a callable ``lazy_dense`` in
      ``static_args``: ``inject_hyperparams`` takes any callable for a
      schedule.
    - ``optax.global_norm`` counts a sparse leaf's indices as values; use
      ``optax.global_norm(jax.tree.map(lambda g: g.todense() if osa.is_sparse(g) else g, grads,
      is_leaf=osa.is_sparse))``, or clip with
      ``sparse_aware(optax.clip_by_global_norm(c))``.

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
    max_norm = _clip_max_norm(inner) if coalesce else None
    inner = optax.with_extra_args_support(inner)

    def init_fn(params: optax.Params) -> Any:
        state = inner.init(params)
        for path, leaf in jax.tree_util.tree_leaves_with_path(state):
            if getattr(leaf, "ndim", 0) > 0:
                raise ValueError(
                    f"{_WHERE}: the wrapped transformation keeps per-parameter state "
                    f"(state{path_str(path)} has shape {leaf.shape}); only stateless "
                    "transformations can be applied to the values of sparse leaves: put it outside "
                    "sparse_aware, or use this library's optimizers for stateful sparse updates"
                )
        return state

    def update_fn(
        updates: optax.Updates, state: Any, params: optax.Params | None = None, **extra_args: Any
    ) -> tuple[optax.Updates, Any]:
        if max_norm is not None:
            return _clip_by_global_norm(updates, params, max_norm), state

        def split(path: Any, u: Any, p: Any) -> tuple[Any, Any, SparseLeaf | None]:
            """The values ``inner`` sees, the parameter rows it sees, and the sparse leaf to rebuild."""
            if not is_sparse(u):
                return u, p, None
            sp = to_sparse_leaf(u, u.shape if p is None else p.shape, path, _WHERE, emits=True)
            # Coalescing leaves its padding slots zero (on both paths); a leaf that is not coalesced is zeroed here.
            sp = coalesce_leaf(sp) if coalesce and not sp.distinct else sp.zero_padding()
            # XLA's gather: the stage's arithmetic on these rows rounds as on the XLA path (see take_rows).
            rows = None if p is None else take_rows(p, sp.row_index(), native=False)
            return sp.values, rows, sp

        others = [] if params is None else [(params, "parameters")]
        values, rows, sparse = map_leaves(
            lambda path, u, *p: split(path, u, p[0] if p else None),
            updates,
            others,
            where=_WHERE,
            tree_name="updates",
            n_out=3,
        )
        new_values, state = inner.update(values, state, None if params is None else rows, **extra_args)

        treedef: Any = jax.tree.structure(updates, is_leaf=is_leaf)
        out = [
            v if sp is None else sp._replace(values=v).to_leaf()
            for sp, v in zip(treedef.flatten_up_to(sparse), treedef.flatten_up_to(new_values), strict=True)
        ]
        return treedef.unflatten(out), state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _clip_max_norm(inner: optax.GradientTransformation) -> Any | None:
    """``max_norm`` where ``inner`` is ``optax.clip_by_global_norm(max_norm)`` (recognized by its update function's
    code, shared by every instance), else ``None``."""
    update: Any = getattr(inner, "update", None)
    closure = getattr(update, "__closure__", None)
    if getattr(update, "__code__", None) is not _CLIP_CODE or closure is None:
        return None
    cells = dict(zip(_CLIP_CELLS, closure, strict=True))
    return cells["max_norm"].cell_contents if "max_norm" in cells else None


def _clip_by_global_norm(updates: optax.Updates, params: optax.Params | None, max_norm: Any) -> optax.Updates:
    """``sparse_aware(optax.clip_by_global_norm(max_norm))``'s update: optax's rule on the dense equivalent.

    On the XLA path it is optax's update itself on the summed values (the norm ``optax.tree.norm`` of them, the
    clipping ``select(g_norm < max_norm, t, (t / g_norm) * max_norm)``). On the CPU's native path the coalescing
    kernel also adds the squares of a table's summed rows, in double (:func:`._coalesce.coalesce_with_squares`),
    rather than XLA's float32 reduction reading them again: the norm may differ from the XLA path's by that float32
    summation's error, as the two paths' coalesced rows, packed in other orders, already let it. Inside
    :func:`~optax_sparse_adam.update_and_apply` each table's clipping is recorded (its entries, the clipping's
    divisor and factor), and a fused optimizer kernel then sums and clips each row itself as it reads the entries,
    bitwise as here; the squares then come from a kernel that reads the entries without writing their sums
    (:func:`._coalesce.sum_of_squares`, bitwise the same), so that neither the summed nor the clipped rows are
    written. Where that table is the only leaf the clipping sees, its norm is its entries' alone: the clipping is
    recorded with ``max_norm`` too, and a kernel that takes it computes the norm itself as it sums the rows, bitwise
    as ``sum_of_squares`` and the ``sqrt`` and comparison here, so that pass drops out as well. A table known
    distinct is not summed: on the native path the squares of its entries as they are (``sum_of_squares``: padding
    left out, no coalescing, no zeroed copy) and, inside ``update_and_apply``, the fused kernel reads the entries
    themselves, taking the norm itself where the table is alone.
    """

    # Inside update_and_apply, with the native kernels on: a fused Adam kernel may take the table's entries.
    fusing = recording_active() and _kernel_path.enabled()
    entries_of: dict[int, SparseLeaf] = {}  # by id of the summed leaf: the entries a fused kernel sums itself
    from_entries: list[SparseLeaf] = []  # the summed leaves whose squares sum_of_squares took from the entries

    def split(path: Any, u: Any, p: Any) -> tuple[Any, SparseLeaf | None, Any]:
        """The values the rule sees, the summed leaf to rebuild, and the sum of its squares where computed."""
        if not is_sparse(u):
            return u, None, None
        entries = to_sparse_leaf(u, u.shape if p is None else p.shape, path, _WHERE, emits=True)
        # Whether the kernels take this table's entries on the CPU (one sparse axis, float32 values).
        native = entries.n_sparse == 1 and _kernel_path.supports(entries.shape, 1, entries.values)
        if entries.distinct:
            zeroed = entries.zero_padding()
            if not native:
                entries_of[id(zeroed)] = zeroed
                return zeroed.values, zeroed, None
            # The squares of the entries as they are (no coalescing, no zeroed copy: the kernels leave padding out).
            # A fused kernel reads the entries themselves, and takes their norm too where this table is alone.
            entries_of[id(zeroed)] = entries
            if fusing:
                from_entries.append(zeroed)
            return zeroed.values, zeroed, sum_of_squares(entries)
        if fusing and native:
            # The summed rows only where the fused step does not take this table (XLA drops them where it does):
            # the squares from the entries, and the kernel sums them again, clipping each as it goes.
            summed, squares = coalesce_leaf(entries), sum_of_squares(entries)
            entries_of[id(summed)] = entries
            from_entries.append(summed)
        else:
            summed, squares = coalesce_with_squares(entries)
            entries_of[id(summed)] = summed
        return summed.values, summed, squares

    values, summed, squares = map_leaves(
        lambda path, u, *p: split(path, u, p[0] if p else None),
        updates,
        [] if params is None else [(params, "parameters")],
        where=_WHERE,
        tree_name="updates",
        n_out=3,
    )
    treedef: Any = jax.tree.structure(updates, is_leaf=is_leaf)
    value_leaves = treedef.flatten_up_to(values)
    # optax.tree.norm(values), each leaf's sum of squares being the coalescing's where it computed one.
    leaf_squares = [
        None if v is None else optax.tree.norm(v, squared=True) if s is None else s
        for v, s in zip(value_leaves, treedef.flatten_up_to(squares), strict=True)
    ]
    g_norm = jnp.sqrt(optax.tree.sum(treedef.unflatten(leaf_squares)))
    # optax.clip_by_global_norm's update, as written there.
    trigger = jnp.squeeze(g_norm < max_norm)
    new_values = jax.tree.map(lambda t: jax.lax.select(trigger, t, (t / g_norm.astype(t.dtype)) * max_norm), values)

    # A table that is the only leaf the clipping sees, summed by a kernel that does not keep the sums (the squares
    # from sum_of_squares): the norm is its entries' alone, so a fused kernel can take it itself as it sums them.
    alone = len(from_entries) == 1 and sum(v is not None for v in value_leaves) == 1
    out = []
    for sp, v in zip(treedef.flatten_up_to(summed), treedef.flatten_up_to(new_values), strict=True):
        if sp is None:
            out.append(v)
            continue
        leaf = sp._replace(values=v).to_leaf()
        if fusing and v.dtype == jnp.float32:
            one = jnp.ones([], jnp.float32)
            limit = jnp.reshape(jnp.asarray(max_norm, jnp.float32), ())
            divisor = jnp.where(trigger, one, g_norm.astype(jnp.float32))
            factor = jnp.where(trigger, one, limit)
            record_clip(leaf, entries_of[id(sp)], divisor, factor, limit if alone else None)
        out.append(leaf)
    return treedef.unflatten(out)
