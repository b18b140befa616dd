"""One call for an optimizer step and its application: :func:`update_and_apply`."""

from __future__ import annotations

from typing import Any

import jax
import optax

from optax_sparse_adam import _ffi, _kernel_path
from optax_sparse_adam._adam import AdamFusion, kernel_flags, kernel_scalars
from optax_sparse_adam._apply import apply_updates
from optax_sparse_adam._indexed_rows import is_sparse
from optax_sparse_adam._partition import PartitionFusion, masked, merge
from optax_sparse_adam._sparse_leaf import SparseLeaf, to_sparse_leaf
from optax_sparse_adam._tree import is_leaf

__all__ = ["update_and_apply"]


def update_and_apply(
    tx: optax.GradientTransformation, grads: optax.Updates, state: optax.OptState, params: optax.Params
) -> tuple[optax.Params, optax.OptState]:
    r"""One optimizer step applied to the parameters: ``tx.update`` then :func:`apply_updates`.

    The result equals

    .. code-block:: python

      updates, state = tx.update(grads, state, params)
      params = osa.apply_updates(params, updates)

    for any ``tx``. Where ``tx`` is an optimizer built by
    :func:`~optax_sparse_adam.sparse_adam` (not wrapped or chained further) and
    the native CPU kernels apply (:func:`kernel_path` is ``"native-cpu"``;
    float32 tables with one sparse axis), each sparse leaf is done in one pass
    per touched row that reads and writes its parameters and both moments
    together, without materializing the update:

    .. math::

      p_S \leftarrow p_S - \alpha_t \, u_S

    with :math:`u_S` the step of :func:`scale_by_sparse_adam`. It checks
    what the two calls check (int8 or uint8 indices too narrow to mark a
    table's padding are refused on every path). Its numbers are those of the
    kernels (see :mod:`._kernel_path`): from the same state, ``nu`` bitwise
    that of the two calls on the XLA path, ``mu`` within one ulp of the larger
    of its old and new values, the parameters within two ulps of themselves
    plus one of the largest update, because XLA:CPU chooses by shape which
    multiply-adds it fuses (and where ``maximize`` negates the gradient). On
    other platforms, for other leaves, under differentiation and in
    :func:`jax.export` artifacts the two calls run. Use it under
    :func:`jax.jit` with the parameters and state donated.

    Args:
      tx: An optax transformation.
      grads: Gradients, with sparse leaves where ``tx`` takes them.
      state: ``tx``'s state.
      params: The parameters.

    Returns:
      ``(params, state)`` after the step.

    Examples:
      >>> import jax.numpy as jnp
      >>> import optax_sparse_adam as osa
      >>> params = {"emb": jnp.ones((4, 2), jnp.float32)}
      >>> tx = osa.sparse_adam(0.1)
      >>> state = tx.init(params)
      >>> grads = {"emb": osa.IndexedRows(jnp.array([2, 2, -1]), jnp.ones((3, 2), jnp.float32), 4)}
      >>> params, state = osa.update_and_apply(tx, grads, state, params)
      >>> params["emb"].round(3)
      Array([[1. , 1. ],
             [1. , 1. ],
             [0.9, 0.9],
             [1. , 1. ]], dtype=float32)
    """
    fusion = getattr(tx.update, "fusion", None)
    if isinstance(fusion, PartitionFusion) and isinstance(state, optax.PartitionState):
        return _partitioned(fusion, grads, state, params)
    fused = _fusable_leaves(grads, state, params) if isinstance(fusion, AdamFusion) and _kernel_path.enabled() else {}
    if not isinstance(fusion, AdamFusion) or not fused:
        updates, state = tx.update(grads, state, params)
        return apply_updates(params, updates), state

    grad_leaves, treedef = _flatten(grads)
    # Everything else takes the plain path: the step count and a schedule's count advance there.
    rest = treedef.unflatten([None if i in fused else g for i, (_, g) in enumerate(grad_leaves)])
    updates, new_state = tx.update(rest, state, params)
    new_params = apply_updates(params, updates)

    adam, new_adam = _adam_state(state), _adam_state(new_state)
    lr = fusion.learning_rate
    if callable(lr):
        lr = lr(optax.tree.get(state, "ScaleByScheduleState").count)
    scalars = kernel_scalars(fusion.hp, new_adam.count, -1 * lr)
    p_leaves = treedef.flatten_up_to(params)
    m_leaves = treedef.flatten_up_to(adam.mu)
    v_leaves = treedef.flatten_up_to(adam.nu)

    def native() -> list[tuple[jax.Array, ...]]:
        return [
            _ffi.sparse_adam_apply(
                p_leaves[i], m_leaves[i], v_leaves[i], sp.keys[:, 0], sp.values, scalars, **kernel_flags(fusion.hp, sp)
            )
            for i, sp in fused.items()
        ]

    def xla() -> list[tuple[jax.Array, ...]]:
        only = treedef.unflatten([g if i in fused else None for i, (_, g) in enumerate(grad_leaves)])
        updates, s = tx.update(only, state, params)
        p = treedef.flatten_up_to(apply_updates(params, updates))
        adam_s = _adam_state(s)
        m, v = treedef.flatten_up_to(adam_s.mu), treedef.flatten_up_to(adam_s.nu)
        return [(p[i], m[i], v[i]) for i in fused]

    results = dict(zip(fused, _kernel_path.select(native, xla), strict=True))
    out_p = treedef.flatten_up_to(new_params)
    out_m = treedef.flatten_up_to(new_adam.mu)
    out_v = treedef.flatten_up_to(new_adam.nu)
    for i, (p, m, v) in results.items():
        out_p[i], out_m[i], out_v[i] = p, m, v
    new_state = optax.tree.set(new_state, mu=treedef.unflatten(out_m), nu=treedef.unflatten(out_v))
    return treedef.unflatten(out_p), new_state


def _partitioned(
    fusion: PartitionFusion, grads: Any, state: optax.PartitionState, params: Any
) -> tuple[Any, optax.PartitionState]:
    """A :func:`partition_tables` step: each part's own :func:`update_and_apply` on its masked trees."""
    labels = fusion.labels(params)
    parts, inner_states = {}, {}
    for group, tx in fusion.transforms.items():
        inner = state.inner_states[group]
        parts[group], new = update_and_apply(
            tx, masked(grads, labels, group), inner.inner_state, masked(params, labels, group)
        )
        inner_states[group] = inner._replace(inner_state=new)
    return merge(labels, parts), state._replace(inner_states=inner_states)


def _adam_state(state: Any) -> optax.ScaleByAdamState:
    """The :class:`optax.ScaleByAdamState` in a :func:`sparse_adam` chain's state, found by name."""
    return optax.tree.get(state, "ScaleByAdamState")


def _flatten(tree: Any) -> tuple[list[tuple[Any, Any]], Any]:
    """``(path, leaf)`` pairs and the treedef, sparse leaves and ``None`` as leaves."""
    return jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)


def _fusable_leaves(grads: Any, state: Any, params: Any) -> dict[int, SparseLeaf]:
    """The sparse gradient leaves the fused kernel handles, by position, validated.

    Trees that do not match, or a state of another shape, give none: the two plain calls then report them.
    """
    grad_leaves, treedef = _flatten(grads)
    try:
        adam = _adam_state(state)
        p_leaves = treedef.flatten_up_to(params)
        m_leaves = treedef.flatten_up_to(adam.mu)
        v_leaves = treedef.flatten_up_to(adam.nu)
    except (ValueError, TypeError, AttributeError, IndexError, KeyError):
        return {}
    fused = {}
    for i, ((path, g), p, m, v) in enumerate(zip(grad_leaves, p_leaves, m_leaves, v_leaves, strict=True)):
        if not (is_sparse(g) and all(isinstance(x, jax.Array) for x in (p, m, v))):
            continue
        if not p.shape == m.shape == v.shape:
            continue
        sp = to_sparse_leaf(g, p.shape, path, "scale_by_sparse_adam", emits=True)
        if _kernel_path.supports(p.shape, sp.n_sparse, p, m, v, sp.values):
            fused[i] = sp
    return fused
