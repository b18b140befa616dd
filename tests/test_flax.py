"""Flax train steps: the lazy opt-in on dense gradients, and the fast path with row gradients.

Both paths apply the same rule (a table row moves when the batch looks it up),
so on the same model and data they give the same losses.
"""

from __future__ import annotations

from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from flax.training import train_state
from jax.extend.core import Jaxpr

import optax_sparse_adam as osa
from tests.helpers import all_eqns, assert_trees_equal, jit_once

pytestmark = pytest.mark.slow

N_USERS, N_ITEMS, FEATURES, HIDDEN, BATCH = 300, 400, 8, 16, 32
LR = 5e-2
EPOCHS = 4


def embedding_tables(params: Any) -> Any:
    """``lazy_dense`` mask: the embedding tables, found by their parameter name."""
    return jax.tree_util.tree_map_with_path(lambda path, _: "embedding" in jax.tree_util.keystr(path), params)


def make_batches(n: int, seed: int = 0) -> list[tuple[jax.Array, jax.Array, jax.Array]]:
    """``n`` batches of (users, items, ratings), the ratings from hidden rank-2 factors."""
    rng = np.random.default_rng(seed)
    user_factors = rng.standard_normal((N_USERS, 2), dtype=np.float32)
    item_factors = rng.standard_normal((N_ITEMS, 2), dtype=np.float32)
    batches = []
    for _ in range(n):
        users = rng.integers(0, N_USERS, BATCH, dtype=np.int32)
        items = rng.integers(0, N_ITEMS, BATCH, dtype=np.int32)
        ratings = np.sum(user_factors[users] * item_factors[items], axis=1)
        batches.append((jnp.asarray(users), jnp.asarray(items), jnp.asarray(ratings)))
    return batches


def all_shapes(jaxpr: Jaxpr) -> list[tuple[int, ...]]:
    """Shapes of every intermediate in ``jaxpr``, sub-jaxprs (jit, while, cond, custom_vjp) included."""
    return [tuple(getattr(v.aval, "shape", ())) for eqn in all_eqns(jaxpr) for v in eqn.outvars]


def table_sized(shapes: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    smallest = min(N_USERS, N_ITEMS) * FEATURES
    return [s for s in shapes if int(np.prod(s)) >= smallest]


# --------------------------------------------------------------------------------------------------------------------
# flax.nnx


class NnxRecommender(nnx.Module):
    def __init__(self, n_users: int, n_items: int, *, rngs: nnx.Rngs) -> None:
        self.user = nnx.Embed(n_users, FEATURES, rngs=rngs)
        self.item = nnx.Embed(n_items, FEATURES, rngs=rngs)
        self.hidden = nnx.Linear(2 * FEATURES, HIDDEN, rngs=rngs)
        self.out = nnx.Linear(HIDDEN, 1, rngs=rngs)

    def __call__(self, users: jax.Array, items: jax.Array) -> jax.Array:
        x = jnp.concatenate([self.user(users), self.item(items)], axis=-1)
        return self.out(jax.nn.gelu(self.hidden(x)))[..., 0]


def nnx_lazy_trainer() -> tuple[NnxRecommender, nnx.Optimizer, Any]:
    """The dense path: ``nnx.Optimizer`` with the lazy opt-in on the tables."""
    model = NnxRecommender(N_USERS, N_ITEMS, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, osa.sparse_adam(LR, lazy_dense=embedding_tables), wrt=nnx.Param)

    def train_step(model: NnxRecommender, optimizer: nnx.Optimizer, users: Any, items: Any, y: Any) -> jax.Array:
        def loss_fn(model: NnxRecommender) -> jax.Array:
            return jnp.mean((model(users, items) - y) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    return model, optimizer, jit_once(train_step, jit=nnx.jit)


def nnx_fast_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation) -> Any:
    """The fast path's step: row gradients, then ``tx.update`` and ``osa.apply_updates`` on the split state."""

    def train_step(params: Any, opt_state: Any, users: Any, items: Any, y: Any) -> tuple[Any, Any, jax.Array]:
        def loss_fn(p: Any, ids: tuple[jax.Array, jax.Array]) -> jax.Array:
            return jnp.mean((nnx.merge(graphdef, p)(*ids) - y) ** 2)

        loss, grads = osa.value_and_row_grad(loss_fn, lambda p: (p["user"], p["item"]))(params, (users, items))
        updates, opt_state = tx.update(grads, opt_state, params)
        return osa.apply_updates(params, updates), opt_state, loss

    return train_step


def nnx_fast_trainer() -> tuple[Any, Any, Any, Any]:
    model = NnxRecommender(N_USERS, N_ITEMS, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    tx = osa.sparse_adam(LR)
    return graphdef, params, tx.init(params), jit_once(nnx_fast_step(graphdef, tx))


def nnx_tables(params: Any) -> dict[str, jax.Array]:
    pure = nnx.as_pure(params)
    return {"user": pure["user"]["embedding"], "item": pure["item"]["embedding"]}


def assert_trained(losses: list[float]) -> None:
    """The last pass over the batches has a clearly lower loss than the first."""
    first, last = np.mean(losses[: len(losses) // EPOCHS]), np.mean(losses[-len(losses) // EPOCHS :])
    assert last < 0.75 * first, (first, last)


def check_untouched(before: dict[str, Any], after: dict[str, Any], users: jax.Array, items: jax.Array) -> None:
    """Rows the batch did not look up are bitwise unchanged; the rows it did look up all moved."""
    for name, ids, n in (("user", users, N_USERS), ("item", items, N_ITEMS)):
        touched = np.isin(np.arange(n), np.asarray(ids))
        b, a = np.asarray(before[name]), np.asarray(after[name])
        np.testing.assert_array_equal(a[~touched], b[~touched])
        assert np.all(np.any(a[touched] != b[touched], axis=1))


def test_nnx_optimizer_lazy_dense_trains_and_leaves_untouched_rows() -> None:
    model, optimizer, train_step = nnx_lazy_trainer()
    losses = []
    for i, (users, items, y) in enumerate(EPOCHS * make_batches(10)):
        before = nnx_tables(nnx.state(model, nnx.Param))
        before_mu = nnx_tables(nnx.as_pure(optimizer.opt_state)[0].mu)
        before_nu = nnx_tables(nnx.as_pure(optimizer.opt_state)[0].nu)
        losses.append(float(train_step(model, optimizer, users, items, y)))
        if i in (0, 1, 39):
            check_untouched(before, nnx_tables(nnx.state(model, nnx.Param)), users, items)
            check_untouched(before_mu, nnx_tables(nnx.as_pure(optimizer.opt_state)[0].mu), users, items)
            check_untouched(before_nu, nnx_tables(nnx.as_pure(optimizer.opt_state)[0].nu), users, items)
    assert_trained(losses)


def test_nnx_fast_path_trains_and_leaves_untouched_rows() -> None:
    _, params, opt_state, train_step = nnx_fast_trainer()
    losses = []
    for i, (users, items, y) in enumerate(EPOCHS * make_batches(10)):
        before, before_mu = nnx_tables(params), nnx_tables(opt_state[0].mu)
        params, opt_state, loss = train_step(params, opt_state, users, items, y)
        losses.append(float(loss))
        if i in (0, 1, 39):
            check_untouched(before, nnx_tables(params), users, items)
            check_untouched(before_mu, nnx_tables(opt_state[0].mu), users, items)
    assert_trained(losses)


def test_nnx_optimizer_takes_row_gradients() -> None:
    """``nnx.Optimizer.update`` applies ``IndexedRows`` updates as they are (they add into the tables' rows)."""
    model = NnxRecommender(N_USERS, N_ITEMS, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, osa.sparse_adam(LR), wrt=nnx.Param)
    _, params, opt_state, fast_step = nnx_fast_trainer()

    @nnx.jit
    def train_step(model: NnxRecommender, optimizer: nnx.Optimizer, users: Any, items: Any, y: Any) -> jax.Array:
        graphdef, params = nnx.split(model, nnx.Param)

        def loss_fn(p: Any, ids: tuple[jax.Array, jax.Array]) -> jax.Array:
            return jnp.mean((nnx.merge(graphdef, p)(*ids) - y) ** 2)

        loss, grads = osa.value_and_row_grad(loss_fn, lambda p: (p["user"], p["item"]))(params, (users, items))
        optimizer.update(model, grads)
        return loss

    for i, (users, items, y) in enumerate(make_batches(10)):
        # Each step from the same parameters and state (copies: the fast step donates them), so that the
        # comparison is of one step, not of ten steps' drift.
        held = (nnx.state(model, nnx.Param), nnx.as_pure(optimizer.opt_state))
        leaves = [jnp.copy(x) for x in jax.tree.leaves(held)]
        assert len(leaves) == jax.tree.structure((params, opt_state)).num_leaves
        params, opt_state = jax.tree.unflatten(jax.tree.structure((params, opt_state)), leaves)
        before = nnx_tables(nnx.state(model, nnx.Param))
        loss = train_step(model, optimizer, users, items, y)
        params, opt_state, fast_loss = fast_step(params, opt_state, users, items, y)
        np.testing.assert_array_equal(loss, fast_loss)
        if i == 0:
            check_untouched(before, nnx_tables(nnx.state(model, nnx.Param)), users, items)
        # The two calls against update_and_apply: the same updates, each parameter within one rounding of it and
        # two ulps of an update (at most LR in size). XLA:CPU may contract a dense layer's p + u into its update in
        # one program and not the other (on the XLA path; on the kernels the two are bitwise equal).
        got = nnx.state(model, nnx.Param)
        assert jax.tree.structure(got) == jax.tree.structure(params)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(params), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2**-23, atol=LR * 2**-22)


def test_nnx_fast_path_with_padding_ids() -> None:
    """A batch of fixed capacity padded with ``-1``: padding looks up zeros and moves nothing."""
    _, params, opt_state, train_step = nnx_fast_trainer()
    users, items, y = make_batches(1)[0]
    users, items = users.at[::4].set(-1), items.at[1::4].set(N_ITEMS)
    before, before_nu = nnx_tables(params), nnx_tables(opt_state[0].nu)
    params, opt_state, loss = train_step(params, opt_state, users, items, y)
    assert np.isfinite(loss)
    check_untouched(before, nnx_tables(params), users, items)
    check_untouched(before_nu, nnx_tables(opt_state[0].nu), users, items)


def test_nnx_both_paths_train_to_the_same_loss() -> None:
    model, optimizer, lazy_step = nnx_lazy_trainer()
    graphdef, params, opt_state, fast_step = nnx_fast_trainer()
    for users, items, y in make_batches(40, seed=1):
        lazy_loss = lazy_step(model, optimizer, users, items, y)
        params, opt_state, fast_loss = fast_step(params, opt_state, users, items, y)
        np.testing.assert_allclose(fast_loss, lazy_loss, rtol=1e-4)
    lazy_params = nnx.state(model, nnx.Param)
    assert_trees_equal(params, lazy_params, rtol=1e-4, atol=1e-5)
    # The trained state merges back into a model as usual.
    users, items, _ = make_batches(1, seed=2)[0]
    np.testing.assert_allclose(nnx.merge(graphdef, params)(users, items), model(users, items), rtol=1e-4, atol=1e-5)


def test_nnx_fast_path_builds_no_table_sized_gradient() -> None:
    graphdef, params, _, _ = nnx_fast_trainer()
    users, items, y = make_batches(1)[0]

    def loss_fn(p: Any, ids: tuple[jax.Array, jax.Array]) -> jax.Array:
        return jnp.mean((nnx.merge(graphdef, p)(*ids) - y) ** 2)

    row_grad = osa.value_and_row_grad(loss_fn, lambda p: (p["user"], p["item"]))
    assert table_sized(all_shapes(jax.make_jaxpr(row_grad)(params, (users, items)).jaxpr)) == []
    # The check can see one: differentiating the whole table builds its gradient.
    dense_grad = jax.value_and_grad(lambda p: loss_fn(p, (users, items)))
    assert (N_USERS, FEATURES) in table_sized(all_shapes(jax.make_jaxpr(dense_grad)(params).jaxpr))


def test_nnx_fast_step_needs_no_table_sized_scratch_memory() -> None:
    # Compiled for a model too large to train here: the shapes are all it needs.
    n_users, n_items = 200_000, 300_000
    model = nnx.eval_shape(lambda: NnxRecommender(n_users, n_items, rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(model, nnx.Param)
    users, items, y = make_batches(1)[0]
    table_bytes = n_users * FEATURES * 4

    def scratch_bytes(train_step: Any, tx: optax.GradientTransformation) -> int:
        # Parameters and state donated: the tables and moments are updated in place.
        step = jax.jit(train_step, donate_argnums=(0, 1))
        compiled = step.lower(params, jax.eval_shape(tx.init, params), users, items, y).compile()
        stats = compiled.memory_analysis()
        assert stats is not None
        return int(stats.temp_size_in_bytes)

    assert scratch_bytes(nnx_fast_step(graphdef, osa.sparse_adam(LR)), osa.sparse_adam(LR)) < table_bytes / 100

    lazy_tx = osa.sparse_adam(LR, lazy_dense=embedding_tables)

    def dense_step(params: Any, opt_state: Any, users: Any, items: Any, y: Any) -> tuple[Any, Any, jax.Array]:
        def loss_fn(p: Any) -> jax.Array:
            return jnp.mean((nnx.merge(graphdef, p)(users, items) - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = lazy_tx.update(grads, opt_state, params)
        return osa.apply_updates(params, updates), opt_state, loss

    # The same measure sees the dense gradients of the lazy path.
    assert scratch_bytes(dense_step, lazy_tx) > table_bytes


# --------------------------------------------------------------------------------------------------------------------
# flax.linen with TrainState


class LinenRecommender(nn.Module):
    n_users: int
    n_items: int

    @nn.compact
    def __call__(self, users: jax.Array, items: jax.Array) -> jax.Array:
        user = nn.Embed(self.n_users, FEATURES, name="user")(users)
        item = nn.Embed(self.n_items, FEATURES, name="item")(items)
        x = jax.nn.gelu(nn.Dense(HIDDEN)(jnp.concatenate([user, item], axis=-1)))
        return nn.Dense(1)(x)[..., 0]


LINEN_MODEL = LinenRecommender(N_USERS, N_ITEMS)


def linen_state(cls: type[train_state.TrainState], tx: optax.GradientTransformation) -> Any:
    ids = jnp.zeros((1,), jnp.int32)
    params = LINEN_MODEL.init(jax.random.key(0), ids, ids)["params"]
    state = cls.create(apply_fn=LINEN_MODEL.apply, params=params, tx=tx)
    # ``create`` sets ``step=0``, a Python int, which the second step would retrace for.
    return state.replace(step=jnp.zeros((), jnp.int32))


def linen_lazy_step() -> Any:
    """The dense path: ``jax.value_and_grad`` and the stock ``TrainState.apply_gradients``."""

    def train_step(state: train_state.TrainState, users: Any, items: Any, y: Any) -> tuple[Any, jax.Array]:
        def loss_fn(params: Any) -> jax.Array:
            return jnp.mean((state.apply_fn({"params": params}, users, items) - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    return jit_once(train_step)


def linen_predict(model: LinenRecommender, params: Any, users: jax.Array, items: jax.Array) -> jax.Array:
    return cast(jax.Array, model.apply({"params": params}, users, items))


def linen_loss(params: Any, ids: tuple[jax.Array, jax.Array], y: jax.Array) -> jax.Array:
    # linen checks each parameter's shape against the module's attributes, so
    # the fast path applies a clone whose tables have the rows' sizes.
    model = LINEN_MODEL.clone(
        n_users=params["user"]["embedding"].shape[0], n_items=params["item"]["embedding"].shape[0]
    )
    return jnp.mean((linen_predict(model, params, *ids) - y) ** 2)


def linen_fast_step() -> Any:
    """The fast path: row gradients and the stock ``TrainState.apply_gradients`` (``IndexedRows`` add into tables)."""

    def train_step(state: train_state.TrainState, users: Any, items: Any, y: Any) -> tuple[Any, jax.Array]:
        row_grad = osa.value_and_row_grad(linen_loss, lambda p: (p["user"], p["item"]))
        loss, grads = row_grad(state.params, (users, items), y)
        return state.apply_gradients(grads=grads), loss

    return jit_once(train_step)


def linen_tables(tree: Any) -> dict[str, jax.Array]:
    return {k: tree[k]["embedding"] for k in ("user", "item")}


@pytest.mark.parametrize("fast", [False, True], ids=["lazy_dense", "fast_path"])
def test_linen_train_state_trains_and_leaves_untouched_rows(fast: bool) -> None:
    if fast:
        state, train_step = linen_state(train_state.TrainState, osa.sparse_adam(LR)), linen_fast_step()
    else:
        tx = osa.sparse_adam(LR, lazy_dense=embedding_tables)
        state, train_step = linen_state(train_state.TrainState, tx), linen_lazy_step()
    losses = []
    for i, (users, items, y) in enumerate(EPOCHS * make_batches(10)):
        before, before_mu = linen_tables(state.params), linen_tables(state.opt_state[0].mu)
        before_nu = linen_tables(state.opt_state[0].nu)
        state, loss = train_step(state, users, items, y)
        losses.append(float(loss))
        if i in (0, 39):
            check_untouched(before, linen_tables(state.params), users, items)
            check_untouched(before_mu, linen_tables(state.opt_state[0].mu), users, items)
            check_untouched(before_nu, linen_tables(state.opt_state[0].nu), users, items)
    assert int(state.step) == len(losses)
    assert_trained(losses)


def test_linen_both_paths_train_to_the_same_loss() -> None:
    lazy = linen_state(train_state.TrainState, osa.sparse_adam(LR, lazy_dense=embedding_tables))
    fast = linen_state(train_state.TrainState, osa.sparse_adam(LR))
    lazy_step, fast_step = linen_lazy_step(), linen_fast_step()
    for users, items, y in make_batches(40, seed=1):
        lazy, lazy_loss = lazy_step(lazy, users, items, y)
        fast, fast_loss = fast_step(fast, users, items, y)
        np.testing.assert_allclose(fast_loss, lazy_loss, rtol=1e-4)
    assert_trees_equal(fast.params, lazy.params, rtol=1e-4, atol=1e-5)


def test_linen_fast_path_builds_no_table_sized_gradient() -> None:
    params = linen_state(train_state.TrainState, osa.sparse_adam(LR)).params
    users, items, y = make_batches(1)[0]
    row_grad = osa.value_and_row_grad(linen_loss, lambda p: (p["user"], p["item"]))
    assert table_sized(all_shapes(jax.make_jaxpr(row_grad)(params, (users, items), y).jaxpr)) == []
    dense_grad = jax.value_and_grad(lambda p: jnp.mean((linen_predict(LINEN_MODEL, p, users, items) - y) ** 2))
    assert (N_USERS, FEATURES) in table_sized(all_shapes(jax.make_jaxpr(dense_grad)(params).jaxpr))


# --------------------------------------------------------------------------------------------------------------------
# padding on the lazy path


def test_lazy_path_pads_safely_with_a_masked_valid_id():
    """On the lazy path -1 is not padding (nnx.Embed takes it as the last row): pad with a valid id and a zero
    weight instead, and no row but the real ids moves (the fast path takes -1 as padding)."""
    model = nnx.Embed(10, 3, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    tx = osa.sparse_adam(0.1, lazy_dense=True)
    ids = jnp.array([2, 5, -1], jnp.int32)

    def loss(params, ids, weights):
        return jnp.sum(nnx.merge(graphdef, params)(ids).sum(axis=1) * weights)

    def moved(ids, weights):
        grads = jax.grad(loss)(params, ids, weights)
        updates, _ = tx.update(grads, tx.init(params), params)
        new = osa.apply_updates(params, updates)
        diff = jax.tree.leaves(jax.tree.map(lambda a, b: np.any(a != b, axis=1), new, params))[0]
        return list(np.flatnonzero(diff))

    safe = jnp.where(ids >= 0, ids, 0)
    assert moved(safe, (ids >= 0).astype(jnp.float32)) == [2, 5]
