"""No silent wrong numbers: out-of-range keys in any dtype, complex and integer gradients, whole-table use on the
fast path, wrappers that need the gradient's static structure, and errors that say where and what to do."""

from __future__ import annotations

import functools
import math
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.experimental import sparse as jsparse
from reference import LazyAdamReference

import optax_sparse_adam as osa

N, D = 10, 3


def _params():
    return {"emb": jnp.arange(N * D, dtype=jnp.float32).reshape(N, D) / 10 - 1, "w": jnp.ones((D,), jnp.float32)}


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


# --------------------------------------------------------------------------- complex and integer gradients


def _complex_run(tx, sparse, steps=4):
    rng = np.random.default_rng(0)
    p = jnp.asarray(rng.standard_normal((N, D)) + 1j * rng.standard_normal((N, D)), jnp.complex64)
    state = tx.init(p)
    for _ in range(steps):
        g = jnp.asarray(rng.standard_normal((N, D)) + 1j * rng.standard_normal((N, D)), jnp.complex64)
        if sparse:
            g = osa.IndexedRows(jnp.arange(N, dtype=jnp.int32), g, N)
        u, state = jax.jit(tx.update)(g, state, p)
        p = osa.apply_updates(p, u)
    return p, state


def test_complex_parameters_match_optax_adam():
    """The second moment is ``|g|^2``, as in optax: identical on the dense path, to rounding on the sparse one."""
    ref_p, ref_state = _complex_run(optax.adam(0.05), sparse=False)
    p, state = _complex_run(osa.sparse_adam(0.05), sparse=False)
    chex.assert_trees_all_equal((p, state[0]), (ref_p, ref_state[0]))
    assert np.all(np.asarray(state[0].nu).imag == 0) and np.all(np.asarray(state[0].nu).real > 0)
    p, state = _complex_run(osa.sparse_adam(0.05), sparse=True)
    chex.assert_trees_all_close((p, state[0].mu, state[0].nu), (ref_p, ref_state[0].mu, ref_state[0].nu), rtol=1e-6)


@pytest.mark.parametrize("lazy", [False, True])
def test_integer_dense_gradients_are_refused_with_the_path(lazy):
    tx = osa.sparse_adam(0.1, lazy_dense=lazy)
    params = _params()
    grads = {"emb": jnp.ones((N, D), jnp.int32), "w": jnp.ones((D,), jnp.float32)}
    with pytest.raises(TypeError, match=r"\['emb'\]: the gradient has dtype int32; Adam needs floating-point"):
        tx.update(grads, tx.init(params), params)


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


def test_lazy_path_pads_safely_with_a_masked_valid_id():
    """nnx.Embed wraps a negative id to the last row, so on the lazy path -1 is not padding: pad with a valid id
    and a zero weight instead, and no row but the real ids moves (the fast path takes -1 as padding)."""
    model = nnx.Embed(N, D, rngs=nnx.Rngs(0))
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

    assert moved(ids, jnp.ones(3, jnp.float32)) == [2, 5, N - 1]  # -1 trained the last row
    safe = jnp.where(ids >= 0, ids, 0)
    assert moved(safe, (ids >= 0).astype(jnp.float32)) == [2, 5]


# --------------------------------------------------------------------------- wrappers need the gradient's structure


@pytest.mark.parametrize("dtype", [np.uint8, np.int16, np.int64, np.uint32])
def test_apply_if_finite_keeps_working_with_any_index_dtype(dtype):
    with jax.enable_x64(True):
        params = _params()
        tx = optax.apply_if_finite(osa.sparse_adam(0.1), max_consecutive_errors=2)
        idx = jnp.asarray(np.array([3, 3, 250], dtype=dtype))  # 250: padding
        g = {"emb": osa.IndexedRows(idx, jnp.ones((3, D), jnp.float32), N), "w": jnp.ones((D,), jnp.float32)}
        updates, state = jax.jit(tx.update)(g, tx.init(params), params)
        assert updates["emb"].indices.dtype == dtype
        assert int(state.total_notfinite) == 0
        new = osa.apply_updates(params, updates)["emb"]
        np.testing.assert_array_equal(np.flatnonzero(np.any(new != params["emb"], axis=1)), [3])


def test_index_dtype_that_cannot_mark_padding_is_refused():
    params = {"emb": jnp.zeros((300, D), jnp.float32)}
    tx = osa.sparse_adam(0.1)
    g = {"emb": osa.IndexedRows(jnp.array([3, 3], jnp.uint8), jnp.ones((2, D), jnp.float32), 300)}
    with pytest.raises(TypeError, match=r"\['emb'\]: indices of dtype uint8 cannot mark padding.*use int32"):
        tx.update(g, tx.init(params), params)


# --------------------------------------------------------------------------- errors that say where and what to do


def test_tree_mismatch_names_the_first_differing_path_without_printing_arrays():
    params = {
        f"layers_{i}": {"kernel": jnp.ones((4, 4), jnp.float32), "bias": jnp.ones(4, jnp.float32)} for i in range(9)
    }
    tx = osa.sparse_adam(0.1)
    state = tx.init(params)
    grads = jax.tree.map(jnp.zeros_like, params)
    del grads["layers_7"]["bias"]
    msg = r"differ at \['layers_7'\]\['bias'\]: the optimizer state's mu hold an array of shape \(4,\)"
    with pytest.raises(ValueError, match=msg):
        tx.update(grads, state, params)
    as_list = [jnp.zeros((4, 4), jnp.float32)] * 18
    with pytest.raises(ValueError) as err:
        tx.update(as_list, state, params)
    assert "0. 0." not in str(err.value) and "Array(" not in str(err.value)
    assert "a dict with keys" in str(err.value) and "a list of length 18" in str(err.value)


def test_state_built_for_other_parameters_is_blamed_on_the_state():
    tx = osa.sparse_adam(0.1)
    state = tx.init({"emb": jnp.zeros((10, D), jnp.float32)})
    params = {"emb": jnp.zeros((6, D), jnp.float32)}
    g = {"emb": osa.IndexedRows(jnp.array([1], jnp.int32), jnp.ones((1, D), jnp.float32), 6)}
    with pytest.raises(ValueError, match=r"\['emb'\]: the optimizer state's mu has shape \(10, 3\) but the parameter"):
        tx.update(g, state, params)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"learning_rate": math.inf}, ValueError, "learning_rate: inf"),
        ({"eps": math.inf}, ValueError, "eps: inf"),
        ({"eps_root": math.inf}, ValueError, "eps_root: inf"),
        ({"b1": "0.9"}, TypeError, "b1: '0.9'; it must be a real number"),
        ({"b1": np.array([0.9, 0.8])}, ValueError, r"b1: an array of shape \(2,\); it must be a scalar"),
        ({"maximize": "no"}, TypeError, "maximize: 'no'; it must be a bool"),
        ({"mu_dtype": "foo"}, TypeError, "mu_dtype: 'foo'"),
        ({"mu_dtype": jnp.int32}, TypeError, "mu_dtype: int32; it must be a floating dtype"),
        ({"lazy_dense": {"emb": "yes"}}, TypeError, r"lazy_dense: 'yes' at \['emb'\]"),
    ],
)
def test_bad_hyperparameters_name_the_argument_at_construction(kwargs, error, match):
    with pytest.raises(error, match=match):
        osa.sparse_adam(**{"learning_rate": 0.1, **kwargs})


def test_lazy_dense_of_the_wrong_structure_fails_at_init_naming_it():
    tx = osa.sparse_adam(0.1, lazy_dense={"emb": True, "other": False})
    with pytest.raises(ValueError, match="lazy_dense must be a bool, or a tree of bools that is a prefix"):
        tx.init(_params())


def test_a_state_of_another_optimizer_is_named():
    tx = osa.sparse_adam(0.1)
    params = _params()
    state = (optax.sgd(0.1).init(params)[0], tx.init(params)[1])
    with pytest.raises(TypeError, match=r"the optimizer state is a EmptyState, not the ScaleByAdamState"):
        tx.update(jax.tree.map(jnp.ones_like, params), state, params)


def test_num_rows_must_be_a_static_int_below_2_31():
    with pytest.raises(TypeError, match="num_rows must be a static Python int"):
        osa.IndexedRows(jnp.array([1]), jnp.ones((1, D), jnp.float32), jnp.asarray(N))
    with pytest.raises(ValueError, match=r"up to 2\*\*31 - 1 rows; split a larger table"):
        osa.IndexedRows(jnp.array([1]), jnp.ones((1, D), jnp.float32), 2**31)
    tx = osa.sparse_adam(0.1)
    big = {"emb": jax.ShapeDtypeStruct((2**31, 1), jnp.float32)}
    g = {"emb": jsparse.BCOO((jnp.ones((1, 1), jnp.float32), jnp.array([[1]], jnp.int32)), shape=(2**31, 1))}
    with pytest.raises(ValueError, match=r"\['emb'\]: the sparse axes \(2147483648,\) hold 2\*\*31 or more"):
        jax.eval_shape(tx.update, g, jax.eval_shape(tx.init, big), big)


# --------------------------------------------------------------------------- donation: nothing written after an error


def test_an_error_under_donation_leaves_params_and_state_alive_and_unchanged():
    tx = osa.sparse_adam(0.1)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return osa.apply_updates(params, updates), state

    params = _params()
    state = tx.init(params)
    snapshot = jax.tree.map(np.array, (params, state))
    bad = {"emb": osa.IndexedRows(jnp.array([1], jnp.int32), jnp.ones((1, D + 1), jnp.float32), N), "w": None}
    with pytest.raises(ValueError, match=r"\['emb'\].*row shape"):
        step(params, state, bad)
    assert not any(x.is_deleted() for x in jax.tree.leaves((params, state)))
    chex.assert_trees_all_equal((params, state), snapshot)
    good = {"emb": osa.IndexedRows(jnp.array([1], jnp.int32), jnp.ones((1, D), jnp.float32), N), "w": None}
    new_params, _ = step(params, state, good)
    assert params["emb"].is_deleted()  # the check above can fail: a good step does consume the buffers
    assert not np.array_equal(new_params["emb"][1], snapshot[0]["emb"][1])


# --------------------------------------------------------------------------- exactness claims


def test_dense_default_is_identical_to_optax_adam_eagerly_too():
    rng = np.random.default_rng(3)
    runs = []
    for tx in (optax.adam(0.01), osa.sparse_adam(0.01)):
        params, state = _params(), None
        state = tx.init(params)
        for step in range(6):
            g = jax.tree.map(
                lambda x, s=step: jnp.asarray(np.random.default_rng(s).standard_normal(x.shape), x.dtype), params
            )
            u, state = tx.update(g, state, params)
            params = optax.apply_updates(params, u)
        runs.append((params, state[0]))
    del rng
    chex.assert_trees_all_equal(*runs)


def test_sparse_mu_dtype_matches_the_reference_with_rounded_moments():
    import ml_dtypes

    rng = np.random.default_rng(1)
    init = rng.standard_normal((N, D)).astype(np.float32)
    ref = LazyAdamReference(init, lr=0.1, round_m=lambda m: np.asarray(m, ml_dtypes.bfloat16).astype(np.float64))
    tx = osa.sparse_adam(0.1, mu_dtype=jnp.bfloat16)
    params = jnp.asarray(init)
    state = tx.init(params)
    for _ in range(5):
        keys = rng.integers(-2, N + 2, size=6)
        values = rng.standard_normal((6, D)).astype(np.float32)
        ref.step([(int(k),) for k in keys], list(values))
        u, state = jax.jit(tx.update)(osa.IndexedRows(jnp.asarray(keys, jnp.int32), jnp.asarray(values), N), state)
        params = osa.apply_updates(params, u)
    assert state[0].mu.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(state[0].mu, np.float32), ref.m, rtol=1e-2, atol=1e-3)
    np.testing.assert_allclose(params, ref.p, rtol=1e-2, atol=2e-3)
    assert re.search("bfloat16", str(state[0].mu.dtype))
