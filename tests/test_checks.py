"""Argument checks (``_checks.py``, and the tree checks of ``_tree.py``): bad input raises a clear error naming the
parameter's path, at trace time, before anything runs (donated buffers stay alive)."""

from __future__ import annotations

import functools
import math
import re

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


_INJECTED = {
    "sparse_adam": osa.sparse_adam,
    "sparse_adamw": osa.sparse_adamw,
    "sparse_amsgrad": osa.sparse_amsgrad,
    "sparse_adam catch_up": functools.partial(osa.sparse_adam, catch_up=True),
    "sparse_rowwise_adagrad": osa.sparse_rowwise_adagrad,
    "sparse_rowwise_adam": osa.sparse_rowwise_adam,
    "sparse_adagrad": osa.sparse_adagrad,
    "sparse_sgd momentum": functools.partial(osa.sparse_sgd, momentum=0.9),
}


@pytest.mark.parametrize("name", list(_INJECTED))
def test_an_injected_warmup_from_zero_runs_eagerly(name):
    """``optax.inject_hyperparams`` builds the optimizer outside a trace with each schedule value as a concrete
    array (at ``init``, and at each eager step): a warmup from 0 is taken, its first step moving no parameter, as
    ``inject_hyperparams(optax.adam)`` takes it; a number 0 is still refused (as torch's SparseAdam refuses it),
    and so is a negative injected rate, by name."""
    make = _INJECTED[name]
    tx = optax.inject_hyperparams(make)(learning_rate=optax.linear_schedule(0.0, 0.1, 4))
    params = {"w": jnp.ones((5, 2), jnp.float32)}
    g = {"w": osa.IndexedRows(jnp.array([1, 3, 3], jnp.int32), jnp.ones((3, 2), jnp.float32), 5)}
    state = tx.init(params)
    first, state = osa.update_and_apply(tx, g, state, params)
    updates, _ = tx.update(g, tx.init(params), params)
    np.testing.assert_array_equal(first["w"], params["w"])
    np.testing.assert_array_equal(osa.apply_updates(params, updates)["w"], params["w"])
    second, state = osa.update_and_apply(tx, g, state, first)
    assert not np.array_equal(second["w"], first["w"])
    with pytest.raises(ValueError, match=re.escape("Invalid learning_rate: 0.0;")):
        make(0.0)
    with pytest.raises(ValueError, match=r"Invalid learning_rate: Array\(-0.1.*it must be finite and >= 0"):
        optax.inject_hyperparams(make)(learning_rate=-0.1).init(params)


N, D = 10, 3


def _emb_params():
    return {"emb": jnp.arange(N * D, dtype=jnp.float32).reshape(N, D) / 10 - 1, "w": jnp.ones((D,), jnp.float32)}


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
            _grads(table=jsparse.BCOO.fromdense(jnp.ones((6, 3), jnp.float32), n_dense=2)),
            ValueError,
            r"\['enc'\]\['table'\]: a BCOO with n_sparse=0 addresses no rows.*g.todense",
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
    params = jax.tree.map(jnp.copy, PARAMS)
    state = tx.init(params)
    update = jax.jit(tx.update, donate_argnums=(1, 2)) if jit else tx.update
    with pytest.raises(error, match=match):
        update(grads, state, params)
    # Raised while tracing, before anything ran: the donated state and parameters were not consumed.
    assert not any(x.is_deleted() for x in jax.tree.leaves((params, state)))


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


@pytest.mark.parametrize("lazy", [False, True])
def test_integer_dense_gradients_are_refused_with_the_path(lazy):
    tx = osa.sparse_adam(0.1, lazy_dense=lazy)
    params = _emb_params()
    grads = {"emb": jnp.ones((N, D), jnp.int32), "w": jnp.ones((D,), jnp.float32)}
    with pytest.raises(
        TypeError, match=r"\['emb'\]: the gradient has dtype int32; this optimizer needs floating-point"
    ):
        tx.update(grads, tx.init(params), params)


def test_tree_mismatch_names_the_first_differing_path_without_printing_arrays():
    params = {
        f"layers_{i}": {"kernel": jnp.ones((4, 4), jnp.float32), "bias": jnp.ones(4, jnp.float32)} for i in range(9)
    }
    tx = osa.sparse_adam(0.1)
    state = tx.init(params)
    grads = jax.tree.map(jnp.zeros_like, params)
    del grads["layers_7"]["bias"]
    msg = r"differ at \['layers_7'\]\['bias'\]: the optimizer state's mu hold an array of shape \(4,\)"
    with pytest.raises(ValueError, match=msg):
        tx.update(grads, state, params)
    as_list = [jnp.zeros((4, 4), jnp.float32)] * 18
    with pytest.raises(ValueError) as err:
        tx.update(as_list, state, params)
    assert "0. 0." not in str(err.value) and "Array(" not in str(err.value)
    assert "a dict with keys" in str(err.value) and "a list of length 18" in str(err.value)


def test_tree_mismatch_names_a_container_that_looks_like_an_array_by_its_type():
    """A gradient whose leaves are flax's nnx.Param (the model's state, not its pure arrays) beside a state of bare
    arrays: the error names the Param, where both sides read "an array of shape (16,)" before."""
    from flax import nnx

    params = {"hidden": {"bias": jnp.zeros(16, jnp.float32)}}
    tx = osa.sparse_adam(0.1)
    grads = {"hidden": {"bias": nnx.Param(jnp.ones(16, jnp.float32))}}
    msg = (
        r"differ at \['hidden'\]\['bias'\]: the optimizer state's mu hold an array of shape \(16,\) and dtype "
        r"float32 there, the gradient holds a Param of shape \(16,\) and dtype float32"
    )
    with pytest.raises(ValueError, match=msg):
        tx.update(grads, tx.init(params), params)


def test_state_built_for_other_parameters_is_blamed_on_the_state():
    tx = osa.sparse_adam(0.1)
    state = tx.init({"emb": jnp.zeros((10, D), jnp.float32)})
    params = {"emb": jnp.zeros((6, D), jnp.float32)}
    g = {"emb": osa.IndexedRows(jnp.array([1], jnp.int32), jnp.ones((1, D), jnp.float32), 6)}
    with pytest.raises(ValueError, match=r"\['emb'\]: the optimizer state's mu has shape \(10, 3\) but the parameter"):
        tx.update(g, state, params)


_EVERY_OPTIMIZER = {
    "sparse_adam(catch_up=True)": lambda: osa.sparse_adam(0.1, catch_up=True),
    "sparse_adam(catch_up=True), schedule": lambda: osa.sparse_adam(optax.linear_schedule(0.1, 0.01, 9), catch_up=True),
    "sparse_adamw": lambda: osa.sparse_adamw(0.1),
    "sparse_adamw(catch_up=True)": lambda: osa.sparse_adamw(0.1, catch_up=True),
    "sparse_amsgrad": lambda: osa.sparse_amsgrad(0.1),
    "sparse_amsgrad(catch_up=True)": lambda: osa.sparse_amsgrad(0.1, catch_up=True),
    "sparse_rowwise_adam": lambda: osa.sparse_rowwise_adam(0.1),
    "sparse_rowwise_adagrad": lambda: osa.sparse_rowwise_adagrad(0.1),
    "sparse_adagrad": lambda: osa.sparse_adagrad(0.1),
    "sparse_ftrl": lambda: osa.sparse_ftrl(0.1),
    "sparse_sgd(momentum)": lambda: osa.sparse_sgd(0.1, momentum=0.9),
    "sparse_sgd(momentum, catch_up=True)": lambda: osa.sparse_sgd(0.1, momentum=0.9, catch_up=True),
}


@pytest.mark.parametrize("fused", [False, True], ids=["two calls", "fused"])
@pytest.mark.parametrize("name", list(_EVERY_OPTIMIZER))
def test_every_optimizer_refuses_a_state_built_for_another_table(name, fused, kernel_path):
    """A state built for a table of other rows (a checkpoint of a smaller or larger table, restored without its
    shapes checked) is refused through either door, naming the parameter and blaming the state, not the gradient
    (which fits the table): the catch-up optimizers took it, dropping the moments of rows past its end."""
    tx = _EVERY_OPTIMIZER[name]()
    params = {"emb": jnp.zeros((6, D), jnp.float32)}
    g = {"emb": osa.IndexedRows(jnp.array([5, 1], jnp.int32), jnp.ones((2, D), jnp.float32), 6)}

    def step(g, state, params):
        if fused:
            return osa.update_and_apply(tx, g, state, params)
        updates, state = tx.update(g, state, params)
        return osa.apply_updates(params, updates), state

    for rows in (4, 10):
        state = tx.init({"emb": jnp.zeros((rows, D), jnp.float32)})
        with pytest.raises(ValueError, match=rf"\['emb'\]: .*\({rows}[,)].*built for other parameters"):
            jax.jit(step)(g, state, params)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"learning_rate": math.inf}, ValueError, "learning_rate: inf"),
        ({"eps": math.inf}, ValueError, "eps: inf"),
        ({"eps_root": math.inf}, ValueError, "eps_root: inf"),
        ({"b1": "0.9"}, TypeError, "b1: '0.9'; it must be a real number"),
        ({"b1": np.array([0.9, 0.8])}, ValueError, r"b1: an array of shape \(2,\); it must be a scalar"),
        ({"maximize": "no"}, TypeError, "maximize: 'no'; it must be a bool"),
        ({"mu_dtype": "foo"}, TypeError, "mu_dtype: 'foo'"),
        ({"mu_dtype": jnp.int32}, TypeError, "mu_dtype: int32; it must be a floating dtype"),
        ({"lazy_dense": {"emb": "yes"}}, TypeError, r"lazy_dense: 'yes' at \['emb'\]"),
    ],
)
def test_bad_hyperparameters_name_the_argument_at_construction(kwargs, error, match):
    with pytest.raises(error, match=match):
        osa.sparse_adam(**{"learning_rate": 0.1, **kwargs})


def test_lazy_dense_of_the_wrong_structure_fails_at_init_naming_it():
    tx = osa.sparse_adam(0.1, lazy_dense={"emb": True, "other": False})
    with pytest.raises(ValueError, match="lazy_dense must be a bool, or a tree of bools that is a prefix"):
        tx.init(_emb_params())


def test_a_state_of_another_optimizer_is_named():
    tx = osa.sparse_adam(0.1)
    params = _emb_params()
    state = (optax.sgd(0.1).init(params)[0], tx.init(params)[1])
    with pytest.raises(TypeError, match=r"the optimizer state is a EmptyState, not the ScaleByAdamState"):
        tx.update(jax.tree.map(jnp.ones_like, params), state, params)


# --------------------------------------------------------------------------- donation: errors come first


def test_an_error_under_donation_leaves_params_and_state_alive():
    tx = osa.sparse_adam(0.1)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return osa.apply_updates(params, updates), state

    params = _emb_params()
    state = tx.init(params)
    row_1 = np.array(params["emb"][1])
    bad = {"emb": osa.IndexedRows(jnp.array([1], jnp.int32), jnp.ones((1, D + 1), jnp.float32), N), "w": None}
    with pytest.raises(ValueError, match=r"\['emb'\].*row shape"):
        step(params, state, bad)
    assert not any(x.is_deleted() for x in jax.tree.leaves((params, state)))
    good = {"emb": osa.IndexedRows(jnp.array([1], jnp.int32), jnp.ones((1, D), jnp.float32), N), "w": None}
    new_params, _ = step(params, state, good)
    assert params["emb"].is_deleted()  # the check above can fail: a good step does consume the buffers
    assert not np.array_equal(new_params["emb"][1], row_1)


# --------------------------------------------------------------------------- one-element hparams, sparse params


@pytest.mark.parametrize("factory", [osa.sparse_adam, osa.sparse_adamw, osa.sparse_rowwise_adagrad])
@pytest.mark.parametrize("shape", [(1,), (1, 1)])
def test_a_one_element_array_learning_rate_is_refused_at_construction(factory, shape):
    """A learning rate of shape (1, 1) used to pass and then crash ``update`` with a JAX-internal error."""
    msg = rf"Invalid learning_rate: an array of shape {re.escape(str(shape))}; it must be a scalar"
    with pytest.raises(ValueError, match=msg):
        factory(np.full(shape, 0.1, np.float32))
    factory(np.float32(0.1))  # 0-d arrays and NumPy scalars are scalars
    factory(jnp.asarray(0.1, jnp.float32))


@pytest.mark.parametrize(
    "table",
    [
        osa.IndexedRows(IDX, ROWS, 6),
        jsparse.BCOO.fromdense(jnp.ones((6, 3), jnp.float32)),
    ],
)
def test_sparse_parameters_are_refused_at_init_naming_the_path(table):
    params = {"enc": {"table": table, "scale": jnp.ones((), jnp.float32)}}
    name = type(table).__name__
    msg = (
        rf"scale_by_sparse_adam: parameter \['enc'\]\['table'\]: the parameter is a sparse {name}; "
        "parameters must be dense"
    )
    with pytest.raises(TypeError, match=msg):
        osa.sparse_adam(0.1).init(params)
    with pytest.raises(TypeError, match="a sparse leaf is a gradient or an update, not a parameter"):
        osa.scale_by_sparse_adam().init(table)
    for tx in (
        osa.sparse_adamw(0.1, catch_up=True),
        osa.sparse_amsgrad(0.1),
        osa.sparse_rowwise_adam(0.1),
        osa.sparse_rowwise_adagrad(0.1),
    ):
        with pytest.raises(TypeError, match=r"parameter \['enc'\]\['table'\]: the parameter is a sparse "):
            tx.init(params)


def test_a_lazy_dense_function_sees_sparse_gradients_as_arrays_without_params():
    """``lazy_dense=fn`` with ``tx.update(grads, state)``: ``fn`` gets each sparse leaf as its dense shape."""
    params = {"emb": jnp.ones((8, 2), jnp.float32), "w": jnp.ones((2,), jnp.float32)}
    tx = osa.sparse_adam(0.1, lazy_dense=lambda p: jax.tree.map(lambda x: x.ndim == 2, p))
    grads = {"emb": osa.IndexedRows(jnp.array([1], jnp.int32), jnp.ones((1, 2), jnp.float32), 8), "w": jnp.ones(2)}
    without, _ = tx.update(grads, tx.init(params))
    with_params, _ = tx.update(grads, tx.init(params), params)
    for a, b in zip(jax.tree.leaves(without), jax.tree.leaves(with_params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
