"""Row gradients (``_row_grad.py``): ``lookup`` and ``value_and_row_grad`` against ``jax.grad`` of the dense loss,
and the checks that keep the fast path from silently dropping a use of the whole table."""

from __future__ import annotations

import functools
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

    @jax.jit  # one compilation, not one dispatch per operation
    def run(table, ids, weights):
        lk = osa.lookup(table, ids)
        d_rows = jax.grad(lambda rows: jnp.sum(rows[lk.inverse] * weights).astype(jnp.float32))(lk.rows)
        grad = lk.grad(d_rows)
        dense = jax.grad(lambda t: jnp.sum(take_or_zero(t, ids) * weights).astype(jnp.float32))(table)
        return lk, lk.rows[lk.inverse], take_or_zero(table, ids), grad, grad.todense(), dense

    lk, gathered, want, grad, grad_dense, dense = run(table, ids, weights)
    np.testing.assert_array_equal(gathered, want)
    assert lk.rows.dtype == dtype and lk.inverse.shape == ids.shape and lk.inverse.dtype == jnp.int32
    assert grad.unique_indices and grad.values.dtype == dtype
    tol = {jnp.float32: 1e-6, jnp.bfloat16: 1e-2}[dtype]
    np.testing.assert_allclose(grad_dense.astype(jnp.float32), dense.astype(jnp.float32), rtol=tol, atol=tol)


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

    def loss(p: Any, ids: tuple[jax.Array, jax.Array], take: Any = jnp.take) -> tuple[jax.Array, jax.Array]:
        emb, emb_neg = take(p["emb"], ids[0], axis=0), take(p["emb"], ids[1], axis=0)
        value = jnp.sum(jnp.tanh(emb @ p["w"])) - jnp.sum(jnp.tanh(emb_neg @ p["w"]))
        return value, p["emb"].shape[0]

    # The reference reads padding ids as the fast path does: zero rows.
    dense_loss = functools.partial(loss, take=lambda t, i, axis: take_or_zero(t, i))

    @jax.jit  # both sides in one compilation, not one dispatch per operation
    def both(params, ids):
        # One table selected twice: looked up once with both arrays of ids.
        fast = osa.value_and_row_grad(loss, lambda p: (p["emb"], p["emb"]), has_aux=True)(params, ids)
        return fast, fast[1]["emb"].todense(), jax.value_and_grad(dense_loss, has_aux=True)(params, ids)

    ((value, aux), grads), emb_grad, ((ref_value, _), ref) = both(params, (pos, neg))
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    assert aux == pos.size + neg.size  # the fun saw the rows of both lookups in place of the table
    assert isinstance(grads["emb"], osa.IndexedRows) and grads["emb"].values.shape == (8, 4)
    np.testing.assert_allclose(emb_grad, ref["emb"], rtol=1e-6, atol=1e-7)
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
        rows = jax.lax.cond(p["w"][0] >= 0, lambda t: t[ids], lambda t: t[ids] * 2.0, p["emb"])
        return jnp.sum(inner(p["emb"], ids) @ p["w"]) + jnp.sum(rows) + jnp.sum(p["emb"][ids[2]])

    @jax.jit  # both sides in one compilation, not one dispatch per operation
    def both(params, ids):
        value, grads = osa.value_and_row_grad(loss, lambda p: p["emb"])(params, ids)
        return value, grads["emb"].todense(), jax.value_and_grad(loss)(params, ids)

    value, emb_grad, (ref_value, ref_grads) = both(params, _ids())
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    np.testing.assert_allclose(emb_grad, ref_grads["emb"], rtol=1e-6)


@pytest.mark.parametrize("tables", [lambda p: p["emb"] * 2, lambda p: p["emb"].T])
def test_fast_path_tables_must_select_leaves(tables):
    with pytest.raises(TypeError, match="`tables` must select leaves of params"):
        osa.value_and_row_grad(lambda p, ids: p["emb"][ids].sum(), tables)(_params(), _ids())


# --------------------------------------------------------------------------- the ids' positions only index rows


def _misuse_params():
    params = _params()
    params["bias"] = jnp.arange(N, dtype=jnp.float32)
    params["emb2"] = jnp.arange(N * D, dtype=jnp.float32).reshape(N, D)
    return params


def _rows(p: Any, ids: jax.Array) -> jax.Array:
    return p["emb"][ids] @ p["w"]


# Each loss gives a wrong value and wrong gradients on the positions the fast path hands `fun`; the guard names
# the use (the primitive) in its refusal.
POSITION_MISUSES = {
    "shift-by-one": (lambda p, ids: jnp.sum(p["emb"][ids + 1] @ p["w"]), "`add`"),
    "hashing-trick": (lambda p, ids: jnp.sum(p["emb"][ids % N] @ p["w"]), "`rem`"),
    "floor-divide": (lambda p, ids: jnp.sum(p["emb"][ids // 2] @ p["w"]), "`div`"),
    "times-zero": (lambda p, ids: jnp.sum(p["emb"][ids * 0] @ p["w"]), "`mul`"),
    "non-row-axis": (lambda p, ids: jnp.sum(p["emb"][:, ids]), "axis 1"),
    "padding-mask": (lambda p, ids: jnp.sum(_rows(p, ids) * (ids != 0)), "`ne`"),
    "mod-mask": (lambda p, ids: jnp.sum(jnp.where(ids % 3 == 0, _rows(p, ids), 0.0)), "`rem`"),
    "id-as-feature": (lambda p, ids: jnp.sum(_rows(p, ids) * ids.astype(jnp.float32)), "`convert_element_type`"),
    "per-id-bias": (lambda p, ids: jnp.sum(_rows(p, ids) + p["bias"][ids]), r"\['bias'\]"),
    "second-table": (lambda p, ids: jnp.sum(_rows(p, ids) + p["emb2"][ids] @ p["w"]), r"\['emb2'\]"),
    "scan-carry": (
        lambda p, ids: jax.lax.scan(lambda c, _: (c + 1, jnp.sum(p["emb"][c])), ids, None, length=2)[1].sum(),
        "`scan`",
    ),
}


@pytest.mark.parametrize("name", list(POSITION_MISUSES))
def test_fast_path_refuses_a_use_of_the_ids_other_than_indexing_rows(name):
    loss, use = POSITION_MISUSES[name]
    params = _misuse_params()
    with pytest.raises(ValueError, match=rf"value_and_row_grad: .*{use}") as refused:
        osa.value_and_row_grad(loss, lambda p: p["emb"])(params, _ids())
    assert "['emb']" in str(refused.value)
    with pytest.raises(ValueError, match=use):
        jax.jit(osa.value_and_row_grad(loss, lambda p: p["emb"]))(params, _ids())


def test_fast_path_refuses_ids_indexing_another_selected_table():
    params = _misuse_params()

    def loss(p, ids, other):
        return jnp.sum(p["emb"][ids[0]] @ p["w"]) + jnp.sum(p["emb2"][ids[other]] @ p["w"])

    both = lambda p: (p["emb"], p["emb2"])  # noqa: E731
    osa.value_and_row_grad(functools.partial(loss, other=1), both)(params, (_ids(), _ids()))  # each its own ids
    with pytest.raises(ValueError, match=r"ids for table \['emb'\] .*`gather` indexes table \['emb2'\] with them"):
        osa.value_and_row_grad(functools.partial(loss, other=0), both)(params, (_ids(), _ids()))


def test_fast_path_refuses_returning_the_positions_or_the_rows():
    params = _params()
    with pytest.raises(ValueError, match=r"ids for table \['emb'\] .*`fun` returns them"):
        osa.value_and_row_grad(lambda p, ids: (jnp.sum(p["emb"][ids]), ids), lambda p: p["emb"], has_aux=True)(
            params, _ids()
        )
    with pytest.raises(ValueError, match=r"table \['emb'\] other than by indexing it .*`fun` returns it"):
        osa.value_and_row_grad(lambda p, ids: (jnp.sum(p["emb"][ids]), p["emb"]), lambda p: p["emb"], has_aux=True)(
            params, _ids()
        )


def _sum_rows(p: Any, rows: jax.Array) -> jax.Array:
    return jnp.sum(jnp.tanh(rows @ p["w"]))


# Uses of the ids that the fast path accepts: each gives what `jax.value_and_grad` gives on the whole table.
ACCEPTED = {
    "getitem": lambda p, ids: _sum_rows(p, p["emb"][ids]),
    "take": lambda p, ids: _sum_rows(p, jnp.take(p["emb"], ids, axis=0)),
    "take-clip": lambda p, ids: _sum_rows(p, jnp.take(p["emb"], ids, axis=0, mode="clip")),
    "get-fill": lambda p, ids: _sum_rows(p, p["emb"].at[ids].get(mode="fill", fill_value=0.0)),
    "reshape": lambda p, ids: _sum_rows(p, p["emb"][jnp.reshape(ids, (-1,))]),
    "transpose": lambda p, ids: _sum_rows(p, p["emb"][ids.T]),
    "narrow-cast": lambda p, ids: _sum_rows(p, p["emb"][ids.astype(jnp.int16)]),
    "one-column": lambda p, ids: jnp.sum(jnp.tanh(p["emb"][ids, 1])),
    "some-columns": lambda p, ids: jnp.sum(jnp.tanh(p["emb"][ids, :2])),
    "one-id": lambda p, ids: _sum_rows(p, p["emb"][ids[1, 2]]),
    "concatenated": lambda p, ids: _sum_rows(p, p["emb"][jnp.concatenate([ids[0], ids[2]])]),
    "under-jit": lambda p, ids: _sum_rows(p, jax.jit(lambda t, i: t[i])(p["emb"], ids)),
    "scan-over-ids": lambda p, ids: jax.lax.scan(lambda c, i: (c + _sum_rows(p, p["emb"][i]), None), 0.0, ids)[0],
    "remat": lambda p, ids: jax.checkpoint(lambda t, i: _sum_rows(p, t[i]))(p["emb"], ids),
}


@pytest.mark.parametrize("name", list(ACCEPTED))
def test_fast_path_accepts_indexing_rows_with_the_ids(name):
    loss = ACCEPTED[name]
    params = _params()
    ids = jnp.array([[1, 4, 4, 9], [-1, 0, 4, 12], [9, 9, 3, -1]], jnp.int32)  # (B, L), with padding ids

    # The reference reads padding ids as the fast path does: a zero row appended to the table.
    def dense(p: Any) -> jax.Array:
        padded = {**p, "emb": jnp.concatenate([p["emb"], jnp.zeros((1, D), jnp.float32)])}
        return loss(padded, jnp.where((ids >= 0) & (ids < N), ids, N))

    @jax.jit  # both sides in one compilation, not one dispatch per operation
    def both(params, ids):
        value, grads = osa.value_and_row_grad(loss, lambda p: p["emb"])(params, ids)
        return value, grads, grads["emb"].todense(), jax.value_and_grad(dense)(params)

    value, grads, emb_grad, (ref_value, ref) = both(params, ids)
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    assert isinstance(grads["emb"], osa.IndexedRows)
    np.testing.assert_allclose(emb_grad, ref["emb"], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(grads["w"], ref["w"], rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------- wide ids are padding, never wrapped


@pytest.mark.parametrize(
    "ids", [np.array([2**32 + 5, 3, -(2**32) + 3], np.int64), np.array([2**32 + 5, 3, 2**63 + 5], np.uint64)]
)
def test_wide_numpy_ids_without_x64_are_padding(ids):
    assert not jax.config.read("jax_enable_x64")
    table = jnp.arange(20, dtype=jnp.float32).reshape(10, 2)
    lk = osa.lookup(table, ids)  # jnp.asarray would wrap 2**32 + 5 onto row 5
    np.testing.assert_array_equal(lk.rows[lk.inverse], np.array([[0, 0], [6, 7], [0, 0]], np.float32))
    _, grads = osa.value_and_row_grad(lambda p, i: jnp.sum(p["emb"][i]), lambda p: p["emb"])({"emb": table}, ids)
    np.testing.assert_array_equal(grads["emb"].todense()[:, 0], np.eye(10, dtype=np.float32)[3])


def test_wide_ids_with_x64_are_padding_in_their_own_dtype():
    from optax_sparse_adam._coalesce import distinct_ids

    with jax.enable_x64(True):
        ids = jnp.array([2**32 + 5, -(2**32) + 3, 5, 2**32 + 5], jnp.int64)
        indices, inverse = distinct_ids(ids, 10)
        np.testing.assert_array_equal(indices, np.array([5, 10, 10, 10], np.int32))
        np.testing.assert_array_equal(inverse, np.array([3, 3, 0, 3], np.int32))
        table = jnp.arange(20, dtype=jnp.float32).reshape(10, 2)
        lk = osa.lookup(table, np.asarray(ids))
        np.testing.assert_array_equal(lk.rows[lk.inverse], np.array([[0, 0], [0, 0], [10, 11], [0, 0]], np.float32))
