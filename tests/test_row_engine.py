"""The lazy-row engine: every optimizer runs on it, so every optimizer runs on row-sharded tables.

Each optimizer of the library (and ``apply_updates_stochastic``) takes a step
on a table split by rows over 8 devices, ``P("x", None)``, on
``jax.make_mesh``'s default mesh (``Explicit`` axes) and on an ``Auto`` mesh,
under plain ``jit``; the result equals the step on one device.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_sparse_adam as osa
from optax_sparse_adam._row_engine import apply_rule, touched_rows
from tests.helpers import spread

ROWS, WIDTH = 64, 4

OPTIMIZERS = {
    "sparse_adam": lambda: osa.sparse_adam(0.1),
    "sparse_adam_torch_eps": lambda: osa.sparse_adam(0.1, eps_placement="torch"),
    "sparse_adamw": lambda: osa.sparse_adamw(0.1, weight_decay=0.1),
    "sparse_adamw_catch_up": lambda: osa.sparse_adamw(0.1, weight_decay=0.1, catch_up=True),
    "sparse_amsgrad": lambda: osa.sparse_amsgrad(0.1),
    "sparse_rowwise_adam": lambda: osa.sparse_rowwise_adam(0.1),
    "sparse_rowwise_adam_per_row_bias": lambda: osa.sparse_rowwise_adam(0.1, per_row_bias_correction=True),
    "sparse_rowwise_adagrad": lambda: osa.sparse_rowwise_adagrad(0.1, weight_decay=0.01),
}
# The edge shapes' tests run every fused kernel.
EDGE_OPTIMIZERS = {
    **OPTIMIZERS,
    "sparse_adam_catch_up": lambda: osa.sparse_adam(0.1, catch_up=True),
    "sparse_amsgrad_catch_up": lambda: osa.sparse_amsgrad(0.1, catch_up=True),
}


def _batches(steps: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(steps):
        ids = rng.integers(-2, ROWS, size=24).astype(np.int32)  # duplicates and padding
        out.append((ids, rng.normal(size=(24, WIDTH)).astype(np.float32)))
    return out


def _mesh(kind: str) -> jax.sharding.Mesh:
    """8 of the simulated CPU devices conftest asks for (on a machine with a GPU as well, where it is the default)."""
    devices = jax.devices("cpu")[:8]
    if kind == "explicit":
        mesh = jax.make_mesh((8,), ("x",), devices=devices)
        assert mesh.axis_types == (AxisType.Explicit,)
        return mesh
    return jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,), devices=devices)


def _train(make_tx, place, steps: int = 3):
    """Three jitted steps of ``tx`` on a table placed by ``place``; returns the table and the state."""
    tx = make_tx()
    table = place(jnp.asarray(np.random.default_rng(1).normal(size=(ROWS, WIDTH)), jnp.float32))
    params = {"emb": table, "w": jnp.ones((WIDTH,), jnp.float32)}
    state = tx.init(params)

    @jax.jit
    def step(params, state, ids, values):
        grads = {"emb": osa.IndexedRows(ids, values, ROWS), "w": jnp.full((WIDTH,), 0.5, jnp.float32)}
        updates, state = tx.update(grads, state, params)
        return osa.apply_updates(params, updates), state

    for ids, values in _batches(steps):
        params, state = step(params, state, jnp.asarray(ids), jnp.asarray(values))
    return params, state


@functools.cache
def _one_device(name: str, path: str):
    """The one-device run of ``name`` on kernel path ``path``: the reference of both meshes, computed once."""
    assert osa.kernel_path() == path
    return _train(OPTIMIZERS[name], lambda t: t)


@pytest.mark.parametrize(
    ("name", "mesh_kind"), spread(sorted(OPTIMIZERS), [("explicit",), ("auto",)])
)  # each optimizer on one kind of mesh, half the optimizers on each
def test_every_optimizer_on_a_row_sharded_table_equals_one_device(name, mesh_kind, kernel_path):
    mesh = _mesh(mesh_kind)
    sharding = NamedSharding(mesh, P("x", None))
    expected = _one_device(name, kernel_path)
    params, state = _train(OPTIMIZERS[name], lambda t: jax.device_put(t, sharding))
    assert params["emb"].sharding.is_equivalent_to(sharding, 2)
    np.testing.assert_allclose(np.asarray(params["emb"]), np.asarray(expected[0]["emb"]), rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(params["w"]), np.asarray(expected[0]["w"]), rtol=2e-6, atol=1e-7)
    for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(expected[1]), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("mesh_kind", ["explicit", "auto"])
def test_apply_updates_stochastic_on_a_row_sharded_table_equals_one_device(mesh_kind):
    mesh = _mesh(mesh_kind)
    sharding = NamedSharding(mesh, P("x", None))
    table = jnp.asarray(np.random.default_rng(2).normal(size=(ROWS, WIDTH)), jnp.bfloat16)
    ids, values = _batches(1)[0]
    update = osa.IndexedRows(jnp.asarray(ids), jnp.asarray(values) * 1e-3, ROWS)
    apply = jax.jit(osa.apply_updates_stochastic)
    want = apply(table, update, jax.random.key(3))
    got = apply(jax.device_put(table, sharding), update, jax.random.key(3))
    assert got.sharding.is_equivalent_to(sharding, 2)
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))
    assert not np.array_equal(np.asarray(want.astype(jnp.float32)), np.asarray(table.astype(jnp.float32)))


@pytest.mark.parametrize("shape", [(ROWS,), (ROWS, WIDTH)], ids=["1-d", "2-d"])
def test_per_row_state_is_split_by_row_like_its_table(shape):
    """``init`` places per-row state (row-wise accumulators, catch-up's last steps) as a row-sharded table's rows,
    a one-dimensional table's (a bias per item) too, instead of replicating it on every device."""
    mesh = _mesh("explicit")
    rows = NamedSharding(mesh, P("x"))
    table = jax.device_put(jnp.zeros(shape, jnp.float32), NamedSharding(mesh, P("x", *(None,) * (len(shape) - 1))))
    for tx in (osa.sparse_rowwise_adagrad(0.1), osa.sparse_adamw(0.1, weight_decay=0.1, catch_up=True)):
        per_row = [x for x in jax.tree.leaves(tx.init(table)) if x.shape == (ROWS,)]
        assert per_row
        for leaf in per_row:
            assert leaf.sharding.is_equivalent_to(rows, 1), leaf.sharding


def _numpy_lazy_rule(g, state, lazy_rows):
    """A NumPy loop of what apply_rule does with a toy rule: ``s += g`` and step ``2 * g`` on touched rows."""
    new, step = state.copy(), np.zeros_like(g)
    for r in range(g.shape[0]):
        if lazy_rows is None or lazy_rows[r]:
            new[r] += g[r]
            step[r] = 2 * g[r]
    return step, new


def _toy_rule(g, state, reads):
    return 2 * g, (state[0] + g,)


def test_dense_leaf_touches_every_row():
    g = np.zeros((6, 3), np.float32)
    g[1], g[4, 2] = 1.0, -2.0
    state = np.arange(18, dtype=np.float32).reshape(6, 3)
    step, (new,) = apply_rule((), jnp.asarray(g), (6, 3), (jnp.asarray(state),), (), _toy_rule, "t", whole_rows=False)
    want_step, want_new = _numpy_lazy_rule(g, state, None)
    np.testing.assert_array_equal(np.asarray(step), want_step)
    np.testing.assert_array_equal(np.asarray(new), want_new)


def test_touched_rows_are_those_holding_a_nonzero_or_nan():
    g = np.zeros((6, 3), np.float32)
    g[1], g[4, 2], g[5, 0] = 1.0, -2.0, np.nan
    np.testing.assert_array_equal(np.asarray(touched_rows(jnp.asarray(g)))[:, 0], [0, 1, 0, 0, 1, 1])
    np.testing.assert_array_equal(np.asarray(touched_rows(jnp.asarray(g[:, 2]))), [0, 1, 0, 0, 1, 0])


def test_lazy_dense_adam_step_copies_no_table():
    """A donated lazy_dense step updates the moments in place: temporaries far below one table."""
    tx = osa.sparse_adam(1e-3, lazy_dense=True)

    def step(p, s, g):
        u, s = tx.update(g, s)
        return osa.apply_updates(p, u), s

    p = jnp.zeros((1 << 16, 64), jnp.float32)
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(p, tx.init(p), p).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < p.nbytes // 4


def test_sparse_leaf_sums_duplicates_and_leaves_other_rows_bitwise():
    ids = np.array([3, 1, 3, -1, 9], np.int32)  # a duplicate, and padding on both sides
    values = np.arange(15, dtype=np.float32).reshape(5, 3)
    state = np.random.default_rng(0).normal(size=(6, 3)).astype(np.float32)
    out, (new,) = apply_rule(
        (),
        osa.IndexedRows(jnp.asarray(ids), jnp.asarray(values), 6),
        (6, 3),
        (jnp.asarray(state),),
        (),
        _toy_rule,
        "t",
        whole_rows=False,
    )
    dense = np.zeros((6, 3), np.float32)
    for i, v in zip(ids, values, strict=True):
        if 0 <= i < 6:
            dense[i] += v
    want_step, want_new = _numpy_lazy_rule(dense, state, dense.any(axis=1))
    np.testing.assert_array_equal(np.asarray(out.todense()), want_step)
    np.testing.assert_array_equal(np.asarray(new), want_new)
    assert isinstance(out, osa.IndexedRows) and out.indices.dtype == jnp.int32


def test_whole_row_rules_refuse_element_sparse_leaves_with_the_path():
    from jax.experimental import sparse as jsparse

    g = jsparse.BCOO((jnp.ones((1,), jnp.float32), jnp.array([[1, 2]], jnp.int32)), shape=(4, 3))
    tx = osa.sparse_rowwise_adagrad(0.1)
    params = {"emb": jnp.zeros((4, 3), jnp.float32)}
    with pytest.raises(ValueError, match=r"parameter \['emb'\].*n_sparse=2"):
        tx.update({"emb": g}, tx.init(params), params)


def test_adam_rule_equals_optax_adam_where_every_row_is_touched(kernel_path):
    rng = np.random.default_rng(5)
    params = jnp.asarray(rng.normal(size=(8, 3)), jnp.float32)
    tx, ref = osa.sparse_adam(0.05), optax.adam(0.05)
    s, rs = tx.init(params), ref.init(params)
    p, rp = params, params
    for _ in range(3):
        g = jnp.asarray(rng.normal(size=(8, 3)), jnp.float32)
        u, s = jax.jit(tx.update)(osa.IndexedRows(jnp.arange(8, dtype=jnp.int32), g, 8), s, p)
        p = osa.apply_updates(p, u)
        ru, rs = jax.jit(ref.update)(g, rs, rp)
        rp = optax.apply_updates(rp, ru)
    np.testing.assert_allclose(np.asarray(p), np.asarray(rp), rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(s[0].nu), np.asarray(rs[0].nu))


def _both_doors(tx):
    """One jitted program taking the step both ways: ``tx.update`` then ``apply_updates`` (with the table's update
    values), and ``update_and_apply``; one compilation for the two."""

    @jax.jit
    def both(params, state, grads):
        updates, new_state = tx.update(grads, state, params)
        fused, fused_state = osa.update_and_apply(tx, grads, state, params)
        return osa.apply_updates(params, updates), new_state, updates["emb"].values, fused, fused_state

    return both


@pytest.mark.parametrize("name", sorted(EDGE_OPTIMIZERS))
def test_rows_of_zero_width_move_nothing(name, kernel_path):
    """A table of rows with no entries (``(5, 0)``): the step runs on both doors and changes nothing of it."""
    tx = EDGE_OPTIMIZERS[name]()
    params = {"emb": jnp.zeros((5, 0), jnp.float32), "w": jnp.ones((WIDTH,), jnp.float32)}
    state = tx.init(params)
    grads = {
        "emb": osa.IndexedRows(jnp.array([1, 1, -1], jnp.int32), jnp.ones((3, 0), jnp.float32), 5),
        "w": jnp.ones((WIDTH,), jnp.float32),
    }

    new, new_state, _, fused, fused_state = _both_doors(tx)(params, state, grads)
    for p in (new, fused):
        assert p["emb"].shape == (5, 0)
    np.testing.assert_array_equal(np.asarray(fused["w"]), np.asarray(new["w"]))
    assert jax.tree.structure(fused_state) == jax.tree.structure(new_state)


@pytest.mark.parametrize("name", sorted(EDGE_OPTIMIZERS))
def test_a_table_of_zero_rows_takes_all_padding(name, kernel_path):
    """``IndexedRows(num_rows=0)``: every id is padding, nothing moves (XLA refuses a gather from 0 rows)."""
    tx = EDGE_OPTIMIZERS[name]()
    params = {"emb": jnp.zeros((0, WIDTH), jnp.float32), "w": jnp.ones((WIDTH,), jnp.float32)}
    state = tx.init(params)
    grads = {
        "emb": osa.IndexedRows(jnp.array([0, -1, 3], jnp.int32), jnp.ones((3, WIDTH), jnp.float32), 0),
        "w": jnp.ones((WIDTH,), jnp.float32),
    }

    new, new_state, values, fused, fused_state = _both_doors(tx)(params, state, grads)
    assert new["emb"].shape == (0, WIDTH)
    np.testing.assert_array_equal(np.asarray(values), 0.0)
    np.testing.assert_array_equal(np.asarray(fused["w"]), np.asarray(new["w"]))
    assert jax.tree.structure(fused_state) == jax.tree.structure(new_state)


_OPTAX_PEERS = {
    "sparse_adam": (lambda: osa.sparse_adam(0.05), lambda: optax.adam(0.05)),
    "sparse_adam(catch_up=True)": (lambda: osa.sparse_adam(0.05, catch_up=True), lambda: optax.adam(0.05)),
    "sparse_adamw": (lambda: osa.sparse_adamw(0.05, weight_decay=0.1), lambda: optax.adamw(0.05, weight_decay=0.1)),
    "sparse_amsgrad": (lambda: osa.sparse_amsgrad(0.05), lambda: optax.amsgrad(0.05)),
    "sparse_adagrad": (lambda: osa.sparse_adagrad(0.05), lambda: optax.adagrad(0.05)),
    "sparse_sgd(momentum)": (lambda: osa.sparse_sgd(0.05, momentum=0.9), lambda: optax.sgd(0.05, momentum=0.9)),
    "sparse_sgd": (lambda: osa.sparse_sgd(0.05), lambda: optax.sgd(0.05)),
}


@pytest.mark.parametrize("form", ["dense", "rows"])
@pytest.mark.parametrize("name", list(_OPTAX_PEERS))
def test_a_bfloat16_gradient_of_a_float32_table_steps_as_optax(name, form, kernel_path):
    """A bfloat16 gradient of a float32 parameter (whose state is float32) takes the update in the dtype optax's
    arithmetic gives it: float32 where the state is (plain SGD has none: bfloat16, as optax's), not rounded to the
    gradient's dtype, which moved the parameters by 1.7e-3 of a step away from ``optax.adam``'s. Every row touched
    (once, as a dense leaf or as rows), three steps of the two calls, each compiled apart: bitwise optax's."""
    ours, theirs = (make() for make in _OPTAX_PEERS[name])
    rng = np.random.default_rng(1)
    p0 = jnp.asarray(rng.normal(size=(8, 4)), jnp.float32)
    grads = [jnp.asarray(rng.normal(size=(8, 4)), jnp.bfloat16) for _ in range(3)]

    def train(tx: optax.GradientTransformation, wrap: bool) -> tuple[jax.Array, jax.Array]:
        p, s, update = p0, tx.init(p0), jax.jit(tx.update)
        for g in grads:
            u, s = update(osa.IndexedRows(jnp.arange(8), g, 8) if wrap else g, s, p)
            p = jax.jit(osa.apply_updates)(p, u)
        return p, u.values if wrap else u

    (p, u), (p_ref, u_ref) = train(ours, form == "rows"), train(theirs, False)
    assert u.dtype == u_ref.dtype == (jnp.bfloat16 if name == "sparse_sgd" else jnp.float32)
    np.testing.assert_array_equal(p, p_ref)
