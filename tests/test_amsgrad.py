"""``sparse_amsgrad``: the lazy AMSGrad rule (``_amsgrad.py``)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import optax_sparse_adam as osa
from optax_sparse_adam._amsgrad import idle_cap
from optax_sparse_adam._kernel_path import PREFIX
from tests import variant_checks
from tests.helpers import assert_trees_equal, needs_kernels
from tests.variant_checks import LR

COMPARE_STATE = True  # the same ScaleByAmsgradState as optax's
NAMES = ["amsgrad"]


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=10, deadline=None)
@given(problem=variant_checks.problems(), seed=st.integers(0, 2**31 - 1))
def test_matches_numpy_reference(name, problem, seed):
    variant_checks.check_matches_reference(name, problem, seed)


EQUIVALENTS = [
    ("amsgrad", lambda: osa.sparse_amsgrad(LR), lambda: optax.amsgrad(LR), 3),
]


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize(("name", "ours", "theirs", "width"), EQUIVALENTS, ids=[e[0] for e in EQUIVALENTS])
def test_equals_optax_when_every_row_is_touched(name, ours, theirs, width, sparse):
    variant_checks.check_equals_optax_when_every_row_is_touched(ours, theirs, width, sparse, COMPARE_STATE)


@pytest.mark.parametrize("name", NAMES)
def test_jit_compiles_once(name):
    variant_checks.check_compiles_once(name)


@pytest.mark.parametrize("name", NAMES)
def test_bad_gradients_raise_naming_the_path(name):
    variant_checks.check_bad_gradients_raise_naming_the_path(name)


INJECTED = [
    ("amsgrad", osa.sparse_amsgrad, {"learning_rate": 0.05, "b2": 0.99}),
]


@pytest.mark.parametrize(("name", "factory", "kwargs"), INJECTED, ids=[i[0] for i in INJECTED])
def test_inject_hyperparams_matches_and_does_not_recompile(name, factory, kwargs):
    variant_checks.check_inject_hyperparams_matches_and_does_not_recompile(factory, kwargs)


@pytest.mark.parametrize("name", NAMES)
def test_extra_args_are_accepted(name):
    variant_checks.check_extra_args_are_accepted(name)


def test_bad_hyperparameters_raise():
    with pytest.raises(ValueError, match="b2"):
        osa.sparse_amsgrad(0.1, b2=1.0)


# ``sparse_amsgrad(catch_up=True)`` against dense AMSGrad in float64 NumPy fed the same gradients (zeros elsewhere).
# Float32 optax.amsgrad drifts from it too (it rounds every row at every idle step), so the caught-up optimizer
# must stay within twice that drift, where lazy AMSGrad is off by orders of magnitude.
ROWS, WIDTH, BATCH, STEPS = 400, 4, 32, 300
SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 0.02, 40, STEPS, 0.002)
CATCH_UP_CASES = {
    "b1=0.9": dict(learning_rate=1e-2),
    "b1=0.9 schedule": dict(learning_rate=SCHEDULE),
    "b1=0.99 eps_root": dict(learning_rate=3e-3, b1=0.99, eps_root=1e-10),
    "b1=0.5 eps=1e-3": dict(learning_rate=1e-2, b1=0.5, eps=1e-3),
    "b1=0": dict(learning_rate=1e-2, b1=0.0),
}


def _zipf_batches(seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Zipf ids with duplicates and some -1 padding, and their row gradients."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(STEPS):
        ids = ((rng.zipf(1.2, BATCH) - 1) % ROWS).astype(np.int32)
        ids[rng.random(BATCH) < 0.05] = -1
        out.append((ids, rng.normal(size=(BATCH, WIDTH)).astype(np.float32)))
    return out


def _amsgrad64(batches: list, p0: np.ndarray, learning_rate: Any, **kw: float) -> dict[str, np.ndarray]:
    """Dense AMSGrad in float64, optax.scale_by_amsgrad's rule."""
    b1, b2, eps, eps_root = (kw.get(k, d) for k, d in (("b1", 0.9), ("b2", 0.999), ("eps", 1e-8), ("eps_root", 0.0)))
    p, m, v, v_max = p0.astype(np.float64), np.zeros(p0.shape), np.zeros(p0.shape), np.zeros(p0.shape)
    for t, (ids, values) in enumerate(batches, start=1):
        g = np.zeros(p0.shape)
        np.add.at(g, ids[ids >= 0], values[ids >= 0].astype(np.float64))
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        v_max = np.maximum(v_max, v / (1 - b2**t))
        lr = float(learning_rate(t - 1)) if callable(learning_rate) else learning_rate
        p = p - lr * (m / (1 - b1**t)) / (np.sqrt(v_max + eps_root) + eps)
    return {"p": p, "mu": m, "nu": v, "nu_max": v_max}


def _run(
    tx: optax.GradientTransformation, batches: list, p0: np.ndarray, sparse: bool, fused: bool = False
) -> tuple[Any, Any]:
    """The whole run in one jit (a scan over the batches): the final parameters and state; ``fused``: each step
    by ``update_and_apply``, else by the two calls."""
    ids, values = (jnp.asarray(np.stack(x)) for x in zip(*batches, strict=True))

    def step(carry: Any, batch: Any) -> tuple[Any, None]:
        p, state = carry
        ids, values = batch
        if sparse:
            g: Any = osa.IndexedRows(ids, values, ROWS)
        else:
            g = jnp.zeros((ROWS, WIDTH), jnp.float32).at[jnp.where(ids < 0, ROWS, ids)].add(values, mode="drop")
        if fused:
            return osa.update_and_apply(tx, g, state, p), None
        updates, state = tx.update(g, state, p)
        return (osa.apply_updates(p, updates), state), None

    @jax.jit
    def run(p: jax.Array, ids: jax.Array, values: jax.Array) -> Any:
        return jax.lax.scan(step, (p, tx.init(p)), (ids, values))[0]

    return run(jnp.asarray(p0), ids, values)


def _moments(p: Any, state: Any) -> dict[str, np.ndarray]:
    state = state[0] if isinstance(state, tuple) and not hasattr(state, "_fields") else state
    return {"p": np.asarray(p), **{k: np.asarray(getattr(state, k)) for k in ("mu", "nu", "nu_max")}}


def _relative(run: dict[str, np.ndarray], ref: dict[str, np.ndarray]) -> dict[str, float]:
    return {k: float(np.max(np.abs(run[k] - ref[k])) / np.max(np.abs(ref[k]))) for k in ref}


@pytest.mark.parametrize(
    ("case", "fused"),
    [(case, False) for case in CATCH_UP_CASES] + [("b1=0.9 schedule", True), ("b1=0", True)],
    ids=[*CATCH_UP_CASES, "b1=0.9 schedule, fused", "b1=0, fused"],
)
def test_catch_up_equals_dense_amsgrad_over_a_zipf_run(case: str, fused: bool) -> None:
    """Parameters and moments of the caught-up run (every row brought up to date by ``catch_up`` at the end) are
    within twice float32 optax.amsgrad's own distance from a float64 AMSGrad; lazy AMSGrad is not. ``fused``: the
    steps by ``update_and_apply`` (on the CPU, the catch-up kernel)."""
    kw = CATCH_UP_CASES[case]
    batches = _zipf_batches(seed=len(case))
    p0 = np.random.default_rng(8).normal(size=(ROWS, WIDTH)).astype(np.float32)
    ref = _amsgrad64(batches, p0, **kw)
    drift = _relative(_moments(*_run(optax.amsgrad(**kw), batches, p0, sparse=False)), ref)
    tx = osa.sparse_amsgrad(**kw, catch_up=True)
    p, state = _run(tx, batches, p0, sparse=True, fused=fused)
    p, state = jax.jit(lambda p, s: osa.catch_up(tx, p, s))(p, state)
    assert isinstance(state, osa.CatchUpAmsgradState)
    np.testing.assert_array_equal(state.last_step[state.last_step > 0], STEPS)
    err = _relative(_moments(p, state), ref)
    for k in ref:
        assert err[k] <= 2 * drift[k] + 2e-7, (k, err, drift)
    if kw.get("b1", 0.9) > 0 and not fused:
        lazy = _relative(_moments(*_run(osa.sparse_amsgrad(**kw), batches, p0, sparse=True)), ref)
        assert lazy["p"] > 100 * max(drift["p"], 1e-7), (lazy, drift)


def _kernel_step_equals_xla(native: Any, xla: Any, p: jax.Array, state: Any, args: tuple[jax.Array, ...]) -> Any:
    """One step both ways from the same ``(p, state)``: the states bitwise, each parameter within two ulps of itself
    and one of its update; the XLA path's ``(p, state)``."""
    (pn, sn), (px, sx) = native(p, state, *args), xla(p, state, *args)
    assert_trees_equal(sn, sx)
    old, new = np.asarray(p), np.asarray(px)
    bound = 2 * np.spacing(np.maximum(np.abs(old), np.abs(new))) + np.spacing(np.abs(new - old))
    assert np.all(np.abs(np.asarray(pn) - new) <= bound), np.max(np.abs(np.asarray(pn) - new) / bound)
    return px, sx


FUSED_CASES = {
    "b1=0.9": dict(learning_rate=1e-2),
    "schedule": dict(learning_rate=SCHEDULE),
    "distinct ids": dict(learning_rate=1e-2),
    "b1=0.99 eps_root": dict(learning_rate=3e-3, b1=0.99, eps_root=1e-10),
    "b1=0": dict(learning_rate=1e-2, b1=0.0),
}


@needs_kernels
@pytest.mark.parametrize("door", ["update_and_apply", "two calls"])
@pytest.mark.parametrize("case", FUSED_CASES)
def test_the_fused_catch_up_step_on_the_kernel_equals_the_xla_path(case: str, door: str) -> None:
    """``update_and_apply`` of ``sparse_amsgrad(catch_up=True)`` runs one kernel call that catches each touched row
    up and steps it; from the same state as the XLA path's, step for step over a Zipf run with duplicates, padding
    (-1 and ids past the table) and rows idle within the replayed window and past it: moments and last steps
    bitwise, each parameter within two ulps of itself and one of its update (the kernel rounds ``p - shift +
    step`` in its own order, the XLA path the caught-up row, then the update that takes the stored row there).
    The two calls (``tx.update``, then ``apply_updates``) run the rows kernel: each row replayed in a scratch copy,
    its update ``(replayed + step) - p``, within the same bound."""
    tx = osa.sparse_amsgrad(**FUSED_CASES[case], catch_up=True)
    rows, width, k, unique = 200, 8, 48, case == "distinct ids"
    rng = np.random.default_rng(3)
    p = jnp.asarray(rng.normal(size=(rows, width)).astype(np.float32))
    # Past the window of steps the replay sums, every row last moved at a step of its own: rows come back within
    # the window and after it (the long-idle table, or the loop under a schedule).
    cap = idle_cap(FUSED_CASES[case].get("b1", 0.9))
    v = (1e-2 * rng.random((rows, width))).astype(np.float32) ** 2
    state = tx.init(p)._replace(
        count=jnp.int32(cap + 200),
        mu=jnp.asarray((np.sqrt(v) * rng.uniform(-0.5, 0.5, v.shape)).astype(np.float32)),
        nu=jnp.asarray(v),
        nu_max=jnp.asarray(v * (1 + rng.random(v.shape)).astype(np.float32)),
        last_step=jnp.asarray(rng.integers(1, cap + 200, rows).astype(np.int32)),
    )

    def step(p: jax.Array, s: Any, ids: jax.Array, values: jax.Array) -> Any:
        g = osa.IndexedRows(ids, values, rows, unique_indices=unique)
        if door == "two calls":
            updates, s = tx.update(g, s, p)
            return osa.apply_updates(p, updates), s
        return osa.update_and_apply(tx, g, s, p)

    native, xla = jax.jit(step), jax.jit(osa.use_kernels(False)(step))
    text = native.lower(p, state, jnp.zeros(k, jnp.int32), jnp.zeros((k, width), jnp.float32)).as_text()
    if door == "two calls":
        assert text.count(PREFIX + "catch_up_amsgrad_rows") == 1 and "amsgrad_apply" not in text
    else:
        assert text.count(PREFIX + "catch_up_amsgrad_apply") == 1 and "amsgrad_rows" not in text
    idle = []
    for _ in range(60):
        # Distinct ids, or Zipf ids with duplicates and padding.
        if unique:
            ids = rng.permutation(rows)[:k]
        else:
            ids = np.where(rng.random(k) < 0.1, rng.choice([-1, rows, rows + 7], k), (rng.zipf(1.3, k) - 1) % rows)
        args = (jnp.asarray(ids.astype(np.int32)), jnp.asarray(rng.normal(size=(k, width)).astype(np.float32)))
        idle.extend(np.asarray(state.count - state.last_step[ids[ids >= 0]]).tolist())
        p, state = _kernel_step_equals_xla(native, xla, p, state, args)
    within = cap == 0 or any(0 < i <= cap for i in idle)
    assert min(idle) == 0 and within and max(idle) > cap, (cap, sorted(set(idle)))


def test_catch_up_reads_caught_up_rows_and_dense_leaves_are_optax() -> None:
    """``value_and_row_grad(catch_up=tx)`` hands the loss the rows dense AMSGrad holds; a leaf with dense
    gradients takes optax.amsgrad's step bitwise (update and application compiled apart)."""
    batches = _zipf_batches(seed=5)[:80]
    p0 = np.random.default_rng(3).normal(size=(ROWS, WIDTH)).astype(np.float32)
    tx = osa.sparse_amsgrad(SCHEDULE, catch_up=True)
    p, state = _run(tx, batches, p0, sparse=True)
    ref = _amsgrad64(batches, p0, SCHEDULE)["p"]
    ids = jnp.arange(ROWS, dtype=jnp.int32)

    def loss(params: jax.Array, ids: jax.Array) -> jax.Array:
        return jnp.sum(params[ids] ** 2)

    # Jitted: one compilation each, not one dispatch per operation of the replay.
    caught_read = jax.jit(
        lambda p, ids, state: osa.value_and_row_grad(loss, lambda q: q, catch_up=tx)(p, ids, opt_state=state)
    )
    value, _ = caught_read(p, ids, state)
    np.testing.assert_allclose(value, np.sum(ref**2), rtol=2e-5)
    stale, _ = jax.jit(osa.value_and_row_grad(loss, lambda q: q))(p, ids)
    assert abs(float(stale) - np.sum(ref**2)) > 100 * abs(float(value) - np.sum(ref**2))

    dense_p, dense_state = jnp.asarray(p0), tx.init(jnp.asarray(p0))
    theirs = optax.amsgrad(SCHEDULE)
    q, their_state = jnp.asarray(p0), theirs.init(jnp.asarray(p0))
    update, apply = jax.jit(tx.update), jax.jit(optax.apply_updates)
    for ids_t, values in batches[:30]:
        g = jnp.zeros((ROWS, WIDTH), jnp.float32).at[jnp.where(ids_t < 0, ROWS, ids_t)].add(values, mode="drop")
        u, dense_state = update(g, dense_state, dense_p)
        dense_p = apply(dense_p, u)
        u, their_state = jax.jit(theirs.update)(g, their_state, q)
        q = apply(q, u)
    np.testing.assert_array_equal(dense_p, q)
    np.testing.assert_array_equal(dense_state.nu_max, their_state[0].nu_max)


def test_catch_up_refusals_name_the_fix() -> None:
    with pytest.raises(TypeError, match="list b1 in static_args"):
        tx = optax.inject_hyperparams(osa.sparse_amsgrad)(learning_rate=0.1, catch_up=True)
        tx.init(jnp.zeros((3, 2)))
    tx = optax.inject_hyperparams(osa.sparse_amsgrad, static_args=("b1", "catch_up"))(learning_rate=0.1, catch_up=True)
    p = jnp.ones((3, 2), jnp.float32)
    g = osa.IndexedRows(jnp.array([0]), jnp.ones((1, 2), jnp.float32), 3)
    np.testing.assert_allclose(osa.update_and_apply(tx, g, tx.init(p), p)[0][0], 0.9, rtol=1e-6)
    with pytest.raises(ValueError, match="call update\\(grads, state, params\\)"):
        osa.sparse_amsgrad(0.1, catch_up=True).update(g, osa.sparse_amsgrad(0.1, catch_up=True).init(p))


@needs_kernels
@pytest.mark.parametrize("door", ["update_and_apply", "two calls"])
def test_the_fused_catch_up_step_with_an_injected_b2_equals_the_xla_path(door: str) -> None:
    """With ``b2`` injected (a traced value, so no table of its powers), the kernel takes ``b2**idle`` per key from
    the XLA side, the rest from its tables: moments and last steps bitwise the XLA path's, parameters within the
    fused test's bound, for rows idle within the window and past it."""
    tx = optax.inject_hyperparams(osa.sparse_amsgrad, static_args=("b1", "catch_up"))(
        learning_rate=1e-2, b2=0.99, catch_up=True
    )
    rows, width, k = 150, 8, 40
    rng = np.random.default_rng(5)
    p = jnp.asarray(rng.normal(size=(rows, width)).astype(np.float32))
    cap = idle_cap(0.9)
    v = (1e-2 * rng.random((rows, width))).astype(np.float32) ** 2
    state = tx.init(p)
    inner = state.inner_state._replace(
        count=jnp.int32(cap + 100),
        mu=jnp.asarray((np.sqrt(v) * rng.uniform(-0.5, 0.5, v.shape)).astype(np.float32)),
        nu=jnp.asarray(v),
        nu_max=jnp.asarray(v * (1 + rng.random(v.shape)).astype(np.float32)),
        last_step=jnp.asarray(rng.integers(1, cap + 100, rows).astype(np.int32)),
    )
    state = state._replace(inner_state=inner)

    def step(p: jax.Array, s: Any, ids: jax.Array, values: jax.Array) -> Any:
        if door == "two calls":
            updates, s = tx.update(osa.IndexedRows(ids, values, rows), s, p)
            return osa.apply_updates(p, updates), s
        return osa.update_and_apply(tx, osa.IndexedRows(ids, values, rows), s, p)

    native, xla = jax.jit(step), jax.jit(osa.use_kernels(False)(step))
    text = native.lower(p, state, jnp.zeros(k, jnp.int32), jnp.zeros((k, width), jnp.float32)).as_text()
    kernel = "catch_up_amsgrad_rows" if door == "two calls" else "catch_up_amsgrad_apply"
    assert text.count(PREFIX + kernel) == 1
    idle = []
    for _ in range(30):
        ids = np.where(rng.random(k) < 0.1, -1, (rng.zipf(1.3, k) - 1) % rows)
        args = (jnp.asarray(ids.astype(np.int32)), jnp.asarray(rng.normal(size=(k, width)).astype(np.float32)))
        inner = state.inner_state
        idle.extend(np.asarray(inner.count - inner.last_step[ids[ids >= 0]]).tolist())
        p, state = _kernel_step_equals_xla(native, xla, p, state, args)
    assert any(0 < i <= cap for i in idle) and max(idle) > cap, sorted(set(idle))
