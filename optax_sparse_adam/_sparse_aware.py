"""Making stateless optax transformations correct on sparse leaves: :func:`sparse_aware`."""

from __future__ import annotations

from typing import Any

import jax
import optax

from optax_sparse_adam._coalesce import coalesce as coalesce_leaf
from optax_sparse_adam._indexed_rows import is_sparse
from optax_sparse_adam._row_ops import take_rows
from optax_sparse_adam._sparse_leaf import SparseLeaf, to_sparse_leaf
from optax_sparse_adam._tree import is_leaf, map_leaves, path_str

__all__ = ["sparse_aware"]

_WHERE = "sparse_aware"


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
