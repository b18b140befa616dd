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

    def step(state, ids, y):
        def loss(p, pos):  # linen checks a parameter's shape: a clone sized to the looked-up rows reads them
            return jnp.mean((model.clone(rows=ids.size).apply(p, pos) - y) ** 2)

        tables = lambda p: p["params"]["Embed_0"]["embedding"]  # noqa: E731
        _, grads = osa.value_and_row_grad(loss, tables)(state.params, ids)
        return state.apply_gradients(grads=grads)

    # One jitted step per class: the two TrainStates' tree structures compare equal (flax's dataclass nodes), so
    # one jitted function fed both can hand back the other class's compiled step, which returns that class.
    # Two function objects: jax.jit of one function shares its trace cache across wrappers, which made this flaky.
    steps = [jax.jit(lambda *a: step(*a)), jax.jit(lambda *a: step(*a))]
    rng = np.random.default_rng(0)
    for _ in range(3):
        ids, y = jnp.asarray(rng.integers(0, 500, 16), jnp.int32), jnp.asarray(rng.standard_normal(16), jnp.float32)
        states = [jitted(s, ids, y) for jitted, s in zip(steps, states, strict=True)]
    stock, fused = states
    assert isinstance(fused, TrainState) and int(fused.step) == 3
    assert_trees_equal(fused.params, stock.params, rtol=1e-6, atol=1e-7)
    assert_trees_equal(fused.opt_state, stock.opt_state, rtol=1e-6, atol=1e-7)
    hlo = steps[1].lower(fused, ids, y).as_text()
    assert ("sparse_adam_apply" in hlo) == (kernel_path == "native-cpu")


def test_embedding_bags_row_gradients_equal_the_dense_models(kernel_path):
    from optax_sparse_adam.linen import EmbeddingBags

    coll = osa.EmbeddingCollection(
        {"user": osa.TableSpec(300, 8), "item": osa.TableSpec(200, 8), "tag": osa.TableSpec(50, 4)},
        {
            "user": osa.FeatureSpec("user"),
            "hist": osa.FeatureSpec("item", "mean"),
            "tags": osa.FeatureSpec("tag", "sqrtn"),
        },
    )

    class Tower(nn.Module):
        @nn.compact
        def __call__(self, bags):
            f = EmbeddingBags(coll)(bags)
            return nn.Dense(1)(jnp.concatenate([f["user"] * f["hist"], f["tags"]], axis=1))[:, 0]

    rng = np.random.default_rng(2)
    # Built, initialized and differentiated jitted: op by op, each operation compiles alone.
    batch = jax.jit(coll.bags)(
        {
            "user": rng.integers(0, 300, 16).astype(np.int32),
            "hist": rng.integers(-1, 200, (16, 6)).astype(np.int32),
            "tags": rng.integers(-1, 50, (16, 3)).astype(np.int32),
        }
    )
    y = jnp.asarray(rng.standard_normal(16), jnp.float32)
    model = Tower()
    params = jax.jit(model.init)(jax.random.key(0), batch)

    def loss(p, b):
        return jnp.mean((model.apply(p, b) - y) ** 2)

    def both(params, batch):
        row = osa.value_and_row_grad(loss, lambda p: p["params"]["EmbeddingBags_0"]["stacks"])(params, batch)
        return row, jax.value_and_grad(loss)(params, batch)

    (value, grads), (want_value, want) = jax.jit(both)(params, batch)
    np.testing.assert_allclose(value, want_value, rtol=1e-6)
    dense = jax.tree.map(lambda g: g.todense() if isinstance(g, osa.IndexedRows) else g, grads, is_leaf=osa.is_sparse)
    assert_trees_equal(dense, want, rtol=1e-5, atol=1e-7)
    state = TrainState.create(apply_fn=model.apply, params=params, tx=osa.sparse_adam(1e-2))
    new = jax.jit(lambda s, g: s.apply_gradients(grads=g))(state, grads)
    assert int(new.step) == 1
