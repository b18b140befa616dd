"""``sparse_adagrad`` (``_adagrad.py``): lazy element-wise Adagrad, equal to ``optax.adagrad`` fed zeros elsewhere.

Dense Adagrad leaves an entry with a zero gradient bitwise as it is (``0 + a`` is ``a``, ``rsqrt(a + eps) * 0`` is
0, and ``p + -0.0`` is ``p``), and the touched entries take optax's own expressions, so the lazy optimizer fed
``IndexedRows`` equals ``optax.adagrad`` fed the dense gradient bitwise, with the update and its application
compiled apart. Two things can round differently, and the tests keep them apart: the order in which duplicate ids
are summed (with gradient values on a grid of 1/64 every sum is exact in float32), and, with the whole step in one
``jit``, XLA:CPU contracting optax's dense ``p + (-lr) u`` into a fused multiply-add, which the sparse scatter-add
does not (one rounding a step, about an ulp of the parameter).
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
from tests.helpers import ON_CPU, assert_trees_equal, jit_once

ROWS, WIDTH, BATCH, STEPS = 500, 4, 64, 300


def _batches(seed: int, dyadic: bool) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Zipf ids (duplicates, some -1 padding), row gradients, and a dense gradient for a bias."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(STEPS):
        ids = ((rng.zipf(1.3, BATCH) - 1) % ROWS).astype(np.int32)
        ids[rng.random(BATCH) < 0.05] = -1
        if dyadic:
            values = (rng.integers(-64, 65, (BATCH, WIDTH)) / 64).astype(np.float32)
        else:
            values = rng.normal(size=(BATCH, WIDTH)).astype(np.float32)
        out.append((ids, values, rng.normal(size=WIDTH).astype(np.float32)))
    return out


def _params() -> dict[str, jax.Array]:
    rng = np.random.default_rng(3)
    return {
        "emb": jnp.asarray(rng.normal(size=(ROWS, WIDTH)), jnp.float32),
        "w": jnp.asarray(rng.normal(size=WIDTH), jnp.float32),
    }


def _dense(ids: np.ndarray, values: np.ndarray) -> np.ndarray:
    g = np.zeros((ROWS, WIDTH), np.float32)
    np.add.at(g, ids[ids >= 0], values[ids >= 0])
    return g


def _run(tx: optax.GradientTransformation, batches: list, sparse: bool, one_jit: bool = False) -> tuple[Any, Any]:
    """Trains with ``tx``: the update and its application compiled apart, or with ``one_jit`` in one step."""
    params = _params()
    state = tx.init(params)
    apply = osa.apply_updates if sparse else optax.apply_updates

    def update(params: Any, state: Any, emb: Any, w: jax.Array) -> tuple[Any, Any]:
        return tx.update({"emb": emb, "w": w}, state, params)

    def step(params: Any, state: Any, emb: Any, w: jax.Array) -> tuple[Any, Any]:
        updates, state = update(params, state, emb, w)
        return apply(params, updates), state

    if one_jit:
        step = jit_once(step)
    else:
        update, apply = jit_once(update), jit_once(apply)
    for ids, values, w in batches:
        emb = (
            osa.IndexedRows(jnp.asarray(ids), jnp.asarray(values), ROWS) if sparse else jnp.asarray(_dense(ids, values))
        )
        params, state = step(params, state, emb, jnp.asarray(w))
    return params, state


LR = optax.warmup_cosine_decay_schedule(0.0, 0.05, 30, STEPS, 0.005)


@pytest.mark.parametrize("learning_rate", [0.05, LR], ids=["constant", "schedule"])
def test_equals_optax_adagrad_fed_zeros_elsewhere_bitwise(learning_rate):
    """300 Zipf steps, duplicates and padding: on the XLA path parameters, accumulators and the dense leaf bitwise
    optax's; on the native kernels the accumulators bitwise and the parameters within the rounding of rsqrt."""
    batches = _batches(seed=0, dyadic=True)
    with osa.use_kernels(False):
        ours = _run(osa.sparse_adagrad(learning_rate), batches, sparse=True)
    theirs = _run(optax.adagrad(learning_rate), batches, sparse=False)
    assert_trees_equal(ours, theirs)
    native = _run(osa.sparse_adagrad(learning_rate), batches, sparse=True)
    assert_trees_equal(native[1], theirs[1])
    # The kernels take 1 / sqrt where XLA:CPU takes its rsqrt estimate (tests/test_elementwise_kernels.py): each
    # step's update within a few ulps of itself, far below an ulp of the parameters (|p| about 1).
    assert_trees_equal(native[0], theirs[0], atol=2e-6)
    touched = np.zeros(ROWS, bool)
    for ids, _, _ in batches:
        touched[ids[ids >= 0]] = True
    assert 0 < touched.sum() < ROWS  # rows both touched and never touched, so laziness is exercised
    np.testing.assert_array_equal(np.asarray(ours[0]["emb"])[~touched], np.asarray(_params()["emb"])[~touched])


def test_equals_optax_adagrad_to_rounding_in_one_jitted_step():
    """Gaussian values, each training step one jit: float32 optax's multiply-add, within an ulp of the parameter."""
    batches = _batches(seed=1, dyadic=False)
    ours = _run(osa.sparse_adagrad(0.05), batches, sparse=True, one_jit=True)
    theirs = _run(optax.adagrad(0.05), batches, sparse=False, one_jit=True)
    # The accumulators: on a GPU a duplicate id's summed gradient can differ by an ulp (helpers.ON_CPU), and
    # its square then by two (seen: one ulp, 1.9e-7 relative, on an H100).
    assert_trees_equal(ours[1], theirs[1], rtol=1e-7 if ON_CPU else 4e-7)
    assert_trees_equal(ours[0], theirs[0], rtol=1e-6, atol=5e-7)  # measured: 2.4e-7 at most, |p| up to 4


def test_dense_gradients_are_optax_adagrad_bitwise():
    batches = _batches(seed=2, dyadic=False)[:50]
    assert_trees_equal(
        _run(osa.sparse_adagrad(0.05), batches, sparse=False), _run(optax.adagrad(0.05), batches, sparse=False)
    )


def test_zero_gradient_step_leaves_every_entry_bitwise_unchanged():
    """The premise of the exactness: a dense Adagrad step with a zero gradient is the identity, -0.0 and 0.0 too."""
    params = jnp.array([[0.0, -0.0], [1.5, -2.0]], jnp.float32)
    tx = optax.adagrad(0.1)
    state = tx.init(params)
    _, state = tx.update(jnp.ones_like(params), state, params)
    updates, new_state = tx.update(jnp.zeros_like(params), state, params)
    assert optax.apply_updates(params, updates).tobytes() == params.tobytes()
    assert_trees_equal(new_state, state)


def test_element_sparse_bcoo_and_chains():
    """An element-sparse BCOO works (per-entry state), and it chains with sparse_aware clipping."""
    params = jnp.ones((4, 3), jnp.float32)
    g = jsparse.BCOO((jnp.array([3.0, 4.0], jnp.float32), jnp.array([[0, 1], [2, 2]], jnp.int32)), shape=(4, 3))
    tx = optax.chain(osa.sparse_aware(optax.clip_by_global_norm(1.0)), osa.sparse_adagrad(0.1))
    updates, state = tx.update(g, tx.init(params), params)
    dense = optax.chain(optax.clip_by_global_norm(1.0), optax.adagrad(0.1))
    want, want_state = dense.update(g.todense(), dense.init(params), params)
    np.testing.assert_allclose(updates.todense(), want, rtol=1e-6)
    assert_trees_equal(state[1], want_state[1], rtol=1e-6)


def test_inject_hyperparams_and_checkpoint_pytree():
    tx = optax.inject_hyperparams(osa.sparse_adagrad)(learning_rate=0.05, eps=1e-6)
    params = _params()
    state = tx.init(params)
    g = {"emb": osa.IndexedRows(jnp.array([1, 1, 7], jnp.int32), jnp.ones((3, WIDTH), jnp.float32), ROWS), "w": None}
    updates, state = jax.jit(tx.update)(g, state, params)
    plain = osa.sparse_adagrad(0.05, eps=1e-6)
    want, _ = plain.update(g, plain.init(params), params)
    np.testing.assert_allclose(updates["emb"].todense(), want["emb"].todense(), rtol=1e-6)
    leaves, treedef = jax.tree.flatten(state)
    assert_trees_equal(jax.tree.unflatten(treedef, [np.asarray(x) for x in leaves]), jax.device_get(state))
    assert jax.tree.structure(osa.sparse_adagrad(0.1).init(params)) == jax.tree.structure(
        optax.adagrad(0.1).init(params)
    )


def test_errors_name_the_parameter_and_the_argument():
    tx = osa.sparse_adagrad(0.1)
    params = {"a": {"emb": jnp.ones((4, 3), jnp.float32)}}
    state = tx.init(params)
    with pytest.raises(ValueError, match=r"parameter \['a'\]\['emb'\]: gradient shape \(4, 2\)"):
        tx.update({"a": {"emb": jnp.ones((4, 2), jnp.float32)}}, state, params)
    with pytest.raises(ValueError, match=r"parameter \['a'\]\['emb'\].*5 rows"):
        tx.update({"a": {"emb": osa.IndexedRows(jnp.array([0]), jnp.ones((1, 3), jnp.float32), 5)}}, state, params)
    with pytest.raises(TypeError, match="not the ScaleByRssState"):
        tx.update({"a": {"emb": jnp.ones((4, 3), jnp.float32)}}, (optax.EmptyState(), state[1]), params)
    with pytest.raises(ValueError, match="initial_accumulator_value"):
        osa.sparse_adagrad(0.1, initial_accumulator_value=-1.0)
    with pytest.raises(ValueError, match="learning_rate"):
        osa.sparse_adagrad(0.0)
    tx.update({"a": {"emb": None}}, state, params, unknown_extra_arg=1)
