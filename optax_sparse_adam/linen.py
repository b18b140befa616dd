"""Flax ``linen`` training state with the fused step (needs ``flax``; import as ``optax_sparse_adam.linen``)."""

from __future__ import annotations

from typing import Any

from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT  # where train_state takes it from
from flax.training import train_state

from optax_sparse_adam._fused import update_and_apply

__all__ = ["TrainState"]


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
