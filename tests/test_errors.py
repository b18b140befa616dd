"""Bad input: a clear error naming the parameter's path, and nothing half-updated."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.experimental import sparse as jsparse

import optax_sparse_adam as osa


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"learning_rate": 0.0}, "learning_rate: 0.0"),
        ({"learning_rate": -1e-3}, "learning_rate: -0.001"),
        ({"learning_rate": math.nan}, "learning_rate: nan"),
        ({"eps": 0.0}, "eps: 0.0"),
        ({"eps": math.nan}, "eps: nan"),
        ({"b1": 1.0}, r"b1: 1.0; it must be in \[0, 1\)"),
        ({"b1": -0.1}, "b1: -0.1"),
        ({"b2": 1.5}, "b2: 1.5"),
        ({"b2": math.nan}, "b2: nan"),
        ({"eps_root": -1.0}, "eps_root: -1.0"),
        ({"eps_placement": "pytorch"}, "eps_placement: 'pytorch'"),
    ],
)
def test_bad_hyperparameters_raise_at_construction(kwargs, match):
    kwargs = {"learning_rate": 1e-3, **kwargs}
    with pytest.raises(ValueError, match=match):
        osa.sparse_adam(**kwargs)


def test_schedules_and_injected_hyperparameters_are_not_checked():
    osa.sparse_adam(optax.linear_schedule(0.0, 1e-3, 10))  # a schedule may start at 0
    tx = optax.inject_hyperparams(osa.sparse_adam)(learning_rate=1e-3)
    state = tx.init({"w": jnp.zeros(2, jnp.float32)})
    state.hyperparams["learning_rate"] = jnp.asarray(0.5, jnp.float32)
    jax.jit(tx.update)({"w": jnp.ones(2, jnp.float32)}, state)


PARAMS = {"enc": {"table": jnp.zeros((6, 3), jnp.float32), "scale": jnp.ones((), jnp.float32)}}
ROWS = jnp.ones((2, 3), jnp.float32)
IDX = jnp.array([0, 1], jnp.int32)


def _grads(table=None, scale=None):
    return {
        "enc": {
            "table": table if table is not None else jnp.zeros((6, 3), jnp.float32),
            "scale": scale if scale is not None else jnp.ones((), jnp.float32),
        }
    }


@pytest.mark.parametrize(
    ("grads", "error", "match"),
    [
        (
            {"enc": {"table": jnp.zeros((6, 3), jnp.float32)}},
            ValueError,
            r"differ at \['enc'\]\['scale'\]: the optimizer state's mu hold an array of shape \(\) and dtype "
            r"float32 there, the gradient holds nothing",
        ),
        (
            {
                "enc": {
                    "table": jnp.zeros((6, 3), jnp.float32),
                    "scale": jnp.ones((), jnp.float32),
                    "extra": jnp.ones((), jnp.float32),
                }
            },
            ValueError,
            r"differ at \['enc'\]\['extra'\]: the optimizer state's mu hold nothing there, the gradient holds an "
            r"array",
        ),
        (_grads(table=jnp.zeros((5, 3), jnp.float32)), ValueError, r"\['enc'\]\['table'\].*shape \(5, 3\)"),
        (
            _grads(table=osa.IndexedRows(IDX.astype(jnp.float32), ROWS, 6)),
            TypeError,
            r"\['enc'\]\['table'\].*must be integers",
        ),
        (_grads(table=osa.IndexedRows(IDX[:, None], ROWS, 6)), ValueError, r"\['enc'\]\['table'\].*must be 1-D"),
        (
            _grads(table=osa.IndexedRows(IDX, jnp.ones((3, 3), jnp.float32), 6)),
            ValueError,
            r"\['enc'\]\['table'\].*2 indices but values of shape \(3, 3\)",
        ),
        (
            _grads(table=osa.IndexedRows(IDX, ROWS, 7)),
            ValueError,
            r"\['enc'\]\['table'\]: the gradient is an IndexedRows for 7 rows but the parameter has 6",
        ),
        (
            _grads(table=osa.IndexedRows(IDX, jnp.ones((2, 4), jnp.float32), 6)),
            ValueError,
            r"\['enc'\]\['table'\].*row shape \(4,\)",
        ),
        (
            _grads(table=osa.IndexedRows(IDX, jnp.ones((2, 3), jnp.int32), 6)),
            TypeError,
            r"\['enc'\]\['table'\].*floating point",
        ),
        (
            _grads(table=jsparse.BCOO.fromdense(jnp.ones((2, 6, 3), jnp.float32), n_batch=1)),
            ValueError,
            r"\['enc'\]\['table'\].*batch dimensions",
        ),
        (
            _grads(table=jsparse.BCOO.fromdense(jnp.ones((6, 4), jnp.float32))),
            ValueError,
            r"\['enc'\]\['table'\].*BCOO shape \(6, 4\)",
        ),
        (
            _grads(scale=osa.IndexedRows(IDX, jnp.ones((2,), jnp.float32), 1)),
            ValueError,
            r"\['enc'\]\['scale'\].*0-d parameter",
        ),
    ],
)
@pytest.mark.parametrize("jit", [False, True])
def test_bad_gradients_name_the_parameter(grads, error, match, jit):
    tx = osa.sparse_adam(0.1)
    state = tx.init(PARAMS)
    snapshot = jax.tree.map(np.array, (PARAMS, state))
    update = jax.jit(tx.update) if jit else tx.update
    with pytest.raises(error, match=match):
        update(grads, state, PARAMS)
    jax.tree.map(np.testing.assert_array_equal, (PARAMS, state), snapshot)  # nothing touched


def test_apply_updates_checks_sparse_leaves_and_shapes():
    with pytest.raises(ValueError, match=r"\['enc'\]\['table'\].*IndexedRows for 9 rows"):
        osa.apply_updates(PARAMS, _grads(table=osa.IndexedRows(IDX, ROWS, 9)))
    with pytest.raises(ValueError, match=r"\['enc'\]\['table'\].*update shape \(6, 4\)"):
        osa.apply_updates(PARAMS, _grads(table=jnp.zeros((6, 4), jnp.float32)))
    with pytest.raises(ValueError, match=r"differ at \['enc'\]\['scale'\]: the parameters hold an array"):
        osa.apply_updates(PARAMS, {"enc": {"table": ROWS}})


def test_lazy_dense_must_be_bools():
    with pytest.raises(TypeError, match=r"Invalid lazy_dense: .* at \['enc'\]\['table'\]"):
        osa.sparse_adam(0.1, lazy_dense={"enc": {"table": jnp.array(True), "scale": False}})
    tx = osa.sparse_adam(0.1, lazy_dense=lambda p: {"enc": {"table": jnp.array(True), "scale": False}})
    with pytest.raises(TypeError, match=r"\['enc'\]\['table'\].*lazy_dense"):
        tx.init(PARAMS)
