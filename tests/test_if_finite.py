"""osa.apply_if_finite: optax.apply_if_finite's transformation, whose step update_and_apply fuses.

The reference is optax's wrapper itself through the two calls (tx.update, then apply_updates), over steps that
mix finite gradients, NaN and infinity in a table's rows, in its padding entries and in a dense leaf, and a streak
of non-finite steps longer than max_consecutive_errors (whose last step is applied, NaN and all).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_sparse_adam as osa
from optax_sparse_adam._kernel_path import PREFIX
from tests.helpers import assert_trees_equal, checking_leaks, jit_once, needs_kernels

ROWS, WIDTH, K = 40, 8, 12
INNER = {
    "sparse_adam": lambda: osa.sparse_adam(0.05),
    "sparse_rowwise_adagrad": lambda: osa.sparse_rowwise_adagrad(0.1),
    "clip, sparse_adam": lambda: optax.chain(osa.sparse_aware(optax.clip_by_global_norm(1.0)), osa.sparse_adam(0.05)),
}
# What each step's gradient holds: finite, or a non-finite value where named.
PLAN = ["finite", "nan row", "finite", "inf dense", "nan padding", "nan row", "inf row", "finite", "finite"]
PATHS = ["xla", pytest.param("native-cpu", marks=needs_kernels)]


def _batches() -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(3)
    out = []
    for kind in PLAN:
        ids = rng.integers(0, ROWS, K).astype(np.int32)
        ids[-2:] = -1  # padding
        values = rng.standard_normal((K, WIDTH)).astype(np.float32)
        dense = rng.standard_normal(3).astype(np.float32)
        if kind == "nan row":
            values[1, 2] = np.nan
        elif kind == "inf row":
            values[0, 0] = -np.inf
        elif kind == "nan padding":
            values[-1, 0] = np.nan  # optax's wrapper inspects every array, padding entries included
        elif kind == "inf dense":
            dense[1] = np.inf
        out.append((ids, values, dense))
    return out


def _train(tx: optax.GradientTransformation, fused: bool) -> tuple[object, object]:
    params = {"emb": jnp.linspace(-1, 1, ROWS * WIDTH, dtype=jnp.float32).reshape(ROWS, WIDTH)}
    params["w"] = jnp.ones((3,), jnp.float32)
    state = tx.init(params)

    def step(params, state, ids, values, dense):
        grads = {"emb": osa.IndexedRows(ids, values, ROWS), "w": dense}
        if fused:
            return osa.update_and_apply(tx, grads, state, params)
        updates, state = tx.update(grads, state, params)
        return osa.apply_updates(params, updates), state

    step = jit_once(step, donate_argnums=(0, 1))
    for batch in _batches():
        params, state = step(params, state, *map(jnp.asarray, batch))
    return params, state


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("inner", list(INNER))
def test_fused_step_equals_optax_apply_if_finite(inner, path):
    """Skipped steps leave parameters and inner state as they were; the counters are optax's; the applied steps
    (the streak's last one too, which writes NaN into its rows) are the inner optimizer's."""
    with osa.use_kernels(path == "native-cpu"):
        ours = _train(osa.apply_if_finite(INNER[inner](), max_consecutive_errors=1), fused=True)
        theirs = _train(optax.apply_if_finite(INNER[inner](), max_consecutive_errors=1), fused=False)
    (p, s), (p_ref, s_ref) = ours, theirs
    assert isinstance(s, optax.ApplyIfFiniteState)
    assert (int(s.notfinite_count), int(s.total_notfinite), bool(s.last_finite)) == (0, 5, True)
    assert_trees_equal(s._replace(inner_state=None), s_ref._replace(inner_state=None))
    # With max_consecutive_errors=1 the second non-finite step in a row is applied: its NaN reaches the table.
    assert np.isnan(np.asarray(p["emb"])).any()
    if path == "xla" and inner != "sparse_rowwise_adagrad":
        assert_trees_equal((p, s.inner_state), (p_ref, s_ref.inner_state))
    else:
        # The fused kernels against the two calls (see update_and_apply's bounds); and on the XLA path row-wise
        # Adagrad's dense leaf, whose multiply-adds XLA:CPU contracts per program (seen: one ulp).
        assert_trees_equal((p, s.inner_state), (p_ref, s_ref.inner_state), rtol=2e-6, atol=1e-7)


def test_update_is_optax_apply_if_finite_bitwise():
    """tx.update is optax's own: the two calls give optax's results bitwise, and the state types are the same."""
    ours = _train(osa.apply_if_finite(osa.sparse_adam(0.05), 1), fused=False)
    theirs = _train(optax.apply_if_finite(osa.sparse_adam(0.05), 1), fused=False)
    assert_trees_equal(ours, theirs)


@needs_kernels
@pytest.mark.parametrize("plain", [False, True], ids=["optimizer", "plain GradientTransformation"])
def test_fused_in_place_under_the_cond(plain):
    """The inner step runs in lax.cond's accepting branch: fused, and the donated tables are not copied; an inner
    optimizer handed over as a plain ``optax.GradientTransformation`` (no extra-args support) too."""
    inner = osa.sparse_adam(0.05)
    tx = osa.apply_if_finite(optax.GradientTransformation(inner.init, inner.update) if plain else inner, 3)
    params = {"emb": jnp.zeros((100_000, 16), jnp.float32)}
    state = tx.init(params)
    grads = {"emb": osa.IndexedRows(jnp.zeros(64, jnp.int32), jnp.ones((64, 16), jnp.float32), 100_000)}
    step = jax.jit(lambda p, s, g: osa.update_and_apply(tx, g, s, p), donate_argnums=(0, 1))
    with osa.use_kernels(True):
        report = osa.step_report(step, params, state, grads)
    assert report.fused and report.in_place, str(report)
    assert "sparse_adam_rows" not in report.kernels


@needs_kernels
def test_the_finiteness_kernel_on_threads_and_under_vmap():
    """The check's kernel on 1 and 3 threads (three parts of about 87,467 elements: a NaN inside the third, an
    infinity at the last element, one at the first element of the second part) and under vmap (once per element)
    decides as ``all(isfinite(x))``, as the XLA path does."""
    from optax_sparse_adam._if_finite import is_finite

    n = 4100 * 64
    x = np.full((4, n), -3.5, np.float32)
    x[1, 200_000], x[2, n - 1], x[3, n // 3] = np.nan, -np.inf, np.inf
    want = [True, False, False, False]
    for enabled, threads in ((True, 1), (True, 3), (False, 1)):
        with osa.use_kernels(enabled, threads=threads):
            one, batched = jax.jit(is_finite), jax.jit(jax.vmap(is_finite))
            for jitted, arg in ((one, x[0]), (batched, x)):
                assert (PREFIX + "all_finite" in jitted.lower(arg).as_text()) == enabled
            assert [bool(one(row)) for row in x] == want, (enabled, threads)
            assert np.asarray(batched(x)).tolist() == want, (enabled, threads)


def test_the_finiteness_check_is_optaxs(kernel_path):
    """``is_finite`` (a vectorizable ``sum(x * 0)`` per array; on the CPU's native path a kernel for a large float32
    array, split over the threads) decides as optax's ``all(isfinite(x))`` does: on infinities of either sign and
    NaN anywhere in an array (in a block of gradient rows too, and in either thread's part of a larger one), the
    largest finite floats, negative zeros and subnormals, low-precision and complex arrays, integer arrays and
    empty ones."""
    from optax_sparse_adam._if_finite import is_finite

    f32 = np.finfo(np.float32)
    base = {
        "big": np.array([f32.max, -f32.max, f32.max], np.float32),
        "small": np.array([-0.0, f32.smallest_subnormal, -f32.tiny], np.float32),
        "half": jnp.asarray([6.5e4, -6.5e4], jnp.float16),
        "bf16": jnp.asarray([3e38, 1.0], jnp.bfloat16),
        "complex": np.array([1e38 + 1e38j, -0.0j], np.complex64),
        "ids": np.array([2**31 - 1, -1], np.int32),
        "empty": np.zeros((0, 3), np.float32),
        "rows": np.ones((1024, 64), np.float32),  # a batch's gradient rows: vectorized reductions
        "more rows": np.full((4100, 64), -3.5, np.float32),  # two threads' parts, blocks and a partial one
    }
    cases = [base]
    for row in (0, 517, 1023):
        for bad in (np.inf, -np.inf, np.nan):
            x = np.ones((1024, 64), np.float32)
            x[row, row % 64] = bad
            cases.append(dict(base, rows=x))
    for at in (0, 131_071, 131_072, 200_000, 4100 * 64 - 1):
        x = np.full(4100 * 64, -3.5, np.float32)
        x[at] = np.nan if at % 2 else -np.inf
        cases.append(dict(base, **{"more rows": x.reshape(4100, 64)}))
    for name in ("big", "small", "half", "bf16", "complex"):
        for bad in (np.inf, -np.inf, np.nan, complex(np.inf, 0), complex(0, np.nan)):
            if name != "complex" and isinstance(bad, complex):
                continue
            x = np.array(base[name])
            x[-1] = bad
            cases.append(dict(base, **{name: jnp.asarray(x, base[name].dtype)}))
    want = [bool(jnp.all(jnp.array([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(t)]))) for t in cases]
    got = [bool(jax.jit(is_finite)(t)) for t in cases]
    assert got == want
    assert want[0] and not any(want[1:])
    kernels = set(re.findall(PREFIX + r"(\w+)", jax.jit(is_finite).lower(base).as_text()))
    assert kernels == ({"all_finite"} if kernel_path == "native-cpu" else set()), kernels  # the two large arrays'


_STAGED_IN_A_COND = {
    "optax.apply_if_finite(chain(clip, sparse_adam))": lambda: optax.apply_if_finite(
        optax.chain(osa.sparse_aware(optax.clip_by_global_norm(1.0)), osa.sparse_adam(0.1)), 2
    ),
    "optax.apply_if_finite(chain(scale, sparse_adam))": lambda: optax.apply_if_finite(
        optax.chain(osa.sparse_aware(optax.scale(0.5)), osa.sparse_adam(0.1)), 2
    ),
    "chain(osa.apply_if_finite(chain(clip, sparse_adam)))": lambda: optax.chain(
        osa.apply_if_finite(optax.chain(osa.sparse_aware(optax.clip_by_global_norm(1.0)), osa.sparse_adam(0.1)), 2)
    ),
    "optax.apply_if_finite(chain(clip, sparse_rowwise_adagrad))": lambda: optax.apply_if_finite(
        optax.chain(osa.sparse_aware(optax.clip_by_global_norm(1.0)), osa.sparse_rowwise_adagrad(0.1)), 2
    ),
}


@pytest.mark.parametrize("name", list(_STAGED_IN_A_COND))
def test_a_stage_and_optimizer_inside_a_cond_take_the_two_calls(name, kernel_path):
    """A stage before the optimizer, both inside a wrapper's ``lax.cond`` (optax's ``apply_if_finite``, or this
    library's nested in a chain): ``update_and_apply`` takes the two calls, bitwise (the fused step looked into
    the branch's recorded calls, whose values belong to the branch's trace, and raised UnexpectedTracerError on the
    native path); and no value of the branch's trace outlives it (``jax.checking_leaks``: the record of the call
    held them, "Leaked trace")."""
    tx = _STAGED_IN_A_COND[name]()
    params = {"a": jnp.ones((8, 2), jnp.float32), "w": jnp.full((3,), 0.5, jnp.float32)}
    grads = {
        "a": osa.IndexedRows(jnp.array([1, 2, 2, 8], jnp.int32), jnp.arange(8.0, dtype=jnp.float32).reshape(4, 2), 8),
        "w": jnp.array([1.0, -2.0, 3.0], jnp.float32),
    }
    state = tx.init(params)

    def two_calls(p, s, g):
        updates, s = tx.update(g, s, p)
        return osa.apply_updates(p, updates), s

    for bad in (False, True):
        g = grads if not bad else {**grads, "w": grads["w"].at[1].set(jnp.nan)}
        with checking_leaks():
            got = jax.jit(lambda p, s, g: osa.update_and_apply(tx, g, s, p))(params, state, g)
        assert_trees_equal(got, jax.jit(two_calls)(params, state, g))
        state = got[1]


_NARROW = {
    "sparse_rowwise_adagrad, float32 table": (lambda: osa.sparse_rowwise_adagrad(0.1), jnp.float32),
    "sparse_rowwise_adam, float32 table": (lambda: osa.sparse_rowwise_adam(0.05), jnp.float32),
    "sparse_rowwise_adagrad, bfloat16 table": (lambda: osa.sparse_rowwise_adagrad(0.1), jnp.bfloat16),
}


@pytest.mark.parametrize("fused", [False, True], ids=["two calls", "fused"])
@pytest.mark.parametrize("name", list(_NARROW))
def test_a_row_wise_optimizer_of_a_narrow_gradient(name, fused, kernel_path):
    """A row-wise optimizer returns a bfloat16 gradient's update in float32: the skipped step's zeros take the
    update's types (optax's own wrapper, whose zeros take the gradient's, fails in ``lax.cond``). Every non-finite
    step skipped (max_consecutive_errors is 10): the result is the inner optimizer's over the finite steps alone,
    through the same door."""
    make, table_dtype = _NARROW[name]
    params = {"emb": jnp.linspace(-1, 1, ROWS * WIDTH, dtype=jnp.float32).reshape(ROWS, WIDTH).astype(table_dtype)}

    def train(tx: optax.GradientTransformation, batches: list) -> tuple[object, object]:
        state = tx.init(params)

        def step(p, s, ids, values):
            grads = {"emb": osa.IndexedRows(ids, values.astype(jnp.bfloat16), ROWS)}
            if fused:
                return osa.update_and_apply(tx, grads, s, p)
            updates, s = tx.update(grads, s, p)
            return osa.apply_updates(p, updates), s

        step = jax.jit(step)
        p = params
        for ids, values, _ in batches:
            p, state = step(p, state, jnp.asarray(ids), jnp.asarray(values))
        return p, state

    batches = [b for b, kind in zip(_batches(), PLAN, strict=True) if kind != "inf dense"]
    finite = [b for b in batches if np.isfinite(b[1]).all()]
    p, s = train(osa.apply_if_finite(make(), max_consecutive_errors=10), batches)
    p_ref, s_ref = train(make(), finite)
    assert (int(s.total_notfinite), int(s.notfinite_count)) == (len(batches) - len(finite), 0)
    assert_trees_equal((p, s.inner_state), (p_ref, s_ref))
    if not fused:  # optax's wrapper, for the record: the reason for the repair
        with pytest.raises(TypeError, match="cond branches"):
            train(optax.apply_if_finite(make(), max_consecutive_errors=10), batches[:1])


def test_update_keeps_optaxs_zeros_where_they_fit():
    """Where optax's zeros have the inner update's shapes and dtypes they are the skipped step's update, with their
    weak types and shardings: a Python float's gradient leaf gives a weakly typed update, which a bfloat16
    parameter adds after rounding it (as optax's two calls do), and a table split over an explicit mesh keeps its
    sharding (``lax.cond`` refuses branches that differ in it). The inner update is traced once, nested too."""
    params = {"b": jnp.asarray(1.0, jnp.bfloat16)}
    grads = {"b": 0.19571786}
    got = []
    for wrap in (osa.apply_if_finite, optax.apply_if_finite):
        tx = wrap(optax.sgd(0.01), max_consecutive_errors=1)
        updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
        assert updates["b"].weak_type
        got.append(osa.apply_updates(params, updates))
    assert_trees_equal(got[0], got[1])

    mesh = jax.make_mesh((2,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,), devices=jax.devices()[:2])
    with jax.set_mesh(mesh):
        split = jax.sharding.NamedSharding(mesh, jax.P("d"))
        params = {"w": jax.device_put(jnp.ones((8, 4)), split)}
        for dtype in (jnp.float32, jnp.bfloat16):  # a bfloat16 gradient's float32 update: zeros of its own types
            grads = {"w": jax.device_put(jnp.full((8, 4), np.nan, dtype), split)}
            for inner in (optax.adam(0.1), osa.sparse_rowwise_adagrad(0.1)):
                tx = osa.apply_if_finite(inner, max_consecutive_errors=1)
                updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
                assert updates["w"].sharding.spec == jax.P("d", None) and int(state.notfinite_count) == 1
                assert updates["w"].dtype == jnp.float32
                assert not np.asarray(updates["w"]).any()

    traces = []

    def counted(u, s, p=None):
        traces.append(1)
        return optax.sgd(0.1).update(u, s, p)

    tx = optax.GradientTransformation(optax.sgd(0.1).init, counted)
    for _ in range(3):
        tx = osa.apply_if_finite(tx, 1)
    jax.jit(tx.update)({"w": jnp.ones(3)}, tx.init({"w": jnp.ones(3)}), {"w": jnp.ones(3)})
    assert len(traces) == 1


def test_a_skipped_fused_step_leaves_the_parameters_and_traces_the_inner_update_once(kernel_path):
    """``update_and_apply``'s skipped step returns the parameters as they were, bitwise: a ``-0.0`` in a table's
    row 0 and in a dense leaf stays (the two calls' zeros turn both into ``0.0``); and it traces the inner update
    once, in the branch that accepts the step, the inner optimizer fused there."""
    traces = []
    inner = osa.sparse_adam(0.05)

    def counted(u, s, p=None):
        traces.append(1)
        return inner.update(u, s, p)

    tx = osa.apply_if_finite(optax.GradientTransformation(inner.init, counted), max_consecutive_errors=3)
    params = {"emb": jnp.ones((ROWS, WIDTH), jnp.float32).at[0].set(-0.0), "w": jnp.array([-0.0, 1.0, 2.0])}
    state = tx.init(params)
    ids, values, dense = _batches()[1]  # a NaN in a row: skipped
    grads = {"emb": osa.IndexedRows(jnp.asarray(ids), jnp.asarray(values), ROWS), "w": jnp.asarray(dense)}
    step = jax.jit(lambda p, s, g: osa.update_and_apply(tx, g, s, p))
    p, s = step(params, state, grads)
    assert len(traces) == 1 and int(s.notfinite_count) == 1
    assert_trees_equal((p, s.inner_state), (params, state.inner_state))
    assert np.signbit(p["emb"][0]).all() and np.signbit(p["w"][0])
    if kernel_path == "native-cpu":
        assert osa.step_report(step, params, state, grads).fused
