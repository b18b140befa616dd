"""``IndexedRows`` (``_indexed_rows.py``): its checks, its dense form and ``+`` on dense arrays, against NumPy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_sparse_adam as osa
from tests.helpers import assert_trees_equal

N, D = 10, 3


def test_num_rows_must_be_a_static_int_below_2_31():
    with pytest.raises(TypeError, match="num_rows must be a static Python int"):
        osa.IndexedRows(jnp.array([1]), jnp.ones((1, D), jnp.float32), jnp.asarray(N))
    with pytest.raises(ValueError, match=r"up to 2\*\*31 - 1 rows; split a larger table"):
        osa.IndexedRows(jnp.array([1]), jnp.ones((1, D), jnp.float32), 2**31)
    with pytest.raises(TypeError, match="unique_indices must be a bool"):
        osa.IndexedRows(jnp.array([1]), jnp.ones((1, D), jnp.float32), N, unique_indices=1)


def _numpy_dense(indices: np.ndarray, values: np.ndarray, num_rows: int) -> np.ndarray:
    dense = np.zeros((num_rows, *values.shape[1:]), values.dtype)
    for i, v in zip(indices, values, strict=True):
        if 0 <= i < num_rows:
            dense[i] += v
    return dense


@pytest.mark.parametrize("dtype", [np.int32, np.int8, np.uint16])
def test_todense_and_add_sum_duplicates_and_drop_padding(dtype):
    rng = np.random.default_rng(0)
    below = np.iinfo(dtype).max if dtype == np.uint16 else -1  # padding below the rows, or the dtype's largest
    indices = np.array([3, 7, 3, below, N, 0, 7, 3], dtype=dtype)
    values = rng.standard_normal((8, D)).astype(np.float32)
    rows = osa.IndexedRows(jnp.asarray(indices), jnp.asarray(values), N)
    assert rows.shape == (N, D) and rows.ndim == 2 and rows.dtype == jnp.float32
    want = _numpy_dense(indices.astype(np.int64), values, N)
    np.testing.assert_allclose(rows.todense(), want, rtol=1e-6)
    table = jnp.asarray(rng.standard_normal((N, D)), jnp.float32)
    for got in (table + rows, rows + table, np.asarray(table) + rows, optax.apply_updates(table, rows)):
        assert_trees_equal(jnp.asarray(got), jnp.asarray(np.asarray(table) + want), rtol=1e-6, atol=1e-6)


def test_is_a_pytree_with_static_num_rows_and_flag():
    rows = osa.IndexedRows(jnp.array([1, 2], jnp.int32), jnp.ones((2, D), jnp.float32), N, unique_indices=True)
    leaves, treedef = jax.tree.flatten(rows)
    assert len(leaves) == 2
    back = jax.tree.unflatten(treedef, leaves)
    assert back.num_rows == N and back.unique_indices is True
    doubled = jax.jit(lambda r: jax.tree.map(lambda x: x * 2, r))(rows)
    assert isinstance(doubled, osa.IndexedRows) and doubled.num_rows == N
    assert osa.is_sparse(rows) and not osa.is_sparse(rows.values)


@pytest.mark.parametrize("dtype", [np.int64, np.uint64])
def test_numpy_ids_too_wide_for_jax_are_padding_not_wrapped(dtype, kernel_path):
    """With x64 off, ``2**32 + 5`` would wrap to row 5 in a cast to int32; it is padding in its own dtype."""
    assert not jax.config.read("jax_enable_x64")
    ids = np.array([2**32 + 5, 1, 2**31], dtype)
    g = osa.IndexedRows(ids, np.ones((3, 2), np.float32), 8)
    want = np.zeros((8, 2), np.float32)
    want[1] = 1.0
    np.testing.assert_array_equal(np.asarray(g.todense()), want)
    table = jnp.zeros((8, 2), jnp.float32)
    np.testing.assert_array_equal(np.asarray(osa.apply_updates(table, g)), want)
    np.testing.assert_array_equal(np.asarray(table + g), want)
    tx = osa.sparse_adam(0.1)
    updates, _ = tx.update(g, tx.init(table), table)
    np.testing.assert_array_equal(np.asarray(updates.todense()[:, 0]) != 0, want[:, 0] != 0)
    new, _ = osa.update_and_apply(tx, g, tx.init(table), table)
    np.testing.assert_array_equal(np.asarray(new[:, 0]) != 0, want[:, 0] != 0)


def test_a_routed_bcoo_pickles_and_copies_with_its_mark() -> None:
    """A routed BCOO (a row-sharded table's gradient, marked with its owner axis) pickles, deep-copies and copies as
    itself, mark and flags kept: its class, made on first use, has no name pickle can look up, and pickling raised."""
    import copy
    import pickle

    from optax_sparse_adam._indexed_rows import bcoo_like, owner_axis

    parts = (jnp.arange(6.0).reshape(3, 2), jnp.array([[0], [2], [4]]))
    routed = bcoo_like(parts, shape=(5, 2), owner_axis="x", unique_indices=True)
    for again in (pickle.loads(pickle.dumps(routed)), copy.deepcopy(routed), copy.copy(routed)):
        assert type(again) is type(routed) and owner_axis(again) == "x"
        assert (again.unique_indices, again.indices_sorted, again.shape) == (True, False, (5, 2))
        np.testing.assert_array_equal(again.todense(), routed.todense())
