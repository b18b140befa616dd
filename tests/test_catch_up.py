"""``sparse_adam(catch_up=True)``: sparse gradients, dense Adam's numbers.

The reference is dense Adam in float64 NumPy fed the same gradients, zeros
elsewhere. Float32 is the limit of any comparison with it: float32
``optax.adam`` drifts from it too, so catch-up must stay within twice that
drift, where lazy Adam is off by O(1).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import math
from collections.abc import Callable, Iterator
from typing import Any

import flax.serialization
import jax
import jax.experimental.sparse
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_sparse_adam as osa
from optax_sparse_adam import _adam, _catch_up, _coalesce, _kernel_path
from optax_sparse_adam._catch_up import idle_cap
from optax_sparse_adam._kernel_path import PREFIX
from tests.helpers import KERNELS_OFF, assert_trees_equal, checking_leaks, jit_once, needs_kernels, non_finite_zeroed

ROWS, WIDTH, BATCH, STEPS = 2000, 8, 64, 400


def _batches(seed: int, steps: int = STEPS) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        (((rng.zipf(1.3, BATCH) - 1) % ROWS).astype(np.int32), rng.normal(size=BATCH).astype(np.float32))
        for _ in range(steps)
    ]


W = np.random.default_rng(7).normal(size=WIDTH).astype(np.float32)
EMB0 = (0.1 * np.random.default_rng(8).normal(size=(ROWS, WIDTH))).astype(np.float32)


def _loss(params: Any, ids: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((params["emb"][ids] @ jnp.asarray(W) - y) ** 2)


def _dense_adam64(
    batches: list, lr: Any, b1: float, b2: float, eps: float, eps_root: float, torch: bool, weight_decay: float = 0.0
) -> dict:
    """Dense Adam (AdamW with ``weight_decay``) in float64: the losses and gradients it sees, its final parameters
    and moments."""
    p = EMB0.astype(np.float64)
    m, v = np.zeros_like(p), np.zeros_like(p)
    losses, grads = [], []
    for t, (ids, y) in enumerate(batches, start=1):
        r = p[ids] @ W - y
        losses.append(np.mean(r**2))
        g = np.zeros_like(p)
        np.add.at(g, ids, (2 * r / len(y))[:, None] * W[None, :])
        grads.append(g)
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        bc1, bc2 = 1 - b1**t, 1 - b2**t
        a = float(lr(t - 1)) if callable(lr) else lr
        if torch:
            u = np.sqrt(bc2) / bc1 * m / (np.sqrt(v + eps_root) + eps)
        else:
            u = (m / bc1) / (np.sqrt(v / bc2 + eps_root) + eps)
        p = p - a * (u + weight_decay * p)
    return {"loss": np.array(losses), "grad": grads, "p": p, "m": m, "v": v}


def _train(tx: optax.GradientTransformation, batches: list, how: str) -> dict:
    """Trains the table with ``tx``; ``how``: "dense" gradients, the same as rows ("every row"), row
    gradients ("rows"), or row gradients read caught up ("caught")."""
    params = {"emb": jnp.asarray(EMB0)}
    state = tx.init(params)
    if how in ("dense", "every row"):
        grad_fn = jax.value_and_grad(_loss)
    else:
        grad_fn = osa.value_and_row_grad(_loss, lambda p: p["emb"], catch_up=tx if how == "caught" else None)

    @jax.jit
    def step(params: Any, state: Any, ids: jax.Array, y: jax.Array) -> tuple[Any, Any, jax.Array, Any]:
        extra = {"opt_state": state} if how == "caught" else {}
        loss, grads = grad_fn(params, ids, y, **extra)
        if how == "every row":
            grads = {"emb": osa.IndexedRows(jnp.arange(ROWS, dtype=jnp.int32), grads["emb"], ROWS)}
        params, state = osa.update_and_apply(tx, grads, state, params)
        return params, state, loss, grads["emb"] if how == "dense" else grads["emb"].todense()

    losses, grads = [], []
    for ids, y in batches:
        params, state, loss, g = step(params, state, jnp.asarray(ids), jnp.asarray(y))
        losses.append(loss)
        grads.append(g)
    losses, grads = [float(x) for x in losses], [np.asarray(g) for g in grads]  # one host transfer after the run
    if how == "caught":
        params, state = jax.jit(lambda p, s: osa.catch_up(tx, p, s))(params, state)
    adam_state = state if how == "caught" else state[0]
    return {
        "loss": np.array(losses),
        "grad": grads,
        "p": np.asarray(params["emb"]),
        "m": np.asarray(adam_state.mu["emb"]),
        "v": np.asarray(adam_state.nu["emb"]),
    }


def _errors(run: dict, ref: dict) -> dict[str, float]:
    """Relative errors against the float64 reference, each over the whole run."""

    def rel(a: Any, b: Any) -> float:
        return float(np.max(np.abs(np.asarray(a) - b)) / np.max(np.abs(b)))

    return {
        "loss": float(np.max(np.abs(run["loss"] - ref["loss"]) / ref["loss"])),
        "grad": max(rel(a, b) for a, b in zip(run["grad"], ref["grad"], strict=True)),
        "p": rel(run["p"], ref["p"]),
        "m": rel(run["m"], ref["m"]),
        "v": rel(run["v"], ref["v"]),
    }


CASES = {
    "b1=0.9": {},
    "b1=0": {"b1": 0.0},
    "b1=0.5": {"b1": 0.5},
    "b1=0.99": {"b1": 0.99},
    "eps_root": {"eps_root": 1e-8},
    "schedule": {"learning_rate": optax.warmup_cosine_decay_schedule(0.0, 1e-2, 50, STEPS, 1e-3)},
    "torch": {"eps_placement": "torch"},
}


ADAMW_CASES = {
    "adamw": {"weight_decay": 0.1},
    "adamw schedule": {
        "weight_decay": 0.5,
        "learning_rate": optax.warmup_cosine_decay_schedule(0.0, 2e-2, 50, STEPS, 1e-3),
    },
    "adamw b1=0.99 eps_root": {"weight_decay": 0.3, "b1": 0.99, "eps_root": 1e-8},
    "adamw torch": {"weight_decay": 0.1, "eps_placement": "torch"},
}


@pytest.mark.parametrize("case", [*CASES, *ADAMW_CASES])
def test_catch_up_equals_dense_adam_over_a_zipf_run(case: str) -> None:
    """Adam, and AdamW (``sparse_adamw(catch_up=True)`` against ``optax.adamw``): every row decays every step,
    those never touched too, and a schedule's idle steps decay at their own rates (from the state's record, for rows
    idle longer than the window)."""
    kw = {"learning_rate": 1e-2, "b1": 0.9, "b2": 0.999, "eps": 1e-8, "eps_root": 0.0, **{**CASES, **ADAMW_CASES}[case]}
    torch = kw.pop("eps_placement", "optax") == "torch"
    batches = _batches(seed=len(case))
    lr = kw["learning_rate"]
    ref = _dense_adam64(batches, lr, kw["b1"], kw["b2"], kw["eps"], kw["eps_root"], torch, kw.get("weight_decay", 0))
    opts = {"eps_placement": "torch" if torch else "optax"}
    ours, theirs = (osa.sparse_adamw, optax.adamw) if "weight_decay" in kw else (osa.sparse_adam, optax.adam)
    # Float32 dense Adam: optax's itself, or for torch's placement the lazy rule fed every row (zeros elsewhere).
    f32 = _train(ours(**kw, **opts), batches, "every row") if torch else _train(theirs(**kw), batches, "dense")
    caught = _train(ours(**kw, **opts, catch_up=True), batches, "caught")
    e32, ecu = _errors(f32, ref), _errors(caught, ref)
    for key in e32:
        assert ecu[key] <= 2 * e32[key] + 1e-6, (key, ecu, e32)
    if kw["b1"] > 0:  # the lazy run is compared only here: not trained for b1=0
        elazy = _errors(_train(ours(**kw, **opts), batches, "rows"), ref)
        assert elazy["p"] > 100 * max(ecu["p"], 1e-7), (elazy, ecu)  # what catch-up fixes


@osa.use_kernels(False)  # the kernel negates inside a multiply-add: within ulps there (the native test below)
def test_maximize_on_the_negated_loss_is_the_minimization() -> None:
    """To float32 rounding (8 ulps of each leaf's scale after 100 steps): the two jitted graphs differ (a negation),
    XLA fuses each its own way, and an ulp apart in one step becomes a few over a run; a wrong sign is off by O(1)."""
    batches = _batches(seed=3, steps=100)
    neg = lambda p, ids, y: -_loss(p, ids, y)  # noqa: E731

    def run(loss: Any, maximize: bool) -> Any:
        tx = osa.sparse_adam(1e-2, maximize=maximize, catch_up=True)
        params = {"emb": jnp.asarray(EMB0)}
        state = tx.init(params)
        grad_fn = osa.value_and_row_grad(loss, lambda p: p["emb"], catch_up=tx)

        @jax.jit
        def step(params: Any, state: Any, ids: jax.Array, y: jax.Array) -> tuple[Any, Any]:
            _, grads = grad_fn(params, ids, y, opt_state=state)
            return osa.update_and_apply(tx, grads, state, params)

        for ids, y in batches:
            params, state = step(params, state, jnp.asarray(ids), jnp.asarray(y))
        return jax.jit(lambda p, s: osa.catch_up(tx, p, s))(params, state)

    ascended, descended = run(neg, True), run(_loss, False)
    for a, d in zip(jax.tree.leaves(ascended), jax.tree.leaves(descended), strict=True):  # mu: of the negated loss
        scale = float(np.max(np.abs(np.asarray(d)))) if jnp.issubdtype(d.dtype, jnp.floating) and d.size else 0.0
        np.testing.assert_allclose(np.asarray(a), np.asarray(d), rtol=0, atol=8 * np.spacing(np.float32(scale)))


def _adam64(
    p: np.ndarray, m: np.ndarray, v: np.ndarray, g: Any, t: int, lr: float, float32_corrections: bool = False
) -> tuple[np.ndarray, ...]:
    """One step of dense Adam (optax's defaults) in float64, at count ``t``; with ``float32_corrections``, the bias
    corrections as float32 computes them (``1 - b**t`` from float32 betas: off from the exact ones by up to 3e-5
    relative early on, for float32 optax.adam too)."""
    b1, b2, eps = 0.9, 0.999, 1e-8
    m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
    c1, c2 = _float32_corrections(t) if float32_corrections else (1 - b1**t, 1 - b2**t)
    return p - lr * (m / c1) / (np.sqrt(v / c2) + eps), m, v


def _float32_corrections(t: int) -> tuple[float, float]:
    """``1 - b**t`` for optax's default betas as float32 computes them in a step (the count traced), at ``t <
    1024``."""
    c1, c2 = _float32_correction_table()
    return float(c1[t]), float(c2[t])


@functools.cache
def _float32_correction_table() -> tuple[np.ndarray, np.ndarray]:
    """:func:`_float32_corrections` for the counts ``0 .. 1023``, in one program (a concrete count would take
    ``integer_pow``, one program per count)."""
    counts = jnp.arange(1024, dtype=jnp.int32)
    return tuple(np.asarray(jax.jit(lambda t, b=b: 1 - b**t)(counts), np.float64) for b in (0.9, 0.999))


@pytest.mark.parametrize("eps_placement", ["optax", "torch"])
def test_the_idle_steps_rates_are_within_a_few_ulps_of_their_values_in_double(eps_placement: str) -> None:
    """``h_j(tau)``, the factors of the idle steps' terms, in float32 (``sqrt(c2)``'s powers taken as products):
    within ``j + 3`` units of ``2**-24`` (relative) of ``lr sqrt(c2)^(j + 1) / c1`` (optax's placement of ``eps``)
    or ``lr sqrt(c2) / c1`` (torch's) in double, on the float32 corrections the steps use, at every step of a
    schedule's first 3,000. Every coefficient of the series, in the window and past it, is a sum of these."""
    lr = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 30, 5000)
    hp = _adam._hyperparams(0.9, 0.999, 1e-8, 0.0, False, eps_placement)
    replayer = _catch_up.Replayer(lr, hp)
    plan = _catch_up._series_plan(replayer, jnp.float32)
    tau = jnp.arange(1, 3001, dtype=jnp.int32)

    @jax.jit
    def rates(t: jax.Array) -> tuple[jax.Array, ...]:  # with the float32 rates and corrections they are made of
        corrections = (1 - hp.b1**t, 1 - hp.b2**t) if eps_placement == "optax" else _adam._torch_corrections(hp, t)
        return plan.rates(t, replayer.lr(t - 1), jnp), replayer.lr(t - 1), *corrections

    got, rate, c1, c2 = (np.asarray(x, np.float64) for x in rates(tau))
    j = np.arange(8) if eps_placement == "optax" else np.zeros(8)
    want = (rate / c1)[:, None] * np.sqrt(c2)[:, None] ** (j[None, :] + 1)
    assert np.all(want[1:] > 0)
    units = np.abs(got[1:] - want[1:]) / want[1:] / 2.0**-24  # step 1 of the warm-up: lr 0
    assert np.all(units <= np.arange(8) + 3), units.max(axis=0)


@pytest.mark.parametrize(("b1", "b2"), [(0.9, 0.999), (0.99, 0.999), (0.95, 0.9999)])
@pytest.mark.parametrize("learning_rate", ["constant", "schedule"])
def test_the_window_is_within_a_few_ulps_of_its_recurrence_in_double(b1, b2, learning_rate) -> None:
    """The window of the idle steps' coefficients, ``C(d) = rho (h(d) + C(d - 1))`` over the last ``K =
    idle_cap`` steps, summed in blocks: within 8 units of ``2**-24`` (relative) of the recurrence in double on the
    same float32 ``h``, at every ``d`` and term (an associative scan's tree of products was 51 at ``b1 = 0.99``)."""
    lr = 0.01 if learning_rate == "constant" else optax.linear_schedule(0.01, 0.001, 3000)
    replayer = _catch_up.Replayer(lr, _adam._hyperparams(b1, b2, 1e-8, 0.0, False, "optax"))
    plan = _catch_up._series_plan(replayer, jnp.float32)
    done = plan.cap + 40  # the window reaches back to step 41
    got = np.asarray(_catch_up._window(plan, replayer.lr, jnp.int32(done), gathered=False), np.float64)
    tau = done - jnp.arange(plan.cap, dtype=jnp.int32)
    h = np.asarray(plan.rates(tau, replayer.lr(tau - 1), jnp), np.float64)
    want, c = np.zeros_like(h), np.zeros(h.shape[1])
    for d in range(plan.cap):
        c = plan.rho * (h[d] + c)
        want[d] = c
    assert got.shape == want.shape == (idle_cap(b1, b2), 8)
    assert np.max(np.abs(got - want) / np.abs(want)) <= 8 * 2.0**-24


def _long_idle_in_double(plan: Any, replayer: Any, lasts: np.ndarray, decay: Any) -> np.ndarray:
    """``G_j(last) = sum_{k=1..K} h_j(last + k) rho_j^k`` for each of ``lasts``, in double on the float32 ``h``
    the steps compute; with ``decay`` (AdamW's), each term divided by the decay of the row's first ``k`` idle
    steps."""
    k = np.arange(1, plan.cap + 1)
    tau = jnp.asarray(lasts[:, None] + k[None, :], jnp.int32)
    h = np.asarray(plan.rates(tau, replayer.lr(tau - 1), jnp), np.float64)  # (lasts, K, terms)
    terms = h * (plan.rho[None, :] ** k[:, None])[None]
    if decay is not None:
        through = np.cumsum(np.asarray(decay.log(replayer.lr, tau), np.float64), axis=1)
        terms = terms * np.exp(-through)[..., None]
    return terms.sum(axis=1)


@pytest.mark.parametrize("decay", [False, True])
def test_the_long_idle_coefficients_are_taken_once_per_last_step(decay: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a schedule the coefficients ``G_j(last) = sum_{k=1..K} h_j(last + k) rho_j^k`` of rows idle longer than
    the window are a function of the last step alone: on the CPU they are computed once for each distinct last
    step among the long-idle entries, in chunks of ``_LAST_STEPS`` (several here, the last one overlapping the one
    before), and gathered for every entry. Each long-idle entry's is within 64 units of ``2**-24`` (relative) of
    the sum in double on the same float32 ``h`` (with AdamW's decay, each term divided by the decay of the row's
    first ``k`` idle steps; the loop takes ``rho**k`` and the sum as ``K = 221`` float32 products and additions, each
    rounded: about 26 units here), and within 2 of its value computed for every entry on its own (XLA contracts the
    sum's multiply-adds by its own choice in each program)."""
    lr = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 30, 5000)
    replayer = _catch_up.Replayer(lr, _adam._hyperparams(0.9, 0.999, 1e-8, 0.0, False, "optax"))
    weights = None
    if decay:
        decay_ = _catch_up.Decay(0.3, None, jnp.zeros(1, jnp.float32))
        weights = _catch_up._DecayWeights(decay_, replayer.lr, None, jnp.int32(4000), 221)
    plan = _catch_up._series_plan(replayer, jnp.float32, decay=None if weights is None else weights.decay)
    rng = np.random.default_rng(2)
    n = 1000
    last = rng.integers(1, 3000, 300)[rng.integers(0, 300, n)].astype(np.int32)  # repeated last steps
    long_idle = rng.random(n) < 0.7
    grouped = []  # the distinct last steps: from distinct_ids (the native kernel, or the XLA path's hash rounds)
    monkeypatch.setattr(_catch_up, "distinct_ids", lambda *a: grouped.append(a) or _coalesce.distinct_ids(*a))
    run = jax.jit(lambda last, rows: _catch_up._long_idle_loop(plan, replayer.lr, last, rows, weights))
    run.lower(last, long_idle)
    assert len(grouped) == 1
    got = np.asarray(run(last, long_idle), np.float64)[long_idle]
    assert len(np.unique(last[long_idle])) > 3 * _catch_up._LAST_STEPS
    want = _long_idle_in_double(plan, replayer, np.unique(last), None if weights is None else weights.decay)
    want = want[np.searchsorted(np.unique(last), last[long_idle])]
    assert np.max(np.abs(got - want) / np.abs(want)) <= 64 * 2.0**-24
    monkeypatch.setattr(_catch_up, "_LAST_STEPS", n)  # every entry on its own
    each = np.asarray(
        jax.jit(lambda last, rows: _catch_up._long_idle_loop(plan, replayer.lr, last, rows, weights))(last, long_idle),
        np.float64,
    )[long_idle]
    assert np.max(np.abs(got - each) / np.abs(each)) <= 2 * 2.0**-24


@pytest.mark.parametrize("decay", [False, True])
def test_the_record_holds_each_last_steps_long_idle_coefficients(decay: bool) -> None:
    """Under a schedule each step records ``G_j(done - K)``, its window's last coefficients (with AdamW's decay,
    divided by the decay of the window's ``K`` steps), in the state's record at row ``(done - K) mod 65536``: after
    the steps from count 0 to ``3000 + K``, row ``L`` holds ``G_j(L) = sum_{k=1..K} h_j(L + k) rho_j^k`` for every
    ``L`` from 1 to 3,000, within 16 units of ``2**-24`` (relative) of the sum in double on the same float32 ``h``
    (with the decay, each term divided by the decay of the row's first ``k`` idle steps), as the loop's are within
    64 above (measured: 5, and 6 with the decay)."""
    lr = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 30, 5000)
    replayer = _catch_up.Replayer(lr, _adam._hyperparams(0.9, 0.999, 1e-8, 0.0, False, "optax"))
    decay_ = _catch_up.Decay(0.3, None) if decay else None
    plan = _catch_up._series_plan(replayer, jnp.float32, decay=decay_)
    record = _catch_up.idle_record((plan,), lr)
    assert record.coefficients.shape == (_catch_up._RECORD_STEPS, 8) == (65536, 8)
    lasts = 3000

    @jax.jit
    def run(record: osa.IdleRecord) -> osa.IdleRecord:
        def step(done: jax.Array, record: osa.IdleRecord) -> osa.IdleRecord:
            return _catch_up.record_step(record, plan, replayer.lr, done, decay_)

        return jax.lax.fori_loop(0, lasts + plan.cap + 1, step, record)

    out = run(record)
    np.testing.assert_array_equal(out.last_steps[: lasts + 1], np.arange(lasts + 1))
    assert np.all(np.asarray(out.last_steps[lasts + 1 : -plan.cap]) == -1)  # the last K rows: steps before 0
    got = np.asarray(out.coefficients, np.float64)[1 : lasts + 1]
    want = _long_idle_in_double(plan, replayer, np.arange(1, lasts + 1), decay_)
    assert np.max(np.abs(got - want) / np.abs(want)) <= 16 * 2.0**-24, np.max(np.abs(got - want) / np.abs(want))


@pytest.mark.parametrize("case", ["schedule", "adamw schedule"])
def test_a_schedules_long_idle_rows_read_the_record_as_far_as_it_reaches(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows idle longer than the window under a schedule read their coefficients from the state's record, as far
    back as it reaches (65,536 last steps before the window's), and compute them step by step beyond it, once per
    distinct last step. With the record cut to 100 last steps, the Zipf run above (rows idle more than the window's
    221 steps within the record's reach and beyond it, read caught up) ends with dense Adam's (AdamW's) parameters
    and moments to the bound of that test. Then
    one step on rows of each kind, through both doors: against the same step with a record that holds no last step
    (as a state built by hand; every long-idle row takes the loop), the moments bitwise and the parameters within
    two ulps and 128 units of ``2**-24`` of their move (the record's sums and the loop's are within 16 and 64 units
    of the sum in double, measured 6 and 26; their difference scales with the idle steps'
    displacement); with the record scaled, exactly the rows idle within its reach move differently. The kernels read
    the record's entries themselves and flag the rows whose entry it does not hold for the XLA rule: exactly those
    idle past its reach, or every long-idle row where it holds no entry."""
    kw = {"learning_rate": 1e-2, "b1": 0.9, "b2": 0.999, "eps": 1e-8, "eps_root": 0.0, **{**CASES, **ADAMW_CASES}[case]}
    batches = _batches(seed=len(case))
    cap, steps = int(idle_cap(0.9, 0.999)), 100
    ours, theirs = (osa.sparse_adamw, optax.adamw) if "weight_decay" in kw else (osa.sparse_adam, optax.adam)
    monkeypatch.setattr(_catch_up, "_RECORD_STEPS", steps)
    tx = ours(**kw, catch_up=True)
    params, state = jnp.asarray(EMB0), tx.init(jnp.asarray(EMB0))
    grad_fn = osa.value_and_row_grad(lambda p, ids, y: _loss({"emb": p}, ids, y), lambda p: p, catch_up=tx)

    @jax.jit
    def step(p: jax.Array, s: Any, ids: jax.Array, y: jax.Array) -> Any:  # the rows read caught up
        return osa.update_and_apply(tx, grad_fn(p, ids, y, opt_state=s)[1], s, p)

    last = np.zeros(ROWS, np.int64)
    for t, (ids, y) in enumerate(batches, start=1):
        params, state = step(params, state, jnp.asarray(ids), jnp.asarray(y))
        last[ids] = t
    ref = _dense_adam64(batches, kw["learning_rate"], 0.9, 0.999, 1e-8, 0.0, False, kw.get("weight_decay", 0))
    e32 = _errors(_train(theirs(**kw), batches, "dense"), ref)
    p, s = jax.jit(lambda p, s: osa.catch_up(tx, p, s))(params, state)
    for key, got in [("p", p), ("m", s.mu), ("v", s.nu)]:
        ecu = float(np.max(np.abs(np.asarray(got) - ref[key])) / np.max(np.abs(ref[key])))
        assert ecu <= 2 * e32[key] + 1e-6, (key, ecu, e32)
    idle = len(batches) - last
    reach = [(idle > cap, cap + steps), (idle > cap + steps, 10**9)]
    near, far = (np.flatnonzero((last > 0) & lo & (idle <= hi))[:6] for lo, hi in reach)
    assert near.size == far.size == 6
    ids = np.concatenate([near, far, np.argsort(idle)[:4]]).astype(np.int32)  # and rows touched last step
    g = osa.IndexedRows(
        jnp.asarray(ids), jnp.asarray(np.random.default_rng(5).normal(size=(ids.size, WIDTH)), jnp.float32), ROWS
    )

    def two_calls(p: jax.Array, s: Any) -> Any:
        updates, s = tx.update(g, s, p)
        return osa.apply_updates(p, updates), s

    fused = lambda p, s: osa.update_and_apply(tx, g, s, p)  # noqa: E731
    record = state.idle_record
    without = state._replace(idle_record=record._replace(last_steps=jnp.full_like(record.last_steps, -1)))
    scaled = state._replace(idle_record=record._replace(coefficients=2 * record.coefficients))
    flagged = {
        door: _record_flags(monkeypatch, kernel)
        for door, kernel in [(fused, "catch_up_adam_apply"), (two_calls, "catch_up_adam_rows")]
    }
    for door in (fused, two_calls):
        (p1, s1), (p0, s0), (p2, _) = (jax.jit(door)(params, s) for s in (state, without, scaled))
        if _kernel_path.enabled():  # the kernel reads the entries the record holds, and flags the rows past its
            # reach for the XLA rule (all long-idle rows, where it holds none)
            held, unheld, _ = flagged[door]
            np.testing.assert_array_equal(held > 0, np.isin(ids, far))
            np.testing.assert_array_equal(unheld > 0, np.isin(ids, np.concatenate([near, far])))
        assert_trees_equal(s1._replace(idle_record=None), s0._replace(idle_record=None))
        p_old, p1, p0, p2 = (np.asarray(x) for x in (params, p1, p0, p2))
        bound = 2 * np.spacing(np.maximum(np.abs(p_old), np.abs(p1))) + 128 * 2.0**-24 * np.abs(p1 - p_old)
        assert np.all(np.abs(p1 - p0) <= bound), np.max(np.abs(p1 - p0) / bound)
        moved = np.any(p2 != p1, axis=1)
        assert moved[near].all() and not moved[far].any() and moved.sum() == near.size, np.flatnonzero(moved)


@pytest.mark.parametrize("door", ["update_and_apply", "two calls"])
@pytest.mark.parametrize("optimizer", ["adam", "adamw", "amsgrad", "amsgrad, b2 injected", "sgd"])
def test_an_empty_batch_under_a_schedule_touches_nothing(optimizer: str, door: str) -> None:
    """A batch of no ids under a schedule (the kernels' per-key operands then empty): the step is the XLA path's,
    bitwise, and moves no row; the count advances."""
    lr = optax.linear_schedule(1e-2, 1e-3, 100)
    tx = {
        "adam": lambda: osa.sparse_adam(lr, catch_up=True),
        "adamw": lambda: osa.sparse_adamw(lr, weight_decay=0.1, catch_up=True),
        "amsgrad": lambda: osa.sparse_amsgrad(lr, catch_up=True),
        "amsgrad, b2 injected": lambda: optax.inject_hyperparams(osa.sparse_amsgrad, static_args=("catch_up", "b1"))(
            lr, catch_up=True
        ),
        "sgd": lambda: osa.sparse_sgd(lr, momentum=0.9, catch_up=True),
    }[optimizer]()
    p = jnp.asarray(np.random.default_rng(0).normal(size=(300, 8)), jnp.float32)
    g = osa.IndexedRows(jnp.zeros(0, jnp.int32), jnp.zeros((0, 8), jnp.float32), 300)

    def step(p: jax.Array, s: Any) -> Any:
        if door == "update_and_apply":
            return osa.update_and_apply(tx, g, s, p)
        updates, s = tx.update(g, s, p)
        return osa.apply_updates(p, updates), s

    state = tx.init(p)
    (pn, sn), (px, sx) = jax.jit(step)(p, state), jax.jit(osa.use_kernels(False)(step))(p, state)
    assert_trees_equal((pn, sn), (px, sx))
    np.testing.assert_array_equal(np.asarray(pn), np.asarray(p))


def test_each_step_is_dense_adam_within_a_few_ulps() -> None:
    """Rows touched now and then, one step at a time: each step takes the touched rows from the catch-up state
    where dense Adam in float64 (with float32's bias corrections), replaying every idle step from that same state,
    takes them; at the end,
    ``catch_up`` is as close to a float64 dense run as float32 ``optax.adam`` is (the closed form rounds once
    where the steps round once a step, so it is compared with the exact sum, not with float32's)."""
    rng = np.random.default_rng(0)
    rows, lr = 40, 0.05
    p = jnp.asarray(rng.normal(size=(rows, 3)).astype(np.float32))
    tx, dense_tx = osa.sparse_adam(lr, catch_up=True), optax.adam(lr)
    state, dense_state, dense_p = tx.init(p), dense_tx.init(p), p
    p64 = np.asarray(p, np.float64)
    m64, v64 = np.zeros_like(p64), np.zeros_like(p64)
    step = jit_once(lambda g, s, p: osa.update_and_apply(tx, g, s, p))
    worst = 0.0
    for t in range(1, 61):
        ids = rng.choice(rows, size=3 if t > 1 else rows, replace=False).astype(np.int32)
        values = rng.normal(size=(ids.size, 3)).astype(np.float32)
        dense_g = np.zeros((rows, 3), np.float32)
        dense_g[ids] = values
        # float64 dense Adam from the catch-up state of the touched rows: the idle steps, then this one.
        rp, rm, rv = (np.asarray(x, np.float64)[ids] for x in (p, state.mu, state.nu))
        for row, last in enumerate(np.asarray(state.last_step)[ids]):
            for tau in range(last + 1, t) if last > 0 else ():
                rp[row], rm[row], rv[row] = _adam64(rp[row], rm[row], rv[row], 0.0, tau, lr, True)
        want_p, want_m, want_v = _adam64(rp, rm, rv, values.astype(np.float64), t, lr, True)
        slots = np.pad(ids, (0, rows - ids.size), constant_values=-1)  # one shape for every step: -1 pads
        padded = np.pad(values, ((0, rows - ids.size), (0, 0)))
        p, state = step(osa.IndexedRows(jnp.asarray(slots), jnp.asarray(padded), rows), state, p)
        ulp = 2.0**-23 * np.abs(want_p).max()  # an ulp of the rows' scale
        worst = max(worst, np.abs(np.asarray(p)[ids] - want_p).max() / ulp)
        for mine, want in ((state.mu, want_m), (state.nu, want_v)):
            np.testing.assert_allclose(np.asarray(mine)[ids], want, rtol=0, atol=2.0**-20 * np.abs(want).max())
        u, dense_state = dense_tx.update(jnp.asarray(dense_g), dense_state)
        dense_p = optax.apply_updates(dense_p, u)
        p64, m64, v64 = _adam64(p64, m64, v64, dense_g.astype(np.float64), t, lr)
    # 0.68 ulps here; 5.0 where the reference took 1 - b**t at a concrete count (integer_pow), not as the step does
    assert worst <= 2, worst
    caught_p, caught = osa.catch_up(tx, p, state)
    own = np.abs(np.asarray(dense_p) - p64).max()  # float32 optax.adam's distance from float64 Adam
    assert np.abs(np.asarray(caught_p) - p64).max() <= 2 * own + 4 * 2.0**-23 * np.abs(p64).max()
    for mine, want in ((caught.mu, m64), (caught.nu, v64)):
        np.testing.assert_allclose(np.asarray(mine), want, rtol=2e-6, atol=2.0**-20 * np.abs(want).max())
    assert np.all(np.asarray(caught.last_step) == 60)


def test_training_goes_on_after_catch_up_and_through_a_checkpoint() -> None:
    batches = _batches(seed=5, steps=80)
    tx = osa.sparse_adam(1e-2, catch_up=True)
    grad_fn = osa.value_and_row_grad(_loss, lambda p: p["emb"], catch_up=tx)
    catch_up = jax.jit(lambda p, s: osa.catch_up(tx, p, s))

    @jax.jit
    def step(params: Any, state: Any, ids: jax.Array, y: jax.Array) -> tuple[Any, Any]:
        _, grads = grad_fn(params, ids, y, opt_state=state)
        return osa.update_and_apply(tx, grads, state, params)

    def train(params: Any, state: Any, part: list, restore: bool) -> tuple[Any, Any]:
        for ids, y in part:
            params, state = step(params, state, jnp.asarray(ids), jnp.asarray(y))
        if restore:
            params, state = catch_up(params, state)
            blob = flax.serialization.to_bytes((params, state))
            params, state = flax.serialization.from_bytes((params, tx.init(params)), blob)
        return params, state

    params = {"emb": jnp.asarray(EMB0)}
    straight = train(params, tx.init(params), batches, restore=False)
    half = train(params, tx.init(params), batches[:40], restore=True)
    resumed = train(*half, batches[40:], restore=False)
    for a, b in zip(jax.tree.leaves(catch_up(*resumed)), jax.tree.leaves(catch_up(*straight)), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_dense_leaves_are_optax_adam_and_inject_hyperparams_agrees() -> None:
    rng = np.random.default_rng(1)
    params = {"emb": jnp.asarray(EMB0[:50]), "w": jnp.asarray(rng.normal(size=(4,)).astype(np.float32))}
    tx = osa.sparse_adam(1e-2, catch_up=True)
    injected = optax.inject_hyperparams(osa.sparse_adam)(learning_rate=1e-2, catch_up=True)
    dense_tx = optax.adam(1e-2)
    s, si, sd = tx.init(params), injected.init(params), dense_tx.init(params["w"])
    p, pi, w = params, params, params["w"]
    # Each step compiled once (not one dispatch per operation), optax's as one program too.
    step, step_injected = (jax.jit(lambda g, s, p, t=t: osa.update_and_apply(t, g, s, p)) for t in (tx, injected))
    dense_step = jax.jit(lambda g, s, w: (lambda u, s: (optax.apply_updates(w, u), s))(*dense_tx.update(g, s)))
    for _ in range(5):
        ids = jnp.asarray(rng.choice(50, 4).astype(np.int32))
        grads = {
            "emb": osa.IndexedRows(ids, jnp.asarray(rng.normal(size=(4, 8)).astype(np.float32)), 50),
            "w": jnp.asarray(rng.normal(size=(4,)).astype(np.float32)),
        }
        p, s = step(grads, s, p)
        pi, si = step_injected(grads, si, pi)
        w, sd = dense_step(grads["w"], sd, w)
    np.testing.assert_array_equal(np.asarray(p["w"]), np.asarray(w))
    # Injected, the betas are float32 arrays, not Python floats: a few ulps apart.
    assert_trees_equal(pi, p, rtol=1e-6, atol=3e-7)


@needs_kernels
@pytest.mark.parametrize(
    "case",
    [
        "optax",
        "torch",
        "maximize",
        "b1=0.99",
        "schedule",
        "unique",
        "no series (eps_root)",
        "adamw",
        "adamw schedule",
        "adamw torch maximize",
        "adamw masked out",
    ],
)
@pytest.mark.parametrize("door", ["update_and_apply", "two calls"])
def test_native_step_equals_the_xla_path(case: str, door: str) -> None:
    """``update_and_apply`` on the kernel against the XLA path, step for step from the same state: moments and last
    steps bitwise, parameters within two ulps of the rows' scale (the kernel rounds ``p + shift + step`` in its own
    order). Some rows see gradients so small that ``v`` is below the series' reach: the kernel leaves them to the
    XLA path's steps, which must then agree too. ``sparse_adamw(catch_up=True)`` on the same kernel: every row
    decays, those never touched too, and its record of the decay (``decay_mark``, ``log_decay``) is bitwise; a
    table its mask leaves out takes Adam's catch-up. The two calls (``tx.update``, then ``apply_updates``) at a
    constant rate run the rows kernel, each row replayed and stepped as the fused step's kernel takes it, within
    the same bound (a table AdamW's mask leaves out too; under a schedule too, the rows it flags taken by the XLA
    rule)."""
    rows, width, k = 200, 8, 48
    kwargs: dict[str, Any] = {
        "optax": {},
        "torch": {"eps_placement": "torch"},
        "maximize": {"maximize": True},
        "b1=0.99": {"b1": 0.99},
        "schedule": {},
        "unique": {},
        "no series (eps_root)": {"eps_root": 1e-12},
        "adamw": {},
        "adamw schedule": {},
        "adamw torch maximize": {"eps_placement": "torch", "maximize": True},
        "adamw masked out": {"mask": False},
    }[case]
    schedule = case.endswith("schedule")
    lr = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 20, 300) if schedule else 1e-2
    adamw = case.startswith("adamw")
    if adamw:
        tx = osa.sparse_adamw(lr, weight_decay=0.3, catch_up=True, **kwargs)
    else:
        tx = osa.sparse_adam(lr, catch_up=True, **kwargs)
    rng = np.random.default_rng(3)
    p = jnp.asarray(rng.normal(size=(rows, width)).astype(np.float32))
    state = tx.init(p)

    def step(p: jax.Array, s: Any, ids: jax.Array, values: jax.Array) -> Any:
        g = osa.IndexedRows(ids, values, rows, unique_indices=case == "unique")
        if door == "two calls":
            updates, s = tx.update(g, s, p)
            return osa.apply_updates(p, updates), s
        return osa.update_and_apply(tx, g, s, p)

    native, xla = jax.jit(step), jax.jit(osa.use_kernels(False)(step))
    text = native.lower(p, state, jnp.zeros(k, jnp.int32), jnp.zeros((k, width), jnp.float32)).as_text()
    if door == "two calls":
        rows_kernel = case != "no series (eps_root)"
        assert (PREFIX + "catch_up_adam_rows" in text) == rows_kernel and PREFIX + "catch_up_adam_apply" not in text
    else:
        assert (PREFIX + "catch_up_adam_apply" in text) == (case != "no series (eps_root)")
    for t in range(150):
        if case == "unique":
            ids = rng.permutation(rows)[:k]
        else:  # Zipf, with duplicates and padding
            ids = np.where(rng.random(k) < 0.1, -1, (rng.zipf(1.3, k) - 1) % rows)
        values = rng.normal(size=(k, width)).astype(np.float32)
        values[: k // 4] *= 1e-7 if t % 10 == 0 else 1.0  # v below the series' reach on those rows
        args = (jnp.asarray(ids.astype(np.int32)), jnp.asarray(values))
        (pn, sn), (px, sx) = native(p, state, *args), xla(p, state, *args)
        assert_trees_equal(sn, sx)  # the moments, last steps, count (and AdamW's record of the decay)
        np.testing.assert_allclose(np.asarray(pn), np.asarray(px), rtol=0, atol=2 * 2.0**-23 * np.abs(px).max())
        p, state = px, sx


@needs_kernels
def test_the_rows_kernel_moves_every_row_that_sat_out_on_a_table_adamw_masks_out() -> None:
    """On a table AdamW's mask leaves out, the rule's update is ``(replayed + step) - p`` for every row that sat out
    a step, also where the replay left the row as it was (a zero first moment: Adam's rule gives the step itself
    there): ``tx.update``'s updates on the rows kernel bitwise the XLA rule's, and its state."""
    tx = osa.sparse_adamw(1e-2, weight_decay=0.3, catch_up=True, mask=False)
    rows, width = 16, 8
    rng = np.random.default_rng(12)
    p = jnp.asarray(rng.normal(size=(rows, width)) * 100, jnp.float32)  # large: the update rounds on p's scale
    m = rng.normal(size=(rows, width)) * 0.1
    m[::2] = 0.0  # even rows: a zero first moment, so the replay leaves them as they were
    state = tx.init(p)._replace(
        count=jnp.asarray(20, jnp.int32),
        mu=jnp.asarray(m, jnp.float32),
        nu=jnp.asarray(rng.random((rows, width)) * 0.01, jnp.float32),
        last_step=jnp.asarray(rng.integers(1, 20, rows), jnp.int32),
    )
    g = osa.IndexedRows(
        jnp.arange(rows, dtype=jnp.int32), jnp.asarray(rng.normal(size=(rows, width)), jnp.float32), rows
    )

    def update(p: jax.Array, s: Any) -> Any:
        u, s = tx.update(g, s, p)
        return u.todense(), s

    native, xla = jax.jit(update), jax.jit(osa.use_kernels(False)(update))
    assert PREFIX + "catch_up_adam_rows" in native.lower(p, state).as_text()
    (un, sn), (ux, sx) = native(p, state), xla(p, state)
    assert_trees_equal(sn, sx)
    assert_trees_equal(un, ux)


def _record_flags(monkeypatch: pytest.MonkeyPatch, kernel: str = "catch_up_adam_apply") -> list[np.ndarray]:
    """The rows each call of a catch-up kernel (the fused step's, or ``catch_up_adam_rows``) flags for the XLA path
    (its flags per entry), as steps run."""
    from optax_sparse_adam import _ffi

    flagged: list[np.ndarray] = []
    call = getattr(_ffi, kernel)

    def recording(*args: Any, **kwargs: Any) -> Any:
        out = call(*args, **kwargs)
        jax.debug.callback(lambda f: flagged.append(np.asarray(f)), out[-1])
        return out

    monkeypatch.setattr(_ffi, kernel, recording)
    return flagged


_IDLE_SHAPE = (96, 8, 64, 400)  # rows, width, ids a step, the step count
# The entries of a step from the idle state: the rows kernel's test's ``k`` ids, 8 repeated and 2 of padding, and
# as many in the other tests (distinct where a test needs them so). One shape: the XLA path's step for an optimizer
# (update_and_apply and the two calls are one program there) compiles once for the tests that take it (the
# persistent compilation cache), where a shape of each test's own compiled it again.
_IDLE_ENTRIES = _IDLE_SHAPE[2] + 10


def _idle_start(init: Any, rng: np.random.Generator) -> tuple[jax.Array, Any, np.ndarray]:
    """A table of ``_IDLE_SHAPE`` and the catch-up state ``init`` gives it, with moments the series does not take
    in half the elements and rows idle for a while (within the window and longer): ``(p, state, last_step)``."""
    rows, width, _, count = _IDLE_SHAPE
    cap = int(idle_cap(0.9, 0.999))
    p = jnp.asarray(rng.normal(size=(rows, width)).astype(np.float32))
    # Every other element near eps (tiny v, m != 0): the series does not take those; the rest ordinary.
    scale = np.where(rng.random((rows, width)) < 0.5, 1e-8, 1e-2).astype(np.float32)
    v = (scale * (0.5 + rng.random((rows, width)))).astype(np.float32) ** 2
    m = (np.sqrt(v) * rng.uniform(-0.3, 0.3, size=(rows, width))).astype(np.float32)
    # Last steps: a third within the window, a third idle longer (down to step 1, early in the bias corrections).
    last = np.concatenate([rng.integers(count - cap, count, rows // 3), rng.integers(1, count - cap - 1, rows // 3)])
    last = np.concatenate([last, np.full(rows - last.size, count - 1)]).astype(np.int32)

    kinds = (osa.CatchUpAdamState, osa.CatchUpAdamWState)

    def idle(state: Any) -> Any:
        if not isinstance(state, kinds):
            return state
        state = state._replace(count=jnp.int32(count), mu=jnp.asarray(m), nu=jnp.asarray(v), last_step=last)
        if isinstance(state, osa.CatchUpAdamWState):  # a record of the decay as a rate of lr * wd = 3e-3 gives it
            log_gamma = np.log1p(-3e-3)
            log_decay = jnp.asarray([count * log_gamma, 0.0], jnp.float32)
            state = state._replace(log_decay=log_decay, decay_mark=jnp.asarray(last * log_gamma, jnp.float32))
        return state

    return p, jax.tree.map(idle, init(p), is_leaf=lambda x: isinstance(x, kinds)), last


def _recorded(tx: Any, p: jax.Array, state: Any, steps: int) -> Any:
    """``state`` with the record of long-idle coefficients that ``steps`` steps of ``tx`` from ``tx.init`` write
    (on empty batches, which move no row): the entries a run to that count holds, where ``_idle_start``'s state
    holds none."""
    kinds = (osa.CatchUpAdamState, osa.CatchUpAdamWState)
    is_state = lambda x: isinstance(x, kinds)  # noqa: E731
    empty = osa.IndexedRows(jnp.zeros((0,), jnp.int32), jnp.zeros((0, p.shape[1]), jnp.float32), p.shape[0])
    written = jax.jit(lambda s: jax.lax.fori_loop(0, steps, lambda _, s: tx.update(empty, s, p)[1], s))(tx.init(p))
    (record,) = (x.idle_record for x in jax.tree.leaves(written, is_leaf=is_state) if is_state(x))
    return jax.tree.map(lambda x: x._replace(idle_record=record) if is_state(x) else x, state, is_leaf=is_state)


def _tiny_and_missed(state: Any, last: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row of ``_idle_start``'s ``state`` (its last steps ``last``): whether it has elements the series does not
    take (``sqrt(v)`` near ``eps``), and whether the kernels find its long-idle coefficients missing from the
    state's record (its entry for another last step; no row where the state keeps no record, which the kernels do
    not read)."""
    (s0,) = (x for x in jax.tree.leaves(state, is_leaf=lambda x: hasattr(x, "last_step")) if hasattr(x, "nu"))
    tiny = (np.sqrt(np.asarray(s0.nu)) < 1e-6).any(axis=1)
    tags = np.asarray(s0.idle_record.last_steps)
    missed = tags[last % tags.size] != last if tags.size > 1 else np.zeros(last.shape, bool)
    return tiny, missed


def _adamw64_after_idle(p: jax.Array, state: Any, last: np.ndarray, g: osa.IndexedRows, lr: float, wd: float) -> Any:
    """The rows of ``g`` (distinct) after dense AdamW (optax's defaults, float32's bias corrections) in float64
    from ``_idle_start``'s state: each row's idle steps since ``last`` with zero gradients, then the step."""
    kind = osa.CatchUpAdamWState
    (s0,) = (x for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, kind)) if isinstance(x, kind))
    ids = np.asarray(g.indices)
    p, m, v = (np.asarray(x, np.float64)[ids] for x in (p, s0.mu, s0.nu))
    b1, b2, eps, done = 0.9, 0.999, 1e-8, int(s0.count)
    grads = np.asarray(g.values, np.float64)
    for t in range(1, done + 2):
        c1, c2 = _float32_corrections(t)
        active = (last[ids] < t)[:, None]
        grad = grads if t == done + 1 else 0.0
        m_t, v_t = b1 * m + (1 - b1) * grad, b2 * v + (1 - b2) * grad * grad
        p_t = p - lr * ((m_t / c1) / (np.sqrt(v_t / c2) + eps) + wd * p)
        p, m, v = (np.where(active, new, old) for new, old in ((p_t, p), (m_t, m), (v_t, v)))
    return p


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_the_loops_over_idle_steps_at_the_gpus_unroll_take_the_same_steps(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loops over a window's idle steps (the long-idle coefficients under a schedule, the steps taken one by one)
    take ``_UNROLL_GPU`` steps a trip on GPUs and ``_UNROLL`` elsewhere, chosen when the step is lowered: run here at
    both (the GPU's count in this platform's branch), the XLA path's step under a schedule, from rows idle within
    the window and longer (counts that are multiples of neither) and elements the series does not take, with more
    entries than a chunk of last steps, gives the same moments and records bitwise and parameters within two ulps of
    the larger of the old and new value (XLA contracts multiply-adds its own way in a body copied more times)."""
    lr = optax.cosine_decay_schedule(1e-2, 1000)
    if name == "adamw":
        tx = osa.sparse_adamw(lr, weight_decay=0.3, catch_up=True)
    else:
        tx = osa.sparse_adam(lr, catch_up=True)
    rng = np.random.default_rng(11)
    p, state, _ = _idle_start(tx.init, rng)
    rows, width, _, _ = _IDLE_SHAPE
    ids = rng.integers(0, rows, _IDLE_ENTRIES).astype(np.int32)  # repeated ids, more than a chunk
    assert ids.size > _catch_up._LAST_STEPS
    g = osa.IndexedRows(jnp.asarray(ids), jnp.asarray(rng.normal(size=(ids.size, width)).astype(np.float32)), rows)

    def run() -> Any:  # a function of its own each time: traced anew, at the unroll of the time
        def step(p: jax.Array, s: Any, g: osa.IndexedRows) -> Any:  # at this unroll, the kernel test's XLA step
            return osa.update_and_apply(tx, g, s, p)

        return jax.jit(osa.use_kernels(False)(step))(p, state, g)

    assert _catch_up._UNROLL != _catch_up._UNROLL_GPU
    here = run()
    monkeypatch.setattr(_catch_up, "_UNROLL", _catch_up._UNROLL_GPU)
    gpus = run()
    assert_trees_equal(here[1], gpus[1])
    ph, pg = np.asarray(here[0]), np.asarray(gpus[0])
    assert not np.array_equal(ph, np.asarray(p))
    bound = 2 * np.spacing(np.maximum(np.abs(pg), np.abs(np.asarray(p))))
    assert np.all(np.abs(ph - pg) <= bound), np.abs(ph - pg).max()


@needs_kernels
@pytest.mark.parametrize("case", ["optax", "torch", "schedule", "adamw", "adamw schedule", "adamw injected"])
def test_the_kernel_takes_the_idle_steps_the_series_does_not_reach(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Elements with ``sqrt(v)`` near ``eps`` (the series in ``eps / sqrt(v)`` does not reach float32 resolution)
    replay their idle steps one by one inside the kernel, for rows idle within the window and longer: nothing is
    left to the XLA path (with a constant learning rate), and the result is the XLA path's, moments bitwise,
    parameters within two ulps of the larger of the old and new value (the kernel adds the current step to the
    replayed row, the XLA path rounds ``p + step - p0`` and adds it back: the bound of ``_kernel_path``'s
    docstring). Under a schedule the kernel has no rates for rows idle longer than the window: it flags
    exactly those that need steps, and the XLA path takes them, with the same result. ``catch_up`` (every row)
    replays each row in a kernel of its own (``catch_up_adam_replay``, in place), as the fused step replays a
    touched row: moments and records bitwise the XLA path's, parameters within two ulps of the larger of the old
    and new value; under a schedule the rows it flags take the XLA path, a chunk of rows at a time. With AdamW's
    decay (``sparse_adamw(catch_up=True)``)
    each of those steps also decays the row, and a row idle longer than the window decays by ``gamma ** (idle -
    K)`` after its first ``K`` steps, from the same table on both paths: at a constant rate nothing is flagged,
    and the touched rows are within 16 ulps of their scale of dense AdamW in float64 (the XLA path, and this
    kernel, take up to ``K = 221`` float32 steps one by one, each rounded: 8.3 here, about ``sqrt(K) / 2``);
    under a schedule the long-idle rows that need steps are flagged, as without decay, and so they are where the
    rate and the decay are not known when the step is traced (``inject_hyperparams``: no table of ``gamma``'s
    powers). ``catch_up``'s kernel takes AdamW's steps alike. Under a
    schedule the state's record holds the long-idle rows' coefficients, as a run to that count writes them: the
    rows flagged are those that need steps, not rows the record misses (the rows kernel's test flags those)."""
    flagged = _record_flags(monkeypatch)
    rows, width, _, count = _IDLE_SHAPE
    lr = optax.cosine_decay_schedule(1e-2, 1000) if case.endswith("schedule") else 1e-2
    if case == "adamw injected":
        static = ("catch_up", "b1", "b2", "eps", "eps_root")  # the closed form's, and so the kernel's
        tx = optax.inject_hyperparams(osa.sparse_adamw, static_args=static)(lr, weight_decay=0.3, catch_up=True)
    elif case.startswith("adamw"):
        tx = osa.sparse_adamw(lr, weight_decay=0.3, catch_up=True)
    else:
        tx = osa.sparse_adam(lr, catch_up=True, eps_placement="torch" if case == "torch" else "optax")
    cap = int(idle_cap(0.9, 0.999))
    rng = np.random.default_rng(5)
    p, state, last = _idle_start(tx.init, rng)
    if case.endswith("schedule"):
        state = _recorded(tx, p, state, count)
    ids = jnp.asarray(rng.permutation(rows).astype(np.int32)[:_IDLE_ENTRIES])  # distinct
    g = osa.IndexedRows(ids, jnp.asarray(rng.normal(size=(ids.size, width)).astype(np.float32)), rows)

    def step(p: jax.Array, s: Any, g: osa.IndexedRows) -> Any:  # the batch an argument: the rows kernel's test's
        # XLA step, the same program
        return osa.update_and_apply(tx, g, s, p)

    native = jax.jit(step)(p, state, g)
    (pn, sn), (px, sx) = native, jax.jit(osa.use_kernels(False)(step))(p, state, g)
    assert_trees_equal(sn, sx)
    pn, px = np.asarray(pn), np.asarray(px)
    bound = 2 * np.spacing(np.maximum(np.abs(px), np.abs(np.asarray(p))))
    assert np.all(np.abs(pn - px) <= bound), np.abs(pn - px).max()
    moved = np.abs(px - np.asarray(p)) > 0
    assert moved[np.asarray(ids)].all()
    (flags,) = flagged
    if case.endswith("schedule"):
        # The flagged rows' fallback runs the steps kernel on the batch's 74 rows, split into parts of at least
        # 32 rows over the threads: on 3 (3 parts; the machine's default took 1 or 2), the numbers of the default,
        # which are the XLA path's (above), bitwise.
        with osa.use_kernels(True, threads=3):
            stepped = jax.jit(step)
            assert PREFIX + "catch_up_adam_steps" in stepped.lower(p, state, g).as_text()
            assert_trees_equal(stepped(p, state, g), native)
    long_idle = np.isin(np.arange(rows), np.asarray(ids)) & (count - 1 - last > cap)
    if case in ("adamw", "adamw injected"):
        assert long_idle.any()
        want = _adamw64_after_idle(p, state, last, g, lr, 0.3)
        scale = 2.0**-23 * np.abs(want).max(axis=1, keepdims=True)
        off = np.abs(pn[np.asarray(ids)] - want) / scale
        assert np.all(off <= 16), off.max()
    if case == "adamw injected":  # catch_up takes the optimizer itself, not wrapped
        np.testing.assert_array_equal(flags > 0, long_idle[np.asarray(ids)])
        return
    # Bringing every row up to date: the replay kernel takes every row, the schedule's flagged rows the XLA path.
    caught = jax.jit(lambda p, s: osa.catch_up(tx, p, s))
    (pc, sc), (pcx, scx) = (
        caught(p, state),
        jax.jit(osa.use_kernels(False)(lambda p, s: osa.catch_up(tx, p, s)))(p, state),
    )
    assert_trees_equal(sc, scx)
    pc, pcx = np.asarray(pc), np.asarray(pcx)
    bound = 2 * np.spacing(np.maximum(np.abs(pcx), np.abs(np.asarray(p))))
    assert np.all(np.abs(pc - pcx) <= bound), np.abs(pc - pcx).max()
    assert np.any(pcx != np.asarray(p))
    assert PREFIX + "catch_up_adam_replay" in caught.lower(p, state).as_text()
    if case.endswith("schedule"):  # the long-idle rows with tiny elements are flagged, the others not
        tiny, missed = _tiny_and_missed(state, last)
        assert long_idle.any() and not missed[long_idle].any()  # the record holds every long-idle row
        np.testing.assert_array_equal(flags > 0, (long_idle & tiny)[np.asarray(ids)])
    else:
        assert not flags.any()


@needs_kernels
@pytest.mark.parametrize("case", ["adam", "adamw schedule"])
def test_non_finite_moments_replay_as_on_the_xla_path(case: str) -> None:
    """Rows whose moments or parameters hold NaN or an infinity (a non-finite gradient stepped them, no
    ``apply_if_finite`` around the optimizer), idle within the window and longer: the fused step (its kernel, and
    under a schedule the steps kernel of its fallback for the rows it flags) and ``catch_up``'s replay kernel put
    NaN and the infinities where the XLA path does, and elsewhere its numbers: moments bitwise, parameters within
    the replay's bound."""
    lr = optax.cosine_decay_schedule(1e-2, 1000) if case.endswith("schedule") else 1e-2
    tx = (
        osa.sparse_adamw(lr, weight_decay=0.3, catch_up=True)
        if case.startswith("adamw")
        else osa.sparse_adam(lr, catch_up=True)
    )
    rows, width, _, count = _IDLE_SHAPE
    rng = np.random.default_rng(21)
    p, state, last = _idle_start(tx.init, rng)
    if case.endswith("schedule"):
        state = _recorded(tx, p, state, count)
    recent, idle_long = int(np.argmax(last == count - 1)), int(np.argmax(last < count - 300))
    within = int(np.argmax((last >= count - 200) & (last < count - 1)))
    is_state = lambda x: isinstance(x, (osa.CatchUpAdamState, osa.CatchUpAdamWState))  # noqa: E731

    def poisoned(x: Any) -> Any:
        if not is_state(x):
            return x
        mu, nu = np.array(x.mu), np.array(x.nu)
        mu[idle_long, 0], nu[idle_long, 1], mu[within, 2] = np.nan, np.inf, -np.inf
        nu[within, 3], mu[recent, 4] = np.nan, np.inf
        return x._replace(mu=jnp.asarray(mu), nu=jnp.asarray(nu))

    state = jax.tree.map(poisoned, state, is_leaf=is_state)
    p = p.at[idle_long, 5].set(-np.inf).at[within, 6].set(np.nan)
    ids = jnp.asarray(np.r_[idle_long, within, recent, rng.permutation(rows)[:20]].astype(np.int32))
    g = osa.IndexedRows(ids, jnp.asarray(rng.normal(size=(ids.size, width)).astype(np.float32)), rows)

    def step(p: jax.Array, s: Any) -> Any:
        p, s = osa.update_and_apply(tx, g, s, p)
        return osa.catch_up(tx, p, s)

    native, xla = jax.jit(step), jax.jit(osa.use_kernels(False)(step))
    text = native.lower(p, state).as_text()
    assert PREFIX + "catch_up_adam_apply" in text and PREFIX + "catch_up_adam_replay" in text
    want = xla(p, state)
    for row in (idle_long, within, recent):  # each poisoned row stays poisoned
        assert not all(np.isfinite(np.asarray(x)[row]).all() for x in jax.tree.leaves(want) if np.ndim(x) == 2)
    # An infinite parameter whose moments are finite: as dense Adam's steps leave it, -inf (the XLA rule took
    # inf - inf for its update, NaN, where the kernels write the row); dense AdamW's decay makes it NaN, and so here.
    np.testing.assert_array_equal(np.asarray(want[0])[idle_long, 5], -np.inf if case == "adam" else np.nan)
    (pn, sn), (px, sx) = non_finite_zeroed(native(p, state), want)
    assert_trees_equal(sn, sx)
    p0 = np.nan_to_num(np.asarray(p), nan=0.0, posinf=0.0, neginf=0.0)
    bound = 2 * np.spacing(np.maximum(np.abs(px), np.abs(p0)))
    assert np.all(np.abs(pn - px) <= bound), np.abs(pn - px).max()


@needs_kernels
@pytest.mark.parametrize("adamw", [False, True], ids=["adam", "adamw"])
def test_the_catch_up_replay_kernel_on_threads_and_under_vmap(adamw: bool) -> None:
    """``catch_up``'s kernel (``catch_up_adam_replay``: every row brought up to date, in place): the same numbers on 1
    and 4 threads, bitwise; under vmap, run once per element: each element's moments and records bitwise the
    unbatched ones and its table within the unbatched test's bound of them, and the XLA path's moments bitwise and
    its table within that bound. (The kernel reads a window of coefficients that XLA computes with dots, and XLA:CPU
    sums a dot batched by vmap in another order on some CPUs: AVX-512 ones put AdamW's table an ulp apart.)"""
    tx = osa.sparse_adamw(1e-2, weight_decay=0.3, catch_up=True) if adamw else osa.sparse_adam(1e-2, catch_up=True)
    rng = np.random.default_rng(9)
    starts = [_idle_start(tx.init, rng)[:2] for _ in range(2)]
    caught = jax.jit(lambda p, s: osa.catch_up(tx, p, s))
    out = []
    for threads in (1, 4):
        with osa.use_kernels(True, threads=threads):
            assert PREFIX + "catch_up_adam_replay" in caught.lower(*starts[0]).as_text()
            out.append(caught(*starts[0]))
    assert_trees_equal(out[0], out[1])
    stacked = jax.tree.map(lambda *x: jnp.stack(x), *starts)
    batched = jax.vmap(lambda p, s: osa.catch_up(tx, p, s))
    assert PREFIX + "catch_up_adam_replay" in jax.jit(batched).lower(*stacked).as_text()
    (pn, sn), (px, sx) = jax.jit(batched)(*stacked), jax.jit(osa.use_kernels(False)(batched))(*stacked)
    assert_trees_equal(jax.tree.map(lambda x: x[0], sn), out[0][1])
    assert_trees_equal(sn, sx)
    p0, pn, px = np.asarray(stacked[0]), np.asarray(pn), np.asarray(px)
    bound = 2 * np.spacing(np.maximum(np.abs(px), np.abs(p0)))
    assert np.all(np.abs(pn - px) <= bound), np.abs(pn - px).max()
    alone = np.asarray(out[0][0])
    assert np.all(np.abs(pn[0] - alone) <= 2 * np.spacing(np.maximum(np.abs(alone), np.abs(p0[0])))), "element 0"


@needs_kernels
@pytest.mark.parametrize("case", ["adam", "adamw", "adam schedule", "adamw schedule"])
def test_catch_up_replays_a_donated_table_in_place_and_its_flagged_rows_a_chunk_at_a_time(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Donated, ``catch_up`` on the kernel holds no table-sized temporary (the XLA path's replay of the whole table
    in one block holds several: the test's check can fail), at a constant rate and under a schedule, whose flagged
    rows take the XLA path in a loop over chunks of rows. With chunks of 5 rows (the rows of ``_idle_start``'s state
    idle past the window, which its record does not hold, all flagged: several chunks) the result is the XLA path's:
    moments and records bitwise, the parameters within the replay's bound; and so under vmap (AdamW's schedule)."""
    lr = optax.cosine_decay_schedule(1e-2, 1000) if case.endswith("schedule") else 1e-2
    make = functools.partial(osa.sparse_adamw, weight_decay=0.3) if case.startswith("adamw") else osa.sparse_adam
    tx = make(lr, catch_up=True)

    def catch_up(p: jax.Array, s: Any) -> Any:
        return osa.catch_up(tx, p, s)

    def temp(kernels: bool, rows: int) -> int:
        p = jnp.zeros((rows, 64), jnp.float32)
        with osa.use_kernels(kernels):
            compiled = jax.jit(catch_up, donate_argnums=(0, 1)).lower(p, tx.init(p)).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    # What the temporaries grow by from a table of 4,096 rows to one of 65,536 (the state's record and the flagged
    # rows' chunks do not grow): on the kernel, at most eight numbers a row (records, flags, the flagged rows'
    # indices), nothing the width of the table.
    grown = 65536 - 4096
    assert temp(True, 65536) - temp(True, 4096) <= grown * 8 * 4
    if not case.endswith("schedule"):  # what the kernel's program leaves out (the schedule's compiles take long)
        with monkeypatch.context() as patch:
            patch.setattr(_catch_up, "_BLOCK_BYTES", 1 << 40)  # the XLA path's replay of the table in one block
            assert temp(False, 65536) - temp(False, 4096) >= 2 * grown * 64 * 4

    flagged = _record_flags(monkeypatch, "catch_up_adam_replay")
    monkeypatch.setattr(_catch_up, "_FLAGGED_CHUNK", 5)
    p, state, last = _idle_start(tx.init, np.random.default_rng(4))
    (pc, sc), (px, sx) = jax.jit(catch_up)(p, state), jax.jit(osa.use_kernels(False)(catch_up))(p, state)
    assert_trees_equal(sc, sx)
    pc, px = np.asarray(pc), np.asarray(px)
    bound = 2 * np.spacing(np.maximum(np.abs(px), np.abs(np.asarray(p))))
    assert np.all(np.abs(pc - px) <= bound), np.abs(pc - px).max()
    (flags,) = flagged
    if not case.endswith("schedule"):
        assert not flags.any()
        return
    # The rows idle past the window, none of which the state's record holds.
    long_idle = _IDLE_SHAPE[3] - last > int(idle_cap(0.9, 0.999))
    np.testing.assert_array_equal(flags > 0, long_idle)
    assert np.count_nonzero(long_idle) > 2 * 5
    if case != "adamw schedule":
        return
    # Under vmap (two states, the loop as long as the one with more flagged rows needs): as the XLA path.
    other, other_state, _ = _idle_start(tx.init, np.random.default_rng(5))
    stacked = jax.tree.map(lambda *x: jnp.stack(x), (p, state), (other, other_state))
    batched = jax.vmap(catch_up)
    (pn, sn), (pbx, sbx) = jax.jit(batched)(*stacked), jax.jit(osa.use_kernels(False)(batched))(*stacked)
    assert_trees_equal(sn, sbx)
    p0, pn, pbx = np.asarray(stacked[0]), np.asarray(pn), np.asarray(pbx)
    bound = 2 * np.spacing(np.maximum(np.abs(pbx), np.abs(p0)))
    assert np.all(np.abs(pn - pbx) <= bound), np.abs(pn - pbx).max()


def _trained(tx: optax.GradientTransformation, rows: int, width: int = 8) -> tuple[jax.Array, Any]:
    """A table and ``tx``'s state after 30 steps on the XLA path, its rows last moved at different steps (the last
    quarter never)."""
    rng = np.random.default_rng(11)
    p = jnp.asarray(rng.normal(size=(rows, width)), jnp.float32)
    state = tx.init(p)
    with osa.use_kernels(False):
        step = jax.jit(lambda g, s, p: osa.update_and_apply(tx, g, s, p))
        for _ in range(30):
            ids = jnp.asarray(rng.integers(0, rows * 3 // 4, 40), jnp.int32)
            p, state = step(osa.IndexedRows(ids, jnp.ones((40, width)), rows), state, p)
    return p, state


# The catch-up optimizers, each with the dense optax one whose steps it takes on a dense leaf.
_CATCH_UP = {
    "adam": (lambda: osa.sparse_adam(1e-2, catch_up=True), lambda: optax.adam(1e-2)),
    "adamw schedule": (
        lambda: osa.sparse_adamw(optax.cosine_decay_schedule(1e-2, 100), weight_decay=0.3, catch_up=True),
        lambda: optax.adamw(optax.cosine_decay_schedule(1e-2, 100), weight_decay=0.3),
    ),
    "amsgrad": (lambda: osa.sparse_amsgrad(1e-2, catch_up=True), lambda: optax.amsgrad(1e-2)),
    "sgd schedule": (
        lambda: osa.sparse_sgd(optax.cosine_decay_schedule(1e-2, 100), momentum=0.9, catch_up=True),
        lambda: optax.sgd(optax.cosine_decay_schedule(1e-2, 100), momentum=0.9),
    ),
}


# The replays that differ in what a block slices: AdamW's schedule, its rows' decay marks too.
@pytest.mark.parametrize("name", ["adam", "adamw schedule"])
def test_catch_up_on_the_xla_path_takes_a_large_table_a_block_of_rows_at_a_time(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the XLA path (a GPU's or TPU's; on the CPU, tables the kernel does not take) ``catch_up`` of Adam and AdamW
    replays a table larger than ``_catch_up._BLOCK_BYTES`` a block of rows at a time, in place.

    Donated, its temporaries do not grow with the table, but for a few numbers a row (Adam's, with one block for the
    whole table, grow by more than a table: the check can fail). The results are one call's on the whole table,
    bitwise, with blocks that take 3 rows of each of 8 runs of 25 (a table of 200 rows) and a last block that
    overlaps the one before it (its rows already written are left as they are). The loop is the same for both:
    Adam's is also checked under vmap over two states, on a table split by rows over 8 devices, which
    stays split, and no part of it is gathered, and inside shard_map."""
    tx = _CATCH_UP[name][0]()
    rows = 200
    p, state = _trained(tx, rows)

    def run(block_rows: int, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` jitted afresh on the XLA path, blocks of ``block_rows`` rows' bytes (a traced program
        reads the constant when it is traced)."""
        leaves = [p, *(x for x in jax.tree.leaves(state) if x.shape[:1] == (rows,))]
        row_bytes = sum(math.prod(x.shape[1:]) * x.dtype.itemsize for x in leaves)
        monkeypatch.setattr(_catch_up, "_BLOCK_BYTES", block_rows * row_bytes)
        with osa.use_kernels(False):
            return jax.jit(lambda *a: fn(*a))(*args)

    def catch_up(p: jax.Array, s: Any) -> Any:
        return osa.catch_up(tx, p, s)

    whole = run(1 << 20, catch_up, p, state)
    assert not np.array_equal(whole[0], p)
    assert_trees_equal(run(30, catch_up, p, state), whole)
    # 199 rows (odd: one run, blocks of 30 rows, the last overlapping).
    odd = jax.tree.map(lambda x: x[:199] if x.shape[:1] == (rows,) else x, (p, state))
    assert_trees_equal(run(30, catch_up, *odd), run(1 << 20, catch_up, *odd))

    def temp(table_rows: int, block_rows: int) -> int:
        """The temporaries of the donated catch_up of a table of 64 float32 a row, blocks of about ``block_rows``
        rows (a kilobyte a row)."""
        q = jnp.zeros((table_rows, 64), jnp.float32)
        with osa.use_kernels(False):
            monkeypatch.setattr(_catch_up, "_BLOCK_BYTES", block_rows * 64 * 4 * 4)
            compiled = jax.jit(lambda p, s: osa.catch_up(tx, p, s), donate_argnums=(0, 1)).lower(q, tx.init(q))
        return compiled.compile().memory_analysis().temp_size_in_bytes

    grown = 16384 - 4096
    assert temp(16384, 1024) - temp(4096, 1024) <= grown * 8 * 4
    if name != "adam":  # what follows is the loop's, the same for both
        return
    assert temp(16384, 1 << 20) - temp(4096, 1 << 20) >= grown * 64 * 4  # one block: the table's temporaries

    other = jax.tree.map(lambda x: x[::-1] if x.shape[:1] == (rows,) else x, (p, state))
    stacked = jax.tree.map(lambda *x: jnp.stack(x), (p, state), other)
    batched = run(30, jax.vmap(catch_up), *stacked)
    for i, start in enumerate([(p, state), other]):
        assert_trees_equal(jax.tree.map(lambda x, i=i: x[i], batched), run(1 << 20, catch_up, *start))

    mesh = jax.make_mesh((8,), ("rows",), axis_types=(jax.sharding.AxisType.Auto,))
    by_rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("rows"))
    placed = jax.tree.map(lambda x: jax.device_put(x, by_rows) if x.shape[:1] == (rows,) else x, (p, state))
    sharded = run(30, catch_up, *placed)
    assert sharded[0].sharding.is_equivalent_to(by_rows, 2)
    assert_trees_equal(sharded, whole)
    with osa.use_kernels(False):  # the program run just above (blocks of 30 rows)
        text = jax.jit(catch_up).lower(*placed).compile().as_text()
    assert "all-gather" not in text and "all-to-all" not in text and "collective-permute" not in text
    # Inside shard_map, as the docs advise for a table split otherwise: each device's rows, as one device's.
    split, whole_leaf = jax.sharding.PartitionSpec("rows"), jax.sharding.PartitionSpec()
    specs = jax.tree.map(lambda x: split if x.shape[:1] == (rows,) else whole_leaf, placed)
    assert_trees_equal(run(30, jax.shard_map(catch_up, mesh=mesh, in_specs=specs, out_specs=specs), *placed), whole)


@pytest.mark.parametrize("name", list(_CATCH_UP))
def test_a_scalar_parameter_steps_as_optax_and_catch_up_leaves_it(name: str, kernel_path: str) -> None:
    """A scalar parameter beside a table (a dense leaf: every step touches it) takes the dense optimizer's steps,
    and ``catch_up`` leaves it as it is (it is up to date), float32 and bfloat16 alike: float32
    scalars raised an IndexError in ``catch_up`` (Adam's and AdamW's replay indexed the table's rows), and in
    AMSGrad's step too; momentum SGD's under a schedule, a loop's carry-type error."""
    make, dense = _CATCH_UP[name]
    tx, reference = make(), dense()
    for dtype in (jnp.float32, jnp.bfloat16):
        params = {"t": jnp.asarray(0.5, dtype), "e": jnp.zeros((4, 2), dtype)}
        state, want = tx.init(params), (params["t"], reference.init(params["t"]))
        step = jax.jit(lambda g, s, p: osa.update_and_apply(tx, g, s, p))
        for i in range(3):
            g = {
                "t": jnp.asarray(0.1 * (i + 1), dtype),
                "e": osa.IndexedRows(jnp.array([i]), jnp.ones((1, 2), dtype), 4),
            }
            params, state = step(g, state, params)
            updates, opt = reference.update(g["t"], want[1], want[0])
            want = (optax.apply_updates(want[0], updates), opt)
        if dtype == jnp.float32:
            np.testing.assert_allclose(params["t"], want[0], rtol=1e-6)
        caught = jax.jit(lambda p, s: osa.catch_up(tx, p, s))(params, state)
        assert_trees_equal(caught[0]["t"], params["t"])


# Each catch-up optimizer and its dense optax reference at a learning rate that may be traced.
_BY_RATE = {
    "adam": (lambda lr: osa.sparse_adam(lr, catch_up=True), optax.adam),
    "adamw": (
        lambda lr: osa.sparse_adamw(lr, weight_decay=0.3, catch_up=True),
        lambda lr: optax.adamw(lr, weight_decay=0.3),
    ),
    "amsgrad": (lambda lr: osa.sparse_amsgrad(lr, catch_up=True), optax.amsgrad),
    "sgd": (lambda lr: osa.sparse_sgd(lr, momentum=0.9, catch_up=True), lambda lr: optax.sgd(lr, momentum=0.9)),
}


@pytest.mark.parametrize("name", list(_BY_RATE))
def test_derivatives_through_catch_up_steps_are_the_dense_optimizers(name: str) -> None:
    """Differentiated with respect to the initial table and the learning rate, six steps of a catch-up optimizer
    (gradients that depend on the table, ids that leave rows idle for a few steps) and a
    ``catch_up`` give the dense optax optimizer's derivatives: in forward mode for all four, in reverse mode for
    AMSGrad and momentum SGD. Adam's and AdamW's replays loop over a number of idle steps read from the data,
    which JAX does not differentiate in reverse mode: ``jax.grad`` raises. (AMSGrad's reverse-mode derivative with
    respect to the learning rate was NaN: the window of its idle steps' coefficients divided by ``1 - b1**tau`` at
    ``tau = 0`` where it was masked out.) Differentiated, the XLA path runs, kernels or not."""
    sparse, dense = _BY_RATE[name]
    rng = np.random.default_rng(5)
    p0 = jnp.asarray(rng.normal(size=(20, 4)).astype(np.float32))
    # The first step touches every row (dense optax's forward derivative is NaN on a row whose nu is still 0:
    # sqrt's derivative at 0 times a zero tangent), the others a few, leaving rows idle for up to five steps.
    ids = [jnp.arange(20), *(jnp.array([t, 2 * t + 1, 7, 7]) for t in range(1, 6))]
    values = [jnp.asarray(rng.normal(size=(i.size, 4)).astype(np.float32)) for i in ids]

    # The five steps of a few ids each run as one compiled body (lax.scan): unrolled, the six steps' compiles took
    # most of the test's time.
    first, rest = (ids[0], values[0]), (jnp.stack(ids[1:]), jnp.stack(values[1:]))

    def loss(p0: jax.Array, lr: jax.Array, is_sparse: bool) -> jax.Array:
        tx = sparse(lr) if is_sparse else dense(lr)
        scale = jnp.sum(jnp.sin(p0))

        def step(carry: Any, batch: tuple[jax.Array, jax.Array]) -> tuple[Any, None]:
            p, state = carry
            grads = osa.IndexedRows(batch[0], batch[1] * scale, 20)
            if not is_sparse:
                grads = jnp.zeros_like(p0).at[grads.indices].add(grads.values)
            updates, state = tx.update(grads, state, p)
            return (osa.apply_updates(p, updates), state), None

        p, state = jax.lax.scan(step, step((p0, tx.init(p0)), first)[0], rest)[0]
        if is_sparse:
            p, state = osa.catch_up(tx, p, state)
        return jnp.sum(jnp.sin(3.0 * p))

    lr, direction = jnp.float32(0.05), jnp.asarray(rng.normal(size=(20, 4)).astype(np.float32))

    @functools.partial(jax.jit, static_argnums=1)
    def forward(p0: jax.Array, is_sparse: bool) -> jax.Array:
        # The derivative along a direction of the table, and the one with respect to the learning rate, apart: two
        # tangents of one linearization (one trace of the steps).
        tangents = (jnp.stack([direction, jnp.zeros_like(direction)]), jnp.array([0.0, 1.0], jnp.float32))
        along = jax.linearize(lambda a, b: loss(a, b, is_sparse), p0, lr)[1]
        return jax.vmap(along)(*tangents)

    reverse = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)
    # The closed forms against dense steps: at most 3e-6 apart here, relative.
    want_fwd, want_rev = forward(p0, False), reverse(p0, lr, False)
    got_fwd = forward(p0, True)
    assert np.all(np.isfinite(want_fwd)) and np.all(np.isfinite(got_fwd))
    np.testing.assert_allclose(got_fwd, want_fwd, rtol=2e-5)
    if name in ("adam", "adamw"):
        with pytest.raises(ValueError, match="Reverse-mode differentiation does not work"):
            reverse(p0, lr, True)
        return
    got = reverse(p0, lr, True)
    assert all(np.all(np.isfinite(x)) for x in (*want_rev, *got))
    scale = float(jnp.max(jnp.abs(want_rev[0])))
    np.testing.assert_allclose(got[0], want_rev[0], rtol=2e-5, atol=2e-5 * scale)
    np.testing.assert_allclose(got[1], want_rev[1], rtol=2e-5)


@pytest.mark.parametrize("name", list(_CATCH_UP))
def test_catch_up_of_a_table_split_by_rows_over_an_explicit_mesh_replays_each_devices_rows(
    name: str, kernel_path: str
) -> None:
    """On an ``Explicit`` mesh, a table and its state split by rows over 8 devices are caught up on each device's
    rows (inside shard_map): the one-device results, bitwise, the table still split. (Without that, the replay's
    reads of its tables of coefficients by row needed their sharding spelled out, and ``catch_up`` raised.)"""
    tx = _CATCH_UP[name][0]()
    rows = 200
    p, state = _trained(tx, rows)
    want = jax.jit(lambda p, s: osa.catch_up(tx, p, s))(p, state)
    mesh = jax.make_mesh((8,), ("rows",), axis_types=(jax.sharding.AxisType.Explicit,))
    by_rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("rows"))
    with jax.set_mesh(mesh):
        placed = jax.tree.map(lambda x: jax.device_put(x, by_rows) if x.shape[:1] == (rows,) else x, (p, state))
        got = jax.jit(lambda p, s: osa.catch_up(tx, p, s))(*placed)
    assert got[0].sharding.is_equivalent_to(by_rows, 2)
    assert_trees_equal(got, want)


@needs_kernels
@pytest.mark.parametrize(
    "case", ["optax", "torch", "adamw", "schedule", "schedule, distinct", "adamw schedule", "adamw injected"]
)
def test_the_rows_kernel_takes_the_idle_steps_the_series_does_not_reach(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``tx.update`` then ``apply_updates`` on the rows kernel, from a state with rows idle within the window and
    longer and elements the series does not take (replayed one by one in the kernel): moments and last steps
    bitwise the XLA path's, the parameters within two ulps of the larger of the old and new value and one of the
    update (the XLA rule's update ``(replayed + step) - p`` from a replayed row rounded its own way). AdamW's
    (``sparse_adamw(catch_up=True)``): each idle step decays the row too, and its record of the decay is bitwise.
    Under a schedule (and with AdamW's rates injected) the kernel flags the long-idle rows that need steps, and under
    a schedule those whose last step the state's record does not hold (this hand-built state's holds none), exactly
    those, as the fused step's does; the XLA rule takes them, and their updates land in the kernel's slots by key
    (ids repeated, padded, or given as distinct)."""
    flagged = _record_flags(monkeypatch, "catch_up_adam_rows")
    rows, width, k, count = _IDLE_SHAPE
    lr = optax.cosine_decay_schedule(1e-2, 1000) if case.endswith("schedule") or ", " in case else 1e-2
    if case == "adamw injected":
        static = ("catch_up", "b1", "b2", "eps", "eps_root")
        tx = optax.inject_hyperparams(osa.sparse_adamw, static_args=static)(lr, weight_decay=0.3, catch_up=True)
    elif case.startswith("adamw"):
        tx = osa.sparse_adamw(lr, weight_decay=0.3, catch_up=True)
    else:
        tx = osa.sparse_adam(lr, catch_up=True, eps_placement="torch" if case == "torch" else "optax")
    rng = np.random.default_rng(6)
    p, state, last = _idle_start(tx.init, rng)
    distinct = case.endswith("distinct")
    extra = [] if distinct else [rng.integers(0, rows, 8), [-1, rows]]  # repeated ids, padding
    ids = jnp.asarray(np.concatenate([rng.permutation(rows)[:k], *extra]), jnp.int32)
    values = jnp.asarray(rng.normal(size=(ids.size, width)).astype(np.float32))
    g = osa.IndexedRows(ids, values, rows, unique_indices=distinct)

    def step(p: jax.Array, s: Any, g: osa.IndexedRows) -> Any:
        updates, s = tx.update(g, s, p)
        return osa.apply_updates(p, updates), s

    native = jax.jit(step)
    assert PREFIX + "catch_up_adam_rows" in native.lower(p, state, g).as_text()
    # The XLA path's program for ids promised distinct rounds mu an ulp apart from its program for the same ids
    # unpromised in the rows whose idle steps it takes one by one (XLA:CPU fuses them otherwise); both kernels give
    # the latter's bits.
    reference = osa.IndexedRows(ids, values, rows) if distinct else g
    (pn, sn), (px, sx) = native(p, state, g), jax.jit(osa.use_kernels(False)(step))(p, state, reference)
    assert_trees_equal(sn, sx)
    old, pn, px = np.asarray(p), np.asarray(pn), np.asarray(px)
    bound = 2 * np.spacing(np.maximum(np.abs(px), np.abs(old))) + np.spacing(np.abs(px - old))
    assert np.all(np.abs(pn - px) <= bound), np.max(np.abs(pn - px) / bound)
    touched = np.asarray(ids)[(np.asarray(ids) >= 0) & (np.asarray(ids) < rows)]
    assert (np.abs(px - old) > 0)[touched].all()
    cap = int(idle_cap(0.9, 0.999))
    assert (count - 1 - last[touched] > cap).any() and (count - 1 - last[touched] <= cap).any()
    (flags,) = flagged
    if case in ("optax", "torch", "adamw"):
        assert not flags.any()
    else:  # every entry of a long-idle row with tiny elements (those the series does not take) or, under a
        # schedule, whose entry the record does not hold; none of the others
        at = np.clip(np.asarray(ids), 0, rows - 1)
        tiny, missed = _tiny_and_missed(state, last)
        in_range = (np.asarray(ids) >= 0) & (np.asarray(ids) < rows)
        needs_steps = in_range & (tiny | missed)[at] & (count - 1 - last[at] > cap)
        assert needs_steps.sum() > 10
        np.testing.assert_array_equal(flags > 0, needs_steps)


@needs_kernels
@pytest.mark.parametrize("door", ["update_and_apply", "two calls"])
def test_flagged_rows_on_a_table_split_by_rows_and_under_vmap(door: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """AdamW's catch-up under a schedule, from a state with rows the kernel flags (idle longer than the window, with
    tiny elements): on a table and records split by rows over 8 devices (the kernel on each block, the flags summed,
    the XLA rule's rows placed by key) the step is the one-device step, bitwise; under vmap over two states, each
    state's own step, the state bitwise but for the record of long-idle coefficients, within two ulps (the window's
    sums are a batched matrix product under vmap, which XLA:CPU accumulates in its own order), and the parameters
    within two ulps of the larger of the old and new value (the XLA rule on the flagged rows is another program
    under vmap, whose multiply-adds XLA contracts by its own choice)."""
    flagged = _record_flags(monkeypatch, "catch_up_adam_rows" if door == "two calls" else "catch_up_adam_apply")
    rows, width, k, _ = _IDLE_SHAPE
    tx = osa.sparse_adamw(optax.cosine_decay_schedule(1e-2, 1000), weight_decay=0.3, catch_up=True)
    rng = np.random.default_rng(7)
    p, state, _ = _idle_start(tx.init, rng)
    ids = jnp.asarray(np.concatenate([rng.permutation(rows)[:k], rng.integers(0, rows, 8), [-1, rows]]), jnp.int32)
    values = jnp.asarray(rng.normal(size=(ids.size, width)), jnp.float32)

    def step(p: jax.Array, s: Any, ids: jax.Array, values: jax.Array) -> Any:
        g = osa.IndexedRows(ids, values, rows)
        if door == "update_and_apply":
            return osa.update_and_apply(tx, g, s, p)
        updates, s = tx.update(g, s, p)
        return osa.apply_updates(p, updates), s

    one = jax.jit(step)(p, state, ids, values)
    assert flagged[0].any()
    mesh = jax.make_mesh((8,), ("rows",), axis_types=(jax.sharding.AxisType.Auto,))
    by_rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("rows"))
    place = functools.partial(jax.tree.map, lambda x: jax.device_put(x, by_rows) if x.shape[:1] == (rows,) else x)
    sharded = jax.jit(step)(place(p), place(state), ids, values)
    assert sharded[0].sharding.is_equivalent_to(by_rows, 2)
    assert_trees_equal(sharded, one)
    starts = [(p, state), one]
    stacked = jax.tree.map(lambda *x: jnp.stack(x), *[(*start, ids, values) for start in starts])
    out = jax.jit(jax.vmap(step))(*stacked)
    for i, start in enumerate(starts):
        (pv, sv), (pw, sw) = jax.tree.map(lambda x, i=i: x[i], out), jax.jit(step)(*start, ids, values)
        assert_trees_equal(sv._replace(idle_record=None), sw._replace(idle_record=None))
        rv, rw = np.asarray(sv.idle_record.coefficients), np.asarray(sw.idle_record.coefficients)
        assert np.all(np.abs(rv - rw) <= 2 * np.spacing(np.maximum(np.abs(rv), np.abs(rw)))), np.abs(rv - rw).max()
        np.testing.assert_array_equal(sv.idle_record.last_steps, sw.idle_record.last_steps)
        pv, pw = np.asarray(pv), np.asarray(pw)
        bound = 2 * np.spacing(np.maximum(np.abs(pw), np.abs(np.asarray(start[0]))))
        assert np.all(np.abs(pv - pw) <= bound), np.abs(pv - pw).max()


@needs_kernels
def test_a_clipped_step_sums_and_clips_the_rows_it_leaves_to_the_xla_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """chain(sparse_aware(clip_by_global_norm), sparse_adam(schedule, catch_up=True)) under update_and_apply, ids
    repeated: the kernel sums and clips each row as it reads the entries, and the rows it flags (idle longer than
    the window under a schedule) are summed and clipped alike before the XLA rule takes them: the two calls'
    numbers on the kernels, moments bitwise, parameters within two ulps (as in the test above)."""
    flagged = _record_flags(monkeypatch)
    rows, width, k, _ = _IDLE_SHAPE
    tx = optax.chain(
        osa.sparse_aware(optax.clip_by_global_norm(0.5)),
        osa.sparse_adam(optax.cosine_decay_schedule(1e-2, 1000), catch_up=True),
    )
    rng = np.random.default_rng(6)
    p, state, _ = _idle_start(tx.init, rng)
    ids = rng.integers(0, rows, k).astype(np.int32)
    ids[: k // 4] = ids[k // 2 : k // 2 + k // 4]  # repeated
    g = osa.IndexedRows(jnp.asarray(ids), jnp.asarray(rng.normal(size=(k, width)).astype(np.float32)), rows)

    def two_calls(p: jax.Array, s: Any) -> Any:
        updates, s = tx.update(g, s, p)
        return osa.apply_updates(p, updates), s

    (pn, sn), (px, sx) = jax.jit(lambda p, s: osa.update_and_apply(tx, g, s, p))(p, state), jax.jit(two_calls)(p, state)
    (flags,) = flagged
    assert flags.any() and not flags.all(), flags
    assert_trees_equal(sn, sx)
    pn, px = np.asarray(pn), np.asarray(px)
    bound = 2 * np.spacing(np.maximum(np.abs(px), np.abs(np.asarray(p))))
    assert np.all(np.abs(pn - px) <= bound), np.abs(pn - px).max()


def test_idle_cap_bounds_the_rest_below_float32_resolution() -> None:
    for b1, b2 in [(0.9, 0.999), (0.5, 0.999), (0.99, 0.999), (0.9, 0.99)]:
        k = int(idle_cap(b1, b2))
        r = b1 / np.sqrt(b2)
        a = 1 / np.sqrt((1 - b2) * (1 - b1 * b1 / b2))
        assert a * r ** (k + 1) / (1 - r) <= 2.0**-24 < a * r**k / (1 - r)
    assert int(idle_cap(0.0, 0.999)) == 0


def test_refusals() -> None:
    with pytest.raises(ValueError, match=r"b1 < sqrt\(b2\)"):
        osa.sparse_adam(1e-2, b1=0.99, b2=0.9, catch_up=True)
    with pytest.raises(ValueError, match="lazy_dense"):
        osa.sparse_adam(1e-2, lazy_dense=True, catch_up=True)
    tx = osa.sparse_adam(1e-2, catch_up=True)
    p = jnp.zeros((4, 2), jnp.float32)
    g = osa.IndexedRows(jnp.array([1]), jnp.ones((1, 2), jnp.float32), 4)
    with pytest.raises(ValueError, match=r"call update\(grads, state, params\)"):
        tx.update(g, tx.init(p))
    with pytest.raises(
        TypeError,
        match=r"catch_up=True \(osa.sparse_adam, sparse_adamw, sparse_amsgrad or sparse_sgd with momentum\) itself",
    ):
        osa.catch_up(osa.sparse_adam(1e-2), p, osa.sparse_adam(1e-2).init(p))
    plain_sgd = osa.sparse_sgd(1e-2, catch_up=True)  # without momentum: catch_up=True has no effect
    with pytest.raises(TypeError, match="sparse_sgd without momentum moves no row a step does not touch"):
        osa.catch_up(plain_sgd, p, plain_sgd.init(p))
    grad_fn = osa.value_and_row_grad(lambda p, ids: p[ids].sum(), lambda p: p, catch_up=tx)
    with pytest.raises(TypeError, match="opt_state"):
        grad_fn(p, jnp.array([1]))
    other = {"emb": p}  # a state built for other parameters: both doors refuse it, naming the structures
    with pytest.raises(ValueError, match="state's mu has structure"):
        osa.catch_up(tx, other, tx.init(p))
    with pytest.raises(ValueError, match="state's mu has structure"):
        osa.value_and_row_grad(lambda q, ids: q["emb"][ids].sum(), lambda q: q["emb"], catch_up=tx)(
            other, jnp.array([1]), opt_state=tx.init(p)
        )
    bcoo = jax.experimental.sparse.BCOO.fromdense(jnp.ones((4, 2), jnp.float32), n_batch=0)
    with pytest.raises(ValueError, match="whole rows"):
        tx.update(bcoo, tx.init(p), p)


def test_a_state_field_of_another_shape_is_refused_naming_the_parameter_and_the_field() -> None:
    """``catch_up`` and caught-up lookups check each of a table's state fields against the shape ``init`` gives it
    (per element, or per row for the last steps and AdamW's decay marks) before a replay reads it by its rows: they
    checked the first moment only, and a second moment, last steps or decay marks built for a table of other rows
    failed in JAX or were read as they were (AdamW's decay marks at a constant rate: no error)."""
    params, other = {"t": jnp.ones((6, 3))}, {"t": jnp.ones((5, 3))}
    optimizers = [
        osa.sparse_adam(1e-2, catch_up=True),
        osa.sparse_adamw(1e-2, weight_decay=0.1, catch_up=True),
        osa.sparse_amsgrad(1e-2, catch_up=True),
        osa.sparse_sgd(1e-2, momentum=0.9, catch_up=True),
    ]
    for tx in optimizers:
        good, wrong = tx.init(params), tx.init(other)
        lookups = osa.value_and_row_grad(lambda q, ids: q["t"][ids].sum(), lambda q: q["t"], catch_up=tx)
        fields = [f for f in good._fields if isinstance(getattr(good, f), dict)]
        assert len(fields) >= 2, fields
        for field in fields:
            state = good._replace(**{field: getattr(wrong, field)})
            message = rf"parameter \['t'\]: shape \(6, 3\) but its optimizer state's {field} has shape \(5"
            with pytest.raises(ValueError, match=message):
                osa.catch_up(tx, params, state)
            with pytest.raises(ValueError, match=message):
                lookups(params, jnp.array([1]), opt_state=state)


@pytest.mark.slow
def test_benchmark_runs() -> None:
    import pathlib
    import subprocess
    import sys

    script = pathlib.Path(__file__).parents[1] / "benchmarks" / "catch_up.py"
    args = ["--rows", "2000", "--width", "8", "--batch", "64", "--warmup", "20", "--steps", "5"]
    proc = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=300, check=True)
    assert "catch_up / plain:" in proc.stdout, proc.stdout + proc.stderr


def test_a_collection_with_pooled_bags_trains_as_dense_adam_through_partition_tables() -> None:
    """Two tables stacked by an EmbeddingCollection, multi-hot bags pooled by mean, the tables on
    ``sparse_adam(catch_up=True)`` and the dense weights on ``optax.adam`` through ``partition_tables``, the loss
    reading caught-up rows: the losses are optax.adam's on the dense model (to float32 rounding), and after
    ``catch_up`` so are the parameters; lazy tables are not."""
    coll = osa.EmbeddingCollection(
        tables={"user": osa.TableSpec(300, 4), "item": osa.TableSpec(200, 4)},
        features={"user": osa.FeatureSpec("user"), "history": osa.FeatureSpec("item", "mean")},
    )
    params0 = {"emb": coll.init(jax.random.key(0)), "w": jnp.ones((4,), jnp.float32)}
    rng = np.random.default_rng(4)
    batches = [
        {
            "user": jnp.asarray((rng.zipf(1.3, 16) - 1) % 300, jnp.int32),
            "history": jnp.asarray(np.where(rng.random((16, 3)) < 0.3, -1, (rng.zipf(1.3, (16, 3)) - 1) % 200)),
        }
        for _ in range(60)
    ]

    def loss(p: Any, bags: Any) -> jax.Array:
        f = coll.pool(p["emb"], bags)
        return jnp.mean((jnp.sum(f["user"] * f["history"], axis=1) + f["user"] @ p["w"] - 1.0) ** 2)

    def run(catch_up: bool | None) -> tuple[list[float], Any]:
        params = params0
        if catch_up is None:  # dense: optax.adam on every leaf, table-sized gradients
            tx: Any = optax.adam(1e-2)
            grad_fn: Any = jax.value_and_grad(lambda p, b: loss(p, coll.bags(b)))
        else:
            tables_tx = osa.sparse_adam(1e-2, catch_up=catch_up)
            tx = osa.partition_tables(tables_tx, optax.adam(1e-2), lambda p: p["emb"])
            reads = {"catch_up": tables_tx} if catch_up else {}
            row_grads = osa.value_and_row_grad(loss, lambda p: p["emb"], **reads)
        state = tx.init(params)

        @jax.jit
        def step(params: Any, state: Any, batch: Any) -> Any:
            if catch_up is None:
                value, grads = grad_fn(params, batch)
                updates, state = tx.update(grads, state, params)
                return optax.apply_updates(params, updates), state, value
            extra = {"opt_state": state} if catch_up else {}
            value, grads = row_grads(params, coll.bags(batch), **extra)
            params, state = osa.update_and_apply(tx, grads, state, params)
            return params, state, value

        losses = []
        for batch in batches:
            params, state, value = step(params, state, batch)
            losses.append(float(value))
        if catch_up:
            params, state = jax.jit(lambda p, s: osa.catch_up(tables_tx, p, s))(params, state)
        return losses, params

    dense, caught, lazy = run(None), run(True), run(False)
    np.testing.assert_allclose(caught[0], dense[0], rtol=2e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(caught[1]), jax.tree.leaves(dense[1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-5)
    pairs = zip(jax.tree.leaves(lazy[1]), jax.tree.leaves(dense[1]), strict=True)
    gap = max(float(np.max(np.abs(a - b))) for a, b in pairs)
    assert gap > 1e-3, gap


@pytest.mark.parametrize(
    ("name", "kernels"),
    [(name, kernels) for name in ("adam", "adamw", "amsgrad") for kernels in (True, False)] + [("sgd", False)],
)
def test_the_fused_step_copies_no_per_row_record_and_its_temporaries_do_not_grow(name: str, kernels: bool) -> None:
    """The per-row last-step record (4 bytes a row) is updated in place: no copy of it, on the kernel path or in
    the XLA path's loop over row chunks, and the temporaries are the same for a table twice the size."""
    if kernels and not _kernel_path.enabled():
        pytest.skip(KERNELS_OFF)
    make = {
        "adam": lambda: osa.sparse_adam(1e-2, catch_up=True),
        "adamw": lambda: osa.sparse_adamw(1e-2, weight_decay=0.1, catch_up=True),
        "amsgrad": lambda: osa.sparse_amsgrad(1e-2, catch_up=True),
        "sgd": lambda: osa.sparse_sgd(1e-2, momentum=0.9, catch_up=True),
    }[name]
    temps = []
    for rows in (100_000, 200_000):
        tx = make()
        p = jax.ShapeDtypeStruct((rows, 4), jnp.float32)
        state = jax.eval_shape(tx.init, p)
        ids, values = jax.ShapeDtypeStruct((2048,), jnp.int32), jax.ShapeDtypeStruct((2048, 4), jnp.float32)

        def step(p: Any, s: Any, i: jax.Array, v: jax.Array, tx: Any = tx, rows: int = rows) -> Any:
            return osa.update_and_apply(tx, osa.IndexedRows(i, v, rows), s, p)

        with osa.use_kernels(kernels):
            report = osa.step_report(jax.jit(step, donate_argnums=(0, 1)), p, state, ids, values, min_bytes=rows * 2)
        assert report.copies == (), report
        assert report.kernel_path == ("native-cpu" if kernels else "xla"), report
        temps.append(report.temp_bytes)
    assert temps[0] == temps[1], temps


@needs_kernels
@pytest.mark.parametrize("name", ["adam", "adamw", "amsgrad"])
def test_the_fused_step_at_the_saturated_step_count_is_the_xla_paths(name: str) -> None:
    """Past 2**31 - 1 steps the count saturates (``optax.safe_increment``): the XLA path replays up to the state's
    count, and so does the fused step (not to the new count minus one), rows idle within the window and longer."""
    top = np.iinfo(np.int32).max
    make = {
        "adam": lambda: osa.sparse_adam(1e-2, catch_up=True),
        "adamw": lambda: osa.sparse_adamw(1e-2, weight_decay=0.1, catch_up=True),
        "amsgrad": lambda: osa.sparse_amsgrad(1e-2, catch_up=True),
    }[name]
    tx = make()
    rows, width = 16, 4
    rng = np.random.default_rng(0)
    p = jnp.asarray(rng.normal(size=(rows, width)).astype(np.float32))
    last = np.array([top - 1, top - 3, top - 500, 0] * (rows // 4), np.int32)

    def saturated(state: Any) -> Any:
        fields = {"count": jnp.int32(top), "last_step": jnp.asarray(last)}
        for moment in ("mu", "nu", "nu_max"):
            if hasattr(state, moment):
                fields[moment] = jnp.asarray(rng.uniform(0.01, 0.1, size=(rows, width)).astype(np.float32))
        return state._replace(**fields)

    kinds = (osa.CatchUpAdamState, osa.CatchUpAdamWState, osa.CatchUpAmsgradState)
    state = jax.tree.map(saturated, tx.init(p), is_leaf=lambda x: isinstance(x, kinds))
    g = osa.IndexedRows(
        jnp.arange(rows, dtype=jnp.int32), jnp.asarray(rng.normal(size=(rows, width)), jnp.float32), rows
    )

    def step(p: jax.Array, s: Any) -> Any:
        return osa.update_and_apply(tx, g, s, p)

    (pn, sn), (px, sx) = jax.jit(step)(p, state), jax.jit(osa.use_kernels(False)(step))(p, state)
    assert_trees_equal(sn, sx)
    np.testing.assert_allclose(np.asarray(pn), np.asarray(px), rtol=0, atol=2 * 2.0**-23 * np.abs(px).max())


@needs_kernels
@pytest.mark.parametrize("name", ["adam", "adam b2=0.99999", "adamw", "adamw schedule", "amsgrad"])
def test_rows_idle_for_any_count_decay_on_the_kernel_as_on_the_xla_path(name: str) -> None:
    """Rows idle from 1 to 2**30 steps, the four base-256 digits of their idle counts all taken: the kernel reads
    ``b1**idle``, ``b2**idle`` and AdamW's ``gamma**idle`` from the XLA path's tables, digit by digit in its order
    (moments and records bitwise); ``b2`` and ``gamma`` close to 1 keep the powers above float32's range for
    millions of steps."""
    count = 2**30
    schedule = optax.exponential_decay(1e-3, 1000, 0.999)
    make = {
        "adam": lambda: osa.sparse_adam(1e-3, catch_up=True),
        "adam b2=0.99999": lambda: osa.sparse_adam(1e-3, b2=0.99999, catch_up=True),
        "adamw": lambda: osa.sparse_adamw(1e-3, b2=0.99999, weight_decay=1e-5, catch_up=True),
        "adamw schedule": lambda: osa.sparse_adamw(schedule, weight_decay=1e-5, catch_up=True),
        "amsgrad": lambda: osa.sparse_amsgrad(1e-3, b2=0.99999, catch_up=True),
    }[name]
    tx = make()
    rows, width = 512, 4
    rng = np.random.default_rng(5)
    p = jnp.asarray(rng.normal(size=(rows, width)).astype(np.float32))
    idle = np.exp(rng.uniform(0.0, np.log(count), rows)).astype(np.int64)
    last = (count - idle).astype(np.int32)

    def idle_rows(state: Any) -> Any:
        fields = {"count": jnp.int32(count), "last_step": jnp.asarray(last)}
        for moment in ("mu", "nu", "nu_max"):
            if hasattr(state, moment):
                size = (rows, width)
                scale = 0.1 if moment == "mu" else 0.05
                fields[moment] = jnp.asarray((scale * (0.2 + rng.random(size)) ** (moment != "mu")).astype(np.float32))
        if hasattr(state, "decay_mark"):  # the record a rate of lr * wd = 1e-8 a step leaves
            fields["log_decay"] = jnp.asarray([count * np.log1p(-1e-8), 0.0], jnp.float32)
            fields["decay_mark"] = jnp.asarray(last * np.log1p(-1e-8), jnp.float32)
        return state._replace(**fields)

    kinds = (osa.CatchUpAdamState, osa.CatchUpAdamWState, osa.CatchUpAmsgradState)
    state = jax.tree.map(idle_rows, tx.init(p), is_leaf=lambda x: isinstance(x, kinds))
    ids = jnp.asarray(rng.permutation(rows).astype(np.int32))
    g = osa.IndexedRows(ids, jnp.asarray(rng.normal(size=(rows, width)), jnp.float32), rows)

    def step(p: jax.Array, s: Any) -> Any:
        return osa.update_and_apply(tx, g, s, p)

    (pn, sn), (px, sx) = jax.jit(step)(p, state), jax.jit(osa.use_kernels(False)(step))(p, state)
    assert_trees_equal(sn, sx)
    np.testing.assert_allclose(np.asarray(pn), np.asarray(px), rtol=0, atol=2 * 2.0**-23 * np.abs(px).max())
    # The moments of rows idle within float32's range of b2**idle moved: the test reaches past the first digit.
    nu = np.asarray(jax.tree.leaves(sx, is_leaf=lambda x: isinstance(x, kinds))[0].nu)
    assert np.count_nonzero((idle > 65536) & (nu[:, 0] > 0)) > 10 or name in ("adam", "adamw schedule")


@pytest.mark.parametrize("b", [0.0, 0.5, 0.9, 0.999, 0.99999, 1 - 1e-8])
def test_powers_of_a_rate_are_within_a_few_ulps_for_any_count(b: float) -> None:
    """``b ** n`` from the table, against a long-double reference, for counts up to 2**31 - 1: within 3.5 ulps
    where the power is a normal float32 (four entries rounded to nearest, three products), else 0 or at most twice
    float32's smallest normal number."""
    from optax_sparse_adam._catch_up import _power

    rng = np.random.default_rng(0)
    top = np.iinfo(np.int32).max
    edges = [0, 1, 2, 255, 256, 257, 65535, 65536, 2**24 - 1, 2**24, top - 1, top, -1, -top]
    n = np.concatenate([np.exp(rng.uniform(0.0, np.log(top), 4000)).astype(np.int64), edges]).astype(np.int32)
    got = np.asarray(jax.jit(functools.partial(_power, b))(jnp.asarray(n))).astype(np.float64)
    log_b = np.log(np.longdouble(b)) if b > 0 else np.longdouble(-np.inf)
    with np.errstate(invalid="ignore"):  # 0 * -inf where n == 0, not taken
        want = np.where(n > 0, np.exp(np.maximum(n, 0).astype(np.longdouble) * log_b), 1.0).astype(np.float64)
    tiny = np.finfo(np.float32).tiny
    normal = want >= tiny
    ulp = np.spacing(want[normal].astype(np.float32)).astype(np.float64)
    assert np.all(np.abs(got[normal] - want[normal]) <= 3.5 * ulp), np.max(np.abs(got[normal] - want[normal]) / ulp)
    assert np.all((got[~normal] == 0) | (got[~normal] <= 2 * tiny))


@pytest.mark.parametrize("name", ["adamw", "amsgrad", "momentum"])
def test_a_schedule_is_traced_once_and_goes_with_its_optimizer(
    name: str, monkeypatch: pytest.MonkeyPatch, kernel_path: str
) -> None:
    """A step evaluates its schedule under a jit of its own, kept while the schedule lives: a schedule built inside
    a jitted function from a traced learning rate (a sweep) leaks no tracer (``jax.checking_leaks``; neither does a
    catch-up kernel's call, fused or ``tx.update``'s, which keeps no traced operand in the step's jaxpr) and leaves
    no entry behind; it is traced fewer times than vmapped at each place (the cache turned off), and the steps'
    numbers are those."""
    optimizers = {
        "adamw": lambda lr: osa.sparse_adamw(lr, 0.3, catch_up=True),
        "amsgrad": lambda lr: osa.sparse_amsgrad(lr, catch_up=True),
        "momentum": lambda lr: osa.sparse_sgd(lr, momentum=0.9, catch_up=True),
    }
    traces = [0]

    def run(peak: jax.Array) -> tuple[jax.Array, ...]:
        linear = optax.linear_schedule(peak, 1e-3, 20)

        def schedule(count: jax.Array) -> jax.Array:
            traces[0] += 1
            return linear(count)

        tx = optimizers[name](schedule)
        p = jnp.ones((30, 4), jnp.float32)
        state = tx.init(p)
        for t in range(2):  # the two calls, then the fused step
            g = osa.IndexedRows(jnp.array([t, 2 * t + 1, 7], jnp.int32), jnp.full((3, 4), 0.5 + t, jnp.float32), 30)
            if t % 2:
                p, state = osa.update_and_apply(tx, g, state, p)
            else:
                updates, state = tx.update(g, state, p)
                p = osa.apply_updates(p, updates)
        return p, osa.catch_up(tx, p, state)[0]

    gc.collect()  # entries of schedules an earlier test left in cyclic garbage go now, not during the count
    entries = len(_catch_up._VMAPPED)
    with checking_leaks():
        cached = jax.jit(lambda peak: run(peak))(jnp.float32(0.05))  # a function of its own: traced anew
    assert len(_catch_up._VMAPPED) == entries
    cached_traces, traces[0] = traces[0], 0

    def uncached(schedule: Any) -> Any:
        raise TypeError("not cached")

    monkeypatch.setattr(_catch_up, "_vmapped", uncached)
    assert_trees_equal(cached, jax.jit(lambda peak: run(peak))(jnp.float32(0.05)))
    assert 0 < cached_traces < traces[0]


def test_schedules_that_keep_themselves_alive_are_kept_up_to_a_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """A schedule whose traced program refers back to it (a ``jax.custom_jvp`` whose rule closes over it) is kept
    alive by its own entry; past ``_MAX_SCHEDULES`` entries the oldest goes, and a schedule whose entry went is
    traced again, its rates unchanged."""

    def make(scale: float) -> Callable[[jax.Array], jax.Array]:
        @jax.custom_jvp
        def schedule(count: jax.Array) -> jax.Array:
            return scale / (1.0 + count.astype(jnp.float32))

        @schedule.defjvp
        def _(primals: Any, tangents: Any) -> Any:
            return schedule(*primals), jnp.zeros((), jnp.float32)  # closes over the schedule itself

        return schedule

    monkeypatch.setattr(_catch_up, "_VMAPPED", {})
    monkeypatch.setattr(_catch_up, "_MAX_SCHEDULES", 4)
    counts = jnp.array([[0, 1], [3, 7]], jnp.int32)
    schedules = [make(float(i + 1)) for i in range(10)]
    for i, schedule in enumerate(schedules):
        np.testing.assert_array_equal(_catch_up.rate_at(schedule, counts), (i + 1.0) / (1.0 + counts))
        assert len(_catch_up._VMAPPED) <= 4
    del schedules[4:]
    gc.collect()
    assert len(_catch_up._VMAPPED) == 4  # the last four, alive through their own jits
    np.testing.assert_array_equal(_catch_up.rate_at(schedules[0], counts), 1.0 / (1.0 + counts))
    assert _catch_up._VMAPPED[id(schedules[0])][0]() is schedules[0]


_WITH_DENSE = {
    "adam": (lambda: osa.sparse_adam(1e-2, catch_up=True), lambda: optax.adam(1e-2)),
    "amsgrad": (lambda: osa.sparse_amsgrad(1e-2, catch_up=True), lambda: optax.amsgrad(1e-2)),
    "momentum": (lambda: osa.sparse_sgd(1e-2, momentum=0.9, catch_up=True), lambda: optax.sgd(1e-2, momentum=0.9)),
}


@pytest.mark.parametrize("door", ["update_and_apply", "two calls"])
@pytest.mark.parametrize("name", list(_WITH_DENSE))
def test_an_infinite_parameter_that_sat_out_steps_stays_as_dense_optax_leaves_it(
    name: str, door: str, kernel_path: str
) -> None:
    """A row touched, idle for four steps, then touched again, whose parameter holds -inf beside finite elements:
    the catch-up step leaves the -inf (its update the replayed -inf, where ``inf - inf`` made it NaN before) and
    the finite elements, and after ``catch_up`` every row, as dense optax's steps take them (within float32
    rounding of the closed forms)."""
    sparse, dense = (make() for make in _WITH_DENSE[name])
    p0 = jnp.ones((4, 3), jnp.float32).at[1, 0].set(-jnp.inf)

    @jax.jit
    def run(p: jax.Array) -> jax.Array:
        s = sparse.init(p)
        for t in range(6):
            g = osa.IndexedRows(jnp.array([1 if t in (0, 5) else 2, 3], jnp.int32), jnp.full((2, 3), 0.5), 4)
            if door == "update_and_apply":
                p, s = osa.update_and_apply(sparse, g, s, p)
            else:
                updates, s = sparse.update(g, s, p)
                p = osa.apply_updates(p, updates)
        return osa.catch_up(sparse, p, s)[0]  # the row idle at the last step too

    want, s = p0, dense.init(p0)
    for t in range(6):
        updates, s = dense.update(jnp.zeros((4, 3)).at[jnp.array([1 if t in (0, 5) else 2, 3])].add(0.5), s, want)
        want = optax.apply_updates(want, updates)
    if kernel_path == "native-cpu":  # the kernels' CaughtUpUpdate: the rows kernel, or momentum's apply kernel
        kernel = {"adam": "catch_up_adam", "amsgrad": "catch_up_amsgrad", "momentum": "catch_up_momentum"}[name]
        assert PREFIX + kernel + ("_apply" if door == "update_and_apply" else "_rows") in run.lower(p0).as_text()
    got = np.asarray(run(p0))
    assert got[1, 0] == -np.inf
    np.testing.assert_allclose(got, np.asarray(want), rtol=1e-6)


@contextlib.contextmanager
def _compiles() -> Iterator[list[str]]:
    """The XLA compiles (or persistent cache loads) inside the block, one entry each."""
    compiles: list[str] = []
    listening = [True]

    def on_duration(event: str, duration: float, **_: Any) -> None:
        if listening[0] and event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    try:
        yield compiles
    finally:
        listening[0] = False


@pytest.mark.parametrize("name", list(_CATCH_UP))
def test_catch_up_on_arrays_compiles_once_and_reuses_its_program(name: str, kernel_path: str) -> None:
    """``catch_up`` called on arrays, as before an evaluation: it ran op by op, and its loops and conditionals,
    built anew on each call, compiled again on every call (4 to 6 programs and up to 2.8 s on a table of 50 rows
    under a schedule). Now one program a call signature: the second call compiles nothing, and the result is the
    one ``catch_up`` gives inside a jitted function."""
    tx = _CATCH_UP[name][0]()
    params = {"t": jnp.ones((48, 8)), "u": jnp.full((20, 8), 2.0)}
    state = tx.init(params)
    step = jax.jit(lambda g, s, p: osa.update_and_apply(tx, g, s, p))
    for ids in ([1, 2, 3], [4, 5]):
        g = {k: osa.IndexedRows(jnp.asarray(ids), jnp.ones((len(ids), 8)), v.shape[0]) for k, v in params.items()}
        params, state = step(g, state, params)
    with _compiles() as compiles:
        first = osa.catch_up(tx, params, state)
        assert len(compiles) == 1, compiles
        compiles.clear()
        second = osa.catch_up(tx, params, state)
        assert not compiles, compiles
    assert_trees_equal(second, first)
    assert_trees_equal(first, jax.jit(lambda p, s: osa.catch_up(tx, p, s))(params, state))
    # Arrays closed over in a jitted function: the program is called under that trace, its results tracers.
    assert_trees_equal(first, jax.jit(lambda: osa.catch_up(tx, params, state))())


_EAGER = {
    "adam": lambda: osa.sparse_adam(1e-2),
    "adam schedule catch_up": lambda: osa.sparse_adam(optax.linear_schedule(1e-2, 0.0, 100), catch_up=True),
    "osa.apply_if_finite(adam)": lambda: osa.apply_if_finite(osa.sparse_adam(1e-2), 3),
    "rowwise_adagrad bfloat16 key": lambda: osa.sparse_rowwise_adagrad(1e-2),
}


@pytest.mark.parametrize("name", list(_EAGER))
def test_update_and_apply_on_arrays_compiles_once_and_steps_as_jitted(name: str, kernel_path: str) -> None:
    """``update_and_apply`` called on arrays (a notebook's loop without ``jax.jit``) ran op by op: the conditionals
    of a catch-up schedule's flagged rows and of ``osa.apply_if_finite``, built anew on each call, compiled again
    every step (2.3 s a step for catch-up Adam under a schedule on a table of 100 rows), and so did the bias
    corrections of each new step count. Now one program: later steps compile nothing, and each step is the jitted
    step's, bitwise."""
    tx = _EAGER[name]()
    dtype = jnp.bfloat16 if "bfloat16" in name else jnp.float32
    params = {"t": jnp.ones((100, 8), dtype), "u": jnp.full((30, 8), 2.0, dtype)}
    state = tx.init(params)
    keys = jax.random.split(jax.random.key(0), 4) if "key" in name else [None] * 4
    jitted = jax.jit(lambda g, s, p, key: osa.update_and_apply(tx, g, s, p, key=key))
    with _compiles() as compiles:
        p, s = params, state
        for i, key in enumerate(keys):
            ids = jnp.asarray([i, i + 1, i, 40 + i])
            g = {
                k: osa.IndexedRows(ids % v.shape[0], jnp.full((4, 8), 0.5 - i, dtype), v.shape[0]) for k, v in p.items()
            }
            want = jitted(g, s, p, key)
            compiles.clear()
            p, s = osa.update_and_apply(tx, g, s, p, key=key)
            assert len(compiles) == (1 if i == 0 else 0), (i, compiles)
            assert_trees_equal((p, s), want)


def test_catch_up_on_arrays_keeps_the_layout_of_a_table_split_over_an_auto_mesh() -> None:
    """``catch_up`` on arrays runs as one program; on an ``Auto`` mesh XLA laid AdamW's per-row decay marks out whole
    on every device where the state split them by rows. Each result keeps its input's layout, and the values are
    those of the call inside ``jax.jit``."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    tx = osa.sparse_adamw(optax.linear_schedule(0.05, 0.01, 50), weight_decay=0.1, catch_up=True)
    p, state = _trained(tx, 256)
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))

    def put(x: jax.Array) -> jax.Array:
        return jax.device_put(x, NamedSharding(mesh, P("x") if jnp.ndim(x) and x.shape[0] == 256 else P()))

    p, state = put(p), jax.tree.map(put, state)
    with jax.set_mesh(mesh):
        out = osa.catch_up(tx, p, state)
        want = jax.jit(lambda p, s: osa.catch_up(tx, p, s))(p, state)
    assert_trees_equal(out, want)
    for got, given in zip(jax.tree.leaves(out), jax.tree.leaves((p, state)), strict=True):
        assert got.sharding.is_equivalent_to(given.sharding, got.ndim), (got.sharding, given.sharding)


@pytest.mark.parametrize("schedule", [False, True], ids=["constant", "schedule"])
@pytest.mark.parametrize("name", list(_BY_RATE))
def test_in_jax_64_bit_mode_a_float32_table_steps_and_catches_up_as_dense_optax(
    name: str, schedule: bool, kernel_path: str
) -> None:
    """In jax's 64-bit mode a float32 table steps through both doors and is caught up to the dense optax
    optimizer's table there (whose arithmetic jax then partly does in float64, as the library's), within 8 ulps of
    the table's scale (1e-6; 4 at most in this run). The kernels'
    coefficient operands were float64 in that mode (NumPy tables, a schedule's rates), which the kernels refused at
    run time (Adam, AdamW, AMSGrad); under a schedule the record of long-idle coefficients was written at indices of
    int32 and int64 together, and the long-idle loop's carry turned float64, which failed to trace (all four)."""
    sparse, dense = _BY_RATE[name]

    def run(tx: optax.GradientTransformation, is_sparse: bool) -> Any:
        p = jnp.asarray(np.random.default_rng(0).normal(size=(30, 4)), jnp.float32)
        state = tx.init(p)

        @functools.partial(jax.jit, static_argnums=4)
        def step(p: jax.Array, state: Any, ids: jax.Array, values: jax.Array, fused: bool) -> Any:
            g: Any = osa.IndexedRows(ids, values, 30)
            if not is_sparse:
                g = jnp.zeros_like(p).at[ids].add(values)
            if fused:
                return osa.update_and_apply(tx, g, state, p)
            updates, state = tx.update(g, state, p)
            return osa.apply_updates(p, updates), state

        for t in range(12):  # rows idle past the window (12 steps and more: rows 8 to 28)
            ids = jnp.array([t % 5, 7, 7, 29], jnp.int32)
            values = jnp.asarray(np.random.default_rng(t).normal(size=(4, 4)), jnp.float32)
            p, state = step(p, state, ids, values, t % 2 == 0)
        if is_sparse:
            p, state = jax.jit(lambda p, s: osa.catch_up(tx, p, s))(p, state)
        return np.asarray(p)

    with jax.enable_x64(True):
        rate = optax.linear_schedule(1e-2, 1e-3, 40) if schedule else 1e-2
        got, want = run(sparse(rate), True), run(dense(rate), False)
    assert got.dtype == np.float32 and np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
