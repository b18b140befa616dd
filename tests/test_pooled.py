"""Pooled multi-hot lookups (``osa.bags``, ``osa.pool``) against a NumPy loop and ``jax.grad`` of a dense model."""

from __future__ import annotations

import functools
import warnings

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

import optax_sparse_adam as osa
from tests.helpers import assert_trees_equal

NUM_ROWS, WIDTH = 40, 3


def _ragged(rng: np.random.Generator, batch: int, max_len: int) -> list[np.ndarray]:
    """Bags of random sizes (some empty, some all padding), ids with padding (-1, num_rows and beyond)."""
    out = []
    for b in range(batch):
        n = 0 if b % 5 == 1 else int(rng.integers(1, max_len + 1))
        ids = rng.integers(-2, NUM_ROWS + 2, size=n).astype(np.int32)
        if b % 5 == 3:
            ids[:] = -1
        out.append(ids)
    return out


def _reference(table: np.ndarray, ragged: list[np.ndarray], weights: list[np.ndarray] | None, combiner: str):
    """The pooled vectors by a loop over bags, in float64."""
    out = np.zeros((len(ragged), table.shape[1]))
    for b, ids in enumerate(ragged):
        w = np.ones(len(ids)) if weights is None else weights[b].astype(np.float64)
        ok = (ids >= 0) & (ids < table.shape[0])
        ids, w = ids[ok], w[ok]
        if combiner == "mean":
            w = w / w.sum() if w.sum() != 0 else w * 0
        elif combiner == "sqrtn":
            w = w / np.sqrt((w * w).sum()) if (w * w).sum() != 0 else w * 0
        out[b] = (w[:, None] * table[ids].astype(np.float64)).sum(0)
    return out


def _form_arrays(
    ragged: list[np.ndarray], weights: list[np.ndarray] | None, *, capacity: int, width: int
) -> dict[str, np.ndarray | None]:
    """The bags' arrays in the padded (``width`` columns), offsets and lengths forms (``capacity`` entries).

    The flat forms end with padding entries after the last bag (at least two), which hold real ids with large
    weights: counted, they would show.
    """
    lengths = np.array([len(x) for x in ragged], np.int32)
    flat = np.concatenate(ragged).astype(np.int32) if ragged else np.zeros(0, np.int32)
    extra = capacity - flat.size
    assert extra >= 2
    flat_pad = np.concatenate([flat, np.resize(np.array([1, 2], np.int32), extra)])
    flat_w_pad = None
    if weights is not None:
        flat_w = np.concatenate(weights).astype(np.float32)
        flat_w_pad = np.concatenate([flat_w, np.full(extra, 5.0, np.float32)])
    assert width >= lengths.max(initial=0)
    padded = np.full((len(ragged), width), -1, np.int32)
    padded_w = np.zeros((len(ragged), width), np.float32)
    for b, ids in enumerate(ragged):
        padded[b, : len(ids)] = ids
        if weights is not None:
            padded_w[b, : len(ids)] = weights[b]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return {
        "padded": padded,
        "padded_w": None if weights is None else padded_w,
        "flat": flat_pad,
        "flat_w": flat_w_pad,
        "offsets": offsets,
        "lengths": lengths,
    }


def _bags_of(a: dict, combiner: str) -> dict[str, osa.Bags]:
    """The same bags built from the padded, offsets and lengths forms."""
    return {
        "padded": osa.bags(a["padded"], NUM_ROWS, weights=a["padded_w"], combiner=combiner),
        "offsets": osa.bags(a["flat"], NUM_ROWS, offsets=a["offsets"], weights=a["flat_w"], combiner=combiner),
        "lengths": osa.bags(a["flat"], NUM_ROWS, lengths=a["lengths"], weights=a["flat_w"], combiner=combiner),
    }


@functools.partial(jax.jit, static_argnames="combiner")
def _pool_forms(table: jax.Array, arrays: dict, combiner: str) -> dict[str, jax.Array]:
    """``pool`` of the bags of every form, built and pooled in one program."""
    return {form: osa.pool(table, b) for form, b in _bags_of(arrays, combiner).items()}


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("weighted", [False, True])
def test_pool_equals_a_loop_over_bags(combiner, weighted):
    rng = np.random.default_rng([len(combiner), weighted])
    table = rng.standard_normal((NUM_ROWS, WIDTH)).astype(np.float32)
    ragged = _ragged(rng, 12, 7)
    ragged.append(rng.integers(0, NUM_ROWS, size=100).astype(np.int32))  # a bag of 100
    weights = [rng.uniform(0.1, 2.0, size=len(x)).astype(np.float32) for x in ragged] if weighted else None
    want = _reference(table, ragged, weights, combiner)
    # One shape for every parametrization (at most 12 * 7 + 100 ids, then padding), so that they share the
    # operations' compiled programs.
    arrays = _form_arrays(ragged, weights, capacity=12 * 7 + 100 + 2, width=100)
    for form, b in _bags_of(arrays, combiner).items():
        got = osa.pool(jnp.asarray(table), b)
        assert got.shape == (len(ragged), WIDTH) and got.dtype == jnp.float32, form
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=form)


def test_one_id_per_bag_and_padding_count_for_nothing():
    table = jnp.arange(NUM_ROWS * WIDTH, dtype=jnp.float32).reshape(NUM_ROWS, WIDTH)
    ids = jnp.array([3, -1, NUM_ROWS, 2**31 - 1, 0], jnp.int32)
    got = osa.pool(table, osa.bags(ids, NUM_ROWS, combiner="mean"))
    want = jnp.stack([table[3], jnp.zeros(WIDTH), jnp.zeros(WIDTH), jnp.zeros(WIDTH), table[0]])
    assert_trees_equal(got, want)


def test_wide_numpy_ids_are_padding_not_wrapped():
    """With x64 off, 2**32 + 5 must not become row 5 (nor count in a mean)."""
    table = jnp.arange(NUM_ROWS * WIDTH, dtype=jnp.float32).reshape(NUM_ROWS, WIDTH)
    ids = np.array([[2**32 + 5, 1]], np.int64)
    got = osa.pool(table, osa.bags(ids, NUM_ROWS, combiner="mean"))
    assert_trees_equal(got, table[1][None])


def _dense_loss(combiner: str):
    """The model written without the library: ``jnp.take`` and ``segment_sum`` on the whole table."""

    def loss(params, ids, weights):
        valid = (ids >= 0) & (ids < NUM_ROWS)
        w = jnp.where(valid, weights, 0.0)
        if combiner == "mean":
            total = w.sum(1, keepdims=True)
            w = jnp.where(total != 0, w / jnp.where(total != 0, total, 1.0), 0.0)
        elif combiner == "sqrtn":
            total = jnp.sqrt((w * w).sum(1, keepdims=True))
            w = jnp.where(total != 0, w / jnp.where(total != 0, total, 1.0), 0.0)
        rows = jnp.take(params["t"], jnp.clip(ids, 0, NUM_ROWS - 1), axis=0)
        batch = ids.shape[0]
        seg = jnp.repeat(jnp.arange(batch), ids.shape[1], total_repeat_length=ids.size)
        pooled = jax.ops.segment_sum((rows * w[..., None]).reshape(-1, WIDTH), seg, num_segments=batch)
        return jnp.sum(jnp.tanh(pooled @ params["w"]))

    return loss


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_row_gradients_equal_the_dense_models(combiner, kernel_path):
    rng = np.random.default_rng(len(combiner))
    params = {
        "t": jnp.asarray(rng.standard_normal((NUM_ROWS, WIDTH)), jnp.float32),
        "w": jnp.asarray(rng.standard_normal(WIDTH), jnp.float32),
    }
    ids = rng.integers(-2, NUM_ROWS + 2, size=(9, 6)).astype(np.int32)
    ids[4] = -1  # an empty bag
    weights = rng.uniform(0.1, 2.0, size=ids.shape).astype(np.float32)
    want_value, want = jax.value_and_grad(_dense_loss(combiner))(params, jnp.asarray(ids), jnp.asarray(weights))

    def loss(p, b):
        return jnp.sum(jnp.tanh(osa.pool(p["t"], b) @ p["w"]))

    b = osa.bags(ids, NUM_ROWS, weights=weights, combiner=combiner)
    value, grads = jax.jit(osa.value_and_row_grad(loss, lambda p: p["t"]))(params, b)
    assert isinstance(grads["t"], osa.IndexedRows)
    np.testing.assert_allclose(value, want_value, rtol=1e-6)
    np.testing.assert_allclose(grads["t"].todense(), want["t"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grads["w"], want["w"], rtol=1e-5, atol=1e-6)

    # One optimizer step on the row gradients: the fused step equals the two calls.
    tx = osa.sparse_adam(0.1)
    state = tx.init(params)
    fused = jax.jit(osa.update_and_apply, static_argnums=0)(tx, grads, state, params)
    updates, state2 = tx.update(grads, state, params)
    assert_trees_equal(fused[1], state2)
    np.testing.assert_allclose(fused[0]["t"], osa.apply_updates(params, updates)["t"], rtol=1e-6, atol=1e-7)


MAX_BAGS, MAX_LEN = 8, 9


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(0, MAX_LEN), min_size=1, max_size=MAX_BAGS),
    combiner=st.sampled_from(["sum", "mean", "sqrtn"]),
    seed=st.integers(0, 2**16),
)
def test_any_ragged_batch_pools_as_the_loop(lengths, combiner, seed):
    rng = np.random.default_rng(seed)
    table = rng.standard_normal((NUM_ROWS, WIDTH)).astype(np.float32)
    ragged = [rng.integers(-1, NUM_ROWS + 1, size=n).astype(np.int32) for n in lengths]
    weights = [rng.uniform(-1.0, 2.0, size=n).astype(np.float32) for n in lengths]
    # Fixed shapes, so that the examples of a combiner share one compiled program: MAX_BAGS bags (the drawn ones,
    # then empty ones, which must pool to zeros), MAX_LEN columns and MAX_BAGS * MAX_LEN + 2 flat entries (the
    # rest padding).
    ragged += [np.zeros(0, np.int32)] * (MAX_BAGS - len(lengths))
    weights += [np.zeros(0, np.float32)] * (MAX_BAGS - len(lengths))
    want = _reference(table, ragged, weights, combiner)
    arrays = _form_arrays(ragged, weights, capacity=MAX_BAGS * MAX_LEN + 2, width=MAX_LEN)
    for form, got in _pool_forms(jnp.asarray(table), arrays, combiner).items():
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=form)


def test_bf16_tables_pool_in_float32():
    rng = np.random.default_rng(3)
    table = jnp.asarray(rng.standard_normal((NUM_ROWS, WIDTH)), jnp.bfloat16)
    ids = rng.integers(0, NUM_ROWS, size=(4, 100)).astype(np.int32)
    got = osa.pool(table, osa.bags(ids, NUM_ROWS))
    assert got.dtype == jnp.bfloat16
    want = _reference(np.asarray(table, np.float32), list(ids), None, "sum")
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=1e-2)  # one bf16 rounding of the sum


def test_bad_inputs_raise():
    ids = jnp.zeros((2, 3), jnp.int32)
    with pytest.raises(ValueError, match="combiner"):
        osa.bags(ids, NUM_ROWS, combiner="max")
    with pytest.raises(ValueError, match="weights must have the shape"):
        osa.bags(ids, NUM_ROWS, weights=jnp.ones((2,), jnp.float32))
    with pytest.raises(TypeError, match="floating"):
        osa.bags(ids, NUM_ROWS, weights=jnp.ones((2, 3), jnp.int32))
    with pytest.raises(ValueError, match="offsets or lengths"):
        osa.bags(ids[0], NUM_ROWS, offsets=jnp.array([0, 1]), lengths=jnp.array([1]))
    with pytest.raises(TypeError, match="integers"):
        osa.bags(jnp.zeros((3,), jnp.float32), NUM_ROWS)
    with pytest.raises(ValueError, match="num_rows"):
        osa.bags(ids, -1)
    with pytest.raises(TypeError, match="Bags"):
        osa.pool(jnp.zeros((NUM_ROWS, WIDTH), jnp.float32), ids)


@pytest.mark.parametrize(
    "layout, wrong",
    [
        ({"lengths": [2, -1, 3]}, "a negative length"),
        ({"lengths": [2, 3]}, "bags ending at entry 5, past the 4 ids"),
        ({"offsets": [0, 3, 2, 4]}, "offsets out of order"),
        ({"offsets": [-1, 2, 4]}, "offsets out of order"),
        ({"offsets": [0, 2, 5]}, "bags ending at entry 5, past the 4 ids"),
    ],
)
def test_a_known_layout_that_lays_out_no_bags_is_refused(layout, wrong):
    """Lengths and offsets known outside ``jit`` (NumPy or jax arrays) that would pool other entries than those
    meant, or miss some, are refused; in order, with padding before the first bag or after the last, they pool."""
    ids = np.array([0, 1, 2, 3], np.int32)
    for as_array in (np.asarray, jnp.asarray):
        with pytest.raises(ValueError, match=f"bags: {next(iter(layout))} must lay out bags.*got {wrong}"):
            osa.bags(ids, NUM_ROWS, **{k: as_array(v) for k, v in layout.items()})
    table = jnp.arange(NUM_ROWS * WIDTH, dtype=jnp.float32).reshape(NUM_ROWS, WIDTH)
    got = osa.pool(table, osa.bags(ids, NUM_ROWS, offsets=np.array([1, 1, 3])))  # entries 0 and 3 are padding
    np.testing.assert_array_equal(got, np.stack([np.zeros(WIDTH, np.float32), table[1] + table[2]]))


def test_value_and_row_grad_refuses_bags_for_another_table_and_arithmetic_on_their_ids():
    params = {"t": jnp.zeros((NUM_ROWS, WIDTH), jnp.float32)}
    b = osa.bags(jnp.array([[1, 2]], jnp.int32), NUM_ROWS + 1)
    with pytest.raises(ValueError, match=r"built for 41 rows.*osa.bags\(ids, 40"):
        osa.value_and_row_grad(lambda p, b: osa.pool(p["t"], b).sum(), lambda p: p["t"])(params, b)
    b = osa.bags(jnp.array([[1, 2]], jnp.int32), NUM_ROWS)

    def shifted(p, b):  # the ids are positions inside the loss: arithmetic on them is refused
        return p["t"][b.ids + 1].sum()

    with pytest.raises(ValueError, match="ids"):
        osa.value_and_row_grad(shifted, lambda p: p["t"])(params, b)


def test_pool_refuses_bags_built_for_another_table():
    """Bags built for another number of rows made the ids past their rows padding: pooling them from a larger
    table pooled zeros there, without a word (inside value_and_row_grad the same mistake was already refused).
    Inside the loss, the bags of positions are bags of the gathered rows, which pool takes."""
    rng = np.random.default_rng(0)
    table = jnp.asarray(rng.standard_normal((2 * NUM_ROWS, WIDTH)), jnp.float32)
    ids = jnp.array([[1, NUM_ROWS + 3], [NUM_ROWS + 5, 2]], jnp.int32)
    for num_rows in (NUM_ROWS, 4 * NUM_ROWS):
        for pool in (osa.pool, jax.jit(osa.pool)):
            with pytest.raises(ValueError, match=rf"pool: the bags were built for a table of {num_rows} rows"):
                pool(table, osa.bags(ids, num_rows))
    b = osa.bags(ids, 2 * NUM_ROWS)
    np.testing.assert_array_equal(osa.pool(table, b), np.asarray(table)[np.asarray(ids)].sum(1))
    params = {"t": table}
    loss = lambda p, b: osa.pool(p["t"], b).sum()  # noqa: E731
    value, grads = osa.value_and_row_grad(loss, lambda p: p["t"])(params, b)
    dense_value, dense = jax.value_and_grad(loss)(params, b)
    np.testing.assert_allclose(value, dense_value, rtol=1e-6)
    np.testing.assert_array_equal(grads["t"].todense(), dense["t"])


@pytest.mark.parametrize(
    "backend, version, warns",
    [
        ("gpu", "0.11.0", True),
        ("cuda", "0.10.2", True),
        ("rocm", "0.10.3.dev20261001", True),
        ("gpu", "0.11.1", False),
        ("gpu", "0.11.1.dev20260115", True),  # a nightly before the release may predate the fix
        ("gpu", "0.11.1rc1", True),
        ("gpu", "0.11.1+cuda13", False),
        ("gpu", "0.11.2", False),
        ("gpu", "0.10.2.dev20250101", False),  # before the oldest supported release
        ("cpu", "0.11.0", False),
        ("tpu", "0.10.2", False),
    ],
)
def test_pooling_and_row_gradients_warn_of_a_gpu_jaxlib_with_the_slow_scatter_add(monkeypatch, backend, version, warns):
    """A bag's sum and the gradient of rows read at repeated ids are scatter-adds whose updates collide; on a GPU,
    jaxlib 0.10.2 to 0.11.0 run those 450 to 2,000 times slower (jax issue 38806): the library says so."""
    from optax_sparse_adam import _row_ops

    monkeypatch.setattr(_row_ops, "_platform", lambda: (backend, version))
    params = {"t": jnp.arange(12.0).reshape(6, 2)}
    b = osa.bags(jnp.array([[1, 2, 2], [4, -1, -1]]), 6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        osa.pool(params["t"], b)
        osa.value_and_row_grad(lambda p, b: osa.pool(p["t"], b).sum(), lambda p: p["t"])(params, b)
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    if not warns:
        assert not said, said
        return
    for where in ("pool", "value_and_row_grad"):
        assert any(
            m.startswith(f"{where} on a GPU with jaxlib {version}") and "jaxlib 0.11.1 or newer" in m for m in said
        )
