"""step_report: what a compiled step costs, read from its donation, memory analysis and HLO."""

import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_sparse_adam as osa
from tests.helpers import needs_kernels

ROWS, WIDTH = 1 << 14, 64


def _args(tx):
    p = {"emb": jnp.zeros((ROWS, WIDTH), jnp.float32), "w": jnp.ones((WIDTH,), jnp.float32)}
    ids = jnp.asarray(np.random.default_rng(0).integers(0, ROWS, 256), jnp.int32)
    return p, tx.init(p), ids


def _step(tx, loss, fused=True):
    """A fast-path step: ``update_and_apply``, or ``tx.update`` then ``apply_updates``."""

    def step(params, state, ids):
        value, grads = osa.value_and_row_grad(loss, lambda p: p["emb"])(params, ids)
        if fused:
            params, state = osa.update_and_apply(tx, grads, state, params)
        else:
            updates, state = tx.update(grads, state, params)
            params = osa.apply_updates(params, updates)
        return params, state, value

    return step


def _nonlinear(p, ids):
    return jnp.tanh(p["emb"][ids] @ p["w"]).sum()


@pytest.mark.parametrize("fused", [True, False])
def test_a_donated_step_is_in_place_on_both_kernel_paths(kernel_path, fused):
    tx = osa.sparse_adam(0.1)
    report = osa.step_report(jax.jit(_step(tx, _nonlinear, fused), donate_argnums=(0, 1)), *_args(tx))
    assert report.in_place, str(report)
    assert report.kernel_path == kernel_path
    assert (report.kernel_calls > 0) == (kernel_path == "native-cpu")
    assert report.temp_bytes < ROWS * WIDTH * 4 // 4
    assert "in place" in str(report)


def test_tables_not_donated_are_named_with_their_paths(kernel_path):
    tx = osa.sparse_adam(0.1)
    report = osa.step_report(jax.jit(_step(tx, _nonlinear), donate_argnums=(1,)), *_args(tx))
    assert not report.in_place
    assert [path for path, _ in report.not_donated] == ["args[0]['emb']"]
    assert report.not_donated[0][1] == ROWS * WIDTH * 4
    assert "not donated: args[0]['emb']" in str(report) and "donate_argnums" in str(report)


def test_copies_are_reported_when_they_are_there(kernel_path):
    """A table not donated is copied before its update in place; the report shows the copy and its size."""
    tx = osa.sparse_adam(0.1)
    step = jax.jit(_step(tx, _nonlinear), donate_argnums=(1,))
    args = _args(tx)
    report = osa.step_report(step, *args)
    hlo = step.lower(*args).compile().as_text()
    table_copies = [line for line in hlo.splitlines() if f"f32[{ROWS},{WIDTH}]" in line and " copy(" in line]
    assert report.copies and len(report.copies) == len(table_copies)
    assert all(size == ROWS * WIDTH * 4 for _, size in report.copies)
    assert report.temp_bytes >= report.threshold_bytes
    assert "is copied before it is updated" in str(report)


@pytest.mark.parametrize("fused", [True, False])
def test_a_loss_linear_in_the_rows_updates_the_table_in_place(kernel_path, fused):
    """``sum(table[ids] @ w)``: the rows' gradient does not depend on the rows, yet the table is not copied."""
    tx = osa.sparse_adam(0.1)

    def linear(p, ids):
        return (p["emb"][ids] @ p["w"]).sum()

    report = osa.step_report(jax.jit(_step(tx, linear, fused), donate_argnums=(0, 1)), *_args(tx))
    assert report.in_place, str(report)


def test_a_plain_function_is_jitted_without_donation():
    tx = osa.sparse_adam(0.1)
    report = osa.step_report(_step(tx, _nonlinear), *_args(tx), min_bytes=1)
    assert {path for path, _ in report.not_donated} >= {"args[0]['emb']", "args[0]['w']", "args[2]"}
    assert report.threshold_bytes == 1


def test_dense_gradient_steps_show_table_sized_temporaries():
    tx = osa.sparse_adam(0.1)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def dense(params, state, ids):
        value, grads = jax.value_and_grad(_nonlinear)(params, ids)
        updates, state = tx.update(grads, state, params)
        return osa.apply_updates(params, updates), state, value

    report = osa.step_report(dense, *_args(tx))
    assert report.temp_bytes >= ROWS * WIDTH * 4
    assert not report.in_place


def test_sharded_tables_are_judged_by_one_devices_block():
    """On 8 devices each device holds an eighth of the table: its copies are an eighth's size, and still reported."""
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    rs = osa.RowSharding(mesh, "x", lambda p: p["emb"])
    params = rs.shard({"emb": jnp.ones((80_000, 32), jnp.float32), "w": jnp.ones((32,), jnp.float32)})
    tx = osa.sparse_adam(0.1)
    state = tx.init(params)

    def step(params, state, ids):
        _, grads, _ = rs.value_and_row_grad(lambda p, i: (p["emb"][i] @ p["w"]).sum())(params, ids)
        updates, state = rs.update(tx, grads, state, params)
        return rs.apply_updates(params, updates), state

    ids = jnp.arange(256, dtype=jnp.int32)
    donated = osa.step_report(jax.jit(step, donate_argnums=(0, 1)), params, state, ids)
    assert donated.in_place, str(donated)
    kept = osa.step_report(jax.jit(step), params, state, ids)
    assert len(kept.copies) >= 3 and all(size == 10_000 * 32 * 4 for _, size in kept.copies), str(kept)
    assert {p for p, _ in kept.not_donated} == {"args[0]['emb']", "args[1][0].mu['emb']", "args[1][0].nu['emb']"}


@pytest.mark.skipif(osa.kernel_path() != "native-cpu", reason="the native kernels are off or were not built")
@pytest.mark.parametrize(
    ("name", "tx", "fused", "says"),
    [
        ("sparse_adam", osa.sparse_adam(1e-2), True, "fused: "),
        ("apply_if_finite", optax.apply_if_finite(osa.sparse_adam(1e-2), 3), False, "two calls: "),
        ("osa.apply_if_finite", osa.apply_if_finite(osa.sparse_adam(1e-2), 3), True, "fused: "),
        ("rowwise adam", osa.sparse_rowwise_adam(1e-2), True, "fused: "),
        ("adagrad", osa.sparse_adagrad(1e-2), True, "fused: "),
        ("sgd", osa.sparse_sgd(1e-2), False, "no native kernel for the optimizer: "),
    ],
)
def test_the_report_says_whether_the_step_runs_fused(name, tx, fused, says):
    """The report names the kernels the compiled step calls and says whether the optimizer's step is one pass,
    the two calls (and how to fuse them), or the XLA path (and why)."""
    step = jax.jit(_step(tx, _nonlinear), donate_argnums=(0, 1))
    report = osa.step_report(step, *_args(tx))
    assert report.fused is fused
    assert says in str(report), str(report)
    if fused:
        # The lookup's distinct ids and gather, and the optimizer's one pass (in a cond's branch for
        # apply_if_finite, which the compiled text lists first, after its check of the gradient's rows).
        apply = {"rowwise adam": "rowwise_adam_apply", "adagrad": "adagrad_apply"}.get(name, "sparse_adam_apply")
        check = ("all_finite",) if name == "osa.apply_if_finite" else ()
        assert sorted(report.kernels) == sorted(("distinct", "gather", apply, *check)), report.kernels
    assert len(report.kernels) <= report.kernel_calls


@pytest.mark.skipif(osa.kernel_path() != "native-cpu", reason="the native kernels are off or were not built")
def test_an_optimizer_on_the_xla_path_is_not_called_two_calls():
    """A step whose optimizer takes the XLA path (a bfloat16 table's Adam, or float32 Adam with a bfloat16 ``mu``)
    calls the helper that sets a 16-bit table's rows, ``set_rows``: the report took it for an optimizer's rows
    kernel, called the step "two calls" and told the user to take update_and_apply, which the step was. And a step
    fused for one table and not for another (a bfloat16 one) said each touched row was one native pass."""
    n, d = 4096, 64
    ids, g = jnp.arange(16) % 9, jnp.ones((16, d), jnp.float32)
    for dtype, mu_dtype in ((jnp.bfloat16, None), (jnp.float32, jnp.bfloat16)):
        tx = osa.sparse_adam(1e-2, mu_dtype=mu_dtype)
        p = jnp.zeros((n, d), dtype)
        step = jax.jit(lambda p, s, ids, g, tx=tx: osa.update_and_apply(tx, osa.IndexedRows(ids, g, n), s, p))
        report = osa.step_report(step, p, tx.init(p), ids, g)
        assert "set_rows" in report.kernels and not report.fused, report.kernels
        assert "no native kernel for the optimizer: " in str(report) and "two calls" not in str(report), str(report)
    tx = osa.sparse_adam(1e-2)
    p = {"a": jnp.zeros((n, d), jnp.float32), "b": jnp.zeros((n, d), jnp.bfloat16)}

    def both(p, s, ids, g):
        return osa.update_and_apply(tx, {k: osa.IndexedRows(ids, g, n) for k in p}, s, p)

    report = osa.step_report(jax.jit(both), p, tx.init(p), ids, g)
    assert report.fused and "not every table: a table's update is applied apart" in str(report), str(report)

    def typed(p, s, ids, g):  # each table's gradient in its dtype: the bfloat16 rows written by set_rows
        return osa.update_and_apply(tx, {k: osa.IndexedRows(ids, g.astype(p[k].dtype), n) for k in p}, s, p)

    report = osa.step_report(jax.jit(typed), p, tx.init(p), ids, g)
    assert "set_rows" in report.kernels and "not every table: a table's update is applied apart (set_rows" in str(
        report
    ), str(report)
    p["b"] = p["b"].astype(jnp.float32)  # both tables fused: no such line
    assert "not every table" not in str(osa.step_report(jax.jit(both), p, tx.init(p), ids, g))


@pytest.mark.skipif(osa.kernel_path() != "native-cpu", reason="the native kernels are off or were not built")
def test_a_fused_step_names_a_table_that_takes_the_two_calls():
    """One table fused, the other two calls (a stage after its optimizer, in a multi_transform): the report said
    only that the step was fused, each touched row one native pass."""
    n, d = 4096, 64
    ids, g = jnp.arange(16) % 9, jnp.ones((16, d), jnp.float32)
    after = optax.chain(osa.sparse_adam(0.1), osa.sparse_aware(optax.scale(0.5)))
    tx = optax.multi_transform({"A": osa.sparse_adam(0.1), "B": after}, {"a": "A", "b": "B"})
    p = {"a": jnp.zeros((n, d), jnp.float32), "b": jnp.zeros((n, d), jnp.float32)}

    def step(p, s, ids, g):
        return osa.update_and_apply(tx, {k: osa.IndexedRows(ids, g, n) for k in p}, s, p)

    report = osa.step_report(jax.jit(step, donate_argnums=(0, 1)), p, tx.init(p), ids, g)
    assert report.fused and {"sparse_adam_apply", "sparse_adam_rows", "scatter_add"} <= set(report.kernels)
    assert "not every table: some take the two calls (sparse_adam_rows)" in str(report), str(report)
    tx = optax.multi_transform({"A": osa.sparse_adam(0.1), "B": osa.sparse_adam(0.5)}, {"a": "A", "b": "B"})
    report = osa.step_report(jax.jit(step, donate_argnums=(0, 1)), p, tx.init(p), ids, g)
    assert report.fused and "two calls" not in str(report), str(report)


def test_paths_count_the_static_arguments():
    """A step with a static first argument: args_info leaves it out, and the report named the table args[0] (the
    static int) among the arguments not donated, where its 4 KiB-pages line said args[1]."""
    n, d = 4096, 64
    tx = osa.sparse_adam(0.1)

    def step(scale, p, s, ids, g):
        return osa.update_and_apply(tx, osa.IndexedRows(ids, g * scale, n), s, p)

    p = jnp.zeros((n, d), jnp.float32)
    args = (p, tx.init(p), jnp.arange(8), jnp.ones((8, d), jnp.float32))
    for static in (0, -5):
        report = osa.step_report(jax.jit(step, static_argnums=static), 2, *args)
        assert [path for path, _ in report.not_donated] == ["args[1]", "args[2][0].mu", "args[2][0].nu"], report
    report = osa.step_report(jax.jit(lambda *a, scale: step(scale, *a), static_argnames="scale"), *args, scale=2)
    assert [path for path, _ in report.not_donated] == ["args[0]", "args[1][0].mu", "args[1][0].nu"], report


@pytest.mark.skipif(osa.kernel_path() != "native-cpu", reason="the native kernels are off or were not built")
@pytest.mark.parametrize("tx", [osa.sparse_adam(1e-2, catch_up=True), osa.sparse_adamw(1e-2, catch_up=True)])
def test_the_report_of_catch_up_names_its_replay_and_finds_it_in_place(tx):
    """``catch_up``'s program, donated: its one kernel, the whole-table replay, named as such (not as a step
    without a kernel), and in place."""
    report = osa.step_report(jax.jit(lambda p, s: osa.catch_up(tx, p, s), donate_argnums=(0, 1)), *_args(tx)[:2])
    assert report.kernels == ("catch_up_adam_replay",), report.kernels
    assert "catch-up replay: rows brought up to date in one native pass" in str(report), str(report)
    assert "no native kernel" not in str(report)
    assert report.in_place, str(report)


# The optimizers of the native kernels guide's table, by the label the table gives them.
_GUIDE_SCHEDULE = optax.cosine_decay_schedule(1e-2, 100)
_GUIDE_OPTIMIZERS = {
    "sparse_adam": lambda: osa.sparse_adam(0.1),
    "sparse_adamw": lambda: osa.sparse_adamw(0.1),
    "sparse_amsgrad": lambda: osa.sparse_amsgrad(0.1),
    "sparse_rowwise_adam": lambda: osa.sparse_rowwise_adam(0.1),
    "sparse_rowwise_adagrad": lambda: osa.sparse_rowwise_adagrad(0.1),
    "sparse_adagrad": lambda: osa.sparse_adagrad(0.1),
    "sparse_ftrl": lambda: osa.sparse_ftrl(0.1),
    "sparse_sgd": lambda: osa.sparse_sgd(0.1),
    "sparse_sgd(momentum=0.9)": lambda: osa.sparse_sgd(0.1, momentum=0.9),
    "sparse_adam(0.1, catch_up=True)": lambda: osa.sparse_adam(0.1, catch_up=True),
    "sparse_adam(schedule, catch_up=True)": lambda: osa.sparse_adam(_GUIDE_SCHEDULE, catch_up=True),
    "sparse_adamw(0.1, catch_up=True)": lambda: osa.sparse_adamw(0.1, catch_up=True),
    "sparse_adamw(schedule, catch_up=True)": lambda: osa.sparse_adamw(_GUIDE_SCHEDULE, catch_up=True),
    "sparse_amsgrad(schedule, catch_up=True)": lambda: osa.sparse_amsgrad(_GUIDE_SCHEDULE, catch_up=True),
    "sparse_sgd(schedule, momentum=0.9, catch_up=True)": lambda: osa.sparse_sgd(
        _GUIDE_SCHEDULE, momentum=0.9, catch_up=True
    ),
}


@needs_kernels
def test_the_native_kernels_guide_names_the_kernels_each_door_runs() -> None:
    """The native kernels guide's table of each optimizer's kernels, through ``tx.update``, ``update_and_apply`` and
    ``catch_up``, is what ``step_report`` reads from the compiled steps (a float32 table of 1,000 x 8, 10 ids)."""
    text = (pathlib.Path(__file__).parents[1] / "docs" / "guides" / "native_kernels.md").read_text()
    rows = [line for line in text.split("### Each optimizer's kernels")[1].splitlines() if line.startswith("| `")]
    table = {}
    for row in rows:
        label, *doors = (cell.strip() for cell in row.strip("|").split("|"))
        table[label.strip("`")] = [tuple(k.strip(" `") for k in door.split(",")) if door else () for door in doors]
    assert list(table) == list(_GUIDE_OPTIMIZERS)
    p = {"t": jnp.ones((1000, 8), jnp.float32)}
    g = {"t": osa.IndexedRows(jnp.arange(10), jnp.ones((10, 8), jnp.float32), 1000)}
    for label, make in _GUIDE_OPTIMIZERS.items():
        tx = make()
        s = tx.init(p)

        def two_calls(g, s, p, tx=tx):
            updates, s = tx.update(g, s, p)
            return osa.apply_updates(p, updates), s

        got = [
            osa.step_report(jax.jit(two_calls, donate_argnums=(1, 2)), g, s, p).kernels,
            osa.step_report(
                jax.jit(lambda g, s, p, tx=tx: osa.update_and_apply(tx, g, s, p), donate_argnums=(1, 2)), g, s, p
            ).kernels,
        ]
        if "catch_up" in label:
            caught = jax.jit(lambda p, s, tx=tx: osa.catch_up(tx, p, s), donate_argnums=(0, 1))
            got.append(osa.step_report(caught, p, s).kernels)
        else:
            got.append(())
        assert [tuple(k) for k in got] == table[label], label
