"""``optax_sparse_adam.linen.TrainState``: the stock ``TrainState`` with the fused step."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

import optax_sparse_adam as osa
from optax_sparse_adam.linen import TrainState
from tests.helpers import assert_trees_equal


class Model(nn.Module):
    rows: int = 500

    @nn.compact
    def __call__(self, ids):
        return nn.Dense(1)(nn.Embed(self.rows, 8)(ids))[:, 0]


def test_fused_apply_gradients_equals_the_stock_one(kernel_path):
    model = Model()
    params = model.init(jax.random.key(0), jnp.zeros((4,), jnp.int32))
    tx = osa.partition_tables(osa.sparse_adam(1e-2), optax.adam(1e-2), lambda p: p["params"]["Embed_0"]["embedding"])
    states = [cls.create(apply_fn=model.apply, params=params, tx=tx) for cls in (train_state.TrainState, TrainState)]

    @jax.jit
    def step(state, ids, y):
        def loss(p, pos):  # linen checks a parameter's shape: a clone sized to the looked-up rows reads them
            return jnp.mean((model.clone(rows=ids.size).apply(p, pos) - y) ** 2)

        tables = lambda p: p["params"]["Embed_0"]["embedding"]  # noqa: E731
        _, grads = osa.value_and_row_grad(loss, tables)(state.params, ids)
        return state.apply_gradients(grads=grads)

    rng = np.random.default_rng(0)
    for _ in range(3):
        ids, y = jnp.asarray(rng.integers(0, 500, 16), jnp.int32), jnp.asarray(rng.standard_normal(16), jnp.float32)
        states = [step(s, ids, y) for s in states]
    stock, fused = states
    assert isinstance(fused, TrainState) and int(fused.step) == 3
    assert_trees_equal(fused.params, stock.params, rtol=1e-6, atol=1e-7)
    assert_trees_equal(fused.opt_state, stock.opt_state, rtol=1e-6, atol=1e-7)
    hlo = step.lower(fused, ids, y).as_text()
    assert ("sparse_adam_apply" in hlo) == (kernel_path == "native-cpu")
