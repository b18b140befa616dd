"""Row gradients (``_row_grad.py``): ``lookup`` and ``value_and_row_grad`` against ``jax.grad`` of the dense loss,
and the checks that keep the fast path from silently dropping a use of the whole table."""

from __future__ import annotations

from typing import Any

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

import optax_sparse_adam as osa

N, D = 10, 3


def _params():
    return {"emb": jnp.arange(N * D, dtype=jnp.float32).reshape(N, D) / 10 - 1, "w": jnp.ones((D,), jnp.float32)}


def take_or_zero(table: jax.Array, ids: jax.Array) -> jax.Array:
    """``table[ids]``, zero for out-of-range ids: the meaning ``lookup`` gives padding."""
    valid = _expand((ids >= 0) & (ids < table.shape[0]), ids.ndim + table.ndim - 1)
    return jnp.where(valid, table[jnp.clip(ids, 0, table.shape[0] - 1)], jnp.zeros((), table.dtype))


def _expand(mask: jax.Array, ndim: int) -> jax.Array:
    return mask.reshape(mask.shape + (1,) * (ndim - mask.ndim))


# --------------------------------------------------------------------------- lookup and value_and_row_grad


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_lookup_rows_and_grad_match_dense(dtype: Any) -> None:
    table = jax.random.normal(jax.random.key(0), (50, 3), dtype)
    ids = jnp.array([[4, 7, 4], [-1, 50, 7], [0, 4, 49]], jnp.int32)
    weights = jax.random.normal(jax.random.key(1), (3, 3, 3), dtype)
    lk = osa.lookup(table, ids)
    np.testing.assert_array_equal(lk.rows[lk.inverse], take_or_zero(table, ids))
    assert lk.rows.dtype == dtype and lk.inverse.shape == ids.shape and lk.inverse.dtype == jnp.int32

    d_rows = jax.grad(lambda rows: jnp.sum(rows[lk.inverse] * weights).astype(jnp.float32))(lk.rows)
    grad = lk.grad(d_rows)
    assert grad.unique_indices and grad.values.dtype == dtype
    dense = jax.grad(lambda t: jnp.sum(take_or_zero(t, ids) * weights).astype(jnp.float32))(table)
    tol = {jnp.float32: 1e-6, jnp.bfloat16: 1e-2}[dtype]
    np.testing.assert_allclose(grad.todense().astype(jnp.float32), dense.astype(jnp.float32), rtol=tol, atol=tol)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(-3, 12), min_size=1, max_size=16))
def test_lookup_keeps_the_unique_indices_invariants(ids_list: list[int]) -> None:
    num_rows = 10
    ids = jnp.asarray(np.array(ids_list + [-1] * (16 - len(ids_list)), np.int32))  # one capacity: one compile
    table = jnp.arange(num_rows * 2, dtype=jnp.float32).reshape(num_rows, 2)
    lk = jax.jit(osa.lookup)(table, ids)
    np.testing.assert_array_equal(lk.rows[lk.inverse], take_or_zero(table, ids))
    idx = np.asarray(lk.indices)
    in_range = idx[idx < num_rows]
    assert sorted(in_range) == sorted({i for i in ids_list if 0 <= i < num_rows})
    assert np.all((idx >= 0) & (idx <= num_rows))
    # Gradients of padding slots are zero even if the loss sends some there.
    grad = lk.grad(jnp.ones_like(lk.rows))
    np.testing.assert_array_equal(np.asarray(grad.values)[idx == num_rows], 0.0)
    touched = np.isin(np.arange(num_rows, dtype=np.int32), in_range)
    np.testing.assert_array_equal(grad.todense(), np.repeat(touched[:, None], 2, axis=1).astype(np.float32))


def test_lookup_takes_narrow_integer_ids() -> None:
    table = jnp.arange(600, dtype=jnp.float32).reshape(300, 2)
    lk = osa.lookup(table, jnp.array([7, 255, 7], jnp.uint8))
    np.testing.assert_array_equal(lk.rows[lk.inverse], table[jnp.array([7, 255, 7], jnp.int32)])


def test_value_and_row_grad_matches_jax_grad() -> None:
    params = {
        "emb": jax.random.normal(jax.random.key(0), (20, 4), jnp.float32),
        "w": jax.random.normal(jax.random.key(1), (4,), jnp.float32),
    }
    pos = jnp.array([1, 5, 5, -1], jnp.int32)
    neg = jnp.array([[5, 9], [2, 30]], jnp.int32)

    def loss(p: Any, ids: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        emb, emb_neg = take_or_zero(p["emb"], ids[0]), take_or_zero(p["emb"], ids[1])
        value = jnp.sum(jnp.tanh(emb @ p["w"])) - jnp.sum(jnp.tanh(emb_neg @ p["w"]))
        return value, p["emb"].shape[0]

    # One table selected twice: looked up once with both arrays of ids.
    (value, aux), grads = osa.value_and_row_grad(loss, lambda p: (p["emb"], p["emb"]), has_aux=True)(params, (pos, neg))
    (ref_value, _), ref = jax.value_and_grad(loss, has_aux=True)(params, (pos, neg))
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    assert aux == pos.size + neg.size  # the fun saw the rows of both lookups in place of the table
    assert isinstance(grads["emb"], osa.IndexedRows) and grads["emb"].values.shape == (8, 4)
    np.testing.assert_allclose(grads["emb"].todense(), ref["emb"], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(grads["w"], ref["w"], rtol=1e-6)


def test_value_and_row_grad_rejects_bad_input() -> None:
    params = {"emb": jnp.zeros((5, 2), jnp.float32)}
    ids = jnp.array([1], jnp.int32)

    def loss(p: Any, ids: Any) -> jax.Array:
        return p["emb"].sum()

    with pytest.raises(ValueError, match="selected 1 table"):
        osa.value_and_row_grad(loss, lambda p: p["emb"])(params, (ids, ids))
    with pytest.raises(TypeError, match="must be integers"):
        osa.value_and_row_grad(loss, lambda p: p["emb"])(params, jnp.array([1.0], jnp.float32))
    with pytest.raises(TypeError, match="must select leaves"):
        osa.value_and_row_grad(loss, lambda p: jnp.zeros((1,), jnp.float32))(params, ids)
    with pytest.raises(ValueError, match="at least one axis"):
        osa.value_and_row_grad(loss, lambda p: p["step"])({"step": jnp.zeros((), jnp.float32)}, ids)
    with pytest.raises(ValueError, match="d_rows has shape"):
        osa.lookup(params["emb"], ids).grad(jnp.zeros((2, 2), jnp.float32))


# --------------------------------------------------------------------------- the fast path reads rows, not tables


def _ids():
    return jnp.array([1, 4, 4, 9], jnp.int32)


@pytest.mark.parametrize(
    ("loss", "how"),
    [
        (lambda p, ids: jnp.sum(p["emb"][ids] @ p["w"]) + 0.1 * jnp.sum(p["emb"] ** 2), "integer_pow"),
        (lambda p, ids: jnp.sum(jax.nn.log_softmax(p["emb"][ids] @ p["emb"].T)), "transpose"),
        (lambda p, ids: jnp.sum(p["emb"][0] * p["w"]), "`slice` reads it"),
        (lambda p, ids: jnp.sum(p["emb"][jnp.arange(3)] @ p["w"]), "do not come from the ids"),
        (lambda p, ids: jax.lax.cond(True, lambda t: jnp.sum(t * 2.0), lambda t: jnp.sum(t), p["emb"]), "reduce_sum"),
    ],
    ids=["l2-penalty", "tied-output-embedding", "constant-row", "arange-rows", "inside-cond"],
)
def test_fast_path_refuses_a_loss_that_reads_the_whole_table(loss, how):
    params = _params()
    with pytest.raises(ValueError, match=rf"table \['emb'\] other than by indexing it with the ids.*{how}"):
        osa.value_and_row_grad(loss, lambda p: p["emb"])(params, _ids())
    with pytest.raises(ValueError, match="other than by indexing"):
        jax.jit(osa.value_and_row_grad(loss, lambda p: p["emb"]))(params, _ids())


def test_fast_path_accepts_indexing_through_jit_take_cond_and_dtype_casts():
    params = _params()

    @jax.jit
    def inner(t, ids):
        return jnp.take(t.astype(jnp.float32), ids, axis=0)

    def loss(p, ids):
        rows = jax.lax.cond(ids[0] >= 0, lambda t: t[ids], lambda t: t[ids] * 2.0, p["emb"])
        return jnp.sum(inner(p["emb"], ids) @ p["w"]) + jnp.sum(rows) + jnp.sum(p["emb"][ids[2]])

    value, grads = osa.value_and_row_grad(loss, lambda p: p["emb"])(params, _ids())
    ref_value, ref_grads = jax.value_and_grad(loss)(params, _ids())
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    np.testing.assert_allclose(grads["emb"].todense(), ref_grads["emb"], rtol=1e-6)


@pytest.mark.parametrize("tables", [lambda p: p["emb"] * 2, lambda p: p["emb"].T])
def test_fast_path_tables_must_select_leaves(tables):
    with pytest.raises(TypeError, match="`tables` must select leaves of params"):
        osa.value_and_row_grad(lambda p, ids: p["emb"][ids].sum(), tables)(_params(), _ids())
