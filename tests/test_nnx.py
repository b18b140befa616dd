"""``optax_sparse_adam.nnx.EmbeddingBags`` against ``nnx.grad`` of the same model on whole tables."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import optax_sparse_adam as osa
from optax_sparse_adam.nnx import EmbeddingBags
from tests.helpers import ON_CPU, assert_trees_equal

COLL = osa.EmbeddingCollection(
    {"user": osa.TableSpec(300, 8), "item": osa.TableSpec(200, 8), "tag": osa.TableSpec(50, 4)},
    {
        "user": osa.FeatureSpec("user"),
        "history": osa.FeatureSpec("item", "mean"),
        "candidate": osa.FeatureSpec("item"),
        "tags": osa.FeatureSpec("tag", "sqrtn"),
    },
)


class Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.emb = EmbeddingBags(COLL, rngs=rngs)
        self.out = nnx.Linear(8 + 8 + 4, 1, rngs=rngs)

    def __call__(self, bags):
        f = self.emb(bags)
        x = jnp.concatenate([f["user"] * f["candidate"], f["history"], f["tags"]], axis=1)
        return self.out(x)[:, 0]


def _batch(rng: np.random.Generator, n: int = 16):
    return COLL.bags(
        {
            "user": rng.integers(0, 300, n).astype(np.int32),
            "history": rng.integers(-1, 200, (n, 10)).astype(np.int32),
            "candidate": rng.integers(0, 200, n).astype(np.int32),
            "tags": rng.integers(-1, 50, (n, 3)).astype(np.int32),
        }
    )


def _loss(model, bags, labels):
    return jnp.mean((model(bags) - labels) ** 2)


def test_row_gradients_and_a_step_equal_the_dense_model(kernel_path):
    rng = np.random.default_rng(0)
    model = Model(nnx.Rngs(0))
    batch, labels = _batch(rng), jnp.asarray(rng.standard_normal(16), jnp.float32)
    graphdef, params = nnx.split(model, nnx.Param)
    value, grads = osa.value_and_row_grad(
        lambda p, b: _loss(nnx.merge(graphdef, p), b, labels), lambda p: p["emb"]["stacks"]
    )(params, batch)
    want_value, want = nnx.value_and_grad(_loss)(model, batch, labels)
    np.testing.assert_allclose(value, want_value, rtol=1e-6)
    dense = jax.tree.map(lambda g: g.todense() if isinstance(g, osa.IndexedRows) else g, grads, is_leaf=osa.is_sparse)
    assert_trees_equal(nnx.state(dense), nnx.state(want), rtol=1e-5, atol=1e-7)

    # nnx.Optimizer takes the row gradients as they are; rows no bag read do not move.
    before = {name: model.emb.table(name) for name in ("user", "item", "tag")}
    optimizer = nnx.Optimizer(model, osa.sparse_adam(1e-2), wrt=nnx.Param)
    optimizer.update(model, grads)
    moved = np.flatnonzero(np.any(np.asarray(model.emb.table("user") != before["user"]), axis=1))
    assert set(moved) == set(np.asarray(batch["float32_8"].ids[:16]).tolist())


def test_fused_optimizer_equals_nnx_optimizer_and_runs_the_kernel(kernel_path):
    from optax_sparse_adam import nnx as osa_nnx

    rng = np.random.default_rng(1)
    models = [Model(nnx.Rngs(0)) for _ in range(2)]
    optimizers = [
        nnx.Optimizer(models[0], osa.sparse_adam(1e-2), wrt=nnx.Param),
        osa_nnx.Optimizer(models[1], osa.sparse_adam(1e-2), wrt=nnx.Param),
    ]

    @nnx.jit
    def step(model, optimizer, bags, labels):
        graphdef, params = nnx.split(model, nnx.Param)
        _, grads = osa.value_and_row_grad(
            lambda p, b: _loss(nnx.merge(graphdef, p), b, labels), lambda p: p["emb"]["stacks"]
        )(params, bags)
        optimizer.update(model, grads)

    for _ in range(3):
        batch, labels = _batch(rng), jnp.asarray(rng.standard_normal(16), jnp.float32)
        for model, optimizer in zip(models, optimizers, strict=True):
            step(model, optimizer, batch, labels)
    # update_and_apply's documented tolerance against the two calls (its docstring).
    assert_trees_equal(nnx.state(models[1]), nnx.state(models[0]), rtol=1e-6, atol=1e-7)
    assert_trees_equal(nnx.state(optimizers[1]), nnx.state(optimizers[0]), rtol=1e-6, atol=1e-7)
    assert int(optimizers[1].step[...]) == 3

    hlo = nnx.jit(step).lower(models[1], optimizers[1], _batch(rng), jnp.zeros(16, jnp.float32)).as_text()
    assert ("sparse_adam_apply" in hlo) == (kernel_path == "native-cpu")


def test_the_fused_step_through_cached_partial_equals_the_plain_call(kernel_path):
    """The Flax guide's loop: the step called through ``nnx.cached_partial`` (its graph walked once) updates the
    model and the optimizer in place as the plain ``nnx.jit`` call does: bitwise on the CPU; XLA:GPU compiles the two
    programs apart and contracts multiply-adds in each as it chooses, so there within a few float32 ulps."""
    from optax_sparse_adam import nnx as osa_nnx

    rng = np.random.default_rng(2)
    models = [Model(nnx.Rngs(0)) for _ in range(2)]
    optimizers = [osa_nnx.Optimizer(m, osa.sparse_adam(1e-2), wrt=nnx.Param) for m in models]

    @nnx.jit(donate_argnames=("model", "optimizer"))
    def step(model, optimizer, bags, labels):
        graphdef, params = nnx.split(model, nnx.Param)
        loss, grads = osa.value_and_row_grad(
            lambda p, b: _loss(nnx.merge(graphdef, p), b, labels), lambda p: p["emb"]["stacks"]
        )(params, bags)
        optimizer.update(model, grads)
        return loss

    cached = nnx.cached_partial(step, models[1], optimizers[1])
    tol = {} if ON_CPU else {"rtol": 1e-6, "atol": 1e-7}
    for _ in range(3):
        batch, labels = _batch(rng), jnp.asarray(rng.standard_normal(16), jnp.float32)
        assert_trees_equal(step(models[0], optimizers[0], batch, labels), cached(batch, labels), **tol)
    assert_trees_equal(nnx.state(models[1]), nnx.state(models[0]), **tol)
    assert_trees_equal(nnx.state(optimizers[1]), nnx.state(optimizers[0]), **tol)
    assert int(optimizers[1].step[...]) == 3


def test_catch_up_through_both_nnx_optimizers_trains_as_dense_adam(kernel_path):
    """The catch-up wiring the docs give for the Flax modules (the tables' optimizer as ``catch_up=``, the whole
    state as ``opt_state=``) on an nnx model: ``opt_state=optimizer.opt_state``, whose arrays nnx holds in
    ``OptVariable`` nodes where the parameters have ``Param`` nodes, trains as ``optax.adam`` on the dense model
    (each step's loss, and the model after ``catch_up``), through ``nnx.Optimizer`` and the fused one."""
    from optax_sparse_adam import nnx as osa_nnx

    rng = np.random.default_rng(2)
    tx = osa.sparse_adam(1e-2, catch_up=True)
    models = [Model(nnx.Rngs(0)) for _ in range(3)]
    optimizers = [
        nnx.Optimizer(models[0], optax.adam(1e-2), wrt=nnx.Param),
        nnx.Optimizer(models[1], tx, wrt=nnx.Param),
        osa_nnx.Optimizer(models[2], tx, wrt=nnx.Param),
    ]

    @nnx.jit
    def dense_step(model, optimizer, bags, labels):
        loss, grads = nnx.value_and_grad(_loss)(model, bags, labels)
        optimizer.update(model, grads)
        return loss

    @nnx.jit
    def step(model, optimizer, bags, labels):
        graphdef, params = nnx.split(model, nnx.Param)
        grad_fn = osa.value_and_row_grad(
            lambda p, b: _loss(nnx.merge(graphdef, p), b, labels), lambda p: p["emb"]["stacks"], catch_up=tx
        )
        loss, grads = grad_fn(params, bags, opt_state=optimizer.opt_state)
        optimizer.update(model, grads)
        return loss

    for _ in range(5):  # rows read, left idle, read again
        batch, labels = _batch(rng, 6), jnp.asarray(rng.standard_normal(6), jnp.float32)
        want = dense_step(models[0], optimizers[0], batch, labels)
        for model, optimizer in zip(models[1:], optimizers[1:], strict=True):
            np.testing.assert_allclose(step(model, optimizer, batch, labels), want, rtol=2e-5)
    want = nnx.state(models[0], nnx.Param)
    for model, optimizer in zip(models[1:], optimizers[1:], strict=True):
        params = nnx.state(model, nnx.Param)
        caught, _ = osa.catch_up(tx, nnx.as_pure(params), nnx.as_pure(optimizer.opt_state))
        assert_trees_equal(caught, nnx.as_pure(want), rtol=2e-5, atol=1e-6)
