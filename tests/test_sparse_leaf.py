"""The internal form of a sparse leaf (``_sparse_leaf.py``): keys out of range in their own dtype are padding, the
round trip back to the user's type keeps its type, index dtype and flags, and the index dtype's limits are checked."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.experimental import sparse as jsparse

import optax_sparse_adam as osa
from optax_sparse_adam._sparse_leaf import SparseLeaf, to_sparse_leaf
from tests.helpers import assert_trees_equal

N, D = 10, 3


def _params():
    return {"emb": jnp.arange(N * D, dtype=jnp.float32).reshape(N, D) / 10 - 1, "w": jnp.ones((D,), jnp.float32)}


# --------------------------------------------------------------------------- to_sparse_leaf and back


def _leaf(name):
    """A user leaf of each kind, its parameter shape, and the internal keys it should get (padding -> shape[:s])."""
    idx = jnp.array([4, -1, 4, N, 0], jnp.int16)
    vals = jnp.arange(5 * D, dtype=jnp.float32).reshape(5, D)
    row_keys = [[4], [N], [4], [N], [0]]
    if name == "indexed_rows":
        return osa.IndexedRows(idx, vals, N), (N, D), row_keys
    if name == "indexed_rows_unique":
        distinct = jnp.array([4, -1, 7, N, 0], jnp.int16)
        return (
            osa.IndexedRows(distinct, vals.at[1].set(0).at[3].set(0), N, unique_indices=True),
            (N, D),
            [
                [4],
                [N],
                [7],
                [N],
                [0],
            ],
        )
    if name == "bcoo_rows":
        return jsparse.BCOO((vals, idx[:, None]), shape=(N, D)), (N, D), row_keys
    keys = jnp.array([[1, 2], [3, 1], [N, 0], [N, 5]], jnp.int64)  # sorted, distinct, padding last
    values = jnp.array([1.0, 2.0, 0.0, 0.0], jnp.float32)
    leaf = jsparse.BCOO((values, keys), shape=(N, D), indices_sorted=True, unique_indices=True)
    return leaf, (N, D), [[1, 2], [3, 1], [N, D], [N, D]]


@pytest.mark.parametrize("name", ["indexed_rows", "indexed_rows_unique", "bcoo_rows", "bcoo_elements_sorted"])
def test_to_sparse_leaf_and_back_keeps_type_index_dtype_and_flags(name):
    with jax.enable_x64(True):
        leaf, shape, want_keys = _leaf(name)
        internal = to_sparse_leaf(leaf, shape, (jax.tree_util.DictKey("emb"),), "test")
        assert isinstance(internal, SparseLeaf)
        assert internal.keys.dtype == jnp.int32 and internal.shape == shape
        np.testing.assert_array_equal(internal.keys, np.array(want_keys, np.int32))  # padding -> shape[:s]
        is_bcoo = isinstance(leaf, jsparse.BCOO)
        assert internal.declared.bcoo == is_bcoo
        assert internal.declared.index_dtype == leaf.indices.dtype
        assert internal.distinct == bool(leaf.unique_indices)
        back = internal.to_leaf()
        assert type(back) is type(leaf)
        assert back.indices.dtype == leaf.indices.dtype
        assert back.unique_indices == leaf.unique_indices
        if is_bcoo:
            assert back.indices_sorted == leaf.indices_sorted and back.shape == leaf.shape
        else:
            assert back.num_rows == leaf.num_rows
        assert jax.tree.structure(back) == jax.tree.structure(leaf)  # what optax's lax.cond wrappers need
        zeros = jnp.zeros(shape, jnp.float32)  # padding is still padding, in the leaf's own index dtype:
        assert_trees_equal(osa.apply_updates(zeros, back), osa.apply_updates(zeros, leaf))
        # An emitted leaf is taken back as it is: the same keys, no second normalisation.
        again = to_sparse_leaf(back, shape, (), "test")
        assert_trees_equal((again.keys, again.values), (internal.keys, internal.values))
        assert (again.distinct, again.sorted) == (internal.distinct, internal.sorted)


@pytest.mark.parametrize(
    ("leaf", "shape", "error", "match"),
    [
        (osa.IndexedRows(jnp.array([0]), jnp.ones((1,), jnp.float32), 1), (), ValueError, "0-d parameter"),
        (osa.IndexedRows(jnp.array([0]), jnp.ones((1, D), jnp.float32), N), (N + 1, D), ValueError, "for 10 rows"),
        (
            osa.IndexedRows(jnp.array([0]), jnp.ones((1, D), jnp.int32), N),
            (N, D),
            TypeError,
            "must be floating point",
        ),
        (jsparse.BCOO.fromdense(jnp.ones((N, D), jnp.float32)), (N, D + 1), ValueError, "BCOO shape"),
    ],
)
def test_to_sparse_leaf_refuses_leaves_that_do_not_fit(leaf, shape, error, match):
    with pytest.raises(error, match=rf"where: parameter \['emb'\].*{match}"):
        to_sparse_leaf(leaf, shape, (jax.tree_util.DictKey("emb"),), "where")


# --------------------------------------------------------------------------- keys out of range in their own dtype


@pytest.mark.parametrize(
    ("dtype", "bad"),
    [
        (np.int64, 2**32 + 5),  # wraps to row 5 when cast to int32 first
        (np.int64, -(2**32) + 3),  # wraps to row 3
        (np.uint64, 2**33 + 1),  # wraps to row 1
        (np.uint32, 2**32 - 1),  # -1 as int32: padding either way, but must not be read as a row
    ],
)
def test_wide_indices_out_of_range_are_padding_everywhere(dtype, bad):
    with jax.enable_x64(True):
        params = _params()
        idx = jnp.asarray(np.array([bad, 7], dtype=dtype))
        vals = jnp.ones((2, D), jnp.float32)
        g = osa.IndexedRows(idx, vals, N)
        expected = np.zeros((N, D), np.float32)
        expected[7] = 1.0
        np.testing.assert_array_equal(g.todense(), expected)
        np.testing.assert_array_equal(osa.apply_updates(params["emb"], g), params["emb"] + expected)
        np.testing.assert_array_equal(optax.apply_updates(params["emb"], g), params["emb"] + expected)
        bcoo = jsparse.BCOO((vals, idx[:, None]), shape=(N, D))
        for grad in (g, bcoo):
            tx = osa.sparse_adam(0.1)
            updates, state = jax.jit(tx.update)({"emb": grad, "w": None}, tx.init(params), params)
            moved = np.flatnonzero(np.any(np.asarray(state[0].mu["emb"]) != 0, axis=1))
            np.testing.assert_array_equal(moved, [7])
            new = osa.apply_updates(params, updates)["emb"]
            np.testing.assert_array_equal(np.flatnonzero(np.any(new != params["emb"], axis=1)), [7])
            assert updates["emb"].indices.dtype == idx.dtype  # the index dtype is kept


def test_index_dtype_that_cannot_mark_padding_is_refused():
    params = {"emb": jnp.zeros((300, D), jnp.float32)}
    tx = osa.sparse_adam(0.1)
    g = {"emb": osa.IndexedRows(jnp.array([3, 3], jnp.uint8), jnp.ones((2, D), jnp.float32), 300)}
    with pytest.raises(TypeError, match=r"\['emb'\]: indices of dtype uint8 cannot mark padding.*use int32"):
        tx.update(g, tx.init(params), params)


def test_sparse_axes_of_2_31_entries_are_refused():
    tx = osa.sparse_adam(0.1)
    big = {"emb": jax.ShapeDtypeStruct((2**31, 1), jnp.float32)}
    g = {"emb": jsparse.BCOO((jnp.ones((1, 1), jnp.float32), jnp.array([[1]], jnp.int32)), shape=(2**31, 1))}
    with pytest.raises(ValueError, match=r"\['emb'\]: the sparse axes \(2147483648,\) hold 2\*\*31 or more"):
        jax.eval_shape(tx.update, g, jax.eval_shape(tx.init, big), big)
