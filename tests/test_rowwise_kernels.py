"""Row-wise Adagrad's native CPU kernels: against a NumPy loop of their arithmetic, and against the XLA path.

The kernels (``csrc/rowwise.cc``) compute the rule of ``scale_by_rowwise_adagrad`` with a fixed order
for each row's sum of squares; the XLA path sums in an order XLA chooses by shape and CPU. So the NumPy loop
here (the kernel's documented arithmetic, float32 operation by operation) is compared bitwise, and the XLA
path within the bounds ``scale_by_rowwise_adagrad`` states, one step from the same state.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_sparse_adam as osa
from optax_sparse_adam import _ffi, _kernel_path
from optax_sparse_adam._rowwise import adagrad_scalars
from tests.helpers import assert_same_non_finite, assert_trees_equal, jit_once, needs_kernels, non_finite_values

ROWS, LR, WD, EPS = 37, 0.05, 0.3, 1e-10
F32 = np.float32
# Bounds against the XLA path, in ulps, one step from the same state (scale_by_rowwise_adagrad states what was
# measured: 4 and 4; these allow half as much again, as XLA's order of a row sum changes with the CPU):
ACC_ULPS = 6  # the accumulators
STEP_ULPS = 6  # the step, of itself; plus, with L2 decay, STEP_SUM_ULPS of r * (|wd p| + sum |g_e|)
STEP_SUM_ULPS = 1
MODES = {
    "none": {},
    "l2": {"weight_decay": WD},
    "decoupled": {"weight_decay": WD, "weight_decay_mode": "decoupled"},
}
DECAY = {"none": 0, "l2": 1, "decoupled": 2}


@functools.cache  # one object for equal arguments: the tests share their compiled steps (see _step)
def _tx(mode: str, lr=LR):
    return osa.sparse_rowwise_adagrad(lr, eps=EPS, **MODES[mode])


def _batch(rng: np.random.Generator, kind: str, k: int, tail: tuple[int, ...], rows: int = ROWS):
    """Ids and values: duplicates and padding mixed in, distinct ids, or int32 extremes as padding."""
    if kind in ("distinct", "promised"):
        ids = (rng.permutation(rows + 6)[:k] - 3).astype(np.int32)  # a few padding ids, -3 to rows + 2
    elif kind == "extreme":
        ids = np.resize(np.array([np.iinfo(np.int32).min, 3, np.iinfo(np.int32).max, rows, -1, 3], np.int32), k)
    else:
        ids = rng.integers(-3, rows + 3, k).astype(np.int32)
        ids[: k // 3] = ids[rng.integers(0, k, k // 3)]
    values = rng.standard_normal((k, *tail)).astype(F32)
    if kind in ("distinct", "promised"):  # a promise covers padding values too: zero
        values[(ids < 0) | (ids >= rows)] = 0.0
    return ids, values


def _start(tx, rng: np.random.Generator, tail: tuple[int, ...], rows: int = ROWS):
    """Parameters and a state with nonzero accumulators."""
    p = jnp.asarray(rng.standard_normal((rows, *tail)), jnp.float32)
    acc = jnp.asarray(rng.random(rows) * 2, jnp.float32)
    return p, optax.tree.set(tx.init(p), sum_of_squares=acc)


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


def _acc(state) -> np.ndarray:
    return np.asarray(optax.tree.get(state, "ScaleByRowwiseAdagradState").sum_of_squares)


def _spacing(x) -> np.ndarray:
    return np.spacing(np.abs(np.asarray(x, F32)))


def _summed(p: np.ndarray, ids: np.ndarray, values: np.ndarray, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """Per entry of the table, the summed gradient (float64, L2 decay in) and the sum of its terms' magnitudes."""
    g = np.zeros(p.shape, np.float64)
    size = np.zeros(p.shape, np.float64)
    for i, key in enumerate(ids):
        if 0 <= key < p.shape[0]:
            g[key] += values[i]
            size[key] += np.abs(values[i])
    if mode == "l2":
        g, size = g + F32(WD) * p, size + np.abs(F32(WD) * p)
    return g, size


def _assert_within_bounds(native, xla, p0: np.ndarray, ids, values, mode: str, lr: float = LR) -> None:
    """The stated bounds, one step from the same state: accumulators within ACC_ULPS; the update within
    STEP_ULPS of the step (plus STEP_SUM_ULPS of ``r (|wd p| + sum |g_e|)`` with L2 decay: XLA may add the
    decay before or after the entries; plus one of ``wd p`` with decoupled decay: XLA may round that product or
    the step's) times lr; the parameters within two ulps of themselves plus that."""
    (pn, sn, un), (px, sx, ux) = native, xla
    an, ax = _acc(sn), _acc(sx)
    acc_ulps = np.abs(an - ax) / _spacing(np.maximum(an, ax))
    assert np.all(acc_ulps <= ACC_ULPS), acc_ulps.max()
    g, size = _summed(p0, ids, values, mode)
    r = (1 / (np.sqrt(ax.astype(np.float64)) + EPS)).reshape((-1,) + (1,) * (p0.ndim - 1))
    step_tol = STEP_ULPS * _spacing(np.abs(g) * r) + STEP_SUM_ULPS * r * _spacing(size)
    if mode == "decoupled":
        step_tol = step_tol + _spacing(F32(WD) * p0)
    if un is not None and ux is not None:
        dn, dx = np.asarray(un.todense()), np.asarray(ux.todense())
        excess = np.abs(dn - dx) - lr * step_tol - 2 * _spacing(dx)  # the update is -lr * (step [+ wd p])
        assert np.all(excess <= 0), np.max(excess)
    pn, px = np.asarray(pn), np.asarray(px)
    tol = 2 * _spacing(np.maximum(np.abs(p0), np.abs(px))) + lr * step_tol + _spacing(lr * np.abs(g) * r)
    assert np.all(np.abs(pn - px) <= tol), np.max(np.abs(pn - px) / tol)


def _one_step(tx, p, s, ids, values, *, fused: bool, unique: bool = False, threads: int | None = None):
    """One step on the kernels (asserting that they run) and on the XLA path, from the same state."""
    step = _step(tx, fused, unique)
    args = (p, s, jnp.asarray(ids), jnp.asarray(values))
    with osa.use_kernels(True, threads=threads):
        hlo = jax.jit(step).lower(*args).as_text()
        assert ("rowwise_adagrad_apply" if fused else "rowwise_adagrad_rows") in hlo
        native = jax.jit(step)(*args)
    with osa.use_kernels(False):
        xla = jax.jit(_step(tx, False, unique))(*args)
    return native, xla


# --- Against the XLA path. ---


@needs_kernels
@pytest.mark.parametrize("tail", [(1,), (), (5,), (64,), (513,), (3, 4)], ids=lambda t: "x".join(map(str, t)) or "1d")
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("kind", ["dups", "promised", "extreme"])
def test_native_within_the_stated_bounds_of_xla(tail, mode, kind):
    rng = np.random.default_rng([len(tail), sum(tail), len(mode), len(kind)])
    tx = _tx(mode)
    p, s = _start(tx, rng, tail)
    # The extremes repeated to the size of the duplicates' batch: the two kinds share their compiled steps.
    ids, values = _batch(rng, kind, {"dups": 48, "promised": 30, "extreme": 48}[kind], tail)
    for fused, threads in ((False, 1), (True, 4)):
        native, xla = _one_step(tx, p, s, ids, values, fused=fused, unique=kind == "promised", threads=threads)
        _assert_within_bounds(native, xla, np.asarray(p), ids, values, mode)
        rows = np.zeros(ROWS, bool)
        rows[ids[(ids >= 0) & (ids < ROWS)]] = True
        np.testing.assert_array_equal(_acc(native[1])[~rows], _acc(s)[~rows])  # untouched rows: bitwise
        np.testing.assert_array_equal(np.asarray(native[0])[~rows], np.asarray(p)[~rows])


@needs_kernels
@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_large_batch_in_chunks(mode):
    """2,048 entries: the XLA path runs the rule chunk by chunk (and adds L2 decay after the entries)."""
    rng = np.random.default_rng(11)
    tx = _tx(mode)
    p, s = _start(tx, rng, (64,))
    ids, values = _batch(rng, "dups", 2048, (64,))
    for fused in (False, True):
        native, xla = _one_step(tx, p, s, ids, values, fused=fused)
        _assert_within_bounds(native, xla, np.asarray(p), ids, values, mode)


@needs_kernels
def test_width_one_without_l2_decay_is_bitwise_xla():
    """Width 1 (and a 1-D parameter) has no row sum: element-wise Adagrad, bitwise the XLA path."""
    rng = np.random.default_rng(12)
    for tail in ((1,), ()):
        for mode in ("none", "decoupled"):
            tx = _tx(mode)
            p, s = _start(tx, rng, tail)
            ids, values = _batch(rng, "dups", 48, tail)
            # The threads of test_native_within_the_stated_bounds_of_xla: the same compiled steps.
            for fused, threads in ((False, 1), (True, 4)):
                native, xla = _one_step(tx, p, s, ids, values, fused=fused, threads=threads)
                assert_trees_equal(native[:2], xla[:2])


def assert_non_finite_as_on_the_xla_path(tx, start, step_fn, kernel: str, *, fused: bool) -> None:
    """Two steps of ``tx`` from ``start(tx, rng, (5,))`` (``step_fn``: a module's ``_step``; ``kernel``: its
    kernels' name, ``rowwise_adagrad``), on batches of 24 entries with duplicates and padding whose first eight rows
    (on table rows, two of them repeated) hold NaN, infinities, the largest floats, subnormals and -0.0: NaN and
    infinity where the XLA path has them, its numbers elsewhere (to 1e-5, plus 16 ulps of a leaf's largest element
    where terms cancel)."""
    rng = np.random.default_rng(33)
    batches = []
    for _ in range(2):
        ids, values = _batch(rng, "dups", 24, (5,))
        ids[:10] = [0, 3, 6, 9, 12, 15, 18, 21, 0, 3]
        batches.append((jnp.asarray(ids), jnp.asarray(non_finite_values(values))))
    out = []
    for kernels in (True, False):
        p, s = start(tx, np.random.default_rng(32), (5,))
        with osa.use_kernels(kernels):
            step = jax.jit(step_fn(tx, fused and kernels))
            hlo = step.lower(p, s, *batches[0]).as_text()
            assert (f"{kernel}_{'apply' if fused else 'rows'}" in hlo) == kernels
            for ids, values in batches:
                p, s, _ = step(p, s, ids, values)
        out.append((p, s))
    assert np.isnan(np.asarray(out[0][0])).any()
    assert_same_non_finite(*out, rtol=1e-5, ulps_of_largest=16)


@needs_kernels
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_non_finite_and_extreme_values_as_on_the_xla_path(mode, fused):
    """NaN, infinities, the largest floats (their squares overflow a row's sum), subnormals and -0.0 among
    duplicates and padding, two steps: NaN and infinity where the XLA path has them, its numbers elsewhere."""
    assert_non_finite_as_on_the_xla_path(_tx(mode), _start, _step, "rowwise_adagrad", fused=fused)


@needs_kernels
@pytest.mark.parametrize("mode", ["l2", "decoupled"])
@pytest.mark.parametrize("k", [0, 1])
@pytest.mark.parametrize("fused", [False, True])
def test_empty_and_single_entry_batches(k, fused, mode):
    rng = np.random.default_rng(13)
    tx = _tx(mode)
    p, s = _start(tx, rng, (5,))
    ids, values = _batch(rng, "dups", 1, (5,))
    ids, values = ids[:k] * 0 + 4, values[:k]
    native, xla = _one_step(tx, p, s, ids, values, fused=fused)
    _assert_within_bounds(native, xla, np.asarray(p), ids, values, mode)
    if k == 0:
        assert_trees_equal(native[:2], (p, s))


@needs_kernels
@pytest.mark.parametrize("mode", sorted(MODES))
def test_schedule_steps_fused_and_in_two_calls(mode):
    """A schedule's count advances once a step; the fused step equals the two calls (both on the kernels), and
    the XLA path within the bounds, several steps on."""
    schedule = optax.linear_schedule(0.1, 0.01, 10)
    tx = _tx(mode, lr=schedule)
    rng = np.random.default_rng(14)
    p0, s0 = _start(tx, rng, (5,))
    batches = [tuple(map(jnp.asarray, _batch(rng, "dups", 32, (5,)))) for _ in range(3)]
    out = {}
    for name, kernels, fused in (("fused", True, True), ("two", True, False), ("xla", False, False)):
        p, s = p0, s0
        with osa.use_kernels(kernels):
            step = jax.jit(_step(tx, fused))
            for ids, values in batches:
                p, s, _ = step(p, s, ids, values)
        out[name] = (p, s)
    assert int(optax.tree.get(out["fused"][1], "ScaleByScheduleState").count) == 3
    if mode == "decoupled":  # where XLA fuses wd * p into the step depends on the graph around it
        np.testing.assert_array_max_ulp(np.asarray(out["fused"][0]), np.asarray(out["two"][0]), maxulp=2)
        assert_trees_equal(out["fused"][1], out["two"][1])
    else:
        assert_trees_equal(out["fused"], out["two"])
    assert_trees_equal(out["fused"], out["xla"], rtol=2e-6, atol=1e-7)


@needs_kernels
@pytest.mark.parametrize("mode", ["l2", "decoupled"])
@pytest.mark.parametrize("fused", [False, True])
def test_threads_give_the_same_numbers(fused, mode):
    """Distinct rows split over threads (4 parts of a few hundred rows here): the same numbers on any count."""
    rng = np.random.default_rng(15)
    tx, rows = _tx(mode), 1000
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
    """The kernels check a user's ``unique_indices=True``: duplicates are summed, never raced over threads."""
    rng = np.random.default_rng(16)
    tx = _tx("l2")
    p, s = _start(tx, rng, (16,))
    ids, values = _batch(rng, "dups", 4096, (16,))
    args = (p, s, jnp.asarray(ids), jnp.asarray(values))
    with osa.use_kernels(True, threads=4):
        promised = jax.jit(_step(tx, fused, unique=True))(*args)
        plain = jax.jit(_step(tx, fused, unique=False))(*args)
    assert_trees_equal(promised[:2], plain[:2])


# --- Against a NumPy loop of the kernels' arithmetic, bitwise. ---


def _fma(a, b, c):
    """float32 fma: the product is exact in float64; the sum rounds to float32 (twice, which the fixed seeds here
    never hit at a tie)."""
    return (np.float64(a) * np.float64(b) + np.float64(c)).astype(F32)


def _row_sum_of_squares(g: np.ndarray) -> F32:
    """The kernels' order: 16 lanes over blocks of 64 floats, products rounded, the lanes folded in halves."""
    width = g.size
    total = np.zeros(16, F32)
    for b in range(0, width, 64):
        block = np.zeros(16, F32)
        for j in range(b, min(width, b + 64), 16):
            x = np.zeros(16, F32)
            x[: min(16, min(width, b + 64) - j)] = g[j : min(j + 16, width, b + 64)]
            block = block + x * x
        total = total + block
    h = 8
    while h >= 1:
        total[:h] = total[:h] + total[h : 2 * h]
        h //= 2
    return total[0]


def _coalesced(ids, values: np.ndarray, rows: int) -> tuple[list[int], dict[int, np.ndarray]]:
    """The kernels' sums: the distinct in-range keys in order of first occurrence, and each one's entries added
    from zero in entry order (float32)."""
    order: list[int] = []
    summed: dict[int, np.ndarray] = {}
    for i, key in enumerate(ids):
        if 0 <= key < rows:
            if key not in summed:
                order.append(int(key))
                summed[key] = F32(0) + values[i]
            else:
                summed[key] = summed[key] + values[i]
    return order, summed


def _numpy_rule(p, acc, ids, values, mode: str, neg_lr: F32, apply: bool):
    """The kernels' arithmetic, float32 operation by operation, entry by entry; returns (p, acc, keys, steps)."""
    p, acc = p.reshape(p.shape[0], -1).copy(), acc.copy()
    values = values.reshape(values.shape[0], -1)
    width = p.shape[1]
    wd, eps = F32(WD if mode != "none" else 0.0), F32(EPS)
    order, summed = _coalesced(ids, values, p.shape[0])
    steps = np.zeros_like(values)
    for d, key in enumerate(order):
        g = summed[key]
        if mode == "l2":
            g = _fma(wd, p[key], g)
        if width == 1:
            acc[key] = _fma(g[0], g[0], acc[key])
            step = g / (np.sqrt(acc[key]) + eps)
        else:
            acc[key] = _fma(_row_sum_of_squares(g), F32(1) / F32(width), acc[key])
            step = g * (F32(1) / (np.sqrt(acc[key]) + eps))
        if mode == "decoupled":  # the decay stage after the rule: the step plus wd p (fused, but at width 1)
            step = step + wd * p[key] if width == 1 else _fma(wd, p[key], step)
        steps[d] = neg_lr * step  # the rows handler's step rows: times neg_lr, the factor it scales them by
        if apply:
            p[key] = p[key] + neg_lr * step
    keys = np.array(order + [p.shape[0]] * (len(ids) - len(order)), np.int32)
    return p, acc, keys, steps


@needs_kernels
@pytest.mark.parametrize("tail", [(1,), (5,), (64,), (100,), (513,), (3, 4)], ids=lambda t: "x".join(map(str, t)))
@pytest.mark.parametrize("mode", sorted(MODES))
def test_kernels_equal_a_numpy_loop_of_their_arithmetic(tail, mode):
    rng = np.random.default_rng([len(tail), sum(tail), len(mode), 17])
    p = rng.standard_normal((ROWS, *tail)).astype(F32)
    acc = (rng.random(ROWS) * 2).astype(F32)
    ids, values = _batch(rng, "dups", 48, tail)
    neg_lr = F32(-LR)
    scalars = adagrad_scalars(EPS, WD if mode != "none" else 0.0, neg_lr)
    args = (jnp.asarray(ids), jnp.asarray(values), scalars)
    want_p, want_acc, want_keys, want_steps = _numpy_rule(p, acc, ids, values, mode, neg_lr, apply=True)
    with osa.use_kernels(True, threads=4):
        got_p, got_acc = jax.jit(_ffi.rowwise_adagrad_apply, static_argnames=("decay", "unique"))(
            jnp.asarray(p), jnp.asarray(acc), *args, decay=DECAY[mode], unique=0
        )
        # the rows kernel (decoupled: the decay stage after the rule, taken in its pass)
        rows = jax.jit(_ffi.rowwise_adagrad_rows, static_argnames=("unique", "decoupled"))
        got_acc2, got_keys, got_steps = rows(
            jnp.asarray(acc), *args, None if mode == "none" else jnp.asarray(p), unique=0, decoupled=mode == "decoupled"
        )
        np.testing.assert_array_equal(got_acc2, want_acc)
        np.testing.assert_array_equal(got_keys, want_keys)
        np.testing.assert_array_equal(np.asarray(got_steps).reshape(len(ids), -1), want_steps)
    np.testing.assert_array_equal(got_acc, want_acc)
    np.testing.assert_array_equal(np.asarray(got_p).reshape(ROWS, -1), want_p)


def test_the_numpy_loop_is_the_rule():
    """The NumPy loop above against the rule in float64 (tests.reference), to float32 rounding."""
    from tests.reference import LazyVariantReference

    rng = np.random.default_rng(18)
    for mode, rule in (("l2", "rowwise_adagrad"), ("decoupled", "rowwise_adagrad_decoupled")):
        p = rng.standard_normal((ROWS, 7)).astype(F32)
        ref = LazyVariantReference(p, rule, lr=LR, eps=EPS, weight_decay=WD)
        ids, values = _batch(rng, "dups", 48, (7,))
        ref.step(list(ids), list(values))
        got_p, got_acc, _, _ = _numpy_rule(p, np.zeros(ROWS, F32), ids, values, mode, F32(-LR), apply=True)
        np.testing.assert_allclose(got_acc, ref.acc, rtol=1e-6)
        np.testing.assert_allclose(got_p, ref.p, rtol=1e-6, atol=1e-7)


# --- Where the kernels run, in place, and where they do not. ---


def _step_args(tx, rows: int, width: int, k: int = 256):
    table = jnp.zeros((rows, width), jnp.float32)
    return table, tx.init(table), jnp.zeros((k,), jnp.int32), jnp.ones((k, width), jnp.float32)


@needs_kernels
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("fused", [False, True])
def test_in_place_under_donation_and_compiled_once(mode, fused):
    """Donated, the tables and accumulators are updated in place: no copy of either, temporaries of the batch's
    size only."""
    tx = _tx(mode)
    temps = {}
    for rows in (1_000, 100_000):
        step = jax.jit(_step(tx, fused, num_rows=rows), donate_argnums=(0, 1))
        args = _step_args(tx, rows, 16)
        temps[rows] = step.lower(*args).compile().memory_analysis().temp_size_in_bytes
    report = osa.step_report(step, *args, min_bytes=100_000 * 4)  # the accumulators count as table-sized
    assert report.in_place, str(report)
    assert report.kernel_path == "native-cpu" and report.kernel_calls == 1 + (not fused)  # + apply_updates'
    assert temps[100_000] == temps[1_000] < 1_000 * 16 * 4
    hlo = jax.jit(_step(tx, fused)).lower(*_step_args(tx, ROWS, 5)).as_text()
    assert ("rowwise_adagrad_apply" in hlo) == fused and ("rowwise_adagrad_rows" in hlo) != fused

    once = jit_once(_step(tx, fused), donate_argnums=(0, 1))
    rng = np.random.default_rng(19)
    p, s = _start(tx, rng, (5,))
    for _ in range(3):
        ids, values = _batch(rng, "dups", 16, (5,))
        p, s, _ = once(p, s, jnp.asarray(ids), jnp.asarray(values))


@needs_kernels
def test_a_bfloat16_table_fuses_and_its_update_alone_takes_the_xla_path():
    """``tx.update`` on a bfloat16 table (whose L2 decay reads it) runs the XLA rule; ``update_and_apply`` the fused
    kernel, which takes 16-bit tables (``tests/test_half_table_kernels.py``)."""
    tx = _tx("l2")
    p = jnp.ones((ROWS, 5), jnp.bfloat16)
    g = osa.IndexedRows(jnp.array([1, 1], jnp.int32), jnp.ones((2, 5), jnp.bfloat16), ROWS)
    assert "rowwise_adagrad" not in jax.jit(lambda: tx.update(g, tx.init(p), p)).lower().as_text()
    fused = jax.jit(lambda: osa.update_and_apply(tx, g, tx.init(p), p)).lower().as_text()
    assert "rowwise_adagrad_apply" in fused


@needs_kernels
def test_a_partition_tables_part_runs_the_fused_kernel():
    params = {"emb": jnp.ones((ROWS, 4), jnp.float32), "w": jnp.ones((3,), jnp.float32)}
    tx = osa.partition_tables(_tx("decoupled"), optax.adam(1e-3), lambda p: p["emb"])
    g = {"emb": osa.IndexedRows(jnp.array([3, 3, -1], jnp.int32), jnp.ones((3, 4), jnp.float32), ROWS)}
    g["w"] = jnp.ones((3,), jnp.float32)
    hlo = jax.jit(lambda g, s, p: osa.update_and_apply(tx, g, s, p)).lower(g, tx.init(params), params).as_text()
    assert "rowwise_adagrad_apply" in hlo and "rowwise_adagrad_rows" not in hlo


def _grad_case(case: str, mode: str):
    rng = np.random.default_rng(20)
    tx = _tx(mode)
    p, s = _start(tx, rng, (5,))
    ids, values = map(jnp.asarray, _batch(rng, "dups", 12, (5,)))

    def loss(p, s):
        return jnp.sum(jnp.sin(p)) + jnp.sum(jnp.sqrt(_acc_tree(s) + 1.0))

    if case == "update":

        def f(x):
            updates, s2 = tx.update(osa.IndexedRows(ids, x[1], ROWS), s, x[0])
            return loss(osa.apply_updates(x[0], updates), s2)

    else:

        def f(x):
            return loss(*osa.update_and_apply(tx, osa.IndexedRows(ids, x[1], ROWS), s, x[0]))

    return f, (p, values)


def _acc_tree(s):
    return optax.tree.get(s, "ScaleByRowwiseAdagradState").sum_of_squares


@needs_kernels
@pytest.mark.parametrize("case", ["update", "update_and_apply"])
@pytest.mark.parametrize("mode", ["l2", "decoupled"])
def test_differentiated_steps_take_the_xla_path(case, mode):
    f, x = _grad_case(case, mode)
    tangent = jax.tree.map(jnp.ones_like, x)
    out = {}
    for kernels in (True, False):
        with osa.use_kernels(kernels):
            grad = jax.jit(jax.grad(f))
            assert "rowwise_adagrad" not in grad.lower(x).as_text()  # primal and tangents: the XLA path
            # Forward mode op by op on the kernels; the reference jitted (the same computation).
            jvp = (
                (lambda x, t: jax.jvp(f, (x,), (t,))[1]) if kernels else jax.jit(lambda x, t: jax.jvp(f, (x,), (t,))[1])
            )
            out[kernels] = (grad(x), jvp(x, tangent))
    assert_trees_equal(out[True], out[False], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_lowers_for_gpu_and_tpu_without_the_cpu_kernel(fused, platform):
    tx = _tx("l2")
    traced = jax.jit(_step(tx, fused)).trace(*_step_args(tx, ROWS, 5, k=8))
    cpu = traced.lower(lowering_platforms=("cpu",)).as_text()
    assert ("rowwise_adagrad" in cpu) == _kernel_path.enabled()
    assert "rowwise_adagrad" not in traced.lower(lowering_platforms=(platform,)).as_text()


@needs_kernels
@pytest.mark.parametrize("mode", sorted(MODES))
def test_row_sharded_table_stays_sharded(mode):
    """Table and accumulators split by rows over 8 devices: each device updates its own rows, as on one (the
    decoupled rows kernel takes its row blocks from the parameters, which it reads)."""
    mesh = jax.make_mesh((8,), ("rows",), axis_types=(jax.sharding.AxisType.Auto,))
    by_rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("rows"))
    tx, num_rows = _tx(mode), 96
    rng = np.random.default_rng(21)
    p0 = jnp.asarray(rng.standard_normal((num_rows, 5)), jnp.float32)
    batches = [tuple(map(jnp.asarray, _batch(rng, "dups", 48, (5,)))) for _ in range(2)]
    for fused in (False, True):
        outs = []
        for shard in (False, True):
            p, s = p0, tx.init(p0)
            if shard:
                p, s = jax.device_put(p, by_rows), jax.device_put(s, by_rows)
            step = jax.jit(_step(tx, fused, num_rows=num_rows))
            kernel = _kernel_path.PREFIX + "rowwise_adagrad_" + ("apply" if fused else "rows")
            assert kernel in step.lower(p, s, *batches[0]).compile().as_text()
            for ids, values in batches:
                p, s, _ = step(p, s, ids, values)
            if shard:
                assert p.sharding.is_equivalent_to(by_rows, 2)
                assert _acc_tree(s).sharding.is_equivalent_to(by_rows, 1)
            outs.append((p, s))
        assert_trees_equal(*outs)


@needs_kernels
@pytest.mark.parametrize("mode", ["l2", "decoupled"])
def test_vmapped_step_equals_the_unbatched_steps(mode):
    """Under vmap the kernels run once per batch element."""
    tx = _tx(mode)
    rng = np.random.default_rng(22)
    starts = [_start(tx, rng, (5,)) for _ in range(2)]
    batches = [tuple(map(jnp.asarray, _batch(rng, "dups", 8, (5,)))) for _ in range(2)]
    stacked = jax.tree.map(lambda *x: jnp.stack(x), *[(*a, *b) for a, b in zip(starts, batches, strict=True)])
    for fused in (False, True):
        step = _step(tx, fused)
        out = jax.jit(jax.vmap(lambda *a, step=step: step(*a)[:2]))(*stacked)
        for i in range(2):
            one = jax.jit(step)(*starts[i], *batches[i])[:2]
            assert_trees_equal(jax.tree.map(lambda x, i=i: x[i], out), one)
