"""Functional checkpointing of ``sparse_adam`` states: orbax across a process boundary, flax msgpack, adam states.

The model is a tiny two-tower recommender: a ``user`` table trained through
``IndexedRows`` gradients, an ``item`` table through BCOO gradients (both with
duplicate ids and padding), and a dense matrix ``w``. The row gradients are
taken with respect to the gathered rows only.

Run as a script, this file is the fresh process of the resume test:
``python -m tests.test_checkpoint resume CKPT_DIR OUT.npz`` (from the repository root) restores the orbax
checkpoint in ``CKPT_DIR``, trains to the end and writes the trajectory to
``OUT.npz``. Every optimizer of the library round-trips through both formats too.
"""

from __future__ import annotations

import functools
import os
import pathlib
import subprocess
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import serialization
from jax.experimental import sparse as jsparse

import optax_sparse_adam as osa
from tests import variant_checks
from tests.helpers import assert_trees_equal

pytestmark = pytest.mark.slow

R, D = 32, 4  # both tables are (R, D)
B = 12  # ids per batch: duplicates and padding included
STEPS, SAVE_AT = 6, 3
LR = 0.05


def init_params() -> dict[str, jax.Array]:
    rng = np.random.default_rng(0)
    return {
        "user": jnp.asarray(rng.standard_normal((R, D)) * 0.1, jnp.float32),
        "item": jnp.asarray(rng.standard_normal((R, D)) * 0.1, jnp.float32),
        "w": jnp.asarray(np.eye(D) + rng.standard_normal((D, D)) * 0.1, jnp.float32),
    }


def batch(step: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Deterministic ids and targets for ``step``: a few hot ids repeat, ``R`` is padding."""
    rng = np.random.default_rng(1000 + step)
    users = rng.choice([0, 1, 2, *range(R), R], size=B).astype(np.int32)
    items = rng.choice([0, 0, 5, *range(R), R], size=B).astype(np.int32)
    users[-1] = items[-1] = R  # at least one padding slot each
    y = rng.standard_normal(B).astype(np.float32)
    return jnp.asarray(users), jnp.asarray(items), jnp.asarray(y)


def loss_on_rows(user_rows: jax.Array, item_rows: jax.Array, w: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((jnp.sum((user_rows @ w) * item_rows, axis=1) - y) ** 2)


def sparse_grads(params: Any, users: jax.Array, items: jax.Array, y: jax.Array) -> dict[str, Any]:
    user_rows = params["user"].at[users].get(mode="fill", fill_value=0)
    item_rows = params["item"].at[items].get(mode="fill", fill_value=0)
    g_user, g_item, g_w = jax.grad(loss_on_rows, argnums=(0, 1, 2))(user_rows, item_rows, params["w"], y)
    return {
        "user": osa.IndexedRows(users, g_user, R),
        "item": jsparse.BCOO((g_item, items[:, None]), shape=(R, D)),
        "w": g_w,
    }


def dense_grads(params: Any, users: jax.Array, items: jax.Array, y: jax.Array) -> dict[str, Any]:
    grads = sparse_grads(params, users, items, y)
    return jax.tree.map(lambda g: g.todense() if osa.is_sparse(g) else g, grads, is_leaf=osa.is_sparse)


@functools.cache
def train_step(tx: optax.GradientTransformation, make_grads=sparse_grads):
    def step(params, opt_state, users, items, y):
        updates, opt_state = tx.update(make_grads(params, users, items, y), opt_state, params)
        return osa.apply_updates(params, updates), opt_state

    return jax.jit(step)


TX = osa.sparse_adam(LR)
ADAM = optax.adam(LR)


def train(
    params: Any, opt_state: Any, start: int, stop: int, tx: optax.GradientTransformation = TX, make_grads=sparse_grads
) -> tuple[Any, Any, list[Any]]:
    """Steps ``start .. stop - 1``; returns the final params and state and the params after every step."""
    trajectory = []
    for step in range(start, stop):
        params, opt_state = train_step(tx, make_grads)(params, opt_state, *batch(step))
        trajectory.append(params)
    return params, opt_state, trajectory


def abstract_checkpoint(params: Any = None, tx: optax.GradientTransformation = TX) -> Any:
    """The restore target: shapes and dtypes of what a fresh process would build."""
    params = init_params() if params is None else params
    return jax.eval_shape(lambda: {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params)})


def save(path: pathlib.Path, step: int, params: Any, opt_state: Any) -> None:
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, {"step": jnp.asarray(step, jnp.int32), "params": params, "opt_state": opt_state})


def restore(path: pathlib.Path, target: Any) -> Any:
    with ocp.StandardCheckpointer() as ckptr:
        return ckptr.restore(path, target)


def _flat(tree: Any) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def _resume_main(ckpt: str, out: str) -> None:
    """The fresh process: restore, train to the end, write the trajectory."""
    jax.config.update("jax_numpy_rank_promotion", "raise")
    restored = restore(pathlib.Path(ckpt), abstract_checkpoint())
    start = int(restored["step"])
    _, opt_state, trajectory = train(restored["params"], restored["opt_state"], start, STEPS)
    arrays = {f"params_{start + i}{k}": v for i, p in enumerate(trajectory) for k, v in _flat(p).items()}
    arrays.update({f"opt_state{k}": v for k, v in _flat(opt_state).items()})
    np.savez(out, **arrays)


def _run_script(*args: Any) -> subprocess.CompletedProcess[str]:
    """Runs this file as a script, in a fresh Python process with this one's environment."""
    return subprocess.run(
        [sys.executable, "-m", "tests.test_checkpoint", *map(str, args)],
        cwd=pathlib.Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ.copy(),
        check=False,
    )


@pytest.fixture(scope="module")
def uninterrupted() -> tuple[Any, Any, list[Any], Any]:
    """The reference run; also the state at ``SAVE_AT`` that the other tests checkpoint."""
    params = init_params()
    mid_params, mid_state, first = train(params, TX.init(params), 0, SAVE_AT)
    final_params, final_state, rest = train(mid_params, mid_state, SAVE_AT, STEPS)
    return (mid_params, mid_state), final_state, first + rest, final_params


# --------------------------------------------------------------------------- orbax, across processes


def test_orbax_resume_in_a_fresh_process_is_bitwise_identical(uninterrupted, tmp_path):
    (mid_params, mid_state), final_state, trajectory, _ = uninterrupted
    save(tmp_path / "ckpt", SAVE_AT, mid_params, mid_state)
    out = tmp_path / "resumed.npz"
    proc = _run_script("resume", tmp_path / "ckpt", out)
    assert proc.returncode == 0, proc.stderr[-4000:]
    resumed = np.load(out)
    for step in range(SAVE_AT, STEPS):
        for key, want in _flat(trajectory[step]).items():
            np.testing.assert_array_equal(resumed[f"params_{step}{key}"], want, err_msg=f"step {step} {key}")
    for key, want in _flat(final_state).items():
        got = resumed[f"opt_state{key}"]
        assert got.dtype == want.dtype, key
        np.testing.assert_array_equal(got, want, err_msg=key)


def test_orbax_restores_the_state_structure(uninterrupted, tmp_path):
    (mid_params, mid_state), *_ = uninterrupted
    save(tmp_path / "ckpt", SAVE_AT, mid_params, mid_state)
    restored = restore(tmp_path / "ckpt", abstract_checkpoint())
    assert isinstance(restored["opt_state"][0], optax.ScaleByAdamState)
    assert isinstance(restored["opt_state"][1], optax.EmptyState)
    assert_trees_equal(
        restored, {"step": jnp.asarray(SAVE_AT, jnp.int32), "params": mid_params, "opt_state": mid_state}
    )


# --------------------------------------------------------------------------- flax msgpack


def test_msgpack_round_trip_and_continue(uninterrupted):
    (mid_params, mid_state), final_state, _, final_params = uninterrupted
    data = serialization.to_bytes({"params": mid_params, "opt_state": mid_state})
    target = {"params": init_params(), "opt_state": TX.init(init_params())}
    restored = serialization.from_bytes(target, data)
    assert_trees_equal(restored, {"params": mid_params, "opt_state": mid_state})
    params, opt_state, _ = train(restored["params"], restored["opt_state"], SAVE_AT, STEPS)
    assert_trees_equal(params, final_params)
    assert_trees_equal(opt_state, final_state)


# --------------------------------------------------------------------------- optax.adam -> sparse_adam


def test_adam_and_sparse_adam_states_have_the_same_structure():
    params = init_params()
    assert jax.tree.structure(optax.adam(LR).init(params)) == jax.tree.structure(TX.init(params))
    assert jax.tree.structure(optax.adam(optax.constant_schedule(LR)).init(params)) == jax.tree.structure(
        osa.sparse_adam(optax.constant_schedule(LR)).init(params)
    )
    injected = optax.inject_hyperparams(optax.adam)(learning_rate=LR).init(params)
    assert jax.tree.structure(injected) == jax.tree.structure(
        optax.inject_hyperparams(osa.sparse_adam)(learning_rate=LR).init(params)
    )
    a, s = jax.eval_shape(optax.adam(LR).init, params), jax.eval_shape(TX.init, params)
    assert jax.tree.leaves(a) == jax.tree.leaves(s)  # shapes and dtypes


@pytest.mark.parametrize("via", ["orbax", "msgpack"])
def test_a_state_saved_from_optax_adam_restores_into_sparse_adam(via, tmp_path):
    adam = ADAM  # one optimizer object for both parametrizations: train_step compiles its step once
    params = init_params()
    params, adam_state, _ = train(params, adam.init(params), 0, SAVE_AT, tx=adam, make_grads=dense_grads)
    if via == "orbax":
        save(tmp_path / "ckpt", SAVE_AT, params, adam_state)
        restored = restore(tmp_path / "ckpt", abstract_checkpoint())
        restored_params, restored_state = restored["params"], restored["opt_state"]
    else:
        data = serialization.to_bytes({"params": params, "opt_state": adam_state})
        restored = serialization.from_bytes({"params": init_params(), "opt_state": TX.init(init_params())}, data)
        restored_params, restored_state = restored["params"], restored["opt_state"]
    assert_trees_equal((restored_params, restored_state), (params, adam_state))
    # Training goes on with sparse gradients, exactly as from the in-memory adam state.
    got_params, got_state, _ = train(restored_params, restored_state, SAVE_AT, STEPS)
    want_params, want_state, _ = train(params, adam_state, SAVE_AT, STEPS)
    assert_trees_equal((got_params, got_state), (want_params, want_state))
    assert int(got_state[0].count) == STEPS
    # Rows that no sparse batch touched keep adam's moments and parameters bitwise.
    users = np.concatenate([np.asarray(batch(step)[0]) for step in range(SAVE_AT, STEPS)])
    untouched = ~np.isin(np.arange(R), users)
    assert untouched.any()
    for got, want in ((got_params["user"], params["user"]), (got_state[0].mu["user"], adam_state[0].mu["user"])):
        np.testing.assert_array_equal(np.asarray(got)[untouched], np.asarray(want)[untouched])


# --------------------------------------------------------------------------- every optimizer


@pytest.mark.parametrize("name", list(variant_checks.VARIANTS))
def test_every_optimizer_round_trips_msgpack_and_orbax(name, tmp_path):
    made = variant_checks.make(name)
    tx = optax.GradientTransformation(made.init, jax.jit(made.update))  # every step's update: one compilation
    fresh = {"p": variant_checks.params_tree(), "s": tx.init(variant_checks.params_tree())}
    params, state = variant_checks.train(tx, fresh["p"], fresh["s"], 3, seed=0)
    expected = variant_checks.train(tx, params, state, 2, seed=1)

    restored = serialization.from_bytes(fresh, serialization.to_bytes({"p": params, "s": state}))
    assert_trees_equal(restored, {"p": params, "s": state})

    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path / "ckpt", {"p": params, "s": state})
    target = jax.eval_shape(lambda: fresh)
    with ocp.StandardCheckpointer() as ckptr:
        back = ckptr.restore(tmp_path / "ckpt", target)
    assert_trees_equal(back, {"p": params, "s": state})
    assert_trees_equal(variant_checks.train(tx, back["p"], back["s"], 2, seed=1), expected)


CATCH_UP_STATES = {
    "adam constant": lambda: osa.sparse_adam(LR, catch_up=True),
    "adam schedule": lambda: osa.sparse_adam(optax.cosine_decay_schedule(LR, 100), catch_up=True),
    "adam eps_root": lambda: osa.sparse_adam(LR, eps_root=1e-8, catch_up=True),  # no closed form: no plan
    "adam injected": lambda: optax.inject_hyperparams(osa.sparse_adam)(learning_rate=LR, catch_up=True),
    "adamw schedule eps_root": lambda: osa.sparse_adamw(
        optax.cosine_decay_schedule(LR, 100), eps_root=1e-8, catch_up=True
    ),
    "amsgrad schedule": lambda: osa.sparse_amsgrad(optax.cosine_decay_schedule(LR, 100), catch_up=True),
    "sgd schedule": lambda: osa.sparse_sgd(optax.cosine_decay_schedule(LR, 100), momentum=0.9, catch_up=True),
    "sgd momentum injected": lambda: optax.inject_hyperparams(osa.sparse_sgd, static_args=("catch_up",))(
        optax.cosine_decay_schedule(LR, 100), 0.9, catch_up=True
    ),
}


@pytest.mark.parametrize("name", CATCH_UP_STATES)
def test_every_catch_up_state_has_no_empty_array_and_round_trips_orbax(name, tmp_path):
    """orbax saves no array of zero size: the record of long-idle coefficients (``osa.IdleRecord``) keeps at least
    one entry of at least one term, whether the state records (a schedule) or not (a table, no closed form, an
    injected rate), and the state round-trips orbax."""
    tx = CATCH_UP_STATES[name]()
    params = init_params()
    state = tx.init(params)
    assert all(x.size > 0 for x in jax.tree.leaves(state)), [x.shape for x in jax.tree.leaves(state)]
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path / "ckpt", {"p": params, "s": state})
    with ocp.StandardCheckpointer() as ckptr:
        back = ckptr.restore(tmp_path / "ckpt", jax.eval_shape(lambda: {"p": params, "s": state}))
    assert_trees_equal(back, {"p": params, "s": state})


# --------------------------------------------------------------------------- a checkpoint of another tree


def _other_tree_params() -> dict[str, jax.Array]:
    params = init_params()
    return {"users": params["user"], "item": params["item"], "w": params["w"]}


@pytest.mark.parametrize(
    "target",
    [
        lambda: abstract_checkpoint(_other_tree_params()),
        lambda: abstract_checkpoint(tx=optax.adamw(LR)),
        lambda: abstract_checkpoint(tx=optax.inject_hyperparams(osa.sparse_adam)(learning_rate=LR)),
    ],
    ids=["other-params-tree", "other-optimizer", "injected-hyperparams"],
)
def test_a_sparse_adam_state_does_not_restore_into_another_tree(uninterrupted, tmp_path, target):
    """The state's tree tells it apart from another optimizer's or an injected one's: a wrong target fails."""
    (mid_params, mid_state), *_ = uninterrupted
    save(tmp_path / "ckpt", SAVE_AT, mid_params, mid_state)
    with pytest.raises(ValueError):
        restore(tmp_path / "ckpt", target())


if __name__ == "__main__":
    {"resume": _resume_main}[sys.argv[1]](*sys.argv[2:])
