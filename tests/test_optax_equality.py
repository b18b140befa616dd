"""Equal to ``optax.adam`` wherever every row is touched, for every gradient form."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.experimental import sparse as jsparse

import optax_sparse_adam as osa

TOL = 1e-6
N, D = 16, 3


def _all_rows_indexed(g: np.ndarray, rng: np.random.Generator) -> osa.IndexedRows:
    """Every row, shuffled, each split into two duplicate entries that sum to ``g``, plus padding."""
    n = g.shape[0]
    perm = rng.permutation(n)
    part = rng.standard_normal(g.shape).astype(np.float32)
    idx = np.concatenate([perm, perm, [-1, n]]).astype(np.int32)
    vals = np.concatenate([part[perm], (g - part)[perm], np.ones((2, *g.shape[1:]), np.float32)])
    return osa.IndexedRows(jnp.asarray(idx), jnp.asarray(vals), n)


def _all_entries_bcoo(g: np.ndarray, n_sparse: int) -> jsparse.BCOO:
    return jsparse.BCOO.fromdense(jnp.asarray(g), n_dense=g.ndim - n_sparse, nse=int(np.prod(g.shape[:n_sparse])))


def _run(tx, make_grad, steps=6, seed=0):
    rng, grad_rng = np.random.default_rng(seed), np.random.default_rng(seed + 1)
    params = {"emb": jnp.asarray(rng.standard_normal((N, D)), jnp.float32), "w": jnp.ones((D,), jnp.float32)}
    state = tx.init(params)
    for _ in range(steps):
        g = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in params.items()}
        g = {k: np.where(np.abs(x) < 1e-3, 1e-3, x).astype(np.float32) for k, x in g.items()}  # no exact zeros
        updates, state = jax.jit(tx.update)(make_grad(g, grad_rng), state, params)
        params = osa.apply_updates(params, updates)
    return params, state


def _assert_close(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=TOL, atol=TOL), a, b)


@pytest.mark.parametrize(
    ("name", "tx_kwargs", "make_grad"),
    [
        ("dense", {}, lambda g, rng: {k: jnp.asarray(v) for k, v in g.items()}),
        ("lazy_dense", {"lazy_dense": True}, lambda g, rng: {k: jnp.asarray(v) for k, v in g.items()}),
        ("indexed_rows", {}, lambda g, rng: {"emb": _all_rows_indexed(g["emb"], rng), "w": jnp.asarray(g["w"])}),
        ("bcoo_rows", {}, lambda g, rng: {"emb": _all_entries_bcoo(g["emb"], 1), "w": jnp.asarray(g["w"])}),
        ("bcoo_elements", {}, lambda g, rng: {"emb": _all_entries_bcoo(g["emb"], 2), "w": jnp.asarray(g["w"])}),
        (
            "mixed",
            {"lazy_dense": {"emb": False, "w": True}},
            lambda g, rng: {"emb": _all_rows_indexed(g["emb"], rng), "w": jnp.asarray(g["w"])},
        ),
    ],
)
def test_equals_optax_adam_when_every_row_is_touched(name, tx_kwargs, make_grad):
    ref_params, ref_state = _run(optax.adam(0.01), lambda g, rng: {k: jnp.asarray(v) for k, v in g.items()})
    params, state = _run(osa.sparse_adam(0.01, **tx_kwargs), make_grad)
    _assert_close(params, ref_params)
    _assert_close(state[0].mu, ref_state[0].mu)
    _assert_close(state[0].nu, ref_state[0].nu)
    assert state[0].count == ref_state[0].count


def test_dense_default_is_bitwise_optax_adam():
    """The default dense path runs optax's own arithmetic, so it is identical, not just close."""
    ref_params, ref_state = _run(optax.adam(0.01), lambda g, rng: {k: jnp.asarray(v) for k, v in g.items()})
    params, state = _run(osa.sparse_adam(0.01), lambda g, rng: {k: jnp.asarray(v) for k, v in g.items()})
    jax.tree.map(np.testing.assert_array_equal, (params, state[0]), (ref_params, ref_state[0]))


def test_state_is_optax_adam_state_and_tree_get_works():
    params = {"emb": jnp.zeros((N, D), jnp.float32)}
    state = osa.sparse_adam(0.1).init(params)
    ref = optax.adam(0.1).init(params)
    assert isinstance(state[0], optax.ScaleByAdamState)
    assert jax.tree.structure(state[0]) == jax.tree.structure(ref[0])
    mu = optax.tree.get(state, "mu")
    assert mu["emb"].shape == (N, D)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("mu_dtype", [None, jnp.float32])
def test_dense_dtypes_match_optax(dtype, mu_dtype):
    """Moments in optax's dtypes; values equal to optax's in the gradient's dtype, over several varied steps
    (after the first, updates are no longer about +-1, so low-precision arithmetic shows)."""
    params = {"w": jnp.linspace(-1, 1, 12, dtype=dtype).reshape(4, 3)}
    ref, tx = optax.scale_by_adam(mu_dtype=mu_dtype), osa.scale_by_sparse_adam(mu_dtype=mu_dtype)
    rs, s = ref.init(params), tx.init(params)
    for step in range(6):
        g = {"w": jnp.asarray(np.random.default_rng(step).standard_normal((4, 3)), dtype)}
        ru, rs = ref.update(g, rs, params)
        u, s = tx.update(g, s, params)
        assert u["w"].dtype == dtype  # updates in the gradient's dtype (optax promotes to mu_dtype)
        assert s.mu["w"].dtype == rs.mu["w"].dtype == (mu_dtype or dtype)
        assert s.nu["w"].dtype == rs.nu["w"].dtype == dtype
        chex.assert_trees_all_equal((u["w"], s.mu, s.nu), (ru["w"].astype(dtype), rs.mu, rs.nu))
    assert np.abs(np.asarray(u["w"], np.float32)).min() < 0.9  # not the first step's +-1 any more
