"""Flax ``nnx`` modules on the library's embeddings (needs ``flax``; import as ``optax_sparse_adam.nnx``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
from flax import nnx

from optax_sparse_adam._collection import EmbeddingCollection
from optax_sparse_adam._fused import update_and_apply
from optax_sparse_adam._pooled import Bags

__all__ = ["EmbeddingBags", "Optimizer"]


class Optimizer(nnx.Optimizer):
    """``nnx.Optimizer`` whose ``update`` is one :func:`~optax_sparse_adam.update_and_apply` step.

    A drop-in for ``nnx.Optimizer``: same constructor, same state, same
    checkpoints. ``update(model, grads)`` runs ``update_and_apply(tx, grads,
    state, params)`` on the ``wrt`` parameters, so a :func:`sparse_adam`
    (alone or in :func:`partition_tables`) updates each touched row of a
    table and its moments in one native pass, where ``nnx.Optimizer`` takes
    the two calls (``tx.update``, then ``optax.apply_updates``). It returns
    ``None``: the fused step never builds the updates. With keyword
    arguments for ``tx.update`` it takes the two calls, as ``nnx.Optimizer``.

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import optax_sparse_adam as osa
      >>> from optax_sparse_adam import nnx as osa_nnx
      >>> model = nnx.Embed(1000, 4, rngs=nnx.Rngs(0))
      >>> optimizer = osa_nnx.Optimizer(model, osa.sparse_adam(0.1), wrt=nnx.Param)
      >>> grads = nnx.State({"embedding": nnx.Param(osa.IndexedRows(jnp.array([5]), jnp.ones((1, 4)), 1000))})
      >>> before = model.embedding[...]
      >>> optimizer.update(model, grads)
      >>> jnp.flatnonzero(jnp.any(model.embedding[...] != before, axis=1))
      Array([5], dtype=int32)
    """

    def update(self, model: Any, grads: Any, /, **kwargs: Any) -> None:  # type: ignore[override]
        """Applies ``grads`` to ``model``'s ``wrt`` parameters in one :func:`~optax_sparse_adam.update_and_apply` step.

        Args:
          model: The model the optimizer was built for.
          grads: Gradients of its ``wrt`` parameters (sparse leaves where the optimizer takes them).
          **kwargs: Extra arguments for ``tx.update``; with any, the step takes the two calls.
        """
        if kwargs:
            super().update(model, grads, **kwargs)
            return
        params = nnx.as_pure(nnx.state(model, self.wrt, graph=self.graph))
        grad_arrays = nnx.as_pure(nnx.state(grads, self.wrt, graph=self.graph))
        new_params, new_state = update_and_apply(self.tx, grad_arrays, nnx.as_pure(self.opt_state), params)
        nnx.update(model, new_params)
        nnx.update(self.opt_state, nnx.state(new_state, graph=self.graph))
        self.step[...] += 1


class EmbeddingBags(nnx.Module):
    """An :class:`~optax_sparse_adam.EmbeddingCollection` as a module: one ``nnx.Param`` per stack.

    Calling it pools a batch's bags (from ``collection.bags``) into each
    feature's ``(batch, width)`` vectors. For row gradients, split the model
    (``graphdef, params = nnx.split(model, nnx.Param)``), select the stacks
    as the tables (``lambda p: p["emb"]["stacks"]`` for a model holding it as
    ``self.emb``) and merge inside the loss:

    Examples:
      >>> import jax, jax.numpy as jnp, optax
      >>> from flax import nnx
      >>> import optax_sparse_adam as osa
      >>> from optax_sparse_adam.nnx import EmbeddingBags
      >>> coll = osa.EmbeddingCollection({"item": osa.TableSpec(1000, 8)},
      ...                                {"history": osa.FeatureSpec("item", "mean")})
      >>> class Model(nnx.Module):
      ...   def __init__(self, rngs):
      ...     self.emb = EmbeddingBags(coll, rngs=rngs)
      ...     self.out = nnx.Linear(8, 1, rngs=rngs)
      ...   def __call__(self, bags):
      ...     return self.out(self.emb(bags)["history"])[:, 0]
      >>> model = Model(nnx.Rngs(0))
      >>> graphdef, params = nnx.split(model, nnx.Param)
      >>> batch = coll.bags({"history": jnp.array([[1, 2, -1], [7, 7, 7]])})
      >>> def loss(params, batch):
      ...   return jnp.sum(nnx.merge(graphdef, params)(batch) ** 2)
      >>> value, grads = osa.value_and_row_grad(loss, lambda p: p["emb"]["stacks"])(params, batch)
      >>> type(grads["emb"]["stacks"]["float32_8"].get_value()).__name__
      'IndexedRows'
      >>> optimizer = nnx.Optimizer(model, osa.sparse_adam(1e-2), wrt=nnx.Param)
      >>> before = model.emb.table("item")
      >>> _ = optimizer.update(model, grads)
      >>> jnp.flatnonzero(jnp.any(model.emb.table("item") != before, axis=1))  # the rows the batch read
      Array([1, 2, 7], dtype=int32)

    Args:
      collection: The tables and features.
      rngs: Random streams; the tables are drawn from ``rngs.params()``.
    """

    def __init__(self, collection: EmbeddingCollection, *, rngs: nnx.Rngs) -> None:
        self.collection = collection
        self.stacks = nnx.data({k: nnx.Param(v) for k, v in collection.init(rngs.params()).items()})

    def __call__(self, bags: Mapping[str, Bags]) -> dict[str, jax.Array]:
        return self.collection.pool({k: v[...] for k, v in self.stacks.items()}, bags)

    def table(self, name: str) -> jax.Array:
        """Table ``name``'s rows."""
        return self.collection.table({k: v[...] for k, v in self.stacks.items()}, name)
