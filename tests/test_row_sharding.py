"""Row-sharded tables on 8 CPU devices, and over two processes.

Every sharded step is compared with the same step on one device: bitwise where
the summation order is the same (replicated ids), to float32 rounding where a
data-parallel batch sums duplicates in another order. Shardings are checked
after each step.

Run as a script, this file is one process of the multi-process test
(``python tests/test_row_sharding.py PROCESS_ID NUM_PROCESSES PORT DEVICES OUT``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import pathlib
import re
import socket
import subprocess
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.experimental import sparse as jsparse
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_sparse_adam as osa
from optax_sparse_adam import _ffi, _kernel_path, _routing
from optax_sparse_adam._kernel_path import PREFIX

N, D, K = 512, 4, 256  # rows, width, ids per step (global)
# tests.helpers' KERNELS_OFF, spelled out: this file also runs as a script (the multi-process test), where the tests
# package is not importable (and importing tests.helpers would start JAX's backends before the script sets its
# device count).
needs_kernels = pytest.mark.skipif(
    not _kernel_path.enabled(),
    reason="the native kernels were not built, or OPTAX_SPARSE_ADAM_KERNELS=0 turned them off",
)
AXIS_TYPES = {"explicit": jax.sharding.AxisType.Explicit, "auto": jax.sharding.AxisType.Auto}


def _mesh(kind: str = "explicit") -> jax.sharding.Mesh:
    assert jax.device_count() == 8, "conftest sets jax_num_cpu_devices=8"
    return jax.make_mesh((8,), ("x",), axis_types=(AXIS_TYPES[kind],))


def _params(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "emb": rng.standard_normal((N, D)).astype(np.float32),
        "w": rng.standard_normal((D,)).astype(np.float32),
    }


def _batches(steps: int, seed: int = 1, k: int = K, zipf: bool = False) -> list[tuple[np.ndarray, np.ndarray]]:
    """Ids with duplicates and padding (-1 and N), and targets."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        ids = (rng.zipf(1.3, k) - 1) % (N + 2) - 1 if zipf else rng.integers(-1, N + 1, k)
        out.append((ids.astype(np.int32), rng.standard_normal(k).astype(np.float32)))
    return out


def loss_fn(p: Any, ids: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((p["emb"][ids] @ p["w"] - y) ** 2)


def _one_device_run(tx: Any, batches: list[tuple[np.ndarray, np.ndarray]]) -> tuple[Any, Any, list[Any]]:
    """The reference: the library's fast path on one device."""

    @jax.jit
    def step(p: Any, s: Any, ids: jax.Array, y: jax.Array) -> Any:
        value, g = osa.value_and_row_grad(loss_fn, lambda p: p["emb"])(p, ids, y)
        u, s = tx.update(g, s, p)
        return osa.apply_updates(p, u), s, (value, g["emb"].todense(), g["w"])

    params = jax.tree.map(jnp.asarray, _params())
    state = tx.init(params)
    grads = []
    for ids, y in batches:
        params, state, g = step(params, state, jnp.asarray(ids), jnp.asarray(y))
        grads.append(g)
    return params, state, grads


def _assert_row_sharded(tree: Any, mesh: jax.sharding.Mesh) -> None:
    rows = NamedSharding(mesh, P("x", None))
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    tables = [(path, x) for path, x in leaves if "emb" in jax.tree_util.keystr(path)]
    assert tables
    for path, x in tables:
        assert x.sharding.is_equivalent_to(rows, 2), (jax.tree_util.keystr(path), x.sharding)


# --------------------------------------------------------------------------- plain jit on an Explicit mesh


def _plain_grad(kind: str, ids: jax.Array, values: jax.Array) -> Any:
    if kind == "indexed_rows":
        return osa.IndexedRows(ids, values, N)
    if kind == "bcoo_rows":
        return jsparse.BCOO((values, ids[:, None]), shape=(N, D))
    if kind == "bcoo_entries":  # one element per entry: keys (row, column)
        return jsparse.BCOO((values[:, 0], jnp.stack([ids, ids % D], axis=1)), shape=(N, D))
    assert kind == "lazy_dense"
    return osa.IndexedRows(ids, values, N).todense()


KINDS = ["indexed_rows", "bcoo_rows", "bcoo_entries", "lazy_dense", "fast_path"]


@pytest.mark.parametrize(
    ("mesh_kind", "use_set_mesh", "kind", "ids_sharded"),
    [("explicit", False, kind, sharded) for kind in KINDS for sharded in (False, True)]
    + [("explicit", True, kind, True) for kind in ("indexed_rows", "fast_path")]
    + [("auto", set_mesh, kind, True) for kind in ("indexed_rows", "fast_path") for set_mesh in (False, True)],
)
def test_plain_jit_on_a_row_sharded_table_matches_one_device(mesh_kind, use_set_mesh, kind, ids_sharded):
    """tx.update / lookup / apply_updates under plain jit, table P("x", None): one device's numbers, shardings kept."""
    mesh = _mesh(mesh_kind)
    k = 2048 if kind == "indexed_rows" else K  # 2048 slots: the chunked row loop
    rng = np.random.default_rng(2)
    ids = jnp.asarray(rng.integers(-2, N + 2, k), jnp.int32)
    values = jnp.asarray(rng.standard_normal((k, D)), jnp.float32)
    tx = optax.chain(
        osa.sparse_aware(optax.clip_by_global_norm(1.0)), osa.sparse_adam(0.1, lazy_dense=kind == "lazy_dense")
    )

    def step(p: Any, s: Any, ids: jax.Array, values: jax.Array) -> Any:
        if kind == "fast_path":
            _, g = osa.value_and_row_grad(lambda t, i: jnp.sum(t["emb"][i] * values), lambda t: t["emb"])(p, ids)
        else:
            g = {"emb": _plain_grad(kind, ids, values)}
        u, s = tx.update(g, s, p)
        return osa.apply_updates(p, u), s

    table = _params()["emb"]
    ref = jax.jit(step)({"emb": jnp.asarray(table)}, tx.init({"emb": jnp.asarray(table)}), ids, values)
    params = {"emb": jax.device_put(table, NamedSharding(mesh, P("x", None)))}
    if ids_sharded:
        ids = jax.device_put(ids, NamedSharding(mesh, P("x")))
        values = jax.device_put(values, NamedSharding(mesh, P("x", None)))
    with jax.set_mesh(mesh) if use_set_mesh else _nullcontext():
        out = jax.jit(step, donate_argnums=(0, 1))(params, tx.init(params), ids, values)
    if ids_sharded and mesh_kind == "auto":  # XLA's partitioner sums duplicates per device, then across
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), out, ref)
    else:
        jax.tree.map(np.testing.assert_array_equal, out, ref)
    _assert_row_sharded(out, mesh)


@needs_kernels
@pytest.mark.parametrize("kind", ["dups", "distinct"])
@pytest.mark.parametrize(
    ("optimizer", "kernel"), [("sparse_adam", "sparse_adam_apply"), ("sparse_rowwise_adagrad", "rowwise_adagrad_apply")]
)
def test_a_row_sharded_table_clipped_alone_takes_the_whole_batchs_norm_in_each_shards_kernel(optimizer, kernel, kind):
    """chain(sparse_aware(clip_by_global_norm), optimizer) under update_and_apply on a table P("x", None) of an
    Auto mesh that is the only leaf the clipping sees: each row shard's kernel takes the norm from the entries
    itself (no sum_squares call), over every row of the batch, not its own: the one-device fused step's numbers
    bitwise (a shard's norm of its own rows would clip each block apart); ids repeating, or known distinct
    (``unique_indices``, padding among them). (On an Explicit mesh the step runs the XLA rule.)"""
    mesh = _mesh("auto")
    rng = np.random.default_rng(4)
    if kind == "dups":
        ids = jnp.asarray(rng.integers(-2, N + 2, K), jnp.int32)
    else:
        ids = jnp.asarray(np.where(np.arange(K) % 9 == 0, -1, rng.permutation(N)[:K]), jnp.int32)
    values = jnp.asarray(rng.standard_normal((K, D)), jnp.float32)
    tx = optax.chain(osa.sparse_aware(optax.clip_by_global_norm(1.0)), getattr(osa, optimizer)(0.1))

    def step(p: Any, s: Any, ids: jax.Array, values: jax.Array) -> Any:
        return osa.update_and_apply(
            tx, {"emb": osa.IndexedRows(ids, values, N, unique_indices=kind == "distinct")}, s, p
        )

    table = {"emb": jnp.asarray(_params()["emb"])}
    with osa.use_kernels(True):
        ref = jax.jit(step)(table, tx.init(table), ids, values)
        params = {"emb": jax.device_put(table["emb"], NamedSharding(mesh, P("x", None)))}
        sharded = jax.jit(step)
        hlo = sharded.lower(params, tx.init(params), ids, values).compile().as_text()
        out = sharded(params, tx.init(params), ids, values)
    calls = set(re.findall(f'custom_call_target="{PREFIX}(\\w+)"', hlo))
    assert calls == {kernel}, calls
    jax.tree.map(np.testing.assert_array_equal, out, ref)
    _assert_row_sharded(out, mesh)


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *args: Any) -> None:
        return None


# ---------------------------------------------------------------------------------- routed fast path

ROUTES = [
    pytest.param(None, "all_to_all", None, id="replicated-ids"),
    pytest.param("x", "all_gather", None, id="all-gather"),
    pytest.param("x", "all_to_all", None, id="all-to-all"),
    pytest.param("x", "all_to_all", 3, id="all-to-all-overflowing"),
    pytest.param("x", "all_to_all", 5, id="all-to-all-second-round"),
    pytest.param("x", "all_to_all", 32, id="all-to-all-never-overflows"),
]


def _placed_state(rs: osa.RowSharding, tx: Any, params: Any) -> Any:
    """``tx.init(params)`` placed by ``rs.state_specs``, as a routed step returns its state: the leaves that
    ``tx.init`` leaves on one device (the count, catch-up's records) replicated over the mesh, so that a run's first
    step and the later ones run one executable (a routed step's compile is most of a test's time; the leaves' values
    are the same)."""
    state = tx.init(params)
    specs = rs.state_specs(tx, state, params)
    return jax.tree.map(
        lambda x, spec: jax.device_put(x, NamedSharding(rs.mesh, spec)),
        state,
        specs,
        is_leaf=lambda x: isinstance(x, P),
    )


def _routed_run(rs: osa.RowSharding, tx: Any, batches: list[tuple[np.ndarray, np.ndarray]]) -> Any:
    batch = NamedSharding(rs.mesh, P(rs.batch_axis))

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(p: Any, s: Any, ids: jax.Array, y: jax.Array) -> Any:
        value, g, info = rs.value_and_row_grad(loss_fn)(p, ids, y)
        u, s = rs.update(tx, g, s, p)
        return rs.apply_updates(p, u), s, (value, g["emb"].todense(), g["w"]), info

    params = rs.shard(_params())
    state = _placed_state(rs, tx, params)
    grads, infos = [], []
    for ids, y in batches:
        params, state, g, info = step(params, state, jax.device_put(ids, batch), jax.device_put(y, batch))
        grads.append(g)
        infos.append(info)
    return params, state, grads, infos


@pytest.mark.parametrize("mesh_kind", ["explicit"])
@pytest.mark.parametrize(("batch_axis", "routing", "capacity"), ROUTES)
def test_routed_steps_match_one_device(mesh_kind, batch_axis, routing, capacity):
    _check_routed_steps(mesh_kind, batch_axis, routing, capacity)


@pytest.mark.parametrize(("batch_axis", "routing", "capacity"), [ROUTES[0], ROUTES[3]])
def test_routed_steps_on_an_auto_mesh(batch_axis, routing, capacity):
    _check_routed_steps("auto", batch_axis, routing, capacity)


def _check_routed_steps(mesh_kind, batch_axis, routing, capacity):
    mesh = _mesh(mesh_kind)
    rs = osa.RowSharding(mesh, "x", lambda p: p["emb"], batch_axis=batch_axis, routing=routing, capacity=capacity)
    tx = osa.sparse_adam(0.05)
    batches = _batches(3)
    params, state, grads, infos = _routed_run(rs, tx, batches)
    ref_params, ref_state, ref_grads = _one_device_run(tx, batches)

    # Gradients directly (Adam's scale invariance would hide a gradient multiplied by the device count).
    for (value, g_emb, g_w), (r_value, r_emb, r_w) in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(value, r_value, rtol=1e-6)
        np.testing.assert_allclose(g_w, r_w, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(g_emb, r_emb, rtol=1e-5, atol=1e-8)
    if batch_axis is None:  # the same sums in the same order: equal to one float32 rounding (XLA:CPU contracts
        # and reassociates the step's arithmetic differently in the routed and the one-device programs); a
        # parameter's rounding is its updates' (each at most lr = 0.05 in size): on the XLA path a small parameter
        # (6.8e-3) came 1.5e-8 apart, four ulps of an update, after three steps
        tol = {"rtol": 2e-6, "atol": 1e-9}
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **tol), state, ref_state)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-6, atol=0.05 * 2**-20), params, ref_params)
    else:
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), params, ref_params)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), state, ref_state)
    _assert_row_sharded((params, state), mesh)
    routes = [_route_taken(i) for i in infos]
    if routing == "all_to_all" and batch_axis is not None:  # as the buckets of each device's distinct ids say
        cap = _routing._capacity(K // 8, 8, rs.capacity)
        assert routes == [_expected_route([ids], cap) for ids, _ in batches], routes
        assert set(routes) == {"all-gather" if capacity == 3 else "second round" if capacity == 5 else "one round"}
    else:
        assert set(routes) == {"one round"}, routes


def _dense(leaf: Any) -> np.ndarray:
    """A sparse leaf whose arrays may be spread over the devices (a routed gradient), dense on the host."""
    return np.asarray(jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), leaf).todense())


def _route_taken(info: osa.RoutingInfo) -> str:
    """The route a step took, by its RoutingInfo (checked consistent)."""
    overflow, fallback, second = int(info.overflow), bool(info.fallback), bool(info.second_round)
    assert not (fallback and second) and (overflow > 0) == (fallback or second), info
    return "all-gather" if fallback else "second round" if second else "one round"


def _expected_route(tables_ids: list[np.ndarray], capacity: int) -> str:
    """The route of a step whose flat global ids (one array per table, split evenly over the 8 devices) ask for
    rows of tables of N rows in blocks of N / 8: each device's distinct ids bucketed by owner."""
    largest = 0
    for ids in tables_ids:
        for part in np.split(np.asarray(ids).reshape(-1), 8):
            distinct = np.unique(part[(part >= 0) & (part < N)])
            largest = max(largest, int(np.bincount(distinct // (N // 8), minlength=8).max()))
    return "one round" if largest <= capacity else "second round" if largest <= 2 * capacity else "all-gather"


def _custom_calls(compiled_text: str) -> set[str]:
    return {
        line.split('custom_call_target="')[1].split('"')[0]
        for line in compiled_text.splitlines()
        if "custom_call_target" in line
    }


@pytest.mark.skipif(osa.kernel_path() != "native-cpu", reason="the native kernels are off or were not built")
@pytest.mark.parametrize("fused", [True, False], ids=["update_and_apply", "two calls"])
def test_routed_steps_run_the_kernels_on_each_device(fused):
    """Inside ``shard_map`` each device runs the native kernels on its own block: the compiled routed step (8
    simulated devices, all-to-all) holds the lookup's, the deduplication's and the optimizer's custom calls, and its
    results agree with the same step on the XLA path (``use_kernels(False)``) to a few float32 roundings."""
    mesh = _mesh()
    rs = osa.RowSharding(mesh, "x", lambda p: p["emb"], batch_axis="x", routing="all_to_all")
    tx = osa.sparse_adam(0.05)
    batch = NamedSharding(mesh, P("x"))

    def step(p: Any, s: Any, ids: jax.Array, y: jax.Array) -> Any:
        value, g, _ = rs.value_and_row_grad(loss_fn)(p, ids, y)
        if fused:
            return (*rs.update_and_apply(tx, g, s, p), value)
        u, s = rs.update(tx, g, s, p)
        return rs.apply_updates(p, u), s, value

    results = {}
    for kernels in (True, False):
        with osa.use_kernels(kernels):
            params = rs.shard(_params())
            state = tx.init(params)
            batches = [(jax.device_put(ids, batch), jax.device_put(y, batch)) for ids, y in _batches(4)]
            # The executable inspected is the one that runs (compiled once: a routed step's compile is most of the
            # test's time).
            run = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, *batches[0]).compile()
            calls = _custom_calls(run.as_text())
            rule = PREFIX + "sparse_adam_" + ("apply" if fused else "rows")
            assert (rule in calls) is kernels and (PREFIX + "gather" in calls) is kernels, calls
            for ids, y in batches:
                params, state, _ = run(params, state, ids, y)
            results[kernels] = (params, state)
    _assert_row_sharded(results[True], mesh)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-7), results[True], results[False])


def test_a_shard_map_manual_over_some_axes_takes_the_xla_path_for_a_table_sharded_over_the_others():
    """Inside a ``shard_map`` that leaves a mesh axis automatic, a table may still be sharded over it, which the
    kernels' row partitioning cannot split: the step runs the XLA path there (it crashed in the partitioner when
    the kernels ran), with the same numbers as ``use_kernels(False)``."""
    mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    table = jax.device_put(jnp.zeros((64, 4), jnp.float32), NamedSharding(mesh, P("y", None)))
    ids, values = jnp.arange(16, dtype=jnp.int32) % 64, jnp.ones((16, 4), jnp.float32)
    tx = osa.sparse_adam(0.1)

    def body(p: jax.Array, ids: jax.Array, values: jax.Array) -> jax.Array:
        g = osa.IndexedRows(ids, values, 64)
        p, _ = osa.update_and_apply(tx, g, tx.init(p), p)
        return osa.apply_updates(p, g)[None]

    results = []
    for kernels in (True, False):
        with osa.use_kernels(kernels):
            fn = jax.jit(
                jax.shard_map(body, mesh=mesh, in_specs=(P(), P("x"), P("x")), out_specs=P("x"), axis_names={"x"})
            )
            results.append(np.asarray(fn(table, ids, values)))
    np.testing.assert_array_equal(results[0], results[1])


@pytest.mark.skipif(osa.kernel_path() != "native-cpu", reason="the native kernels are off or were not built")
def test_a_kernels_results_vary_over_the_axes_its_operands_vary_over():
    """Inside ``shard_map`` a kernel's results are typed as varying where its operands are, as the XLA path's would
    be: returned as replicated (``out_specs=P()``) they are refused at trace time, where results typed invariant
    would pass and silently return one device's values; summed with ``psum`` they add every device's."""
    mesh = _mesh()
    rng = np.random.default_rng(3)
    keys = rng.integers(0, 50, 8 * 64).astype(np.int32)
    values = rng.standard_normal((8 * 64, 4)).astype(np.float32)
    split = NamedSharding(mesh, P("x"))
    args = (jax.device_put(keys, split), jax.device_put(values, split))

    def summed(keys: jax.Array, values: jax.Array) -> jax.Array:
        return _ffi.coalesce(keys, values, 50)[1].sum(axis=0)  # the kernel itself: each device's entries by key

    replicated = jax.shard_map(summed, mesh=mesh, in_specs=(P("x"), P("x")), out_specs=P())
    with pytest.raises(ValueError, match="could not infer replication"):
        jax.jit(replicated)(*args)
    psum = jax.shard_map(
        lambda k, v: jax.lax.psum(summed(k, v), "x"), mesh=mesh, in_specs=(P("x"), P("x")), out_specs=P()
    )
    np.testing.assert_allclose(jax.jit(psum)(*args), values.sum(axis=0), rtol=1e-5, atol=1e-4)  # 512 unit normals


def test_a_row_shard_kernels_function_may_hold_no_tracer():
    """The function a kernel's partitioning rule keeps lives as long as the step's jaxpr: one that holds a tracer
    (closing over it, through a function it closes over, as a default argument, or through a partial's argument)
    is refused at trace time, naming where; one that closes over the traced value's shape alone runs."""

    def step(table: jax.Array, how: str) -> jax.Array:
        def add(rows: jax.Array) -> jax.Array:
            return rows + table[:1]

        def direct(row_begin: jax.Array, rows: jax.Array) -> tuple[jax.Array]:
            return (rows + table[:1],)

        def through(row_begin: jax.Array, rows: jax.Array) -> tuple[jax.Array]:
            return (add(rows),)  # closes over `add` alone

        def default(row_begin: jax.Array, rows: jax.Array, bias: jax.Array = table[:1]) -> tuple[jax.Array]:
            return (rows + bias,)

        def biased(bias: jax.Array, row_begin: jax.Array, rows: jax.Array) -> tuple[jax.Array]:
            return (rows + bias,)

        fn = {"direct": direct, "through": through, "default": default, "partial": functools.partial(biased, table)}
        return _ffi._by_row_shards(fn[how], "n w -> n w")(table)[0]

    table = jnp.arange(8.0, dtype=jnp.float32).reshape(4, 2)
    where = {"direct": "'table'", "through": "'table'", "default": "a default argument", "partial": "a partial's"}
    for how, held in where.items():
        with pytest.raises(TypeError, match=re.escape(f"holds a tracer ({held}")):
            jax.jit(step, static_argnums=1)(table, how)

    def shape_only(table: jax.Array) -> jax.Array:
        shape = table.shape

        def fn(row_begin: jax.Array, rows: jax.Array) -> tuple[jax.Array]:
            return (rows + jnp.ones(shape, rows.dtype),)

        return _ffi._by_row_shards(fn, "n w -> n w")(table)[0]

    np.testing.assert_array_equal(jax.jit(shape_only)(table), table + 1)


@pytest.mark.parametrize(("capacity", "route"), [(4, "second round"), (2, "all-gather")])
def test_overflow_count_is_exact_and_no_id_is_dropped(capacity, route):
    """Device 0 looks up 6 distinct rows of device 1's block (and one duplicate): capacity 4 leaves 2 over, which
    a second round carries; capacity 2 leaves 4 over, 2 of them over two rounds: the all-gather route."""
    mesh = _mesh()
    rs = osa.RowSharding(mesh, "x", lambda p: p["emb"], batch_axis="x", routing="all_to_all", capacity=capacity)
    block = N // 8
    ids = np.full(K, -1, np.int32)
    ids[:7] = block + np.array([0, 1, 2, 3, 4, 5, 5])  # device 0's share: the first K / 8 ids
    y = np.ones(K, np.float32)
    _, g, info = jax.jit(rs.value_and_row_grad(loss_fn))(
        rs.shard(_params()),
        jax.device_put(ids, NamedSharding(mesh, P("x"))),
        jax.device_put(y, NamedSharding(mesh, P("x"))),
    )
    assert int(info.overflow) == 6 - capacity and _route_taken(info) == route
    _, ref = osa.value_and_row_grad(loss_fn, lambda p: p["emb"])(jax.tree.map(jnp.asarray, _params()), ids, y)
    np.testing.assert_allclose(g["emb"].todense(), ref["emb"].todense(), rtol=1e-6)
    assert np.count_nonzero(np.abs(np.asarray(g["emb"].todense())).sum(1)) == 6


def test_suggested_capacity_is_the_largest_bucket_and_stops_zipf_overflow():
    """Zipf ids on contiguous row blocks crowd device 0's bucket: the default overflows, the suggestion does not."""
    mesh = _mesh()
    rs = osa.RowSharding(mesh, "x", lambda p: p["emb"], batch_axis="x", routing="all_to_all")
    recorded = [ids for ids, _ in _batches(20, seed=11, zipf=True)]
    exact = rs.suggest_capacity(_params(), recorded)
    # The largest bucket, by a loop over devices and owners.
    largest = 0
    for ids in recorded:
        for share in np.array_split(ids, 8):
            u = np.unique(share[(share >= 0) & (share < N)])
            largest = max(largest, max(np.sum(u // (N // 8) == o) for o in range(8)))
    assert exact == largest
    assert rs.suggest_capacity(_params(), recorded, margin=1.25) == int(np.ceil(1.25 * largest))

    def overflows(rs: osa.RowSharding, batches: list[tuple[np.ndarray, np.ndarray]]) -> list[int]:
        batch = NamedSharding(mesh, P("x"))
        lookup = jax.jit(rs.value_and_row_grad(loss_fn))  # traced once for all the batches
        params = rs.shard(_params())
        return [
            int(lookup(params, jax.device_put(ids, batch), jax.device_put(y, batch))[2].overflow) for ids, y in batches
        ]

    fresh = _batches(5, seed=12, zipf=True)
    assert max(overflows(rs, fresh)) > 0  # the default capacity assumes spread ids
    tuned = dataclasses.replace(rs, capacity=rs.suggest_capacity(_params(), recorded, margin=1.25))
    assert all(o == 0 for o in overflows(tuned, fresh))
    with pytest.raises(ValueError, match="margin"):
        rs.suggest_capacity(_params(), recorded, margin=0.5)


def test_owner_aligned_gradients_also_work_with_plain_update_and_apply():
    """The routed gradient is an ordinary IndexedRows in global ids: tx.update and apply_updates take it as is."""
    mesh = _mesh()
    rs = osa.RowSharding(mesh, "x", lambda p: p["emb"], batch_axis="x")
    tx = osa.sparse_adam(0.05)
    ((ids, y),) = _batches(1)
    batch = NamedSharding(mesh, P("x"))

    @jax.jit
    def both(p: Any, s: Any, ids: jax.Array, y: jax.Array) -> Any:
        _, g, _ = rs.value_and_row_grad(loss_fn)(p, ids, y)
        routed = rs.apply_updates(p, rs.update(tx, g, s, p)[0])
        u, _ = tx.update(g, s, p)
        return routed, osa.apply_updates(p, u)

    params = rs.shard(_params())
    routed, plain = both(params, tx.init(params), jax.device_put(ids, batch), jax.device_put(y, batch))
    # one float32 rounding: XLA:CPU contracts the step's arithmetic differently in the two programs
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-9), routed, plain)


@pytest.mark.parametrize("tx", [osa.sparse_adam(0.05), osa.sparse_amsgrad(0.05)])  # fused where it can be, and not
def test_update_and_apply_equals_update_then_apply_updates(tx):
    mesh = _mesh()
    rs = osa.RowSharding(mesh, "x", lambda p: p["emb"], batch_axis="x")
    ((ids, y),) = _batches(1)
    batch = NamedSharding(mesh, P("x"))
    params = rs.shard(_params())
    state = tx.init(params)
    _, g, _ = jax.jit(rs.value_and_row_grad(loss_fn))(params, jax.device_put(ids, batch), jax.device_put(y, batch))

    @jax.jit
    def two_calls(p: Any, s: Any, g: Any) -> Any:
        u, s = rs.update(tx, g, s, p)
        return rs.apply_updates(p, u), s

    fused = jax.jit(functools.partial(rs.update_and_apply, tx))(g, state, params)
    # one float32 rounding: XLA:CPU contracts the step's arithmetic differently in the two programs
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-9), fused, two_calls(params, state, g)
    )
    _assert_row_sharded(fused, mesh)


@pytest.mark.parametrize(
    ("tx", "kernel"),
    [
        (osa.sparse_rowwise_adagrad(0.5), "rowwise_adagrad_apply"),
        # bfloat16 updates (Adam's moments take the table's dtype): apply_stochastic's XLA rounding
        (osa.sparse_adam(0.05), None),
        # float32 updates, not fused (a stage after the optimizer): the native stochastic add on each block
        (optax.chain(osa.sparse_rowwise_adam(0.05), osa.sparse_aware(optax.scale(1.0))), "add_rows_half_stochastic"),
    ],
    ids=["fused rows", "two calls", "two calls, float32 updates"],
)
def test_stochastic_rounding_of_a_row_sharded_bfloat16_table_draws_as_on_one_device(tx, kernel, kernel_path):
    """``RowSharding.update_and_apply(key=)``: each device's block draws by its rows' ids in the whole table (the
    fused row-wise kernel and the stochastic add kernel by the third word of their seeds, the two calls on the XLA
    path by apply_stochastic's first rows), so the table and its state equal ``update_and_apply(key=)``'s on one
    device bitwise (replicated ids, one summation order; the dense leaf's gradient is summed over the devices, to
    float32 rounding), step after step."""
    mesh = _mesh()
    rs = osa.RowSharding(mesh, "x", lambda p: p["emb"])
    rng = np.random.default_rng(11)
    init = {
        "emb": jnp.asarray(rng.standard_normal((N, 16)), jnp.bfloat16),
        "w": jnp.asarray(rng.standard_normal((16,)), jnp.float32),
    }
    batches = [(rng.integers(-1, N + 1, K).astype(np.int32), rng.standard_normal(K).astype(np.float32))] * 3
    is_table = lambda path: "emb" in jax.tree_util.keystr(path)  # noqa: E731
    key = jax.random.key(3)

    @jax.jit
    def one_device(p: Any, s: Any, ids: jax.Array, y: jax.Array, k: jax.Array) -> Any:
        _, g = osa.value_and_row_grad(loss_fn, lambda p: p["emb"])(p, ids, y)
        return osa.update_and_apply(tx, g, s, p, key=k)

    @jax.jit
    def sharded(p: Any, s: Any, ids: jax.Array, y: jax.Array, k: jax.Array) -> Any:
        _, g, _ = rs.value_and_row_grad(loss_fn)(p, ids, y)
        return rs.update_and_apply(tx, g, s, p, key=k)

    @jax.jit
    def nearest(p: Any, s: Any, ids: jax.Array, y: jax.Array) -> Any:
        _, g, _ = rs.value_and_row_grad(loss_fn)(p, ids, y)
        return rs.update_and_apply(tx, g, s, p)

    ref = (init, tx.init(init))
    got = (rs.shard(init), _placed_state(rs, tx, rs.shard(init)))  # each step one executable (see _placed_state)
    hlo = sharded.lower(*got, jnp.asarray(batches[0][0]), jnp.asarray(batches[0][1]), key).compile().as_text()
    calls = set(re.findall(f'custom_call_target="{PREFIX}(\\w+)"', hlo))
    if kernel is not None:
        assert (kernel in calls) == (kernel_path == "native-cpu"), calls
    else:
        assert "add_rows_half_stochastic" not in calls, calls
    for step, (ids, y) in enumerate(batches):
        k = jax.random.fold_in(key, step)
        ref = one_device(*ref, jnp.asarray(ids), jnp.asarray(y), k)
        to_nearest = nearest(*got, jnp.asarray(ids), jnp.asarray(y))
        got = sharded(*got, jnp.asarray(ids), jnp.asarray(y), k)
        _assert_row_sharded(got[0], mesh)
        assert got[0]["emb"].dtype == jnp.bfloat16
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(ref), strict=True):
            if is_table(path):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))
            else:
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7, err_msg=jax.tree_util.keystr(path))
        ref = jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), got)  # the next step from the same dense leaf
        # the draws matter: rounding to nearest gives other parameters
        assert not np.array_equal(np.asarray(to_nearest[0]["emb"]), np.asarray(got[0]["emb"]))


def test_several_tables_and_a_table_looked_up_twice():
    mesh = _mesh()
    rng = np.random.default_rng(5)
    init = {
        "user": jnp.asarray(rng.standard_normal((N, 4)), jnp.float32),
        "item": jnp.asarray(rng.standard_normal((2 * N, 8)), jnp.float32),
        "proj": jnp.asarray(rng.standard_normal((8, 4)), jnp.float32),
    }

    def loss(p: Any, ids: Any, y: jax.Array) -> jax.Array:
        users, pos, neg = ids
        score = lambda items: jnp.sum(p["user"][users] * (p["item"][items] @ p["proj"]), axis=1)  # noqa: E731
        return jnp.mean(jax.nn.softplus(score(neg) - score(pos)) * y)

    def tables(p: Any) -> Any:
        return p["user"], p["item"], p["item"]

    ids = tuple(jnp.asarray(rng.integers(-1, n, K), jnp.int32) for n in (N, 2 * N, 2 * N))
    y = jnp.asarray(rng.random(K), jnp.float32)
    tx = osa.sparse_adam(0.05)
    ref_value, ref_g = osa.value_and_row_grad(loss, tables)(init, ids, y)
    ref_u, _ = tx.update(ref_g, tx.init(init), init)
    ref_p = osa.apply_updates(init, ref_u)
    for batch_axis in (None, "x"):
        rs = osa.RowSharding(mesh, "x", tables, batch_axis=batch_axis, capacity=K // 8)
        batch = NamedSharding(mesh, P(batch_axis))
        params = rs.shard(jax.tree.map(np.asarray, init))

        @jax.jit
        def step(p: Any, s: Any, ids: Any, y: jax.Array, rs: osa.RowSharding = rs) -> Any:
            value, g, _ = rs.value_and_row_grad(loss)(p, ids, y)
            u, s = rs.update(tx, g, s, p)
            return value, g, rs.apply_updates(p, u)

        value, g, p = step(params, tx.init(params), jax.device_put(ids, batch), jax.device_put(y, batch))
        np.testing.assert_allclose(value, ref_value, rtol=1e-6)
        for name in ("user", "item"):
            np.testing.assert_allclose(g[name].todense(), ref_g[name].todense(), rtol=1e-5, atol=1e-8)
        np.testing.assert_allclose(g["proj"], ref_g["proj"], rtol=1e-5, atol=1e-8)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), p, ref_p)
        assert p["item"].sharding.is_equivalent_to(NamedSharding(mesh, P("x", None)), 2)


def _collectives(compiled_text: str) -> dict[str, int]:
    """The all-to-all, all-gather and reduce-scatter instructions of a compiled program (in every computation:
    branches too), by kind and element type."""
    counts: dict[str, int] = {}
    for line in compiled_text.splitlines():
        match = re.match(r"\s*(?:ROOT )?%\S+ = \(?(\w+)\[.* (all-to-all|all-gather|reduce-scatter)\(", line)
        if match:
            key = f"{match[2]} {match[1]}"
            counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.mark.parametrize(
    ("routing", "capacity"),
    [("all_to_all", None), ("all_to_all", 5), ("all_to_all", 2), ("all_gather", None)],
    ids=["one-round", "second-round", "all-gather-fallback", "all-gather-route"],
)
def test_the_tables_of_a_routed_step_share_each_exchange(routing, capacity):
    """The tables of a routed step share each collective: the compiled lookup and backward of three float32
    tables of different widths and of a bfloat16 one beside them hold as many all-to-alls (their bytes), all-gathers
    and reduce-scatters as those of one table, as does ``rs.route`` of their gradients (keys and values as bytes), on
    every route. The values and gradients equal one device's, the step taking the route the buckets say."""
    mesh = _mesh()
    rng = np.random.default_rng(9)
    shapes = {"a": (N, 4), "b": (2 * N, 8), "c": (N, 3), "h": (N, 4)}
    dtypes = {"a": jnp.float32, "b": jnp.float32, "c": jnp.float32, "h": jnp.bfloat16}
    init = {name: jnp.asarray(rng.standard_normal(s), dtypes[name]) for name, s in shapes.items()}
    # Zipf ids (a few hot rows, so that small buckets overflow) and padding, the same hot rows on every device.
    ids = {
        name: np.where(rng.random(K) < 0.1, -1, (rng.zipf(1.5, K) * 37) % s[0]).astype(np.int32)
        for name, s in shapes.items()
    }
    y = rng.standard_normal(K).astype(np.float32)

    def loss(p: Any, ids: Any, y: jax.Array) -> jax.Array:
        feats = [jnp.sum(p[name][ids[name]].astype(jnp.float32), axis=1) for name in sorted(p)]
        return jnp.mean((sum(f * (i + 1.0) for i, f in enumerate(feats)) - y) ** 2)

    def routed(names: list[str]) -> tuple[Any, dict[str, int]]:
        rs = osa.RowSharding(
            mesh, "x", lambda p: tuple(p[n] for n in names), batch_axis="x", routing=routing, capacity=capacity
        )
        batch = NamedSharding(mesh, P("x"))
        params = rs.shard({n: init[n] for n in names})
        args = (params, tuple(jax.device_put(ids[n], batch) for n in names), jax.device_put(y, batch))

        def run(p: Any, ids: Any, y: jax.Array) -> Any:
            return rs.value_and_row_grad(lambda p, i, y: loss(p, dict(zip(names, i, strict=True)), y))(p, ids, y)

        step = jax.jit(run)
        return step(*args), _collectives(step.lower(*args).compile().as_text())

    (value, grads, info), counts = routed(list(shapes))
    _, one = routed(["a"])
    _, three = routed(["a", "b", "c"])
    assert {"all_to_all": {"all-to-all u8"}, "all_gather": {"all-gather u8", "reduce-scatter f32"}}[routing] <= set(one)
    assert counts == three == one, (counts, three, one)

    ref_value, ref_grads = osa.value_and_row_grad(loss, lambda p: tuple(p[n] for n in shapes))(init, ids, y)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    for name in shapes:
        got, ref = (np.asarray(g[name].todense(), np.float32) for g in (grads, ref_grads))
        # bfloat16 gradients: the devices sum a hot row's duplicates in bfloat16, in another order than one device.
        tol = {"rtol": 0.05, "atol": 0.05 * np.abs(ref).max()} if name == "h" else {"rtol": 1e-5, "atol": 1e-7}
        np.testing.assert_allclose(got, ref, **tol)
        np.testing.assert_array_equal(got != 0, ref != 0)  # the same rows (an exchange mixed up would move them)
    want = {None: "one round", 5: "second round", 2: "all-gather"}[capacity] if routing == "all_to_all" else "one round"
    assert _route_taken(info) == want

    # The gradients' own route (rs.route): the tables' keys and values go in one exchange of bytes a round.
    def routed_entries(names: list[str]) -> tuple[Any, Any, dict[str, int]]:
        rs = osa.RowSharding(
            mesh, "x", lambda p: tuple(p[n] for n in names), batch_axis="x", routing=routing, capacity=capacity
        )
        batch = NamedSharding(mesh, P("x"))
        params = rs.shard({n: init[n] for n in names})
        grads = {
            n: osa.IndexedRows(
                jax.device_put(ids[n], batch),
                jax.device_put(rng.standard_normal((K, shapes[n][1])).astype(dtypes[n]), batch),
                shapes[n][0],
            )
            for n in names
        }
        route = jax.jit(rs.route)
        routed, info = route(grads, params)
        return (grads, routed, info), _collectives(route.lower(grads, params).compile().as_text())

    (grads, routed, info), counts = routed_entries(list(shapes))
    _, one = routed_entries(["a"])
    assert counts == one and set(one) <= {"all-to-all u8", "all-gather u8"}, (counts, one)
    assert _route_taken(info) == want
    for name in shapes:  # summed per device, then per owner: float32 (and bfloat16) roundings apart
        got, ref = (_dense(g[name]).astype(np.float32) for g in (routed, grads))
        tol = {"rtol": 0.05, "atol": 0.05 * np.abs(ref).max()} if name == "h" else {"rtol": 1e-6, "atol": 1e-6}
        np.testing.assert_allclose(got, ref, **tol)


@pytest.mark.parametrize(("routing", "capacity"), [("all_to_all", None), ("all_to_all", 2), ("all_gather", None)])
def test_a_complex_table_beside_a_float_one_routes_as_on_one_device(routing, capacity):
    """A complex64 table shares the step's collectives with a float32 one (as its real and imaginary parts): the
    routed lookup's value and gradients, and ``rs.route`` of complex entries, equal one device's; ``rs.route`` of a
    tree with no sparse leaf passes it through."""
    mesh = _mesh()
    rng = np.random.default_rng(13)
    init = {
        "z": jnp.asarray(rng.standard_normal((N, 3)) + 1j * rng.standard_normal((N, 3)), jnp.complex64),
        "f": jnp.asarray(rng.standard_normal((N, 4)), jnp.float32),
    }
    ids = tuple(jnp.asarray((rng.zipf(1.5, K) * 37) % N, jnp.int32) for _ in range(2))
    y = jnp.asarray(rng.standard_normal(K), jnp.float32)

    def loss(p: Any, ids: Any, y: jax.Array) -> jax.Array:
        z = p["z"][ids[0]]
        return jnp.mean(
            (jnp.sum(jnp.real(z * jnp.conj(z)) + jnp.imag(z), axis=1) * jnp.sum(p["f"][ids[1]], 1) - y) ** 2
        )

    tables = lambda p: (p["z"], p["f"])  # noqa: E731
    ref_value, ref_g = osa.value_and_row_grad(loss, tables)(init, ids, y)
    rs = osa.RowSharding(mesh, "x", tables, batch_axis="x", routing=routing, capacity=capacity)
    batch = NamedSharding(mesh, P("x"))
    params = rs.shard(init)
    value, g, _ = jax.jit(rs.value_and_row_grad(loss))(params, jax.device_put(ids, batch), jax.device_put(y, batch))
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    for name in init:
        got = _dense(g[name])
        np.testing.assert_allclose(got, ref_g[name].todense(), rtol=1e-4, atol=1e-6)
    grads = {
        "z": osa.IndexedRows(
            jax.device_put(ids[0], batch), jax.device_put(jnp.ones((K, 3), jnp.complex64) * 1j, batch), N
        ),
        "f": osa.IndexedRows(jax.device_put(ids[1], batch), jax.device_put(jnp.ones((K, 4), jnp.float32), batch), N),
    }
    routed, _ = jax.jit(rs.route)(grads, params)
    for name, value in (("z", 1j), ("f", 1.0)):
        want = np.zeros(init[name].shape, init[name].dtype)
        np.add.at(want, np.asarray(ids[name == "f"]), value)
        got = _dense(routed[name])
        np.testing.assert_array_equal(got, want)
    dense = {"z": jnp.zeros((N, 3), jnp.complex64), "f": jnp.zeros((N, 4), jnp.float32)}
    passed, _ = jax.jit(rs.route)(jax.device_put(dense, NamedSharding(mesh, P("x", None))), params)
    jax.tree.map(np.testing.assert_array_equal, passed, dense)


_HLO_BYTES = {"u8": 1, "s8": 1, "pred": 1, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4, "f64": 8, "s64": 8}


def _all_to_all_bytes(compiled_text: str) -> int:
    """The bytes the all-to-alls of a compiled program return, summed over every computation (branches too)."""
    total = 0
    for line in compiled_text.splitlines():
        match = re.match(r"\s*(?:ROOT )?%\S+ = (.*?) all-to-all\(", line)
        if match:
            for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", match[1]):
                total += _HLO_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


@pytest.mark.parametrize("capacity", [None, 5, 2], ids=["one-round", "second-round", "all-gather-fallback"])
def test_a_table_with_fewer_rows_per_device_than_the_capacity_gets_buckets_of_its_rows(capacity):
    """An owner holds at most its rows, so a table with fewer rows per device than the capacity has buckets of that
    many slots, in one round, never standing by for the all-gather route: alone, its lookup and backward exchange
    ``n * rows_per_device`` ids and twice as many rows (nothing else, no branch). Beside a crowded table that takes
    a second round or the all-gather route, its buckets stay one round; values, gradients and the trained tables
    equal one device's."""
    mesh = _mesh()
    rng = np.random.default_rng(21)
    shapes = {"tiny": (16, D), "big": (N, D)}  # the tiny table: 2 rows a device, under every capacity here
    init = {name: jnp.asarray(rng.standard_normal(s), jnp.float32) for name, s in shapes.items()}
    ids = {  # hot rows crowding a few owners of the big table
        "tiny": rng.integers(-1, 16, K).astype(np.int32),
        "big": ((rng.zipf(1.5, K) * 37) % N).astype(np.int32),
    }
    y = rng.standard_normal(K).astype(np.float32)

    def loss(p: Any, ids: Any, y: jax.Array) -> jax.Array:
        return jnp.mean((jnp.sum(p["tiny"][ids[0]], 1) * jnp.sum(p["big"][ids[1]], 1) - y) ** 2)

    def tables(p: Any) -> Any:
        return p["tiny"], p["big"]

    batch = NamedSharding(mesh, P("x"))
    rs = osa.RowSharding(mesh, "x", tables, batch_axis="x", capacity=capacity)

    # Alone: one exchange of 2 ids per owner, and of their rows forward and their gradients back.
    alone = osa.RowSharding(mesh, "x", lambda p: p["tiny"], batch_axis="x", capacity=capacity)

    def lookup(p: Any, ids: jax.Array, y: jax.Array) -> Any:
        return alone.value_and_row_grad(lambda p, i, y: jnp.mean((jnp.sum(p["tiny"][i], 1) - y) ** 2))(p, ids, y)

    args = (alone.shard({"tiny": init["tiny"]}), jax.device_put(ids["tiny"], batch), jax.device_put(y, batch))
    text = jax.jit(lookup).lower(*args).compile().as_text()
    assert _all_to_all_bytes(text) == 8 * 2 * (4 + 2 * 4 * D)  # ids, then rows and gradients of width D, float32

    tx = osa.sparse_adam(0.05)
    params = rs.shard(jax.tree.map(np.asarray, init))

    @jax.jit
    def step(p: Any, s: Any, ids: Any, y: jax.Array) -> Any:
        value, g, info = rs.value_and_row_grad(loss)(p, ids, y)
        u, s = rs.update(tx, g, s, p)
        return value, g, rs.apply_updates(p, u), info

    ids_t = (ids["tiny"], ids["big"])
    value, g, p, info = step(params, tx.init(params), jax.device_put(ids_t, batch), jax.device_put(y, batch))
    assert _route_taken(info) == {None: "one round", 5: "second round", 2: "all-gather"}[capacity]
    ref_value, ref_g = osa.value_and_row_grad(loss, tables)(init, ids_t, y)
    ref_p = osa.apply_updates(init, tx.update(ref_g, tx.init(init), init)[0])
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    for name in shapes:
        np.testing.assert_allclose(g[name].todense(), ref_g[name].todense(), rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(p[name], ref_p[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("capacity", [None, 8])
def test_routed_entries_with_a_broken_unique_indices_promise_are_summed_not_dropped(capacity):
    """``rs.route`` of entries promised distinct (``unique_indices=True``) that repeat rows: every entry reaches its
    owner and the owner's rows hold their sums, as without the promise, also in a table whose buckets hold one entry
    per row (fewer rows per device than the capacity), where unsummed duplicates would overflow them."""
    mesh = _mesh()
    rs = osa.RowSharding(mesh, "x", lambda p: p["t"], batch_axis="x", capacity=capacity)
    params = rs.shard({"t": np.zeros((16, 2), np.float32)})
    batch = NamedSharding(mesh, P("x"))
    ids = jax.device_put(np.tile(np.array([0, 0, 0, 0, 1, 1, 1, 1], np.int32), 8), batch)  # rows of device 0
    values = jax.device_put(np.ones((64, 2), np.float32), batch)
    for promise in (False, True):
        grads = {"t": osa.IndexedRows(ids, values, 16, unique_indices=promise)}
        routed, info = jax.jit(rs.route)(grads, params)
        dense = _dense(routed["t"])
        np.testing.assert_array_equal(dense[:2], np.full((2, 2), 32.0, np.float32))
        np.testing.assert_array_equal(dense[2:], 0.0)
        assert _route_taken(info) == "one round"


def _collection_tables(coll: osa.EmbeddingCollection) -> dict[str, jax.Array]:
    """The collection's stacks (``coll.stack``, in its layout) of tables drawn by NumPy: the values ``coll.init``
    would draw take a compile of their own for each collection's shapes, and what is tested here is the routed
    step, from any values (the initializer is tested with the collection itself)."""
    rng = np.random.default_rng(0)  # apart from the test's own draws, which its ids and routes come from
    return coll.stack(  # at the default initializer's scale, 1 / sqrt(width)
        {
            n: (rng.standard_normal((t.num_rows, t.width)) / np.sqrt(t.width)).astype(np.float32)
            for n, t in coll.tables.items()
        }
    )


@pytest.mark.parametrize("routing", ["all_to_all", "all_gather"])
def test_a_collection_with_pooled_bags_matches_one_device(routing):
    """A stack of tables read by pooled multi-hot features, routed over 8 devices, equals the one-device step."""
    coll = osa.EmbeddingCollection(
        {"user": osa.TableSpec(N, D), "item": osa.TableSpec(2 * N, D)},
        {"user": osa.FeatureSpec("user"), "hist": osa.FeatureSpec("item", "mean"), "cand": osa.FeatureSpec("item")},
    )
    rng = np.random.default_rng(6)
    init = {"emb": _collection_tables(coll), "w": jnp.asarray(rng.standard_normal(D), jnp.float32)}
    batch = 32
    ids = {
        "user": rng.integers(-1, N, batch).astype(np.int32),
        "hist": rng.integers(-1, 2 * N, (batch, 7)).astype(np.int32),
        "cand": rng.integers(0, 2 * N, batch).astype(np.int32),
    }
    y = jnp.asarray(rng.standard_normal(batch), jnp.float32)

    def loss(p: Any, bags: Any, y: jax.Array) -> jax.Array:
        f = coll.pool(p["emb"], bags)
        return jnp.mean(((f["user"] + f["hist"]) * f["cand"] @ p["w"] - y) ** 2)

    tables = lambda p: p["emb"]  # noqa: E731
    tx = osa.sparse_adam(0.05)
    bags = coll.bags(ids)
    ref_value, ref_g = osa.value_and_row_grad(loss, tables)(init, bags, y)
    ref_p, _ = osa.update_and_apply(tx, ref_g, tx.init(init), init)
    rs = osa.RowSharding(_mesh(), "x", tables, routing=routing)
    params = rs.shard(init)

    @jax.jit
    def step(p: Any, s: Any, ids: Any, y: jax.Array) -> Any:
        value, g, _ = rs.value_and_row_grad(loss)(p, coll.bags(ids), y)
        return (value, g, *rs.update_and_apply(tx, g, s, p))

    value, g, p, _ = step(params, tx.init(params), ids, y)
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    stack = "float32_4"
    np.testing.assert_allclose(g["emb"][stack].todense(), ref_g["emb"][stack].todense(), rtol=1e-5, atol=1e-8)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), p, ref_p)
    with pytest.raises(ValueError, match=r"Bags for table \['emb'\]\['float32_4'\] cannot be split over the 8 devices"):
        osa.RowSharding(_mesh(), "x", tables, batch_axis="x").value_and_row_grad(loss)(params, bags, y)


@pytest.mark.parametrize(
    ("routing", "capacity", "mesh_kind"),
    [("all_to_all", None, "auto"), ("all_to_all", 3, "explicit"), ("all_gather", None, "auto")],
)
def test_a_collection_laid_out_for_the_devices_takes_a_data_parallel_step_as_one_device(routing, capacity, mesh_kind):
    """``EmbeddingCollection(..., shards=8)`` on a data-parallel step (``batch_axis``): each device pools its share
    of the examples' bags (sum, weighted mean, sqrt-n; padding, empty bags, a table of rows no multiple of 8) and the
    step equals the one-device step of the same collection, loss, gradients and parameters, on every route (at
    capacity 3, the all-gather one). On an Auto mesh the step builds the bags from the split ids; on an Explicit mesh
    (where building them from split ids would need every reshape's output sharding) they are built, then split."""
    coll = osa.EmbeddingCollection(
        {"user": osa.TableSpec(N, D), "item": osa.TableSpec(2 * N, D), "tag": osa.TableSpec(37, D)},
        {
            "user": osa.FeatureSpec("user"),
            "hist": osa.FeatureSpec("item", "mean"),
            "cand": osa.FeatureSpec("item"),
            "tags": osa.FeatureSpec("tag", "sqrtn"),
        },
        shards=8,
    )
    rng = np.random.default_rng(7)
    init = {"emb": _collection_tables(coll), "w": jnp.asarray(rng.standard_normal(D), jnp.float32)}
    batch = 32
    hist = rng.integers(-1, 2 * N, (batch, 7)).astype(np.int32)
    hist[3] = -1  # an empty bag
    ids = {
        "user": rng.integers(-1, N, batch).astype(np.int32),
        "hist": hist,
        "cand": rng.integers(0, 2 * N, batch).astype(np.int32),
        "tags": rng.integers(-1, 40, (batch, 3)).astype(np.int32),
    }
    weights = {"hist": rng.uniform(0.5, 2.0, (batch, 7)).astype(np.float32)}
    y = jnp.asarray(rng.standard_normal(batch), jnp.float32)

    def loss(p: Any, bags: Any, y: jax.Array) -> jax.Array:
        f = coll.pool(p["emb"], bags)
        return jnp.mean(((f["user"] + f["hist"] + f["tags"]) * f["cand"] @ p["w"] - y) ** 2)

    tables = lambda p: p["emb"]  # noqa: E731
    tx = osa.sparse_adam(0.05)
    bags = jax.jit(coll.bags)(ids, weights)
    ref_value, ref_g = osa.value_and_row_grad(loss, tables)(init, bags, y)
    ref_p, _ = osa.update_and_apply(tx, ref_g, tx.init(init), init)
    mesh = _mesh(mesh_kind)
    rs = osa.RowSharding(mesh, "x", tables, batch_axis="x", routing=routing, capacity=capacity)
    params = rs.shard(init)
    split = NamedSharding(mesh, P("x"))

    @jax.jit
    def step(p: Any, s: Any, bags: Any, y: jax.Array) -> Any:
        if mesh_kind == "auto":
            bags = coll.bags(*bags)
        value, g, info = rs.value_and_row_grad(loss)(p, bags, y)
        return (value, g, info, *rs.update_and_apply(tx, g, s, p))

    given = (ids, weights) if mesh_kind == "auto" else bags
    value, g, info, p, _ = step(params, tx.init(params), *jax.device_put((given, y), split))
    if mesh_kind == "explicit":  # bags built from the split ids: refused, saying how to build them
        with pytest.raises(ValueError, match=r"split over the Explicit mesh axes \('x',\).*before splitting them"):
            jax.jit(coll.bags)(*jax.device_put((ids, weights), split))
    if capacity:
        assert _route_taken(info) == "all-gather"  # some device asks one owner for more than 2 * 3 rows
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    stack = "float32_4_shards8"
    np.testing.assert_allclose(g["emb"][stack].todense(), ref_g["emb"][stack].todense(), rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(g["w"], ref_g["w"], rtol=1e-5, atol=1e-7)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), p, ref_p)


def test_a_table_two_rounds_always_fit_keeps_its_second_round_in_a_step_another_sends_down_the_all_gather():
    """Capacity 2: table "a" has 4 ids a device (two rounds always fit it: no all-gather branch), device 0 asking 3
    rows of device 1's block; table "b" has 8 ids a device, device 0 asking 6 rows of device 2's block, over two
    rounds: the step takes the all-gather route, and "a"'s third id still reaches its owner in a second round."""
    mesh = _mesh()
    block = N // 8
    rng = np.random.default_rng(12)
    init = {name: jnp.asarray(rng.standard_normal((N, D)), jnp.float32) for name in ("a", "b")}
    w = jnp.asarray(rng.standard_normal(D), jnp.float32)
    ids_a = np.full(8 * 4, -1, np.int32)
    ids_a[:3] = block + np.array([0, 1, 2])
    ids_b = np.full(8 * 8, -1, np.int32)
    ids_b[:6] = 2 * block + np.arange(6)

    def loss(p: Any, ids: Any) -> jax.Array:
        return jnp.mean(p["a"][ids[0]] @ w) + jnp.mean(jnp.tanh(p["b"][ids[1]]) @ w)

    def tables(p: Any) -> Any:
        return p["a"], p["b"]

    ref_value, ref_g = osa.value_and_row_grad(loss, tables)(init, (ids_a, ids_b))
    rs = osa.RowSharding(mesh, "x", tables, batch_axis="x", capacity=2)
    batch = NamedSharding(mesh, P("x"))
    value, g, info = jax.jit(rs.value_and_row_grad(loss))(
        rs.shard(jax.tree.map(np.asarray, init)), jax.device_put((ids_a, ids_b), batch)
    )
    assert _route_taken(info) == "all-gather" and int(info.overflow) == 1 + 4
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    for name in ("a", "b"):
        got = _dense(g[name])
        np.testing.assert_allclose(got, ref_g[name].todense(), rtol=1e-5, atol=1e-8)
    assert np.count_nonzero(np.abs(got).sum(1)) == 6
    # the routed gradients' own route (rs.route): "a"'s entries over the first round reach their owner too
    grads = {
        "a": osa.IndexedRows(jnp.asarray(ids_a), jnp.ones((32, D), jnp.float32), N),
        "b": osa.IndexedRows(jnp.asarray(ids_b), jnp.ones((64, D), jnp.float32), N),
    }
    routed, info = jax.jit(rs.route)(jax.device_put(grads, batch), rs.shard(jax.tree.map(np.asarray, init)))
    assert _route_taken(info) == "all-gather"
    for name, ids in (("a", ids_a), ("b", ids_b)):
        dense = _dense(routed[name])
        want = np.zeros((N, D), np.float32)
        np.add.at(want, ids[ids >= 0], 1.0)
        np.testing.assert_array_equal(dense, want)


# ------------------------------------------------------------------------- routing sparse gradients


@pytest.mark.parametrize(
    ("kind", "batch_axis", "routing", "capacity"),
    [("indexed_rows", *route) for route in [(None, "all_to_all", None), ("x", "all_gather", None)]]
    + [(kind, "x", "all_to_all", capacity) for kind in KINDS[:3] for capacity in (None, 2, 5)],
)
def test_routed_sparse_gradients_match_one_device(kind, batch_axis, routing, capacity):
    mesh = _mesh()
    rs = osa.RowSharding(mesh, "x", lambda p: p["emb"], batch_axis=batch_axis, routing=routing, capacity=capacity)
    rng = np.random.default_rng(7)
    ids = jnp.asarray(rng.integers(-1, N + 1, K), jnp.int32)
    values = jnp.asarray(rng.standard_normal((K, D)), jnp.float32)
    w = jnp.asarray(rng.standard_normal(D), jnp.float32)
    tx = osa.sparse_adam(0.05)
    init = jax.tree.map(jnp.asarray, _params())
    ref_g = {"emb": _plain_grad(kind, ids, values), "w": w}
    ref_u, ref_s = tx.update(ref_g, tx.init(init), init)
    ref_p = osa.apply_updates(init, ref_u)

    @jax.jit
    def step(p: Any, s: Any, g: Any) -> Any:
        g, info = rs.route(g, p)
        u, s = rs.update(tx, g, s, p)
        return rs.apply_updates(p, u), s, g, info

    params = rs.shard(init)
    entries = NamedSharding(mesh, P(batch_axis))
    g = {"emb": _plain_grad(kind, jax.device_put(ids, entries), jax.device_put(values, entries)), "w": w}
    p, s, routed, info = step(params, tx.init(params), g)
    on_host = jax.tree.map(lambda a: jnp.asarray(np.asarray(a)), routed["emb"])  # BCOO.todense: one device
    np.testing.assert_allclose(on_host.todense(), ref_g["emb"].todense(), rtol=1e-6, atol=1e-7)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), p, ref_p)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), s, ref_s)
    _assert_row_sharded((p, s), mesh)
    # each device's entries (K / 8 of them) summed by row and bucketed by owner
    expected = _expected_route([np.asarray(ids)], _routing._capacity(K // 8, 8, rs.capacity))
    assert _route_taken(info) == expected == {None: "one round", 2: "all-gather", 5: "second round"}[capacity]


# ---------------------------------------------------------------------------------- memory and errors


def test_routed_step_temporaries_do_not_grow_with_the_table():
    """Compiled temporaries per device are the same for a table 16x larger: nothing table-sized is copied."""
    mesh = _mesh()
    tx = osa.sparse_adam(0.05)
    temps = []
    for rows in (1 << 20, 1 << 24):  # compiled only, never allocated
        rs = osa.RowSharding(mesh, "x", lambda p: p["emb"], batch_axis="x", capacity=64)
        params = {
            "emb": jax.ShapeDtypeStruct((rows, 16), jnp.float32, sharding=NamedSharding(mesh, P("x", None))),
            "w": jax.ShapeDtypeStruct((16,), jnp.float32, sharding=NamedSharding(mesh, P())),
        }
        state = jax.eval_shape(tx.init, params)
        state = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s)),
            state,
            rs.state_specs(tx, state, params),
        )
        batch = jax.ShapeDtypeStruct((1024,), jnp.int32, sharding=NamedSharding(mesh, P("x")))
        y = jax.ShapeDtypeStruct((1024,), jnp.float32, sharding=NamedSharding(mesh, P("x")))

        def step(p: Any, s: Any, ids: jax.Array, y: jax.Array, rs: osa.RowSharding = rs) -> Any:
            _, g, _ = rs.value_and_row_grad(loss_fn)(p, ids, y)
            u, s = rs.update(tx, g, s, p)
            return rs.apply_updates(p, u), s

        compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, batch, y).compile()
        temps.append(compiled.memory_analysis().temp_size_in_bytes)
    assert temps[1] == temps[0], temps
    # An eighth of one device's block of the smaller table (2 MB): the XLA path's temporaries of a batch of 1,024
    # ids (553,608 bytes) are the larger, the kernels' the smaller.
    assert temps[0] < (1 << 20) * 16 * 4 // 8 // 8, temps


def test_errors_name_the_table_and_what_to_do():
    mesh = _mesh()
    with pytest.raises(ValueError, match="batch_axis"):
        osa.RowSharding(mesh, "x", lambda p: p["emb"], batch_axis="y")
    with pytest.raises(ValueError, match="not an axis of the mesh"):
        osa.RowSharding(mesh, "rows", lambda p: p["emb"])
    with pytest.raises(ValueError, match="capacity"):
        osa.RowSharding(mesh, "x", lambda p: p["emb"], capacity=0)
    rs = osa.RowSharding(mesh, "x", lambda p: p["emb"])
    with pytest.raises(ValueError, match=r"\['emb'\] has 100 rows, not a multiple of the 8 devices"):
        rs.shard({"emb": np.zeros((100, 2), np.float32)})
    with pytest.raises(ValueError, match="selected 1 table"):
        rs.value_and_row_grad(loss_fn)(rs.shard(_params()), (jnp.zeros(8, jnp.int32), jnp.zeros(8, jnp.int32)))
    with pytest.raises(TypeError, match="must be integers"):
        rs.value_and_row_grad(loss_fn)(rs.shard(_params()), jnp.zeros(8, jnp.float32), jnp.zeros(8, jnp.float32))
    with pytest.raises(TypeError, match="must select leaves"):
        osa.RowSharding(mesh, "x", lambda p: 3).shard(_params())


def test_a_routed_step_names_the_parameter_of_a_gradient_that_does_not_fit():
    """A gradient a routed step cannot take is refused naming the parameter's path (it said ``<root>``) and the
    whole table's shape (a gradient for another number of rows was measured against one device's block)."""
    rs = osa.RowSharding(_mesh(), "x", lambda p: p["emb"])
    params = rs.shard(_params())
    tx = osa.sparse_adam(0.1)
    ids = jnp.arange(8, dtype=jnp.int32)
    for step in (rs.update_and_apply, rs.update):
        bad = {"emb": osa.IndexedRows(ids, jnp.ones((8, D), jnp.int32), N, owner_axis="x"), "w": jnp.zeros((D,))}
        with pytest.raises(TypeError, match=r"parameter \['emb'\]: sparse values must be floating point"):
            step(tx, bad, tx.init(params), params)
        bad = {"emb": osa.IndexedRows(ids, jnp.ones((8, D), jnp.float32), 2 * N), "w": jnp.zeros((D,), jnp.float32)}
        with pytest.raises(
            ValueError,
            match=rf"\['emb'\]: the gradient \(IndexedRows\) has shape \({2 * N}, {D}\) but "
            rf"the table has shape \({N}, {D}\)",
        ):
            step(tx, bad, tx.init(params), params)


@pytest.mark.parametrize("form", ["indexed_rows", "bcoo"])
def test_a_routed_step_refuses_a_gradient_that_was_not_routed(form):
    """The routed steps take a table's gradient only in the owners' layout. One in global ids that was never routed
    (its entries split over the devices as they come) lost every entry a device did not own, without a word: on 8
    devices, 3 of 8 rows moved. Such a gradient is now refused before anything runs, naming the table; the routed
    one, also after a tree map and a stateless stage, steps as one device does."""
    mesh = _mesh()
    rs = osa.RowSharding(mesh, "x", lambda p: p["emb"])
    init = jax.tree.map(jnp.asarray, _params())
    params = rs.shard(init)
    tx = osa.sparse_adam(0.1)
    ids = jnp.arange(0, N, N // 8, dtype=jnp.int32)  # one row on each device
    values = jnp.ones((8, D), jnp.float32)
    rows = osa.IndexedRows(ids, values, N)
    grads = {"emb": rows if form == "indexed_rows" else jsparse.BCOO((values, ids[:, None]), shape=(N, D))}
    grads["w"] = jnp.zeros((D,), jnp.float32)
    message = r"parameter \['emb'\]: the (IndexedRows|BCOO) of this table was not routed to the owners of its rows"
    for step in (rs.update_and_apply, rs.update):
        with pytest.raises(ValueError, match=message):
            step(tx, grads, tx.init(params), params)
    with pytest.raises(ValueError, match=message):
        rs.apply_updates(params, grads)
    with pytest.raises(ValueError, match=message):  # marked for another mesh axis
        rs.update(tx, {**grads, "emb": dataclasses.replace(rows, owner_axis="y")}, tx.init(params), params)

    routed, _ = jax.jit(rs.route)(grads, params)
    assert osa.IndexedRows is type(routed["emb"]) if form == "indexed_rows" else isinstance(routed["emb"], jsparse.BCOO)
    routed = jax.tree.map(jnp.copy, routed)  # the mark is static: a tree map keeps it
    halve = optax.chain(osa.sparse_aware(optax.scale(0.5)), tx)
    new, _ = jax.jit(lambda g, s, p: rs.update_and_apply(halve, g, s, p))(routed, halve.init(params), params)
    u, _ = jax.jit(lambda g, s, p: rs.update(halve, g, s, p))(routed, halve.init(params), params)
    assert routed["emb"].owner_axis == u["emb"].owner_axis == "x"  # the updates keep the gradient's mark
    applied = jax.jit(rs.apply_updates)(params, u)
    ref_u, _ = halve.update({"emb": rows.todense(), "w": grads["w"]}, halve.init(init), init)
    ref = optax.apply_updates(init, ref_u)
    moved = np.flatnonzero(np.any(np.asarray(new["emb"]) != np.asarray(init["emb"]), axis=1))
    np.testing.assert_array_equal(moved, np.asarray(ids))
    for got in (new, applied):
        np.testing.assert_allclose(np.asarray(got["emb"]), np.asarray(ref["emb"]), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("routing", ["all_to_all", "all_gather"])
def test_an_update_laid_out_anew_outside_a_routed_step_loses_the_mark(routing):
    """``tx.update`` under plain jit sums the duplicate rows of a gradient into leading slots: the entries are no
    longer each on their owner's device, and ``rs.apply_updates`` dropped the rows that moved, without a word. Such
    an update loses the mark (the routed step refuses it; ``osa.apply_updates`` takes it); an update in the
    gradient's layout (distinct rows, as the all-gather route gives) keeps it, and either applies it alike."""
    from tests.helpers import assert_trees_equal  # here: the multi-process test runs this file as a script

    mesh = _mesh()
    rs = osa.RowSharding(mesh, "x", lambda p: p["emb"], batch_axis="x", routing=routing)
    params = rs.shard(_params())
    ids = jax.device_put(
        jnp.asarray(np.random.default_rng(3).integers(0, N, K), jnp.int32), NamedSharding(mesh, P("x"))
    )
    _, grads, _ = rs.value_and_row_grad(lambda p, ids: jnp.sum(p["emb"][ids] @ p["w"]))(params, ids)
    tx = osa.sparse_adam(0.1)
    updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    want = jax.jit(osa.apply_updates)(params, updates)
    moved = np.any(np.asarray(want["emb"]) != _params()["emb"], axis=1)
    np.testing.assert_array_equal(moved, np.isin(np.arange(N), np.asarray(ids)))
    if routing == "all_to_all":
        assert updates["emb"].owner_axis is None
        with pytest.raises(ValueError, match=r"\['emb'\]: the IndexedRows of this table was not routed"):
            rs.apply_updates(params, updates)
    else:
        assert updates["emb"].owner_axis == "x"
        assert_trees_equal(jax.jit(rs.apply_updates)(params, updates), want)


@pytest.mark.parametrize("other", ["rowwise_adagrad", "sgd"])
def test_a_routed_step_refuses_the_state_of_another_optimizer(other):
    """A state built by another optimizer failed with JAX's pytree error about a prefix tree; the routed steps now
    say what is wrong, as the one-device step does."""
    rs = osa.RowSharding(_mesh(), "x", lambda p: p["emb"])
    params = rs.shard(_params())
    tx = osa.sparse_adam(0.1)
    wrong = {"rowwise_adagrad": osa.sparse_rowwise_adagrad(0.1), "sgd": optax.sgd(0.1)}[other].init(params)
    _, grads, _ = rs.value_and_row_grad(lambda p, ids: jnp.sum(p["emb"][ids] @ p["w"]))(params, jnp.arange(8))
    for name, step in (("update_and_apply", rs.update_and_apply), ("update", rs.update)):
        with pytest.raises(TypeError, match=rf"RowSharding.{name}: the optimizer state .* built for another optimizer"):
            step(tx, grads, wrong, params)


# Every loss that the one-device fast path refuses (tests/test_reliability.py), by name.
WHOLE_TABLE_LOSSES = {
    "l2-penalty": lambda p, ids: jnp.sum(p["emb"][ids] @ p["w"]) + 0.1 * jnp.sum(p["emb"] ** 2),
    "tied-output-embedding": lambda p, ids: jnp.sum(jax.nn.log_softmax(p["emb"][ids] @ p["emb"].T)),
    "constant-row": lambda p, ids: jnp.sum(p["emb"][0] * p["w"]),
    "arange-rows": lambda p, ids: jnp.sum(p["emb"][jnp.arange(3)] @ p["w"]),
    "inside-cond": lambda p, ids: jax.lax.cond(True, lambda t: jnp.sum(t * 2.0), lambda t: jnp.sum(t), p["emb"]),
    # Uses of the ids other than indexing the table's rows (tests/test_row_grad.py).
    "shift-by-one": lambda p, ids: jnp.sum(p["emb"][ids + 1] @ p["w"]),
    "hashing-trick": lambda p, ids: jnp.sum(p["emb"][ids % 16] @ p["w"]),
    "times-zero": lambda p, ids: jnp.sum(p["emb"][ids * 0] @ p["w"]),
    "non-row-axis": lambda p, ids: jnp.sum(p["emb"][:, ids]),
    "padding-mask": lambda p, ids: jnp.sum((p["emb"][ids] @ p["w"]) * (ids != 0)),
    "id-as-feature": lambda p, ids: jnp.sum((p["emb"][ids] @ p["w"]) * ids.astype(jnp.float32)),
    "scan-carry": lambda p, ids: jax.lax.scan(lambda c, _: (c + 1, jnp.sum(p["emb"][c])), ids, None, length=2)[1].sum(),
}


@pytest.mark.parametrize(("batch_axis", "routing"), [(None, "all_to_all"), ("x", "all_gather"), ("x", "all_to_all")])
@pytest.mark.parametrize("name", list(WHOLE_TABLE_LOSSES))
def test_sharded_fast_path_refuses_what_the_fast_path_refuses(name, batch_axis, routing):
    loss = WHOLE_TABLE_LOSSES[name]
    params = {"emb": np.ones((16, 2), np.float32), "w": np.ones((2,), np.float32)}
    ids = jnp.array([1, 4, 4, 9, 0, 15, 3, 3, 7, 2, 2, 11, 12, 5, 6, 8], jnp.int32)  # two per device
    with pytest.raises(ValueError, match="other than by indexing it with the ids") as plain:
        osa.value_and_row_grad(loss, lambda p: p["emb"])(params, ids)
    rs = osa.RowSharding(_mesh(), "x", lambda p: p["emb"], batch_axis=batch_axis, routing=routing)
    with pytest.raises(ValueError) as sharded:
        rs.value_and_row_grad(loss)(rs.shard(params), ids)
    assert str(sharded.value) == str(plain.value)


# --------------------------------------------------------------------------------- data-parallel sums


@pytest.mark.parametrize("check_vma", [True, False])
def test_all_gather_rows_sums_sparse_gradients_over_devices(check_vma):
    """Data parallel with a replicated table: the summed gradient equals one device's gradient of the summed loss."""
    mesh = _mesh()
    params = jax.tree.map(jnp.asarray, _params())
    ((ids, y),) = _batches(1)

    def total(p: Any, ids: jax.Array, y: jax.Array) -> jax.Array:
        return jnp.sum((p["emb"][ids] @ p["w"] - y) ** 2)

    def per_device(p: Any, ids: jax.Array, y: jax.Array) -> Any:
        _, g = osa.value_and_row_grad(total, lambda p: p["emb"])(p, ids, y)
        wrong = jax.lax.psum(g["emb"].indices, "x")  # what a psum does to the indices
        return osa.all_gather_rows(g, "x"), wrong

    summed, wrong = jax.jit(
        jax.shard_map(
            per_device,
            mesh=mesh,
            in_specs=(P(), P("x"), P("x")),
            out_specs=((P(), P()) if check_vma else P()),
            check_vma=check_vma,
        )
    )(
        jax.device_put(params, NamedSharding(mesh, P())),
        *(jax.device_put(a, NamedSharding(mesh, P("x"))) for a in (ids, y)),
    )
    _, ref = osa.value_and_row_grad(total, lambda p: p["emb"])(params, jnp.asarray(ids), jnp.asarray(y))
    np.testing.assert_allclose(summed["emb"].todense(), ref["emb"].todense(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(summed["w"], ref["w"], rtol=1e-5)
    assert summed["emb"].indices.shape == (K,)
    assert np.asarray(wrong).max() >= N  # summed indices address rows that do not exist (or other rows)


# ------------------------------------------------------------------------------------- checkpoints


@pytest.mark.slow
def test_orbax_restores_a_sharded_table_with_its_shardings(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    mesh = _mesh()
    rs = osa.RowSharding(mesh, "x", lambda p: p["emb"], batch_axis="x")
    tx = osa.sparse_adam(0.05)
    params, state, _, _ = _routed_run(rs, tx, _batches(2))
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path / "ckpt", {"params": params, "opt_state": state})
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), {"params": params, "opt_state": state}
    )
    with ocp.StandardCheckpointer() as ckptr:
        restored = ckptr.restore(tmp_path / "ckpt", target)
    jax.tree.map(np.testing.assert_array_equal, restored, {"params": params, "opt_state": state})
    jax.tree.map(lambda r, t: assert_same_sharding(r, t.sharding), restored, target)


def assert_same_sharding(x: jax.Array, sharding: Any) -> None:
    assert x.sharding.is_equivalent_to(sharding, x.ndim), (x.sharding, sharding)


# ------------------------------------------------------------------------------------- two processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(num_processes: int, devices: int, out: pathlib.Path) -> None:
    out.mkdir(parents=True)
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(i), str(num_processes), str(port), str(devices), str(out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(num_processes)
    ]
    try:
        logs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-4000:]


@pytest.mark.slow
def test_two_processes_train_the_table_of_a_single_process_run(tmp_path):
    """2 processes x 2 CPU devices (gloo collectives on 127.0.0.1) against 1 process x 4 devices: sparse_adam's
    routed two calls, checkpointed, and catch-up AdamW's fused routed step (it could not be built on process 1)."""
    _launch(2, 2, tmp_path / "two")
    _launch(1, 4, tmp_path / "one")
    two, one = np.load(tmp_path / "two" / "result.npz"), np.load(tmp_path / "one" / "result.npz")
    assert sorted(two.files) == sorted(one.files)
    for name in ("emb", "mu", "nu", "count", "fallbacks"):  # the table and its moments: bitwise
        np.testing.assert_array_equal(two[name], one[name], err_msg=name)
    # The dense leaf's gradient is an all-reduce, whose order differs between gloo and one process.
    np.testing.assert_allclose(two["w"], one["w"], rtol=1e-6)
    assert two["fallbacks"].tolist() == [False, False, False, False]
    np.testing.assert_allclose(two["catch_up_emb"], one["catch_up_emb"], rtol=1e-6, atol=1e-7)
    assert not np.array_equal(two["catch_up_emb"], _params()["emb"])
    assert two["capacities"][0] == two["capacities"][1] == one["capacities"][0] > 0
    assert bool(two["restored_equal"]) and bool(two["restored_sharded"])


def _process_main(process_id: int, num_processes: int, port: int, devices: int, out: str) -> None:
    """One process: a table sharded over every process's devices, ids fed per process, checkpointed and restored."""
    jax.config.update("jax_num_cpu_devices", devices)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if num_processes > 1:
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes, process_id, initialization_timeout=60)
    import orbax.checkpoint as ocp
    from jax.experimental import multihost_utils

    mesh = jax.make_mesh((jax.device_count(),), ("x",))
    rs = osa.RowSharding(mesh, "x", lambda p: p["emb"], batch_axis="x", capacity=24)
    tx = osa.sparse_adam(0.05)
    batch = NamedSharding(mesh, P("x"))
    params = rs.shard(_params())
    state = tx.init(params)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(p: Any, s: Any, ids: jax.Array, y: jax.Array) -> Any:
        _, g, info = rs.value_and_row_grad(loss_fn)(p, ids, y)
        u, s = rs.update(tx, g, s, p)
        return rs.apply_updates(p, u), s, info

    share = K // jax.process_count()
    lo = jax.process_index() * share

    def feed() -> Any:  # every process draws the same batches and feeds its share
        for ids, y in _batches(4):
            yield tuple(jax.make_array_from_process_local_data(batch, a[lo : lo + share], (K,)) for a in (ids, y))

    fallbacks = []
    for ids_g, y_g in feed():
        params, state, info = step(params, state, ids_g, y_g)
        fallbacks.append(bool(info.fallback))

    # Catch-up AdamW, built on every process (its constants were computed on the first CPU device, another
    # process's on all but process 0, whose values those could not fetch), in the fused routed step.
    cu = osa.sparse_adamw(0.05, weight_decay=0.1, catch_up=True)
    cu_params = rs.shard(_params())
    cu_state = cu.init(cu_params)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def cu_step(p: Any, s: Any, ids: jax.Array, y: jax.Array) -> Any:
        _, g, _ = rs.value_and_row_grad(loss_fn)(p, ids, y)
        return rs.update_and_apply(cu, g, s, p)

    for ids_g, y_g in feed():
        cu_params, cu_state = cu_step(cu_params, cu_state, ids_g, y_g)
    catch_up_emb = multihost_utils.process_allgather(cu_params["emb"], tiled=True)
    # suggest_capacity of the global ids as the step takes them (each process holding its share), as of NumPy's
    capacities = [rs.suggest_capacity(params, [ids for ids, _ in source]) for source in (feed(), _batches(4))]

    path = pathlib.Path(out) / "ckpt"
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, {"params": params, "opt_state": state})
    target_tree = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), {"params": params, "opt_state": state}
    )
    with ocp.StandardCheckpointer() as ckptr:
        restored = ckptr.restore(path, target_tree)
    sharded = jax.tree.map(lambda r, t: r.sharding.is_equivalent_to(t.sharding, r.ndim), restored, target_tree)
    whole, whole_restored = multihost_utils.process_allgather(((params, state), restored), tiled=True)
    equal = jax.tree.map(np.array_equal, whole_restored, {"params": whole[0], "opt_state": whole[1]})
    if jax.process_index() == 0:
        np.savez(
            pathlib.Path(out) / "result.npz",
            emb=whole[0]["emb"],
            catch_up_emb=catch_up_emb,
            capacities=np.array(capacities),
            w=whole[0]["w"],
            mu=whole[1][0].mu["emb"],
            nu=whole[1][0].nu["emb"],
            count=whole[1][0].count,
            fallbacks=np.array(fallbacks),
            restored_equal=np.array(all(jax.tree.leaves(equal))),
            restored_sharded=np.array(all(jax.tree.leaves(sharded))),
        )
    if num_processes > 1:
        jax.distributed.shutdown()


if __name__ == "__main__":
    _process_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])


ROUTINGS = [
    {},
    {"batch_axis": "x", "routing": "all_gather"},
    {"batch_axis": "x", "routing": "all_to_all"},
]


@pytest.mark.parametrize("x64", [False, True], ids=["x64-off", "x64-on"])
@pytest.mark.parametrize("routing", ROUTINGS, ids=["replicated", "all_gather", "all_to_all"])
def test_wide_ids_are_padding_on_every_routing(routing, x64):
    """``2**32 + 5`` and ``-(2**32) + 3`` are padding, as in ``osa.value_and_row_grad``, not rows 5 and 3."""
    rs = osa.RowSharding(_mesh(), "x", tables=lambda p: p["emb"], **routing)
    table = np.arange(N * D, dtype=np.float32).reshape(N, D)
    wide = np.tile(np.array([2**32 + 5, -(2**32) + 3, 7, 9], np.int64), 8)  # 4 ids per device

    def loss(p, ids):
        return jnp.sum(p["emb"][ids] @ p["w"])

    # Jitted with the ids closed over, so that they reach value_and_row_grad as they are given (a NumPy int64
    # array, which a jitted function's argument would cast to int32 before the library sees it).
    with jax.enable_x64(x64):
        params = rs.shard({"emb": jnp.asarray(table), "w": jnp.ones((D,), jnp.float32)})
        ids = wide if not x64 else jnp.asarray(wide, jnp.int64)
        value, dense = jax.jit(lambda p: _value_and_dense(rs.value_and_row_grad(loss)(p, ids)[:2]))(params)
        want_value, want = jax.jit(
            lambda p: _value_and_dense(osa.value_and_row_grad(loss, lambda p: p["emb"])(p, ids))
        )({"emb": jnp.asarray(table), "w": jnp.ones((D,), jnp.float32)})
        dense = np.asarray(dense)
    np.testing.assert_allclose(float(value), float(want_value) / (8 if routing else 1), rtol=1e-6)
    np.testing.assert_array_equal(dense[[3, 5]], 0.0)  # never rows 5 and 3
    np.testing.assert_array_equal(dense, np.asarray(want) / (8 if routing else 1))


def _value_and_dense(value_and_grads: Any) -> tuple[jax.Array, jax.Array]:
    value, grads = value_and_grads
    return value, grads["emb"].todense()


# Optimizers whose state has per-row leaves (row-wise accumulators, catch-up's last steps) or loops over idle steps.
STATEFUL_ROWS = {
    "rowwise_adagrad": lambda: osa.sparse_rowwise_adagrad(0.05, weight_decay=0.01),
    "rowwise_adam": lambda: osa.sparse_rowwise_adam(0.05),
    "adam_catch_up_schedule": lambda: osa.sparse_adam(optax.linear_schedule(0.05, 0.01, 3), catch_up=True),
    "adamw_catch_up": lambda: osa.sparse_adamw(0.05, weight_decay=0.1, catch_up=True),
    "amsgrad_catch_up_schedule": lambda: osa.sparse_amsgrad(optax.linear_schedule(0.05, 0.01, 3), catch_up=True),
    "sgd_momentum_catch_up_schedule": lambda: osa.sparse_sgd(
        optax.linear_schedule(0.05, 0.01, 3), momentum=0.9, catch_up=True
    ),
}


@pytest.mark.parametrize("name", list(STATEFUL_ROWS))
def test_routed_optimizers_with_per_row_state_match_one_device(name):
    """``state_specs`` splits per-row state leaves ``(rows,)`` by row like their table (it gave them the table's
    two-dimensional spec), and the routed steps (two calls, and ``update_and_apply``) of optimizers that keep such
    state or loop over idle steps inside ``shard_map`` equal one device's."""
    mesh = _mesh()
    rs = osa.RowSharding(mesh, "x", lambda p: p["emb"], batch_axis="x")
    tx = STATEFUL_ROWS[name]()
    batches = _batches(3, zipf=True)
    params, state, _, _ = _routed_run(rs, tx, batches)
    ref_params, ref_state, _ = _one_device_run(tx, batches)
    tol = {"rtol": 1e-5, "atol": 1e-5}  # duplicates summed in another order on each device
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **tol), (params, state), (ref_params, ref_state))
    _assert_row_sharded((params, state), mesh)

    p = rs.shard(_params())
    s = _placed_state(rs, tx, p)
    batch = NamedSharding(mesh, P("x"))

    @jax.jit
    def fused(p: Any, s: Any, ids: jax.Array, y: jax.Array) -> Any:
        _, g, _ = rs.value_and_row_grad(loss_fn)(p, ids, y)
        return rs.update_and_apply(tx, g, s, p)

    for ids, y in batches:
        p, s = fused(p, s, jax.device_put(ids, batch), jax.device_put(y, batch))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-7), (p, s), (params, state))
    _assert_row_sharded((p, s), mesh)


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_a_collections_table_of_stacks_split_over_the_mesh(kind):
    """``EmbeddingCollection.table`` (evaluation, export) of stacks laid out for 8 devices and split by rows over
    them equals the table of the unsplit stacks, eagerly and under ``jit``: on an ``Explicit`` mesh it failed
    (its reshape and slices of a split array need an output sharding)."""
    coll = osa.EmbeddingCollection({"a": osa.TableSpec(13, 4), "c": osa.TableSpec(5, 4)}, shards=8)
    rs = osa.RowSharding(_mesh(kind), "x", lambda p: p["emb"])
    whole = {"emb": coll.init(jax.random.key(0))}
    params = rs.shard(whole)
    for name in ("a", "c"):
        want = np.asarray(coll.table(whole["emb"], name))
        np.testing.assert_array_equal(coll.table(params["emb"], name), want)
        np.testing.assert_array_equal(jax.jit(coll.table, static_argnums=1)(params["emb"], name), want)


@pytest.mark.parametrize("wrapper", ["partition_tables", "multi_transform"])
def test_a_labelling_wrapper_steps_as_its_plain_jitted_step(wrapper: str) -> None:
    """``RowSharding``'s steps take a wrapper that labels the parameters (a table optimizer beside a dense one):
    the state's specs came from ``optax.tree_utils.tree_map_params``, whose ``tx.init`` on one placeholder for the
    whole tree such a wrapper cannot label (``partition_tables`` raised that ``tables`` computes with the leaves,
    ``multi_transform`` that the state was built for another optimizer). Now the table's moments are split as the
    table, and the routed step gives the numbers of the plain jitted two calls on the same gradients."""
    mesh = jax.make_mesh((8,), ("x",))
    rs = osa.RowSharding(mesh, "x", tables=lambda p: p["emb"], batch_axis="x")
    if wrapper == "partition_tables":
        tx = osa.partition_tables(osa.sparse_adam(1e-2), optax.adam(1e-2), tables=lambda p: p["emb"])
    else:
        tx = optax.multi_transform({"t": osa.sparse_adam(1e-2), "d": optax.adam(1e-2)}, {"emb": "t", "w": "d"})

    def loss_fn(p: Any, ids: jax.Array, y: jax.Array) -> jax.Array:
        return jnp.mean((p["emb"][ids] @ p["w"] - y) ** 2)

    params = rs.shard({"emb": jax.random.normal(jax.random.key(0), (64, 4)), "w": jnp.ones((4,))})
    routed = plain = (params, tx.init(params))
    two_calls = jax.jit(lambda g, s, p: (lambda u, s: (osa.apply_updates(p, u), s))(*tx.update(g, s, p)))
    for t in range(3):
        ids, y = (jnp.arange(16, dtype=jnp.int32) * 3 + t) % 64, jnp.ones(16)
        g = rs.value_and_row_grad(loss_fn)(routed[0], ids, y)[1]
        p, s = jax.jit(lambda g, s, p: rs.update_and_apply(tx, g, s, p))(g, routed[1], routed[0])
        routed = (p, s)
        g = rs.value_and_row_grad(loss_fn)(plain[0], ids, y)[1]
        plain = two_calls(g, plain[1], plain[0])
    assert routed[0]["emb"].sharding.spec == P("x", None)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), routed, plain)
    table_moments = [x for x in jax.tree.leaves(routed[1]) if x.shape == (64, 4)]
    assert len(table_moments) == 2 and all(x.sharding.spec == P("x", None) for x in table_moments)
