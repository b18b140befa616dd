"""The optimizer variants: references, jit, errors, checkpoints and inject_hyperparams.

Each variant is checked against :mod:`variants_reference` (its lazy rule in
NumPy, hypothesis-generated batches with duplicates and padding), against its
optax (or torch) equivalent where every row is touched, and for what optax
checks of its own optimizers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
import torch
from flax import serialization
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental import sparse as jsparse
from variants_reference import LazyVariantReference

import optax_sparse_adam as osa

LR, WD = 0.05, 0.3

# name -> (factory of the optimizer from keyword hyperparameters, its keyword hyperparameters, reference rule)
VARIANTS: dict[str, tuple[Callable[..., Any], dict[str, Any], str]] = {
    "adamw": (osa.sparse_adamw, {"weight_decay": WD}, "adamw"),
    "adamw_catch_up": (functools.partial(osa.sparse_adamw, catch_up=True), {"weight_decay": WD}, "adamw_catch_up"),
    "amsgrad": (osa.sparse_amsgrad, {}, "amsgrad"),
    "rowwise_adam": (osa.sparse_rowwise_adam, {}, "rowwise_adam"),
    "rowwise_adam_per_row": (
        functools.partial(osa.sparse_rowwise_adam, per_row_bias_correction=True),
        {},
        "rowwise_adam_per_row",
    ),
    "rowwise_adagrad": (osa.sparse_rowwise_adagrad, {"weight_decay": WD}, "rowwise_adagrad"),
    "rowwise_adagrad_decoupled": (
        functools.partial(osa.sparse_rowwise_adagrad, weight_decay_mode="decoupled"),
        {"weight_decay": WD},
        "rowwise_adagrad_decoupled",
    ),
}
NAMES = list(VARIANTS)


def make(name: str, lr: Any = LR) -> optax.GradientTransformation:
    factory, kwargs, _ = VARIANTS[name]
    return factory(learning_rate=lr, **kwargs)


def reference(name: str, param: np.ndarray) -> LazyVariantReference:
    _, kwargs, rule = VARIANTS[name]
    eps = 1e-10 if rule.startswith("rowwise_adagrad") else 1e-8
    return LazyVariantReference(param, rule, lr=LR, eps=eps, **kwargs)


# --------------------------------------------------------------------------- the lazy rule against NumPy


@st.composite
def _problems(draw):
    num_rows = draw(st.integers(1, 10))
    row_shape = draw(st.sampled_from([(), (1,), (3,), (2, 2)]))
    capacity = draw(st.integers(0, 9))
    steps = draw(st.integers(1, 5))
    rows = st.one_of(st.integers(0, num_rows - 1), st.integers(0, num_rows - 1), st.sampled_from([-2, num_rows]))
    batches = [draw(st.lists(rows, min_size=capacity, max_size=capacity)) for _ in range(steps)]
    return (num_rows, *row_shape), capacity, batches


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=10, deadline=None)
@given(problem=_problems(), seed=st.integers(0, 2**31 - 1))
def test_matches_numpy_reference(name, problem, seed):
    shape, capacity, batches = problem
    rng = np.random.default_rng(seed)
    init = rng.standard_normal(shape).astype(np.float32)
    ref = reference(name, init)
    tx = make(name)
    params = jnp.asarray(init)
    state = tx.init(params)
    for rows in batches:
        values = rng.standard_normal((capacity, *shape[1:])).astype(np.float32)
        ref.step(rows, list(values))
        idx = jnp.asarray(np.array(rows, np.int32))
        if rng.random() < 0.5:
            grad = osa.IndexedRows(idx, jnp.asarray(values), shape[0])
        else:
            grad = jsparse.BCOO((jnp.asarray(values), idx[:, None]), shape=shape)
        updates, state = tx.update(grad, state, params)
        assert type(updates) is type(grad)
        params = osa.apply_updates(params, updates)
    np.testing.assert_allclose(params, ref.p, rtol=1e-4, atol=1e-5)
    never = np.ones(shape[0], bool)
    for rows in batches:
        never[[r for r in rows if 0 <= r < shape[0]]] = False
    assert np.asarray(params)[never].tobytes() == init[never].tobytes()  # untouched rows bitwise unchanged


# --------------------------------------------------------------------------- optax equality, every row touched


def _all_rows(g: np.ndarray, rng: np.random.Generator) -> osa.IndexedRows:
    """An IndexedRows equal to the dense ``g`` touching every row, split into shuffled duplicates, with padding."""
    n = g.shape[0]
    part = rng.standard_normal(g.shape).astype(np.float32)
    idx = np.concatenate([np.arange(n), np.arange(n), [-1, n]])
    vals = np.concatenate([part, g - part, np.full((2, *g.shape[1:]), 5.0, np.float32)])
    perm = rng.permutation(len(idx))
    return osa.IndexedRows(jnp.asarray(idx[perm], jnp.int32), jnp.asarray(vals[perm]), n)


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
    ("amsgrad", lambda: osa.sparse_amsgrad(LR), lambda: optax.amsgrad(LR), 3),
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
    rng = np.random.default_rng(0)
    params = {
        "emb": jnp.asarray(rng.standard_normal((6, width)), jnp.float32),
        "bias": jnp.asarray(rng.standard_normal((width,)), jnp.float32),
    }
    a, b = ours(), theirs()
    pa, pb, sa, sb = params, params, a.init(params), b.init(params)
    for _ in range(5):
        g = rng.standard_normal((6, width)).astype(np.float32)
        gb = {"emb": jnp.asarray(g), "bias": jnp.asarray(rng.standard_normal((width,)), jnp.float32)}
        ga = {**gb, "emb": _all_rows(g, rng) if sparse else gb["emb"]}
        ua, sa = jax.jit(a.update)(ga, sa, pa)
        ub, sb = jax.jit(b.update)(gb, sb, pb)
        pa, pb = osa.apply_updates(pa, ua), optax.apply_updates(pb, ub)
    chex.assert_trees_all_close(pa, pb, rtol=2e-6, atol=1e-7)
    if name == "amsgrad":
        chex.assert_trees_all_close(sa[0], sb[0], rtol=2e-6, atol=1e-8)  # the same ScaleByAmsgradState


def test_rowwise_adagrad_equals_torch_adagrad_on_width_1_tables():
    """Width 1: a row's mean square is its square, so the rule is Adagrad's; a zero gradient moves nothing."""
    rng = np.random.default_rng(1)
    n = 9
    init = rng.standard_normal((n, 1)).astype(np.float32)
    t_param = torch.nn.Parameter(torch.tensor(init))
    t_opt = torch.optim.Adagrad([t_param], lr=LR, eps=1e-10)
    tx = osa.sparse_rowwise_adagrad(LR)
    p = jnp.asarray(init)
    s = tx.init(p)
    for _ in range(8):
        k = int(rng.integers(1, 7))
        idx = np.concatenate([rng.integers(0, n, size=k), [-1]]).astype(np.int32)
        vals = rng.standard_normal((k + 1, 1)).astype(np.float32)
        g = osa.IndexedRows(jnp.asarray(idx), jnp.asarray(vals), n)
        u, s = tx.update(g, s, p)
        p = osa.apply_updates(p, u)
        t_opt.zero_grad()
        t_param.grad = torch.tensor(np.asarray(g.todense()))
        t_opt.step()
    np.testing.assert_allclose(p, t_param.detach().numpy(), rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------- catch-up, bias correction


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
    np.testing.assert_array_equal(s[1].last_step, [4, 0, 5])


def test_catch_up_with_a_schedule_decays_idle_steps_at_the_current_rate():
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
    lr3 = float(schedule(3))  # the fourth step's rate, also used for the 3 idle steps
    np.testing.assert_allclose(p[1, 0], (1 - lr3 * wd) ** 4, rtol=1e-6)
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
    assert u["emb"].values.dtype == jnp.bfloat16  # updates in the gradient's dtype


# --------------------------------------------------------------------------- jit, errors


@pytest.mark.parametrize("name", NAMES)
def test_jit_compiles_once(name):
    chex.clear_trace_counter()
    tx = make(name)
    params = {"emb": jnp.ones((20, 3), jnp.float32), "w": jnp.ones((3,), jnp.float32)}
    state = tx.init(params)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(params, state, idx, vals, w_grad):
        grads = {"emb": osa.IndexedRows(idx, vals, 20), "w": w_grad}
        updates, state = tx.update(grads, state, params)
        return osa.apply_updates(params, updates), state

    rng = np.random.default_rng(0)
    for n_valid in (1, 5, 8):
        idx = np.full(8, -1, np.int32)
        idx[:n_valid] = rng.integers(0, 20, n_valid)
        params, state = step(params, state, jnp.asarray(idx), jnp.ones((8, 3), jnp.float32), jnp.ones(3, jnp.float32))
    chex.assert_trees_all_equal_shapes_and_dtypes(state, tx.init(params))


ROWWISE = ["adamw_catch_up", "rowwise_adam", "rowwise_adagrad"]


@pytest.mark.parametrize("name", ROWWISE)
def test_rowwise_state_refuses_element_sparse_gradients_naming_the_path(name):
    tx = make(name)
    params = {"emb": jnp.ones((4, 3), jnp.float32)}
    g = jsparse.BCOO((jnp.ones(2, jnp.float32), jnp.array([[0, 1], [2, 2]], jnp.int32)), shape=(4, 3))
    with pytest.raises(ValueError, match=r"parameter \['emb'\].*n_sparse=2"):
        tx.update({"emb": g}, tx.init(params), params)


@pytest.mark.parametrize("name", NAMES)
def test_bad_gradients_raise_naming_the_path(name):
    tx = make(name)
    params = {"a": {"emb": jnp.ones((4, 3), jnp.float32)}}
    state = tx.init(params)
    with pytest.raises(ValueError, match=r"parameter \['a'\]\['emb'\]: gradient shape \(4, 2\)"):
        tx.update({"a": {"emb": jnp.ones((4, 2), jnp.float32)}}, state, params)
    with pytest.raises(ValueError, match=r"parameter \['a'\]\['emb'\].*5 rows"):
        tx.update({"a": {"emb": osa.IndexedRows(jnp.array([0]), jnp.ones((1, 3), jnp.float32), 5)}}, state, params)
    with pytest.raises(TypeError, match=r"parameter \['a'\]\['emb'\].*int32"):
        tx.update({"a": {"emb": jnp.ones((4, 3), jnp.int32)}}, state, params)
    with pytest.raises(TypeError, match="not the"):
        tx.update({"a": {"emb": jnp.ones((4, 3), jnp.float32)}}, (optax.EmptyState(), *state[1:]), params)


def test_bad_hyperparameters_and_missing_params_raise():
    with pytest.raises(ValueError, match="weight_decay"):
        osa.sparse_adamw(0.1, weight_decay=-1.0)
    with pytest.raises(ValueError, match="b2"):
        osa.sparse_amsgrad(0.1, b2=1.0)
    with pytest.raises(ValueError, match="weight_decay_mode"):
        osa.sparse_rowwise_adagrad(0.1, weight_decay_mode="l1")
    with pytest.raises(TypeError, match="per_row_bias_correction"):
        osa.sparse_rowwise_adam(0.1, per_row_bias_correction=1)
    with pytest.raises(TypeError, match="mu_dtype"):
        osa.sparse_rowwise_adam(0.1, mu_dtype=jnp.int32)
    p = jnp.ones((3, 2), jnp.float32)
    g = osa.IndexedRows(jnp.array([0]), jnp.ones((1, 2), jnp.float32), 3)
    tx = osa.sparse_adamw(0.1, catch_up=True)
    with pytest.raises(ValueError, match="needs the parameters"):
        tx.update(g, tx.init(p))
    tx = osa.sparse_rowwise_adagrad(0.1, weight_decay=0.1)
    with pytest.raises(ValueError, match="needs the parameters"):
        tx.update(g, tx.init(p))
    with pytest.raises(ValueError, match="mask"):
        osa.sparse_adamw(0.1, catch_up=True, mask={"x": True}).init({"y": p})


# --------------------------------------------------------------------------- checkpoints, inject_hyperparams


def _train(tx, params, state, steps, seed):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        idx = jnp.asarray(rng.integers(-1, 12, size=6), jnp.int32)
        grads = {
            "emb": osa.IndexedRows(idx, jnp.asarray(rng.standard_normal((6, 4)), jnp.float32), 12),
            "w": jnp.asarray(rng.standard_normal((4,)), jnp.float32),
        }
        updates, state = tx.update(grads, state, params)
        params = osa.apply_updates(params, updates)
    return params, state


def _params():
    return {"emb": jnp.ones((12, 4), jnp.float32), "w": jnp.zeros((4,), jnp.float32)}


@pytest.mark.parametrize("name", NAMES)
def test_checkpoint_round_trip_msgpack_and_orbax(name, tmp_path):
    tx = make(name)
    params, state = _train(tx, _params(), tx.init(_params()), 3, seed=0)
    expected = _train(tx, params, state, 2, seed=1)

    restored = serialization.from_bytes(
        {"p": _params(), "s": tx.init(_params())}, serialization.to_bytes({"p": params, "s": state})
    )
    chex.assert_trees_all_equal_structs(restored["s"], state)
    chex.assert_trees_all_equal(restored, {"p": params, "s": state})

    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path / "ckpt", {"p": params, "s": state})
    target = jax.eval_shape(lambda: {"p": _params(), "s": tx.init(_params())})
    with ocp.StandardCheckpointer() as ckptr:
        back = ckptr.restore(tmp_path / "ckpt", target)
    chex.assert_trees_all_equal_structs(back["s"], state)
    chex.assert_trees_all_equal(back, {"p": params, "s": state})
    chex.assert_trees_all_equal(_train(tx, back["p"], back["s"], 2, seed=1), expected)


INJECTED = [
    ("adamw", osa.sparse_adamw, {"learning_rate": 0.05, "weight_decay": 0.3, "b1": 0.8}),
    (
        "adamw_catch_up",
        functools.partial(osa.sparse_adamw, catch_up=True),
        {"learning_rate": 0.05, "weight_decay": 0.3},
    ),
    ("amsgrad", osa.sparse_amsgrad, {"learning_rate": 0.05, "b2": 0.99}),
    ("rowwise_adam", osa.sparse_rowwise_adam, {"learning_rate": 0.05, "b1": 0.8, "eps": 1e-6}),
    ("rowwise_adagrad", osa.sparse_rowwise_adagrad, {"learning_rate": 0.05, "weight_decay": 0.3}),
]


@pytest.mark.parametrize(("name", "factory", "kwargs"), INJECTED, ids=[i[0] for i in INJECTED])
def test_inject_hyperparams_matches_and_does_not_recompile(name, factory, kwargs):
    chex.clear_trace_counter()
    plain = factory(**kwargs)
    injected = optax.inject_hyperparams(factory)(**kwargs)
    p1, _ = _train(plain, _params(), plain.init(_params()), 3, seed=2)
    p2, s2 = _train(injected, _params(), injected.init(_params()), 3, seed=2)
    chex.assert_trees_all_close(p1, p2, rtol=2e-5, atol=1e-6)  # injected values are float32 arrays

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(params, state, grads):
        updates, state = injected.update(grads, state, params)
        return osa.apply_updates(params, updates), state

    grads = {"emb": osa.IndexedRows(jnp.array([1, 2], jnp.int32), jnp.ones((2, 4), jnp.float32), 12), "w": None}
    params, state = step(p2, s2, grads)
    state.hyperparams["learning_rate"] = jnp.asarray(0.001, jnp.float32)
    before = params
    params, state = step(params, state, grads)
    assert not np.array_equal(params["emb"], before["emb"])


def test_extra_args_are_accepted():
    for name in NAMES:
        tx = make(name)
        p = _params()
        tx.update({"emb": jnp.ones((12, 4), jnp.float32), "w": None}, tx.init(p), p, some_extra_arg=1)
