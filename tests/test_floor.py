"""The benchmarks' memory floors (``benchmarks/floor.py``) against a NumPy loop: the ratios the docs print are only
as good as the floors' work being the step's bytes."""

from __future__ import annotations

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
try:
    import floor
finally:
    sys.path.pop(0)

pytestmark = pytest.mark.skipif(floor.unavailable() is not None, reason=str(floor.unavailable()))


@pytest.fixture(autouse=True)
def _on_the_cpu():
    """The floors are CPU kernels: on a machine whose default device is a GPU, they run on its CPU."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


ROWS, WIDTH = 300, 5


def _batch(seed: int, n: int) -> tuple[np.ndarray, np.ndarray, tuple[np.ndarray, ...]]:
    """Ids with duplicates, padding (-1) and an out-of-range id; small whole numbers as values, so that every sum
    is exact and the comparison is bitwise whatever the order of the sums; the tables, p and a row-wise one."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 40, n).astype(np.int32)
    ids[::7] = -1
    if n:
        ids[3 % n] = ROWS + 5
    values = rng.integers(-8, 9, (n, WIDTH)).astype(np.float32)
    tables = (rng.integers(-8, 9, (ROWS, WIDTH)).astype(np.float32), rng.integers(0, 9, (ROWS, 1)).astype(np.float32))
    return ids, values, tables


def _sum_reference(ids: np.ndarray, values: np.ndarray, tables: tuple[np.ndarray, ...]) -> list[np.ndarray]:
    """Each in-range id's entries summed, added once to its row of each table (its first entries for a narrower
    one)."""
    out = [t.copy() for t in tables]
    for r in np.unique(ids[(ids >= 0) & (ids < ROWS)]):
        total = values[ids == r].sum(axis=0)
        for t in out:
            t[r] += total[: t.shape[1]]
    return out


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("n", [0, 1, 64, 2000])
def test_sum_touch_rows_reads_every_entry_and_each_row_once(n: int, threads: int) -> None:
    ids, values, tables = _batch(n, n)
    keys, slots = floor.group(ids)
    assert keys.shape == slots.shape == (n,)
    assert np.array_equal(keys[slots[ids >= 0]], ids[ids >= 0]) and np.all(slots[ids < 0] == -1)
    got = jax.jit(floor.sum_touch_rows, static_argnames="threads")(
        tuple(map(jnp.asarray, tables)), keys, slots, values, threads=threads
    )
    for g, want in zip(got, _sum_reference(ids, values, tables), strict=True):
        np.testing.assert_array_equal(np.asarray(g), want)


@pytest.mark.parametrize("threads", [1, 3])
def test_touch_rows_adds_one_gradient_row_per_key(threads: int) -> None:
    ids, values, tables = _batch(1, 2000)
    keys = np.unique(ids[ids >= 0]).astype(np.int32)  # the distinct ids, one gradient row each (the out-of-range too)
    rows = values[: keys.size]
    got = jax.jit(floor.touch_rows, static_argnames="threads")(
        tuple(map(jnp.asarray, tables)), keys, rows, threads=threads
    )
    want = [t.copy() for t in tables]
    for key, row in zip(keys, rows, strict=True):
        if key < ROWS:
            for t in want:
                t[key] += row[: t.shape[1]]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), w)


def test_sum_touch_rows_rejects_slots_outside_the_keys() -> None:
    ids, values, tables = _batch(2, 64)
    keys, slots = floor.group(ids)
    slots[5] = 64
    with pytest.raises(Exception, match="slots must index the keys"):
        floor.sum_touch_rows(tuple(map(jnp.asarray, tables)), keys, slots, values, threads=1)
