"""Summing duplicate keys: on the CPU and TPU without sorting (hash-and-elect rounds, then one scatter-add); on GPUs
one sort of the keys and a segmented scan (see :func:`pack_distinct` and :func:`sum_into_slots`)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_sparse_adam import _ffi, _kernel_path
from optax_sparse_adam._indexed_rows import normalise_keys
from optax_sparse_adam._sparse_leaf import SparseLeaf, padding_key


def _mix(x: jax.Array) -> jax.Array:
    """murmur3's 32-bit finalizer."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def representatives(keys: jax.Array, valid: jax.Array) -> jax.Array:
    """For each entry, the position of one entry with the same key (``k`` for padding).

    Sort-free: each round hashes the unresolved keys into a table of at least
    ``4k`` slots, lets the entries of each slot elect one winner by scatter, and
    resolves every entry whose key equals its slot winner's key. Entries with
    equal keys always share a slot, so they always agree on the winner; each
    round resolves at least every winner, and with a fresh hash per round the
    expected number of rounds is small (about 3 at 8,192 entries).
    """
    k = keys.shape[0]
    pos = jnp.arange(k, dtype=jnp.int32)
    if k <= 1:
        return jnp.where(valid, pos, k)
    rep0 = jnp.where(valid, jnp.int32(-1), k)
    log_t = max(2, (4 * k - 1).bit_length())
    table_size = 1 << log_t
    ukeys = keys.astype(jnp.uint32)

    def slots(round_: jax.Array) -> jax.Array:
        h = _mix(round_.astype(jnp.uint32) * jnp.uint32(0x9E3779B9) + jnp.uint32(0x7F4A7C15))
        for j in range(keys.shape[1]):
            h = _mix(h ^ ukeys[:, j])
        return (h >> (32 - log_t)).astype(jnp.int32)

    def cond(carry: tuple[jax.Array, jax.Array]) -> jax.Array:
        return jnp.any(carry[0] < 0)

    def body(carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        rep, round_ = carry
        open_ = rep < 0
        slot = jnp.where(open_, slots(round_), table_size)
        table = jnp.zeros(table_size, jnp.int32).at[slot].set(pos, mode="drop")
        winner = table.at[slot].get(mode="fill", fill_value=0)
        same = open_ & jnp.all(keys[winner] == keys, axis=1)
        return jnp.where(same, winner, rep), round_ + 1

    rep, _ = jax.lax.while_loop(cond, body, (rep0, jnp.int32(0)))
    return rep


def distinct_ids(ids: jax.Array, num_rows: int) -> tuple[jax.Array, jax.Array]:
    """The distinct in-range ids of a flat batch, packed into the leading slots, and each id's slot.

    By :func:`~optax_sparse_adam._coalesce.pack_distinct`: sort-free on the CPU
    and TPU, O(k) for ``k`` ids whatever the table's size (on GPUs one sort of
    the ids). On the CPU a native kernel packs the same ids in order of first
    occurrence (the XLA path's hash rounds give an order of their own).

    Args:
      ids: ``(k,)`` integer ids; ids ``< 0`` or ``>= num_rows`` are padding.
      num_rows: The number of rows of the table.

    Returns:
      ``(indices, inverse)``: ``(k,)`` int32 distinct ids, ``num_rows`` in the
      slots after them; ``(k,)`` int32 slot of each id, where a padding id
      gets the last slot (padding whenever there is a padding id).
    """
    keys = normalise_keys(ids[:, None], (num_rows,))

    def xla(keys: jax.Array) -> tuple[jax.Array, jax.Array]:
        valid = keys[:, 0] < num_rows
        # The distinct ids go into the leading slots, so that the optimizer stops after the last one
        # (for_each_chunk).
        target, packed = pack_distinct(keys, valid, padding_key((num_rows,), 1))
        return packed[:, 0], jnp.where(valid, target, ids.shape[0] - 1)

    if ids.shape[0] > 0 and _kernel_path.supports_rows((num_rows,), keys):
        return _kernel_path.select(lambda keys: _ffi.distinct(keys[:, 0], num_rows), xla, keys)
    return xla(keys)


def pack_distinct(keys: jax.Array, valid: jax.Array, pad: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Gives each distinct valid key one slot, the slots packed first.

    On the CPU and TPU by :func:`representatives`' hash rounds, the slots in an order of their own; on CUDA and
    ROCm GPUs by one sort of the keys, the slots in key order (a GPU runs the rounds' ``while`` loop with a
    device-to-host copy of its condition each round: at 8,192 ids on an H100 the rounds took 0.15 ms, a sort of the
    keys less). The branch is chosen when the step is lowered for its platform (``jax.lax.platform_dependent``).

    Args:
      keys: ``(k, s)`` int32 keys.
      valid: ``(k,)`` bool, False for padding entries.
      pad: ``(1, s)`` key for the slots after the distinct keys, out of range on every axis.

    Returns:
      ``(target, packed)``: ``target[i]`` is the slot of entry ``i``'s key
      (``k`` for padding); ``packed`` holds each distinct key once, in its slot,
      and ``pad`` in the slots after the last one.
    """
    return jax.lax.platform_dependent(keys, valid, pad, cuda=_pack_sorted, rocm=_pack_sorted, default=_pack_hashed)


def _pack_hashed(keys: jax.Array, valid: jax.Array, pad: jax.Array) -> tuple[jax.Array, jax.Array]:
    """:func:`pack_distinct` by hash rounds."""
    k = keys.shape[0]
    rep = representatives(keys, valid)
    is_rep = rep == jnp.arange(k, dtype=jnp.int32)
    slot = jnp.cumsum(is_rep, dtype=jnp.int32) - 1  # packed slot of each representative
    target = jnp.where(rep < k, slot.at[rep].get(mode="fill", fill_value=k), k)
    packed = jnp.broadcast_to(pad, keys.shape).at[jnp.where(is_rep, slot, k)].set(keys, mode="drop")
    return target, packed


class _SortedKeys(NamedTuple):
    """The keys of a batch sorted (padding last), and where each distinct key goes."""

    order: jax.Array  # (k,) the entry in each sorted position
    keys: jax.Array  # (k, s) the keys in sorted order, padding entries' keys replaced by ``pad``
    valid: jax.Array  # (k,) whether each sorted position holds a valid entry
    first: jax.Array  # (k,) whether it holds the first entry of its key
    slot: jax.Array  # (k,) the packed slot of its key (meaningful where ``valid``)


def _sort_keys(keys: jax.Array, valid: jax.Array, pad: jax.Array) -> _SortedKeys:
    """One stable sort of ``keys`` (padding entries given ``pad``, which sorts after every valid key)."""
    k, s = keys.shape
    keyed = jnp.where(valid[:, None], keys, pad)
    *columns, order = jax.lax.sort((*keyed.T, jnp.arange(k, dtype=jnp.int32)), num_keys=s, is_stable=True)
    ordered = jnp.stack(columns, axis=1)
    ok = valid[order]
    changed = jnp.concatenate([jnp.ones((1,), bool), jnp.any(ordered[1:] != ordered[:-1], axis=1)])
    first = ok & changed
    return _SortedKeys(order, ordered, ok, first, jnp.cumsum(first, dtype=jnp.int32) - 1)


def _pack_sorted(keys: jax.Array, valid: jax.Array, pad: jax.Array) -> tuple[jax.Array, jax.Array]:
    """:func:`pack_distinct` by one sort: the distinct keys in key order."""
    k = keys.shape[0]
    if k == 0:
        return jnp.zeros((0,), jnp.int32), keys
    sk = _sort_keys(keys, valid, pad)
    target = jnp.zeros((k,), jnp.int32).at[sk.order].set(jnp.where(sk.valid, sk.slot, k), unique_indices=True)
    packed = _put_first(jnp.broadcast_to(pad, keys.shape), sk, sk.keys)
    return target, packed


def _put_first(into: jax.Array, sk: _SortedKeys, rows: jax.Array) -> jax.Array:
    """``rows`` (in sorted order) written to their keys' slots of ``into``, from each key's first position."""
    k = into.shape[0]
    return into.at[jnp.where(sk.first, sk.slot, k)].set(rows, mode="drop", unique_indices=True)


def coalesce(leaf: SparseLeaf) -> SparseLeaf:
    """Sums duplicate keys into one entry each, packed into the leading slots.

    On the CPU a native kernel where it applies (float32 values, one sparse axis; see :mod:`._kernel_path`): the
    same keys and, key by key, bitwise the same sums (both add a key's entries from zero in entry order), in
    another slot order (first occurrence, where the XLA path's hash rounds give an order of their own). On GPUs the
    XLA path sorts the keys once and sums each key's run by a segmented scan (no scatter-add, no host-synced loop):
    the distinct keys come out in key order.

    The capacity ``k`` is kept, so shapes stay fixed under ``jit``: the
    distinct keys fill the first slots and padding with zero values the rest,
    which lets :func:`~optax_sparse_adam._sparse_leaf.for_each_chunk` stop after the
    last distinct key. Entries whose duplicates sum to zero stay (they are
    touched). A leaf already known to be distinct is returned as it is.
    """
    if leaf.distinct:
        return leaf

    def xla() -> tuple[jax.Array, jax.Array]:
        return _coalesce_xla(leaf)

    if leaf.n_sparse == 1 and _kernel_path.supports(leaf.shape, 1, leaf.values):

        def native() -> tuple[jax.Array, jax.Array]:
            keys, values = _ffi.coalesce(leaf.keys[:, 0], leaf.values, leaf.shape[0])
            return keys[:, None], values

        keys, values = _kernel_path.select(native, xla)
    else:
        keys, values = xla()
    return leaf.repacked(keys, values)


def _coalesce_xla(leaf: SparseLeaf) -> tuple[jax.Array, jax.Array]:
    """:func:`coalesce`'s keys and values on the XLA path: a sort on GPUs, hash rounds elsewhere."""
    operands = (leaf.keys, leaf.valid(), padding_key(leaf.shape, leaf.n_sparse), leaf.values)
    return jax.lax.platform_dependent(*operands, cuda=_coalesce_sorted, rocm=_coalesce_sorted, default=_coalesce_hashed)


def coalesce_unless_known(leaf: SparseLeaf) -> SparseLeaf:
    """:func:`coalesce`, also of a leaf distinct only by the user's unchecked ``unique_indices`` promise: a step
    that sets the summed rows (rather than adding each entry) sums a broken promise's duplicates as without it, as
    the kernels do."""
    return coalesce(leaf._replace(distinct=False, promised=False) if leaf.promised else leaf)


def coalesce_with_squares(leaf: SparseLeaf) -> tuple[SparseLeaf, jax.Array]:
    """:func:`coalesce` of a leaf it sums (not known distinct), and the sum of the squares of its summed values.

    The sum is ``optax.tree.norm(values, squared=True)`` of them on the XLA path; on the CPU's native path the
    coalescing kernel adds the squares of each row as it sums it, in double (:func:`._ffi.coalesce_squares`), so the
    two may differ by the XLA path's float32 summation error (as the slot orders of the two paths' sums already let
    them).
    """
    assert not leaf.distinct, "a distinct leaf is not summed"

    def xla() -> tuple[jax.Array, jax.Array, jax.Array]:
        keys, values = _coalesce_xla(leaf)
        return keys, values, optax.tree.norm(values, squared=True)

    if leaf.n_sparse == 1 and _kernel_path.supports(leaf.shape, 1, leaf.values):

        def native() -> tuple[jax.Array, jax.Array, jax.Array]:
            keys, values, squares = _ffi.coalesce_squares(leaf.keys[:, 0], leaf.values, leaf.shape[0])
            return keys[:, None], values, squares

        keys, values, squares = _kernel_path.select(native, xla)
    else:
        keys, values, squares = xla()
    summed = leaf.repacked(keys, values)
    return summed, squares


def sum_of_squares(leaf: SparseLeaf) -> jax.Array:
    """:func:`coalesce_with_squares`' sum of squares alone, bitwise, for a leaf of float32 values and one sparse
    axis: on the CPU the kernel reads the entries without writing their sums.

    Of a leaf known distinct, the sum of its entries' squares, each entry its own row (padding left out): on the XLA
    path ``optax.tree.norm`` of its values, padding zeroed; on the CPU's native path the kernel adds them in double
    without coalescing, as it adds distinct rows (so the two paths may differ by the XLA path's float32 summation
    error, as for a leaf it sums)."""
    assert leaf.n_sparse == 1, "a leaf of one sparse axis"

    def xla() -> jax.Array:
        values = leaf.zero_padding().values if leaf.distinct else _coalesce_xla(leaf)[1]
        return optax.tree.norm(values, squared=True)

    def native() -> jax.Array:
        return _ffi.sum_squares(leaf.keys[:, 0], leaf.values, leaf.shape[0], unique=_kernel_path.unique_flag(leaf))

    return _kernel_path.select(native, xla) if _kernel_path.supports(leaf.shape, 1, leaf.values) else xla()


def _coalesce_hashed(
    keys: jax.Array, valid: jax.Array, pad: jax.Array, values: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """:func:`coalesce`'s XLA path on the CPU and TPU: hash rounds, then one scatter-add."""
    target, packed = _pack_hashed(keys, valid, pad)
    return packed, sum_into_slots(target, values)


def _coalesce_sorted(
    keys: jax.Array, valid: jax.Array, pad: jax.Array, values: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """:func:`coalesce`'s XLA path on GPUs: one sort of the keys, the values of each key's run summed by a segmented
    scan, each total written to its key's slot (distinct keys in key order)."""
    k = keys.shape[0]
    if k == 0:
        return keys, values
    sk = _sort_keys(keys, valid, pad)
    # A padding entry is a run of its own (never added to a key's run), and is not written.
    starts = sk.first | ~sk.valid
    last = jnp.concatenate([starts[1:], jnp.ones((1,), bool)]) & sk.valid
    sums = _segmented_sums(starts, values[sk.order])
    summed = jnp.zeros_like(values).at[jnp.where(last, sk.slot, k)].set(sums, mode="drop", unique_indices=True)
    return _put_first(jnp.broadcast_to(pad, keys.shape), sk, sk.keys), summed


def sum_into_slots(target: jax.Array, values: jax.Array) -> jax.Array:
    """``values`` summed by ``target`` slot (``(k,)`` int32, ``k`` or more for entries to drop), shape kept.

    On the CPU and TPU one scatter-add. On CUDA and ROCm GPUs, where duplicate ids make a scatter-add's updates
    collide on the same slot (the hot rows of a Zipf batch, thousands of times) and jaxlib 0.10.2 to 0.11.0 run such
    scatter-adds 450 to 2,000 times slower (jax issue 38806, openxla issue 46225), a sort by slot, a segmented sum
    (an associative scan) and a scatter that writes each slot once (:func:`_sorted_sum`). The branch is chosen when
    the step is lowered for its platform (``jax.lax.platform_dependent``)."""

    def scatter_add(target: jax.Array, values: jax.Array) -> jax.Array:
        return jnp.zeros_like(values).at[target].add(values, mode="drop")

    return jax.lax.platform_dependent(target, values, cuda=_sorted_sum, rocm=_sorted_sum, default=scatter_add)


def _sorted_sum(target: jax.Array, values: jax.Array) -> jax.Array:
    """:func:`sum_into_slots` without a contended scatter: the entries sorted by slot, each slot's run summed by a
    segmented associative scan, and each run's total written to its slot by one scatter whose in-range indices are
    distinct."""
    k = values.shape[0]
    if k == 0:
        return values
    order = jnp.argsort(target, stable=True)
    slots, sorted_values = target[order], values[order]
    starts = jnp.concatenate([jnp.ones(1, bool), slots[1:] != slots[:-1]])
    ends = jnp.concatenate([slots[1:] != slots[:-1], jnp.ones(1, bool)])
    sums = _segmented_sums(starts, sorted_values)
    return jnp.zeros_like(values).at[jnp.where(ends, slots, k)].set(sums, mode="drop")


def _segmented_sums(starts: jax.Array, values: jax.Array) -> jax.Array:
    """Along the first axis, each entry's sum of ``values`` since the last ``starts`` (inclusive): at a run's last
    entry, the run's total. An associative scan (no scatter-add)."""

    def combine(a: tuple[jax.Array, jax.Array], b: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        (start_a, sum_a), (start_b, sum_b) = a, b
        restart = start_b.reshape(start_b.shape + (1,) * (sum_b.ndim - start_b.ndim))
        return start_a | start_b, jnp.where(restart, sum_b, sum_a + sum_b)

    return jax.lax.associative_scan(combine, (starts, values))[1]
