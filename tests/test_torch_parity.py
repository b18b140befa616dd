"""Parity with the real torch optimizers: ``torch.optim.SparseAdam`` and ``Adam`` (``eps_placement="torch"``), and
``Adagrad`` for the row-wise Adagrad on width-1 tables."""

from __future__ import annotations

import functools

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
    update = jax.jit(tx.update)  # every batch padded to 7 entries: one compilation
    for _ in range(8):
        k = int(rng.integers(1, 7))
        idx = np.concatenate([rng.integers(0, n, size=k), [-1] * (7 - k)]).astype(np.int32)
        vals = rng.standard_normal((7, 1)).astype(np.float32)
        g = osa.IndexedRows(jnp.asarray(idx), jnp.asarray(vals), n)
        u, s = update(g, s, p)
        p = osa.apply_updates(p, u)
        t_opt.zero_grad()
        t_param.grad = torch.tensor(np.asarray(g.todense()))
        t_opt.step()
    np.testing.assert_allclose(p, t_param.detach().numpy(), rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------- torch's own sparse Rosenbrock test

# torch's TestCase.assertEqual tolerance for float32 (torch.testing.assert_close's defaults).
TORCH_RTOL, TORCH_ATOL = 1.3e-6, 1e-5


def _rosenbrock(p: torch.Tensor) -> torch.Tensor:
    x, y = p
    return (1 - x) ** 2 + 100 * (y - x**2) ** 2


def _drosenbrock(p: torch.Tensor) -> torch.Tensor:
    x, y = p
    return torch.tensor((-400 * x * (y - x**2) - 2 * (1 - x), 200 * (y - x**2)))


def _rosenbrock_sparse_grads(param: torch.Tensor, w: int) -> tuple[list[int], torch.Tensor]:
    """The uncoalesced gradient of torch's ``_test_rosenbrock_sparse``: one coordinate, split in two entries."""
    grad = _drosenbrock(param.detach())
    if w:
        x = grad[0]
        return [0, 0], torch.stack([x / 4.0, x - x / 4.0])
    y = grad[1]
    return [1, 1], torch.stack([y - y / 4.0, y / 4.0])


@functools.cache
def _torch_rosenbrock(maximize: bool, steps: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """torch's side of ``test_sparse_adam`` (the same on both kernel paths, so run once): cyclic coordinate descent
    on the Rosenbrock function with ``SparseAdam(lr=4e-2)``; returns each step's ids, values and torch's parameters
    after it, once torch's own end condition holds."""
    param = torch.nn.Parameter(torch.tensor([1.5, 1.5]))
    topt = torch.optim.SparseAdam([param], lr=4e-2, maximize=maximize)
    ids, grads, expected = [], [], []
    for i in range(steps):
        idx, values = _rosenbrock_sparse_grads(param, i % 2)
        param.grad = torch.sparse_coo_tensor(torch.tensor([idx]), values, (2,), check_invariants=True)
        topt.step()
        ids.append(idx)
        grads.append(values.numpy())
        expected.append(param.detach().numpy().copy())
    # torch's own end condition
    init = torch.tensor([1.5, 1.5])
    if maximize:
        assert _rosenbrock(param.detach()) >= _rosenbrock(init)
    else:
        assert torch.dist(param.detach(), torch.ones(2)) <= torch.dist(init, torch.ones(2))
    return np.array(ids, np.int32), np.stack(grads), np.stack(expected)


def _rosenbrock_ratio(tx, maximize: bool, steps: int = 2000) -> float:
    """Port of torch's ``test_sparse_adam``: torch's gradients fed to ``tx`` too, step after step (one jitted scan);
    returns the largest ``|p - p_torch|`` over all steps, in units of torch's own float32 tolerance."""
    ids, grads, expected = _torch_rosenbrock(maximize, steps)

    @jax.jit
    def run(p, state, ids, grads):
        def step(carry, batch):
            p, state = carry
            updates, state = tx.update(osa.IndexedRows(batch[0], batch[1], 2), state, p)
            p = osa.apply_updates(p, updates)
            return (p, state), p

        return jax.lax.scan(step, (p, state), (ids, grads))[1]

    p = jnp.asarray([1.5, 1.5], jnp.float32)
    got = np.asarray(run(p, tx.init(p), jnp.asarray(ids), jnp.asarray(grads)))
    assert got.shape == expected.shape == (steps, 2)
    tolerance = TORCH_ATOL + TORCH_RTOL * np.abs(expected)
    return float(np.max(np.abs(got - expected) / tolerance))


@pytest.mark.parametrize("maximize", [False, True])
def test_torch_sparse_rosenbrock_within_torchs_tolerance(maximize):
    """2000 steps of torch's sparse Rosenbrock test stay within torch's float32 tolerance of the real SparseAdam.

    With float32 bias corrections ``1 - b**t`` the step was ~1e-5 relative small and ``maximize`` drifted to 4.2x the
    tolerance (0.36x without); with torch's corrections the worst step is at 0.44x (0.18x).
    """
    tx = osa.sparse_adam(4e-2, maximize=maximize, eps_placement="torch")
    assert _rosenbrock_ratio(tx, maximize) <= 1.0


# --------------------------------------------------------------------------- a torch model: SparseAdam + Adam


class _Model(torch.nn.Module):
    """An embedding table with sparse gradients and a small MLP."""

    def __init__(self, num_rows: int, dim: int) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(num_rows, dim, sparse=True)
        self.fc1 = torch.nn.Linear(dim, 16)
        self.fc2 = torch.nn.Linear(16, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(self.emb(ids).sum(1)))).squeeze(-1)


@functools.cache
def _pair_step(kind: str, lr: float, eps: float, wd: float, path: str):
    """The library's side of the pair and its jitted step, built once per kernel path: torch's ``foreach`` changes
    torch's side only, so both of its values share one compilation."""
    if kind == "adam":
        tx = osa.sparse_adam(lr, eps=eps, eps_placement="torch")
    else:
        tx = osa.sparse_adamw(lr, eps=eps, weight_decay=wd, eps_placement="torch")

    @jax.jit
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return osa.apply_updates(params, updates), state

    return tx, step


@pytest.mark.parametrize("kind", ["adam", "adamw"])
@pytest.mark.parametrize("foreach", [None, True])
@pytest.mark.parametrize("eps", [1e-8, 1e-3])
def test_torch_pair_sparse_adam_and_adam(eps, foreach, kind):
    """One ``sparse_adam(eps_placement="torch")`` is torch's usual pair: ``SparseAdam`` for the table (sparse
    gradients), ``Adam`` for the dense layers, each placing ``eps`` its own way.

    With SparseAdam's rule on the dense layers too, they were off by 25x this tolerance at eps=1e-8 and 4e5x at
    eps=1e-3; now all parameters are within 0.2x of it. ``sparse_adamw(eps_placement="torch")`` is the pair with
    ``AdamW`` for the dense layers; torch has no sparse AdamW, so its table is ``SparseAdam`` after the decoupled
    decay of the rows the batch touched (``p_S *= 1 - lr * wd``), the lazy rule the library documents.
    """
    wd = 0.1
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    num_rows, dim, lr, steps = 50, 8, 0.01, 8
    model = _Model(num_rows, dim)
    dense = [p for name, p in model.named_parameters() if name != "emb.weight"]
    sparse_opt = torch.optim.SparseAdam([model.emb.weight], lr=lr, eps=eps)
    if kind == "adam":
        dense_opt = torch.optim.Adam(dense, lr=lr, eps=eps, foreach=foreach)
    else:
        dense_opt = torch.optim.AdamW(dense, lr=lr, eps=eps, weight_decay=wd, foreach=foreach)
    tx, step = _pair_step(kind, lr, eps, wd, osa.kernel_path())
    params = {name: jnp.asarray(p.detach().numpy()) for name, p in model.named_parameters()}
    state = tx.init(params)

    for _ in range(steps):
        ids = torch.tensor(rng.integers(0, num_rows, size=(16, 3)))
        target = torch.tensor(rng.standard_normal(16).astype(np.float32))
        sparse_opt.zero_grad()
        dense_opt.zero_grad()
        torch.nn.functional.mse_loss(model(ids), target).backward()
        grads = {}
        for name, p in model.named_parameters():
            if p.grad.is_sparse:  # uncoalesced, as autograd gives it
                g = p.grad
                grads[name] = osa.IndexedRows(
                    jnp.asarray(g._indices()[0].numpy().astype(np.int32)), jnp.asarray(g._values().numpy()), num_rows
                )
            else:
                grads[name] = jnp.asarray(p.grad.numpy())
        if kind == "adamw":
            with torch.no_grad():
                touched = model.emb.weight.grad.coalesce()._indices()[0]
                model.emb.weight[touched] *= 1 - lr * wd
        sparse_opt.step()
        dense_opt.step()
        params, state = step(params, state, grads)

    for name, p in model.named_parameters():
        np.testing.assert_allclose(params[name], p.detach().numpy(), rtol=1e-6, atol=1e-7, err_msg=name)
