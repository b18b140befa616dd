"""bfloat16 and float16 tables on the fused row-wise kernels: against the two calls on the XLA path.

``update_and_apply`` runs row-wise Adagrad and row-wise Adam (float32 state) on a 16-bit table in one pass per
touched row: the parameters widened to float32, the rule computed there, ``p + u`` rounded once to the table's
dtype, to nearest (``apply_updates``) or stochastically with the draws of ``apply_updates_stochastic``. The
reference is ``tx.update`` then ``apply_updates`` / ``apply_updates_stochastic`` on the XLA path, from the same
state: the state as the float32 kernels' bounds allow, and the parameters bitwise but where ``p + u`` in float32
differs by the float32 rounding that XLA's own fusion choices already allow on float32 tables, which moves a
16-bit result by at most one of its ulps, rarely.
"""

from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_sparse_adam as osa
from optax_sparse_adam import _ffi
from optax_sparse_adam._stochastic_rounding import _draws, _round_with, leaf_seeds
from tests.helpers import assert_trees_equal, jit_once, needs_kernels, spread

ROWS, WIDTH, K = 48, 24, 96
HALF = {"bfloat16": jnp.bfloat16, "float16": jnp.float16}
OPTIMIZERS = {
    "adagrad": lambda: osa.sparse_rowwise_adagrad(0.05),
    "adagrad-l2": lambda: osa.sparse_rowwise_adagrad(0.05, weight_decay=0.01),
    "adagrad-decoupled": lambda: osa.sparse_rowwise_adagrad(0.05, weight_decay=0.01, weight_decay_mode="decoupled"),
    "rowwise-adam": lambda: osa.sparse_rowwise_adam(0.01, mu_dtype=jnp.float32),
    "rowwise-adam-per-row": lambda: osa.sparse_rowwise_adam(0.01, mu_dtype=jnp.float32, per_row_bias_correction=True),
}
KERNEL = {"adagrad": "rowwise_adagrad_apply", "rowwise": "rowwise_adam_apply"}


@functools.cache
def _tx(name: str) -> optax.GradientTransformation:
    return OPTIMIZERS[name]()


def _kernel(name: str) -> str:
    return KERNEL[name.split("-")[0]]


def _bits(x) -> np.ndarray:
    return np.asarray(x).view(np.uint16).astype(np.int64)


def _ulps(a, b) -> np.ndarray:
    """How many 16-bit values apart, per entry (finite values of one sign, as here)."""
    return np.abs(_bits(a) - _bits(b))


@functools.cache
def _steps(name: str, stochastic: bool, unique: bool = False):
    """The fused step and the two calls, jitted: ``(p, state, ids, values, key) -> (p, state)``."""
    tx = _tx(name)

    def fused(p, s, ids, values, key):
        g = osa.IndexedRows(ids, values, ROWS, unique_indices=unique)
        return osa.update_and_apply(tx, g, s, p, key=key if stochastic else None)

    def two_calls(p, s, ids, values, key):
        updates, s = tx.update(osa.IndexedRows(ids, values, ROWS, unique_indices=unique), s, p)
        if stochastic:
            return osa.apply_updates_stochastic(p, updates, key), s
        return osa.apply_updates(p, updates), s

    return jax.jit(fused), jax.jit(two_calls)


def _case(rng, dtype, values_dtype):
    """A table, and ids with duplicates and padding (negative, past the end, int32's extremes) mixed in, and their
    values."""
    p = jnp.asarray(rng.standard_normal((ROWS, WIDTH)), dtype)
    ids = rng.integers(-3, ROWS + 3, K).astype(np.int32)
    ids[: K // 3] = ids[rng.integers(0, K, K // 3)]
    ids[rng.integers(0, K, 2)] = [np.iinfo(np.int32).min, np.iinfo(np.int32).max]
    values = rng.standard_normal((K, WIDTH)).astype(np.float32)
    return p, jnp.asarray(ids), jnp.asarray(values, values_dtype)


def _warm_state(tx, p, rng):
    """A state some steps in (moments and counts away from their initial values), on the XLA path."""
    s = tx.init(p)
    with osa.use_kernels(False):
        for _ in range(3):
            ids = jnp.asarray(rng.integers(0, ROWS, K), jnp.int32)
            values = jnp.asarray(rng.standard_normal((K, WIDTH)), jnp.float32)
            _, s = jax.jit(tx.update)(osa.IndexedRows(ids, values, ROWS), s, p)
    return s


def _compare(fused, xla, p0) -> None:
    """The state as the float32 kernels' bounds allow (here: relatively, 4e-6); the parameters within one ulp of
    their dtype, in at most 2% of the entries."""
    (pf, sf), (px, sx) = fused, xla
    assert pf.dtype == px.dtype == p0.dtype
    ulps = _ulps(pf, px)
    assert ulps.max() <= 1, ulps.max()
    assert (ulps > 0).mean() <= 0.02, (ulps > 0).mean()
    assert_trees_equal(sf, sx, rtol=4e-6, atol=1e-30)


@needs_kernels
@pytest.mark.parametrize(
    ("name", "dtype", "values_dtype", "stochastic"),
    # Every optimizer on both half floats, each case's complement beside it: all eight options across them.
    spread(
        sorted(OPTIMIZERS),
        [
            ("bfloat16", "float32", False),
            ("float16", "table", True),
            ("bfloat16", "table", True),
            ("float16", "float32", False),
            ("bfloat16", "float32", True),
            ("float16", "table", False),
            ("bfloat16", "table", False),
            ("float16", "float32", True),
        ],
        per=2,
    ),
    ids=lambda x: {False: "nearest", True: "stochastic"}.get(x) if isinstance(x, bool) else None,
)
def test_fused_step_on_a_half_float_table_equals_the_two_calls(name, dtype, values_dtype, stochastic):
    rng = np.random.default_rng(zlib.crc32(repr((name, dtype, values_dtype, stochastic)).encode()))  # str hashes vary
    dt = HALF[dtype]
    p, ids, values = _case(rng, dt, jnp.float32 if values_dtype == "float32" else dt)
    s = _warm_state(_tx(name), p, rng)
    key = jax.random.key(5)
    fused, two_calls = _steps(name, stochastic)
    with osa.use_kernels(True):
        assert _kernel(name) in fused.lower(p, s, ids, values, key).as_text()
        got = fused(p, s, ids, values, key)
    with osa.use_kernels(False):
        want = two_calls(p, s, ids, values, key)
    _compare(got, want, p)
    touched = np.zeros(ROWS, bool)
    touched[np.asarray(ids)[(np.asarray(ids) >= 0) & (np.asarray(ids) < ROWS)]] = True
    assert np.array_equal(_bits(got[0])[~touched], _bits(p)[~touched])  # untouched rows: bitwise as they were


@needs_kernels
@pytest.mark.parametrize("dtype", sorted(HALF))
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_rounding_is_bitwise_that_of_the_xla_path(dtype, stochastic):
    """Width 1 (element-wise Adagrad, one division a row on both paths): ``p + u`` is the same float32 value on
    both, so the rounding is compared bitwise, over parameters across the dtype's range (zeros of both signs,
    subnormals, the largest finite values, where a step overflows, infinities, NaN) and rows not touched."""
    dt = HALF[dtype]
    finfo = jnp.finfo(dt)
    rng = np.random.default_rng(7)
    edges = [0.0, -0.0, float(finfo.smallest_subnormal), -3 * float(finfo.smallest_subnormal), float(finfo.max)]
    edges += [-float(finfo.max), float(finfo.tiny), np.inf, -np.inf, np.nan, 1.0, -1.0, 2.0**-8, 1000.0]
    rows = 4096
    p = np.concatenate([edges, rng.standard_normal(rows - len(edges)) * 10.0 ** rng.integers(-6, 4, rows - len(edges))])
    p = jnp.asarray(p.reshape(rows, 1), dt)
    tx = osa.sparse_rowwise_adagrad(float(finfo.eps) / 3, eps=1e-30)  # steps of +-1: lr below the spacing at 1
    s = tx.init(p)
    ids = jnp.arange(rows - 64, dtype=jnp.int32)  # the last 64 rows untouched
    values = jnp.asarray(rng.choice([-1.0, 1.0], (rows - 64, 1)) * 10.0 ** rng.integers(-3, 3, (rows - 64, 1)))
    values = values.astype(jnp.float32)
    key = jax.random.key(2)

    def step(p, s, ids, values, key):
        g = osa.IndexedRows(ids, values, rows)
        return osa.update_and_apply(tx, g, s, p, key=key if stochastic else None)

    def two_calls(p, s, ids, values, key):
        updates, s = tx.update(osa.IndexedRows(ids, values, rows), s, p)
        return (osa.apply_updates_stochastic(p, updates, key) if stochastic else osa.apply_updates(p, updates)), s

    with osa.use_kernels(True):
        assert "rowwise_adagrad_apply" in jax.jit(step).lower(p, s, ids, values, key).as_text()
        got = jax.jit(step)(p, s, ids, values, key)
    with osa.use_kernels(False):
        want = jax.jit(two_calls)(p, s, ids, values, key)
    assert_trees_equal(got[1], want[1])
    # Widened to float32 (exactly), so that NaNs compare equal whatever their payload; the rest bitwise.
    np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32), strict=True)
    finite = np.isfinite(np.asarray(want[0], np.float32))
    assert np.array_equal(_bits(got[0])[finite], _bits(want[0])[finite])  # zeros' signs too


@needs_kernels
@pytest.mark.parametrize("dtype", sorted(HALF))
def test_the_kernels_draws_are_those_of_apply_updates_stochastic(dtype):
    """The kernel's rounding on its own, bitwise: ``_round_with`` on ``_draws``' draws, with the seeds
    of the leaf's key, for a step whose float32 sums are computed alike (lr 1, a step of one row's entries over
    their own root mean square: a row of equal magnitudes has a step of exactly +-1)."""
    dt = HALF[dtype]
    rng = np.random.default_rng(3)
    p = jnp.asarray(rng.standard_normal((ROWS, WIDTH)), dt)
    key = jax.random.fold_in(jax.random.key(9), 0)
    ids = jnp.asarray(rng.permutation(ROWS)[:20], jnp.int32)
    values = jnp.asarray(rng.choice([-0.5, 0.5], (20, WIDTH)), jnp.float32)
    scalars = jnp.array([0.0, 0.0, -(2.0**-12)], jnp.float32)  # eps 0, no decay, neg_lr
    seeds = leaf_seeds(key, 0)

    def apply(p, acc):
        return _ffi.rowwise_adagrad_apply(p, acc, ids, values, scalars, seeds, decay=0, unique=2)

    with osa.use_kernels(True):
        got, _ = jax.jit(apply)(p, jnp.zeros((ROWS,), jnp.float32))
    x = p[ids].astype(jnp.float32) + jnp.float32(-(2.0**-12)) * jnp.sign(values)
    want = p.at[ids].set(_round_with(x, dt, _draws(seeds, ids[:, None], (WIDTH,))))
    assert_trees_equal(got, want)


@needs_kernels
@pytest.mark.parametrize("name", ["adagrad-l2", "rowwise-adam-per-row"])
def test_threads_promise_and_chunks_give_the_same_numbers(name):
    """Rows split over threads, a kept and a broken ``unique_indices`` promise: the same bits."""
    rng = np.random.default_rng(11)
    p, ids, values = _case(rng, jnp.bfloat16, jnp.float32)
    s = _warm_state(_tx(name), p, rng)
    key = jax.random.key(1)
    out = []
    for threads, unique in ((1, False), (4, False), (4, True)):
        fused, _ = _steps(name, True, unique)
        with osa.use_kernels(True, threads=threads):
            out.append(fused(p, s, ids, values, key))
    assert_trees_equal(out[0], out[1])
    assert_trees_equal(out[0], out[2])  # the broken promise (duplicates) summed as without it


@needs_kernels
@pytest.mark.parametrize("name", ["adagrad", "rowwise-adam"])
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_in_place_under_donation_and_compiled_once(stochastic, name):
    """Donated, the 16-bit table is updated in place: one kernel call, temporaries of the batch's size only."""
    tx = _tx(name)
    rows = 200_000
    p = jnp.zeros((rows, 32), jnp.bfloat16)
    s = tx.init(p)
    ids = jnp.zeros((256,), jnp.int32)
    values = jnp.ones((256, 32), jnp.float32)
    key = jax.random.key(0)

    def step(p, s, ids, values, key):
        return osa.update_and_apply(tx, osa.IndexedRows(ids, values, rows), s, p, key=key if stochastic else None)

    report = osa.step_report(jax.jit(step, donate_argnums=(0, 1)), p, s, ids, values, key, min_bytes=rows * 4)
    assert report.in_place, str(report)
    assert report.kernel_path == "native-cpu" and report.kernel_calls == 1, str(report)
    once = jit_once(step, donate_argnums=(0, 1))
    for i in range(3):
        p, s = once(p, s, ids + i, values, jax.random.fold_in(key, i))
    assert float(p[0].astype(jnp.float32).sum()) != 0.0


@needs_kernels
def test_a_row_sharded_half_float_table_runs_the_kernel_on_each_shard():
    """Rows split over 8 devices: each runs the kernel on its own rows (the seeds keyed by the global row), and
    the result is that of one device."""
    rng = np.random.default_rng(13)
    name = "rowwise-adam"
    p, ids, values = _case(rng, jnp.bfloat16, jnp.float32)
    s = _tx(name).init(p)
    key = jax.random.key(4)
    fused, _ = _steps(name, True)
    with osa.use_kernels(True):
        whole = fused(p, s, ids, values, key)
        mesh = jax.make_mesh((8,), ("rows",), axis_types=(jax.sharding.AxisType.Auto,))
        rows = jax.NamedSharding(mesh, jax.P("rows"))
        sharded = jax.tree.map(lambda x: jax.device_put(x, rows) if x.ndim and x.shape[0] == ROWS else x, (p, s))
        got = fused(*sharded, ids, values, key)
    assert_trees_equal(jax.device_get(got), jax.device_get(whole))


@needs_kernels
@pytest.mark.parametrize("name", ["adagrad", "rowwise-adam"])
def test_vmapped_fused_steps_equal_each_alone(name):
    rng = np.random.default_rng(17)
    cases = [_case(rng, jnp.bfloat16, jnp.float32) for _ in range(2)]
    ps, ids, values = (jnp.stack(x) for x in zip(*cases, strict=True))
    s = jax.vmap(_tx(name).init)(ps)
    keys = jax.random.split(jax.random.key(6), 2)
    fused, _ = _steps(name, True)
    with osa.use_kernels(True):
        assert _kernel(name) in jax.jit(jax.vmap(fused)).lower(ps, s, ids, values, keys).as_text()
        batched = jax.jit(jax.vmap(fused))(ps, s, ids, values, keys)
        alone = [fused(ps[i], jax.tree.map(lambda x, i=i: x[i], s), ids[i], values[i], keys[i]) for i in range(2)]
    assert_trees_equal(batched, jax.tree.map(lambda *x: jnp.stack(x), *alone))


@needs_kernels
def test_empty_batch_changes_nothing():
    for name in ("adagrad", "rowwise-adam"):
        tx = _tx(name)
        p = jnp.asarray(np.random.default_rng(0).standard_normal((ROWS, WIDTH)), jnp.float16)
        s = tx.init(p)
        g = osa.IndexedRows(jnp.zeros((0,), jnp.int32), jnp.zeros((0, WIDTH), jnp.float32), ROWS)
        with osa.use_kernels(True):
            new_p, _ = jax.jit(lambda p, s, g, tx=tx: osa.update_and_apply(tx, g, s, p, key=jax.random.key(0)))(p, s, g)
        assert np.array_equal(_bits(new_p), _bits(p))


@needs_kernels
def test_a_bfloat16_first_moment_and_wrapped_stochastic_steps_take_the_two_calls():
    """What the kernels do not take runs the two calls: a bfloat16 ``mu`` (row-wise Adam's ``mu_dtype=None`` on a
    bfloat16 table), and a stochastic step under a wrapper (``inject_hyperparams``)."""
    p = jnp.ones((ROWS, WIDTH), jnp.bfloat16)
    g = osa.IndexedRows(jnp.array([1, 1, 3], jnp.int32), jnp.ones((3, WIDTH), jnp.float32), ROWS)
    key = jax.random.key(0)
    for tx in (osa.sparse_rowwise_adam(0.01), optax.inject_hyperparams(osa.sparse_rowwise_adagrad)(learning_rate=0.1)):
        s = tx.init(p)
        fn = jax.jit(lambda p, s, g, k, tx=tx: osa.update_and_apply(tx, g, s, p, key=k))
        with osa.use_kernels(True):
            hlo = fn.lower(p, s, g, key).as_text()
            assert "rowwise_adagrad_apply" not in hlo and "rowwise_adam_apply" not in hlo
            got = fn(p, s, g, key)
        updates, s2 = jax.jit(tx.update)(g, s, p)
        assert_trees_equal(got, (jax.jit(osa.apply_updates_stochastic)(p, updates, key), s2))


@needs_kernels
@pytest.mark.parametrize("values_dtype", ["float32", "bfloat16"])
def test_a_clipped_chain_on_a_half_float_table(values_dtype):
    """``chain(sparse_aware(clip_by_global_norm), sparse_rowwise_adagrad)``: float32 gradients are summed and
    clipped by the fused kernel; bfloat16 ones are summed and clipped in bfloat16 by the stage (as the two calls
    do), and the kernel takes the clipped rows widened. Both equal the two calls on the XLA path within the bounds
    above."""
    tx = optax.chain(osa.sparse_aware(optax.clip_by_global_norm(0.5)), osa.sparse_rowwise_adagrad(0.05))
    rng = np.random.default_rng(21)
    p, ids, values = _case(rng, jnp.bfloat16, HALF.get(values_dtype, jnp.float32))
    s = tx.init(p)

    def fused(p, s, ids, values):
        return osa.update_and_apply(tx, osa.IndexedRows(ids, values, ROWS), s, p)

    def two_calls(p, s, ids, values):
        updates, s = tx.update(osa.IndexedRows(ids, values, ROWS), s, p)
        return osa.apply_updates(p, updates), s

    with osa.use_kernels(True):
        hlo = jax.jit(fused).lower(p, s, ids, values).as_text()
        assert "rowwise_adagrad_apply" in hlo
        got = jax.jit(fused)(p, s, ids, values)
    with osa.use_kernels(False):
        want = jax.jit(two_calls)(p, s, ids, values)
    _compare(got, want, p)


def test_leaf_seeds_depend_on_the_key_and_the_leaf_and_take_raw_keys():
    """Two uint32 seeds from the key's data and the leaf's position, by integer hashing (no threefry): different
    for another leaf or another key, equal for a raw key of the same data."""
    k = jax.random.key(3)
    seeds = [leaf_seeds(k, 0), leaf_seeds(k, 1), leaf_seeds(jax.random.fold_in(k, 1), 0)]
    assert all(s.dtype == jnp.uint32 and s.shape == (2,) for s in seeds)
    assert len({tuple(np.asarray(s).tolist()) for s in seeds}) == 3 and seeds[0][0] != seeds[0][1]
    assert_trees_equal(leaf_seeds(jax.random.PRNGKey(3), 0), seeds[0])
    hlo = jax.jit(leaf_seeds, static_argnums=1).lower(k, 0).as_text()
    assert "threefry" not in hlo and "while" not in hlo
