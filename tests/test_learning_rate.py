"""The optimizers that are ``chain(stage, sparse_aware(scale_by_learning_rate))`` apply their learning rate inside
the stage's pass (``_learning_rate.with_learning_rate``), and ``sparse_adamw`` and decoupled
``sparse_rowwise_adagrad``, which are ``chain(stage, sparse_aware(add_decayed_weights),
sparse_aware(scale_by_learning_rate))``, their decay too: the chain's numbers and state, a pass or two fewer."""

from __future__ import annotations

import collections
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_sparse_adam as osa
from optax_sparse_adam._sgd import _lazy_trace
from tests.helpers import assert_trees_equal

ROWS, WIDTH, BATCH = 40, 4, 24


_TABLES = {"emb": True, "w": False}  # a decay mask: the table decays, the dense layer does not


# name -> (the optimizer at a learning rate, the stage it chains with that rate).
STAGES: dict[str, tuple[Callable[[Any], optax.GradientTransformation], Callable[[], optax.GradientTransformation]]] = {
    "adam": (lambda lr: osa.sparse_adam(lr), lambda: osa.scale_by_sparse_adam()),
    "amsgrad": (lambda lr: osa.sparse_amsgrad(lr), lambda: osa.scale_by_sparse_amsgrad()),
    "adagrad": (lambda lr: osa.sparse_adagrad(lr), lambda: osa.scale_by_sparse_adagrad()),
    "rowwise_adagrad": (lambda lr: osa.sparse_rowwise_adagrad(lr), lambda: osa.scale_by_rowwise_adagrad()),
    "rowwise_adagrad_l2": (
        lambda lr: osa.sparse_rowwise_adagrad(lr, weight_decay=0.01),
        lambda: osa.scale_by_rowwise_adagrad(weight_decay=0.01),
    ),
    "rowwise_adam": (lambda lr: osa.sparse_rowwise_adam(lr), lambda: osa.scale_by_rowwise_adam()),
    "rowwise_adam_per_row": (
        lambda lr: osa.sparse_rowwise_adam(lr, per_row_bias_correction=True),
        lambda: osa.scale_by_rowwise_adam(per_row_bias_correction=True),
    ),
    "momentum": (lambda lr: osa.sparse_sgd(lr, momentum=0.9), lambda: _lazy_trace(0.9, False, None)),
    "nesterov": (lambda lr: osa.sparse_sgd(lr, momentum=0.9, nesterov=True), lambda: _lazy_trace(0.9, True, None)),
    "rowwise_adagrad_decoupled": (
        lambda lr: osa.sparse_rowwise_adagrad(lr, weight_decay=0.01, weight_decay_mode="decoupled"),
        lambda: osa.scale_by_rowwise_adagrad(),
    ),
    "adamw": (lambda lr: osa.sparse_adamw(lr, weight_decay=0.01), lambda: osa.scale_by_sparse_adam()),
    "adamw_masked": (
        lambda lr: osa.sparse_adamw(lr, weight_decay=0.01, mask=_TABLES),
        lambda: osa.scale_by_sparse_adam(),
    ),
    # float32 parameters, bfloat16 first moments: the rows kernel does not take them, the XLA rule does.
    "adamw_mu_bf16": (
        lambda lr: osa.sparse_adamw(lr, weight_decay=0.01, mu_dtype=jnp.bfloat16),
        lambda: osa.scale_by_sparse_adam(mu_dtype=jnp.bfloat16),
    ),
}
# name -> the stages between the stage and the learning rate in the chain (the decoupled weight decays).
BETWEEN: dict[str, Callable[[], list[optax.GradientTransformation]]] = {
    "rowwise_adagrad_decoupled": lambda: [osa.sparse_aware(optax.add_decayed_weights(0.01))],
    "adamw": lambda: [osa.sparse_aware(optax.add_decayed_weights(0.01))],
    "adamw_masked": lambda: [osa.sparse_aware(optax.add_decayed_weights(0.01, _TABLES))],
    "adamw_mu_bf16": lambda: [osa.sparse_aware(optax.add_decayed_weights(0.01))],
}
RATES = {"constant": 0.05, "schedule": optax.linear_schedule(0.05, 0.01, 4)}


def _pair(name: str, learning_rate: Any) -> tuple[optax.GradientTransformation, optax.GradientTransformation]:
    """The optimizer, and the chain it stands for."""
    make, make_stage = STAGES[name]
    between = BETWEEN.get(name, list)()
    scale = osa.sparse_aware(optax.scale_by_learning_rate(learning_rate))
    return make(learning_rate), optax.chain(make_stage(), *between, scale)


def _grads(rng: np.random.Generator) -> dict[str, Any]:
    """A table's rows with duplicates and padding (ids below 0 and past the table), and a dense leaf."""
    ids = jnp.asarray(rng.integers(-2, ROWS + 3, BATCH), jnp.int32)
    return {
        "emb": osa.IndexedRows(ids, jnp.asarray(rng.standard_normal((BATCH, WIDTH)), jnp.float32), ROWS),
        "w": jnp.asarray(rng.standard_normal((3, WIDTH)), jnp.float32),
    }


@pytest.mark.parametrize("rate", list(RATES))
@pytest.mark.parametrize("name", list(STAGES))
def test_the_learning_rate_inside_the_stages_pass_is_the_chain(kernel_path, name, rate):
    """Each optimizer's tx.update, its learning rate applied inside the stage's pass (on the CPU, by the rows kernel
    to the step rows it writes), gives bitwise the updates and state of the chain of its stage and
    sparse_aware(scale_by_learning_rate), step after step, on a table's rows and on a dense leaf."""
    ours, chain = _pair(name, RATES[rate])
    rng = np.random.default_rng(5)
    params = {
        "emb": jnp.asarray(rng.standard_normal((ROWS, WIDTH)), jnp.float32),
        "w": jnp.asarray(rng.standard_normal((3, WIDTH)), jnp.float32),
    }
    states = [ours.init(params), chain.init(params)]
    steps = [jax.jit(tx.update) for tx in (ours, chain)]
    for _ in range(4):
        grads = _grads(rng)
        (u1, s1), (u2, s2) = (step(grads, s, params) for step, s in zip(steps, states, strict=True))
        assert_trees_equal((s1, u1["w"]), (s2, u2["w"]))
        np.testing.assert_array_equal(u1["emb"].indices, u2["emb"].indices)
        np.testing.assert_array_equal(u1["emb"].values, u2["emb"].values)
        states = [s1, s2]
        params = osa.apply_updates(params, u1)


_ADAMW = (lambda wd, **kw: osa.sparse_adamw(0.05, weight_decay=wd, **kw), osa.scale_by_sparse_adam)
_DECOUPLED = (
    lambda wd, **kw: osa.sparse_rowwise_adagrad(0.05, weight_decay=wd, weight_decay_mode="decoupled", **kw),
    osa.scale_by_rowwise_adagrad,
)
_SCHEDULE = optax.linear_schedule(0.02, 0.001, 3)
# name -> (optimizer and stage, weight decay, the table's shape, its dtype, the gradient's dtype, options).
DECAYS = {
    "adamw width 1": (_ADAMW, 0.01, (ROWS, 1), jnp.float32, jnp.float32, {}),
    "adamw 1-d table": (_ADAMW, 0.01, (ROWS,), jnp.float32, jnp.float32, {}),
    "adamw rows of 3 x 4": (_ADAMW, 0.01, (ROWS, 3, 4), jnp.float32, jnp.float32, {}),
    "adamw maximize, torch's eps": (
        _ADAMW,
        0.01,
        (ROWS, WIDTH),
        jnp.float32,
        jnp.float32,
        {"maximize": True, "eps_placement": "torch"},
    ),
    "decoupled width 1": (_DECOUPLED, 0.01, (ROWS, 1), jnp.float32, jnp.float32, {}),
    # The chain itself runs: a schedule of decays (its count advances), ...
    "adamw decay schedule": (_ADAMW, _SCHEDULE, (ROWS, WIDTH), jnp.float32, jnp.float32, {}),
    "decoupled decay schedule": (_DECOUPLED, _SCHEDULE, (ROWS, WIDTH), jnp.float32, jnp.float32, {}),
    # ... a 16-bit table or gradient (the chain rounds the update to its dtype before the decay).
    "adamw bfloat16 table": (_ADAMW, 0.01, (ROWS, WIDTH), jnp.bfloat16, jnp.bfloat16, {"mu_dtype": jnp.float32}),
    "adamw bfloat16 gradient": (_ADAMW, 0.01, (ROWS, WIDTH), jnp.float32, jnp.bfloat16, {}),
    "decoupled bfloat16 table": (_DECOUPLED, 0.01, (ROWS, WIDTH), jnp.bfloat16, jnp.float32, {}),
    # A literal zero decay is none (add_decayed_weights skips it): an infinite parameter's row still moves.
    "adamw zero decay": (_ADAMW, 0, (ROWS, WIDTH), jnp.float32, jnp.float32, {}),
    "decoupled zero decay": (_DECOUPLED, 0.0, (ROWS, WIDTH), jnp.float32, jnp.float32, {}),
}


@pytest.mark.parametrize("name", list(DECAYS))
def test_the_decays_inside_the_stages_pass_are_the_chain_on_any_table(kernel_path, name):
    """sparse_adamw and decoupled row-wise Adagrad give bitwise the chain's updates and state (their stage, then
    sparse_aware(add_decayed_weights), then the learning rate) on rows of any shape and options; where the decay
    cannot be taken in the stage's pass with the chain's numbers (a schedule, a 16-bit table or gradient) the chain
    runs, and a literal zero decays nothing, as there (a table holding an infinity still moves its other rows)."""
    (make, make_stage), wd, shape, p_dtype, g_dtype, options = DECAYS[name]
    ours = make(wd, **options)
    chain = optax.chain(
        make_stage(**options),
        osa.sparse_aware(optax.add_decayed_weights(wd)),
        osa.sparse_aware(optax.scale_by_learning_rate(0.05)),
    )
    rng = np.random.default_rng(6)
    table = rng.standard_normal(shape).astype(np.float32)
    table[0] = np.inf  # a touched row: with a zero decay, the chain's update is finite there
    params = jnp.asarray(table, p_dtype)
    states = [ours.init(params), chain.init(params)]
    steps = [jax.jit(tx.update) for tx in (ours, chain)]
    for _ in range(3):
        ids = jnp.asarray(np.concatenate([[0], rng.integers(-2, ROWS + 3, BATCH - 1)]), jnp.int32)
        grads = osa.IndexedRows(ids, jnp.asarray(rng.standard_normal((BATCH, *shape[1:])), g_dtype), ROWS)
        (u1, s1), (u2, s2) = (step(grads, s, params) for step, s in zip(steps, states, strict=True))
        assert_trees_equal(s1, s2)
        assert u1.values.dtype == u2.values.dtype
        np.testing.assert_array_equal(u1.indices, u2.indices)
        np.testing.assert_array_equal(np.asarray(u1.values, np.float32), np.asarray(u2.values, np.float32))
        states = [s1, s2]
        params = osa.apply_updates(params, u1)


@pytest.mark.parametrize("make", [_ADAMW[0], _DECOUPLED[0]], ids=["adamw", "decoupled"])
def test_a_decay_schedule_runs_the_chain_through_either_door(make):
    """A weight decay given as a schedule (optax.add_decayed_weights takes one): update_and_apply runs the two calls
    (the kernels take a decay as a number), their numbers exactly; catch-up AdamW says it takes a number."""
    tx = make(_SCHEDULE)
    rng = np.random.default_rng(7)
    params = jnp.asarray(rng.standard_normal((ROWS, WIDTH)), jnp.float32)
    grads = osa.IndexedRows(jnp.asarray(rng.integers(0, ROWS, BATCH), jnp.int32), jnp.ones((BATCH, WIDTH)), ROWS)
    state = tx.init(params)
    fused = jax.jit(lambda p, s, g: osa.update_and_apply(tx, g, s, p))(params, state, grads)
    updates, new_state = jax.jit(tx.update)(grads, state, params)
    assert_trees_equal(fused, (osa.apply_updates(params, updates), new_state))
    with pytest.raises(ValueError, match="constant weight_decay"):
        osa.sparse_adamw(0.05, weight_decay=_SCHEDULE, catch_up=True)


def _row_passes(tx: optax.GradientTransformation, params: jax.Array, grads: osa.IndexedRows) -> list[str]:
    """The operations of tx.update's compiled program (on the CPU) that produce an array of the update rows' shape,
    other than the kernel's own results: each is a pass of XLA's over the rows."""
    text = jax.jit(tx.update).lower(grads, tx.init(params), params).compile().as_text()
    entry = text[text.index("ENTRY") :]
    shape = "f32[{},{}]".format(*grads.values.shape)
    ops = re.findall(r"^\s*(?:ROOT )?%\S+ = " + re.escape(shape) + r"\{[^}]*\} (\S+?)\(", entry, re.MULTILINE)
    return [op for op in ops if op not in ("custom-call", "get-tuple-element", "parameter", "bitcast")]


# The stages a rows kernel takes on one float32 table (a mask of two leaves needs their tree).
KERNEL_STAGES = [name for name in STAGES if name not in ("adamw_masked", "adamw_mu_bf16")]


@pytest.mark.parametrize("name", KERNEL_STAGES)
def test_two_calls_take_no_pass_of_their_own_to_scale_the_rows(name):
    """On the CPU the rows kernel writes the scaled step rows: tx.update's program holds no operation over them of
    its own, where the chain written out multiplies them in a second pass."""
    with osa.use_kernels(True):
        if osa.kernel_path() != "native-cpu":
            pytest.skip("the native kernels were not built (no C++ compiler at install time)")
        ours, chain = _pair(name, 0.05)
        params = jnp.zeros((ROWS, WIDTH), jnp.float32)
        grads = osa.IndexedRows(jnp.zeros((BATCH,), jnp.int32), jnp.ones((BATCH, WIDTH), jnp.float32), ROWS)
        assert _row_passes(ours, params, grads) == []
        assert _row_passes(chain, params, grads) != []  # the check sees the pass it is there to rule out


# name -> (the optimizer at a learning rate or schedule, its program's name).
_EAGER: dict[str, tuple[Callable[[Any], optax.GradientTransformation], str]] = {
    "adam": (lambda lr: osa.sparse_adam(lr), "sparse_adam"),
    "adamw catch_up": (lambda lr: osa.sparse_adamw(lr, weight_decay=0.3, catch_up=True), "sparse_adamw"),
    "amsgrad": (lambda lr: osa.sparse_amsgrad(lr), "sparse_amsgrad"),
    "adagrad": (lambda lr: osa.sparse_adagrad(lr), "sparse_adagrad"),
    "ftrl": (lambda lr: osa.sparse_ftrl(lr), "sparse_ftrl"),
    "rowwise_adagrad": (lambda lr: osa.sparse_rowwise_adagrad(lr), "sparse_rowwise_adagrad"),
    "rowwise_adam": (lambda lr: osa.sparse_rowwise_adam(lr), "sparse_rowwise_adam"),
    "sgd momentum catch_up": (lambda lr: osa.sparse_sgd(lr, momentum=0.9, catch_up=True), "sparse_sgd"),
    # A wrapper: its optimizer, built anew inside inject_hyperparams at every step, enters its key by its recipe.
    "apply_if_finite": (lambda lr: osa.apply_if_finite(osa.sparse_adam(lr), 3), "apply_if_finite"),
}


def _traces(caplog: pytest.LogCaptureFixture, name: str) -> int:
    return sum(f"Finished tracing {name}_update " in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("name", list(_EAGER))
def test_an_eager_update_of_row_gradients_is_one_program_kept_for_the_next_steps(
    name: str, kernel_path: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Called on arrays outside ``jit``, ``tx.update`` of row gradients runs as one compiled program, traced at
    the first step and kept for the next (op by op, a step traced and compiled its conditionals and loops again at
    every call: 2.5 s a step for catch-up AdamW under a schedule, 0.13 s through ``osa.apply_if_finite``); its
    numbers are the jitted update's, bitwise.
    Through ``optax.inject_hyperparams``, which builds the optimizer anew at every step from arrays, the program is
    kept for the next optimizer built alike, the arrays its operands; a learning rate changed between steps
    changes the step as under ``jit``."""
    make, program = _EAGER[name]
    schedule = optax.linear_schedule(0.1, 0.01, 10)
    injected = optax.inject_hyperparams(lambda learning_rate: make(learning_rate))(learning_rate=0.1)
    p0 = jnp.asarray(np.random.default_rng(0).normal(size=(12, 3)), jnp.float32)
    for tx in (make(schedule), injected):
        caplog.clear()
        eager = jitted = (p0, tx.init(p0))
        step = jax.jit(tx.update)
        with jax.log_compiles():
            for t in range(4):
                if tx is injected:
                    for s in (eager[1], jitted[1]):
                        s.hyperparams["learning_rate"] = jnp.asarray(0.1 / (t + 1), jnp.float32)
                g = osa.IndexedRows(jnp.array([t, 2 * t + 1, 7, 7]), jnp.full((4, 3), 0.5 + t, jnp.float32), 12)
                u, s = tx.update(g, eager[1], eager[0])
                eager = (osa.apply_updates(eager[0], u), s)
                u, s = step(g, jitted[1], jitted[0])
                jitted = (osa.apply_updates(jitted[0], u), s)
        assert _traces(caplog, program) == 1, [r.getMessage() for r in caplog.records if "tracing" in r.getMessage()]
        assert_trees_equal(eager, jitted)


def test_an_eager_update_whose_optimizer_is_built_anew_at_every_call_goes_back_to_op_by_op(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An optimizer whose arguments change at every step (a mask defined inside the function
    ``inject_hyperparams`` calls) is a new key at every call: after ``_MAX_MISSES`` programs at its place none of
    which was called again, its update runs op by op (compiling each cost more than that), as it did before eager
    updates were compiled."""
    from optax_sparse_adam import _fusion

    monkeypatch.setattr(_fusion, "_PROGRAMS", collections.OrderedDict())
    monkeypatch.setattr(_fusion, "_MISSES", {})

    def make(learning_rate: Any) -> optax.GradientTransformation:
        return osa.sparse_adamw(learning_rate, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p))

    tx = optax.inject_hyperparams(make)(learning_rate=0.1)
    params = {"emb": jnp.ones((20, 4), jnp.float32), "b": jnp.ones((4,), jnp.float32)}
    eager = jitted = (params, tx.init(params))
    step = jax.jit(tx.update)
    with jax.log_compiles():
        for t in range(10):
            g = {"emb": osa.IndexedRows(jnp.array([t, t + 5, 9]), jnp.ones((3, 4)), 20), "b": jnp.ones((4,))}
            u, s = tx.update(g, eager[1], eager[0])
            eager = (osa.apply_updates(eager[0], u), s)
            u, s = step(g, jitted[1], jitted[0])
            jitted = (osa.apply_updates(jitted[0], u), s)
    assert _traces(caplog, "sparse_adamw") == _fusion._MAX_MISSES
    # Op by op, a bias correction at a known count is a product of its factors (jax's integer_pow), and XLA rounds
    # a few operations otherwise: 2e-6 apart after ten steps of rate 0.1, 1e-4 of a step at most.
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-5), eager[0], jitted[0])


def test_an_eager_update_of_a_table_split_over_devices_steps_again_and_keeps_the_layouts() -> None:
    """Eager steps of a table split by rows over 8 devices, ``tx.update`` and ``update_and_apply``: the state
    ``init`` makes uncommitted (its count) is left where the compiled update puts it (moved back to its one
    device, it was refused next to the mesh's arrays at the second step), and the moments keep the table's
    layout."""
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x", None))
    whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    p0 = jnp.asarray(np.random.default_rng(0).normal(size=(64, 4)), jnp.float32)
    for tx in (osa.sparse_adam(0.1), osa.sparse_adam(0.1, catch_up=True), osa.sparse_ftrl(0.1)):
        eager = (jax.device_put(p0, split), tx.init(jax.device_put(p0, split)))
        jitted = fused = eager
        for t in range(3):
            ids, values = jnp.array([t, 40 + t, 9]), jnp.full((3, 4), 0.5 + t, jnp.float32)
            g = osa.IndexedRows(jax.device_put(ids, whole), jax.device_put(values, whole), 64)
            u, s = tx.update(g, eager[1], eager[0])
            eager = (osa.apply_updates(eager[0], u), s)
            u, s = jax.jit(tx.update)(g, jitted[1], jitted[0])
            jitted = (osa.apply_updates(jitted[0], u), s)
            fused = osa.update_and_apply(tx, g, fused[1], fused[0])  # refused at the second step too
        assert_trees_equal(eager, jitted)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), fused, jitted)
        assert eager[0].sharding.spec == split.spec
        assert all(x.sharding.spec == split.spec for x in jax.tree.leaves(eager[1]) if x.shape == p0.shape)
