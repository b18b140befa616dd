"""advise_huge_pages: the tables' buffers on 2 MiB pages, their values and the steps on them unchanged."""

import ctypes
import errno
import platform
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optax_sparse_adam as osa
from optax_sparse_adam import _huge_pages

ROWS, WIDTH = 1 << 18, 64  # 64 MiB a table


def _collapses() -> str | None:
    """Why this machine cannot move memory onto huge pages now, or None: Linux 6.1 or later (MADV_COLLAPSE), with
    transparent huge pages on ("always" or "madvise")."""
    mode = _huge_pages.transparent_huge_pages()
    if mode not in ("always", "madvise"):
        return f"transparent huge pages unavailable or off here ({mode or 'not Linux'})"
    version = re.match(r"(\d+)\.(\d+)", platform.release())
    if version is None or (int(version[1]), int(version[2])) < (6, 1):
        return f"Linux {platform.release()} has no MADV_COLLAPSE (6.1 and later)"
    return None


needs_collapse = pytest.mark.skipif(_collapses() is not None, reason=str(_collapses()))
# A freshly written buffer lies on small pages only where huge ones are given on request.
needs_madvise = pytest.mark.skipif(
    _collapses() is not None or _huge_pages.transparent_huge_pages() != "madvise",
    reason="transparent huge pages not on 'madvise' here (or no MADV_COLLAPSE)",
)


def _fused_step(tx: Any) -> Any:
    """``update_and_apply`` of ``tx`` on a table of ``ROWS`` rows, for ``jax.jit``."""

    def step(p: jax.Array, s: Any, ids: jax.Array, values: jax.Array) -> Any:
        return osa.update_and_apply(tx, osa.IndexedRows(ids, values, ROWS), s, p)

    return step


def _share_huge(x: jax.Array) -> int:
    """The bytes of ``x``'s buffer on huge pages."""
    return _huge_pages.huge_bytes([(x.unsafe_buffer_pointer(), x.nbytes)])[0]


def _table(seed: int) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).normal(size=(ROWS, WIDTH)).astype(np.float32))


@needs_collapse
def test_the_tables_and_state_move_onto_huge_pages_and_keep_their_values() -> None:
    p = {"table": _table(0), "bias": jnp.ones((WIDTH,), jnp.float32)}
    tx = osa.sparse_adam(1e-2)
    state = tx.init(p)
    before = [np.asarray(x).copy() for x in jax.tree.leaves((p, state))]
    report = osa.advise_huge_pages((p, state))
    # The table, mu and nu; the bias and the count are below min_bytes.
    assert [path for path, _, _ in report.leaves] == ["[0]['table']", "[1][0].mu['table']", "[1][0].nu['table']"]
    assert report.bytes == 3 * ROWS * WIDTH * 4
    # Each buffer's whole 2 MiB pages (all but at most the pages at its two ends).
    for path, size, huge in report.leaves:
        assert size - 2 * report.page_bytes <= huge <= size, (path, huge, size)
    assert "on 2.0 MiB pages" in str(report)
    for x, y in zip(before, jax.tree.leaves((p, state)), strict=True):
        np.testing.assert_array_equal(np.asarray(y), x)


@needs_collapse
def test_a_donated_step_keeps_the_buffers_on_huge_pages_and_computes_the_same_numbers() -> None:
    """The advice stays with the buffers: a donated step updates them in place, and its numbers are those of the
    same steps on 4 KiB pages."""
    tx = osa.sparse_adam(1e-2)
    rng = np.random.default_rng(1)
    batches = [
        (
            jnp.asarray(rng.integers(-1, ROWS, 512).astype(np.int32)),
            jnp.asarray(rng.normal(size=(512, WIDTH)), jnp.float32),
        )
        for _ in range(3)
    ]

    step = _fused_step(tx)

    runs = []
    for advise in (False, True):
        p = _table(2)
        s = tx.init(p)
        if advise:
            osa.advise_huge_pages((p, s))
        start = p.unsafe_buffer_pointer()
        stepper = jax.jit(step, donate_argnums=(0, 1))
        for ids, values in batches:
            p, s = stepper(p, s, ids, values)
        assert p.unsafe_buffer_pointer() == start  # in place
        runs.append((p, s))
        if advise:
            spans = [(x.unsafe_buffer_pointer(), x.nbytes) for x in jax.tree.leaves((p, s)) if x.nbytes >= 2**25]
            assert len(spans) == 3
            for (_, size), huge in zip(spans, _huge_pages.huge_bytes(spans), strict=True):
                assert size - 2 * _huge_pages.page_bytes() <= huge <= size
    for x, y in zip(*(jax.tree.leaves(r) for r in runs), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@needs_collapse
def test_each_device_buffer_of_a_row_sharded_table_is_advised() -> None:
    mesh = jax.make_mesh((4,), ("rows",), devices=jax.devices()[:4])
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("rows"))
    table = jax.device_put(_table(3), sharding)
    report = osa.advise_huge_pages(table, min_bytes=0)
    assert sorted(path for path, _, _ in report.leaves) == sorted(f"on {d}" for d in jax.devices()[:4])
    for _, size, huge in report.leaves:
        assert size == ROWS * WIDTH
        assert size - 2 * report.page_bytes <= huge <= size


def test_without_huge_pages_nothing_is_advised(monkeypatch: pytest.MonkeyPatch) -> None:
    """With transparent huge pages off (or not on Linux) the buffers are listed, none advised, and the report
    says why. A fresh table may lie partly on huge pages already (memory an earlier test's advised buffer left
    to the allocator, here on a system that has them): the report gives what it found, unchanged."""
    table = _table(4)
    found = _share_huge(table)
    for mode, says in (("never", "transparent huge pages are off"), ("", "no transparent huge pages here")):
        monkeypatch.setattr(_huge_pages, "transparent_huge_pages", lambda mode=mode: mode)
        monkeypatch.setattr(_huge_pages, "_madvise", lambda: pytest.fail("advised"))
        report = osa.advise_huge_pages({"table": table, "count": 3})
        assert report.leaves == (("['table']", ROWS * WIDTH * 4, found),) and report.huge_bytes == found
        assert str(report).startswith(says)


def test_small_arrays_and_what_is_not_a_jax_array_are_left_alone() -> None:
    tree = {"small": jnp.zeros((8, 8), jnp.float32), "n": 3, "numpy": np.zeros(2**24, np.float32)}
    assert osa.advise_huge_pages(tree).leaves == ()


@needs_madvise
def test_step_report_names_the_tables_on_small_pages_until_they_are_moved() -> None:
    tx = osa.sparse_adam(1e-2)

    step = _fused_step(tx)

    p = _table(5)
    s = tx.init(p)
    args = (p, s, jnp.arange(8, dtype=jnp.int32), jnp.ones((8, WIDTH), jnp.float32))
    report = osa.step_report(jax.jit(step, donate_argnums=(0, 1)), *args)
    # Fresh buffers lie on 4 KiB pages where huge ones come on request (the process may have memory on huge pages
    # from its earlier work to give them, so each is measured here): the report names those.
    tables = {"args[0]": p, "args[1][0].mu": s[0].mu, "args[1][0].nu": s[0].nu}
    small = [(path, x.nbytes) for path, x in tables.items() if 2 * _share_huge(x) < x.nbytes]
    assert small and report.small_pages == tuple(small), (small, report.small_pages)
    assert f"on 4 KiB pages: {small[0][0]} (64.0 MiB)" in str(report) and report.in_place
    osa.advise_huge_pages((p, s))
    assert osa.step_report(jax.jit(step, donate_argnums=(0, 1)), *args).small_pages == ()


def test_step_report_says_nothing_of_pages_where_there_are_no_huge_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_huge_pages, "transparent_huge_pages", lambda: "never")
    tx = osa.sparse_adam(1e-2)
    p = _table(6)
    report = osa.step_report(
        jax.jit(_fused_step(tx)),
        p,
        tx.init(p),
        jnp.arange(8, dtype=jnp.int32),
        jnp.ones((8, WIDTH), jnp.float32),
    )
    assert report.small_pages == () and "4 KiB" not in str(report)


@needs_collapse
def test_an_nnx_model_and_optimizer_are_taken_as_they_are_and_stay_through_donated_steps() -> None:
    """The Flax guide's advice: an nnx model and optimizer advised as they are; its donated ``nnx.jit`` step (the
    guide's) keeps updating the same buffers, which stay on huge pages."""
    from flax import nnx

    from optax_sparse_adam import nnx as osa_nnx

    model = nnx.Embed(ROWS, WIDTH, rngs=nnx.Rngs(0))
    optimizer = osa_nnx.Optimizer(model, osa.sparse_adam(1e-2), wrt=nnx.Param)
    report = osa.advise_huge_pages((model, optimizer))
    paths = [path for path, _, _ in report.leaves]
    assert paths[0].endswith(".embedding.value") and len(paths) == 3, paths
    assert ".mu[" in paths[1] and ".nu[" in paths[2], paths
    for _, size, huge in report.leaves:
        assert size - 2 * report.page_bytes <= huge <= size

    @nnx.jit(donate_argnames=("model", "optimizer"))
    def train_step(model: Any, optimizer: Any, ids: jax.Array) -> jax.Array:
        graphdef, params = nnx.split(model, nnx.Param)

        def loss_fn(p: Any, ids: jax.Array) -> jax.Array:
            return jnp.sum(nnx.merge(graphdef, p)(ids) ** 2)

        loss, grads = osa.value_and_row_grad(loss_fn, lambda p: p["embedding"])(params, ids)
        optimizer.update(model, grads)
        return loss

    def buffers() -> list[tuple[int, int]]:
        leaves = jax.tree.leaves(nnx.state((model, optimizer)))
        return [(x.unsafe_buffer_pointer(), x.nbytes) for x in leaves if x.nbytes >= _huge_pages.MIN_BYTES]

    before = buffers()
    for t in range(3):
        train_step(model, optimizer, jnp.arange(256, dtype=jnp.int32) * 7 + t)
    assert buffers() == before
    for (_, size), huge in zip(before, _huge_pages.huge_bytes(before), strict=True):
        assert size - 2 * report.page_bytes <= huge <= size


def test_a_mapping_s_huge_pages_are_counted_once_over_the_buffers_in_it() -> None:
    """smaps gives each mapping's huge bytes, not where they lie: spans sharing a mapping share them, in address
    order, each up to its overlap; none is counted twice."""
    mib = 2**20
    smaps = "\n".join(
        [
            f"{0x10000000:x}-{0x10000000 + 64 * mib:x} rw-p 00000000 00:00 0",
            "Rss:               65536 kB",
            f"AnonHugePages:     {32 * 1024} kB",
            f"{0x20000000:x}-{0x20000000 + 8 * mib:x} rw-p 00000000 00:00 0",
            f"AnonHugePages:     {8 * 1024} kB",
        ]
    )
    spans = [(0x10000000 + 32 * mib, 32 * mib), (0x10000000, 32 * mib), (0x20000000 + mib, 4 * mib), (0x30000000, mib)]
    assert _huge_pages.huge_bytes(spans, smaps) == [0, 32 * mib, 4 * mib, 0]


def test_a_deleted_or_traced_array_is_refused_by_its_path_and_a_tied_one_is_listed_once() -> None:
    table = _table(7)
    report = osa.advise_huge_pages({"a": table, "tied": table})
    assert [path for path, _, _ in report.leaves] == ["['a']"] and report.bytes == ROWS * WIDTH * 4
    donated = _table(8)
    jax.jit(lambda x: x + 1, donate_argnums=0)(donated)
    with pytest.raises(ValueError, match=r"\['emb'\] was deleted \(donated to a step\?\)"):
        osa.advise_huge_pages({"emb": donated})
    with pytest.raises(ValueError, match=r"\['emb'\] is traced: call it on the arrays themselves, outside jit"):
        jax.jit(lambda tree: osa.advise_huge_pages(tree) and tree)({"emb": table})
    for bad in (-1, 1.5, "1", True):
        with pytest.raises(ValueError, match="min_bytes must be a non-negative int"):
            osa.advise_huge_pages({"emb": table}, min_bytes=bad)


def test_only_whole_huge_pages_inside_a_buffer_are_advised(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr(_huge_pages, "transparent_huge_pages", lambda: "madvise")
    monkeypatch.setattr(_huge_pages, "page_bytes", lambda: 2**21)
    monkeypatch.setattr(_huge_pages, "_madvise", lambda: lambda at, n, advice: calls.append((at, n, advice)) or 0)
    page = 2**21
    _huge_pages.advise_spans([(5 * page + 16, 3 * page), (20 * page + 1, page)])
    # The first span's pages 6 and 7 (its start and end lie inside pages 5 and 8); the second holds no whole page.
    assert calls == [(6 * page, 2 * page, 14), (6 * page, page, 25), (7 * page, page, 25)]


def test_a_page_that_fails_for_a_moment_is_tried_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """MADV_COLLAPSE's EAGAIN (a page locked, or on its way to the LRU) is tried again, up to three times; any other
    failure (ENOMEM: no free huge page; EINVAL: a kernel without it) leaves the page at once."""
    page = 2**21
    for err, tries in ((errno.EAGAIN, 3), (errno.ENOMEM, 1), (errno.EINVAL, 1)):
        calls = []

        def madvise(at: int, n: int, advice: int, err: int = err, calls: list[int] = calls) -> int:
            calls.append(advice)
            if advice == 14:
                return 0
            ctypes.set_errno(err)
            return -1

        monkeypatch.setattr(_huge_pages, "transparent_huge_pages", lambda: "madvise")
        monkeypatch.setattr(_huge_pages, "page_bytes", lambda: page)
        monkeypatch.setattr(_huge_pages, "_madvise", lambda madvise=madvise: madvise)
        _huge_pages.advise_spans([(4 * page, 2 * page)])
        assert calls == [14] + [25] * tries * 2, (err, calls)
