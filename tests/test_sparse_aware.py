"""``sparse_aware`` (``_sparse_aware.py``), and ``sparse_adam`` inside optax pipelines, against the dense equivalent
gradient.

Every test feeds one parameter tree with three embedding tables, whose
gradients come as an ``IndexedRows`` (``"ir"``), a BCOO (``"bcoo"``) and a
dense array with zero rows (``"dense"``), next to two dense parameters. The
sparse gradients hold duplicate indices and padding entries with junk values.
Each pipeline is compared with what it gives on the dense equivalent gradient
(duplicates summed, padding dropped). Jitted steps are shared between tests
(:func:`_jit_step`), which keeps the file fast.

The optax compatibility table of ``docs/guides/optax_pipelines.md`` is the expectations written down here
(:data:`STATELESS` and the tests of the wrappers). How plain optax treats a sparse leaf without
``sparse_aware`` is optax's behaviour, documented there, not tested here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import traverse_util
from jax.experimental import sparse as jsparse

import optax_sparse_adam as osa
from optax_sparse_adam._kernel_path import PREFIX
from tests.helpers import assert_trees_equal, jit_once

R, D = 10, 3  # every table is (R, D)
K = 14  # capacity of a sparse gradient: touched rows, 2 duplicates, padding
LR = 0.05
TOL = 1e-6
TABLES = ("ir", "bcoo", "dense")
SPARSE = ("ir", "bcoo")
LAZY = {"ir": True, "bcoo": True, "dense": False, "w": False, "b": False}
JUNK = 100.0  # the value of padding entries: a pipeline that counts them is visibly wrong

# --------------------------------------------------------------------------- data and helpers


def _params() -> dict[str, jax.Array]:
    rng = np.random.default_rng(0)
    params = {name: jnp.asarray(rng.standard_normal((R, D)), jnp.float32) for name in TABLES}
    params["w"] = jnp.asarray(rng.standard_normal((D, 2)), jnp.float32)
    params["b"] = jnp.asarray(rng.standard_normal((2,)), jnp.float32)
    return params


def _table_grad(rng: np.random.Generator, all_rows: bool, padding: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    touched = rng.permutation(R) if all_rows else rng.choice(R, size=4, replace=False)
    pad = np.resize(np.asarray(padding, np.int32), K - touched.shape[0] - 2)
    idx = np.concatenate([touched, touched[:2], pad]).astype(np.int32)
    vals = rng.uniform(0.5, 1.5, (K, D)) * rng.choice([-1.0, 1.0], (K, D))
    vals[touched.shape[0] + 2 :] = JUNK
    order = rng.permutation(K)
    return idx[order], vals[order].astype(np.float32)


def _grads(seed: int, *, all_rows: bool = False) -> tuple[dict[str, Any], dict[str, jax.Array]]:
    """A gradient with an ``IndexedRows``, a BCOO and a dense table, and its dense equivalent.

    Each table gradient touches 4 rows (or all of them), two of them through
    two entries each, and fills the rest of its capacity ``K`` with padding.
    ``IndexedRows`` pads with ``-1`` and ``R``; BCOO with ``R`` and ``R + 3``
    (jax's own ``BCOO.todense`` wraps negative indices, so they are avoided).
    """
    rng = np.random.default_rng(100 + seed)
    ir_idx, ir_vals = _table_grad(rng, all_rows, [-1, R])
    bc_idx, bc_vals = _table_grad(rng, all_rows, [R, R + 3])
    de_idx, de_vals = _table_grad(rng, all_rows, [R])
    grads: dict[str, Any] = {
        "ir": osa.IndexedRows(jnp.asarray(ir_idx), jnp.asarray(ir_vals), R),
        "bcoo": jsparse.BCOO((jnp.asarray(bc_vals), jnp.asarray(bc_idx[:, None])), shape=(R, D)),
        "dense": osa.IndexedRows(jnp.asarray(de_idx), jnp.asarray(de_vals), R).todense(),
        "w": jnp.asarray(rng.standard_normal((D, 2)), jnp.float32),
        "b": jnp.asarray(rng.standard_normal((2,)), jnp.float32),
    }
    return grads, _dense(grads)


def _dense(tree: Any) -> Any:
    return jax.tree.map(lambda x: x.todense() if osa.is_sparse(x) else x, tree, is_leaf=osa.is_sparse)


def _with_nan(grads: dict[str, Any], name: str, *, in_padding: bool = False) -> dict[str, Any]:
    """A NaN in one of two duplicate entries of a touched row of table ``name``, or in a padding entry."""
    g = grads[name]
    if name == "dense":
        row = int(np.flatnonzero(np.any(np.asarray(g) != 0, axis=1))[0])
        return {**grads, name: g.at[row, 0].set(jnp.nan)}
    idx = np.asarray(g.indices if isinstance(g, osa.IndexedRows) else g.indices[:, 0])
    valid = (idx >= 0) & (idx < R)
    duplicated = valid & (np.sum(idx[:, None] == idx[None, :], axis=1) > 1)
    slot = int(np.flatnonzero(~valid if in_padding else duplicated)[0])
    if isinstance(g, osa.IndexedRows):
        return {**grads, name: osa.IndexedRows(g.indices, g.values.at[slot, 0].set(jnp.nan), R)}
    return {**grads, name: jsparse.BCOO((g.data.at[slot, 0].set(jnp.nan), g.indices), shape=g.shape)}


def _step(tx: optax.GradientTransformation, params: Any, state: Any, grads: Any) -> tuple[Any, Any]:
    updates, state = tx.update(grads, state, params)
    return osa.apply_updates(params, updates), state


@functools.cache
def _jit_step(make_tx: Callable[..., optax.GradientTransformation]) -> Callable[..., tuple[Any, Any]]:
    """One jitted step per pipeline factory; its hyperparameters are traced arguments."""
    return jax.jit(lambda params, state, grads, hp: _step(make_tx(**hp), params, state, grads))


def _train(
    make_tx: Callable[..., optax.GradientTransformation],
    grads_seq: Sequence[Any],
    hps: Sequence[dict[str, float]] | None = None,
    params: Any = None,
    state: Any = None,
) -> tuple[Any, Any]:
    """Steps of ``make_tx(**hp)``; ``hps`` gives the hyperparameters of each step (as float32)."""
    hps = [{}] * len(grads_seq) if hps is None else hps
    cast = [{k: jnp.asarray(v, jnp.float32) for k, v in hp.items()} for hp in hps]
    params = _params() if params is None else params
    state = make_tx(**cast[0]).init(params) if state is None else state
    for grads, hp in zip(grads_seq, cast, strict=True):
        params, state = _jit_step(make_tx)(params, state, grads, hp)
    return params, state


def _sparse_adam(learning_rate: jax.Array = LR) -> optax.GradientTransformation:
    return osa.sparse_adam(learning_rate)


def _adam_state(state: Any) -> optax.ScaleByAdamState:
    is_adam = lambda s: isinstance(s, optax.ScaleByAdamState)  # noqa: E731
    (found,) = [s for s in jax.tree.leaves(state, is_leaf=is_adam) if is_adam(s)]
    return found


# --------------------------------------------------------------------------- clip by global norm


def _global_norm_probe() -> optax.GradientTransformation:
    """A stateless transformation whose (scalar) state is the global norm of the updates it was given."""
    return optax.GradientTransformation(
        lambda params: jnp.zeros((), jnp.float32),
        lambda updates, state, params=None: (updates, optax.tree.norm(updates)),
    )


@pytest.mark.parametrize("max_norm", [0.5, 1e3], ids=["clipping", "not-clipping"])
def test_sparse_aware_global_norm_and_clip_equal_the_dense_equivalents(max_norm):
    grads, dense = _grads(0)
    tx = osa.sparse_aware(optax.chain(_global_norm_probe(), optax.clip_by_global_norm(max_norm)))
    clipped, (norm, _) = jax.jit(tx.update)(grads, tx.init(_params()), _params())
    np.testing.assert_allclose(norm, optax.tree.norm(dense), rtol=TOL)
    want = optax.clip_by_global_norm(max_norm).update(dense, optax.EmptyState())[0]
    assert_trees_equal(_dense(clipped), want, rtol=TOL, atol=TOL)


def _clip_sparse_adam(max_norm: jax.Array) -> optax.GradientTransformation:
    return optax.chain(osa.sparse_aware(optax.clip_by_global_norm(max_norm)), osa.sparse_adam(LR))


def _clip_adam(max_norm: jax.Array) -> optax.GradientTransformation:
    return optax.chain(optax.clip_by_global_norm(max_norm), optax.adam(LR))


def _clip_lazy_adam(max_norm: jax.Array) -> optax.GradientTransformation:
    # Lazy Adam on the dense equivalent: a row of a table is touched when it is nonzero.
    return optax.chain(optax.clip_by_global_norm(max_norm), osa.sparse_adam(LR, lazy_dense=LAZY))


@pytest.mark.parametrize("max_norm", [0.5, 1e3], ids=["clipping", "not-clipping"])
@pytest.mark.parametrize("all_rows", [False, True], ids=["some-rows", "all-rows"])
def test_clip_by_global_norm_then_sparse_adam(max_norm, all_rows):
    seq = [_grads(seed, all_rows=all_rows) for seed in range(3)]
    hps = [{"max_norm": max_norm}] * 3
    params, state = _train(_clip_sparse_adam, [g for g, _ in seq], hps)
    ref_params, ref_state = _train(_clip_adam if all_rows else _clip_lazy_adam, [d for _, d in seq], hps)
    assert_trees_equal(params, ref_params, rtol=TOL, atol=TOL)
    assert_trees_equal(_adam_state(state), _adam_state(ref_state), rtol=TOL, atol=TOL)


# --------------------------------------------------------------------------- inject_hyperparams, schedules


def _sparse_adam_betas(learning_rate: jax.Array, b1: jax.Array, b2: jax.Array) -> optax.GradientTransformation:
    return osa.sparse_adam(learning_rate, b1, b2)


def test_inject_hyperparams_changes_lr_and_betas_without_recompiling():
    tx = optax.inject_hyperparams(osa.sparse_adam)(learning_rate=0.1, b1=0.9, b2=0.999)

    def step(params, state, grads):
        return _step(tx, params, state, grads)

    step = jit_once(step)
    params, ref = _params(), (_params(), osa.sparse_adam(0.1).init(_params()))
    state = tx.init(params)
    for seed, (lr, b1, b2) in enumerate([(0.1, 0.9, 0.999), (0.03, 0.8, 0.99), (0.2, 0.5, 0.9)]):
        hp = {"learning_rate": lr, "b1": b1, "b2": b2}
        state.hyperparams.update({k: jnp.asarray(v, jnp.float32) for k, v in hp.items()})
        grads, _ = _grads(seed)
        params, state = step(params, state, grads)
        ref = _train(_sparse_adam_betas, [grads], [hp], *ref)
    assert_trees_equal(params, ref[0], rtol=TOL, atol=TOL)
    assert_trees_equal(state.inner_state, ref[1], rtol=TOL, atol=TOL)


def test_inject_hyperparams_takes_structural_options_as_static_args():
    """``mu_dtype`` (a dtype is callable) and a callable ``lazy_dense`` must be named in ``static_args``.

    Otherwise ``inject_hyperparams`` takes any callable for a schedule, as it does for ``optax.adam``.
    """
    lazy = lambda params: {"ir": True, "bcoo": True, "dense": True, "w": False, "b": False}  # noqa: E731
    injected = optax.inject_hyperparams(osa.sparse_adam, static_args=("mu_dtype", "lazy_dense"))
    tx = injected(learning_rate=LR, mu_dtype=jnp.bfloat16, lazy_dense=lazy)
    grads = _dense(_grads(0)[0])
    updates, state = jax.jit(tx.update)(grads, tx.init(_params()), _params())
    ref_tx = osa.sparse_adam(LR, mu_dtype=jnp.bfloat16, lazy_dense=lazy)
    ref_updates, ref_state = jax.jit(ref_tx.update)(grads, ref_tx.init(_params()), _params())
    assert state.inner_state[0].mu["ir"].dtype == jnp.bfloat16
    assert not np.any(updates["dense"][np.all(grads["dense"] == 0, axis=1)])  # lazy: zero rows do not move
    assert_trees_equal(updates, ref_updates, rtol=TOL, atol=TOL)
    assert_trees_equal(state.inner_state, ref_state, rtol=TOL, atol=TOL)


def _constant_schedule() -> optax.GradientTransformation:
    return osa.sparse_adam(optax.constant_schedule(LR))


def _linear_schedule() -> optax.GradientTransformation:
    return osa.sparse_adam(optax.linear_schedule(0.1, 0.01, transition_steps=3))


def test_schedules_equal_the_equivalent_constants():
    seq = [_grads(seed)[0] for seed in range(3)]
    const_params, const_state = _train(_sparse_adam, seq, [{"learning_rate": LR}] * 3)
    sched_params, sched_state = _train(_constant_schedule, seq)
    assert_trees_equal(sched_params, const_params)
    assert_trees_equal(sched_state[0], const_state[0])

    schedule = optax.linear_schedule(0.1, 0.01, transition_steps=3)
    params, state = _train(_linear_schedule, seq)
    ref_params, ref_state = _train(_sparse_adam, seq, [{"learning_rate": float(schedule(t))} for t in range(3)])
    assert_trees_equal(params, ref_params)
    assert_trees_equal(state[0], ref_state[0])


# --------------------------------------------------------------------------- partition / multi_transform, masked

LABELS = {"ir": "tables", "bcoo": "tables", "dense": "tables", "w": "rest", "b": "rest"}


def _label_fn(tree: Any) -> Any:
    # The pattern that works: map with is_leaf=osa.is_sparse, so that a sparse leaf gets one label. A sparse
    # leaf has the dense parameter's .shape/.ndim/.dtype, so parameters and gradients get the same labels.
    return jax.tree.map(lambda x: "tables" if x.shape == (R, D) else "rest", tree, is_leaf=osa.is_sparse)


def _label_fn_paths(tree: Any) -> Any:
    # flax's path_aware_map walks nested dicts only, so a sparse leaf is one leaf already.
    return traverse_util.path_aware_map(lambda path, _: "tables" if path[-1] in TABLES else "rest", tree)


def _adamw() -> optax.GradientTransformation:
    return optax.adamw(LR, weight_decay=0.1)


def _partition_tree() -> optax.GradientTransformation:
    return optax.partition({"tables": osa.sparse_adam(LR), "rest": _adamw()}, LABELS)


def _partition_fn() -> optax.GradientTransformation:
    return optax.multi_transform({"tables": osa.sparse_adam(LR), "rest": _adamw()}, _label_fn)


@pytest.mark.parametrize("make_tx", [_partition_tree, _partition_fn], ids=["label-tree", "label-fn"])
def test_partition_sparse_adam_on_tables_adamw_on_the_rest(make_tx):
    seq = [_grads(seed)[0] for seed in range(3)]
    params, _ = _train(make_tx, seq)
    tables, _ = _train(_sparse_adam, seq)
    rest, _ = _train(_adamw, [_dense(g) for g in seq])
    assert_trees_equal(params, {**{k: tables[k] for k in TABLES}, "w": rest["w"], "b": rest["b"]}, rtol=TOL, atol=TOL)


@pytest.mark.parametrize("label_fn", [_label_fn, _label_fn_paths], ids=["is_leaf", "path_aware_map"])
def test_label_functions_that_keep_sparse_leaves_whole(label_fn):
    """optax calls a label (or mask) function on the parameters at init and on the updates at update."""
    assert label_fn(_params()) == LABELS
    assert label_fn(_grads(0)[0]) == LABELS


def _masked_fn() -> optax.GradientTransformation:
    return optax.masked(osa.sparse_adam(LR), lambda tree: jax.tree.map(lambda lab: lab == "tables", _label_fn(tree)))


def test_masked_sparse_adam_on_the_tables_only():
    seq = [_grads(seed)[0] for seed in range(2)]
    params, _ = _train(_masked_fn, seq)
    tables, _ = _train(_sparse_adam, seq)
    rest = {k: _params()[k] + seq[0][k] + seq[1][k] for k in ("w", "b")}  # masked out: passed through
    assert_trees_equal(params, {**{k: tables[k] for k in TABLES}, **rest}, rtol=TOL, atol=TOL)


# --------------------------------------------------------------------------- apply_if_finite


def _apply_if_finite() -> optax.GradientTransformation:
    return optax.apply_if_finite(osa.sparse_adam(LR), max_consecutive_errors=3)


def _zero_nans_apply_if_finite() -> optax.GradientTransformation:
    return optax.chain(osa.sparse_aware(optax.zero_nans()), _apply_if_finite())


def test_apply_if_finite_skips_a_nonfinite_step_and_keeps_the_state():
    g0, g1, g2 = (_grads(seed)[0] for seed in range(3))
    params, state = _train(_apply_if_finite, [g0])
    for name in TABLES:
        skipped_params, skipped_state = _train(_apply_if_finite, [_with_nan(g1, name)], params=params, state=state)
        assert_trees_equal(skipped_params, params)
        assert_trees_equal(skipped_state.inner_state, state.inner_state)
        assert int(skipped_state.notfinite_count) == 1 and not bool(skipped_state.last_finite)
    params, _ = _train(_apply_if_finite, [g2], params=skipped_params, state=skipped_state)
    ref_params, _ = _train(_sparse_adam, [g0, g2])
    assert_trees_equal(params, ref_params, rtol=TOL, atol=TOL)


def test_sparse_aware_zero_nans_cleans_a_nan_in_a_padding_slot():
    """``sparse_aware(optax.zero_nans())`` in front of ``apply_if_finite`` sees coalesced values, so a NaN in a
    padding entry (which the dense equivalent drops) does not skip the step."""
    for name in SPARSE:
        grads = _with_nan(_grads(0)[0], name, in_padding=True)
        _, state = _train(_zero_nans_apply_if_finite, [grads])
        assert int(state[1].notfinite_count) == 0 and int(state[1].inner_state[0].count) == 1


def test_apply_if_finite_with_a_sorted_bcoo():
    dense = _grads(0)[1]
    grads = {**dense, "bcoo": jsparse.BCOO.fromdense(dense["bcoo"])}
    assert grads["bcoo"].indices_sorted
    tx = _apply_if_finite()
    updates, _ = jax.jit(tx.update)(grads, tx.init(_params()), _params())
    assert updates["bcoo"].indices_sorted
    keys = [tuple(row) for row in np.asarray(updates["bcoo"].indices)]
    assert keys == sorted(keys)  # the flag holds: coalescing's packed order was sorted back


# --------------------------------------------------------------------------- MultiSteps


def _mean_of_two(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """The mean of two gradients in their own form: for a sparse leaf, the entries of both, halved."""
    out = {k: (a[k] + b[k]) / 2 for k in ("dense", "w", "b")}
    out["ir"] = osa.IndexedRows(
        jnp.concatenate([a["ir"].indices, b["ir"].indices]), jnp.concatenate([a["ir"].values, b["ir"].values]) / 2, R
    )
    data = jnp.concatenate([a["bcoo"].data, b["bcoo"].data]) / 2
    out["bcoo"] = jsparse.BCOO((data, jnp.concatenate([a["bcoo"].indices, b["bcoo"].indices])), shape=(R, D))
    return out


def _multi_steps() -> optax.GradientTransformation:
    return optax.MultiSteps(osa.sparse_adam(LR, lazy_dense=LAZY), every_k_schedule=2).gradient_transformation()


def test_multi_steps_with_densified_gradients_is_lazy_adam_on_the_mean():
    """The working pattern: densify the sparse leaves before MultiSteps and mark those tables ``lazy_dense``.

    The accumulation is dense (O(table) per mini-step). Rows that no mini-batch touched stay exactly zero in
    the mean, so the lazy rule skips them as sparse_adam skips untouched rows.
    """
    seq = [_grads(seed)[0] for seed in range(4)]
    params, state = _train(_multi_steps, [_dense(g) for g in seq])
    ref_params, ref_state = _train(_sparse_adam, [_mean_of_two(seq[0], seq[1]), _mean_of_two(seq[2], seq[3])])
    assert_trees_equal(params, ref_params, rtol=TOL, atol=TOL)
    assert_trees_equal(state.inner_opt_state, ref_state, rtol=TOL, atol=TOL)


# --------------------------------------------------------------------------- apply_updates


def test_optax_apply_updates_on_sparse_leaves():
    """``optax.apply_updates`` adds an ``IndexedRows`` with its one scatter (``IndexedRows.__radd__``): the same
    as ``osa.apply_updates``."""
    params, grads = _params(), _grads(0)[0]
    want = osa.apply_updates(params, grads)
    assert_trees_equal(optax.apply_updates(params, {**_dense(grads), "ir": grads["ir"]}), want, rtol=TOL, atol=TOL)


# --------------------------------------------------------------------------- the compatibility table

# Outcome of one stateless transformation on one table's gradient:
#   ok       equals the transformation applied to the dense equivalent gradient
#   lazy     equals it on the touched rows; untouched rows get no update
#   wrong    runs, but the result differs, the state changes structure, or the update is not a valid leaf
#   error    raises (TypeError / ValueError)
#   refused  sparse_aware refuses it at init: it keeps per-parameter state
STATELESS: list[tuple[str, Callable[[], optax.GradientTransformation], str]] = [
    # name, factory, wrapped in osa.sparse_aware (sparse and dense leaves)
    ("identity", optax.identity, "ok"),
    ("clip_by_global_norm", lambda: optax.clip_by_global_norm(1.0), "ok"),
    ("clip", lambda: optax.clip(0.5), "ok"),
    ("scale", lambda: optax.scale(0.5), "ok"),
    ("scale_by_learning_rate", lambda: optax.scale_by_learning_rate(0.1), "ok"),
    ("scale_by_schedule", lambda: optax.scale_by_schedule(optax.linear_schedule(2.0, 1.0, 10)), "ok"),
    ("normalize_by_update_norm", optax.normalize_by_update_norm, "ok"),
    ("zero_nans", optax.zero_nans, "ok"),
    ("add_decayed_weights", lambda: optax.add_decayed_weights(0.1), "lazy"),
    ("clip_by_block_rms", lambda: optax.clip_by_block_rms(0.5), "wrong"),
    ("scale_by_trust_ratio", lambda: optax.scale_by_trust_ratio(), "wrong"),
    ("trace", lambda: optax.trace(0.9), "refused"),
    ("adam", lambda: optax.adam(0.1), "refused"),
]


def _outcomes(tx: optax.GradientTransformation, want: dict[str, jax.Array], grads: Any) -> dict[str, str]:
    """The outcome for each table of ``grads``, given ``want``: the transformation on the dense equivalent."""
    params, dense = _params(), _dense(grads)
    try:
        state = tx.init(params)
    except ValueError as e:
        assert "per-parameter state" in str(e)
        return dict.fromkeys(TABLES, "refused")
    try:
        updates, new_state = jax.jit(tx.update)(grads, state, params)
    except (TypeError, ValueError):
        return dict.fromkeys(TABLES, "error")
    if jax.tree.structure(new_state) != jax.tree.structure(state):
        return dict.fromkeys(TABLES, "wrong")
    out = {}
    for name in TABLES:
        try:
            got = osa.apply_updates(jnp.zeros((R, D), jnp.float32), updates[name])
        except TypeError:  # e.g. IndexedRows indices turned into floats
            out[name] = "wrong"
            continue
        touched = jnp.any(dense[name] != 0, axis=1, keepdims=True)
        lazy_want = jnp.where(touched, want[name], jnp.zeros((), jnp.float32))
        close = functools.partial(np.allclose, got, rtol=TOL, atol=TOL, equal_nan=True)
        out[name] = "ok" if close(want[name]) else "lazy" if close(lazy_want) else "wrong"
    return out


@pytest.mark.parametrize(("name", "factory", "aware"), STATELESS, ids=[row[0] for row in STATELESS])
def test_compatibility_table(name, factory, aware):
    grads, dense = _grads(0)
    if name == "zero_nans":  # a NaN in one of two duplicate entries: the dense equivalent's row holds a NaN
        for table in TABLES:
            grads = _with_nan(grads, table)
        dense = _dense(grads)
    ref = factory()
    want, _ = jax.jit(ref.update)(dense, ref.init(_params()), _params())
    wrapped = _outcomes(osa.sparse_aware(factory()), want, grads)
    want_dense = "refused" if aware == "refused" else "ok"
    assert wrapped == {"ir": aware, "bcoo": aware, "dense": want_dense}


@pytest.mark.parametrize("dtype", [np.uint8, np.int16, np.int64, np.uint32])
def test_apply_if_finite_keeps_working_with_any_index_dtype(dtype):
    with jax.enable_x64(True):
        params = {"emb": jnp.arange(R * D, dtype=jnp.float32).reshape(R, D), "w": jnp.ones((D,), jnp.float32)}
        tx = optax.apply_if_finite(osa.sparse_adam(0.1), max_consecutive_errors=2)
        idx = jnp.asarray(np.array([3, 3, 250], dtype=dtype))  # 250: padding
        g = {"emb": osa.IndexedRows(idx, jnp.ones((3, D), jnp.float32), R), "w": jnp.ones((D,), jnp.float32)}
        updates, state = jax.jit(tx.update)(g, tx.init(params), params)
        assert updates["emb"].indices.dtype == dtype
        assert int(state.total_notfinite) == 0
        new = osa.apply_updates(params, updates)["emb"]
        np.testing.assert_array_equal(np.flatnonzero(np.any(new != params["emb"], axis=1)), [3])


@pytest.mark.parametrize("max_norm", [0.5, 1e3, np.float32(0.5)], ids=["clipping", "not-clipping", "array"])
def test_clip_by_global_norm_is_recognized_and_keeps_optaxs_numbers(max_norm):
    """sparse_aware(optax.clip_by_global_norm(c)) runs its own form of the stage (the squares of a table's summed
    rows from the coalescing kernel on the native path): on the XLA path bitwise what the stage computes by calling
    optax's update (optax.chain around it hides it from the recognition), on the native path within an ulp or so
    of it (the norm's sum rounds apart), and the native program coalesces with the squares in one kernel call."""
    grads, _ = _grads(0)
    recognized = osa.sparse_aware(optax.clip_by_global_norm(max_norm))
    generic = osa.sparse_aware(optax.chain(optax.clip_by_global_norm(max_norm)))
    out = {}
    for kernels in (False, True):
        with osa.use_kernels(kernels):
            for name, tx in (("recognized", recognized), ("generic", generic)):
                step = jax.jit(lambda g, tx=tx: tx.update(g, tx.init(_params()))[0])
                text = step.lower(grads).compile().as_text()
                native = osa.kernel_path() == "native-cpu"  # False also where the kernels were not built
                assert (PREFIX + "coalesce_squares" in text) is (native and name == "recognized")
                out[kernels, name] = _dense(step(grads))
    assert_trees_equal(out[False, "recognized"], out[False, "generic"])
    for a, b in zip(jax.tree.leaves(out[True, "recognized"]), jax.tree.leaves(out[True, "generic"]), strict=True):
        np.testing.assert_array_max_ulp(np.asarray(a), np.asarray(b), maxulp=4)
