"""The lazy rule against a NumPy reference, and its behaviour under jit."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental import sparse as jsparse
from reference import LazyAdamReference

import optax_sparse_adam as osa


@st.composite
def _problems(draw):
    num_rows = draw(st.integers(1, 12))
    row_shape = draw(st.sampled_from([(), (2,), (3,), (2, 2)]))
    shape = (num_rows, *row_shape)
    n_sparse = draw(st.integers(1, len(shape)))
    capacity = draw(st.integers(0, 10))
    steps = draw(st.integers(1, 4))
    in_range = st.tuples(*[st.integers(0, n - 1) for n in shape[:n_sparse]])
    padding = st.tuples(*[st.sampled_from([-3, -1, n, n + 5]) for n in shape[:n_sparse]])
    batches = []
    for _ in range(steps):
        keys = draw(st.lists(st.one_of(in_range, in_range, padding), min_size=capacity, max_size=capacity))
        batches.append(keys)
    placement = draw(st.sampled_from(["optax", "torch"]))
    maximize = draw(st.booleans())
    eps_root = draw(st.sampled_from([0.0, 1e-3]))
    # lazy_dense: the same gradient, dense; whole rows are touched, so only for row keys
    form = draw(st.sampled_from(["indexed_rows", "bcoo", "lazy_dense"] if n_sparse == 1 else ["bcoo"]))
    return shape, n_sparse, capacity, batches, placement, maximize, eps_root, form


@settings(max_examples=60, deadline=None)
@given(_problems(), st.integers(0, 2**31 - 1))
def test_matches_numpy_reference(problem, seed):
    shape, n_sparse, capacity, batches, placement, maximize, eps_root, form = problem
    rng = np.random.default_rng(seed)
    init = rng.standard_normal(shape).astype(np.float32)
    ref = LazyAdamReference(init, lr=0.1, eps_placement=placement, maximize=maximize, eps_root=eps_root)
    tx = osa.sparse_adam(
        0.1, eps_placement=placement, maximize=maximize, eps_root=eps_root, lazy_dense=form == "lazy_dense"
    )
    params = jnp.asarray(init)
    state = tx.init(params)
    for keys in batches:
        values = rng.standard_normal((capacity, *shape[n_sparse:])).astype(np.float32)
        ref.step(keys, list(values))
        key_arr = jnp.asarray(np.array(keys, np.int32).reshape(capacity, n_sparse))
        if form == "bcoo":
            grad = jsparse.BCOO((jnp.asarray(values), key_arr), shape=shape)
        else:
            grad = osa.IndexedRows(key_arr[:, 0], jnp.asarray(values), shape[0])
            grad = grad.todense() if form == "lazy_dense" else grad
        updates, state = tx.update(grad, state, params)
        assert type(updates) is type(grad)
        params = osa.apply_updates(params, updates)
    np.testing.assert_allclose(params, ref.p, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(state[0].mu, ref.m, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(state[0].nu, ref.v, rtol=2e-5, atol=1e-7)
    untouched = ref.m == 0  # never touched (every reference value is float64 noise otherwise)
    np.testing.assert_array_equal(np.asarray(params)[untouched], init[untouched])
    assert int(state[0].count) == len(batches)


def _tables(num_rows=10, dim=3):
    p = np.arange(num_rows * dim, dtype=np.float32).reshape(num_rows, dim) / 7 - 2
    p[0, 0] = -0.0  # signed zero must survive too
    return {"emb": jnp.asarray(p), "bias": jnp.zeros((dim,), jnp.float32)}


def test_untouched_rows_are_bitwise_unchanged_sparse_and_lazy_dense():
    params = _tables()
    idx = jnp.array([3, 5, 3, -1], jnp.int32)
    vals = jnp.ones((4, 3), jnp.float32)
    touched = np.zeros(10, bool)
    touched[[3, 5]] = True
    for lazy, grad in [
        (False, osa.IndexedRows(idx, vals, 10)),
        (True, osa.IndexedRows(idx, vals, 10).todense()),
    ]:
        tx = osa.sparse_adam(0.5, lazy_dense={"emb": lazy, "bias": False})
        p, s = params, tx.init(params)
        # warm moments everywhere first, so "unchanged" is not just "still zero"
        u, s = tx.update({"emb": jnp.ones((10, 3), jnp.float32), "bias": jnp.ones(3, jnp.float32)}, s, p)
        p = osa.apply_updates(p, u)
        before_p, before_m, before_v = (np.asarray(x["emb"]) for x in (p, s[0].mu, s[0].nu))
        for _ in range(3):
            u, s = jax.jit(tx.update)({"emb": grad, "bias": jnp.ones(3, jnp.float32)}, s, p)
            p = jax.jit(osa.apply_updates)(p, u)
        for before, after in [(before_p, p), (before_m, s[0].mu), (before_v, s[0].nu)]:
            after = np.asarray(after["emb"])
            assert after[~touched].tobytes() == before[~touched].tobytes()
            assert not np.array_equal(after[touched], before[touched])


def test_sparse_update_holds_exactly_the_touched_rows():
    tx = osa.scale_by_sparse_adam()
    grad = osa.IndexedRows(jnp.array([4, 1, 4, 9, -2, 1], jnp.int32), jnp.ones((6, 2), jnp.float32), 8)
    updates, _ = tx.update(grad, tx.init(jnp.zeros((8, 2), jnp.float32)))
    valid = (np.asarray(updates.indices) >= 0) & (np.asarray(updates.indices) < 8)
    assert sorted(np.asarray(updates.indices)[valid].tolist()) == [1, 4]
    assert updates.indices.shape == (6,)  # fixed capacity
    np.testing.assert_array_equal(np.asarray(updates.values)[~valid], 0.0)


def test_duplicates_that_sum_to_zero_are_touched():
    tx = osa.sparse_adam(0.1)
    p = jnp.ones((3, 2), jnp.float32)
    s = tx.init(p)
    u, s = tx.update(osa.IndexedRows(jnp.array([2], jnp.int32), jnp.ones((1, 2), jnp.float32), 3), s, p)
    p = osa.apply_updates(p, u)
    zero_sum = osa.IndexedRows(jnp.array([2, 2], jnp.int32), jnp.array([[1.0, 1.0], [-1.0, -1.0]], jnp.float32), 3)
    u, s2 = tx.update(zero_sum, s, p)
    np.testing.assert_allclose(s2[0].mu[2], 0.9 * s[0].mu[2])  # decayed: touched with g = 0
    assert np.all(np.asarray(osa.apply_updates(p, u)[2]) < np.asarray(p[2]))  # and it still moves


def test_count_advances_on_empty_and_all_padding_steps_and_none_skips():
    tx = osa.sparse_adam(0.1)
    params = {"a": jnp.ones((4, 2), jnp.float32), "b": jnp.ones((2,), jnp.float32)}
    s = tx.init(params)
    empty = osa.IndexedRows(jnp.zeros((0,), jnp.int32), jnp.zeros((0, 2), jnp.float32), 4)
    padding = osa.IndexedRows(jnp.array([-1, 4], jnp.int32), jnp.ones((2, 2), jnp.float32), 4)
    for g in (empty, padding):
        u, s = tx.update({"a": g, "b": None}, s, params)
        assert u["b"] is None
        new = osa.apply_updates(params, u)
        jax.tree.map(np.testing.assert_array_equal, new, params)
    assert int(s[0].count) == 2
    np.testing.assert_array_equal(s[0].mu["b"], 0.0)


def test_jit_and_eager_agree_and_one_trace_over_varying_distinct_counts():
    traces = 0
    tx = osa.sparse_adam(0.05)

    def step(params, state, idx, vals):
        nonlocal traces
        traces += 1
        u, state = tx.update({"emb": osa.IndexedRows(idx, vals, 50)}, state, params)
        return osa.apply_updates(params, u), state

    jitted = jax.jit(step, donate_argnums=(0, 1))
    rng = np.random.default_rng(0)
    p_e = {"emb": jnp.asarray(rng.standard_normal((50, 4)), jnp.float32)}
    p_j = jax.tree.map(jnp.copy, p_e)  # the jitted step donates its inputs
    s_e, s_j = tx.init(p_e), tx.init(p_j)
    for distinct in (1, 7, 16, 3, 0):
        idx = np.full(16, -1, np.int32)
        if distinct:  # the distinct rows, then repeats of them, then padding
            n = min(16, distinct + 5)
            idx[:n] = np.resize(rng.choice(50, distinct, replace=False), n)
        vals = rng.standard_normal((16, 4)).astype(np.float32)
        p_e, s_e = step(p_e, s_e, jnp.asarray(idx), jnp.asarray(vals))
        p_j, s_j = jitted(p_j, s_j, jnp.asarray(idx), jnp.asarray(vals))
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), (p_j, s_j), (p_e, s_e))
    assert traces == 5 + 1  # every eager call traces; the jitted step traced once


def _varied_grads(step: int) -> dict:
    rng = np.random.default_rng(step)
    return {
        "emb": osa.IndexedRows(
            jnp.asarray(rng.integers(-1, 11, size=4), jnp.int32),
            jnp.asarray(rng.standard_normal((4, 3)), jnp.float32),
            10,
        ),
        "bias": jnp.asarray(rng.standard_normal(3), jnp.float32),
    }


def _train(tx, steps=6, dense=False, **update_kwargs):
    params = _tables()
    state = tx.init(params)
    update = jax.jit(functools.partial(tx.update, **update_kwargs))
    for step in range(steps):
        g = _varied_grads(step)
        if dense:
            g = {"emb": g["emb"].todense(), "bias": g["bias"]}
        u, state = update(g, state, params)
        params = osa.apply_updates(params, u)
    return params


def test_extra_args_are_accepted_and_inject_hyperparams_matches():
    """Several steps with varied gradients, so that b1 and b2 matter (the first step from zero ignores them)."""
    plain = _train(osa.sparse_adam(0.1, b1=0.8, b2=0.95), value=jnp.float32(1.0), unknown_arg="ignored")
    injected = _train(optax.inject_hyperparams(osa.sparse_adam)(learning_rate=0.1, b1=0.8, b2=0.95))
    # Injected hyperparameters are float32 arrays rather than Python floats, so 1 - b2**t rounds
    # differently (optax.adam behaves the same way): equal up to float32 rounding.
    chex.assert_trees_all_close(plain, injected, rtol=1e-5, atol=1e-6)
    other = _train(optax.inject_hyperparams(osa.sparse_adam)(learning_rate=0.1, b1=0.5, b2=0.95))
    assert not np.allclose(other["emb"], plain["emb"], rtol=1e-3)
    other = _train(optax.inject_hyperparams(osa.sparse_adam)(learning_rate=0.1, b1=0.8, b2=0.5))
    assert not np.allclose(other["emb"], plain["emb"], rtol=1e-3)


def test_schedule_equals_constant_and_multisteps_dense():
    chex.assert_trees_all_equal(
        _train(osa.sparse_adam(0.1), dense=True), _train(osa.sparse_adam(optax.constant_schedule(0.1)), dense=True)
    )
    # MultiSteps averages k varied mini-batch gradients and steps once per k: equal to optax.adam's MultiSteps,
    # and a count off by one or a sum instead of a mean would differ.
    runs = [
        _train(optax.MultiSteps(tx, every_k_schedule=3), steps=6, dense=True)
        for tx in (osa.sparse_adam(0.1), optax.adam(0.1))
    ]
    chex.assert_trees_all_equal(*runs)
    assert not np.array_equal(runs[0]["emb"], _tables()["emb"])


def test_lazy_dense_mask_as_tree_and_callable():
    params = _tables()
    grad = {"emb": jnp.zeros((10, 3), jnp.float32).at[2].set(1.0), "bias": jnp.ones(3, jnp.float32)}
    by_tree = osa.sparse_adam(0.1, lazy_dense={"emb": True, "bias": False})
    by_fn = osa.sparse_adam(0.1, lazy_dense=lambda p: jax.tree.map(lambda x: x.ndim == 2, p))
    outs = []
    for tx in (by_tree, by_fn):
        u, s = tx.update(grad, tx.init(params), params)
        outs.append((osa.apply_updates(params, u), s[0]))
        np.testing.assert_array_equal(s[0].mu["emb"][3:], 0.0)
    jax.tree.map(np.testing.assert_array_equal, *outs)
    dense = osa.sparse_adam(0.1)
    _, s = dense.update(grad, dense.init(params), params)
    assert np.all(np.asarray(s[0].nu["emb"][2]) > 0)


def test_sharded_table_matches_unsharded():
    """Rows sharded over 8 devices: the same numbers, and the table stays sharded."""
    if jax.device_count() < 8:
        pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count=8 (set by conftest)")
    mesh = jax.make_mesh((8,), ("rows",), axis_types=(jax.sharding.AxisType.Auto,))
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("rows", None))
    rng = np.random.default_rng(1)
    table = jnp.asarray(rng.standard_normal((4096, 4)), jnp.float32)
    idx = jnp.asarray(rng.integers(-2, 4096, 2048), jnp.int32)  # capacity 2048: processed in chunks
    vals = jnp.asarray(rng.standard_normal((2048, 4)), jnp.float32)
    tx = osa.sparse_adam(0.1)

    @jax.jit
    def step(p, s):
        u, s = tx.update(osa.IndexedRows(idx, vals, 4096), s, p)
        return osa.apply_updates(p, u), s

    p_ref, s_ref = step(table, tx.init(table))
    sharded = jax.device_put(table, rows)
    p_sh, s_sh = step(sharded, tx.init(sharded))
    assert s_sh[0].mu.sharding.is_equivalent_to(rows, 2)
    np.testing.assert_array_equal(p_sh, p_ref)
    jax.tree.map(np.testing.assert_array_equal, s_sh, s_ref)
    assert p_sh.sharding.is_equivalent_to(rows, 2)


@pytest.mark.parametrize("unique", [False, True])
def test_large_capacity_in_chunks_matches_reference(unique):
    """Capacities over 1,024 run in chunks up to the last valid slot; valid entries anywhere must count."""
    rng = np.random.default_rng(3)
    num_rows, k = 3000, 4096
    init = rng.standard_normal((num_rows, 3)).astype(np.float32)
    ref = LazyAdamReference(init, lr=0.1)
    tx = osa.sparse_adam(0.1)
    params = jnp.asarray(init)
    state = tx.init(params)
    step = jax.jit(lambda p, s, g: (lambda u, s: (osa.apply_updates(p, u), s))(*tx.update(g, s, p)))
    for n_valid in (2500, 40, 4000):
        if unique:  # distinct rows spread over all slots, the last slot among them
            idx = np.full(k, -1, np.int64)
            slots = np.append(rng.choice(k - 1, min(n_valid, num_rows) - 1, replace=False), k - 1)
            idx[slots] = rng.choice(num_rows, len(slots), replace=False)
        else:  # duplicates and padding everywhere
            idx = rng.integers(0, num_rows, k)
            idx[rng.choice(k, k - n_valid, replace=False)] = rng.choice([-1, num_rows], k - n_valid)
        values = rng.standard_normal((k, 3)).astype(np.float32)
        values[(idx < 0) | (idx >= num_rows)] = 0.0 if unique else 5.0
        ref.step([(int(i),) for i in idx], list(values))
        grad = osa.IndexedRows(jnp.asarray(idx, jnp.int32), jnp.asarray(values), num_rows, unique_indices=unique)
        params, state = step(params, state, grad)
    np.testing.assert_allclose(params, ref.p, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(state[0].mu, ref.m, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(state[0].nu, ref.v, rtol=2e-5, atol=1e-7)
