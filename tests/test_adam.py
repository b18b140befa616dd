"""``sparse_adam``: the lazy rule against a NumPy loop, ``optax.adam`` where every row is touched, and what optax
checks of its own optimizers (extra arguments, one compile, ``inject_hyperparams``, schedules, ``MultiSteps``, dtypes).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental import sparse as jsparse

import optax_sparse_adam as osa
from tests.helpers import assert_trees_equal, jit_once
from tests.reference import LazyAdamReference


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


@functools.cache
def _reference_step(placement, maximize, eps_root, lazy_dense):
    """The optimizer and its jitted step (update, then apply), shared by the examples with its hyperparameters:
    one compilation per problem's shapes, not one dispatch per operation, and none for shapes seen before."""
    tx = osa.sparse_adam(0.1, eps_placement=placement, maximize=maximize, eps_root=eps_root, lazy_dense=lazy_dense)

    def step(grad, state, params):
        updates, state = tx.update(grad, state, params)
        return updates, osa.apply_updates(params, updates), state

    return tx, jax.jit(step)


@settings(max_examples=60, deadline=None)
@given(_problems(), st.integers(0, 2**31 - 1))
def test_matches_numpy_reference(problem, seed):
    shape, n_sparse, capacity, batches, placement, maximize, eps_root, form = problem
    rng = np.random.default_rng(seed)
    init = rng.standard_normal(shape).astype(np.float32)
    ref = LazyAdamReference(init, lr=0.1, eps_placement=placement, maximize=maximize, eps_root=eps_root)
    tx, step = _reference_step(placement, maximize, eps_root, form == "lazy_dense")
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
        updates, params, state = step(grad, state, params)
        assert type(updates) is type(grad)
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
        assert_trees_equal(new, params)
    assert int(s[0].count) == 2
    np.testing.assert_array_equal(s[0].mu["b"], 0.0)


def test_jit_and_eager_agree_and_one_compile_over_varying_distinct_counts():
    tx = osa.sparse_adam(0.05)

    def step(params, state, idx, vals):
        u, state = tx.update({"emb": osa.IndexedRows(idx, vals, 50)}, state, params)
        return osa.apply_updates(params, u), state

    jitted = jit_once(step, donate_argnums=(0, 1))
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
        assert_trees_equal((p_j, s_j), (p_e, s_e), rtol=1e-5, atol=1e-6)


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
    assert_trees_equal(plain, injected, rtol=1e-5, atol=1e-6)
    other = _train(optax.inject_hyperparams(osa.sparse_adam)(learning_rate=0.1, b1=0.5, b2=0.95))
    assert not np.allclose(other["emb"], plain["emb"], rtol=1e-3)
    other = _train(optax.inject_hyperparams(osa.sparse_adam)(learning_rate=0.1, b1=0.8, b2=0.5))
    assert not np.allclose(other["emb"], plain["emb"], rtol=1e-3)


def test_schedule_equals_constant_and_multisteps_dense():
    assert_trees_equal(
        _train(osa.sparse_adam(0.1), dense=True), _train(osa.sparse_adam(optax.constant_schedule(0.1)), dense=True)
    )
    # MultiSteps averages k varied mini-batch gradients and steps once per k: equal to optax.adam's MultiSteps,
    # and a count off by one or a sum instead of a mean would differ.
    runs = [
        _train(optax.MultiSteps(tx, every_k_schedule=3), steps=6, dense=True)
        for tx in (osa.sparse_adam(0.1), optax.adam(0.1))
    ]
    assert_trees_equal(*runs)
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
    assert_trees_equal(*outs)
    dense = osa.sparse_adam(0.1)
    _, s = dense.update(grad, dense.init(params), params)
    assert np.all(np.asarray(s[0].nu["emb"][2]) > 0)


def test_sharded_table_matches_unsharded():
    """Rows sharded over 8 devices: the same numbers, and the table stays sharded."""
    assert jax.device_count() == 8, "conftest sets jax_num_cpu_devices=8"
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
    assert_trees_equal(s_sh, s_ref)
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


# --------------------------------------------------------------------------- equal to optax.adam, on both kernel paths

TOL = 1e-6
ROWS, WIDTH = 16, 3


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


def _run_every_step(tx, make_grad, steps=6, seed=0):
    rng, grad_rng = np.random.default_rng(seed), np.random.default_rng(seed + 1)
    params = {"emb": jnp.asarray(rng.standard_normal((ROWS, WIDTH)), jnp.float32), "w": jnp.ones((WIDTH,), jnp.float32)}
    state = tx.init(params)
    for _ in range(steps):
        g = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in params.items()}
        g = {k: np.where(np.abs(x) < 1e-3, 1e-3, x).astype(np.float32) for k, x in g.items()}  # no exact zeros
        updates, state = jax.jit(tx.update)(make_grad(g, grad_rng), state, params)
        params = osa.apply_updates(params, updates)
    return params, state


@pytest.mark.usefixtures("kernel_path")
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
    ref_params, ref_state = _run_every_step(optax.adam(0.01), lambda g, rng: {k: jnp.asarray(v) for k, v in g.items()})
    params, state = _run_every_step(osa.sparse_adam(0.01, **tx_kwargs), make_grad)
    assert_trees_equal(
        (params, state[0].mu, state[0].nu), (ref_params, ref_state[0].mu, ref_state[0].nu), rtol=TOL, atol=TOL
    )
    assert state[0].count == ref_state[0].count


@pytest.mark.usefixtures("kernel_path")
def test_dense_default_is_bitwise_optax_adam():
    """The default dense path runs optax's own arithmetic, so it is identical, not just close."""
    ref_params, ref_state = _run_every_step(optax.adam(0.01), lambda g, rng: {k: jnp.asarray(v) for k, v in g.items()})
    params, state = _run_every_step(osa.sparse_adam(0.01), lambda g, rng: {k: jnp.asarray(v) for k, v in g.items()})
    assert_trees_equal((params, state[0]), (ref_params, ref_state[0]))


@pytest.mark.usefixtures("kernel_path")
def test_state_is_optax_adam_state_and_tree_get_works():
    params = {"emb": jnp.zeros((ROWS, WIDTH), jnp.float32)}
    state = osa.sparse_adam(0.1).init(params)
    ref = optax.adam(0.1).init(params)
    assert isinstance(state[0], optax.ScaleByAdamState)
    assert jax.tree.structure(state[0]) == jax.tree.structure(ref[0])
    mu = optax.tree.get(state, "mu")
    assert mu["emb"].shape == (ROWS, WIDTH)


@pytest.mark.usefixtures("kernel_path")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("mu_dtype", [None, jnp.float32])
def test_dense_dtypes_match_optax(dtype, mu_dtype):
    """Moments and updates in optax's dtypes (the updates promoted with ``mu_dtype``, as optax's arithmetic
    promotes them), values equal to optax's, over several varied steps (after the first, updates are no longer
    about +-1, so low-precision arithmetic shows)."""
    params = {"w": jnp.linspace(-1, 1, 12, dtype=dtype).reshape(4, 3)}
    ref, tx = optax.scale_by_adam(mu_dtype=mu_dtype), osa.scale_by_sparse_adam(mu_dtype=mu_dtype)
    rs, s = ref.init(params), tx.init(params)
    for step in range(6):
        g = {"w": jnp.asarray(np.random.default_rng(step).standard_normal((4, 3)), dtype)}
        ru, rs = ref.update(g, rs, params)
        u, s = tx.update(g, s, params)
        assert u["w"].dtype == ru["w"].dtype == jnp.promote_types(dtype, mu_dtype or dtype)
        assert s.mu["w"].dtype == rs.mu["w"].dtype == (mu_dtype or dtype)
        assert s.nu["w"].dtype == rs.nu["w"].dtype == dtype
        assert_trees_equal((u["w"], s.mu, s.nu), (ru["w"], rs.mu, rs.nu))
    assert np.abs(np.asarray(u["w"], np.float32)).min() < 0.9  # not the first step's +-1 any more


def _complex_run(tx, sparse, steps=4):
    rng = np.random.default_rng(0)
    p = jnp.asarray(rng.standard_normal((ROWS, WIDTH)) + 1j * rng.standard_normal((ROWS, WIDTH)), jnp.complex64)
    state = tx.init(p)
    for _ in range(steps):
        g = jnp.asarray(rng.standard_normal((ROWS, WIDTH)) + 1j * rng.standard_normal((ROWS, WIDTH)), jnp.complex64)
        if sparse:
            g = osa.IndexedRows(jnp.arange(ROWS, dtype=jnp.int32), g, ROWS)
        u, state = jax.jit(tx.update)(g, state, p)
        p = osa.apply_updates(p, u)
    return p, state


def test_complex_parameters_match_optax_adam():
    """The second moment is ``|g|^2``, as in optax: identical on the dense path, to rounding on the sparse one."""
    ref_p, ref_state = _complex_run(optax.adam(0.05), sparse=False)
    p, state = _complex_run(osa.sparse_adam(0.05), sparse=False)
    assert_trees_equal((p, state[0]), (ref_p, ref_state[0]))
    assert np.all(np.asarray(state[0].nu).imag == 0) and np.all(np.asarray(state[0].nu).real > 0)
    p, state = _complex_run(osa.sparse_adam(0.05), sparse=True)
    assert_trees_equal((p, state[0].mu, state[0].nu), (ref_p, ref_state[0].mu, ref_state[0].nu), rtol=1e-6)


def _eager_params():
    return {"emb": jnp.arange(30, dtype=jnp.float32).reshape(10, 3) / 10 - 1, "w": jnp.ones((3,), jnp.float32)}


def test_dense_default_is_identical_to_optax_adam_eagerly_too():
    runs = []
    for tx in (optax.adam(0.01), osa.sparse_adam(0.01)):
        params = _eager_params()
        state = tx.init(params)
        for step in range(6):
            g = jax.tree.map(
                lambda x, s=step: jnp.asarray(np.random.default_rng(s).standard_normal(x.shape), x.dtype), params
            )
            u, state = tx.update(g, state, params)
            params = optax.apply_updates(params, u)
        runs.append((params, state[0]))
    assert_trees_equal(*runs)


# --------------------------------------------------------------------------- mu_dtype on the sparse path


def test_sparse_mu_dtype_matches_the_reference_with_rounded_moments():
    rng = np.random.default_rng(1)
    init = rng.standard_normal((10, 3)).astype(np.float32)
    ref = LazyAdamReference(init, lr=0.1, round_m=lambda m: np.asarray(m, ml_dtypes.bfloat16).astype(np.float64))
    tx = osa.sparse_adam(0.1, mu_dtype=jnp.bfloat16)
    params = jnp.asarray(init)
    state = tx.init(params)
    for _ in range(5):
        keys = rng.integers(-2, 12, size=6)
        values = rng.standard_normal((6, 3)).astype(np.float32)
        ref.step([(int(k),) for k in keys], list(values))
        u, state = jax.jit(tx.update)(osa.IndexedRows(jnp.asarray(keys, jnp.int32), jnp.asarray(values), 10), state)
        params = osa.apply_updates(params, u)
    assert state[0].mu.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(state[0].mu, np.float32), ref.m, rtol=1e-2, atol=1e-3)
    np.testing.assert_allclose(params, ref.p, rtol=1e-2, atol=2e-3)


# --------------------------------------------------------------------------- ported: TF Addons' LazyAdam tests


def _lazy_adam_update_numpy(param, indices, g_t, t, m, v, alpha=0.001, beta1=0.9, beta2=0.999, epsilon=1e-8):
    """TF Addons' ``adam_update_numpy`` applied to the rows ``indices`` only (its lazy reference)."""
    m, v, param = m.copy(), v.copy(), param.copy()
    alpha_t = alpha * np.sqrt(1 - beta2**t) / (1 - beta1**t)
    m[indices] = beta1 * m[indices] + (1 - beta1) * g_t
    v[indices] = beta2 * v[indices] + (1 - beta2) * g_t * g_t
    param[indices] = param[indices] - alpha_t * m[indices] / (np.sqrt(v[indices]) + epsilon)
    return param, m, v


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_lazy_adam_sparse_as_tf_addons(kernel_path, dtype):
    """TF Addons' ``test_sparse``: two variables with sparse gradients, 3 steps, against its NumPy reference."""
    var0, var1 = np.array([1.0, 1.0, 2.0], dtype), np.array([3.0, 3.0, 4.0], dtype)
    g0, g1 = np.array([0.1, 0.1], dtype), np.array([0.01, 0.01], dtype)
    idx = np.array([0, 2], np.int32)
    tx = osa.sparse_adam(0.001, eps_placement="torch")  # LazyAdam's step: alpha sqrt(1 - b2^t) / (1 - b1^t)
    params = {"var0": jnp.asarray(var0), "var1": jnp.asarray(var1)}
    state = tx.init(params)
    grads = {"var0": osa.IndexedRows(idx, jnp.asarray(g0), 3), "var1": osa.IndexedRows(idx, jnp.asarray(g1), 3)}
    step = jax.jit(lambda p, s: osa.update_and_apply(tx, grads, s, p))
    m0 = v0 = m1 = v1 = np.zeros(3)
    ref0, ref1 = var0.astype(np.float64), var1.astype(np.float64)
    for t in range(1, 4):
        params, state = step(params, state)
        ref0, m0, v0 = _lazy_adam_update_numpy(ref0, idx, g0.astype(np.float64), t, m0, v0)
        ref1, m1, v1 = _lazy_adam_update_numpy(ref1, idx, g1.astype(np.float64), t, m1, v1)
        tol = 1e-3 if dtype == np.float16 else 1e-6  # TF's assertAllCloseAccordingToType
        np.testing.assert_allclose(np.asarray(params["var0"], np.float64), ref0, rtol=tol, atol=tol)
        np.testing.assert_allclose(np.asarray(params["var1"], np.float64), ref1, rtol=tol, atol=tol)
    assert params["var0"][1] == 1.0 and params["var1"][1] == 3.0  # the untouched row never moves


def test_lazy_adam_repeated_indices_as_tf_addons(kernel_path):
    """TF Addons' ``test_sparse_repeated_indices``: ``[1, 1]`` with 0.1 each equals ``[1]`` with 0.2, bitwise."""
    tx = osa.sparse_adam(0.001, eps_placement="torch")
    repeated = osa.IndexedRows(jnp.array([1, 1], jnp.int32), jnp.array([[0.1], [0.1]], jnp.float32), 2)
    summed = osa.IndexedRows(jnp.array([1], jnp.int32), jnp.array([[0.2]], jnp.float32), 2)
    results = []
    for g in (repeated, summed):
        p = jnp.array([[1.0], [2.0]], jnp.float32)
        s = tx.init(p)
        for _ in range(3):
            p, s = jax.jit(osa.update_and_apply, static_argnums=0)(tx, g, s, p)
        results.append((p, s))
    assert_trees_equal(results[0], results[1])


@pytest.mark.parametrize("learning_rate", [0.05, optax.linear_schedule(0.05, 0.01, 4)], ids=["constant", "schedule"])
def test_the_learning_rate_inside_adams_pass_is_the_chain(kernel_path, learning_rate):
    """sparse_adam applies its learning rate inside Adam's pass (on the rows kernel, to the step rows it writes);
    its updates and state are bitwise those of chain(scale_by_sparse_adam, sparse_aware(scale_by_learning_rate)),
    on sparse leaves with duplicates and padding, a lazy_dense leaf and a dense one, step after step."""
    is_lazy = {"emb": False, "lazy": True, "w": False}
    ours = osa.sparse_adam(learning_rate, lazy_dense=is_lazy)
    chain = optax.chain(
        osa.scale_by_sparse_adam(lazy_dense=is_lazy), osa.sparse_aware(optax.scale_by_learning_rate(learning_rate))
    )
    rng = np.random.default_rng(3)
    params = {
        "emb": jnp.asarray(rng.standard_normal((50, 4)), jnp.float32),
        "lazy": jnp.asarray(rng.standard_normal((6, 4)), jnp.float32),
        "w": jnp.asarray(rng.standard_normal((3,)), jnp.float32),
    }
    states = [ours.init(params), chain.init(params)]
    for _ in range(4):
        ids = jnp.asarray(rng.integers(-2, 53, 24), jnp.int32)
        lazy = np.zeros((6, 4), np.float32)
        lazy[rng.integers(0, 6, 2)] = rng.standard_normal((2, 4))
        grads = {
            "emb": osa.IndexedRows(ids, jnp.asarray(rng.standard_normal((24, 4)), jnp.float32), 50),
            "lazy": jnp.asarray(lazy),
            "w": jnp.asarray(rng.standard_normal((3,)), jnp.float32),
        }
        out = [jax.jit(tx.update)(grads, s, params) for tx, s in zip((ours, chain), states, strict=True)]
        (u1, s1), (u2, s2) = out
        assert_trees_equal((s1, u1["lazy"], u1["w"]), (s2, u2["lazy"], u2["w"]))
        np.testing.assert_array_equal(u1["emb"].todense(), u2["emb"].todense())
        states = [s1, s2]
        params = osa.apply_updates(params, u1)
