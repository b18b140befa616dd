"""Stochastic rounding of low-precision parameter updates: unbiased, deterministic, lazy."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import optax_sparse_adam as osa
from optax_sparse_adam._stochastic_rounding import _round_with, leaf_seeds
from tests.helpers import ON_CPU, assert_trees_equal, needs_kernels


@functools.cache
def _round_4000(dtype):
    """``stochastic_round`` of 4,000 copies of a value, jitted: every example of a dtype shares one compilation."""
    return jax.jit(lambda x: osa.stochastic_round(jnp.full((4000,), x, jnp.float32), dtype, jax.random.key(0)))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@settings(max_examples=20, deadline=None)
@given(x=st.floats(-1e3, 1e3, allow_nan=False, width=32))
def test_rounds_to_a_neighbour_without_bias(dtype, x):
    y = np.asarray(_round_4000(dtype)(np.float32(x)).astype(jnp.float32))
    near = float(jnp.asarray(x, jnp.float32).astype(dtype).astype(jnp.float32))
    values = set(np.unique(y).tolist())
    assert near in values and len(values) <= 2  # only the two neighbours of x
    if len(values) == 2:
        lo, hi = min(values), max(values)
        assert lo <= x <= hi
        p_hi = (x - lo) / (hi - lo)  # the mean is x, within 5 binomial standard deviations
        assert abs(np.mean(y == hi) - p_hi) <= 5 * np.sqrt(p_hi * (1 - p_hi) / y.size) + 1e-9
    if near == np.float32(x):
        assert values == {near}  # exactly representable: unchanged


@pytest.mark.parametrize(
    "x",
    [1.0 + 2.0**-10 + 2.0**-20, -3.3e-3, 1.37 * 2.0**-130, -(2.0**-149), 1.99999, 3.3e38, -1.2345678e38],
    ids=["normal", "negative", "subnormal", "smallest subnormal", "below a power of two", "top binade", "large"],
)
def test_bfloat16_rounds_up_with_probability_exactly_its_distance_over_the_gap(x):
    """Over all 2**16 draws that bfloat16's rule tells apart (a draw's top 16 bits), the rounded values average to
    ``x`` exactly: unbiased to the last bit, subnormals, carries into the next binade and the top binade included
    (2**16 values of two neighbours sum exactly in float64)."""
    x = np.float32(x)
    bits = jnp.arange(2**16, dtype=jnp.uint32) << 16
    y = jax.jit(_round_with, static_argnums=1)(jnp.full((2**16,), x), jnp.bfloat16, bits)
    assert len(np.unique(np.asarray(y, np.float32))) == 2
    assert np.asarray(y, np.float64).mean() == np.float64(x)


def test_special_values_round_to_nearest():
    """As ``astype`` rounds them, bit for bit (the NaN's payload is the platform's: XLA:GPU gives 0x7fff)."""
    x = jnp.array([jnp.inf, -jnp.inf, jnp.nan, 0.0, -0.0], jnp.float32)
    y = jax.jit(osa.stochastic_round, static_argnums=1)(x, jnp.bfloat16, jax.random.key(1))
    assert np.asarray(y).tobytes() == np.asarray(x.astype(jnp.bfloat16)).tobytes()
    assert np.isnan(np.asarray(y, np.float32)[2])


def test_sparse_draws_follow_the_rows_not_the_order_of_the_ids(kernel_path):
    """Each touched row draws by its id: shuffled ids, duplicates split apart and padding give the same result.

    The packed order of the summed rows differs between these batches (and between the kernel paths, and on GPUs
    from run to run), so draws taken by packed slot would differ.
    """
    rng = np.random.default_rng(0)
    p = jnp.asarray(rng.standard_normal((50, 16)), jnp.bfloat16)
    ids = np.array([3, 17, 42, 8, 0, 49], np.int32)
    steps = (rng.standard_normal((6, 16)) * 1e-2).astype(np.float32)
    half = np.float32(0.5) * steps  # exact halves: the split rows sum back to steps bitwise
    order = rng.permutation(14)
    shuffled_ids = np.concatenate([ids, ids, [-1, -1]])[order]
    shuffled = np.concatenate([half, half, np.ones((2, 16), np.float32)])[order]
    key = jax.random.key(7)
    apply = jax.jit(osa.apply_updates_stochastic)  # eager and jitted agree: test_deterministic_given_the_key...
    a = apply(p, osa.IndexedRows(jnp.asarray(ids), jnp.asarray(steps), 50), key)
    b = apply(p, osa.IndexedRows(jnp.asarray(shuffled_ids), jnp.asarray(shuffled), 50), key)
    assert_trees_equal(a, b)
    moved = np.asarray(a, np.float32) != np.asarray(p, np.float32)
    assert moved[ids].any() and not np.delete(moved, ids, axis=0).any()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_every_element_of_a_sparse_update_rounds_up_at_its_rate_step_after_step(dtype, kernel_path):
    """Each element lying a fraction ``f`` of the way from 1 to the next value rounds up in a fraction ``f`` of 400
    steps with fresh keys (binomial, within 5 sigma, every element of every row), and the rows draw apart: the draws
    of a sparse update are uniform in each element from step to step, whatever the rest of the row draws."""
    rows, width, steps = 8, 64, 400
    gap = float(jnp.finfo(dtype).eps)  # the spacing above 1
    rng = np.random.default_rng(0)
    f = rng.uniform(0.05, 0.95, (rows, width)).astype(np.float32)
    f[:, : width // 2] = 0.3  # half of each row alike
    p = jnp.ones((rows, width), dtype)
    g = osa.IndexedRows(jnp.arange(rows, dtype=jnp.int32), jnp.asarray(f * gap), rows)
    apply = jax.jit(osa.apply_updates_stochastic)
    ups = np.stack(
        [np.asarray(apply(p, g, jax.random.fold_in(jax.random.key(3), t)), np.float32) > 1 for t in range(steps)]
    )
    rate_sd = np.sqrt(steps * f * (1 - f))
    assert np.all(np.abs(ups.sum(0) - steps * f) <= 5 * rate_sd), np.max(np.abs(ups.sum(0) - steps * f) / rate_sd)
    alike = ups[:, :, : width // 2]  # (steps, rows, 32) of rate 0.3: rows round different elements up
    assert np.mean(np.all(alike[:, 0] == alike[:, 1], axis=-1)) < 0.05


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_values_past_the_largest_finite_round_to_nearest_on_both_sides(dtype):
    big = float(jnp.finfo(dtype).max)
    past = [1e6, 7e4] if dtype == jnp.float16 else []  # overflow in float16, not in bfloat16
    x = jnp.array([float(jnp.finfo(jnp.float32).max), big * 1.0001, big, *past], jnp.float32)
    x = jnp.concatenate([x, -x])
    y = jax.jit(osa.stochastic_round, static_argnums=1)(x, dtype, jax.random.key(2))
    np.testing.assert_array_equal(np.asarray(y.astype(jnp.float32)), np.asarray(x.astype(dtype).astype(jnp.float32)))
    table = jnp.zeros((2, x.shape[0]), dtype)
    update = osa.IndexedRows(jnp.array([0, 1], jnp.int32), jnp.stack([x, -x]), 2)
    np.testing.assert_array_equal(
        np.asarray(jax.jit(osa.apply_updates_stochastic)(table, update, jax.random.key(3)).astype(jnp.float32)),
        np.asarray(jax.jit(osa.apply_updates)(table, update).astype(jnp.float32)),
    )


def test_deterministic_given_the_key_and_lazy_on_sparse_updates():
    p = {"emb": jnp.ones((6, 64), jnp.bfloat16), "w": jnp.ones((64,), jnp.float32)}
    u = {
        "emb": osa.IndexedRows(jnp.array([1, 4, 1, -1], jnp.int32), jnp.full((4, 64), 5e-4, jnp.float32), 6),
        "w": jnp.full((64,), 1e-3, jnp.float32),
    }
    apply = jax.jit(osa.apply_updates_stochastic)
    a = apply(p, u, jax.random.key(3))
    b = osa.apply_updates_stochastic(p, u, jax.random.key(3))  # eager: the same draws as jitted
    c = apply(p, u, jax.random.key(4))
    assert_trees_equal(a, b)
    assert not np.array_equal(np.asarray(a["emb"], np.float32), np.asarray(c["emb"], np.float32))
    emb = np.asarray(a["emb"], np.float32)
    assert emb.dtype == np.float32 and a["emb"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(emb[[0, 2, 3, 5]], 1.0)  # untouched rows unchanged
    assert set(np.unique(emb[[1, 4]]).tolist()) == {1.0, 1.0078125}  # a 1e-3 step rounds up now and then
    np.testing.assert_allclose(emb[1].mean(), 1.001, atol=0.002)  # row 1: two 5e-4 entries summed
    np.testing.assert_array_equal(a["w"], osa.apply_updates(p["w"], u["w"]))  # float32 leaves: plain add


def test_small_steps_survive_where_round_to_nearest_loses_them():
    p = jnp.ones((1, 512), jnp.bfloat16)
    u = jnp.full((1, 512), -2e-4, jnp.float32)  # 1/20 of bf16's spacing below 1
    nearest, stochastic = p, p
    apply, apply_stochastic = jax.jit(osa.apply_updates), jax.jit(osa.apply_updates_stochastic)  # one compile each
    for step in range(200):
        nearest = apply(nearest, u)
        stochastic = apply_stochastic(stochastic, u, jax.random.fold_in(jax.random.key(0), step))
    np.testing.assert_array_equal(np.asarray(nearest, np.float32), 1.0)  # stalled
    np.testing.assert_allclose(np.asarray(stochastic, np.float32).mean(), 1 - 200 * 2e-4, atol=2e-3)


def test_errors_name_the_path():
    p = {"emb": jnp.ones((3, 2), jnp.bfloat16)}
    with pytest.raises(ValueError, match=r"parameter \['emb'\]: update shape"):
        osa.apply_updates_stochastic(p, {"emb": jnp.ones((3, 3), jnp.float32)}, jax.random.key(0))
    with pytest.raises(ValueError, match=r"parameter \['emb'\]"):
        bad = osa.IndexedRows(jnp.array([0]), jnp.ones((1, 2), jnp.float32), 4)
        osa.apply_updates_stochastic(p, {"emb": bad}, jax.random.key(0))


# ------------------------------------------------------------------------ low-precision tables, rounded to nearest


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("values_dtype", [jnp.float32, jnp.bfloat16])
def test_sparse_updates_of_half_float_tables_round_once_as_a_dense_update(dtype, values_dtype, kernel_path):
    """``osa.apply_updates`` of rows with duplicates and padding equals ``optax.apply_updates`` of the dense update
    (``(p + u).astype(p.dtype)``: one rounding), bit for bit, not a sum of entries each rounded to the table."""
    rng = np.random.default_rng(8)
    p = jnp.asarray(rng.standard_normal((60, 8)), dtype)
    ids = jnp.asarray(np.concatenate([rng.integers(0, 60, 40), [-1, 60, 3, 3]]), jnp.int32)
    values = jnp.asarray(rng.standard_normal((44, 8)) * 3e-3, values_dtype)  # small: rounding decides the result
    u = osa.IndexedRows(ids, values, 60)
    got = jax.jit(osa.apply_updates)(p, u)
    # The dense update: the entries summed in their own dtype, in entry order from 0 (as the sparse path sums them).
    dense = jax.jit(lambda u: u.todense())(u)
    want = optax.apply_updates(p, dense)
    assert got.dtype == dtype and np.asarray(got).tobytes() == np.asarray(want).tobytes()
    # and not the sum of the entries each rounded to the table's dtype first
    rounded = jax.jit(lambda p, u: p.at[u.indices].add(u.values.astype(p.dtype), mode="drop"))(p, u)
    assert np.asarray(got).tobytes() != np.asarray(rounded).tobytes()
    valid = (np.asarray(ids) >= 0) & (np.asarray(ids) < 60)
    moved = np.asarray(got, np.float32) != np.asarray(p, np.float32)
    assert moved.any() and not moved[np.setdiff1d(np.arange(60), np.asarray(ids)[valid])].any()


@pytest.mark.parametrize("stochastic", [False, True])
def test_a_half_float_table_step_is_in_place(stochastic, kernel_path):
    """A bfloat16 table's step (``tx.update``, then its rows applied) writes only the touched rows: no temporary of
    the table's size on the native path (XLA:CPU's own scatter into it converts the whole table to float32) and on a
    GPU (XLA:GPU scatters into it in place)."""
    table = jnp.zeros((200_000, 32), jnp.bfloat16)
    tx = osa.sparse_rowwise_adam(1e-3, mu_dtype=jnp.float32)

    def step(p, s, ids, v, key):
        u, s = tx.update(osa.IndexedRows(ids, v, 200_000), s, p)
        return (osa.apply_updates_stochastic(p, u, key) if stochastic else osa.apply_updates(p, u)), s

    args = (table, tx.init(table), jnp.arange(64, dtype=jnp.int32), jnp.ones((64, 32), jnp.float32), jax.random.key(0))
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(*args).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert (temp < table.nbytes // 4) == (kernel_path == "native-cpu" or not ON_CPU), temp


def test_update_and_apply_with_a_key_rounds_half_float_tables_stochastically(kernel_path):
    """With ``key``: the two calls with ``apply_updates_stochastic`` where a parameter is bfloat16 or float16, the
    usual step (fused on the kernels) where none is; without, round to nearest."""
    rng = np.random.default_rng(9)
    ids = jnp.asarray(rng.integers(-1, 100, 32), jnp.int32)
    g = osa.IndexedRows(ids, jnp.asarray(rng.standard_normal((32, 16)), jnp.float32), 100)
    tx = osa.sparse_rowwise_adam(1e-3, mu_dtype=jnp.float32)
    key = jax.random.key(11)
    for dtype in (jnp.bfloat16, jnp.float32):
        p = {"emb": jnp.asarray(rng.standard_normal((100, 16)), dtype), "w": jnp.ones((4,), jnp.float32)}
        grads = {"emb": g, "w": jnp.ones((4,), jnp.float32)}
        s = tx.init(p)
        fused = jax.jit(lambda p, s, g, k: osa.update_and_apply(tx, g, s, p, key=k))(p, s, grads, key)
        u, s2 = jax.jit(tx.update)(grads, s, p)
        rounded = jax.jit(osa.apply_updates_stochastic)(p, u, key)
        plain = jax.jit(lambda p, s, g: osa.update_and_apply(tx, g, s, p))(p, s, grads)
        assert_trees_equal(fused[1], s2)
        if dtype == jnp.bfloat16:
            assert_trees_equal(fused[0], rounded)
            assert np.asarray(fused[0]["emb"]).tobytes() != np.asarray(plain[0]["emb"]).tobytes()
        else:
            assert_trees_equal(fused[0], plain[0])  # float32 tables: the key changes nothing


@pytest.mark.parametrize("stochastic", [False, True])
def test_a_broken_unique_indices_promise_sums_its_duplicates_on_half_float_tables(stochastic, kernel_path):
    """As the kernels sum a broken promise's duplicates on float32 tables: the rows are summed, not the last set."""
    p = jnp.zeros((4, 8), jnp.bfloat16)
    u = osa.IndexedRows(jnp.array([1, 1, 2], jnp.int32), jnp.ones((3, 8), jnp.float32), 4, unique_indices=True)
    if stochastic:
        got = jax.jit(osa.apply_updates_stochastic)(p, u, jax.random.key(0))
    else:
        got = jax.jit(osa.apply_updates)(p, u)
    np.testing.assert_array_equal(np.asarray(got, np.float32), [[0] * 8, [2] * 8, [1] * 8, [0] * 8])


def _half_table_batch(rng: np.random.Generator, rows: int, tail: tuple[int, ...], dtype: Any):
    """A 16-bit table ``p`` holding an infinity, a NaN, a negative zero and a subnormal (float16's; bfloat16's are
    float32 subnormals, which XLA:CPU's threads, and so the kernels, flush), and float32 update rows ``u`` at ``ids``
    with duplicates (a row summed six times), padding and int32 extremes, and a sum past the dtype's range."""
    p = np.asarray(rng.standard_normal((rows, *tail)) * 10, dtype)
    flat = p.reshape(rows, -1)
    flat[0, :1], flat[1, :1], flat[2, :1] = np.inf, np.nan, -0.0
    tiny = np.finfo(dtype).smallest_subnormal if dtype == jnp.float16 else np.finfo(dtype).smallest_normal
    flat[3, :1] = tiny
    ids = rng.integers(0, rows, 40).astype(np.int32)
    ids[:8] = [0, 1, 2, 3, 4, np.iinfo(np.int32).min, np.iinfo(np.int32).max, rows]
    ids[8:14] = 5
    values = rng.standard_normal((40, *tail)).astype(np.float32) * 10
    v = values.reshape(40, -1)
    v[4, :1] = float(np.finfo(dtype).max)  # past the dtype's range: to infinity
    v[3, :1] = float(tiny)
    return p, ids, osa.IndexedRows(jnp.asarray(ids), jnp.asarray(values), rows)


@needs_kernels
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("tail", [(1,), (), (513,), (3, 4)])
def test_the_half_table_add_kernel_equals_the_xla_path(dtype, tail):
    """``apply_updates`` of float32 rows into a 16-bit table on the native kernel (``add_rows_half``): bitwise a
    NumPy loop of the rule (each touched element ``(p + u).astype(p.dtype)``, ``u`` the summed rows, rounded to
    nearest even once), with duplicates, padding and int32 extremes, NaN, infinities, sums past the dtype's range,
    subnormals and a negative zero in the table; the same bits on 1 and 4 threads, under vmap, donated in place,
    and for an empty batch. The XLA path is within an ulp of the table: inside its program XLA:CPU may add the
    summed entries onto ``p`` one by one (seen at width 513, a tie rounded the other way), where the rule adds
    their sum."""
    rng = np.random.default_rng([60, len(tail), sum(tail), jnp.dtype(dtype).itemsize])
    rows = 50
    p, ids, u = _half_table_batch(rng, rows, tail, dtype)
    summed = np.asarray(jax.jit(lambda u: u.todense())(u))  # the entries summed from zero in entry order
    touched = np.isin(np.arange(rows), ids)
    want = p.copy()
    want[touched] = (p[touched].astype(np.float32) + summed[touched]).astype(dtype)
    _check_half_kernel(osa.apply_updates, "add_rows_half", p, u, want, rng)


def _fmix32(x: np.ndarray) -> np.ndarray:
    """murmur3's 32-bit finalizer, in NumPy's wrapping uint32 arithmetic."""
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x85EBCA6B)
    x = x ^ (x >> np.uint32(13))
    x = x * np.uint32(0xC2B2AE35)
    return x ^ (x >> np.uint32(16))


@needs_kernels
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("tail", [(), (513,), (3, 4)])
def test_the_half_table_stochastic_kernel_equals_the_rule(dtype, tail):
    """``apply_updates_stochastic`` of float32 rows into a 16-bit table on the native kernel
    (``add_rows_half_stochastic``): bitwise the rule computed apart, each touched element ``p + u`` (``u`` the
    summed rows, from zero in entry order) formed in float32 and rounded by ``_round_with`` with the draws of a NumPy
    loop (the row's seed murmur3's finalizer over its id and the leaf's two seeds, each element's draw that seed
    plus its position times the golden ratio), with duplicates, padding and int32 extremes, NaN, infinities, sums
    past the dtype's range, subnormals and a negative zero in the table; the same bits on 1 and 4 threads, under
    vmap, donated in place, split by rows over 8 devices, and for an empty batch. The XLA path is within an ulp of
    the table (its sums may round apart: see test_the_half_table_add_kernel_equals_the_xla_path)."""
    rng = np.random.default_rng([61, len(tail), sum(tail), jnp.dtype(dtype).itemsize])
    rows = 50
    p, ids, u = _half_table_batch(rng, rows, tail, dtype)
    flat = p.reshape(rows, -1)
    key = jax.random.key(21)
    # The rule: the sums, the draws by row id, _round_with.
    summed = np.asarray(jax.jit(lambda u: u.todense())(u)).reshape(rows, -1)
    touched = np.flatnonzero(np.isin(np.arange(rows), ids))
    s0, s1 = (np.uint32(s) for s in np.asarray(leaf_seeds(key, 0)))
    seed = _fmix32(_fmix32(touched.astype(np.uint32) ^ s0) ^ s1)
    position = np.arange(flat.shape[1], dtype=np.uint32) * np.uint32(0x9E3779B9)
    bits = seed[:, None] + position[None, :]
    x = flat[touched].astype(np.float32) + summed[touched]
    want = flat.copy()
    want[touched] = np.asarray(_round_with(jnp.asarray(x), dtype, jnp.asarray(bits)))
    want = want.reshape(p.shape)
    _check_half_kernel(osa.apply_updates_stochastic, "add_rows_half_stochastic", p, u, want, rng, key)


def _check_half_kernel(apply, kernel, p, u, want, rng, key=None):
    """A 16-bit table's add kernel (``kernel``, run by ``apply(table, update[, key])``): bitwise ``want`` on 1 and 4
    threads, the XLA path within an ulp of the table (inside its program XLA:CPU may add a row's summed entries onto
    ``p`` one by one, seen at width 513 to round a tie the other way, where the rule adds their sum); donated, in
    place (no temporary of the table's size), under vmap (each table with a key of its own), on a table split by rows
    over 8 devices (the kernel on each shard, the same bits as on one) and for an empty batch."""
    rows, tail, dtype = p.shape[0], p.shape[1:], p.dtype
    keys = () if key is None else (key,)
    step = jax.jit(apply, donate_argnums=(0,))
    outs = {}
    for kernels, threads in ((False, None), (True, 1), (True, 4)):
        with osa.use_kernels(kernels, threads=threads):
            assert (kernel + '"' in step.lower(jnp.asarray(p), u, *keys).compile().as_text()) == kernels
            outs[kernels, threads] = np.asarray(step(jnp.asarray(p), u, *keys))
    assert outs[True, 1].dtype == dtype and outs[True, 1].tobytes() == outs[True, 4].tobytes()
    nan = np.isnan(want.astype(np.float32))
    assert np.array_equal(np.isnan(outs[True, 1].astype(np.float32)), nan)
    assert outs[True, 1][~nan].tobytes() == want[~nan].tobytes()
    xla = outs[False, None].astype(np.float32)
    finite = np.isfinite(want.astype(np.float32))
    assert np.array_equal(xla[~finite], want.astype(np.float32)[~finite], equal_nan=True)
    with np.errstate(over="ignore"):  # the spacing at the dtype's largest value is infinite
        ulp = np.spacing(np.abs(want[finite]).astype(dtype)).astype(np.float32)
    assert np.all(np.abs(xla[finite] - want[finite].astype(np.float32)) <= ulp)
    big = jnp.zeros((200_000, 32), dtype)
    small = osa.IndexedRows(jnp.arange(64, dtype=jnp.int32), jnp.ones((64, 32), jnp.float32), 200_000)
    assert step.lower(big, small, *keys).compile().memory_analysis().temp_size_in_bytes < big.nbytes // 4
    tables = jnp.asarray(rng.standard_normal((3, rows, *tail)), dtype)
    stacked = osa.IndexedRows(
        jnp.asarray(rng.integers(-1, rows + 1, (3, 9)), jnp.int32),
        jnp.asarray(rng.standard_normal((3, 9, *tail)), jnp.float32),
        rows,
    )
    split = () if key is None else (jax.random.split(key, 3),)
    batched = jax.jit(jax.vmap(apply))(tables, stacked, *split)
    for b in range(3):
        one = jax.tree.map(lambda x, b=b: x[b], stacked)
        alone = apply(tables[b], one, *(k[b] for k in split))
        assert np.asarray(batched[b]).tobytes() == np.asarray(alone).tobytes()
    mesh = jax.make_mesh((8,), ("rows",), axis_types=(jax.sharding.AxisType.Auto,))
    by_rows = jax.sharding.NamedSharding(mesh, jax.P("rows"))
    u48 = osa.IndexedRows(u.indices, u.values, 48)
    placed = jax.device_put(jnp.asarray(p[:48]), by_rows)
    jitted = jax.jit(apply)
    assert kernel + '"' in jitted.lower(placed, u48, *keys).compile().as_text()
    sharded = jitted(placed, u48, *keys)
    assert sharded.sharding.is_equivalent_to(by_rows, sharded.ndim)
    assert np.asarray(sharded).tobytes() == np.asarray(jitted(jnp.asarray(p[:48]), u48, *keys)).tobytes()
    empty = osa.IndexedRows(jnp.zeros((0,), jnp.int32), jnp.zeros((0, *tail), jnp.float32), rows)
    assert np.asarray(jitted(jnp.asarray(p), empty, *keys)).tobytes() == p.tobytes()
