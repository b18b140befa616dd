"""Summing duplicate keys without sorting: hash-and-elect rounds, then one scatter-add (on GPUs a sort and a
segmented scan instead: see :func:`sum_into_slots`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from optax_sparse_adam import _ffi, _kernel_path
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


def pack_distinct(keys: jax.Array, valid: jax.Array, pad: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Gives each distinct valid key one slot, the slots packed first.

    Args:
      keys: ``(k, s)`` int32 keys.
      valid: ``(k,)`` bool, False for padding entries.
      pad: ``(1, s)`` key for the slots after the distinct keys.

    Returns:
      ``(target, packed)``: ``target[i]`` is the slot of entry ``i``'s key
      (``k`` for padding); ``packed`` holds each distinct key once, in its slot,
      and ``pad`` in the slots after the last one.
    """
    k = keys.shape[0]
    rep = representatives(keys, valid)
    is_rep = rep == jnp.arange(k, dtype=jnp.int32)
    slot = jnp.cumsum(is_rep, dtype=jnp.int32) - 1  # packed slot of each representative
    target = jnp.where(rep < k, slot.at[rep].get(mode="fill", fill_value=k), k)
    packed = jnp.broadcast_to(pad, keys.shape).at[jnp.where(is_rep, slot, k)].set(keys, mode="drop")
    return target, packed


def coalesce(leaf: SparseLeaf) -> SparseLeaf:
    """Sums duplicate keys into one entry each, packed into the leading slots.

    On the CPU a native kernel where it applies (float32 values, one sparse axis; see :mod:`._kernel_path`): the
    same keys and, key by key, bitwise the same sums (both add a key's entries from zero in entry order), in
    another slot order (first occurrence, where the XLA path's hash rounds give an order of their own).

    The capacity ``k`` is kept, so shapes stay fixed under ``jit``: the
    distinct keys fill the first slots and padding with zero values the rest,
    which lets :func:`~optax_sparse_adam._sparse_leaf.for_each_chunk` stop after the
    last distinct key. Entries whose duplicates sum to zero stay (they are
    touched). A leaf already known to be distinct is returned as it is.
    """
    if leaf.distinct:
        return leaf

    def xla() -> tuple[jax.Array, jax.Array]:
        target, keys = pack_distinct(leaf.keys, leaf.valid(), padding_key(leaf.shape, leaf.n_sparse))
        return keys, sum_into_slots(target, leaf.values)

    if leaf.n_sparse == 1 and _kernel_path.supports(leaf.shape, 1, leaf.values):

        def native() -> tuple[jax.Array, jax.Array]:
            keys, values = _ffi.coalesce(leaf.keys[:, 0], leaf.values, leaf.shape[0])
            return keys[:, None], values

        keys, values = _kernel_path.select(native, xla)
    else:
        keys, values = xla()
    return leaf._replace(keys=keys, values=values, distinct=True, sorted=False, promised=False)


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

    def combine(a: tuple[jax.Array, jax.Array], b: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        (start_a, sum_a), (start_b, sum_b) = a, b
        restart = start_b.reshape(start_b.shape + (1,) * (sum_b.ndim - start_b.ndim))
        return start_a | start_b, jnp.where(restart, sum_b, sum_a + sum_b)

    _, sums = jax.lax.associative_scan(combine, (starts, sorted_values))
    return jnp.zeros_like(values).at[jnp.where(ends, slots, k)].set(sums, mode="drop")
