"""Parity with the real torch optimizers: ``torch.optim.SparseAdam`` (``eps_placement="torch"``), and ``Adagrad`` for
the row-wise Adagrad on width-1 tables."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.experimental import sparse as jsparse

import optax_sparse_adam as osa

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("kernel_path")]  # every test on both paths

torch.set_num_threads(1)

RTOL, ATOL = 1e-5, 1e-7


def _batches(rng: np.random.Generator, shape: tuple[int, ...], n_sparse: int, steps: int, capacity: int):
    """Random sparse batches: duplicates, empty steps, and duplicates that sum to zero."""
    for step in range(steps):
        kind = step % 5
        n = 0 if kind == 3 else int(rng.integers(1, capacity - 2))
        keys = np.stack([rng.integers(0, shape[j], size=n) for j in range(n_sparse)], axis=1).astype(np.int64)
        if n and kind != 4:  # force duplicates: some entries repeat others
            dup = rng.integers(0, n, size=n // 2)
            keys[: n // 2] = keys[dup]
        values = rng.standard_normal((n, *shape[n_sparse:])).astype(np.float32)
        if kind == 4 and n:  # a key whose duplicates sum exactly to zero
            keys = np.concatenate([keys, keys[:1]])
            values = np.concatenate([values, -values[:1]])
        yield keys.reshape(-1, n_sparse), values


def _pad(keys: np.ndarray, values: np.ndarray, capacity: int, shape: tuple[int, ...]):
    """Pads to a fixed capacity with padding entries (-1 and out-of-range keys alternating)."""
    n, n_sparse = keys.shape
    pad_keys = np.where(np.arange(capacity - n)[:, None] % 2 == 0, -1, np.array(shape[:n_sparse]))
    pad_keys = np.broadcast_to(pad_keys, (capacity - n, n_sparse))
    pad_values = np.full((capacity - n, *values.shape[1:]), 7.0, np.float32)  # nonzero: must be ignored
    return (np.concatenate([keys, pad_keys]).astype(np.int32), np.concatenate([values, pad_values]))


@pytest.mark.parametrize("maximize", [False, True])
@pytest.mark.parametrize(
    ("shape", "n_sparse", "as_bcoo"),
    [
        ((20, 4), 1, False),  # rows of shape (D,), IndexedRows
        ((20, 4), 1, True),  # the same as a row BCOO
        ((15, 3, 2), 1, False),  # rows of shape (D1, D2)
        ((25,), 1, False),  # a 1-D parameter
        ((12, 5), 2, True),  # element-sparse
        ((6, 4, 3), 2, True),  # slices
    ],
)
def test_matches_torch_sparse_adam(shape, n_sparse, as_bcoo, maximize):
    rng = np.random.default_rng(hash((shape, n_sparse, as_bcoo, maximize)) % 2**32)
    lr, b1, b2, eps = 0.05, 0.8, 0.95, 1e-6
    init = rng.standard_normal(shape).astype(np.float32)
    capacity = 24

    tp = torch.nn.Parameter(torch.tensor(init))
    topt = torch.optim.SparseAdam([tp], lr=lr, betas=(b1, b2), eps=eps, maximize=maximize)

    tx = osa.sparse_adam(lr, b1, b2, eps, eps_placement="torch", maximize=maximize)
    params = {"w": jnp.asarray(init)}
    state = tx.init(params)

    @jax.jit
    def step(params, state, keys, values):
        g = jsparse.BCOO((values, keys), shape=shape) if as_bcoo else osa.IndexedRows(keys[:, 0], values, shape[0])
        updates, state = tx.update({"w": g}, state, params)
        return osa.apply_updates(params, updates), state

    for keys, values in _batches(rng, shape, n_sparse, steps=15, capacity=capacity):
        tp.grad = torch.sparse_coo_tensor(
            torch.tensor(keys.T.copy()).reshape(n_sparse, -1), torch.tensor(values), size=shape, check_invariants=True
        )
        topt.step()
        params, state = step(params, state, *map(jnp.asarray, _pad(keys, values, capacity, shape)))

    tstate = topt.state[tp]
    np.testing.assert_allclose(params["w"], tp.detach().numpy(), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(state[0].mu["w"], tstate["exp_avg"].numpy(), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(state[0].nu["w"], tstate["exp_avg_sq"].numpy(), rtol=RTOL, atol=ATOL)
    assert int(state[0].count) == int(tstate["step"])


def test_eps_placement_differs_measurably_when_v_is_small():
    """With tiny gradients v is tiny and where eps goes matters; torch matches only ``"torch"``."""
    init = np.ones((4, 2), np.float32)
    g = np.full((1, 2), 1e-7, np.float32)
    results = {}
    for placement in ("optax", "torch"):
        tx = osa.sparse_adam(0.1, eps=1e-8, eps_placement=placement)
        p = {"w": jnp.asarray(init)}
        s = tx.init(p)
        for _ in range(3):
            u, s = tx.update({"w": osa.IndexedRows(jnp.array([1], jnp.int32), jnp.asarray(g), 4)}, s, p)
            p = osa.apply_updates(p, u)
        results[placement] = np.asarray(p["w"])
    tp = torch.nn.Parameter(torch.tensor(init))
    topt = torch.optim.SparseAdam([tp], lr=0.1, eps=1e-8)
    for _ in range(3):
        tp.grad = torch.sparse_coo_tensor(torch.tensor([[1]]), torch.tensor(g), size=(4, 2), check_invariants=True)
        topt.step()
    np.testing.assert_allclose(results["torch"], tp.detach().numpy(), rtol=RTOL)
    assert np.max(np.abs(results["optax"] - results["torch"])) > 1e-3


def test_rowwise_adagrad_equals_torch_adagrad_on_width_1_tables():
    """Width 1: a row's mean square is its square, so the rule is Adagrad's; a zero gradient moves nothing."""
    rng = np.random.default_rng(1)
    n = 9
    init = rng.standard_normal((n, 1)).astype(np.float32)
    t_param = torch.nn.Parameter(torch.tensor(init))
    t_opt = torch.optim.Adagrad([t_param], lr=0.05, eps=1e-10)
    tx = osa.sparse_rowwise_adagrad(0.05)
    p = jnp.asarray(init)
    s = tx.init(p)
    for _ in range(8):
        k = int(rng.integers(1, 7))
        idx = np.concatenate([rng.integers(0, n, size=k), [-1]]).astype(np.int32)
        vals = rng.standard_normal((k + 1, 1)).astype(np.float32)
        g = osa.IndexedRows(jnp.asarray(idx), jnp.asarray(vals), n)
        u, s = tx.update(g, s, p)
        p = osa.apply_updates(p, u)
        t_opt.zero_grad()
        t_param.grad = torch.tensor(np.asarray(g.todense()))
        t_opt.step()
    np.testing.assert_allclose(p, t_param.detach().numpy(), rtol=1e-5, atol=1e-7)
