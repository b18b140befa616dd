"""The row gather (take_rows) and the distinct ids of a batch (distinct_ids), on the native kernels and the XLA path.

The gather copies rows, so the two paths must agree bit for bit, in every dtype; the distinct ids are the same set
on both paths, in order of first occurrence on the kernels and in the hash rounds' order on the XLA path.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import optax_sparse_adam as osa
from optax_sparse_adam._coalesce import distinct_ids
from optax_sparse_adam._kernel_path import PREFIX
from optax_sparse_adam._row_ops import scatter_rows, take_rows
from tests.helpers import ON_CPU, needs_kernels


def _gather_reference(table: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """``table.at[ids].get(mode="fill", fill_value=0)`` in NumPy: negative ids count from the end."""
    n = table.shape[0]
    wrapped = np.where(ids < 0, ids.astype(np.int64) + n, ids)
    out = np.zeros((ids.shape[0], *table.shape[1:]), table.dtype)
    ok = (wrapped >= 0) & (wrapped < n)
    out[ok] = table[wrapped[ok]]
    return out


def _ids(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    ids = rng.integers(-n - 3, n + 3, k).astype(np.int32)  # wrapped negatives, out of range both ways
    ids[: k // 3] = rng.integers(0, max(n // 10, 1), k // 3)  # duplicates
    ids[-1] = np.iinfo(np.int32).min  # never wraps into range
    return ids


@pytest.mark.parametrize(
    "shape, dtype",
    [
        ((50, 8), jnp.float32),
        ((50,), jnp.float32),  # a scalar per row (row-wise state)
        ((50, 3, 5), jnp.float32),
        ((50, 7), jnp.bfloat16),
        ((50, 4), jnp.float16),
        ((50, 2), jnp.int32),
        ((50, 3), jnp.uint8),
        ((50, 5), jnp.int4),  # packed two to a byte: XLA's gather (the kernel copies whole bytes)
        ((50, 3), jnp.bool_),
    ],
)
def test_take_rows_equals_the_xla_gather_bitwise(shape, dtype, kernel_path):
    rng = np.random.default_rng(0)
    table = np.asarray(
        np.clip(rng.standard_normal(shape) * 100, -8, 7) if dtype == jnp.int4 else rng.standard_normal(shape) * 100
    ).astype(dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        table.reshape(-1)[:4] = np.array([0, -0.0, np.inf, np.nan]).astype(dtype)
    ids = _ids(rng, shape[0], 40)
    got = jax.jit(take_rows)(jnp.asarray(table), jnp.asarray(ids))
    want = _gather_reference(table, ids)
    assert got.dtype == dtype and got.shape == want.shape
    np.testing.assert_array_equal(np.asarray(got).astype(np.float32), want.astype(np.float32))
    assert np.asarray(got).tobytes() == want.tobytes()


def test_take_rows_runs_the_kernel_on_the_cpu(kernel_path):
    table = jnp.ones((100, 4), jnp.float32)
    hlo = jax.jit(take_rows).lower(table, jnp.arange(10, dtype=jnp.int32)).compile().as_text()
    assert (PREFIX + "gather" in hlo) == (kernel_path == "native-cpu")


def test_take_rows_with_many_ids_on_several_threads(kernel_path):
    """Enough ids to split the copy over threads; and an empty table axis, and a nonzero fill, stay on XLA."""
    rng = np.random.default_rng(1)
    table = rng.standard_normal((10_000, 16)).astype(np.float32)
    ids = _ids(rng, 10_000, 20_000)
    for threads in (1, 3, 4):  # the ids split evenly over four threads, unevenly over three
        with osa.use_kernels(kernel_path == "native-cpu", threads=threads):
            got = jax.jit(take_rows)(jnp.asarray(table), jnp.asarray(ids))
        assert np.asarray(got).tobytes() == _gather_reference(table, ids).tobytes(), threads
    np.testing.assert_array_equal(take_rows(jnp.ones((5, 2), jnp.float32), jnp.array([7], jnp.int32), 3.0), [[3, 3]])
    assert take_rows(jnp.ones((0, 2), jnp.float32), jnp.array([0, 1], jnp.int32)).shape == (2, 2)
    # no ids: an empty result (XLA drops the kernel's call, whose result has no elements)
    assert jax.jit(take_rows)(jnp.asarray(table), jnp.zeros((0,), jnp.int32)).shape == (0, 16)


def test_take_rows_under_vmap_and_grad(kernel_path):
    rng = np.random.default_rng(2)
    tables = jnp.asarray(rng.standard_normal((3, 20, 4)), jnp.float32)
    ids = jnp.asarray(rng.integers(-2, 22, (3, 9)), jnp.int32)
    got = jax.jit(jax.vmap(take_rows))(tables, ids)
    for b in range(3):
        np.testing.assert_array_equal(got[b], _gather_reference(np.asarray(tables[b]), np.asarray(ids[b])))
    # Differentiated, the XLA path runs: the gradient is XLA's scatter-add of the cotangent.
    grad = jax.jit(jax.grad(lambda t, i: jnp.sum(take_rows(t, i) * 2.0)))(tables[0], ids[0])
    want = np.zeros((20, 4), np.float32)
    i = np.asarray(ids[0])
    i = np.where(i < 0, i + 20, i)
    np.add.at(want, i[(i >= 0) & (i < 20)], 2.0)
    np.testing.assert_array_equal(grad, want)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32, jnp.bool_])
def test_take_rows_from_a_row_sharded_table(dtype, kernel_path):
    """Each device gathers the rows it holds, the others read zeros there, and the shards' results add up."""
    mesh = jax.make_mesh((8,), ("rows",), axis_types=(jax.sharding.AxisType.Auto,))
    rng = np.random.default_rng(3)
    table = (rng.standard_normal((64, 6)) * 10).astype(dtype)
    ids = _ids(rng, 64, 30)
    sharded = jax.device_put(table, jax.NamedSharding(mesh, jax.P("rows", None)))
    got = jax.jit(take_rows)(sharded, jnp.asarray(ids))
    assert np.asarray(got).tobytes() == _gather_reference(table, ids).tobytes()


@settings(max_examples=30, deadline=None)
@given(
    ids=st.lists(st.integers(-12, 40), min_size=1, max_size=64),
    num_rows=st.integers(1, 30),
)
def test_distinct_ids_on_both_paths(ids, num_rows):
    ids = np.asarray(ids, np.int32)
    valid = (ids >= 0) & (ids < num_rows)
    k = ids.shape[0]
    results = {}
    for native in (True, False):
        with osa.use_kernels(native):
            packed, inverse = (np.asarray(a) for a in jax.jit(distinct_ids, static_argnums=1)(ids, num_rows))
        distinct = np.unique(ids[valid]).size
        assert sorted(packed[:distinct].tolist()) == sorted(set(ids[valid].tolist()))
        assert (packed[distinct:] == num_rows).all()
        np.testing.assert_array_equal(packed[inverse[valid]], ids[valid])
        assert (inverse[~valid] == k - 1).all()
        results[native] = packed
    if osa.kernel_path() == "native-cpu":  # the kernel packs in order of first occurrence
        _, first = np.unique(ids[valid], return_index=True)
        np.testing.assert_array_equal(results[True][: first.size], ids[valid][np.sort(first)])


def test_distinct_ids_under_vmap_and_at_the_int32_limits(kernel_path):
    """Under vmap (on the CPU the kernel runs once per batch element) each element's distinct ids and slots are
    those of the call on it alone; ids at int32's limits and just out of range are padding; an element of one
    repeated id, and one of padding alone, too."""
    num_rows, k = 50, 64
    rng = np.random.default_rng(11)
    ids = rng.integers(-3, num_rows + 3, (4, k)).astype(np.int32)
    ids[0, :5] = [np.iinfo(np.int32).min, np.iinfo(np.int32).max, num_rows, -1, num_rows - 1]
    ids[1] = 7
    ids[2] = -1
    one = jax.jit(lambda i: distinct_ids(i, num_rows))
    batched = jax.jit(jax.vmap(lambda i: distinct_ids(i, num_rows)))
    if kernel_path == "native-cpu":
        assert PREFIX + "distinct" in batched.lower(ids).as_text()
    packed, inverse = (np.asarray(a) for a in batched(ids))
    for b in range(ids.shape[0]):
        alone = one(ids[b])
        np.testing.assert_array_equal(packed[b], alone[0])
        np.testing.assert_array_equal(inverse[b], alone[1])
        valid = (ids[b] >= 0) & (ids[b] < num_rows)
        distinct = np.unique(ids[b][valid])
        assert sorted(packed[b, : distinct.size].tolist()) == distinct.tolist()
        assert (packed[b, distinct.size :] == num_rows).all()
        np.testing.assert_array_equal(packed[b][inverse[b][valid]], ids[b][valid])
        assert (inverse[b][~valid] == k - 1).all()


def test_lookup_on_both_paths_reads_the_same_rows(kernel_path):
    rng = np.random.default_rng(4)
    table = jnp.asarray(rng.standard_normal((1000, 8)), jnp.float32)
    ids = jnp.asarray(rng.integers(-5, 1005, (16, 4)), jnp.int32)
    lk = jax.jit(osa.lookup)(table, ids)
    flat = np.asarray(ids)
    want = np.where(((flat >= 0) & (flat < 1000))[..., None], np.asarray(table)[np.clip(flat, 0, 999)], 0)
    np.testing.assert_array_equal(np.asarray(lk.rows)[np.asarray(lk.inverse)], want)


@needs_kernels
def test_the_gather_kernel_refuses_sub_byte_dtypes():
    """XLA packs int4 two to a byte; the kernel, which copies whole bytes, refuses it rather than overrun."""
    from optax_sparse_adam import _ffi

    with pytest.raises(Exception, match="whole bytes"):
        jax.block_until_ready(jax.jit(_ffi.gather)(jnp.zeros((8, 4), jnp.int4), jnp.arange(3, dtype=jnp.int32)))


# ------------------------------------------------------------------ setting rows of 16-bit float tables


def _set_reference(table: np.ndarray, ids: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``table.at[ids].set(values, mode="drop")`` in NumPy, entries in order (a repeated id keeps its last row)."""
    n = table.shape[0]
    out = table.copy()
    for i, v in zip(np.where(ids < 0, ids.astype(np.int64) + n, ids), values, strict=True):
        if 0 <= i < n:
            out[i] = v
    return out


def _assert_set(got: jax.Array, table: np.ndarray, ids: np.ndarray, values: np.ndarray) -> None:
    """``got`` is ``table`` with ``values`` set at ``ids``, bitwise. The native kernel and XLA:CPU keep a repeated
    id's last row; XLA:GPU's scatter leaves which one unspecified, element by element (a row can mix its entries'
    elements; the library sets only distinct rows): there each element of a repeated id's row is one of its
    entries'."""
    got = np.asarray(got)
    assert got.dtype == table.dtype
    if ON_CPU:
        assert got.tobytes() == _set_reference(table, ids, values).tobytes()
        return
    n = table.shape[0]
    wrapped = np.where(ids < 0, ids.astype(np.int64) + n, ids)
    bits = np.uint16  # both 16-bit float dtypes, compared by their bits (NaN, signed zeros)
    for r in range(n):
        candidates = table[r : r + 1] if not (wrapped == r).any() else values[wrapped == r]
        assert (got[r].view(bits) == candidates.view(bits)).any(axis=0).all(), r


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("shape", [(50, 7), (50,), (50, 3, 2)])
def test_scatter_rows_sets_half_float_rows_bitwise(dtype, shape, kernel_path):
    """Duplicates (the last wins), wrapped negatives, ids out of range both ways, NaN, infinities and signed zeros."""
    rng = np.random.default_rng(5)
    table = (rng.standard_normal(shape) * 100).astype(dtype)
    values = (rng.standard_normal((40, *shape[1:])) * 100).astype(dtype)
    values.reshape(-1)[:4] = np.array([0, -0.0, np.inf, np.nan]).astype(dtype)
    ids = _ids(rng, shape[0], 40)
    step = jax.jit(lambda t, i, v: scatter_rows(t, i, v, "set"), donate_argnums=(0,))
    hlo = step.lower(jnp.asarray(table), jnp.asarray(ids), jnp.asarray(values)).compile().as_text()
    assert (PREFIX + "set_rows" in hlo) == (kernel_path == "native-cpu")
    got = step(jnp.asarray(table), jnp.asarray(ids), jnp.asarray(values))
    assert got.dtype == dtype
    _assert_set(got, table, ids, values)


def test_scatter_rows_sets_half_float_rows_on_threads_under_vmap_and_in_place(kernel_path):
    rng = np.random.default_rng(6)
    table = rng.standard_normal((10_000, 16)).astype(jnp.bfloat16)
    ids = _ids(rng, 10_000, 20_000)
    values = rng.standard_normal((20_000, 16)).astype(jnp.bfloat16)
    for threads in (1, 3, 4):
        with osa.use_kernels(kernel_path == "native-cpu", threads=threads):
            got = jax.jit(lambda t, i, v: scatter_rows(t, i, v, "set"))(jnp.asarray(table), jnp.asarray(ids), values)
        _assert_set(got, table, ids, values)
    # vmapped over a batch of tables
    tables = jnp.asarray(rng.standard_normal((3, 20, 4)), jnp.float16)
    few = jnp.asarray(rng.integers(-2, 22, (3, 9)), jnp.int32)
    rows = jnp.asarray(rng.standard_normal((3, 9, 4)), jnp.float16)
    got = jax.jit(jax.vmap(lambda t, i, v: scatter_rows(t, i, v, "set")))(tables, few, rows)
    for b in range(3):
        _assert_set(got[b], np.asarray(tables[b]), np.asarray(few[b]), np.asarray(rows[b]))
    # no ids: the table as it was
    got = jax.jit(lambda t, i, v: scatter_rows(t, i, v, "set"))(tables[0], few[0, :0], rows[0, :0])
    assert np.asarray(got).tobytes() == np.asarray(tables[0]).tobytes()
    # donated, the table is written in place: no temporary of its size (XLA:CPU's own scatter converts it; XLA:GPU
    # scatters in place)
    big = jnp.zeros((200_000, 32), jnp.bfloat16)
    step = jax.jit(lambda t, i, v: scatter_rows(t, i, v, "set", unique=True), donate_argnums=(0,))
    compiled = step.lower(big, jnp.arange(64, dtype=jnp.int32), jnp.ones((64, 32), jnp.bfloat16)).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert (temp < big.nbytes // 4) == (kernel_path == "native-cpu" or not ON_CPU), temp


def test_scatter_rows_sets_rows_of_a_row_sharded_half_float_table(kernel_path):
    mesh = jax.make_mesh((8,), ("rows",), axis_types=(jax.sharding.AxisType.Auto,))
    rng = np.random.default_rng(7)
    table = (rng.standard_normal((64, 6)) * 10).astype(jnp.bfloat16)
    ids = _ids(rng, 64, 30)
    values = rng.standard_normal((30, 6)).astype(jnp.bfloat16)
    sharded = jax.device_put(table, jax.NamedSharding(mesh, jax.P("rows", None)))
    got = jax.jit(lambda t, i, v: scatter_rows(t, i, v, "set"))(sharded, jnp.asarray(ids), jnp.asarray(values))
    assert np.asarray(got).tobytes() == _set_reference(table, ids, values).tobytes()
