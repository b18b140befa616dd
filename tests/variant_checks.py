"""The lazy optimizer variants by name, and the checks every one of them passes.

``test_adamw.py``, ``test_amsgrad.py`` and ``test_rowwise.py`` run these checks on their own variants: each
variant against its NumPy loop (:class:`tests.reference.LazyVariantReference`, hypothesis-generated batches with
duplicates and padding), against its optax equivalent where every row is touched, and what optax checks of its
own optimizers (one compile, ``inject_hyperparams``, extra arguments, errors naming the parameter's path).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import strategies as st
from jax.experimental import sparse as jsparse

import optax_sparse_adam as osa
from tests.helpers import ON_CPU, assert_trees_equal, jit_once
from tests.reference import LazyVariantReference

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


def make(name: str, lr: Any = LR) -> optax.GradientTransformation:
    factory, kwargs, _ = VARIANTS[name]
    return factory(learning_rate=lr, **kwargs)


def reference(name: str, param: np.ndarray) -> LazyVariantReference:
    _, kwargs, rule = VARIANTS[name]
    eps = 1e-10 if rule.startswith("rowwise_adagrad") else 1e-8
    return LazyVariantReference(param, rule, lr=LR, eps=eps, **kwargs)


@st.composite
def problems(draw):
    num_rows = draw(st.integers(1, 10))
    row_shape = draw(st.sampled_from([(), (1,), (3,), (2, 2)]))
    capacity = draw(st.integers(0, 9))
    steps = draw(st.integers(1, 5))
    rows = st.one_of(st.integers(0, num_rows - 1), st.integers(0, num_rows - 1), st.sampled_from([-2, num_rows]))
    batches = [draw(st.lists(rows, min_size=capacity, max_size=capacity)) for _ in range(steps)]
    return (num_rows, *row_shape), capacity, batches


def check_matches_reference(name: str, problem: Any, seed: int) -> None:
    shape, capacity, batches = problem
    rng = np.random.default_rng(seed)
    init = rng.standard_normal(shape).astype(np.float32)
    ref = reference(name, init)
    tx = make(name)
    params = jnp.asarray(init)
    state = tx.init(params)
    update = jax.jit(tx.update)  # one compilation per problem's shapes, not one dispatch per operation
    for rows in batches:
        values = rng.standard_normal((capacity, *shape[1:])).astype(np.float32)
        ref.step(rows, list(values))
        idx = jnp.asarray(np.array(rows, np.int32))
        if rng.random() < 0.5:
            grad = osa.IndexedRows(idx, jnp.asarray(values), shape[0])
        else:
            grad = jsparse.BCOO((jnp.asarray(values), idx[:, None]), shape=shape)
        updates, state = update(grad, state, params)
        assert type(updates) is type(grad)
        params = osa.apply_updates(params, updates)
    np.testing.assert_allclose(params, ref.p, rtol=1e-4, atol=1e-5)
    never = np.ones(shape[0], bool)
    for rows in batches:
        never[[r for r in rows if 0 <= r < shape[0]]] = False
    assert np.asarray(params)[never].tobytes() == init[never].tobytes()  # untouched rows bitwise unchanged


def _all_rows(g: np.ndarray, rng: np.random.Generator) -> osa.IndexedRows:
    """An IndexedRows equal to the dense ``g`` touching every row, split into shuffled duplicates, with padding."""
    n = g.shape[0]
    part = rng.standard_normal(g.shape).astype(np.float32)
    idx = np.concatenate([np.arange(n), np.arange(n), [-1, n]])
    vals = np.concatenate([part, g - part, np.full((2, *g.shape[1:]), 5.0, np.float32)])
    perm = rng.permutation(len(idx))
    return osa.IndexedRows(jnp.asarray(idx[perm], jnp.int32), jnp.asarray(vals[perm]), n)


def check_equals_optax_when_every_row_is_touched(
    ours: Callable[[], optax.GradientTransformation],
    theirs: Callable[[], optax.GradientTransformation],
    width: int,
    sparse: bool,
    compare_state: bool = False,
) -> None:
    rng = np.random.default_rng(0)
    params = {
        "emb": jnp.asarray(rng.standard_normal((6, width)), jnp.float32),
        "bias": jnp.asarray(rng.standard_normal((width,)), jnp.float32),
    }
    a, b = ours(), theirs()
    pa, pb, sa, sb = params, params, a.init(params), b.init(params)
    update_a, update_b = jax.jit(a.update), jax.jit(b.update)
    apply_a, apply_b = jax.jit(osa.apply_updates), jax.jit(optax.apply_updates)
    for _ in range(5):
        g = rng.standard_normal((6, width)).astype(np.float32)
        gb = {"emb": jnp.asarray(g), "bias": jnp.asarray(rng.standard_normal((width,)), jnp.float32)}
        ga = {**gb, "emb": _all_rows(g, rng) if sparse else gb["emb"]}
        ua, sa = update_a(ga, sa, pa)
        ub, sb = update_b(gb, sb, pb)
        pa, pb = apply_a(pa, ua), apply_b(pb, ub)
    assert_trees_equal(pa, pb, rtol=2e-6, atol=1e-7)
    if compare_state:  # the same state type as optax's
        # On a GPU, fused multiply-adds chosen per program (helpers.ON_CPU): mu = b1 mu + (1 - b1) g of O(1)
        # terms that cancel lands an ulp of the terms apart (seen: 1.7e-8 absolute on an H100).
        assert_trees_equal(sa[0], sb[0], rtol=2e-6, atol=1e-8 if ON_CPU else 6e-8)


def check_compiles_once(name: str) -> None:
    tx = make(name)
    params = {"emb": jnp.ones((20, 3), jnp.float32), "w": jnp.ones((3,), jnp.float32)}
    state = tx.init(params)

    def step(params, state, idx, vals, w_grad):
        grads = {"emb": osa.IndexedRows(idx, vals, 20), "w": w_grad}
        updates, state = tx.update(grads, state, params)
        return osa.apply_updates(params, updates), state

    step = jit_once(step)
    rng = np.random.default_rng(0)
    for n_valid in (1, 5, 8):
        idx = np.full(8, -1, np.int32)
        idx[:n_valid] = rng.integers(0, 20, n_valid)
        params, state = step(params, state, jnp.asarray(idx), jnp.ones((8, 3), jnp.float32), jnp.ones(3, jnp.float32))
    assert_trees_equal(jax.eval_shape(lambda: state), jax.eval_shape(tx.init, params))


def check_refuses_element_sparse_gradients(name: str) -> None:
    """A variant with per-row state takes row gradients only; an element-sparse BCOO is refused, naming the path."""
    tx = make(name)
    params = {"emb": jnp.ones((4, 3), jnp.float32)}
    g = jsparse.BCOO((jnp.ones(2, jnp.float32), jnp.array([[0, 1], [2, 2]], jnp.int32)), shape=(4, 3))
    with pytest.raises(ValueError, match=r"parameter \['emb'\].*n_sparse=2"):
        tx.update({"emb": g}, tx.init(params), params)


def check_bad_gradients_raise_naming_the_path(name: str) -> None:
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


def train(tx, params, state, steps, seed, jit=False):
    """``steps`` steps of ``tx`` on :func:`params_tree`'s shapes; with ``jit``, each step compiled (once)."""

    def step(grads, state, params):
        updates, state = tx.update(grads, state, params)
        return osa.apply_updates(params, updates), state

    step = jax.jit(step) if jit else step
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        idx = jnp.asarray(rng.integers(-1, 12, size=6), jnp.int32)
        grads = {
            "emb": osa.IndexedRows(idx, jnp.asarray(rng.standard_normal((6, 4)), jnp.float32), 12),
            "w": jnp.asarray(rng.standard_normal((4,)), jnp.float32),
        }
        params, state = step(grads, state, params)
    return params, state


def params_tree():
    return {"emb": jnp.ones((12, 4), jnp.float32), "w": jnp.zeros((4,), jnp.float32)}


def check_inject_hyperparams_matches_and_does_not_recompile(factory: Callable[..., Any], kwargs: dict) -> None:
    plain = factory(**kwargs)
    injected = optax.inject_hyperparams(factory)(**kwargs)
    p1, _ = train(plain, params_tree(), plain.init(params_tree()), 3, seed=2, jit=True)
    p2, s2 = train(injected, params_tree(), injected.init(params_tree()), 3, seed=2, jit=True)
    assert_trees_equal(p1, p2, rtol=2e-5, atol=1e-6)  # injected values are float32 arrays

    def step(params, state, grads):
        updates, state = injected.update(grads, state, params)
        return osa.apply_updates(params, updates), state

    step = jit_once(step)

    grads = {"emb": osa.IndexedRows(jnp.array([1, 2], jnp.int32), jnp.ones((2, 4), jnp.float32), 12), "w": None}
    params, state = step(p2, s2, grads)
    state.hyperparams["learning_rate"] = jnp.asarray(0.001, jnp.float32)
    before = params
    params, state = step(params, state, grads)
    assert not np.array_equal(params["emb"], before["emb"])


def check_extra_args_are_accepted(name: str) -> None:
    tx = make(name)
    p = params_tree()
    tx.update({"emb": jnp.ones((12, 4), jnp.float32), "w": None}, tx.init(p), p, some_extra_arg=1)
