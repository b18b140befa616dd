"""One optimizer with a rule for the tables and another for the rest: :func:`partition_tables`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import optax

from optax_sparse_adam._fusion import FusableUpdate
from optax_sparse_adam._row_grad import select_tables

__all__ = ["PartitionFusion", "partition_tables"]

_GROUPS = ("tables", "rest")


@dataclasses.dataclass(frozen=True)
class PartitionFusion:
    """What :func:`update_and_apply` needs of a :func:`partition_tables` to fuse each part's step."""

    labels: Callable[[Any], Any]
    transforms: dict[str, optax.GradientTransformation]


def partition_tables(
    tables_tx: optax.GradientTransformation,
    rest_tx: optax.GradientTransformation,
    tables: Callable[[Any], Any],
) -> optax.GradientTransformationExtraArgs:
    """``tables_tx`` for the embedding tables, ``rest_tx`` for every other parameter.

    The recommender's usual pair, row-wise Adagrad (or lazy Adam) for the
    tables and Adam for the layers, without hand-written labels:
    :func:`optax.multi_transform` with labels from the same ``tables``
    selector that :func:`value_and_row_grad` takes. Its state is that of
    ``multi_transform`` (an :class:`optax.PartitionState` with one
    :class:`optax.MaskedState` per part), and :func:`update_and_apply` runs
    each part as its own fused step, so a :func:`sparse_adam` for the tables
    keeps its one pass per touched row.

    Args:
      tables_tx: The tables' transformation (one that takes sparse gradients).
      rest_tx: The other parameters' transformation, e.g. :func:`optax.adam`.
      tables: Selects the tables from the parameters' tree, e.g.
        ``lambda p: p["emb"]``; it may only index into the tree.

    Returns:
      An :class:`optax.GradientTransformationExtraArgs`.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import optax_sparse_adam as osa
      >>> params = {"emb": jnp.ones((100, 4), jnp.float32), "w": jnp.ones((4,), jnp.float32)}
      >>> tx = osa.partition_tables(osa.sparse_rowwise_adagrad(0.1), optax.adam(1e-3), lambda p: p["emb"])
      >>> state = tx.init(params)
      >>> grads = {"emb": osa.IndexedRows(jnp.array([3]), jnp.ones((1, 4), jnp.float32), 100),
      ...          "w": jnp.ones((4,), jnp.float32)}
      >>> params, state = osa.update_and_apply(tx, grads, state, params)
      >>> params["emb"][3], params["w"]
      (Array([0.9, 0.9, 0.9, 0.9], dtype=float32), Array([0.999, 0.999, 0.999, 0.999], dtype=float32))
    """
    if not callable(tables):
        raise TypeError(f"partition_tables: tables must be a function selecting the tables, got {tables!r}")

    def labels(tree: Any) -> Any:
        sel = select_tables(tree, tables, "partition_tables")
        chosen = set(sel.chosen)
        return sel.treedef.unflatten([_GROUPS[i not in chosen] for i in range(len(sel.leaves))])

    transforms = {"tables": tables_tx, "rest": rest_tx}
    inner = optax.multi_transform(transforms, labels)
    return optax.GradientTransformationExtraArgs(
        inner.init, FusableUpdate(inner.update, PartitionFusion(labels, transforms))
    )


def masked(tree: Any, labels: Any, group: str) -> Any:
    """``tree`` with the leaves of other groups replaced by :class:`optax.MaskedNode`, as ``optax.masked`` does."""
    return jax.tree.map(lambda g, x: x if g == group else optax.MaskedNode(), labels, tree)


def merge(labels: Any, parts: dict[str, Any]) -> Any:
    """One tree from each group's masked tree."""
    return jax.tree.map(lambda g, *xs: xs[_GROUPS.index(g)], labels, *(parts[g] for g in _GROUPS))
