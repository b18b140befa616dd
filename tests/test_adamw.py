"""``sparse_adamw``: decoupled weight decay on the touched rows, optionally caught up for idle steps (``_adamw.py``)."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import optax_sparse_adam as osa
from tests import variant_checks
from tests.variant_checks import LR, WD

COMPARE_STATE = False
NAMES = ["adamw", "adamw_catch_up"]


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=10, deadline=None)
@given(problem=variant_checks.problems(), seed=st.integers(0, 2**31 - 1))
def test_matches_numpy_reference(name, problem, seed):
    variant_checks.check_matches_reference(name, problem, seed)


EQUIVALENTS = [
    ("adamw", lambda: osa.sparse_adamw(LR, weight_decay=WD), lambda: optax.adamw(LR, weight_decay=WD), 3),
    (
        "adamw_catch_up",
        lambda: osa.sparse_adamw(LR, weight_decay=WD, catch_up=True),
        lambda: optax.adamw(LR, weight_decay=WD),
        3,
    ),
    (
        "adamw_mask",
        lambda: osa.sparse_adamw(LR, weight_decay=WD, mask={"emb": True, "bias": False}),
        lambda: optax.adamw(LR, weight_decay=WD, mask={"emb": True, "bias": False}),
        3,
    ),
    (
        "adamw_catch_up_mask_fn",
        lambda: osa.sparse_adamw(LR, weight_decay=WD, catch_up=True, mask=lambda p: {"emb": False, "bias": True}),
        lambda: optax.adamw(LR, weight_decay=WD, mask=lambda p: {"emb": False, "bias": True}),
        3,
    ),
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


@pytest.mark.parametrize("name", ["adamw_catch_up"])
def test_per_row_state_refuses_element_sparse_gradients_naming_the_path(name):
    variant_checks.check_refuses_element_sparse_gradients(name)


INJECTED = [
    ("adamw", osa.sparse_adamw, {"learning_rate": 0.05, "weight_decay": 0.3, "b1": 0.8}),
    (
        "adamw_catch_up",
        functools.partial(osa.sparse_adamw, catch_up=True),
        {"learning_rate": 0.05, "weight_decay": 0.3},
    ),
]


@pytest.mark.parametrize(("name", "factory", "kwargs"), INJECTED, ids=[i[0] for i in INJECTED])
def test_inject_hyperparams_matches_and_does_not_recompile(name, factory, kwargs):
    variant_checks.check_inject_hyperparams_matches_and_does_not_recompile(factory, kwargs)


@pytest.mark.parametrize("name", NAMES)
def test_extra_args_are_accepted(name):
    variant_checks.check_extra_args_are_accepted(name)


# --------------------------------------------------------------------------- catch-up


def test_catch_up_decays_an_idle_row_by_the_steps_it_missed():
    lr, wd = 0.1, 0.2
    tx = osa.sparse_adamw(lr, weight_decay=wd, catch_up=True)
    p = jnp.ones((3, 2), jnp.float32)
    s = tx.init(p)
    zeros = jnp.zeros((1, 2), jnp.float32)
    for _ in range(4):  # only row 0 moves, with a zero gradient: pure decay
        u, s = tx.update(osa.IndexedRows(jnp.array([0], jnp.int32), zeros, 3), s, p)
        p = osa.apply_updates(p, u)
    np.testing.assert_array_equal(p[1:], 1.0)  # idle rows have not moved yet
    u, s = tx.update(osa.IndexedRows(jnp.array([2], jnp.int32), zeros, 3), s, p)
    p = osa.apply_updates(p, u)
    np.testing.assert_allclose(p[2], (1 - lr * wd) ** 5, rtol=1e-6)  # 4 idle steps + its own
    np.testing.assert_allclose(p[0], (1 - lr * wd) ** 4, rtol=1e-6)
    np.testing.assert_array_equal(p[1], 1.0)
    np.testing.assert_array_equal(s.last_step, [4, 0, 5])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_catch_up_decays_a_low_precision_table_by_the_exact_factor(dtype):
    """A row idle 2,000 steps at lr * wd = 1e-3 decays by 0.999 ** 2000 = 0.1352, not 1 (bf16's 1 - 1e-3)."""
    lr, wd, idle = 0.1, 0.01, 2000
    tx = osa.lazy_decoupled_weight_decay(lr, weight_decay=wd)
    p = jnp.ones((2, 4), dtype)
    state = osa.LazyWeightDecayState(count=jnp.asarray(idle, jnp.int32), last_step=jnp.zeros((2,), jnp.int32))
    u, _ = tx.update(osa.IndexedRows(jnp.array([1], jnp.int32), jnp.zeros((1, 4), dtype), 2), state, p)
    want = (1 - lr * wd) ** (idle + 1)  # the idle steps and its own
    got = np.asarray(osa.apply_updates(p, u).astype(jnp.float32))
    np.testing.assert_allclose(got[1], want, rtol=0, atol=2 * float(jnp.finfo(dtype).eps))  # two roundings of ~1
    np.testing.assert_array_equal(got[0], 1.0)


def test_catch_up_with_a_schedule_decays_each_idle_step_at_its_own_rate():
    schedule = optax.linear_schedule(0.2, 0.1, 10)
    wd = 0.5
    tx = osa.sparse_adamw(schedule, weight_decay=wd, catch_up=True)
    p = jnp.ones((2, 1), jnp.float32)
    s = tx.init(p)
    zeros = jnp.zeros((1, 1), jnp.float32)
    for _ in range(3):
        u, s = tx.update(osa.IndexedRows(jnp.array([0], jnp.int32), zeros, 2), s, p)
        p = osa.apply_updates(p, u)
    u, s = tx.update(osa.IndexedRows(jnp.array([1], jnp.int32), zeros, 2), s, p)
    p = osa.apply_updates(p, u)
    # Row 1, never touched, decays from step 1 on, as in optax.adamw: 3 idle steps at their rates, then its own.
    np.testing.assert_allclose(p[1, 0], np.prod([1 - float(schedule(i)) * wd for i in range(4)]), rtol=1e-6)
    expected0 = np.prod([1 - float(schedule(i)) * wd for i in range(3)])
    np.testing.assert_allclose(p[0, 0], expected0, rtol=1e-6)


def test_without_catch_up_idle_rows_do_not_decay():
    tx = osa.sparse_adamw(0.1, weight_decay=0.5)
    p = jnp.ones((3, 2), jnp.float32)
    s = tx.init(p)
    for _ in range(3):
        u, s = tx.update(osa.IndexedRows(jnp.array([1], jnp.int32), jnp.ones((1, 2), jnp.float32), 3), s, p)
        p = osa.apply_updates(p, u)
    np.testing.assert_array_equal(np.asarray(p)[[0, 2]], 1.0)
    assert np.all(np.asarray(p[1]) < 1.0)


def test_bad_hyperparameters_and_missing_params_raise():
    with pytest.raises(ValueError, match="weight_decay"):
        osa.sparse_adamw(0.1, weight_decay=-1.0)
    p = jnp.ones((3, 2), jnp.float32)
    g = osa.IndexedRows(jnp.array([0]), jnp.ones((1, 2), jnp.float32), 3)
    tx = osa.sparse_adamw(0.1, catch_up=True)
    with pytest.raises(ValueError, match="needs the parameters"):
        tx.update(g, tx.init(p))
    with pytest.raises(ValueError, match="mask"):
        osa.sparse_adamw(0.1, catch_up=True, mask={"x": True}).init({"y": p})


@pytest.mark.parametrize(
    ("build", "product"),
    [
        (lambda: osa.sparse_adamw(1e-2, weight_decay=100.0, catch_up=True), "1"),
        (lambda: osa.sparse_adamw(1e-2, weight_decay=150.0, catch_up=True), "1.5"),
        (lambda: osa.lazy_decoupled_weight_decay(0.1, 10.0), "1"),
        (lambda: osa.lazy_decoupled_weight_decay(0.5, 3.0), "1.5"),
    ],
    ids=["catch_up-1", "catch_up-1.5", "lazy_decay-1", "lazy_decay-1.5"],
)
def test_a_decay_factor_of_zero_or_less_is_refused_where_idle_steps_decay(build, product):
    """Where a row's decay over its idle steps is a power of ``1 - lr * wd`` (catch-up AdamW,
    ``lazy_decoupled_weight_decay``), ``lr * wd >= 1`` is refused at construction, naming both: the power was
    taken through ``log1p(-lr * wd)``, a bare "math domain error" at construction, NaN rows or wrong numbers in the
    step. Without catch-up each touched row decays by one step's factor, as ``optax.adamw``: still taken."""
    with pytest.raises(ValueError, match=rf"learning_rate \* weight_decay is {product} .*must be below 1"):
        build()
    p = jnp.asarray(np.random.default_rng(0).normal(size=(6, 3)), jnp.float32)
    g = jnp.asarray(np.random.default_rng(1).normal(size=(6, 3)), jnp.float32)
    tx, ref = osa.sparse_adamw(1e-2, weight_decay=150.0), optax.adamw(1e-2, weight_decay=150.0)
    got = osa.update_and_apply(tx, osa.IndexedRows(jnp.arange(6), g, 6), tx.init(p), p)[0]
    want = optax.apply_updates(p, ref.update(g, ref.init(p), p)[0])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
