"""Summing duplicate keys (``_coalesce.py``) against a NumPy loop: duplicates summed, the distinct keys packed into
the first slots, padding after them with zero values, the capacity kept."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental import sparse as jsparse

import optax_sparse_adam as osa
from optax_sparse_adam._coalesce import _coalesce_sorted, _pack_sorted, _sorted_sum, coalesce, sum_into_slots
from optax_sparse_adam._kernel_path import PREFIX
from optax_sparse_adam._sparse_leaf import GPU_ONE_PASS_SLOTS, padding_key, to_sparse_leaf
from tests.helpers import jit_once


def _internal(keys: np.ndarray, values: np.ndarray, shape: tuple[int, ...]):
    """The internal form of the user's leaf: an IndexedRows for row keys, a BCOO otherwise."""
    if keys.shape[1] == 1:
        leaf = osa.IndexedRows(jnp.asarray(keys[:, 0]), jnp.asarray(values), shape[0])
    else:
        leaf = jsparse.BCOO((jnp.asarray(values), jnp.asarray(keys)), shape=shape)
    return to_sparse_leaf(leaf, shape, (), "test")


def _numpy_coalesce(keys: np.ndarray, values: np.ndarray, shape: tuple[int, ...]) -> dict[tuple[int, ...], np.ndarray]:
    """Each in-range key once, with the float64 sum of its entries' values and the sum of their magnitudes."""
    summed: dict[tuple[int, ...], np.ndarray] = {}
    for key, value in zip(map(tuple, keys.tolist()), values, strict=True):
        if all(0 <= c < n for c, n in zip(key, shape, strict=False)):
            v = value.astype(np.float64)
            total, size = summed.get(key, (0.0, 0.0))
            summed[key] = (total + v, size + np.abs(v))
    return summed


def _assert_coalesced(out, keys: np.ndarray, values: np.ndarray, shape: tuple[int, ...]) -> None:
    assert out.distinct and out.shape == shape
    _assert_packed(out.keys, out.values, keys, values, shape)


def _assert_packed(got_keys, got_values, keys: np.ndarray, values: np.ndarray, shape: tuple[int, ...]) -> None:
    want = _numpy_coalesce(keys, values, shape)
    n, n_sparse = len(want), keys.shape[1]
    got_keys, got_values = np.asarray(got_keys), np.asarray(got_values)
    assert got_keys.shape == keys.shape and got_keys.dtype == np.int32  # the capacity is kept
    assert got_values.shape == values.shape and got_values.dtype == values.dtype
    packed = [tuple(k) for k in got_keys[:n].tolist()]
    assert sorted(packed) == sorted(want)  # each distinct key once, in the first slots
    for key, value in zip(packed, got_values[:n], strict=True):
        total, size = want[key]  # float32 sums of many entries: rounding grows with the magnitudes summed
        assert np.all(np.abs(value - total) <= 1e-6 * size + 1e-6), (key, value, total)
    np.testing.assert_array_equal(got_keys[n:], np.broadcast_to(np.array(shape[:n_sparse]), (len(keys) - n, n_sparse)))
    np.testing.assert_array_equal(got_values[n:], 0.0)  # padding holds zeros


@st.composite
def _leaves(draw):
    n_sparse = draw(st.integers(1, 2))
    shape = tuple(draw(st.integers(1, 6)) for _ in range(n_sparse)) + draw(st.sampled_from([(), (2,), (2, 3)]))
    capacity = draw(st.integers(0, 24))
    in_range = st.tuples(*[st.integers(0, n - 1) for n in shape[:n_sparse]])
    padding = st.tuples(*[st.sampled_from([-7, -1, n, n + 3]) for n in shape[:n_sparse]])
    keys = draw(st.lists(st.one_of(in_range, in_range, in_range, padding), min_size=capacity, max_size=capacity))
    return np.array(keys, np.int32).reshape(capacity, n_sparse), shape


@functools.cache
def _jitted_coalesce(shape: tuple[int, ...], kernels: bool):
    """``coalesce`` of a leaf of ``shape`` from its keys and values, jitted (one compilation per capacity, not one
    dispatch per operation), shared by the examples; with the result's static fields as its trace saw them."""
    static = {}

    def run(keys, values):
        out = coalesce(_internal(keys, values, shape))
        static["distinct"], static["shape"] = out.distinct, out.shape
        return out.keys, out.values

    return jax.jit(run), static


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "xla"])
@settings(max_examples=80, deadline=None)
@given(_leaves(), st.integers(0, 2**31 - 1))
def test_matches_numpy_on_random_keys(kernels, leaf, seed):
    keys, shape = leaf
    values = np.random.default_rng(seed).standard_normal((len(keys), *shape[keys.shape[1] :])).astype(np.float32)
    run, static = _jitted_coalesce(shape, kernels)
    with osa.use_kernels(kernels):
        got_keys, got_values = run(jnp.asarray(keys), jnp.asarray(values))
    assert static["distinct"] and static["shape"] == shape
    _assert_packed(got_keys, got_values, keys, values, shape)


@settings(max_examples=30, deadline=None)
@given(_leaves(), st.integers(0, 2**31 - 1))
def test_the_gpu_branch_sums_as_numpy_with_the_keys_in_order(leaf, seed):
    """On CUDA and ROCm the XLA path deduplicates by one sort of the keys (no hash rounds, whose while loop a GPU
    syncs with the host each round); run directly here: the same keys and sums as NumPy, packed first in key order,
    and ``pack_distinct``'s sorted form gives each valid entry its key's slot."""
    keys, shape = leaf
    values = np.random.default_rng(seed).standard_normal((len(keys), *shape[keys.shape[1] :])).astype(np.float32)
    internal = _internal(keys, values, shape)
    args = (internal.keys, internal.valid(), padding_key(shape, keys.shape[1]))
    got_keys, got_values = jax.jit(_coalesce_sorted)(*args, internal.values)
    _assert_packed(got_keys, got_values, keys, values, shape)
    n = len(_numpy_coalesce(keys, values, shape))
    packed = [tuple(k) for k in np.asarray(got_keys)[:n].tolist()]
    assert packed == sorted(packed)
    target, packed_keys = jax.jit(_pack_sorted)(*args)
    np.testing.assert_array_equal(packed_keys, got_keys)
    valid, target = np.asarray(args[1]), np.asarray(target)
    np.testing.assert_array_equal(target[~valid], len(keys))
    np.testing.assert_array_equal(np.asarray(packed_keys)[target[valid]], np.asarray(internal.keys)[valid])


@pytest.mark.parametrize("batch", [8192, 2 * GPU_ONE_PASS_SLOTS])
def test_a_step_lowered_for_cuda_has_no_host_synced_loop_up_to_the_one_pass_size(batch):
    """A GPU copies a while loop's condition to the host each round: lowered for CUDA, lazy Adam's XLA-path step
    deduplicates without the hash rounds' loop and, up to ``GPU_ONE_PASS_SLOTS`` slots, updates the rows in one pass
    (larger leaves keep the chunks' loop, which skips the padding); lowered for the CPU both loops are there."""
    rows = 1000
    tx = osa.sparse_adam(1e-2)
    p = jnp.zeros((rows, 8), jnp.float32)
    g = osa.IndexedRows(jnp.asarray(np.arange(batch) % 5, jnp.int32), jnp.ones((batch, 8), jnp.float32), rows)

    def step(p, s, g):
        return osa.update_and_apply(tx, g, s, p)

    with osa.use_kernels(False):
        traced = jax.jit(step).trace(p, tx.init(p), g)
        cuda = traced.lower(lowering_platforms=("cuda",)).as_text().count("stablehlo.while")
        cpu = traced.lower(lowering_platforms=("cpu",)).as_text().count("stablehlo.while")
    assert cuda == (0 if batch <= GPU_ONE_PASS_SLOTS else 2)
    assert cpu == 3  # the hash rounds, the rows' chunks and the parameters' chunks


@pytest.mark.skipif(osa.kernel_path() != "native-cpu", reason="the native kernels are off or were not built")
@pytest.mark.parametrize("kind", ["zipf", "all padding", "extremes", "empty"])
def test_the_native_kernel_sums_as_the_xla_path(kind):
    """The native coalescing kernel packs the same keys with, key by key, bitwise the same sums as the XLA path
    (entry order from zero), padding after them; under jit, once per batch shape."""
    rng = np.random.default_rng(7)
    rows, width = 5_000, 16
    keys = {
        "zipf": (rng.zipf(1.2, 8192) - 1) % (rows + 40) - 20,  # hot keys hundreds of times, padding both sides
        "all padding": np.where(np.arange(64) % 2 == 0, -1, rows),
        "extremes": np.array([np.iinfo(np.int32).min, np.iinfo(np.int32).max, 3, rows, -1, 3]),
        "empty": np.zeros(0, np.int64),
    }[kind].astype(np.int32)
    values = rng.standard_normal((len(keys), width)).astype(np.float32)

    def step(keys, values):
        out = coalesce(to_sparse_leaf(osa.IndexedRows(keys, values, rows), (rows, width), (), "test"))
        return out.keys[:, 0], out.values

    results = {}
    for kernels in (True, False):
        with osa.use_kernels(kernels):
            compiled = jax.jit(step).lower(jnp.asarray(keys), jnp.asarray(values)).compile()
            if len(keys):  # XLA folds a call with empty results away
                assert (PREFIX + "coalesce" in compiled.as_text()) is kernels
            results[kernels] = [np.asarray(x) for x in compiled(jnp.asarray(keys), jnp.asarray(values))]
    dense = {}
    for kernels, (got_keys, got_values) in results.items():
        table = np.zeros((rows + 1, width), np.float32)
        table[got_keys] = got_values  # distinct keys: a plain assignment; padding lands in the last row
        n = int(np.sum(got_keys < rows))
        np.testing.assert_array_equal(got_keys[n:], rows)
        np.testing.assert_array_equal(got_values[n:], 0.0)
        dense[kernels] = table[:rows]
    np.testing.assert_array_equal(dense[True], dense[False])
    _assert_packed(results[True][0][:, None], results[True][1], keys[:, None], values, (rows, width))


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "xla"])
def test_duplicates_that_sum_to_zero_keep_their_slot(kernels):
    keys = np.array([[2], [5], [2], [-1], [5]], np.int32)
    values = np.array([[1.0, -2.0], [3.0, 3.0], [-1.0, 2.0], [9.0, 9.0], [0.5, 0.5]], np.float32)
    with osa.use_kernels(kernels):
        out = coalesce(_internal(keys, values, (6, 2)))
    _assert_coalesced(out, keys, values, (6, 2))
    assert 2 in np.asarray(out.keys)[:2, 0]  # touched with a zero sum: still a key


def test_a_leaf_known_distinct_is_returned_as_it_is():
    rows = osa.IndexedRows(jnp.array([3, 1, 9], jnp.int32), jnp.ones((3, 2), jnp.float32), 9, unique_indices=True)
    leaf = to_sparse_leaf(rows, (9, 2), (), "test")
    assert coalesce(leaf) is leaf


@pytest.mark.parametrize("capacity", [1, 8192])
def test_many_keys_under_jit_with_one_compile(capacity):
    """Hash rounds run in a while loop: any mix of duplicates, up to one key repeated everywhere, one compile."""
    rng = np.random.default_rng(capacity)
    shape = (300, 2)

    def step(keys, values):
        out = coalesce(to_sparse_leaf(osa.IndexedRows(keys[:, 0], values, shape[0]), shape, (), "test"))
        assert out.distinct
        return out.keys, out.values

    step = jit_once(step)
    for distinct in (1, 17, 299):
        keys = rng.choice(rng.choice(300, distinct, replace=False), capacity)[:, None].astype(np.int32)
        keys[rng.random(capacity) < 0.1] = -1
        values = rng.standard_normal((capacity, 2)).astype(np.float32)
        _assert_packed(*step(jnp.asarray(keys), jnp.asarray(values)), keys, values, shape)


def _scatters(stablehlo: str) -> list[bool]:
    """For each scatter of a lowered module, whether its update computation adds (a scatter-add)."""
    out, lines = [], stablehlo.splitlines()
    for i, line in enumerate(lines):
        if '"stablehlo.scatter"' in line:
            region = []
            for following in lines[i + 1 :]:
                region.append(following)
                if following.strip().startswith("})"):
                    break
            out.append(any("stablehlo.add" in r for r in region))
    return out


@pytest.mark.parametrize("shape", [(8192,), (8192, 16), (7, 3)])
def test_the_gpu_sum_is_the_scatter_add_without_one(shape):
    """On CUDA and ROCm the duplicates are summed by a sort and a segmented scan (jaxlib 0.10.2 to 0.11.0 run
    contended GPU scatter-adds 450-2,000x slower): it equals the scatter-add the CPU runs, to the order of the
    additions; lowered for CUDA the sum holds no scatter-add, lowered for the CPU it is one."""
    rng = np.random.default_rng(shape[0])
    k = shape[0]
    zipf = (rng.zipf(1.2, k) - 1) % max(k // 4, 1)  # hot slots repeated hundreds of times, as Zipf ids make them
    target = jnp.asarray(np.where(rng.random(k) < 0.05, k + rng.integers(0, 3, k), zipf).astype(np.int32))
    values = jnp.asarray(rng.normal(size=shape).astype(np.float32))
    reference = np.zeros(shape, np.float64)
    np.add.at(reference, np.asarray(target)[np.asarray(target) < k], np.asarray(values, np.float64)[target < k])
    scale = np.abs(values).sum() * np.finfo(np.float32).eps
    # Jitted: one compilation each, where eagerly the sort and the scan's levels dispatch op by op.
    np.testing.assert_allclose(jax.jit(_sorted_sum)(target, values), reference, rtol=0, atol=scale)
    summed = jax.jit(sum_into_slots)
    np.testing.assert_allclose(summed(target, values), reference, rtol=0, atol=scale)
    lowered = summed.trace(target, values)
    assert _scatters(lowered.lower(lowering_platforms=("cuda",)).as_text()) == [False]
    assert _scatters(lowered.lower(lowering_platforms=("rocm",)).as_text()) == [False]
    assert _scatters(lowered.lower(lowering_platforms=("cpu",)).as_text()) == [True]


def test_the_optimizer_step_lowered_for_cuda_sums_duplicates_without_a_scatter_add():
    """The whole XLA-path step of lazy Adam on an IndexedRows with duplicates, lowered for CUDA: its only
    scatter-adds are the parameters' update by distinct rows (``apply_updates`` after coalescing)."""
    tx = osa.sparse_adam(1e-2)
    p = jnp.zeros((1000, 8), jnp.float32)
    g = osa.IndexedRows(jnp.asarray(np.arange(64) % 5, jnp.int32), jnp.ones((64, 8), jnp.float32), 1000)

    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return osa.apply_updates(p, u), s

    with osa.use_kernels(False):
        cuda = jax.jit(step).trace(p, tx.init(p), g).lower(lowering_platforms=("cuda",)).as_text()
        cpu = jax.jit(step).trace(p, tx.init(p), g).lower(lowering_platforms=("cpu",)).as_text()
    assert _scatters(cpu).count(True) == _scatters(cuda).count(True) + 1, (_scatters(cpu), _scatters(cuda))


@pytest.mark.skipif(osa.kernel_path() != "native-cpu", reason="the native kernels are off or were not built")
@pytest.mark.parametrize("kind", ["zipf", "all padding", "extremes", "empty", "one wide row"])
def test_coalescing_with_squares_adds_the_squares_of_the_summed_rows(kind):
    """sparse_aware's global norm on the native path: the coalescing kernel's keys and values bitwise as without
    the squares, and the sum of the squares of the summed rows in double, rounded once. Against a NumPy loop of that
    rule: within an ulp (the double sums run in another order), on one thread and on two alike, and bitwise the
    kernel that adds them without writing the sums; the XLA path's sum (optax.tree.norm of its coalesced values)
    within float32 summation error of it."""
    from optax_sparse_adam import _ffi
    from optax_sparse_adam._coalesce import coalesce_with_squares

    rng = np.random.default_rng(3)
    rows = 5_000
    width = 67 if kind == "one wide row" else 16  # not a multiple of the kernel's eight lanes
    keys = {
        "zipf": (rng.zipf(1.2, 8192) - 1) % (rows + 40) - 20,
        "all padding": np.where(np.arange(64) % 2 == 0, -1, rows),
        "extremes": np.array([np.iinfo(np.int32).min, np.iinfo(np.int32).max, 3, rows, -1, 3]),
        "empty": np.zeros(0, np.int64),
        "one wide row": np.full(5, 42),
    }[kind].astype(np.int32)
    values = (rng.standard_normal((len(keys), width)) * np.float32(1e3)).astype(np.float32)
    summed: dict[int, np.ndarray] = {}
    for key, value in zip(keys.tolist(), values, strict=True):
        if 0 <= key < rows:
            summed[key] = summed.get(key, np.zeros(width, np.float32)) + value  # float32, in entry order, from 0
    want = np.float32(sum(float(np.sum(row.astype(np.float64) ** 2)) for row in summed.values()))
    got = {}
    for threads in (1, 2):
        with osa.use_kernels(True, threads=threads):
            got[threads] = jax.jit(lambda k, v: _ffi.coalesce_squares(k, v, rows))(keys, values)
        plain = jax.jit(lambda k, v: _ffi.coalesce(k, v, rows))(keys, values)
        for x, y in zip(got[threads][:2], plain, strict=True):
            np.testing.assert_array_equal(x, y)
    squares = np.asarray(got[1][2])
    assert squares == np.asarray(got[2][2]) and squares.dtype == np.float32 and squares.shape == ()
    assert np.abs(squares - want) <= np.spacing(want), (squares, want)
    for threads in (1, 2):  # the same sum from the kernel that writes no sums
        with osa.use_kernels(True, threads=threads):
            assert np.asarray(jax.jit(lambda k, v: _ffi.sum_squares(k, v, rows))(keys, values)) == squares

    def leaf_squares(k, v):
        return coalesce_with_squares(to_sparse_leaf(osa.IndexedRows(k, v, rows), (rows, width), (), "test"))[1]

    for kernels in (True, False):
        with osa.use_kernels(kernels):
            text = jax.jit(leaf_squares).lower(keys, values).compile().as_text()
            assert (PREFIX + "coalesce_squares" in text) is kernels
            xla = np.asarray(jax.jit(leaf_squares)(keys, values))
        assert np.abs(xla - want) <= 1e-6 * want + np.spacing(want), (kernels, xla, want)


@pytest.mark.skipif(osa.kernel_path() != "native-cpu", reason="the native kernels were not built")
@pytest.mark.parametrize("width", [16, 67])
def test_sum_squares_of_entries_taken_as_distinct(width):
    """sum_squares with ``unique`` (a promise, 1, or ids the library made distinct, 2) takes each in-range entry as
    its own row without coalescing: on distinct keys, bitwise the coalescing kernel's sum; its squares in double,
    rounded once (a float64 NumPy sum within an ulp); padding (negative keys, keys past the table, the int32
    extremes) left out, whatever its values hold (NaN here); over one thread or two alike. A repeated key (a
    broken promise) adds each entry's squares, as the XLA path's norm of such a leaf does, not those of the sum."""
    from optax_sparse_adam import _ffi

    rng = np.random.default_rng(8)
    rows, k = 50_000, 8192
    keys = rng.permutation(rows)[:k].astype(np.int32)
    pad = np.arange(k) % 13 == 5
    keys[pad] = np.resize(np.array([-1, rows, np.iinfo(np.int32).min, np.iinfo(np.int32).max], np.int32), pad.sum())
    values = (rng.standard_normal((k, width)) * np.float32(1e3)).astype(np.float32)
    values[pad] = np.nan
    want = np.float32(np.sum(values[~pad].astype(np.float64) ** 2))
    got = {}
    for threads in (1, 2):
        with osa.use_kernels(True, threads=threads):
            for unique in (0, 1, 2):
                got[threads, unique] = np.asarray(
                    jax.jit(lambda k, v, u=unique: _ffi.sum_squares(k, v, rows, unique=u))(keys, values)
                )
    assert len({x.item() for x in got.values()}) == 1, got
    assert np.abs(got[1, 2] - want) <= np.spacing(want), (got[1, 2], want)

    # A broken promise: every entry's squares, the duplicates' too.
    twice = np.concatenate([keys[:100], keys[:100]])
    doubled = np.concatenate([values[:100], values[:100]])
    with osa.use_kernels(True):
        broken = np.asarray(jax.jit(lambda k, v: _ffi.sum_squares(k, v, rows, unique=1))(twice, doubled))
    entries = np.float32(np.sum(np.where(pad[:100, None], 0.0, values[:100].astype(np.float64)) ** 2) * 2)
    assert np.abs(broken - entries) <= np.spacing(entries), (broken, entries)
