"""``sparse_rowwise_adam`` and ``sparse_rowwise_adagrad``: one second moment per row (``_rowwise.py``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import optax_sparse_adam as osa
from tests import variant_checks
from tests.variant_checks import LR

COMPARE_STATE = False
NAMES = ["rowwise_adam", "rowwise_adam_per_row", "rowwise_adagrad", "rowwise_adagrad_decoupled"]


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=10, deadline=None)
@given(problem=variant_checks.problems(), seed=st.integers(0, 2**31 - 1))
def test_matches_numpy_reference(name, problem, seed):
    variant_checks.check_matches_reference(name, problem, seed)


EQUIVALENTS = [
    ("rowwise_adam_width_1", lambda: osa.sparse_rowwise_adam(LR), lambda: optax.adam(LR), 1),
    (
        "rowwise_adam_per_row_width_1",
        lambda: osa.sparse_rowwise_adam(LR, per_row_bias_correction=True),
        lambda: optax.adam(LR),
        1,
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


@pytest.mark.parametrize("name", ["rowwise_adam", "rowwise_adagrad"])
def test_per_row_state_refuses_element_sparse_gradients_naming_the_path(name):
    variant_checks.check_refuses_element_sparse_gradients(name)


INJECTED = [
    ("rowwise_adam", osa.sparse_rowwise_adam, {"learning_rate": 0.05, "b1": 0.8, "eps": 1e-6}),
    ("rowwise_adagrad", osa.sparse_rowwise_adagrad, {"learning_rate": 0.05, "weight_decay": 0.3}),
]


@pytest.mark.parametrize(("name", "factory", "kwargs"), INJECTED, ids=[i[0] for i in INJECTED])
def test_inject_hyperparams_matches_and_does_not_recompile(name, factory, kwargs):
    variant_checks.check_inject_hyperparams_matches_and_does_not_recompile(factory, kwargs)


@pytest.mark.parametrize("name", NAMES)
def test_extra_args_are_accepted(name):
    variant_checks.check_extra_args_are_accepted(name)


# --------------------------------------------------------------------------- bias correction, state layout


def test_per_row_bias_correction_corrects_a_late_row_fully():
    """A row first seen at step 10 gets a full-size first step (|u| = 1) only with per-row correction."""
    out = {}
    for per_row in (False, True):
        tx = osa.scale_by_rowwise_adam(per_row_bias_correction=per_row)
        s = tx.init(jnp.zeros((2, 3), jnp.float32))
        for step in range(10):
            g = osa.IndexedRows(jnp.array([0 if step < 9 else 1], jnp.int32), jnp.ones((1, 3), jnp.float32), 2)
            u, s = tx.update(g, s)
        out[per_row] = np.asarray(u.todense())[1]
        if per_row:
            np.testing.assert_array_equal(s.row_count, [9, 1])
    np.testing.assert_allclose(out[True], 1.0, rtol=2e-5)
    b1, b2, t = 0.9, 0.999, 10
    global_corrected = ((1 - b1) / (1 - b1**t)) / np.sqrt((1 - b2) / (1 - b2**t))
    np.testing.assert_allclose(out[False], global_corrected, rtol=1e-5)


def test_rowwise_state_layout_and_dtypes():
    params = {
        "emb": jnp.zeros((5, 4), jnp.bfloat16),
        "w": jnp.zeros((3,), jnp.float32),
        "s": jnp.zeros((), jnp.float32),
    }
    state = osa.scale_by_rowwise_adam(mu_dtype=jnp.float32, per_row_bias_correction=True).init(params)
    assert jax.tree.map(lambda x: (x.shape, x.dtype), state.nu) == {
        "emb": ((5,), jnp.float32),
        "w": ((3,), jnp.float32),
        "s": ((), jnp.float32),
    }
    assert state.mu["emb"].dtype == jnp.float32 and state.mu["emb"].shape == (5, 4)
    assert state.row_count["emb"].dtype == jnp.int32 and state.row_count["emb"].shape == (5,)
    assert osa.scale_by_rowwise_adam().init(params).row_count == optax.EmptyState()
    acc = osa.scale_by_rowwise_adagrad(initial_accumulator_value=0.1).init(params).sum_of_squares
    np.testing.assert_array_equal(acc["emb"], np.full(5, 0.1, np.float32))
    g = {"emb": osa.IndexedRows(jnp.array([1], jnp.int32), jnp.ones((1, 4), jnp.bfloat16), 5), "w": None, "s": None}
    u, _ = osa.scale_by_rowwise_adam().update(g, osa.scale_by_rowwise_adam().init(params))
    # A bfloat16 gradient is widened to the float32 state first: summed, computed and returned in float32, as
    # optax.adam with a float32 mu returns float32 updates.
    assert u["emb"].values.dtype == jnp.float32


def test_bad_hyperparameters_and_missing_params_raise():
    with pytest.raises(ValueError, match="weight_decay_mode"):
        osa.sparse_rowwise_adagrad(0.1, weight_decay_mode="l1")
    with pytest.raises(TypeError, match="per_row_bias_correction"):
        osa.sparse_rowwise_adam(0.1, per_row_bias_correction=1)
    with pytest.raises(TypeError, match="mu_dtype"):
        osa.sparse_rowwise_adam(0.1, mu_dtype=jnp.int32)
    p = jnp.ones((3, 2), jnp.float32)
    g = osa.IndexedRows(jnp.array([0]), jnp.ones((1, 2), jnp.float32), 3)
    tx = osa.sparse_rowwise_adagrad(0.1, weight_decay=0.1)
    with pytest.raises(ValueError, match="needs the parameters"):
        tx.update(g, tx.init(p))
