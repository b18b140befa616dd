"""Summing duplicate keys without sorting: hash-and-elect rounds, then one scatter-add."""

from __future__ import annotations

import jax
import jax.numpy as jnp

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

    The capacity ``k`` is kept, so shapes stay fixed under ``jit``: the
    distinct keys fill the first slots and padding with zero values the rest,
    which lets :func:`~optax_sparse_adam._sparse_leaf.for_each_chunk` stop after the
    last distinct key. Entries whose duplicates sum to zero stay (they are
    touched). A leaf already known to be distinct is returned as it is.
    """
    if leaf.distinct:
        return leaf
    target, keys = pack_distinct(leaf.keys, leaf.valid(), padding_key(leaf.shape, leaf.n_sparse))
    values = jnp.zeros_like(leaf.values).at[target].add(leaf.values, mode="drop")
    return leaf._replace(keys=keys, values=values, distinct=True, sorted=False, promised=False)
