"""Row-wise Adam's native CPU kernels: against a NumPy loop of their arithmetic, and against the XLA path.

The kernels (``csrc/rowwise.cc``) compute the rule of ``scale_by_rowwise_adam`` with a fixed order for each
row's sum of squares; the XLA path sums in an order XLA chooses by shape and CPU. So the NumPy loop here (the
kernel's documented arithmetic, float32 operation by operation) is compared bitwise, and the XLA path within the
bounds ``scale_by_rowwise_adam`` states, one step from the same state: ``mu`` and the row counts bitwise, ``nu``
within a few ulps, the step within a few ulps of itself.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_sparse_adam as osa
from optax_sparse_adam import _ffi, _kernel_path
from optax_sparse_adam._rowwise import rowwise_adam_corrections, rowwise_adam_scalars
from tests.helpers import assert_trees_equal, jit_once, needs_kernels
from tests.test_rowwise_kernels import _batch, _fma, _row_sum_of_squares, _spacing, assert_non_finite_as_on_the_xla_path

ROWS, LR, B1, B2, EPS = 37, 0.05, 0.9, 0.999, 1e-8
F32 = np.float32
NU_ULPS = 6  # nu against the XLA path (scale_by_rowwise_adam states 3, measured; half as much again allowed)
STEP_ULPS = 6  # the step, of itself (nu's few ulps reach it halved, through the square root)
MODES = {"global": False, "per_row": True}


@functools.cache  # one object for equal arguments: the tests share their compiled steps (see _step)
def _tx(mode: str, lr=LR, **kw):
    return osa.sparse_rowwise_adam(lr, b1=B1, b2=B2, eps=EPS, per_row_bias_correction=MODES[mode], **kw)


def _state(s):
    return optax.tree.get(s, "ScaleByRowwiseAdamState")


def _start(tx, rng: np.random.Generator, tail: tuple[int, ...], rows: int = ROWS):
    """Parameters and a state three steps on, moments nonzero (and row counts from 0 to 4)."""
    shape = (rows, *tail)
    p = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    s = tx.init(p)
    st = _state(s)._replace(
        count=jnp.int32(3),
        mu=jnp.asarray(rng.standard_normal(shape) * 0.1, jnp.float32),
        nu=jnp.asarray(rng.random(rows) * 0.5, jnp.float32),
    )
    if not isinstance(st.row_count, optax.EmptyState):
        st = st._replace(row_count=jnp.asarray(rng.integers(0, 5, rows), jnp.int32))
    return p, optax.tree.set(s, ScaleByRowwiseAdamState=st)


@functools.cache  # one function for equal arguments: jax.jit of it traces and compiles once for equal shapes
def _step(tx, fused: bool, unique: bool = False, num_rows: int = ROWS):
    """The step to jit: ``(params, state, update or None)``, as two calls or as update_and_apply."""

    def step(p, s, ids, values):
        g = osa.IndexedRows(ids, values, num_rows, unique_indices=unique)
        if fused:
            return (*osa.update_and_apply(tx, g, s, p), None)
        updates, s = tx.update(g, s, p)
        return osa.apply_updates(p, updates), s, updates

    return step


def _one_step(tx, p, s, ids, values, *, fused: bool, unique: bool = False, threads: int | None = None):
    """One step on the kernels (asserting that they run) and on the XLA path (two calls), from the same state."""
    args = (p, s, jnp.asarray(ids), jnp.asarray(values))
    with osa.use_kernels(True, threads=threads):
        step = jax.jit(_step(tx, fused, unique))
        hlo = step.lower(*args).as_text()
        assert ("rowwise_adam_apply" if fused else "rowwise_adam_rows") in hlo
        native = step(*args)
    with osa.use_kernels(False):
        xla = jax.jit(_step(tx, False, unique))(*args)
    return native, xla


def _assert_within_bounds(native, xla, p0: np.ndarray, lr: float = LR) -> None:
    """mu and the row counts bitwise, nu within NU_ULPS, the update within STEP_ULPS of itself, the parameters
    within two ulps of themselves plus that."""
    (pn, sn, un), (px, sx, ux) = native, xla
    a, b = _state(sn), _state(sx)
    np.testing.assert_array_equal(a.mu, b.mu)
    assert_trees_equal(a.row_count, b.row_count)
    nn, nx = np.asarray(a.nu), np.asarray(b.nu)
    assert np.all(np.abs(nn - nx) <= NU_ULPS * _spacing(np.maximum(nn, nx))), np.max(np.abs(nn - nx))
    px = np.asarray(px)
    step = np.abs(px.astype(np.float64) - p0) / lr  # the XLA path's step, to within its own rounding
    step_tol = STEP_ULPS * _spacing(step) + 2 * _spacing(np.maximum(np.abs(p0), np.abs(px))) / lr
    if un is not None and ux is not None:
        dn, dx = np.asarray(un.todense()), np.asarray(ux.todense())
        assert np.all(np.abs(dn - dx) <= lr * step_tol + 2 * _spacing(dx)), np.max(np.abs(dn - dx))
    tol = 2 * _spacing(np.maximum(np.abs(p0), np.abs(px))) + lr * step_tol
    assert np.all(np.abs(np.asarray(pn) - px) <= tol), np.max(np.abs(np.asarray(pn) - px) / tol)


# --- Against the XLA path. ---


@needs_kernels
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_non_finite_and_extreme_values_as_on_the_xla_path(mode, fused):
    """NaN, infinities, the largest floats (their squares overflow a row's sum), subnormals and -0.0 among
    duplicates and padding, two steps (test_rowwise_kernels' batches): NaN and infinity where the XLA path has
    them, its numbers elsewhere."""
    assert_non_finite_as_on_the_xla_path(_tx(mode), _start, _step, "rowwise_adam", fused=fused)


@needs_kernels
@pytest.mark.parametrize("tail", [(1,), (), (5,), (64,), (513,), (3, 4)], ids=lambda t: "x".join(map(str, t)) or "1d")
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("kind", ["dups", "promised", "extreme"])
def test_native_within_the_stated_bounds_of_xla(tail, mode, kind):
    rng = np.random.default_rng([len(tail), sum(tail), len(mode), len(kind), 1])
    tx = _tx(mode)
    p, s = _start(tx, rng, tail)
    # The extremes repeated to the size of the duplicates' batch: the two kinds share their compiled steps.
    ids, values = _batch(rng, kind, {"dups": 48, "promised": 30, "extreme": 48}[kind], tail)
    for fused, threads in ((False, 1), (True, 4)):
        native, xla = _one_step(tx, p, s, ids, values, fused=fused, unique=kind == "promised", threads=threads)
        _assert_within_bounds(native, xla, np.asarray(p))
        rows = np.zeros(ROWS, bool)
        rows[ids[(ids >= 0) & (ids < ROWS)]] = True
        old, new = _state(s), _state(native[1])
        np.testing.assert_array_equal(np.asarray(new.nu)[~rows], np.asarray(old.nu)[~rows])  # untouched: bitwise
        np.testing.assert_array_equal(np.asarray(new.mu)[~rows], np.asarray(old.mu)[~rows])
        np.testing.assert_array_equal(np.asarray(native[0])[~rows], np.asarray(p)[~rows])


@needs_kernels
def test_per_row_corrections_in_64_bit_mode_are_the_rules():
    """In jax's 64-bit mode the rule computes ``1 - b^c`` for Python-float betas in float64: the kernels are then given
    XLA's corrections instead of computing their own in float32, and stay within the bounds of the XLA path."""
    with jax.enable_x64(True):
        rng = np.random.default_rng(43)
        tx = _tx("per_row")
        p, s = _start(tx, rng, (5,))
        ids, values = _batch(rng, "dups", 48, (5,))
        for fused in (False, True):
            native, xla = _one_step(tx, p, s, ids, values, fused=fused)
            _assert_within_bounds(native, xla, np.asarray(p))
        hlo = jax.jit(_step(tx, True)).lower(p, s, jnp.asarray(ids), jnp.asarray(values)).as_text()
    # p, mu, nu, keys, values, scalars, seeds, row_begin, then the row counts and the corrections: ten operands
    assert re.search(r"rowwise_adam_apply\(([^,)]*,){9}[^,)]*\)", hlo), "the corrections are not passed"


@needs_kernels
@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_large_batch_in_chunks(mode):
    """2,048 entries: the XLA path runs the rule chunk by chunk."""
    rng = np.random.default_rng(31)
    tx = _tx(mode, eps_root=1e-12)
    p, s = _start(tx, rng, (64,))
    ids, values = _batch(rng, "dups", 2048, (64,))
    for fused in (False, True):
        native, xla = _one_step(tx, p, s, ids, values, fused=fused)
        _assert_within_bounds(native, xla, np.asarray(p))


@needs_kernels
@pytest.mark.parametrize("mode", sorted(MODES))
def test_without_a_row_sum_bitwise_xla(mode):
    """Width 1 (and a 1-D parameter) has no row sum: the kernels' numbers are the XLA path's, bit for bit."""
    rng = np.random.default_rng(32)
    for tail in ((1,), ()):
        tx = _tx(mode)
        p, s = _start(tx, rng, tail)
        ids, values = _batch(rng, "dups", 48, tail)
        # The threads of test_native_within_the_stated_bounds_of_xla: the same compiled steps.
        for fused, threads in ((False, 1), (True, 4)):
            native, xla = _one_step(tx, p, s, ids, values, fused=fused, threads=threads)
            assert_trees_equal(native[:2], xla[:2])


@needs_kernels
def test_per_row_corrections_of_counts_far_apart_bitwise_xla():
    """Row counts from 0 to 1282 in one batch, in any order, with duplicates (the other tests' counts are 0 to 4):
    each row gets its own count's corrections. Width 1 has no row sum, so the numbers are the XLA path's, bit for
    bit (the kernel's powf is the function XLA:CPU calls for the power)."""
    rng = np.random.default_rng(37)
    tx = _tx("per_row")
    p, s = _start(tx, rng, (1,))
    counts = 256 * (np.arange(ROWS) % 6) + np.arange(ROWS) // 6 % 3  # 0 to 1282
    s = optax.tree.set(s, ScaleByRowwiseAdamState=_state(s)._replace(row_count=jnp.asarray(counts, jnp.int32)))
    for seed in range(3):
        ids = np.random.default_rng(seed).permutation(np.concatenate([np.arange(ROWS), np.arange(0, ROWS, 4)]))
        values = np.random.default_rng(seed).standard_normal((ids.size, 1)).astype(np.float32)
        for fused, threads in ((False, 1), (True, 1), (True, 3)):
            native, xla = _one_step(tx, p, s, ids.astype(np.int32), values, fused=fused, threads=threads)
            assert_trees_equal(native[:2], xla[:2])


@needs_kernels
@pytest.mark.parametrize("k", [0, 1])
@pytest.mark.parametrize("fused", [False, True])
def test_empty_and_single_entry_batches(k, fused):
    rng = np.random.default_rng(33)
    tx = _tx("per_row")
    p, s = _start(tx, rng, (5,))
    ids, values = _batch(rng, "dups", 1, (5,))
    ids, values = ids[:k] * 0 + 4, values[:k]
    native, xla = _one_step(tx, p, s, ids, values, fused=fused)
    _assert_within_bounds(native, xla, np.asarray(p))
    if k == 0:
        assert_trees_equal(native[0], p)
        assert_trees_equal(_state(native[1])._replace(count=0), _state(s)._replace(count=0))


@needs_kernels
@pytest.mark.parametrize("mode", sorted(MODES))
def test_schedule_steps_fused_and_in_two_calls(mode):
    """A schedule's count advances once a step; the fused step equals the two calls (both on the kernels), and
    the XLA path within float32 noise, several steps on (bias corrections early in training)."""
    tx = _tx(mode, lr=optax.linear_schedule(0.1, 0.01, 10))
    rng = np.random.default_rng(34)
    p0 = jnp.asarray(rng.standard_normal((ROWS, 5)), jnp.float32)
    batches = [tuple(map(jnp.asarray, _batch(rng, "dups", 32, (5,)))) for _ in range(4)]
    out = {}
    for name, kernels, fused in (("fused", True, True), ("two", True, False), ("xla", False, False)):
        p, s = p0, tx.init(p0)
        with osa.use_kernels(kernels):
            step = jax.jit(_step(tx, fused))
            for ids, values in batches:
                p, s, _ = step(p, s, ids, values)
        out[name] = (p, s)
    assert int(optax.tree.get(out["fused"][1], "ScaleByScheduleState").count) == 4
    assert_trees_equal(out["fused"], out["two"])
    assert_trees_equal(out["fused"], out["xla"], rtol=2e-6, atol=1e-7)


@needs_kernels
@pytest.mark.parametrize("fused", [False, True])
def test_threads_give_the_same_numbers(fused):
    """Distinct rows split over threads (4 parts of a few hundred rows here): the same numbers on any count."""
    rng = np.random.default_rng(35)
    tx, rows = _tx("per_row"), 1000
    p, s = _start(tx, rng, (16,), rows)
    ids, values = _batch(rng, "dups", 4096, (16,), rows)
    args = (p, s, jnp.asarray(ids), jnp.asarray(values))
    out = []
    for threads in (1, 4):
        with osa.use_kernels(True, threads=threads):
            out.append(jax.jit(_step(tx, fused, num_rows=rows))(*args)[:2])
    assert_trees_equal(out[0], out[1])


@needs_kernels
@pytest.mark.parametrize("fused", [False, True])
def test_a_broken_unique_promise_is_summed_like_no_promise(fused):
    """The kernels check a user's ``unique_indices=True``: duplicates are summed (a row counted once), never raced
    over threads."""
    rng = np.random.default_rng(36)
    tx = _tx("per_row")
    p, s = _start(tx, rng, (16,))
    ids, values = _batch(rng, "dups", 4096, (16,))
    args = (p, s, jnp.asarray(ids), jnp.asarray(values))
    with osa.use_kernels(True, threads=4):
        promised = jax.jit(_step(tx, fused, unique=True))(*args)
        plain = jax.jit(_step(tx, fused, unique=False))(*args)
    assert_trees_equal(promised[:2], plain[:2])


def test_row_counts_saturate():
    """A row count at the int32 maximum stays there (optax.safe_increment), on both paths."""
    tx = _tx("per_row")
    p = jnp.ones((ROWS, 4), jnp.float32)
    s = tx.init(p)
    top = np.iinfo(np.int32).max
    s = optax.tree.set(s, ScaleByRowwiseAdamState=_state(s)._replace(row_count=jnp.full((ROWS,), top, jnp.int32)))
    g = osa.IndexedRows(jnp.array([2, 2, 5], jnp.int32), jnp.ones((3, 4), jnp.float32), ROWS)
    for kernels in (True, False):
        with osa.use_kernels(kernels):
            for fn in (lambda: tx.update(g, s, p)[1], lambda: osa.update_and_apply(tx, g, s, p)[1]):
                assert int(jnp.min(_state(jax.jit(fn)()).row_count)) == top


# --- Against a NumPy loop of the kernels' arithmetic, bitwise. ---


def _numpy_rule(p, mu, nu, count, ids, values, scalars, bc, apply: bool):
    """The kernels' arithmetic, float32 operation by operation, entry by entry; returns (p, mu, nu, count, keys,
    steps). ``count``/``bc``: per-row bias correction (else None)."""
    p, mu, nu = p.reshape(p.shape[0], -1).copy(), mu.reshape(mu.shape[0], -1).copy(), nu.copy()
    count = None if count is None else count.copy()
    values = values.reshape(values.shape[0], -1)
    width = p.shape[1]
    b1, omb1, b2, omb2, eps, eps_root, bc1g, bc2g, neg_lr = (F32(x) for x in scalars)
    order: list[int] = []
    first: dict[int, int] = {}
    summed: dict[int, np.ndarray] = {}
    for i, key in enumerate(ids):
        if 0 <= key < p.shape[0]:
            if key not in summed:
                order.append(int(key))
                first[key] = i
                summed[key] = F32(0) + values[i]
            else:
                summed[key] = summed[key] + values[i]
    steps = np.zeros_like(values)
    for d, key in enumerate(order):
        g = summed[key]
        bc1, bc2 = (bc1g, bc2g) if count is None else (F32(bc[first[key], 0]), F32(bc[first[key], 1]))
        if count is not None:
            count[key] = min(int(count[key]) + 1, np.iinfo(np.int32).max)
        ms = g[0] * g[0] if width == 1 else _row_sum_of_squares(g) * (F32(1) / F32(width))
        nu[key] = _fma(omb2, ms, b2 * nu[key])
        vc = nu[key] / bc2 if count is not None else nu[key] * (F32(1) / bc2)
        denom = np.sqrt(vc + eps_root) + eps
        mn = _fma(omb1, g, b1 * mu[key])
        mu[key] = mn
        if width == 1:
            step = mn / (bc1 * denom) if count is not None else (mn * (F32(1) / bc1)) / denom
        else:
            step = (mn * (F32(1) / bc1)) * (F32(1) / denom)
        steps[d] = neg_lr * step  # the rows handler's step rows: times neg_lr, the factor it scales them by
        if apply:
            p[key] = p[key] + neg_lr * step
    keys = np.array(order + [p.shape[0]] * (len(ids) - len(order)), np.int32)
    return p, mu, nu, count, keys, steps


@needs_kernels
@pytest.mark.parametrize("tail", [(1,), (5,), (64,), (100,), (513,), (3, 4)], ids=lambda t: "x".join(map(str, t)))
@pytest.mark.parametrize("mode", [*sorted(MODES), "per_row_given"])
def test_kernels_equal_a_numpy_loop_of_their_arithmetic(tail, mode):
    """Each handler against a NumPy loop of its arithmetic, bitwise; with per-row bias correction, the corrections
    computed by the kernel (``per_row``: the row counts alone) or given (``per_row_given``: XLA's, as the rule computes
    them in 64-bit mode), the loop taking XLA's either way."""
    given = mode == "per_row_given"
    mode = "per_row" if given else mode
    rng = np.random.default_rng([len(tail), sum(tail), len(mode), 37])
    p = rng.standard_normal((ROWS, *tail)).astype(F32)
    mu = (rng.standard_normal((ROWS, *tail)) * 0.1).astype(F32)
    nu = (rng.random(ROWS) * 0.5).astype(F32)
    count = rng.integers(0, 5, ROWS).astype(np.int32) if MODES[mode] else None
    ids, values = _batch(rng, "dups", 48, tail)
    scalars = rowwise_adam_scalars(B1, B2, EPS, 1e-12, jnp.int32(4), -LR)
    per_row = None
    bc = None
    if count is not None:
        bc = rowwise_adam_corrections(B1, B2, jnp.asarray(count), jnp.asarray(ids))
        per_row = (jnp.asarray(count), bc) if given else (jnp.asarray(count),)
    want = _numpy_rule(p, mu, nu, count, ids, values, np.asarray(scalars), None if bc is None else np.asarray(bc), True)
    args = (jnp.asarray(ids), jnp.asarray(values), scalars, per_row)
    with osa.use_kernels(True, threads=4):
        got_p, got_mu, got_nu, *got_count = jax.jit(_ffi.rowwise_adam_apply, static_argnames="unique")(
            jnp.asarray(p), jnp.asarray(mu), jnp.asarray(nu), *args, unique=0
        )
        rows = jax.jit(_ffi.rowwise_adam_rows, static_argnames="unique")
        mu2, nu2, keys, steps, *count2 = rows(jnp.asarray(mu), jnp.asarray(nu), *args, unique=0)
    np.testing.assert_array_equal(np.asarray(got_p).reshape(ROWS, -1), want[0])
    for got_m, got_v, got_c in ((got_mu, got_nu, got_count), (mu2, nu2, count2)):
        np.testing.assert_array_equal(np.asarray(got_m).reshape(ROWS, -1), want[1])
        np.testing.assert_array_equal(got_v, want[2])
        if count is not None:
            np.testing.assert_array_equal(got_c[0], want[3])
    np.testing.assert_array_equal(keys, want[4])
    np.testing.assert_array_equal(np.asarray(steps).reshape(len(ids), -1), want[5])


def test_the_numpy_loop_is_the_rule():
    """The NumPy loop above against the rule in float64 (tests.reference), to float32 rounding."""
    from tests.reference import LazyVariantReference

    rng = np.random.default_rng(38)
    for mode, rule in (("global", "rowwise_adam"), ("per_row", "rowwise_adam_per_row")):
        p = rng.standard_normal((ROWS, 7)).astype(F32)
        ref = LazyVariantReference(p, rule, lr=LR, b1=B1, b2=B2, eps=EPS)
        ids, values = _batch(rng, "dups", 48, (7,))
        ref.step(list(ids), list(values))
        zeros = np.zeros_like(p)
        count = np.zeros(ROWS, np.int32) if MODES[mode] else None
        scalars = np.asarray(rowwise_adam_scalars(B1, B2, EPS, 0.0, jnp.int32(1), -LR))
        bc = None if count is None else np.asarray(rowwise_adam_corrections(B1, B2, jnp.asarray(count), ids))
        got_p, got_mu, got_nu, *_ = _numpy_rule(p, zeros, np.zeros(ROWS, F32), count, ids, values, scalars, bc, True)
        np.testing.assert_allclose(got_nu, ref.row_v, rtol=1e-6)
        np.testing.assert_allclose(got_mu, ref.m, rtol=1e-6, atol=1e-9)
        # In float32 (as the rule computes them) (1 - b2) / (1 - b2^t) is 1.3e-5 from 1 at t = 1: the step, up to
        # sqrt(7) in a row of 7, is off by half that, relatively.
        np.testing.assert_allclose(got_p, ref.p, rtol=1e-6, atol=LR * 2.7 * 0.7e-5)


# --- Where the kernels run, in place, and where they do not. ---


def _step_args(tx, rows: int, width: int, k: int = 256):
    table = jnp.zeros((rows, width), jnp.float32)
    return table, tx.init(table), jnp.zeros((k,), jnp.int32), jnp.ones((k, width), jnp.float32)


@needs_kernels
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("fused", [False, True])
def test_in_place_under_donation_and_compiled_once(mode, fused):
    """Donated, the tables and moments are updated in place: no copy of any, temporaries of the batch's size."""
    tx = _tx(mode)
    temps = {}
    for rows in (1_000, 100_000):
        step = jax.jit(_step(tx, fused, num_rows=rows), donate_argnums=(0, 1))
        args = _step_args(tx, rows, 16)
        temps[rows] = step.lower(*args).compile().memory_analysis().temp_size_in_bytes
    report = osa.step_report(step, *args, min_bytes=100_000 * 4)  # per-row state counts as table-sized
    assert report.in_place, str(report)
    # + apply_updates' scatter; per-row bias correction's corrections are the kernel's own (no gather of the counts)
    assert report.kernel_path == "native-cpu" and report.kernel_calls == 1 + (not fused), str(report)
    assert temps[100_000] == temps[1_000] < 1_000 * 16 * 4
    once = jit_once(_step(tx, fused), donate_argnums=(0, 1))
    rng = np.random.default_rng(39)
    p, s = _start(tx, rng, (5,))
    for _ in range(3):
        ids, values = _batch(rng, "dups", 16, (5,))
        p, s, _ = once(p, s, jnp.asarray(ids), jnp.asarray(values))


@needs_kernels
def test_other_dtypes_take_the_xla_path():
    """A bfloat16 first moment (or table) is the XLA path's."""
    ids = jnp.array([1, 1], jnp.int32)
    for tx, dtype in ((_tx("global", mu_dtype=jnp.bfloat16), jnp.float32), (_tx("global"), jnp.bfloat16)):
        p = jnp.ones((ROWS, 5), dtype)
        g = osa.IndexedRows(ids, jnp.ones((2, 5), dtype), ROWS)
        s = tx.init(p)
        for fn in (tx.update, lambda g, s, p, tx=tx: osa.update_and_apply(tx, g, s, p)):
            assert "rowwise_adam" not in jax.jit(fn).lower(g, s, p).as_text()


@needs_kernels
def test_wrapped_in_inject_hyperparams_fuses():
    """``inject_hyperparams(sparse_rowwise_adam)``: the fused kernel runs, and equals the two calls."""
    tx = optax.inject_hyperparams(osa.sparse_rowwise_adam)(learning_rate=LR, per_row_bias_correction=True)
    rng = np.random.default_rng(40)
    p = jnp.asarray(rng.standard_normal((ROWS, 5)), jnp.float32)
    ids, values = map(jnp.asarray, _batch(rng, "dups", 24, (5,)))
    s = tx.init(p)
    fused = jax.jit(lambda p, s: osa.update_and_apply(tx, osa.IndexedRows(ids, values, ROWS), s, p))
    assert "rowwise_adam_apply" in fused.lower(p, s).as_text()
    two = jax.jit(lambda p, s: _step(tx, False)(p, s, ids, values)[:2])
    assert_trees_equal(fused(p, s), two(p, s))


@needs_kernels
@pytest.mark.parametrize("case", ["update", "update_and_apply"])
def test_differentiated_steps_take_the_xla_path(case):
    rng = np.random.default_rng(41)
    tx = _tx("per_row")
    p, s = _start(tx, rng, (5,))
    ids, values = map(jnp.asarray, _batch(rng, "dups", 12, (5,)))

    def loss(p, s):
        return jnp.sum(jnp.sin(p)) + jnp.sum(jnp.sqrt(_state(s).nu + 1.0)) + jnp.sum(_state(s).mu ** 2)

    def f(x):
        g = osa.IndexedRows(ids, x[1], ROWS)
        if case == "update":
            updates, s2 = tx.update(g, s, x[0])
            return loss(osa.apply_updates(x[0], updates), s2)
        return loss(*osa.update_and_apply(tx, g, s, x[0]))

    x = (p, values)
    tangent = jax.tree.map(jnp.ones_like, x)
    out = {}
    for kernels in (True, False):
        with osa.use_kernels(kernels):
            grad = jax.jit(jax.grad(f))
            assert "rowwise_adam" not in grad.lower(x).as_text()  # primal and tangents: the XLA path
            # Forward mode op by op on the kernels; the reference jitted (the same computation).
            jvp = (
                (lambda x, t: jax.jvp(f, (x,), (t,))[1]) if kernels else jax.jit(lambda x, t: jax.jvp(f, (x,), (t,))[1])
            )
            out[kernels] = (grad(x), jvp(x, tangent))
    assert_trees_equal(out[True], out[False], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_lowers_for_gpu_and_tpu_without_the_cpu_kernel(fused, platform):
    tx = _tx("per_row")
    traced = jax.jit(_step(tx, fused)).trace(*_step_args(tx, ROWS, 5, k=8))
    cpu = traced.lower(lowering_platforms=("cpu",)).as_text()
    assert ("rowwise_adam" in cpu) == _kernel_path.enabled()
    assert "rowwise_adam" not in traced.lower(lowering_platforms=(platform,)).as_text()


@needs_kernels
@pytest.mark.parametrize("mode", sorted(MODES))
def test_row_sharded_table_stays_sharded(mode):
    """Table and state split by rows over 8 devices: each device updates its own rows, as on one."""
    mesh = jax.make_mesh((8,), ("rows",), axis_types=(jax.sharding.AxisType.Auto,))
    by_rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("rows"))
    tx, num_rows = _tx(mode), 96
    rng = np.random.default_rng(42)
    p0 = jnp.asarray(rng.standard_normal((num_rows, 5)), jnp.float32)
    batches = [tuple(map(jnp.asarray, _batch(rng, "dups", 48, (5,), num_rows))) for _ in range(2)]
    for fused in (False, True):
        outs = []
        for shard in (False, True):
            p, s = p0, tx.init(p0)
            if shard:
                s = jax.tree.map(lambda x: jax.device_put(x, by_rows) if x.ndim else x, s)
                p = jax.device_put(p, by_rows)
            step = jax.jit(_step(tx, fused, num_rows=num_rows))
            assert "rowwise_adam" in step.lower(p, s, *batches[0]).compile().as_text()
            for ids, values in batches:
                p, s, _ = step(p, s, ids, values)
            if shard:
                assert p.sharding.is_equivalent_to(by_rows, 2)
                assert _state(s).nu.sharding.is_equivalent_to(by_rows, 1)
            outs.append((p, s))
        assert_trees_equal(*outs)


@needs_kernels
def test_vmapped_step_equals_the_unbatched_steps():
    """Under vmap the kernels run once per batch element."""
    tx = _tx("per_row")
    rng = np.random.default_rng(43)
    starts = [_start(tx, rng, (5,)) for _ in range(2)]
    batches = [tuple(map(jnp.asarray, _batch(rng, "dups", 8, (5,)))) for _ in range(2)]
    stacked = jax.tree.map(lambda *x: jnp.stack(x), *[(*a, *b) for a, b in zip(starts, batches, strict=True)])
    for fused in (False, True):
        step = _step(tx, fused)
        out = jax.jit(jax.vmap(lambda *a, step=step: step(*a)[:2]))(*stacked)
        for i in range(2):
            one = jax.jit(step)(*starts[i], *batches[i])[:2]
            assert_trees_equal(jax.tree.map(lambda x, i=i: x[i], out), one)
