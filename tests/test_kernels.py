"""The native CPU kernels (``_kernel_path``, ``_ffi``) against the XLA path: the same cases on both, compared."""

from __future__ import annotations

import collections
import functools
import itertools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_sparse_adam as osa
from optax_sparse_adam import _kernel_path
from optax_sparse_adam._kernel_path import PREFIX
from tests.helpers import (
    all_eqns,
    assert_trees_equal,
    jit_once,
    needs_kernels,
    non_finite_values,
    non_finite_zeroed,
    spread,
)

NUM_ROWS, WIDTH = 97, 5
# The optimizers on the Adam kernels: plain lazy Adam, lazy AdamW (the decay of each touched row fused in) and
# lazy AMSGrad (a third moment; optax's eps placement, no maximize).
ADAMS = {
    "adam": lambda lr, **kw: osa.sparse_adam(lr, **kw),
    "adamw": lambda lr, **kw: osa.sparse_adamw(lr, weight_decay=0.3, **kw),
    "amsgrad": lambda lr, **kw: osa.sparse_amsgrad(lr, **kw),
    "amsgrad catch_up": lambda lr, **kw: osa.sparse_amsgrad(lr, catch_up=True, **kw),
    "adam catch_up": lambda lr, **kw: osa.sparse_adam(lr, catch_up=True, **kw),
    "adamw catch_up": lambda lr, **kw: osa.sparse_adamw(lr, weight_decay=0.3, catch_up=True, **kw),
}
ADAM_OPTIONS = [
    (adam, placement, maximize)
    for adam in sorted(ADAMS)
    for placement in ("optax", "torch")
    for maximize in (False, True)
    if not adam.startswith("amsgrad") or (placement == "optax" and not maximize)
    # The catch-up AdamW kernel's placement and maximize are the lazy kernels' templates: each value once.
    if adam != "adamw catch_up" or (placement == "torch") == maximize
]

# The fused step's kernel, where it is not sparse_{adam}_apply.
_APPLY_KERNELS = {
    "amsgrad catch_up": "catch_up_amsgrad_apply",
    "adam catch_up": "catch_up_adam_apply",
    "adamw catch_up": "catch_up_adam_apply",
}
# tx.update's rows kernel (at a constant learning rate), where it is not sparse_{adam}_rows.
_ROWS_KERNELS = {
    "amsgrad catch_up": "catch_up_amsgrad_rows",
    "adam catch_up": "catch_up_adam_rows",
    "adamw catch_up": "catch_up_adam_rows",
}


def _kernel_of(adam: str, fused: bool) -> str:
    """The kernel a step of ``ADAMS[adam]`` calls: fused, or tx.update's rows kernel."""
    if fused:
        return _APPLY_KERNELS.get(adam, f"sparse_{adam}_apply")
    return _ROWS_KERNELS.get(adam, f"sparse_{adam}_rows")


def _adam_state(state):
    """The state holding ``count`` and the moments: the first of a chain's, or a catch-up optimizer's own."""
    return state if hasattr(state, "_fields") else state[0]


@functools.cache
def _adam(adam: str, lr: float, **options):
    """``ADAMS[adam](lr, **options)``, one object for equal arguments: tests built on it share compiled steps."""
    return ADAMS[adam](lr, **options)


def test_kernels_are_built_where_required():
    """`make test` sets OPTAX_SPARSE_ADAM_REQUIRE_KERNELS=1: there, a missing build is a failure, not a skip."""
    if os.environ.get("OPTAX_SPARSE_ADAM_REQUIRE_KERNELS") == "1":
        assert _kernel_path.available()
        assert osa.kernel_path() == "native-cpu"
    with osa.use_kernels(False):
        assert osa.kernel_path() == "xla"


def _ids(rng: np.random.Generator, kind: str, k: int) -> np.ndarray:
    if kind == "dups":  # duplicates, negative and out-of-range padding mixed in
        ids = rng.integers(-5, NUM_ROWS + 5, k)
        ids[: k // 3] = ids[rng.integers(0, k, k // 3)]
        return ids.astype(np.int32)
    if kind == "distinct":
        return rng.permutation(NUM_ROWS)[:k].astype(np.int32)
    if kind == "all_padding":
        return np.where(np.arange(k) % 2 == 0, -1, NUM_ROWS).astype(np.int32)
    if kind == "extreme":  # int32 extremes are padding too
        return np.resize(np.array([np.iinfo(np.int32).min, np.iinfo(np.int32).max, 3, NUM_ROWS, -1, 3], np.int32), k)
    raise ValueError(kind)


@functools.cache
def _run_step(tx, fused: bool, unique: bool):
    """The jitted step of :func:`_run`, one per ``(tx, fused, unique)``: equal shapes compile once per module (the
    kernel setting is part of jit's cache key)."""

    @jax.jit
    def step(params, state, ids, values):
        grads = {
            "table": osa.IndexedRows(ids, values, NUM_ROWS, unique_indices=unique),
            "w": jnp.sum(values, axis=0)[:3],
        }
        if fused:
            return (*osa.update_and_apply(tx, grads, state, params), None)
        updates, state = tx.update(grads, state, params)
        return osa.apply_updates(params, updates), state, updates

    return step


def _run_start(tx):
    """The parameters (a table and a dense vector) and state that :func:`_run` starts from."""
    params = {"table": jnp.linspace(-1.0, 1.0, NUM_ROWS * WIDTH, dtype=jnp.float32).reshape(NUM_ROWS, WIDTH)}
    params["w"] = jnp.ones((3,), jnp.float32)
    return params, tx.init(params)


def _run(tx, steps, *, fused: bool, unique: bool = False):
    """Runs jitted steps of ``tx`` (two calls, or update_and_apply) on a table and a dense vector."""
    params, state = _run_start(tx)
    step = _run_step(tx, fused, unique)
    updates = None
    for ids, values in steps:
        params, state, updates = step(params, state, jnp.asarray(ids), jnp.asarray(values))
    return params, state, updates


def _run_staged(tx, steps, unique: bool):
    """:func:`_run`'s two calls of ``tx``, a chain of a stage and an optimizer, with the stage's update a jitted
    function of its own (its result computed apart from the optimizer's)."""
    params, state = _run_start(tx)
    (stage_state, opt_state), updates = state, None
    stage, optimizer = _CHAIN_PARTS[tx]

    @jax.jit
    def grads_of(ids, values):
        return {
            "table": osa.IndexedRows(ids, values, NUM_ROWS, unique_indices=unique),
            "w": jnp.sum(values, axis=0)[:3],
        }

    @jax.jit
    def rest(grads, opt_state, params):
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return osa.apply_updates(params, updates), opt_state, updates

    for ids, values in steps:
        clipped, stage_state = jax.jit(stage.update)(
            grads_of(jnp.asarray(ids), jnp.asarray(values)), stage_state, params
        )
        params, opt_state, updates = rest(clipped, opt_state, params)
    return params, (stage_state, opt_state), updates


def _steps(kind: str, k: int, n: int = 4, seed: int = 0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ids = _ids(rng, kind, k)
        values = rng.standard_normal((k, WIDTH)).astype(np.float32)
        if kind == "distinct":
            values[ids >= NUM_ROWS] = 0.0
        out.append((ids, values))
    return out


def _assert_same(a, b, n_steps, lr):
    """m and v bitwise (on these shapes; see test_fuzz_native_against_xla); the updates and the parameters
    within two ulps of themselves plus one of the largest update a step.

    The XLA path may compute a step from a moment rounded apart from the one it stores (XLA:CPU
    contracts the moment's multiply-adds afresh inside each fusion), and where the moment nearly
    cancels that is many ulps of the step but never more than an ulp of the largest step.
    """
    (pa, sa, ua), (pb, sb, ub) = a, b
    assert_trees_equal(sa, sb)
    if ua is not None and ub is not None:
        x, y = np.asarray(ua["table"].todense()), np.asarray(ub["table"].todense())
        tol = 2 * np.spacing(np.abs(y)) + np.spacing(np.float32(lr * 32))
        assert np.all(np.abs(x - y) <= tol), np.max(np.abs(x - y) / tol)
    for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        # |step| <= 1 / sqrt(1 - b2) ~ 32 for Adam; one ulp of it and of p, each step.
        tol = n_steps * (np.spacing(np.abs(y)) + np.spacing(np.float32(lr * 32)))
        assert np.all(np.abs(x - y) <= tol), np.max(np.abs(x - y) / tol)


@needs_kernels
@pytest.mark.parametrize("kind", ["dups", "distinct", "all_padding", "extreme"])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize(("adam", "eps_placement", "maximize"), ADAM_OPTIONS)
def test_native_equals_xla(kind, eps_placement, maximize, fused, adam):
    # One batch size but for the distinct ids: the other kinds (and the XLA reference of both values of `fused`)
    # share their compiled steps.
    k = 40 if kind == "distinct" else 64
    steps = _steps(kind, k)
    options = {"eps_root": 1e-12} if maximize else {}
    if not adam.startswith("amsgrad"):
        options |= {"maximize": maximize, "eps_placement": eps_placement}
    tx = _adam(adam, 0.05, **options)
    with osa.use_kernels(True):
        native = _run(tx, steps, fused=fused, unique=kind == "distinct")
    with osa.use_kernels(False):
        xla = _run(tx, steps, fused=False, unique=kind == "distinct")
    _assert_same(native, xla, len(steps), 0.05)
    if kind == "all_padding":  # nothing moved but the dense vector
        np.testing.assert_array_equal(_adam_state(native[1]).mu["table"], 0.0)


@needs_kernels
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("adam", sorted(ADAMS))
def test_native_equals_xla_on_non_finite_and_extreme_values(adam, fused):
    """A gradient with NaN, both infinities, the largest floats (their squares overflow the second moment),
    subnormals and -0.0, among duplicates and padding, three steps: the kernels give NaN and infinity where the
    XLA path does (moments, parameters, the dense leaf), and elsewhere its numbers within test_native_equals_xla's
    bounds (the moments bitwise)."""
    steps = [(ids, non_finite_values(values)) for ids, values in _steps("dups", 24, n=3, seed=5)]
    tx = _adam(adam, 0.1)
    with osa.use_kernels(True):
        text = _run_step(tx, fused, False).lower(*_run_start(tx), *map(jnp.asarray, steps[0])).as_text()
        assert PREFIX + _kernel_of(adam, fused) in text
        native = _run(tx, steps, fused=fused)
    with osa.use_kernels(False):
        xla = _run(tx, steps, fused=False)
    (pa, sa), (pb, sb) = non_finite_zeroed(native[:2], xla[:2])
    assert (
        np.isnan(np.asarray(native[0]["table"])).any()
        and np.isinf(np.asarray(_adam_state(native[1]).nu["table"])).any()
    )
    assert_trees_equal(native[1], xla[1])
    _assert_same((pa, sa, None), (pb, sb, None), len(steps), 0.1)


@needs_kernels
@pytest.mark.parametrize("k", [0, 1])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("adam", sorted(ADAMS))
def test_empty_and_single_entry_batches(k, fused, adam):
    steps = _steps("dups", max(k, 1))
    steps = [(ids[:k], values[:k]) for ids, values in steps]
    tx = _adam(adam, 0.1)
    with osa.use_kernels(True):
        native = _run(tx, steps, fused=fused)
    with osa.use_kernels(False):
        xla = _run(tx, steps, fused=False)
    _assert_same(native, xla, len(steps), 0.1)
    assert int(_adam_state(native[1]).count) == len(steps)


@needs_kernels
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("adam", sorted(ADAMS))
def test_one_id_repeated_65536_times(fused, adam):
    rng = np.random.default_rng(4)
    k = 65_536
    ids = np.full(k, 7, np.int32)
    values = rng.standard_normal((k, WIDTH)).astype(np.float32)
    tx = _adam(adam, 0.1)
    with osa.use_kernels(True):
        native = _run(tx, [(ids, values)], fused=fused)
    with osa.use_kernels(False):
        xla = _run(tx, [(ids, values)], fused=False)
    _assert_same(native, xla, 1, 0.1)
    # The sum runs in entry order from 0, as XLA's scatter-add: check it against NumPy's sequential float32 sum
    # (cumsum adds row by row in the array's dtype: ((0 + v0) + v1) + ...).
    g = np.cumsum(values, axis=0, dtype=np.float32)[-1]
    np.testing.assert_array_equal(_adam_state(native[1]).mu["table"][7], np.float32(1 - 0.9) * g)


@needs_kernels
def test_schedule_and_mixed_dtypes_fuse_where_they_can():
    """A schedule's step count advances once; a bfloat16 table falls back to XLA inside the same call."""
    schedule = optax.linear_schedule(0.1, 0.01, 10)
    tx = osa.sparse_adam(schedule)
    params = {
        "f32": jnp.ones((NUM_ROWS, WIDTH), jnp.float32),
        "bf16": jnp.ones((NUM_ROWS, WIDTH), jnp.bfloat16),
    }
    rng = np.random.default_rng(5)

    def grads(dtype):
        ids = jnp.asarray(rng.integers(-2, NUM_ROWS, 32), jnp.int32)
        return osa.IndexedRows(ids, jnp.asarray(rng.standard_normal((32, WIDTH)), dtype), NUM_ROWS)

    batches = [{"f32": grads(jnp.float32), "bf16": grads(jnp.bfloat16)} for _ in range(3)]
    results = []
    fused_step = jax.jit(lambda p, s, g: osa.update_and_apply(tx, g, s, p))
    update, apply = jax.jit(tx.update), jax.jit(osa.apply_updates)
    for fused in (True, False):
        p, s = params, tx.init(params)
        for g in batches:
            if fused:
                p, s = fused_step(p, s, g)
            else:
                u, s = update(g, s, p)
                p = apply(p, u)
        results.append((p, s))
    (p1, s1), (p2, s2) = results
    assert_trees_equal(s1, s2)
    assert_trees_equal(p1["bf16"], p2["bf16"])
    np.testing.assert_array_max_ulp(np.asarray(p1["f32"]), np.asarray(p2["f32"]), maxulp=1)
    assert int(s1[1].count) == 3


def test_update_and_apply_runs_any_transformation(kernel_path):
    """For a tx whose updates it cannot take over (a stage after the optimizer), update_and_apply is exactly the
    two calls."""
    tx = optax.chain(osa.sparse_adam(0.1), osa.sparse_aware(optax.scale(0.5)))
    params = {"table": jnp.ones((NUM_ROWS, WIDTH), jnp.float32)}
    g = {"table": osa.IndexedRows(jnp.array([1, 1, -1], jnp.int32), jnp.ones((3, WIDTH), jnp.float32), NUM_ROWS)}
    state = tx.init(params)
    p1, s1 = jax.jit(lambda p, s: osa.update_and_apply(tx, g, s, p))(params, state)

    def two_calls(p, s):
        u, s = tx.update(g, s, p)
        return osa.apply_updates(p, u), s

    assert_trees_equal((p1, s1), jax.jit(two_calls)(params, state))


def _kernel_calls(jitted, *args) -> collections.Counter[str]:
    """How many of the library's custom calls the compiled HLO of ``jitted`` (a jitted function) holds, by
    handler name."""
    text = jitted.lower(*args).compile().as_text()
    return collections.Counter(re.findall(f'custom_call_target="{PREFIX}(\\w+)"', text))


def _kernel_targets(jitted, *args) -> set[str]:
    """The library's custom calls in the compiled HLO of ``jitted``, by handler name."""
    return set(_kernel_calls(jitted, *args))


_SCHEDULE = optax.linear_schedule(0.05, 0.005, 3)
WRAPPED = {
    "inject_hyperparams": (lambda: optax.inject_hyperparams(osa.sparse_adam)(learning_rate=0.05, b1=0.8), 1),
    "inject_hyperparams, schedule": (lambda: optax.inject_hyperparams(osa.sparse_adam)(learning_rate=_SCHEDULE), 1),
    "clip_by_global_norm before": (
        lambda: optax.chain(osa.sparse_aware(optax.clip_by_global_norm(1.0)), osa.sparse_adam(0.05)),
        1,
    ),
    "multi_transform": (
        lambda: optax.multi_transform(
            {"rows": osa.sparse_adam(0.05, eps_placement="torch"), "dense": optax.adam(0.05)},
            {"table": "rows", "w": "dense"},
        ),
        1,
    ),
    "inject_hyperparams in multi_transform": (
        lambda: optax.multi_transform(
            {"rows": optax.inject_hyperparams(osa.sparse_adam)(learning_rate=_SCHEDULE), "dense": optax.sgd(0.1)},
            {"table": "rows", "w": "dense"},
        ),
        1,
    ),
    "inject_hyperparams, row-wise Adagrad": (
        lambda: optax.inject_hyperparams(osa.sparse_rowwise_adagrad)(learning_rate=0.05, weight_decay=0.01),
        1,
    ),
    "multi_transform, row-wise Adam": (
        lambda: optax.multi_transform(
            {"rows": osa.sparse_rowwise_adam(0.05, per_row_bias_correction=True), "dense": optax.sgd(0.1)},
            {"table": "rows", "w": "dense"},
        ),
        1,
    ),
    "catch-up, multi_transform": (
        lambda: optax.multi_transform(
            {"rows": osa.sparse_adam(0.05, catch_up=True), "dense": optax.sgd(0.1)}, {"table": "rows", "w": "dense"}
        ),
        1,
    ),
    "apply_if_finite (not fused)": (lambda: optax.apply_if_finite(osa.sparse_adam(0.05), 2), 0),
    "osa.apply_if_finite": (lambda: osa.apply_if_finite(osa.sparse_adam(0.05), 2), 1),
}


@needs_kernels
@pytest.mark.parametrize("case", list(WRAPPED))
def test_update_and_apply_fuses_through_optax_wrappers(case):
    """Wrapped in optax's inject_hyperparams, chained after a stage that transforms the gradients, or partitioned
    by multi_transform, the optimizer still takes one fused pass per row, with the two calls' numbers; a wrapper
    that changes what the optimizer returned (optax.apply_if_finite's selection) keeps the two calls, and
    osa.apply_if_finite, the same transformation, fuses."""
    make, fused_calls = WRAPPED[case]
    tx = make()
    steps = _steps("dups", 64, n=3, seed=11)
    with osa.use_kernels(True):
        native = _run(tx, steps, fused=True)
        # The program that just ran (compiled once: jit's caches hold it).
        targets = _kernel_targets(_run_step(tx, True, False), *_run_start(tx), *map(jnp.asarray, steps[0]))
    applies = {t for t in targets if t.endswith("_apply")}
    assert len(applies) == fused_calls, targets
    assert not fused_calls or not any(t.endswith("_rows") for t in targets), targets  # none of the two calls' work
    if "row-wise" in case or "clip" in case:
        # The row-wise kernels order a row's sum apart from XLA (test_rowwise_kernels), and the native
        # coalescing packs the clipped rows in another order than the XLA path (so the global norm may round
        # apart): the reference is the two calls on the kernels.
        with osa.use_kernels(True):
            _assert_same((*native[:2], None), _run(tx, steps, fused=False), len(steps), 0.05)
        return
    with osa.use_kernels(False):
        xla = _run(tx, steps, fused=False)
    _assert_same((*native[:2], None), xla, len(steps), 0.05)


# Every optimizer with a fused kernel, in the modes whose row loops differ.
_CLIPPED = {
    "adam": lambda: _adam("adam", 0.05, eps_placement="torch"),
    "adamw": lambda: _adam("adamw", 0.05),
    "amsgrad": lambda: _adam("amsgrad", 0.05),
    "adam catch_up": lambda: osa.sparse_adam(0.05, catch_up=True),
    "amsgrad catch_up": lambda: osa.sparse_amsgrad(0.05, catch_up=True),
    "adamw catch_up": lambda: osa.sparse_adamw(0.05, weight_decay=0.3, catch_up=True),
    "rowwise_adagrad": lambda: osa.sparse_rowwise_adagrad(0.05),
    "rowwise_adagrad L2": lambda: osa.sparse_rowwise_adagrad(0.05, weight_decay=0.01),
    "rowwise_adagrad decoupled": lambda: osa.sparse_rowwise_adagrad(
        0.05, weight_decay=0.01, weight_decay_mode="decoupled"
    ),
    "rowwise_adam per-row": lambda: osa.sparse_rowwise_adam(0.05, per_row_bias_correction=True),
}


_CHAIN_PARTS = {}  # a chain _clip_chain made: its stage and optimizer


@functools.cache
def _clip_chain(max_norm: float, optimizer: str):
    """``chain(sparse_aware(clip_by_global_norm(max_norm)), _CLIPPED[optimizer]())``, one object for equal
    arguments (shared compiled steps)."""
    parts = (osa.sparse_aware(optax.clip_by_global_norm(max_norm)), _CLIPPED[optimizer]())
    tx = optax.chain(*parts)
    _CHAIN_PARTS[tx] = parts
    return tx


@needs_kernels
@pytest.mark.parametrize(
    ("optimizer", "kind", "max_norm"),
    # Every optimizer clipping and not, on repeated keys and distinct ones; each pairing across the optimizers.
    spread(sorted(_CLIPPED), [("dups", 0.5), ("distinct", 1e6), ("distinct", 0.5), ("dups", 1e6)], per=2),
    ids=lambda x: {0.5: "clips", 1e6: "does not clip"}.get(x) if isinstance(x, float) else None,
)
def test_global_norm_clipping_is_taken_by_the_optimizer_kernel(optimizer, kind, max_norm):
    """chain(sparse_aware(clip_by_global_norm(c)), optimizer) under update_and_apply: a table whose entries repeat
    keys has the squares of its summed rows added by a kernel that writes no sums, and the optimizer's kernel sums
    and clips each row as it reads the entries (no coalescing call: no summed or clipped copy of them), with the
    two calls' numbers on the kernels (where one call coalesces with the squares): moments bitwise (so each clipped
    row is), whether the norm clips or not, beside a dense leaf the norm includes; a table known distinct
    (unique_indices) alike, the squares of its entries added by the same kernel without coalescing them, its
    entries clipped as the kernel reads them."""
    tx = _clip_chain(max_norm, optimizer)
    steps = _steps(kind, 64, n=3, seed=5)
    unique = kind == "distinct"
    with osa.use_kernels(True):
        native = _run(tx, steps, fused=True, unique=unique)
        calls = _kernel_calls(_run_step(tx, True, unique), *_run_start(tx), *map(jnp.asarray, steps[0]))
        two_calls = _run(tx, steps, fused=False, unique=unique)
    targets = set(calls)
    assert sum(t.endswith("_apply") for t in targets) == 1 and not any(t.endswith("_rows") for t in targets), targets
    assert targets == {"sum_squares", next(t for t in targets if t.endswith("_apply"))}, targets
    if "catch_up" in optimizer and kind == "distinct":
        # The two calls run catch-up's XLA rule, and XLA:CPU fuses the clipping of the entries into the second
        # moment's multiply-add, rounding it an ulp apart where it contracts it afresh: the table's reference is
        # the clipping's update computed on its own, then the optimizer's two calls on it (the dense leaf's, the
        # two calls as they are: the fused step leaves it to them).
        with osa.use_kernels(True):
            staged = _run_staged(tx, steps, unique)
        two_calls = jax.tree_util.tree_map_with_path(
            lambda path, x, y: y if "table" in jax.tree_util.keystr(path) else x, two_calls, staged
        )
    _assert_same((*native[:2], None), two_calls, len(steps), 0.05)


@needs_kernels
@pytest.mark.parametrize("kind", ["dups", "distinct"])
@pytest.mark.parametrize("fused", [False, True])
def test_the_clipping_kernels_under_vmap_give_each_element_its_own_step(fused, kind):
    """chain(sparse_aware(clip_by_global_norm(c)), sparse_adam) beside a dense leaf, under vmap over two tables,
    states and batches (one clipping and one not): the norm's kernels (coalesce_squares for the two calls' repeated
    keys, sum_squares for the others) and the optimizer's run once per element, each element's numbers those of its
    step alone (which the tests above compare with the two calls and the XLA path) within 4 ulps of each leaf's
    scale: XLA batches the dense leaf's arithmetic and its squares' sum under vmap, and rounds them an ulp apart
    there, which moves the norm, so each clipped row, by as much."""
    tx = _clip_chain(0.5, "adam")
    step = _run_step(tx, fused, kind == "distinct")
    (ids0, values0), (ids1, values1) = _steps(kind, 64, n=2, seed=13)
    ids, values = jnp.asarray(np.stack([ids0, ids1])), jnp.asarray(np.stack([values0, values1 * 1e-4]))
    params = jax.tree.map(lambda x: jnp.stack([x, 0.5 * x]), _run_start(tx)[0])
    state = jax.vmap(tx.init)(params)
    with osa.use_kernels(True):
        batched = jax.jit(jax.vmap(step))
        calls = _kernel_targets(batched, params, state, ids, values)
        out = batched(params, state, ids, values)
        for b in range(2):
            alone = step(*jax.tree.map(lambda x, b=b: x[b], (params, state, ids, values)))
            got = jax.tree.map(lambda x, b=b: x[b], out)
            assert jax.tree.structure(got) == jax.tree.structure(alone)
            for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(alone), strict=True):
                x, y = np.asarray(x), np.asarray(y)
                assert np.all(np.abs(x - y) <= 4 * np.spacing(np.abs(y).max())), (b, np.abs(x - y).max())
    squares = "coalesce_squares" if kind == "dups" and not fused else "sum_squares"
    assert squares in calls and ("sparse_adam_apply" if fused else "sparse_adam_rows") in calls, calls


_ALONE = [(name, 0.5) for name in sorted(_CLIPPED) if "catch_up" not in name]
_ALONE += [("adam", 1e6), ("rowwise_adagrad", 1e6), ("adam catch_up", 0.5)]


@needs_kernels
@pytest.mark.parametrize("kind", ["dups", "distinct"])
@pytest.mark.parametrize(("optimizer", "max_norm"), _ALONE)
def test_global_norm_clipping_of_a_table_alone_is_one_kernel_call(optimizer, max_norm, kind):
    """chain(sparse_aware(clip_by_global_norm(c)), optimizer) under update_and_apply on a table that is the only
    leaf the clipping sees (entries repeating keys, padding; or distinct by ``unique_indices``, no coalescing): the
    optimizer's kernel takes ``c`` alone and the norm from the entries itself (one call, no sum_squares pass), with
    the two calls' numbers on the kernels (moments bitwise, so the norm and each clipped row are), whether the norm
    clips or not. The catch-up kernels take the clipping's two scalars, from sum_squares."""
    tx = _clip_chain(max_norm, optimizer)
    rng = np.random.default_rng(11)
    params = {"table": jnp.asarray(rng.standard_normal((NUM_ROWS, WIDTH)), jnp.float32)}

    def grads(ids, values):
        return {"table": osa.IndexedRows(ids, values, NUM_ROWS, unique_indices=kind == "distinct")}

    def two_calls(p, s, ids, values):
        updates, s = tx.update(grads(ids, values), s, p)
        return osa.apply_updates(p, updates), s

    def staged(p, s, ids, values):
        # Catch-up on distinct entries: the clipping's update computed on its own, as in the test above (XLA:CPU
        # would fuse the clipping into catch-up's XLA rule and round a moment an ulp apart).
        stage, optimizer = _CHAIN_PARTS[tx]
        clipped, stage_state = jax.jit(stage.update)(grads(ids, values), s[0], p)
        updates, opt_state = jax.jit(optimizer.update)(clipped, s[1], p)
        return jax.jit(osa.apply_updates)(p, updates), (stage_state, opt_state)

    reference_step = staged if "catch_up" in optimizer and kind == "distinct" else jax.jit(two_calls)
    fused_step = jax.jit(lambda p, s, ids, values: osa.update_and_apply(tx, grads(ids, values), s, p))
    with osa.use_kernels(True):
        fused = reference = (params, tx.init(params))
        for ids, values in _steps(kind, 64, n=3, seed=12):
            if kind == "distinct":  # padding among the keys, its values anything: the norm leaves them out
                ids = np.where(np.arange(ids.size) % 7 == 0, -1, np.where(np.arange(ids.size) % 11 == 3, NUM_ROWS, ids))
                values = np.where(((ids < 0) | (ids >= NUM_ROWS))[:, None], np.float32(np.nan), values)
            fused = fused_step(*fused, jnp.asarray(ids), jnp.asarray(values))
            reference = reference_step(*reference, jnp.asarray(ids), jnp.asarray(values))
        calls = _kernel_targets(fused_step, *fused, jnp.asarray(ids), jnp.asarray(values))
    applies = {t for t in calls if t.endswith("_apply")}
    assert len(applies) == 1, calls
    if "catch_up" in optimizer:
        assert "sum_squares" in calls, calls
    else:
        assert calls == applies, calls
    _assert_same((*fused, None), (*reference, None), 3, 0.05)


@needs_kernels
@pytest.mark.parametrize(("width", "max_norm"), [(1, 0.5), (64, 0.5), (513, 0.5), (64, "shape (1,)")])
def test_global_norm_clipping_in_the_kernel_is_the_two_calls_at_any_width(width, max_norm):
    """XLA:CPU picks its fusions by shape: the kernel's (g / g_norm) * c is bitwise the two calls' at other widths
    than the test above (one step, ids repeated and padding, the norm clipping), and with a max_norm of shape (1,)
    (which optax takes, broadcasting it against the rows: rank promotion allowed, as it is by default)."""
    rng = np.random.default_rng(width)
    promotion = "raise"
    if max_norm == "shape (1,)":
        max_norm, promotion = jnp.asarray([0.5], jnp.float32), "allow"
    tx = optax.chain(osa.sparse_aware(optax.clip_by_global_norm(max_norm)), osa.sparse_adam(0.05))
    params = {"table": jnp.asarray(rng.standard_normal((NUM_ROWS, width)), jnp.float32)}
    ids = jnp.asarray(rng.integers(-3, NUM_ROWS + 3, 64), jnp.int32)
    grads = {"table": osa.IndexedRows(ids, jnp.asarray(rng.standard_normal((64, width)), jnp.float32), NUM_ROWS)}

    def two_calls(p, s):
        updates, s = tx.update(grads, s, p)
        return osa.apply_updates(p, updates), s

    with osa.use_kernels(True), jax.numpy_rank_promotion(promotion):
        state = tx.init(params)
        step = jax.jit(lambda p, s: osa.update_and_apply(tx, grads, s, p))
        fused = step(params, state)
        assert _kernel_targets(step, params, state) == {"sparse_adam_apply"}  # the norm taken in the kernel
        reference = jax.jit(two_calls)(params, state)
    _assert_same((*fused, None), (*reference, None), 1, 0.05)


@needs_kernels
@pytest.mark.parametrize("optimizer", ["adam", "rowwise_adagrad"])
def test_global_norm_in_the_kernel_adds_the_squares_in_order_of_first_occurrence_on_any_thread_count(optimizer):
    """The fused step's norm, taken over the threads' own rows, adds the rows' squares in the order of their first
    entries, as the two calls' sum_squares adds them: on batches where that order decides the norm, the moments
    are the two calls' bitwise on 1 to 4 threads. A big row (square S = 4096**2 + 109**2, a tie between two floats
    whose roots are two floats) comes first, then 8,192 small rows (square 2**-38) and duplicates: added after the
    big row, each small square is lost in double (below half its ulp, 2**-29) and the total rounds to float as a
    tie, down to S - 1; a few thousand of them added first tip it up to S + 1, and the norm (its root) one float
    up. (Taken part by part rather than merged, a thread's share of small rows would come first wherever the big
    row is another thread's: one of the big row's ids below is.)"""
    rows, small, width = 12_000, 8192, 2
    tx = _clip_chain(1.0, optimizer)
    params = {"table": jnp.zeros((rows, width), jnp.float32)}
    with osa.use_kernels(True):
        state = tx.init(params)
    two_calls = jax.jit(lambda p, s, g: tx.update(g, s, p)[1])  # the state: the moments (bitwise)
    fused = jax.jit(lambda p, s, g: osa.update_and_apply(tx, g, s, p)[1])
    for big in range(9000, 9008):
        ids = np.concatenate([[big], np.arange(small), np.arange(64)]).astype(np.int32)
        values = np.zeros((ids.size, width), np.float32)
        values[0] = [4096.0, 109.0]
        values[1 : 1 + small, 0] = 2.0**-19  # square 2**-38; the duplicates add zeros
        grads = {"table": osa.IndexedRows(jnp.asarray(ids), jnp.asarray(values), rows)}
        with osa.use_kernels(True):
            reference = two_calls(params, state, grads)
        for threads in (1, 2, 3, 4):
            with osa.use_kernels(True, threads=threads):
                got = fused(params, state, grads)
            try:
                assert_trees_equal(got, reference)
            except AssertionError as error:
                raise AssertionError(f"the big row's id {big}, {threads} threads") from error


@needs_kernels
@pytest.mark.parametrize("adam", sorted(ADAMS))
def test_threads_give_the_same_numbers(adam):
    """Both doors' kernels on 1 and 4 threads: bitwise the same numbers, and the XLA path's within
    test_native_equals_xla's bounds (a thread count other than the machine's default against the reference)."""
    steps = _steps("dups", 4096, n=2, seed=6)
    tx = ADAMS[adam](0.1)
    with osa.use_kernels(True, threads=1):
        one = _run(tx, steps, fused=True)
        one_unfused = _run(tx, steps, fused=False)
    with osa.use_kernels(True, threads=4):
        four = _run(tx, steps, fused=True)
        four_unfused = _run(tx, steps, fused=False)
    with osa.use_kernels(False):
        xla = _run(tx, steps, fused=False)
    assert_trees_equal(one[:2], four[:2])
    # The two-call path's scatter-add splits rows over threads too: same sums, same order.
    assert_trees_equal(one_unfused[:2], four_unfused[:2])
    assert_trees_equal(one[1], four_unfused[1])
    _assert_same(four_unfused, xla, len(steps), 0.1)
    _assert_same((*four[:2], None), xla, len(steps), 0.1)


@needs_kernels
@pytest.mark.parametrize("fused", [False, True])
def test_a_broken_unique_promise_is_summed_like_no_promise(fused):
    """The kernels check a user's ``unique_indices=True``: duplicates are summed, never raced over threads."""
    steps = _steps("dups", 4096, n=2, seed=8)
    tx = osa.sparse_adam(0.1)
    with osa.use_kernels(True, threads=4):
        promised = _run(tx, steps, fused=fused, unique=True)
        plain = _run(tx, steps, fused=fused, unique=False)
    assert_trees_equal(promised[:2], plain[:2])


@needs_kernels
def test_apply_updates_sums_duplicates_in_entry_order_on_any_thread_count():
    """Rows split over threads by key: each row's duplicates still summed in entry order, as XLA does."""
    rng = np.random.default_rng(7)
    k = 8192
    table = jnp.asarray(rng.standard_normal((NUM_ROWS, WIDTH)), jnp.float32)
    ids = jnp.asarray(rng.integers(-3, NUM_ROWS + 3, k), jnp.int32)
    values = jnp.asarray(rng.standard_normal((k, WIDTH)) * 1e3, jnp.float32)
    g = osa.IndexedRows(ids, values, NUM_ROWS)
    out = {}
    for name, enabled, threads in [("xla", False, 1), ("one", True, 1), ("four", True, 4)]:
        with osa.use_kernels(enabled, threads=threads):
            out[name] = jax.jit(osa.apply_updates)(table, g)
    assert_trees_equal(out["one"], out["xla"])
    assert_trees_equal(out["four"], out["xla"])


@needs_kernels
def test_apply_updates_of_distinct_keys_splits_them_by_position_and_a_broken_promise_is_summed():
    """Keys known distinct (the user's unique_indices, checked; the updates of tx.update, trusted) are split over
    the threads by position: the table equals XLA's on one thread and four, padding and out-of-range keys
    dropped; keys that repeat under a unique_indices promise are summed as without it, in entry order. (The
    trusted updates of tx.update: test_native_equals_xla's two calls.)"""
    rng = np.random.default_rng(8)
    k = 8192
    table = jnp.asarray(rng.standard_normal((NUM_ROWS, WIDTH)), jnp.float32)
    distinct = rng.permutation(NUM_ROWS + 6).astype(np.int32) - 3  # -3 .. NUM_ROWS + 2: some padding
    repeated = rng.integers(0, NUM_ROWS, k).astype(np.int32)
    values = rng.standard_normal((k, WIDTH)) * 1e3
    out = {}
    for kind, ids, unique in [("distinct", distinct, True), ("broken", repeated, True), ("plain", repeated, False)]:
        rows = jnp.asarray(values[: len(ids)], jnp.float32)
        if kind == "distinct":  # padding rows zero, as unique_indices promises
            rows = jnp.where((jnp.asarray(ids) >= 0)[:, None], rows, 0.0)
        g = osa.IndexedRows(jnp.asarray(ids), rows, NUM_ROWS, unique_indices=unique)
        for name, enabled, threads in [("xla", False, 1), ("one", True, 1), ("four", True, 4)]:
            with osa.use_kernels(enabled, threads=threads):
                out[kind, name] = jax.jit(osa.apply_updates)(table, g)
    for kind in ("distinct", "plain"):
        assert_trees_equal(out[kind, "one"], out[kind, "xla"])
        assert_trees_equal(out[kind, "four"], out[kind, "xla"])
    assert_trees_equal(out["broken", "one"], out["plain", "xla"])
    assert_trees_equal(out["broken", "four"], out["plain", "xla"])


@pytest.mark.parametrize("threads", [0, 17, 1.5, True])
def test_threads_out_of_range_raise(threads):
    with pytest.raises(ValueError, match="threads"), osa.use_kernels(True, threads=threads):
        pass


def _step_fn(tx, fused, num_rows=NUM_ROWS):
    def step(params, state, ids, values):
        grads = osa.IndexedRows(ids, values, num_rows)
        if fused:
            return osa.update_and_apply(tx, grads, state, params)
        updates, state = tx.update(grads, state, params)
        return osa.apply_updates(params, updates), state

    return step


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_lowers_for_gpu_and_tpu_without_the_cpu_kernel(fused, platform):
    tx = osa.sparse_adam(0.1)
    table = jnp.zeros((NUM_ROWS, WIDTH), jnp.float32)
    args = (table, tx.init(table), jnp.zeros((8,), jnp.int32), jnp.ones((8, WIDTH), jnp.float32))
    traced = jax.jit(_step_fn(tx, fused)).trace(*args)
    assert (PREFIX in traced.lower(lowering_platforms=("cpu",)).as_text()) == _kernel_path.enabled()
    text = traced.lower(lowering_platforms=(platform,)).as_text()
    assert PREFIX not in text
    assert "scatter" in text  # the XLA path


def _selections(jaxpr) -> list:
    """The selections (``_kernel_path.select_p``) of a jaxpr, at every depth (inside jit, cond, loops, ...)."""
    return [eqn for eqn in all_eqns(jaxpr) if eqn.primitive is _kernel_path.select_p]


@needs_kernels
@pytest.mark.parametrize("fused", [False, True])
def test_the_branches_of_a_selection_hold_no_selection(fused):
    """Wherever a selection's XLA branch runs (another platform, an export, a derivative), so do those of the
    selections inside it: the branch is traced without kernels, and a step traces each rule once on each path
    (with the kernel's branch traced inside every XLA branch as well, a catch-up AdamW step under a schedule on 26
    tables took 41 s to trace rather than 19). The kernel's branch runs only where the CPU alone is lowered for, and
    is never differentiated: a selection inside it traces its kernel alone (its XLA branch could never run). The
    kernel's branch holds the kernel, and the fused step's fallback for the rows it flags the steps kernel."""
    tx = osa.sparse_adamw(optax.linear_schedule(0.1, 0.01, 10), weight_decay=0.3, catch_up=True)
    table = jnp.zeros((NUM_ROWS, WIDTH), jnp.float32)
    args = (table, tx.init(table), jnp.zeros((8,), jnp.int32), jnp.ones((8, WIDTH), jnp.float32))
    outer = _selections(jax.make_jaxpr(_step_fn(tx, fused))(*args))
    assert outer
    for eqn in outer:
        assert not _selections(eqn.params["xla"])
        assert not _selections(eqn.params["native"])
    kernel = PREFIX + _kernel_of("adamw catch_up", fused)
    assert any(kernel in str(eqn.params["native"]) for eqn in outer)
    if fused:
        assert any(PREFIX + "catch_up_adam_steps" in str(eqn.params["native"]) for eqn in outer)


@needs_kernels
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("adam", sorted(ADAMS))
def test_in_place_and_compiled_once(fused, adam):
    """With donation the kernel updates the tables in place: temporaries do not grow with the table."""
    tx = ADAMS[adam](0.1)
    sizes = {}
    # The 1,000-row step is also the one called below, three times: it must not trace (compile) again.
    traced_once = jit_once(_step_fn(tx, fused, 1_000), donate_argnums=(0, 1))
    for rows in (1_000, 100_000):
        table = jnp.zeros((rows, 16), jnp.float32)
        args = (table, tx.init(table), jnp.zeros((256,), jnp.int32), jnp.ones((256, 16), jnp.float32))
        step = traced_once if rows == 1_000 else jax.jit(_step_fn(tx, fused, rows), donate_argnums=(0, 1))
        compiled = step.lower(*args).compile()
        text = compiled.as_text()
        assert f"{PREFIX}{_kernel_of(adam, fused)}" in text
        sizes[rows] = compiled.memory_analysis().temp_size_in_bytes
    assert sizes[100_000] == sizes[1_000] < 100_000 * 16 * 4 / 10  # independent of the table, and small

    rng = np.random.default_rng(10)
    table = jnp.zeros((1_000, 16), jnp.float32)
    params, state = table, tx.init(table)
    for _ in range(3):
        ids = rng.integers(-3, 1_003, 256).astype(np.int32)
        ids[:85] = ids[rng.integers(0, 256, 85)]  # duplicates and padding
        values = rng.standard_normal((256, 16)).astype(np.float32)
        params, state = traced_once(params, state, jnp.asarray(ids), jnp.asarray(values))


@needs_kernels
@pytest.mark.parametrize("adam", ["adam", "adamw"])
def test_row_sharded_table_stays_sharded_on_both_calls(adam):
    """Tables split by rows over 8 devices: each device updates its own rows; numbers as on one device (AdamW's
    rows kernel reads the parameters' rows too, its blocks taken from the moments)."""
    mesh = jax.make_mesh((8,), ("rows",), axis_types=(jax.sharding.AxisType.Auto,))
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("rows", None))
    tx = ADAMS[adam](0.1)
    steps = _steps("dups", 64, n=2, seed=8)
    num_rows = 96  # divisible by 8
    outs = []
    for fused in (False, True):
        for shard in (False, True):
            table = jnp.linspace(-1.0, 1.0, num_rows * WIDTH, dtype=jnp.float32).reshape(num_rows, WIDTH)
            if shard:
                table = jax.device_put(table, rows)
            state = tx.init(table)
            step = jax.jit(_step_fn(tx, fused, num_rows))
            text = step.lower(table, state, *map(jnp.asarray, steps[0])).compile().as_text()
            assert f"{PREFIX}{_kernel_of(adam, fused)}" in text
            for ids, values in steps:
                table, state = step(table, state, jnp.asarray(ids), jnp.asarray(values))
            if shard:
                assert table.sharding.is_equivalent_to(rows, 2)
                assert optax.tree.get(state, "mu").sharding.is_equivalent_to(rows, 2)
            outs.append((table, state))
    for a, b in (outs[:2], outs[2:]):
        assert_trees_equal(a, b)
    np.testing.assert_array_max_ulp(np.asarray(outs[0][0]), np.asarray(outs[2][0]), maxulp=1)


@needs_kernels
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("adam", sorted(ADAMS))
def test_vmapped_step_equals_xla(fused, adam):
    """Under vmap the kernel runs once per batch element (no batching rule is needed from the caller)."""
    tx = ADAMS[adam](0.1)
    step = _step_fn(tx, fused)
    tables = jnp.linspace(-1.0, 1.0, 2 * NUM_ROWS * WIDTH, dtype=jnp.float32).reshape(2, NUM_ROWS, WIDTH)
    ids = jnp.asarray([[1, 1, 2, -1], [3, NUM_ROWS, 3, 5]], jnp.int32)
    values = jnp.ones((2, 4, WIDTH), jnp.float32)
    outs = []
    for kernels in (True, False):
        with osa.use_kernels(kernels):
            outs.append(jax.jit(jax.vmap(step))(tables, jax.vmap(tx.init)(tables), ids, values))
    assert_trees_equal(outs[0][1], outs[1][1])
    np.testing.assert_array_max_ulp(np.asarray(outs[0][0]), np.asarray(outs[1][0]), maxulp=1)


# --- Derivatives: the native path differentiates as the XLA path (its JVP is the XLA path's). ---


def _grad_case(case: str):
    """``f(x)`` for one way of reaching a kernel, and its argument: a scalar loss of the step's results."""
    ids = jnp.asarray([1, 4, 1, -1, NUM_ROWS, 7], jnp.int32)
    values = jnp.asarray(np.random.default_rng(9).standard_normal((6, WIDTH)), jnp.float32)
    table = jnp.linspace(-1.0, 1.0, NUM_ROWS * WIDTH, dtype=jnp.float32).reshape(NUM_ROWS, WIDTH)
    tx = osa.sparse_adam(0.1)
    state = tx.init(table)
    state = tx.update(osa.IndexedRows(ids[::-1], values, NUM_ROWS), state, table)[1]  # nonzero moments

    def loss(p, s):
        return jnp.sum(jnp.sin(p)) + sum(jnp.sum(jnp.sqrt(x + 1.0)) for x in jax.tree.leaves((s[0].mu, s[0].nu)))

    g = osa.IndexedRows(ids, values, NUM_ROWS)
    if case == "update":

        def f(x):
            updates, s = tx.update(osa.IndexedRows(ids, x[1], NUM_ROWS), state, x[0])
            return loss(osa.apply_updates(x[0], updates), s)

        return f, (table, values)
    if case == "update_and_apply":
        return (lambda x: loss(*osa.update_and_apply(tx, osa.IndexedRows(ids, x[1], NUM_ROWS), state, x[0]))), (
            table,
            values,
        )
    if case == "add":
        return (lambda x: jnp.sum(jnp.sin(x[0] + osa.IndexedRows(ids, x[1], NUM_ROWS)))), (table, values)
    assert case == "learning_rate"  # hypergradients, through both calls and the fused step
    injected = optax.inject_hyperparams(osa.sparse_adam)(learning_rate=0.1)
    inj_state = injected.init(table)

    def f(lr):
        s = optax.tree.set(inj_state, learning_rate=lr)
        updates, _ = injected.update(g, s, table)
        fused, _ = osa.update_and_apply(injected, g, s, table)
        return jnp.sum(jnp.sin(osa.apply_updates(table, updates))) + jnp.sum(jnp.cos(fused))

    return f, jnp.asarray(0.1, jnp.float32)


@needs_kernels
@pytest.mark.parametrize("case", ["update", "update_and_apply", "add", "learning_rate"])
def test_gradients_equal_the_xla_paths(case):
    f, x = _grad_case(case)
    tangent = jax.tree.map(jnp.ones_like, x)
    with osa.use_kernels(True):  # jitted reverse mode, and forward and reverse mode op by op
        got = (jax.jit(jax.grad(f))(x), jax.jvp(f, (x,), (tangent,))[1], jax.grad(f)(x))
    with osa.use_kernels(False):  # the reference, jitted (op by op it is the same computation)
        grad = jax.jit(jax.grad(f))(x)
        want = (grad, jax.jit(lambda x, t: jax.jvp(f, (x,), (t,))[1])(x, tangent), grad)
    # The same XLA computation both ways, compiled in other contexts (XLA:CPU may fuse and round apart).
    assert_trees_equal(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("fused", [False, True])
def test_reverse_mode_takes_a_step_of_fewer_than_1024_ids_forward_mode_any(fused):
    """A step's learning-rate derivative, against its closed form: Adam's first step from a zeroed state moves each
    touched row by ``-lr u`` with ``u`` free of ``lr``, so ``d/dlr sum(p**2) = -2 sum(p (p0 - p)) / lr``. Reverse
    mode takes a leaf of 1,023 ids; a leaf of 2,048 the XLA path processes in chunks as far as it holds rows, a loop
    whose trip count is read from the data, which JAX differentiates in forward mode only (the docs say so)."""
    rng = np.random.default_rng(3)
    p0 = jnp.asarray(rng.normal(size=(4096, 4)).astype(np.float32))
    lr = jnp.float32(0.1)

    def loss(lr: jax.Array, ids: jax.Array, values: jax.Array) -> jax.Array:
        tx = osa.sparse_adam(lr)
        grads = osa.IndexedRows(ids, values, 4096)
        if fused:
            p, _ = osa.update_and_apply(tx, grads, tx.init(p0), p0)
        else:
            updates, _ = tx.update(grads, tx.init(p0), p0)
            p = osa.apply_updates(p0, updates)
        return jnp.sum(p**2)

    for k in (1023, 2048):
        ids = jnp.asarray(rng.integers(0, 4096, k).astype(np.int32))
        values = jnp.asarray(rng.normal(size=(k, 4)).astype(np.float32))
        with osa.use_kernels(False):
            tx = osa.sparse_adam(lr)
            p = osa.update_and_apply(tx, osa.IndexedRows(ids, values, 4096), tx.init(p0), p0)[0]
        want = float(-2 * jnp.sum(p * (p0 - p)) / lr)
        forward = jax.jit(lambda lr, i, v: jax.jvp(lambda x: loss(x, i, v), (lr,), (jnp.float32(1.0),))[1])
        np.testing.assert_allclose(forward(lr, ids, values), want, rtol=1e-4)
        reverse = jax.jit(jax.grad(loss))
        if k < 1024:
            np.testing.assert_allclose(reverse(lr, ids, values), want, rtol=1e-4)
        else:
            with pytest.raises(ValueError, match="Reverse-mode differentiation does not work"):
                reverse(lr, ids, values)


# --- jax.export: an exported step takes the XLA path, so the artifact runs without this library. ---


@pytest.mark.parametrize("fused", [False, True])
def test_exported_step_runs_the_xla_path(kernel_path, fused):
    tx = osa.sparse_adam(0.1)
    steps = _steps("dups", 16, n=1)
    table = jnp.linspace(-1.0, 1.0, NUM_ROWS * WIDTH, dtype=jnp.float32).reshape(NUM_ROWS, WIDTH)
    args = (table, tx.init(table), *map(jnp.asarray, steps[0]))
    step = jax.jit(_step_fn(tx, fused))
    exported = jax.export.export(step)(*args)
    assert PREFIX not in exported.mlir_module()
    with osa.use_kernels(False):
        expected = jax.jit(_step_fn(tx, fused))(*args)
    assert_trees_equal(exported.call(*args), expected)
    # Jitted as usual, the same step still runs the kernel.
    assert (PREFIX in step.lower(*args).as_text()) == (kernel_path == "native-cpu")


# --- One rule for what every path accepts. ---


@pytest.mark.parametrize("fused", [False, True])
def test_narrow_indices_refused_on_every_path(kernel_path, fused):
    """uint8 indices cannot mark padding (300) for a 300-row table: the same TypeError from every call."""
    tx = osa.sparse_adam(0.1)
    table = jnp.zeros((300, WIDTH), jnp.float32)
    g = osa.IndexedRows(jnp.asarray([1, 2], jnp.uint8), jnp.ones((2, WIDTH), jnp.float32), 300)
    with pytest.raises(TypeError, match="indices of dtype uint8 cannot mark padding"):
        _step_fn(tx, fused, 300)(table, tx.init(table), g.indices, g.values)


# --- Fuzz: what holds between the kernels and the XLA path, one step from the same state. ---


def _ulps(x, y, *scales):
    """``|x - y|`` in units of ``np.spacing`` of the largest magnitude among ``scales``."""
    unit = np.spacing(np.max(np.stack([np.abs(np.asarray(s, np.float32)) for s in scales]), axis=0))
    return np.abs(np.asarray(x, np.float32) - np.asarray(y, np.float32)) / unit


@needs_kernels
@pytest.mark.slow
@pytest.mark.parametrize(("width", "threads"), [(1, 1), (5, 1), (63, 7), (513, 7)])
def test_fuzz_native_against_xla(width, threads):
    """nu bitwise; mu within one ulp of the larger of its old and new values; the parameters within two ulps
    of themselves plus two of the update. From the same state, each implementation stepping once."""
    lr, rows = 0.05, 37
    for maximize, eps_placement in itertools.product([False, True], ["optax", "torch"]):
        rng = np.random.default_rng([width, maximize, eps_placement == "torch", threads])
        k = int(rng.integers(1, 65))
        batches = []
        for _ in range(3):
            ids = rng.integers(-3, rows + 3, k).astype(np.int32)
            ids[: k // 3] = ids[rng.integers(0, k, k // 3)]
            batches.append((jnp.asarray(ids), jnp.asarray(rng.standard_normal((k, width)), jnp.float32)))
        tx = osa.sparse_adam(lr, maximize=maximize, eps_placement=eps_placement)
        p = jnp.linspace(-1.0, 1.0, rows * width, dtype=jnp.float32).reshape(rows, width)
        s = tx.init(p)

        @jax.jit  # one program for the three XLA steps, which also returns the last step's update
        def xla_step(p, s, ids, values, tx=tx):
            updates, s = tx.update(osa.IndexedRows(ids, values, rows), s, p)
            return osa.apply_updates(p, updates), s, updates

        with osa.use_kernels(False):
            for ids, values in batches[:2]:
                p, s, _ = xla_step(p, s, ids, values)
            xp, xs, u = xla_step(p, s, *batches[2])
        for fused in (False, True):
            with osa.use_kernels(True, threads=threads):
                np_, ns = jax.jit(_step_fn(tx, fused, rows))(p, s, *batches[2])
            case = (maximize, eps_placement, threads, fused)
            np.testing.assert_array_equal(ns[0].nu, xs[0].nu, err_msg=str(case))
            assert np.all(_ulps(ns[0].mu, xs[0].mu, s[0].mu, xs[0].mu) <= 1), case
            tol = 2 * (np.spacing(np.maximum(np.abs(p), np.abs(xp))) + np.spacing(np.abs(u.todense())))
            assert np.all(np.abs(np.asarray(np_) - np.asarray(xp)) <= tol), case
