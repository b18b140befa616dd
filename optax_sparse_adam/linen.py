"""Flax ``linen`` training state with the fused step (needs ``flax``; import as ``optax_sparse_adam.linen``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT  # where train_state takes it from
from flax.training import train_state

from optax_sparse_adam._collection import EmbeddingCollection
from optax_sparse_adam._fused import update_and_apply
from optax_sparse_adam._pooled import Bags

__all__ = ["EmbeddingBags", "TrainState"]


class EmbeddingBags(nn.Module):
    """An :class:`~optax_sparse_adam.EmbeddingCollection` as a linen module: its stacks in ``params["stacks"]``.

    Calling it pools a batch's bags (from ``collection.bags``) into each
    feature's ``(batch, width)`` vectors. The stacks are one ``params``
    variable, which linen does not check against a shape, so the module
    reads the rows :func:`~optax_sparse_adam.value_and_row_grad` gathers as
    it reads whole tables: select ``lambda p: p["params"]["stacks"]`` (under
    the module's own name in a larger model) as the tables.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import optax_sparse_adam as osa
      >>> from optax_sparse_adam.linen import EmbeddingBags
      >>> coll = osa.EmbeddingCollection({"item": osa.TableSpec(1000, 8)},
      ...                                {"history": osa.FeatureSpec("item", "mean")})
      >>> model = EmbeddingBags(coll)
      >>> batch = coll.bags({"history": jnp.array([[1, 2, -1], [7, 7, 7]])})
      >>> params = model.init(jax.random.key(0), batch)
      >>> jax.tree.map(jnp.shape, params)
      {'params': {'stacks': {'float32_8': (1000, 8)}}}
      >>> def loss(p, b):
      ...   return jnp.sum(model.apply(p, b)["history"] ** 2)
      >>> value, grads = osa.value_and_row_grad(loss, lambda p: p["params"]["stacks"])(params, batch)
      >>> type(grads["params"]["stacks"]["float32_8"]).__name__
      'IndexedRows'

    Attributes:
      collection: The tables and features.
    """

    collection: EmbeddingCollection

    @nn.compact
    def __call__(self, bags: Mapping[str, Bags]) -> dict[str, jax.Array]:
        stacks = self.variable("params", "stacks", lambda: self.collection.init(self.make_rng("params")))
        return self.collection.pool(stacks.value, bags)


class TrainState(train_state.TrainState):
    """A ``flax.training.train_state.TrainState`` whose ``apply_gradients`` is one fused step.

    One :func:`~optax_sparse_adam.update_and_apply` step. A drop-in: same
    fields, same ``create``, same checkpoints, and the same
    handling of the ``overwrite_with_gradient`` collection. Where the stock
    ``apply_gradients`` takes the two calls (``tx.update``, then
    ``optax.apply_updates``), a :func:`sparse_adam` (alone or in
    :func:`partition_tables`) updates each touched row of a table and its
    moments in one native pass.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import flax.linen as nn
      >>> import optax_sparse_adam as osa
      >>> from optax_sparse_adam.linen import TrainState
      >>> model = nn.Embed(1000, 4)
      >>> params = model.init(jax.random.key(0), jnp.zeros((1,), jnp.int32))
      >>> state = TrainState.create(apply_fn=model.apply, params=params, tx=osa.sparse_adam(0.1))
      >>> g = {"params": {"embedding": osa.IndexedRows(jnp.array([5]), jnp.ones((1, 4)), 1000)}}
      >>> new = state.apply_gradients(grads=g)
      >>> table = lambda s: s.params["params"]["embedding"]
      >>> jnp.flatnonzero(jnp.any(table(new) != table(state), axis=1)), int(new.step)
      (Array([5], dtype=int32), 1)
    """

    def apply_gradients(self, *, grads: Any, **kwargs: Any) -> TrainState:
        overwrite = OVERWRITE_WITH_GRADIENT in grads
        params = self.params["params"] if overwrite else self.params
        new_params, new_opt_state = update_and_apply(
            self.tx, grads["params"] if overwrite else grads, self.opt_state, params
        )
        if overwrite:
            new_params = {"params": new_params, OVERWRITE_WITH_GRADIENT: grads[OVERWRITE_WITH_GRADIENT]}
        return self.replace(step=self.step + 1, params=new_params, opt_state=new_opt_state, **kwargs)
