"""FBGEMM's TBE optimizer test for ``EXACT_ROWWISE_ADAGRAD`` (``fbgemm_gpu``'s
``test/tbe/training/backward_optimizers_test.py``), ported: its reference rule as a NumPy loop, with its weight decay
modes ``L2`` and ``DECOUPLE``, run for several steps against ``sparse_rowwise_adagrad``; and the real FBGEMM TBE
(``SplitTableBatchedEmbeddingBagsCodegen`` on the CPU) against the library on the same gradients."""

from __future__ import annotations

import functools
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optax_sparse_adam as osa

pytestmark = pytest.mark.usefixtures("kernel_path")

# The FBGEMM test's hyperparameters: (lr, eps, weight_decay) = (0.5, 1e-4, 0.01).
LR, EPS, WD = 0.5, 1e-4, 0.01

# Tables of different heights and widths, as the test's ``mixed`` tables (widths a multiple of 4 on the CPU).
TABLES = {"t0": (40, 8), "t1": (17, 4)}
B, MAX_L, STEPS = 6, 4, 6  # bags per table and step, most ids in a bag, steps
CAPACITY = B * MAX_L + 4  # the library's fixed number of entries per table: the rest is padding


class Bags(NamedTuple):
    """One table's batch: the bags' ids (``offsets`` into ``ids``), per-id weights, the upstream gradient of the
    pooled output, and what it makes: the gradient of each id's row (one entry per id, duplicates not summed)."""

    ids: np.ndarray
    offsets: np.ndarray
    weights: np.ndarray | None
    grad_out: np.ndarray
    entry_grads: np.ndarray


def _bags(rng: np.random.Generator, num_rows: int, dim: int, pooling: str) -> Bags:
    """Random bags of 0 to ``MAX_L`` ids, the first id of every nonempty bag the same one (the test's
    ``long_segments``: a long run of duplicates), and the gradient each id's row gets from pooling."""
    lengths = rng.integers(0, MAX_L + 1, size=B)
    lengths[0] = max(lengths[0], 2)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    ids = rng.integers(0, num_rows - 4, size=int(offsets[-1])).astype(np.int64)  # the last 4 rows: never looked up
    ids[offsets[:-1][lengths > 0]] = rng.integers(0, num_rows - 4)
    weights = rng.standard_normal(ids.size).astype(np.float32) if pooling == "weighted" else None
    grad_out = rng.standard_normal((B, dim)).astype(np.float32)
    bag = np.repeat(np.arange(B), lengths)
    entry_grads = grad_out[bag]
    if pooling == "mean":
        entry_grads = entry_grads / lengths[bag][:, None].astype(np.float32)
    elif pooling == "weighted":
        entry_grads = entry_grads * weights[:, None]
    return Bags(ids, offsets, weights, grad_out, entry_grads.astype(np.float32))


def _padded(ids: np.ndarray, values: np.ndarray, num_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Pads to ``CAPACITY`` entries: ids -1 and ``num_rows`` alternating, with nonzero values that must be ignored."""
    n = CAPACITY - ids.size
    pad_ids = np.where(np.arange(n) % 2 == 0, -1, num_rows)
    pad_values = np.full((n, values.shape[1]), 3.0, np.float32)
    return np.concatenate([ids, pad_ids]).astype(np.int32), np.concatenate([values, pad_values])


def reference_step(w: np.ndarray, acc: np.ndarray, ids: np.ndarray, values: np.ndarray, mode: str) -> set[int]:
    """FBGEMM's reference for ``EXACT_ROWWISE_ADAGRAD``, one step, in place, in float64: for each row the ids touch,
    with ``g`` its summed gradient, ``g += wd * w`` (``L2``), ``acc += mean(g**2)``, ``denom = sqrt(acc) + eps``, and
    ``w -= lr * g / denom`` (``NONE``, ``L2``) or ``w -= lr * (g / denom + wd * w)`` (``DECOUPLE``). Ids outside
    ``[0, rows)`` are padding. Returns the rows touched."""
    rows: dict[int, np.ndarray] = {}
    for i, v in zip(ids.tolist(), values.astype(np.float64), strict=True):
        if 0 <= i < w.shape[0]:
            rows[i] = rows.get(i, 0.0) + v
    for r, g in rows.items():
        if mode == "l2":
            g = g + WD * w[r]
        acc[r] += np.mean(g**2)
        denom = np.sqrt(acc[r]) + EPS
        if mode == "decoupled":
            w[r] = w[r] - LR * (g / denom + WD * w[r])
        else:
            w[r] = w[r] - LR * g / denom
    return set(rows)


@functools.cache
def _library(mode: str, path: str) -> tuple[Any, Any]:
    """``sparse_rowwise_adagrad`` with FBGEMM's weight decay mode, and its jitted step on a dict of tables (built
    once per kernel path: every batch is padded to the same shapes, so the tests share one compilation)."""
    if mode == "none":
        tx = osa.sparse_rowwise_adagrad(LR, eps=EPS)
    else:
        tx = osa.sparse_rowwise_adagrad(LR, eps=EPS, weight_decay=WD, weight_decay_mode=mode)

    @jax.jit
    def step(params, state, ids, values):
        grads = {name: osa.IndexedRows(ids[name], values[name], p.shape[0]) for name, p in params.items()}
        updates, state = tx.update(grads, state, params)
        return osa.apply_updates(params, updates), state

    return tx, step


# --------------------------------------------------------------------------- against FBGEMM's reference rule


@pytest.mark.parametrize("pooling", ["sum", "mean", "weighted"])
@pytest.mark.parametrize("mode", ["none", "l2", "decoupled"])
def test_matches_fbgemm_reference(mode, pooling):
    """Several steps over two tables, duplicate ids, empty bags, padding, and a row whose two entries cancel exactly
    (touched: it decays with ``L2`` and ``DECOUPLE``, and stays otherwise); the whole tables and the accumulators are
    compared with the float64 reference (float32 rounding: rtol 1e-5), untouched rows bitwise."""
    rng = np.random.default_rng([mode == "l2", mode == "decoupled", pooling == "mean", pooling == "weighted"])
    init = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in TABLES.items()}
    ref_w = {name: x.astype(np.float64) for name, x in init.items()}
    ref_acc = {name: np.zeros(shape[0]) for name, shape in TABLES.items()}
    touched: dict[str, set[int]] = {name: set() for name in TABLES}

    tx, step = _library(mode, osa.kernel_path())
    params = {name: jnp.asarray(x) for name, x in init.items()}
    state = tx.init(params)
    for t in range(STEPS):
        ids, values = {}, {}
        for name, (num_rows, dim) in TABLES.items():
            bags = _bags(rng, num_rows, dim, pooling)
            entry_ids, entry_grads = bags.ids, bags.entry_grads
            if t == 2:  # the last row, looked up nowhere else: two entries that cancel exactly
                entry_ids = np.concatenate([entry_ids, [num_rows - 1, num_rows - 1]])
                g = rng.standard_normal((1, dim)).astype(np.float32)
                entry_grads = np.concatenate([entry_grads, g, -g])
            touched[name] |= reference_step(ref_w[name], ref_acc[name], entry_ids, entry_grads, mode)
            ids[name], values[name] = _padded(entry_ids, entry_grads, num_rows)
        params, state = step(params, state, ids, values)

    acc = state[0].sum_of_squares
    for name, (num_rows, _) in TABLES.items():
        w, a = np.asarray(params[name]), np.asarray(acc[name])
        rest = slice(0, num_rows - 1)
        np.testing.assert_allclose(w[rest], ref_w[name][rest], rtol=1e-5, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(a[rest], ref_acc[name][rest], rtol=1e-5, atol=1e-7, err_msg=name)
        # The cancelling row. Under jit the L2 term is added before the duplicates cancel ((wd p + g) - g; eager and
        # FBGEMM: (g - g) + wd p), an error of float32 rounding of |g|, which w - lr g / denom, nearly cancelling
        # here, amplifies to ~1e-5 relative (3.7e-6 absolute measured).
        rtol, atol = (1e-4, 1e-5) if mode == "l2" else (1e-5, 1e-6)
        np.testing.assert_allclose(w[-1], ref_w[name][-1], rtol=rtol, atol=atol, err_msg=name)
        np.testing.assert_allclose(a[-1], ref_acc[name][-1], rtol=rtol, atol=1e-7, err_msg=name)
        assert (mode == "none") == np.array_equal(w[-1], init[name][-1])
        untouched = np.setdiff1d(np.arange(num_rows), sorted(touched[name]))
        assert untouched.size
        np.testing.assert_array_equal(w[untouched], init[name][untouched])
        np.testing.assert_array_equal(a[untouched], 0.0)


# --------------------------------------------------------------------------- against the real FBGEMM TBE


@pytest.mark.slow
@pytest.mark.parametrize("pooling", ["sum", "mean", "weighted"])
def test_matches_fbgemm_tbe(pooling):
    """FBGEMM's TBE on the CPU (its optimizer fused into the backward pass) and the library, fed the same bags and
    upstream gradients over several steps: tables and accumulators agree to rtol 1e-5 / atol 1e-6. Both compute in
    float32, but sum an id's duplicates and a row's squares in different orders, so they differ by a few float32
    roundings (measured: at most 2.4e-7 absolute on the weights, 2.5e-7 relative on the accumulators).

    Without weight decay: FBGEMM's CPU kernel ignores ``weight_decay`` for this optimizer (the FBGEMM test checks
    ``L2`` and ``DECOUPLE`` on the GPU only), so those modes are checked against its reference rule above.
    """
    with warnings.catch_warnings():  # fbgemm_gpu warns when an optional (SSD) op does not load
        warnings.filterwarnings("ignore", message=r"(?s).*Failed to import", category=DeprecationWarning)
        pytest.importorskip("fbgemm_gpu")
        import torch
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            SplitTableBatchedEmbeddingBagsCodegen,
        )

    torch.set_num_threads(1)
    rng = np.random.default_rng(["sum", "mean", "weighted"].index(pooling))
    init = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in TABLES.items()}
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(num_rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for num_rows, dim in TABLES.values()],
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=LR,
        eps=EPS,
        pooling_mode=PoolingMode.MEAN if pooling == "mean" else PoolingMode.SUM,
    )
    with torch.no_grad():
        for weight, x in zip(tbe.split_embedding_weights(), init.values(), strict=True):
            weight.copy_(torch.from_numpy(x))

    tx, step = _library("none", osa.kernel_path())
    params = {name: jnp.asarray(x) for name, x in init.items()}
    state = tx.init(params)
    for _ in range(STEPS):
        batch = {name: _bags(rng, num_rows, dim, pooling) for name, (num_rows, dim) in TABLES.items()}
        # TBE's layout: the bags of every table one after another, one offsets array over all of them.
        ids = np.concatenate([b.ids for b in batch.values()])
        starts = np.cumsum([0] + [b.ids.size for b in batch.values()])[:-1]
        offsets = np.concatenate([[0]] + [b.offsets[1:] + s for b, s in zip(batch.values(), starts, strict=True)])
        weights = np.concatenate([b.weights for b in batch.values()]) if pooling == "weighted" else None
        out = tbe(
            torch.from_numpy(ids),
            torch.from_numpy(offsets.astype(np.int64)),
            per_sample_weights=None if weights is None else torch.from_numpy(weights),
        )
        out.backward(torch.from_numpy(np.concatenate([b.grad_out for b in batch.values()], axis=1)))

        padded = {name: _padded(b.ids, b.entry_grads, TABLES[name][0]) for name, b in batch.items()}
        params, state = step(params, state, {n: p[0] for n, p in padded.items()}, {n: p[1] for n, p in padded.items()})

    fbgemm_weights = [w.detach().numpy() for w in tbe.split_embedding_weights()]
    fbgemm_acc = [s[0].numpy() for s in tbe.split_optimizer_states()]
    for name, w, acc in zip(TABLES, fbgemm_weights, fbgemm_acc, strict=True):
        assert not np.array_equal(w, init[name])
        np.testing.assert_allclose(params[name], w, rtol=1e-5, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(state[0].sum_of_squares[name], acc, rtol=1e-5, atol=1e-7, err_msg=name)
