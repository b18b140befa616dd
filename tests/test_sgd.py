"""``sparse_sgd`` (``_sgd.py``): lazy SGD, lazy momentum, and momentum caught up to ``optax.sgd``.

The reference is dense SGD with momentum (``optax.trace``'s rule) in float64 NumPy fed the same gradients, zeros
elsewhere. Float32 ``optax.sgd`` drifts from it too (it rounds every row at every step, idle or not), so the
caught-up optimizer must stay within twice that drift, where lazy momentum is off by orders of magnitude.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.experimental import sparse as jsparse

import optax_sparse_adam as osa
from tests.helpers import assert_trees_equal, jit_once

ROWS, WIDTH, BATCH, STEPS = 400, 4, 32, 300
F = np.float32
SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 0.02, 40, STEPS, 0.002)


def _batches(seed: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Zipf ids with duplicates and some -1 padding, their row gradients, a dense gradient for ``w``; and a last
    step that touches every row with a zero gradient, so that every row ends caught up."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(STEPS):
        ids = ((rng.zipf(1.2, BATCH) - 1) % ROWS).astype(np.int32)
        ids[rng.random(BATCH) < 0.05] = -1
        out.append((ids, rng.normal(size=(BATCH, WIDTH)).astype(F), rng.normal(size=WIDTH).astype(F)))
    out.append((np.arange(ROWS, dtype=np.int32), np.zeros((ROWS, WIDTH), F), np.zeros(WIDTH, F)))
    return out


EMB0 = np.random.default_rng(8).normal(size=(ROWS, WIDTH)).astype(F)
W0 = np.random.default_rng(9).normal(size=WIDTH).astype(F)


def _dense_grad(ids: np.ndarray, values: np.ndarray, dtype: Any = F) -> np.ndarray:
    g = np.zeros((ROWS, WIDTH), dtype)
    np.add.at(g, ids[ids >= 0], values[ids >= 0].astype(dtype))
    return g


def _sgd64(batches: list, lr: Any, momentum: float, nesterov: bool) -> dict[str, np.ndarray]:
    """Dense SGD with momentum in float64: ``m = g + mu m``, ``p -= lr(t) (m or g + mu m)``."""
    p, m = EMB0.astype(np.float64), np.zeros((ROWS, WIDTH))
    rates = np.asarray(jax.vmap(lr)(jnp.arange(len(batches)))) if callable(lr) else np.full(len(batches), lr)
    for t, (ids, values, _) in enumerate(batches):
        g = _dense_grad(ids, values, np.float64)
        m = g + momentum * m
        a = float(rates[t])
        p = p - a * (g + momentum * m if nesterov else m)
    return {"p": p, "m": m}


def _train(tx: optax.GradientTransformation, batches: list, sparse: bool) -> tuple[dict[str, np.ndarray], Any, Any]:
    """The whole run in one jit: a scan over the Zipf batches, then the last step, which touches every row."""
    params = {"emb": jnp.asarray(EMB0), "w": jnp.asarray(W0)}
    *zipf, last = batches
    ids, values, ws = (jnp.asarray(np.stack(x)) for x in zip(*zipf, strict=True))

    def step(carry: Any, batch: Any) -> tuple[Any, None]:
        params, state = carry
        ids, values, w = batch
        if sparse:
            emb: Any = osa.IndexedRows(ids, values, ROWS)
        else:
            rows = jnp.where(ids < 0, ROWS, ids)  # padding dropped, as np.add.at over ids >= 0
            emb = jnp.zeros((ROWS, WIDTH), jnp.float32).at[rows].add(values, mode="drop")
        updates, state = tx.update({"emb": emb, "w": w}, state, params)
        return (osa.apply_updates(params, updates), state), None

    @jit_once
    def run(params: Any, ids: jax.Array, values: jax.Array, ws: jax.Array) -> tuple[Any, Any]:
        carry, _ = jax.lax.scan(step, (params, tx.init(params)), (ids, values, ws))
        return step(carry, tuple(jnp.asarray(x) for x in last))[0]

    params, state = run(params, ids, values, ws)
    trace = optax.tree.get(state, "trace")  # of CatchUpSgdState, TraceState, or either inside inject_hyperparams
    return {"p": np.asarray(params["emb"]), "m": np.asarray(trace["emb"])}, params["w"], trace["w"]


def _error(run: dict[str, np.ndarray], ref: dict[str, np.ndarray]) -> dict[str, float]:
    return {k: float(np.max(np.abs(run[k] - ref[k])) / np.max(np.abs(ref[k]))) for k in ref}


CASES = {
    "mu=0.9": (0.05, 0.9, False),
    "mu=0.9 schedule": (SCHEDULE, 0.9, False),
    "mu=0.9 nesterov schedule": (SCHEDULE, 0.9, True),
    "mu=0.99 nesterov": (0.005, 0.99, True),
}


@pytest.mark.parametrize("case", CASES)
def test_catch_up_equals_dense_sgd_over_a_zipf_run(case: str) -> None:
    lr, momentum, nesterov = CASES[case]
    batches = _batches(seed=len(case))
    ref = _sgd64(batches, lr, momentum, nesterov)
    optax32, optax_w, optax_trace_w = _train(optax.sgd(lr, momentum, nesterov), batches, sparse=False)
    caught, w, trace_w = _train(osa.sparse_sgd(lr, momentum, nesterov, catch_up=True), batches, sparse=True)
    drift, err = _error(optax32, ref), _error(caught, ref)
    for k in ("p", "m"):
        assert err[k] <= 2 * drift[k] + 1e-7, (k, err, drift)
    if not nesterov:  # lazy momentum, for contrast (twice suffices)
        lazy_err = _error(_train(osa.sparse_sgd(lr, momentum, nesterov), batches, sparse=True)[0], ref)
        for k in ("p", "m"):
            assert lazy_err[k] > 100 * max(drift[k], 1e-7), (k, lazy_err, drift)
    np.testing.assert_allclose(caught["p"], optax32["p"], rtol=0, atol=4 * drift["p"] * np.max(np.abs(ref["p"])))
    # The dense leaf takes optax.sgd's step (bitwise where compiled apart, see below; here one jit, whose fused
    # multiply-adds XLA:CPU chooses per graph).
    np.testing.assert_allclose(w, optax_w, rtol=1e-6)
    np.testing.assert_allclose(trace_w, optax_trace_w, rtol=1e-6)


def test_a_schedule_with_an_injected_momentum_sums_each_rows_idle_steps_over_the_schedule() -> None:
    """With the momentum injected (traced when the step is traced: no window or record is planned) and the schedule
    passed as it is, each row's sum over its idle steps is taken by Horner's rule over the schedule's rates; the run
    stays within twice float32 ``optax.sgd``'s drift from the float64 loop, as the planned sums do."""
    lr, momentum, nesterov = CASES["mu=0.9 nesterov schedule"]
    batches = _batches(seed=21)
    ref = _sgd64(batches, lr, momentum, nesterov)
    drift = _error(_train(optax.sgd(lr, momentum, nesterov), batches, sparse=False)[0], ref)
    inject = optax.inject_hyperparams(osa.sparse_sgd, static_args=("learning_rate", "nesterov", "catch_up"))
    tx = inject(lr, momentum, nesterov, catch_up=True)
    assert tx.init({"emb": jnp.asarray(EMB0)}).inner_state.idle_record.last_steps.shape == (1,)  # none planned
    err = _error(_train(tx, batches, sparse=True)[0], ref)
    for k in ("p", "m"):
        assert err[k] <= 2 * drift[k] + 1e-7, (k, err, drift)


@pytest.mark.parametrize(
    ("momentum", "nesterov", "catch_up"),
    [(None, False, False), (0.9, False, False), (0.9, True, True)],
)
def test_dense_leaves_are_optax_sgd_bitwise(momentum, nesterov, catch_up) -> None:
    """Dense gradients everywhere, the update and its application compiled apart: optax.sgd, bitwise."""
    batches = _batches(seed=3)[:60]
    ours = _train_plain(osa.sparse_sgd(SCHEDULE, momentum, nesterov, catch_up=catch_up), batches, sparse=False)
    theirs = _train_plain(optax.sgd(SCHEDULE, momentum, nesterov), batches, sparse=False)
    np.testing.assert_array_equal(ours[0], theirs[0])
    np.testing.assert_array_equal(ours[1], theirs[1])
    if momentum is not None:
        trace = ours[2].trace if catch_up else ours[2][0].trace
        assert_trees_equal(trace, theirs[2][0].trace)


def test_plain_sgd_is_optax_sgd_fed_zeros_elsewhere() -> None:
    batches = _batches(seed=1)[:100]
    ours, w, _ = _train_plain(osa.sparse_sgd(SCHEDULE), batches, sparse=True)
    theirs, w2, _ = _train_plain(optax.sgd(SCHEDULE), batches, sparse=False)
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=2e-7 * np.max(np.abs(theirs)))
    np.testing.assert_array_equal(w, w2)


def _train_plain(tx: optax.GradientTransformation, batches: list, sparse: bool) -> tuple[np.ndarray, Any, Any]:
    params = {"emb": jnp.asarray(EMB0), "w": jnp.asarray(W0)}
    state = tx.init(params)
    update, apply = jax.jit(tx.update), jax.jit(osa.apply_updates)
    for ids, values, w in batches:
        emb = osa.IndexedRows(jnp.asarray(ids), jnp.asarray(values), ROWS) if sparse else _dense_grad(ids, values)
        updates, state = update({"emb": emb, "w": jnp.asarray(w)}, state, params)
        params = apply(params, updates)
    return np.asarray(params["emb"]), params["w"], state


@pytest.mark.parametrize("nesterov", [False, True])
def test_lazy_momentum_updates_the_touched_rows_only(nesterov: bool) -> None:
    """Lazy momentum: the touched rows take optax.trace's step on their own trace; other rows and traces stay."""
    tx = osa.sparse_sgd(0.1, momentum=0.9, nesterov=nesterov)
    params = jnp.ones((4, 2), jnp.float32)
    state = tx.init(params)
    assert jax.tree.structure(state) == jax.tree.structure(optax.sgd(0.1, 0.9).init(params))
    m = np.zeros((4, 2))
    p = np.ones((4, 2))
    update = jax.jit(tx.update)
    for rows in ([0, 0, 1], [1, -1, 1], [0, 3, 3]):
        g = np.ones((len(rows), 2), F)
        u, state = update(osa.IndexedRows(jnp.asarray(rows, jnp.int32), jnp.asarray(g), 4), state, params)
        params = osa.apply_updates(params, u)
        dense = _dense_grad_small([r for r in rows if r >= 0], g[: sum(r >= 0 for r in rows)])
        touched = sorted({r for r in rows if r >= 0})
        m[touched] = dense[touched] + 0.9 * m[touched]
        p[touched] -= 0.1 * (dense[touched] + 0.9 * m[touched] if nesterov else m[touched])
    np.testing.assert_allclose(params, p, rtol=1e-6)
    np.testing.assert_allclose(state[0].trace, m, rtol=1e-6)
    assert np.asarray(params)[2].tolist() == [1.0, 1.0]


def _dense_grad_small(rows: list[int], g: np.ndarray) -> np.ndarray:
    out = np.zeros((4, 2))
    np.add.at(out, rows, g)
    return out


def test_catch_up_checkpoints_chains_and_injects() -> None:
    tx = osa.sparse_sgd(0.05, momentum=0.9, catch_up=True)
    params = {"emb": jnp.ones((6, 2), jnp.float32)}
    state = tx.init(params)
    assert state.last_step["emb"].dtype == jnp.int32 and state.last_step["emb"].shape == (6,)
    g1 = {"emb": osa.IndexedRows(jnp.array([0, 2], jnp.int32), jnp.ones((2, 2), jnp.float32), 6)}
    g2 = {"emb": osa.IndexedRows(jnp.array([0], jnp.int32), jnp.ones((1, 2), jnp.float32), 6)}
    step = jax.jit(lambda p, s, g: osa.update_and_apply(tx, g, s, p))
    for g in (g1, g2, g2):
        params, state = step(params, state, g)
    leaves, treedef = jax.tree.flatten(state)
    restored = jax.tree.unflatten(treedef, [np.asarray(x) for x in leaves])
    update = jax.jit(tx.update)
    assert_trees_equal(update(g1, restored, params), update(g1, state, params))
    # behind a clipping stage
    chained = optax.chain(osa.sparse_aware(optax.clip_by_global_norm(1.0)), tx)
    u, _ = jax.jit(lambda g, s, p: chained.update(g, s, p, unknown_extra_arg=1))(g1, chained.init(params), params)
    assert isinstance(u["emb"], osa.IndexedRows)
    # inject_hyperparams: the same numbers as the constant
    injected = optax.inject_hyperparams(osa.sparse_sgd, static_args=("catch_up",))(0.05, 0.9, catch_up=True)
    p1, s1 = {"emb": jnp.ones((6, 2), jnp.float32)}, injected.init({"emb": jnp.ones((6, 2), jnp.float32)})
    p2, s2 = {"emb": jnp.ones((6, 2), jnp.float32)}, tx.init(p1)
    injected_step = jax.jit(lambda p, s, g: osa.update_and_apply(injected, g, s, p))
    for g in (g1, g2, g2, g1):
        p1, s1 = injected_step(p1, s1, g)
        p2, s2 = step(p2, s2, g)
    np.testing.assert_allclose(p1["emb"], p2["emb"], rtol=1e-6)


@pytest.mark.parametrize("nesterov", [False, True])
def test_catch_up_and_caught_up_lookups_bring_rows_to_dense_sgd(nesterov: bool) -> None:
    """``osa.catch_up`` brings every row where dense SGD has it (within twice float32 optax.sgd's drift from a
    float64 loop), and ``value_and_row_grad(catch_up=tx)`` hands the loss those rows; the stored rows lag."""
    *zipf, _ = _batches(seed=11)
    ref = _sgd64(zipf, SCHEDULE, 0.9, nesterov)
    tx, theirs = osa.sparse_sgd(SCHEDULE, 0.9, nesterov, catch_up=True), optax.sgd(SCHEDULE, 0.9, nesterov)
    p, q = jnp.asarray(EMB0), jnp.asarray(EMB0)
    state, their_state = tx.init(p), theirs.init(q)

    @jax.jit
    def steps(p: Any, state: Any, q: Any, their_state: Any, ids: jax.Array, values: jax.Array) -> Any:
        p, state = osa.update_and_apply(tx, osa.IndexedRows(ids, values, ROWS), state, p)
        dense = jnp.zeros((ROWS, WIDTH), jnp.float32).at[jnp.where(ids < 0, ROWS, ids)].add(values, mode="drop")
        u, their_state = theirs.update(dense, their_state, q)
        return p, state, optax.apply_updates(q, u), their_state

    for ids, values, _ in zipf:
        p, state, q, their_state = steps(p, state, q, their_state, jnp.asarray(ids), jnp.asarray(values))

    def error(x: Any) -> float:
        return float(np.max(np.abs(np.asarray(x) - ref["p"])) / np.max(np.abs(ref["p"])))

    def loss(table: jax.Array, ids: jax.Array) -> jax.Array:
        return jnp.sum(table[ids] ** 2)

    everything = jnp.arange(ROWS, dtype=jnp.int32)
    read, _ = osa.value_and_row_grad(loss, lambda t: t, catch_up=tx)(p, everything, opt_state=state)
    caught, caught_state = jax.jit(lambda p, s: osa.catch_up(tx, p, s))(p, state)
    drift = error(q)
    assert error(caught) <= 2 * drift + 1e-7, (error(caught), drift)
    assert error(p) > 100 * max(drift, 1e-7), (error(p), drift)  # the stored rows, before catch_up
    np.testing.assert_allclose(read, np.sum(np.asarray(caught) ** 2), rtol=1e-6)
    np.testing.assert_array_equal(caught_state.last_step[caught_state.last_step > 0], len(zipf))
    np.testing.assert_allclose(caught_state.trace, ref["m"], atol=4 * drift * np.max(np.abs(ref["m"])) + 1e-6)


@pytest.mark.parametrize("door", ["update_and_apply", "two calls"])
def test_a_schedules_idle_sums_come_from_the_window_the_record_and_the_loop(
    door: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under a schedule a returning row's sum over its idle steps, ``sum_k lr(last + k - 1) mu**k``, comes from the
    window of the last ``K = 180`` steps (rows idle at most ``K`` steps), the state's record (idle longer, their
    last step within its reach, cut here to 50 last steps) or a loop over the schedule (beyond it). After a Zipf
    run, one step on rows of each kind and on fresh ones moves every row as a float64 loop of dense SGD over its
    idle steps and the step does, within two ulps and 64 units of ``2**-24`` of the move; with the record's sums
    doubled, exactly the rows within its reach move differently."""
    from optax_sparse_adam import _catch_up, _sgd

    cap, steps, momentum = int(_sgd.idle_cap(0.9)), 50, 0.9
    monkeypatch.setattr(_catch_up, "_RECORD_STEPS", steps)
    tx = osa.sparse_sgd(SCHEDULE, momentum, catch_up=True)
    params, state = jnp.asarray(EMB0), tx.init(jnp.asarray(EMB0))
    step = jax.jit(lambda p, s, ids, v: osa.update_and_apply(tx, osa.IndexedRows(ids, v, ROWS), s, p))
    rng = np.random.default_rng(12)
    for t in range(1, STEPS + 1):  # rows 0-99 all along, 100-199 at steps 1-40, 200-299 at 80-100, 300-399 never
        ids = (rng.zipf(1.2, BATCH) - 1) % 100
        ids[-8:] = rng.integers(100, 200, 8) if t <= 40 else rng.integers(200, 300, 8) if 80 <= t <= 100 else -1
        values = rng.normal(size=(BATCH, WIDTH)).astype(F)
        params, state = step(params, state, jnp.asarray(ids, jnp.int32), jnp.asarray(values))
    last, done = np.asarray(state.last_step), int(state.count)
    idle = done - last
    kinds = [
        (last > 0) & (idle <= cap),
        (last > 0) & (idle > cap) & (idle <= cap + steps),
        (last > 0) & (idle > cap + steps),
        last == 0,
    ]
    picked = [np.flatnonzero(kind)[:5] for kind in kinds]
    assert all(p.size == 5 for p in picked), [p.size for p in picked]
    ids = np.concatenate(picked).astype(np.int32)
    g = np.random.default_rng(5).normal(size=(ids.size, WIDTH)).astype(F)
    grad = osa.IndexedRows(jnp.asarray(ids), jnp.asarray(g), ROWS)

    def run(s: Any) -> np.ndarray:
        if door == "update_and_apply":
            return np.asarray(jax.jit(lambda p, s: osa.update_and_apply(tx, grad, s, p))(params, s)[0])
        updates, _ = jax.jit(tx.update)(grad, s, params)
        return np.asarray(jax.jit(osa.apply_updates)(params, updates))

    rates = np.asarray(jax.vmap(SCHEDULE)(jnp.arange(done + 1)), np.float64)
    p0, m0 = np.asarray(params, np.float64)[ids], np.asarray(state.trace, np.float64)[ids]
    shift = np.array(
        [
            sum(rates[start + k - 1] * momentum**k for k in range(1, n + 1))
            for start, n in zip(last[ids], idle[ids] * (last[ids] > 0), strict=True)
        ]
    )
    m = momentum ** (idle[ids] * (last[ids] > 0))[:, None] * m0
    want = p0 - shift[:, None] * m0 - rates[done] * (g + momentum * m)
    got = run(state)[ids]
    bound = 2 * np.spacing(np.abs(want).astype(F)) + 64 * 2.0**-24 * np.abs(want - p0)
    assert np.all(np.abs(got - want) <= bound), np.max(np.abs(got - want) / bound, axis=1)
    record = state.idle_record
    doubled = run(state._replace(idle_record=record._replace(coefficients=2 * record.coefficients)))[ids]
    moved = np.any(doubled != got, axis=1)
    np.testing.assert_array_equal(moved, np.repeat([False, True, False, False], [p.size for p in picked]))


def test_errors_name_the_parameter_and_the_argument() -> None:
    tx = osa.sparse_sgd(0.1, momentum=0.9, catch_up=True)
    params = {"a": {"emb": jnp.ones((4, 3), jnp.float32)}}
    state = tx.init(params)
    g = {"a": {"emb": osa.IndexedRows(jnp.array([0]), jnp.ones((1, 3), jnp.float32), 4)}}
    with pytest.raises(ValueError, match=r"catching up moves the parameters.*update\(grads, state, params\)"):
        tx.update(g, state)
    with pytest.raises(ValueError, match=r"parameter \['a'\]\['emb'\]: gradient shape \(4, 2\)"):
        tx.update({"a": {"emb": jnp.ones((4, 2), jnp.float32)}}, state, params)
    bcoo = jsparse.BCOO((jnp.ones(1, jnp.float32), jnp.array([[0, 1]], jnp.int32)), shape=(4, 3))
    with pytest.raises(ValueError, match=r"parameter \['a'\]\['emb'\].*n_sparse=2"):
        tx.update({"a": {"emb": bcoo}}, state, params)
    with pytest.raises(TypeError, match="not the CatchUpSgdState"):
        tx.update(g, optax.EmptyState(), params)
    with pytest.raises(ValueError, match="momentum"):
        osa.sparse_sgd(0.1, momentum=1.0, catch_up=True)
    with pytest.raises(ValueError, match="momentum"):
        osa.sparse_sgd(0.1, momentum=-0.1)
    with pytest.raises(TypeError, match="nesterov"):
        osa.sparse_sgd(0.1, momentum=0.9, nesterov=1)
    lazy = osa.sparse_sgd(0.1, momentum=0.9)
    lazy.update(g, lazy.init(params), extra=1)  # lazy momentum needs no parameters
