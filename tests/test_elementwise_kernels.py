"""The element-wise optimizers' native CPU kernels (``csrc/elementwise.cc``): against the XLA path, and against a
NumPy loop of their arithmetic.

``sparse_ftrl`` and Nesterov's ``sparse_sgd``: every array bitwise the XLA path's, one step and many. Lazy momentum
(``sparse_sgd(momentum)``): XLA:CPU computes ``g + momentum * t`` in one of several ways by shape (a fused
multiply-add, or the product rounded apart, or, where ids repeat, the entries added one by one onto
``momentum * t``, a scatter-add into that product), where the kernel rounds the product and adds it to the entries'
sum: the trace is within the rounding of that sum. ``sparse_adagrad``: accumulators bitwise; the update
within a few ulps of itself, as XLA:CPU's ``rsqrt`` is a hardware estimate refined by two Newton steps (its last bit
depends on the CPU and on the loop's lanes) and the kernel's ``1 / sqrt`` is rounded twice.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_sparse_adam as osa
from optax_sparse_adam import _ffi, _kernel_path
from tests.helpers import assert_same_non_finite, assert_trees_equal, jit_once, needs_kernels, non_finite_values, spread
from tests.test_rowwise_kernels import ROWS, _batch, _coalesced, _fma, _step

LR, EPS, MU = 0.05, 1e-7, 0.9
F32 = np.float32
FTRL = {"l1_regularization_strength": 0.01, "l2_regularization_strength": 0.02, "beta": 0.3}
FTRL_POWER = {
    "learning_rate_power": -0.3,
    "l1_regularization_strength": 0.001,
    "l2_shrinkage_regularization_strength": 0.05,
}
OPTIMIZERS = {
    "adagrad": lambda lr: osa.sparse_adagrad(lr, eps=EPS),
    "momentum": lambda lr: osa.sparse_sgd(lr, momentum=MU),
    "nesterov": lambda lr: osa.sparse_sgd(lr, momentum=MU, nesterov=True),
    "ftrl": lambda lr: osa.sparse_ftrl(lr, **FTRL),
    "ftrl_power": lambda lr: osa.sparse_ftrl(lr, **FTRL_POWER),
}
KERNEL = {"adagrad": "adagrad", "momentum": "momentum", "nesterov": "momentum", "ftrl": "ftrl", "ftrl_power": "ftrl"}
SCHEDULE = optax.linear_schedule(0.1, 0.01, 12)
# Adagrad's update, in ulps of itself: 1 / sqrt rounded twice (up to 1.5 ulps) against XLA:CPU's estimate (1.3).
ADAGRAD_ULPS = 3


@functools.cache  # one object for equal arguments: the tests share their compiled steps (see _step)
def _tx(name: str, lr=LR):
    return OPTIMIZERS[name](lr)


def _kind(name: str) -> str:
    return "ftrl" if name.startswith("ftrl") else name if name == "adagrad" else "momentum"


def _fields(name: str) -> tuple[str, ...]:
    return {"adagrad": ("sum_of_squares",), "ftrl": ("accumulator", "linear")}.get(_kind(name), ("trace",))


def _start(name: str, tx, rng: np.random.Generator, tail: tuple[int, ...], rows: int = ROWS):
    """Parameters and a state of nonzero values (Adagrad's accumulators zero in some entries)."""
    shape = (rows, *tail)
    p = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    s = tx.init(p)
    if name == "adagrad":
        acc = rng.random(shape) * 2
        acc[rng.random(shape) < 0.2] = 0.0
        return p, optax.tree.set(s, sum_of_squares=jnp.asarray(acc, jnp.float32))
    if name.startswith("ftrl"):
        n, z = rng.random(shape) + 0.1, rng.standard_normal(shape) * 0.05
        return p, optax.tree.set(s, accumulator=jnp.asarray(n, jnp.float32), linear=jnp.asarray(z, jnp.float32))
    return p, optax.tree.set(s, trace=jnp.asarray(rng.standard_normal(shape), jnp.float32))


def _state(name: str, s) -> list[np.ndarray]:
    owner = {"adagrad": "ScaleByRssState", "ftrl": "FtrlState"}.get(_kind(name), "TraceState")
    found = optax.tree.get(s, owner)
    return [np.asarray(getattr(found, f)) for f in _fields(name)]


def _run(name, tx, p, s, batches, *, fused: bool, kernels: bool, unique: bool = False, threads: int | None = None):
    """Steps from the same state on one path (asserting that the kernel runs on the native one)."""
    step = jax.jit(_step(tx, fused, unique))
    with osa.use_kernels(kernels, threads=threads):
        hlo = step.lower(p, s, *batches[0]).as_text()
        assert (KERNEL[name] + ("_apply" if fused else "_rows") in hlo) == kernels
        out = None
        for ids, values in batches:
            p, s, u = step(p, s, ids, values)
            out = (p, s, u)
    return out


def _spacing(x) -> np.ndarray:
    return np.spacing(np.abs(np.asarray(x, F32)))


def _assert_close(name: str, native, xla, p0, s0, ids, values, lr: float = LR) -> None:
    """One step from the same state: bitwise, or within the bounds the module docstring states."""
    (pn, sn, un), (px, sx, ux) = native, xla
    exact = name in ("nesterov", "ftrl", "ftrl_power")
    if exact:  # the update's rows may be packed in another order: compared dense
        assert_trees_equal((pn, sn), (px, sx))
        if un is not None:
            assert_trees_equal(un.todense(), ux.todense())
        return
    p0 = np.asarray(p0).reshape(ROWS, -1)
    values = np.asarray(values).reshape(len(ids), p0.shape[1])
    size = np.zeros_like(p0, np.float64)  # per entry: the sum of its terms' magnitudes
    count = np.zeros(ROWS, np.int64)
    for i, key in enumerate(np.asarray(ids)):
        if 0 <= key < ROWS:
            size[key] += np.abs(values[i])
            count[key] += 1
    if name == "adagrad":
        assert_trees_equal(_state(name, sn), _state(name, sx))
        acc = _state(name, sx)[0].reshape(ROWS, -1).astype(np.float64)
        g = np.zeros_like(p0, np.float64)
        for i, key in enumerate(np.asarray(ids)):
            if 0 <= key < ROWS:
                g[key] += values[i]
        u = np.abs(g) / np.sqrt(acc + EPS, where=acc > 0, out=np.ones_like(acc))
        step_tol = ADAGRAD_ULPS * _spacing(u) * lr
    else:  # lazy momentum: the trace within the rounding of its sum of count + 1 terms, in another order
        (t0,) = _state(name, s0)
        size += MU * np.abs(t0.reshape(ROWS, -1))
        trace_tol = (count[:, None] + 1) * _spacing(size)
        (tn,), (tx,) = _state(name, sn), _state(name, sx)
        excess = np.abs(tn - tx).reshape(ROWS, -1) - trace_tol
        assert np.all(excess <= 0), np.max(excess)
        step_tol = lr * trace_tol + _spacing(lr * size)
    if un is not None:
        dn, dx = np.asarray(un.todense()).reshape(ROWS, -1), np.asarray(ux.todense()).reshape(ROWS, -1)
        excess = np.abs(dn - dx) - step_tol - 2 * _spacing(dx)
        assert np.all(excess <= 0), np.max(excess)
    pn, px = np.asarray(pn).reshape(ROWS, -1), np.asarray(px).reshape(ROWS, -1)
    tol = 2 * _spacing(np.maximum(np.abs(p0), np.abs(px))) + step_tol
    assert np.all(np.abs(pn - px) <= tol), np.max(np.abs(pn - px) / tol)


def _one_step(name, tail, kind, fused, lr=LR, threads=None):
    tx = _tx(name, lr)
    rng = np.random.default_rng([len(name), len(tail), sum(tail), len(kind), fused])
    p, s = _start(name, tx, rng, tail)
    ids, values = _batch(rng, "distinct" if kind == "promised" else kind, 24, tail)
    if name == "adagrad":
        values[rng.random(values.shape) < 0.1] = 0.0  # zero gradients where the accumulator is zero too
    batch = [(jnp.asarray(ids), jnp.asarray(values))]
    unique = kind == "promised"
    native = _run(name, tx, p, s, batch, fused=fused, kernels=True, unique=unique, threads=threads)
    xla = _run(name, tx, p, s, batch, fused=False, kernels=False, unique=unique)
    return native, xla, p, s, ids, values


TAILS = [(1,), (), (5,), (64,), (513,), (3, 4)]
CASES = spread(sorted(OPTIMIZERS), [(t, k) for t in TAILS for k in ("dups", "promised", "extreme")], per=6)


@needs_kernels
@pytest.mark.parametrize(
    ("name", "tail", "kind"), CASES, ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else str(x)
)
@pytest.mark.parametrize("fused", [False, True])
def test_native_equals_the_xla_path(name, tail, kind, fused):
    """Duplicates, padding (int32 extremes too) and promised-distinct ids, widths 1 to 513 and a 1-D table."""
    native, xla, p, s, ids, values = _one_step(name, tail, kind, fused)
    _assert_close(name, native, xla, p, s, ids, values)


def _non_finite_batches(rng: np.random.Generator, tail: tuple[int, ...], n: int = 2) -> list[tuple[jax.Array, ...]]:
    """Batches of 24 entries with duplicates and padding whose first eight rows (on table rows, two of them
    repeated) hold NaN, infinities, the largest floats, subnormals and -0.0."""
    out = []
    for _ in range(n):
        ids, values = _batch(rng, "dups", 24, tail)
        ids[:10] = [0, 3, 6, 9, 12, 15, 18, 21, 0, 3]
        out.append((jnp.asarray(ids), jnp.asarray(non_finite_values(values))))
    return out


@needs_kernels
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_non_finite_and_extreme_values_as_on_the_xla_path(name, fused):
    """NaN, infinities, the largest floats, subnormals and -0.0 among duplicates and padding, two steps: NaN and
    infinity where the XLA path has them (state and parameters), its numbers elsewhere (to 1e-5, plus 16 ulps of a
    leaf's largest element where terms cancel)."""
    tx = _tx(name)
    rng = np.random.default_rng(31)
    p, s = _start(name, tx, rng, (5,))
    batches = _non_finite_batches(rng, (5,))
    native = _run(name, tx, p, s, batches, fused=fused, kernels=True)
    xla = _run(name, tx, p, s, batches, fused=False, kernels=False)
    assert np.isnan(np.asarray(native[0])).any()
    assert_same_non_finite(native[:2], xla[:2], rtol=1e-5, ulps_of_largest=16)


@needs_kernels
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("fused", [False, True])
def test_schedule_steps_equal_the_xla_path(name, fused):
    """Twelve steps under a schedule (FTRL then divides by the learning rate, where it multiplies by the reciprocal
    of a constant one): FTRL and Nesterov bitwise, the others within their bounds step by step."""
    tx = _tx(name, SCHEDULE)
    rng = np.random.default_rng([len(name), 3])
    p, s = _start(name, tx, rng, (6,))
    batches = [tuple(map(jnp.asarray, _batch(rng, "dups", 20, (6,)))) for _ in range(12)]
    native = _run(name, tx, p, s, batches, fused=fused, kernels=True)
    xla = _run(name, tx, p, s, batches, fused=False, kernels=False)
    if name in ("nesterov", "ftrl", "ftrl_power"):
        assert_trees_equal(native[:2], xla[:2])
    else:  # drift over twelve steps: within a few ulps of the parameters
        assert_trees_equal(native[0], xla[0], rtol=2e-6, atol=1e-6)
        assert_trees_equal(_state(name, native[1]), _state(name, xla[1]), rtol=2e-6, atol=1e-6)


@needs_kernels
@pytest.mark.parametrize("k", [0, 1])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("name", ["adagrad", "momentum", "ftrl"])
def test_empty_and_single_entry_batches(name, k, fused):
    tx = _tx(name)
    rng = np.random.default_rng([k, fused, len(name)])
    p, s = _start(name, tx, rng, (5,))
    batch = [(jnp.full((k,), 4, jnp.int32), jnp.asarray(rng.standard_normal((k, 5)), jnp.float32))]
    native = _run(name, tx, p, s, batch, fused=fused, kernels=True)
    xla = _run(name, tx, p, s, batch, fused=False, kernels=False)
    _assert_close(name, native, xla, p, s, *batch[0])
    if k == 0:
        assert_trees_equal((native[0], _state(name, native[1])), (p, _state(name, s)))


@needs_kernels
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("name", ["adagrad", "momentum", "ftrl"])
def test_threads_give_the_same_numbers(name, fused):
    tx = _tx(name)
    rng = np.random.default_rng([7, fused, len(name)])
    p, s = _start(name, tx, rng, (9,), rows=ROWS)
    batch = [tuple(map(jnp.asarray, _batch(rng, "dups", 400, (9,))))]
    outs = [_run(name, tx, p, s, batch, fused=fused, kernels=True, threads=t) for t in (1, 3, 16)]
    for out in outs[1:]:
        assert_trees_equal(out, outs[0])


@needs_kernels
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("name", ["adagrad", "nesterov", "ftrl"])
def test_a_broken_unique_promise_is_summed_like_no_promise(name, fused):
    tx = _tx(name)
    rng = np.random.default_rng([8, fused, len(name)])
    p, s = _start(name, tx, rng, (5,))
    batch = [(jnp.array([3, 5, 3, 9], jnp.int32), jnp.asarray(rng.standard_normal((4, 5)), jnp.float32))]
    promised = _run(name, tx, p, s, batch, fused=fused, kernels=True, unique=True)
    plain = _run(name, tx, p, s, batch, fused=fused, kernels=True)
    assert_trees_equal(promised[:2], plain[:2])


# --- Against a NumPy loop of the kernels' arithmetic, bitwise. ---


_LIBM = ctypes.CDLL(ctypes.util.find_library("m"))
_POWF = _LIBM.powf  # the C library's, which the kernel and XLA:CPU call (NumPy has a power of its own)
_POWF.restype, _POWF.argtypes = ctypes.c_float, [ctypes.c_float, ctypes.c_float]


def _sign(x: F32) -> F32:
    return F32(1) if x > 0 else (F32(-1) if x < 0 else x)


def _numpy_rule(name: str, p: np.ndarray, state: list[np.ndarray], ids, values, neg_lr: F32, hp: dict):
    """The kernels' arithmetic, float32 operation by operation, entry by entry: ``(p, state, keys, steps)``."""
    p = p.reshape(p.shape[0], -1).copy()
    state = [x.reshape(p.shape).copy() for x in state]
    values = values.reshape(values.shape[0], -1)
    order, summed = _coalesced(ids, values, p.shape[0])
    steps = np.zeros_like(values)
    for d, key in enumerate(order):
        g = summed[key]
        for j in range(p.shape[1]):
            if name == "adagrad":
                (acc,) = state
                acc[key, j] = _fma(g[j], g[j], acc[key, j])
                inv = F32(1) / np.sqrt(acc[key, j] + F32(EPS)) if acc[key, j] > 0 else F32(0)
                u = inv * g[j]
            elif name in ("momentum", "nesterov"):
                (t,) = state
                t[key, j] = _fma(t[key, j], F32(MU), g[j]) if name == "nesterov" else g[j] + F32(MU) * t[key, j]
                u = _fma(t[key, j], F32(MU), g[j]) if name == "nesterov" else t[key, j]
            else:
                n, z = state
                alpha, l1, q0, shrink, power = hp["scalars"]
                pj = p[key, j]
                gs = _fma(pj, shrink, g[j]) if hp["shrinks"] else g[j]
                nn = _fma(g[j], g[j], n[key, j])

                rn, ro = (np.sqrt(x) if hp["sqrt"] else F32(_POWF(x, -power)) for x in (nn, n[key, j]))
                sigma = (rn - ro) / alpha if hp["divides"] else (rn - ro) * alpha
                zn = z[key, j] + _fma(-sigma, pj, gs)
                n[key, j], z[key, j] = nn, zn
                quad = rn / alpha + q0 if hp["divides"] else _fma(rn, alpha, q0)
                p_new = _fma(_sign(zn), l1, -zn) / quad if np.abs(zn) > l1 else F32(0)
                u = p_new - pj
            # The rows handlers' step rows: FTRL's update; the others' times neg_lr, the factor they scale them by.
            steps[d, j] = u if name.startswith("ftrl") else neg_lr * u
            if name.startswith("ftrl"):
                p[key, j] = p[key, j] + u
            else:
                p[key, j] = p[key, j] + neg_lr * u
    keys = np.array(order + [p.shape[0]] * (len(ids) - len(order)), np.int32)
    return p, state, keys, steps


@needs_kernels
@pytest.mark.parametrize("tail", [(1,), (5,), (33,)], ids=lambda t: "x".join(map(str, t)))
@pytest.mark.parametrize("name", [*sorted(OPTIMIZERS), "ftrl_divides"])
def test_kernels_equal_a_numpy_loop_of_their_arithmetic(name, tail):
    rng = np.random.default_rng([len(name), sum(tail), 17])
    p = rng.standard_normal((ROWS, *tail)).astype(F32)
    ids, values = _batch(rng, "dups", 48, tail)
    neg_lr = F32(-LR)
    flags: dict = {}
    hp: dict = {}
    if name == "adagrad":
        state = [(rng.random((ROWS, *tail)) * 2).astype(F32)]
        scalars = jnp.asarray([EPS, neg_lr], jnp.float32)
    elif name in ("momentum", "nesterov"):
        state = [rng.standard_normal((ROWS, *tail)).astype(F32)]
        scalars = jnp.asarray([MU, neg_lr], jnp.float32)
        flags = {"nesterov": name == "nesterov"}
    else:
        state = [(rng.random((ROWS, *tail)) + 0.1).astype(F32), (rng.standard_normal((ROWS, *tail)) * 0.05).astype(F32)]
        options = FTRL_POWER if name == "ftrl_power" else FTRL
        tx = osa.sparse_ftrl(LR, **options)
        fusion = tx.update.fusion
        scalars, _ = fusion.scalars(LR)  # 1 / alpha first
        divides = name == "ftrl_divides"
        if divides:  # alpha first, as for a learning rate computed at run time
            scalars = scalars.at[0].set(LR)
        flags = {"root": fusion.root, "shrinks": fusion.shrinks, "divides": divides}
        hp = {
            "scalars": list(np.asarray(scalars)),
            "sqrt": fusion.root == 1,
            "shrinks": fusion.shrinks,
            "divides": divides,
        }
    kernel = KERNEL.get(name, "ftrl")
    want_p, want_state, want_keys, want_steps = _numpy_rule(name, p, state, ids, values, neg_lr, hp)
    args = (jnp.asarray(ids), jnp.asarray(values), scalars)
    with osa.use_kernels(True, threads=4):
        got = jax.jit(functools.partial(_ffi.elementwise_apply, kernel, unique=0, **flags))(
            jnp.asarray(p), tuple(map(jnp.asarray, state)), *args
        )
        reads = (jnp.asarray(p),) if kernel == "ftrl" else ()
        rows = jax.jit(functools.partial(_ffi.elementwise_rows, kernel, unique=0, **flags))
        *got_state, got_keys, got_steps = rows(tuple(map(jnp.asarray, state)), *args, reads)
    np.testing.assert_array_equal(np.asarray(got[0]).reshape(ROWS, -1), want_p)
    for a, b, c in zip(got[1:], got_state, want_state, strict=True):
        np.testing.assert_array_equal(np.asarray(a).reshape(c.shape), c)
        np.testing.assert_array_equal(np.asarray(b).reshape(c.shape), c)
    np.testing.assert_array_equal(got_keys, want_keys)
    np.testing.assert_array_equal(np.asarray(got_steps).reshape(len(ids), -1), want_steps)


# --- Where the kernels run, in place, and where they do not. ---


def _step_args(tx, rows: int, width: int, k: int = 256):
    table = jnp.zeros((rows, width), jnp.float32)
    return table, tx.init(table), jnp.zeros((k,), jnp.int32), jnp.ones((k, width), jnp.float32)


@needs_kernels
@pytest.mark.parametrize("name", ["adagrad", "momentum", "ftrl"])
@pytest.mark.parametrize("fused", [False, True])
def test_in_place_under_donation_and_compiled_once(name, fused):
    """Donated, the tables and their state are updated in place: no copy of either, temporaries of the batch's
    size only."""
    tx = _tx(name)
    temps = {}
    for rows in (1_000, 100_000):
        step = jax.jit(_step(tx, fused, num_rows=rows), donate_argnums=(0, 1))
        args = _step_args(tx, rows, 16)
        temps[rows] = step.lower(*args).compile().memory_analysis().temp_size_in_bytes
    report = osa.step_report(step, *args, min_bytes=100_000 * 4)
    assert report.in_place, str(report)
    assert report.kernel_path == "native-cpu" and report.kernel_calls == 1 + (not fused)  # + apply_updates'
    assert report.fused == fused
    assert temps[100_000] == temps[1_000] < 1_000 * 16 * 4

    once = jit_once(_step(tx, fused), donate_argnums=(0, 1))
    rng = np.random.default_rng(19)
    p, s = _start(name, tx, rng, (5,))
    for _ in range(3):
        ids, values = _batch(rng, "dups", 16, (5,))
        p, s, _ = once(p, s, jnp.asarray(ids), jnp.asarray(values))


@needs_kernels
def test_a_bfloat16_trace_takes_the_xla_path():
    """The kernels take float32 state: a bfloat16 trace (``accumulator_dtype``) runs the XLA rule."""
    tx = osa.sparse_sgd(LR, momentum=MU, accumulator_dtype=jnp.bfloat16)
    p = jnp.ones((ROWS, 5), jnp.float32)
    g = osa.IndexedRows(jnp.array([1, 1], jnp.int32), jnp.ones((2, 5), jnp.float32), ROWS)
    for step in (lambda: tx.update(g, tx.init(p), p), lambda: osa.update_and_apply(tx, g, tx.init(p), p)):
        assert "momentum_" not in jax.jit(step).lower().as_text()


@needs_kernels
@pytest.mark.parametrize("name", ["adagrad", "nesterov", "ftrl"])
def test_wrapped_optimizers_run_the_fused_kernel(name):
    """Clipped by the global norm before it, or its learning rate injected: one fused pass, the XLA path's numbers
    (FTRL bitwise)."""
    rng = np.random.default_rng([9, len(name)])
    factory, options = {
        "adagrad": (osa.sparse_adagrad, {"eps": EPS}),
        "nesterov": (osa.sparse_sgd, {"momentum": MU, "nesterov": True}),
        "ftrl": (osa.sparse_ftrl, FTRL),
    }[name]
    txs = {
        "clip": optax.chain(osa.sparse_aware(optax.clip_by_global_norm(0.5)), _tx(name)),
        "inject": optax.inject_hyperparams(factory, static_args=("nesterov",) if name == "nesterov" else ())(
            learning_rate=LR, **options
        ),
    }
    for how, tx in txs.items():
        p, s = _start(name, tx, rng, (5,))
        ids, values = map(jnp.asarray, _batch(rng, "dups", 24, (5,)))
        step = jax.jit(_step(tx, True))
        with osa.use_kernels(True):
            assert KERNEL[name] + "_apply" in step.lower(p, s, ids, values).as_text(), how
            native = step(p, s, ids, values)
        with osa.use_kernels(False):
            xla = jax.jit(_step(tx, False))(p, s, ids, values)
        if name == "ftrl":
            assert_trees_equal(native[:2], xla[:2])
        else:  # XLA may fuse the clipping's product into the trace's multiply-add; Adagrad's rsqrt
            assert_trees_equal(native[:2], xla[:2], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("name", ["adagrad", "momentum", "ftrl"])
def test_lowers_for_gpu_and_tpu_without_the_cpu_kernel(name, fused, platform):
    tx = _tx(name)
    traced = jax.jit(_step(tx, fused)).trace(*_step_args(tx, ROWS, 5, k=8))
    cpu = traced.lower(lowering_platforms=("cpu",)).as_text()
    assert (KERNEL[name] + "_" in cpu) == _kernel_path.enabled()
    assert KERNEL[name] + "_" not in traced.lower(lowering_platforms=(platform,)).as_text()


@needs_kernels
@pytest.mark.parametrize("name", ["adagrad", "ftrl"])
def test_differentiated_steps_take_the_xla_path(name):
    tx = _tx(name)
    rng = np.random.default_rng(20)
    p, s = _start(name, tx, rng, (5,))
    ids, values = map(jnp.asarray, _batch(rng, "dups", 12, (5,)))

    def f(x):
        p2, s2 = osa.update_and_apply(tx, osa.IndexedRows(ids, x[1], ROWS), s, x[0])
        return jnp.sum(jnp.sin(p2)) + sum(jnp.sum(jnp.sqrt(jnp.abs(a) + 1.0)) for a in jax.tree.leaves(s2))

    out = {}
    for kernels in (True, False):
        with osa.use_kernels(kernels):
            grad = jax.jit(jax.grad(f))
            assert KERNEL[name] + "_" not in grad.lower((p, values)).as_text()
            out[kernels] = grad((p, values))
    assert_trees_equal(out[True], out[False])


@needs_kernels
@pytest.mark.parametrize("name", ["adagrad", "momentum", "ftrl"])
def test_row_sharded_table_stays_sharded(name):
    """Table and state split by rows over 8 devices: each device updates its own rows, as on one."""
    mesh = jax.make_mesh((8,), ("rows",), axis_types=(jax.sharding.AxisType.Auto,))
    by_rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("rows"))
    tx, num_rows = _tx(name), 96
    rng = np.random.default_rng(21)
    p0 = jnp.asarray(rng.standard_normal((num_rows, 5)), jnp.float32)
    batches = [tuple(map(jnp.asarray, _batch(rng, "dups", 48, (5,), rows=num_rows))) for _ in range(2)]
    for fused in (False, True):
        outs = []
        for shard in (False, True):
            p, s = p0, tx.init(p0)
            if shard:
                p, s = (
                    jax.device_put(p, by_rows),
                    jax.tree.map(lambda x: jax.device_put(x, by_rows if x.ndim else None), s),
                )
            step = jax.jit(_step(tx, fused, num_rows=num_rows))
            assert KERNEL[name] + "_" in step.lower(p, s, *batches[0]).compile().as_text()
            for ids, values in batches:
                p, s, _ = step(p, s, ids, values)
            if shard:
                assert p.sharding.is_equivalent_to(by_rows, 2)
                assert all(a.sharding.is_equivalent_to(by_rows, 2) for a in jax.tree.leaves(s) if a.ndim == 2)
            outs.append((p, s))
        assert_trees_equal(*outs)


@needs_kernels
@pytest.mark.parametrize("name", ["adagrad", "momentum", "ftrl"])
def test_vmapped_step_equals_the_unbatched_steps(name):
    """Under vmap the kernels run once per batch element."""
    tx = _tx(name)
    rng = np.random.default_rng(22)
    starts = [_start(name, tx, rng, (5,)) for _ in range(2)]
    batches = [tuple(map(jnp.asarray, _batch(rng, "dups", 8, (5,)))) for _ in range(2)]
    stacked = jax.tree.map(lambda *x: jnp.stack(x), *[(*a, *b) for a, b in zip(starts, batches, strict=True)])
    for fused in (False, True):
        step = _step(tx, fused)
        out = jax.jit(jax.vmap(lambda *a, step=step: step(*a)[:2]))(*stacked)
        for i in range(2):
            one = jax.jit(step)(*starts[i], *batches[i])[:2]
            assert_trees_equal(jax.tree.map(lambda x, i=i: x[i], out), one)


# --- Momentum with catch-up: the fused kernel (update_and_apply) and the rows kernel (tx.update's two calls). ---

DOORS = ["fused", "two calls"]


def _catch_up_run(tx, p, s, batches, kernels: bool, door: str = "fused"):
    step = jax.jit(_step(tx, door == "fused", num_rows=p.shape[0]))
    kernel = "catch_up_momentum_apply" if door == "fused" else "catch_up_momentum_rows"
    with osa.use_kernels(kernels):
        # Compiled: a row-sharded table's kernel call is placed by the partitioner.
        text = step.lower(p, s, *batches[0]).compile().as_text()
        called = set(re.findall(f'custom_call_target="{_kernel_path.PREFIX}(\\w+)"', text))
        other = "catch_up_momentum_rows" if door == "fused" else "catch_up_momentum_apply"
        assert (kernel in called) == kernels and other not in called, called
        for ids, values in batches:
            p, s, _ = step(p, s, ids, values)
    return p, s


def _zipf_batches(rng):
    """Forty batches of 48 Zipf ids over 300 rows (and -1 and two ids past the table), most rows idle a while."""
    return [
        (
            jnp.asarray((rng.zipf(1.3, 48) - 1) % 303 - 1, jnp.int32),
            jnp.asarray(rng.standard_normal((48, 8)), jnp.float32),
        )
        for _ in range(40)
    ]


@needs_kernels
@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("lr", [LR, SCHEDULE], ids=["constant", "schedule"])
@pytest.mark.parametrize("door", DOORS)
def test_catch_up_momentum_fused_equals_the_xla_path(lr, nesterov, door):
    """Forty Zipf steps over 300 rows, most of them idle for a while: the last steps bitwise; Nesterov's parameters
    and trace bitwise; the plain trace's sum rounds as lazy momentum's does, its drift within a few ulps."""
    tx = osa.sparse_sgd(lr, MU, nesterov, catch_up=True)
    rng = np.random.default_rng([30, nesterov])
    p = jnp.asarray(rng.standard_normal((300, 8)), jnp.float32)
    batches = _zipf_batches(rng)
    native, xla = (_catch_up_run(tx, p, tx.init(p), batches, kernels, door) for kernels in (True, False))
    assert_trees_equal(native[1].last_step, xla[1].last_step)
    assert int(native[1].count) == 40
    if nesterov:
        assert_trees_equal(native, xla)
    else:
        _assert_drift_within_ulps(native, xla)


@needs_kernels
@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("door", DOORS)
def test_catch_up_momentum_on_non_finite_and_extreme_values_as_on_the_xla_path(door, nesterov):
    """Six steps over 300 rows, two of them with NaN, infinities, the largest floats, subnormals and -0.0 among
    duplicates and padding (rows idle in between catch up across them): NaN and infinity where the XLA path has
    them, its numbers elsewhere (the plain trace's drift within 16 ulps of the largest element, as in
    test_catch_up_momentum_fused_equals_the_xla_path), the last steps bitwise."""
    tx = osa.sparse_sgd(SCHEDULE, MU, nesterov, catch_up=True)
    rng = np.random.default_rng([34, nesterov])
    p = jnp.asarray(rng.standard_normal((300, 8)), jnp.float32)
    batches = _zipf_batches(rng)[:6]
    for i in (1, 3):
        ids, values = np.array(batches[i][0]), non_finite_values(np.asarray(batches[i][1]))
        ids[:10] = [5, 40, 41, 42, 43, 44, 45, 46, 5, 40]
        batches[i] = (jnp.asarray(ids), jnp.asarray(values))
    native, xla = (_catch_up_run(tx, p, tx.init(p), batches, kernels, door) for kernels in (True, False))
    assert np.isnan(np.asarray(native[0])).any()
    assert_trees_equal(native[1].last_step, xla[1].last_step)
    assert_same_non_finite(native, xla, rtol=1e-5, ulps_of_largest=16)


def _assert_drift_within_ulps(native, xla):
    """The plain trace's sum rounds as lazy momentum's does: parameters and trace within 16 ulps of the largest."""
    for a, b in ((native[0], xla[0]), (native[1].trace, xla[1].trace)):
        scale = float(jnp.max(jnp.abs(b)))
        assert float(jnp.max(jnp.abs(a - b))) <= 16 * float(np.spacing(F32(scale)))


@needs_kernels
@pytest.mark.parametrize("door", DOORS)
def test_catch_up_momentum_with_an_injected_momentum_takes_its_coefficients_per_key(door):
    """A momentum injected (traced: no table of its powers, no window) reaches the kernel as coefficients per key,
    computed as the XLA path computes them per row: Nesterov's parameters, trace and last steps bitwise the XLA
    path's over forty Zipf steps."""
    tx = optax.inject_hyperparams(osa.sparse_sgd, static_args=("nesterov", "catch_up"))(
        LR, MU, nesterov=True, catch_up=True
    )
    rng = np.random.default_rng(33)
    p = jnp.asarray(rng.standard_normal((300, 8)), jnp.float32)
    batches = _zipf_batches(rng)
    native, xla = (_catch_up_run(tx, p, tx.init(p), batches, kernels, door) for kernels in (True, False))
    assert_trees_equal(native, xla)
    assert int(native[1].inner_state.count) == 40


@needs_kernels
@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("door", DOORS)
def test_catch_up_momentum_rows_idle_for_any_count(nesterov, door):
    """One step from a state whose rows sat out 0 to 2**30 steps (and rows that never moved): the kernel's caught-up
    rows as the XLA path's, from the same coefficients."""
    tx = osa.sparse_sgd(LR, MU, nesterov, catch_up=True)
    rng = np.random.default_rng([31, nesterov])
    rows, done = 40, 2**30 + 5
    p = jnp.asarray(rng.standard_normal((rows, 6)), jnp.float32)
    last = np.asarray([0, 1, 2, done - 1, done, *rng.integers(1, done, rows - 5)], np.int32)
    s = tx.init(p)._replace(
        count=jnp.int32(done),
        trace=jnp.asarray(rng.standard_normal((rows, 6)), jnp.float32),
        last_step=jnp.asarray(last),
    )
    batch = [
        (
            jnp.asarray(rng.permutation(rows + 4)[:30] - 2, jnp.int32),
            jnp.asarray(rng.standard_normal((30, 6)), jnp.float32),
        )
    ]
    native, xla = (_catch_up_run(tx, p, s, batch, kernels, door) for kernels in (True, False))
    assert_trees_equal(native[1].last_step, xla[1].last_step)
    assert_trees_equal(native[1].trace, xla[1].trace)  # distinct ids: one entry a row
    if nesterov:
        assert_trees_equal(native[0], xla[0])
    else:
        assert_trees_equal(native[0], xla[0], atol=4 * float(np.spacing(F32(jnp.max(jnp.abs(xla[0]))))))


@needs_kernels
@pytest.mark.parametrize("door", DOORS)
@pytest.mark.parametrize(
    ("tail", "kind"), [((1,), "extreme"), ((), "dups"), ((513,), "promised"), ((3, 4), "dups"), ((5,), "distinct")]
)
def test_catch_up_momentum_shapes_padding_promises_and_threads(tail, kind, door):
    """Widths 1 and 513, a 1-D and a 3-D table, int32 extremes as padding, duplicates and promised-distinct ids, from
    a state whose rows sat out 0 to 9 steps (and never moved): Nesterov's trace and records bitwise the XLA path's,
    its parameters within a rounding of the replayed row and one of the new (at some widths XLA:CPU contracts the
    replay's ``p - C t`` into a multiply-add in some elements and not in others; the kernel always does),
    and the same bits on 1 and 4 threads."""
    tx = osa.sparse_sgd(LR, MU, True, catch_up=True)
    rng = np.random.default_rng([50, len(tail), sum(tail), len(kind)])
    p = jnp.asarray(rng.standard_normal((ROWS, *tail)), jnp.float32)
    s = tx.init(p)._replace(
        count=jnp.int32(10),
        trace=jnp.asarray(rng.standard_normal((ROWS, *tail)), jnp.float32),
        last_step=jnp.asarray(rng.integers(0, 11, ROWS), jnp.int32),
    )
    ids, values = map(jnp.asarray, _batch(rng, kind, 24, tail))
    step = jax.jit(_step(tx, door == "fused", kind == "promised"))
    outs = {}
    for kernels, threads in ((False, None), (True, 1), (True, 4)):
        with osa.use_kernels(kernels, threads=threads):
            text = step.lower(p, s, ids, values).as_text()
            assert ("catch_up_momentum_" + ("apply" if door == "fused" else "rows") in text) == kernels
            outs[kernels, threads] = step(p, s, ids, values)[:2]
    assert_trees_equal(outs[True, 1], outs[True, 4])
    (pn, sn), (px, sx) = outs[True, 1], outs[False, None]
    assert_trees_equal((sn.trace, sn.last_step, sn.count), (sx.trace, sx.last_step, sx.count))
    # One rounding of the replayed row p - C t apart (C < lr mu**2 / (1 - mu) with Nesterov), then of the new one.
    replayed = np.abs(np.asarray(p)) + LR * MU**2 / (1 - MU) * np.abs(np.asarray(s.trace))
    ulps = np.spacing(replayed.astype(F32)) + np.spacing(np.abs(np.asarray(px)))
    assert np.all(np.abs(np.asarray(pn) - np.asarray(px)) <= ulps)
    assert int(sn.last_step.max()) == 11


@needs_kernels
@pytest.mark.parametrize("door", DOORS)
def test_catch_up_momentum_in_place_under_donation(door):
    """Donated, the table, trace and records are updated in place: temporaries of the batch's size only."""
    tx = osa.sparse_sgd(LR, MU, catch_up=True)
    temps = {}
    for rows in (1_000, 100_000):
        step = jax.jit(_step(tx, door == "fused", num_rows=rows), donate_argnums=(0, 1))
        args = _step_args(tx, rows, 16)
        temps[rows] = step.lower(*args).compile().memory_analysis().temp_size_in_bytes
    report = osa.step_report(step, *args, min_bytes=100_000 * 4)
    assert report.in_place and report.kernel_path == "native-cpu", str(report)
    assert temps[100_000] == temps[1_000] < 1_000 * 16 * 4


@needs_kernels
@pytest.mark.parametrize("door", DOORS)
def test_catch_up_momentum_fuses_after_global_norm_clipping(door):
    """``chain(sparse_aware(clip_by_global_norm), sparse_sgd(..., catch_up=True))``: one fused pass, which clips
    each summed row as it reads the entries; the XLA path's numbers to a rounding (XLA may fuse the clipping's
    product into the trace's multiply-add)."""
    tx = optax.chain(osa.sparse_aware(optax.clip_by_global_norm(0.5)), osa.sparse_sgd(LR, MU, True, catch_up=True))
    rng = np.random.default_rng(32)
    p = jnp.asarray(rng.standard_normal((100, 6)), jnp.float32)
    ids = [jnp.asarray((rng.zipf(1.3, 24) - 1) % 100, jnp.int32) for _ in range(12)]
    batches = [(i, jnp.asarray(rng.standard_normal((24, 6)), jnp.float32)) for i in ids]
    native, xla = (_catch_up_run(tx, p, tx.init(p), batches, kernels, door) for kernels in (True, False))
    assert_trees_equal(native, xla, rtol=2e-6, atol=1e-6)
    assert int(optax.tree.get(native[1], "CatchUpSgdState").last_step.max()) == 12


@needs_kernels
def test_float16_parameters_with_a_float32_trace_take_the_xla_path():
    """The element-wise kernels take float32 parameters: bfloat16 ones with a float32 trace (``accumulator_dtype``)
    and float32 gradients step on the XLA path, at both doors."""
    tx = osa.sparse_sgd(LR, momentum=MU, accumulator_dtype=jnp.float32)
    p = jnp.ones((ROWS, 5), jnp.bfloat16)
    g = osa.IndexedRows(jnp.array([1, 1, 4], jnp.int32), jnp.ones((3, 5), jnp.float32), ROWS)
    fused = jax.jit(lambda p, s: osa.update_and_apply(tx, g, s, p))
    assert "momentum_apply" not in fused.lower(p, tx.init(p)).as_text()
    new_p, new_s = fused(p, tx.init(p))
    with osa.use_kernels(False):
        assert_trees_equal((new_p, new_s), jax.jit(lambda p, s: osa.update_and_apply(tx, g, s, p))(p, tx.init(p)))


@needs_kernels
@pytest.mark.parametrize(
    "options",
    [
        {"learning_rate": jnp.float32(LR)},
        {"learning_rate": LR, "learning_rate_power": -4.0},
        {"learning_rate": LR, "learning_rate_power": -1.5},
        {"learning_rate": SCHEDULE, "learning_rate_power": -0.75, "l2_shrinkage_regularization_strength": 0.01},
    ],
    ids=["array-rate", "power-4", "power-1.5", "schedule-power"],
)
def test_ftrl_fused_and_two_calls_are_the_xla_path_bitwise(options):
    """An array learning rate is a constant (XLA multiplies by its reciprocal, as for a float), powers the kernel
    takes with powf as XLA:CPU does, a schedule with another power: both doors bitwise the XLA path's."""
    tx = osa.sparse_ftrl(**options, l1_regularization_strength=0.001)
    rng = np.random.default_rng([40, len(options)])
    p, s = _start("ftrl", tx, rng, (6,))
    batches = [tuple(map(jnp.asarray, _batch(rng, "dups", 20, (6,)))) for _ in range(6)]
    xla = _run("ftrl", tx, p, s, batches, fused=False, kernels=False)
    for fused in (False, True):
        assert_trees_equal(_run("ftrl", tx, p, s, batches, fused=fused, kernels=True)[:2], xla[:2])


@needs_kernels
def test_ftrl_with_injected_power_is_the_xla_path_bitwise():
    """Under ``inject_hyperparams`` the power is traced: the kernel chooses the square root where it is -1/2 at run
    time, as the rule's ``jnp.where`` does."""
    rng = np.random.default_rng(41)
    for power in (-0.5, -0.3):
        tx = optax.inject_hyperparams(osa.sparse_ftrl)(learning_rate=LR, learning_rate_power=power)
        p, s = _start("ftrl", tx, rng, (6,))
        batch = [tuple(map(jnp.asarray, _batch(rng, "dups", 20, (6,))))]
        xla = _run("ftrl", tx, p, s, batch, fused=False, kernels=False)
        for fused in (False, True):
            assert_trees_equal(_run("ftrl", tx, p, s, batch, fused=fused, kernels=True)[:2], xla[:2])


@needs_kernels
@pytest.mark.parametrize("door", DOORS)
def test_catch_up_momentum_sharded_vmapped_and_empty(door):
    """The catch-up kernel on a table and record split by rows over 8 devices, under vmap, and on an empty batch."""
    tx = osa.sparse_sgd(LR, MU, True, catch_up=True)
    rng = np.random.default_rng(42)
    rows = 96
    p0 = jnp.asarray(rng.standard_normal((rows, 5)), jnp.float32)
    batches = [
        (jnp.asarray((rng.zipf(1.3, 32) - 1) % rows, jnp.int32), jnp.asarray(rng.standard_normal((32, 5)), jnp.float32))
        for _ in range(4)
    ]
    mesh = jax.make_mesh((8,), ("rows",), axis_types=(jax.sharding.AxisType.Auto,))
    by_rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("rows"))
    # the tables and per-row state split by rows, the rest (the count, the record of long-idle sums) replicated
    split = lambda x: by_rows if x.ndim and x.shape[0] == rows else None  # noqa: E731
    place = functools.partial(jax.tree.map, lambda x: jax.device_put(x, split(x)))
    one = _catch_up_run(tx, p0, tx.init(p0), batches, kernels=True, door=door)
    sharded = _catch_up_run(tx, place(p0), place(tx.init(p0)), batches, kernels=True, door=door)
    assert sharded[0].sharding.is_equivalent_to(by_rows, 2)
    assert sharded[1].last_step.sharding.is_equivalent_to(by_rows, 1)
    assert_trees_equal(sharded, one)

    step = jax.jit(_step(tx, door == "fused", num_rows=rows))
    starts = [(p0, tx.init(p0)), one]
    stacked = jax.tree.map(lambda *x: jnp.stack(x), *[(*a, *b) for a, b in zip(starts, batches[:2], strict=True)])
    out = jax.jit(jax.vmap(step))(*stacked)
    for i in range(2):
        assert_trees_equal(jax.tree.map(lambda x, i=i: x[i], out), step(*starts[i], *batches[i]))

    empty = (jnp.zeros((0,), jnp.int32), jnp.zeros((0, 5), jnp.float32))
    p, s, _ = step(*one, *empty)
    assert_trees_equal((p, s.trace, s.last_step), (one[0], one[1].trace, one[1].last_step))


@needs_kernels
@pytest.mark.parametrize("power", [-1.0, -2.0, -3.0])
def test_ftrl_with_a_power_xla_turns_into_products_takes_the_xla_path(power):
    """XLA:CPU rewrites the powers 1, 2 and 3 of the rule into products and rounds them (and what reads them) its
    own way: those FTRL steps take the XLA path at both doors, and ``step_report`` says so."""
    tx = osa.sparse_ftrl(LR, learning_rate_power=power)
    p, s = _start("ftrl", tx, np.random.default_rng(43), (6,))
    ids, values = map(jnp.asarray, _batch(np.random.default_rng(44), "dups", 20, (6,)))
    for fused in (False, True):
        step = jax.jit(_step(tx, fused))
        assert "ftrl_" not in step.lower(p, s, ids, values).as_text()
    report = osa.step_report(jax.jit(_step(tx, True)), p, s, ids, values)
    assert "no native kernel for the optimizer" in str(report), str(report)


def _scheduled_idle_start(tx, rng):
    """A table of 64 rows at step 3,000 under a schedule, a quarter of its rows never moved, a quarter idle within
    the window (``K = 180`` steps), a quarter idle longer with their long-idle sums in the state's record (hand
    written: both paths read them), and a quarter idle longer without (their entries for no step, or another):
    ``(p, state, kind)``, ``kind`` per row 0 to 3 in that order."""
    rows, width, done, cap = 64, 6, 3_000, 180
    kind = np.arange(rows) % 4
    last = np.zeros(rows, np.int64)
    last[kind == 1] = done - rng.integers(1, cap + 1, int((kind == 1).sum()))
    long_idle = rng.permutation(np.arange(1, done - cap - 1))[: int((kind >= 2).sum())]  # distinct last steps
    last[kind >= 2] = long_idle
    s = tx.init(jnp.zeros((rows, width), jnp.float32))
    coefficients, tags = np.array(s.idle_record.coefficients), np.array(s.idle_record.last_steps)
    held, missed = last[kind == 2], last[kind == 3]
    tags[held] = held
    coefficients[held, 0] = rng.uniform(0.001, 0.05, held.size)
    tags[missed[::2]] = missed[::2] + tags.size  # an entry for a later step, the others for none
    s = s._replace(
        count=jnp.int32(done),
        trace=jnp.asarray(rng.standard_normal((rows, width)), jnp.float32),
        last_step=jnp.asarray(last, jnp.int32),
        idle_record=s.idle_record._replace(coefficients=jnp.asarray(coefficients), last_steps=jnp.asarray(tags)),
    )
    return jnp.asarray(rng.standard_normal((rows, width)), jnp.float32), s, kind


def _scheduled_batch(rng, rows):
    """Every row once, a third of them again (duplicates), and padding (-1, ``rows``)."""
    ids = np.concatenate([rng.permutation(rows), rng.integers(0, rows, rows // 3), [-1, rows]])
    ids = rng.permutation(ids).astype(np.int32)
    return jnp.asarray(ids), jnp.asarray(rng.standard_normal((ids.size, 6)), jnp.float32)


@needs_kernels
@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("door", DOORS)
def test_catch_up_momentum_under_a_schedule_reads_the_record_and_flags_what_it_does_not_hold(
    nesterov, door, monkeypatch
):
    """Under a schedule the kernels take a returning row's sum over its idle steps from the window of the last steps
    or, idle longer, from the state's record, and flag (in each of its entries: ids repeat) exactly the in-range
    rows whose record entry is not for their last step, which the XLA rule takes (its update placed in the rows
    kernel's slot by key): the step as the XLA path's, Nesterov's trace and records bitwise and its parameters too
    but in the flagged rows, there within a rounding of the replayed row and one of the new (XLA:CPU contracts the
    replay's ``p - C t`` into a multiply-add in some elements and not in others, as it compiles the rule for those
    rows alone or for all), the plain trace's drift within a few ulps as in the run above."""
    flags: list[np.ndarray] = []
    call = _ffi.catch_up_momentum

    def recording(*args, **kwargs):
        out = call(*args, **kwargs)
        jax.debug.callback(lambda f: flags.append(np.asarray(f)), out[-1])
        return out

    monkeypatch.setattr(_ffi, "catch_up_momentum", recording)
    tx = osa.sparse_sgd(optax.cosine_decay_schedule(LR, 5_000), MU, nesterov, catch_up=True)
    rng = np.random.default_rng([60, nesterov])
    p, s, kind = _scheduled_idle_start(tx, rng)
    batch = [_scheduled_batch(rng, p.shape[0])]
    native, xla = (_catch_up_run(tx, p, s, batch, kernels, door) for kernels in (True, False))
    ids = np.asarray(batch[0][0])
    in_range = (ids >= 0) & (ids < p.shape[0])
    (got,) = flags
    np.testing.assert_array_equal(got > 0, in_range & (kind[np.clip(ids, 0, p.shape[0] - 1)] == 3))
    assert_trees_equal(native[1].last_step, xla[1].last_step)
    assert int(native[1].last_step.min()) == 3_001
    if nesterov:
        assert_trees_equal(native[1], xla[1])
        pn, px = np.asarray(native[0]), np.asarray(xla[0])
        np.testing.assert_array_equal(pn[kind != 3], px[kind != 3])
        replayed = np.abs(np.asarray(p)) + np.abs(np.asarray(s.trace))  # C < lr mu**2 / (1 - mu) < 1
        ulps = np.spacing(replayed.astype(F32)) + np.spacing(np.abs(px))
        assert np.all(np.abs(pn - px) <= ulps)
    else:
        _assert_drift_within_ulps(native, xla)


@needs_kernels
@pytest.mark.parametrize("door", DOORS)
def test_catch_up_momentum_flagged_rows_on_a_table_split_by_rows_and_after_clipping(door):
    """The flagged rows of a schedule's step (see above) on a table split by rows over 8 devices (the kernel on each
    block, the flags summed, the XLA rule's rows placed by key): the one-device step, bitwise; and after global-norm
    clipping, which the XLA rule applies to the flagged rows' sums as the kernel to the others', the XLA path's
    numbers to a rounding."""
    schedule = optax.cosine_decay_schedule(LR, 5_000)
    tx = osa.sparse_sgd(schedule, MU, True, catch_up=True)
    rng = np.random.default_rng(61)
    p, s, _ = _scheduled_idle_start(tx, rng)
    batch = [_scheduled_batch(rng, p.shape[0])]
    rows = p.shape[0]
    mesh = jax.make_mesh((8,), ("rows",), axis_types=(jax.sharding.AxisType.Auto,))
    by_rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("rows"))
    split = lambda x: by_rows if x.ndim and x.shape[0] == rows else None  # noqa: E731
    place = functools.partial(jax.tree.map, lambda x: jax.device_put(x, split(x)))
    one = _catch_up_run(tx, p, s, batch, kernels=True, door=door)
    sharded = _catch_up_run(tx, place(p), place(s), batch, kernels=True, door=door)
    assert sharded[0].sharding.is_equivalent_to(by_rows, 2)
    assert_trees_equal(sharded, one)

    clipped = optax.chain(osa.sparse_aware(optax.clip_by_global_norm(0.5)), tx)
    start = clipped.init(p)
    start = (start[0], s)
    native, xla = (_catch_up_run(clipped, p, start, batch, kernels, door) for kernels in (True, False))
    assert_trees_equal(native, xla, rtol=2e-6, atol=1e-6)
