"""Low-precision tables: :func:`apply_updates_stochastic`, parameter updates with stochastic rounding."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import optax

from optax_sparse_adam import _ffi, _kernel_path
from optax_sparse_adam._apply import apply_updates
from optax_sparse_adam._coalesce import _mix, coalesce_unless_known
from optax_sparse_adam._indexed_rows import is_sparse
from optax_sparse_adam._row_ops import HALF_FLOATS, scatter_rows, take_rows
from optax_sparse_adam._sparse_leaf import for_each_chunk, to_sparse_leaf
from optax_sparse_adam._tree import map_leaves, param_error

__all__ = ["apply_updates_stochastic", "stochastic_round"]

_WHERE = "apply_updates_stochastic"


def stochastic_round(x: jax.Array, dtype: Any, key: jax.Array) -> jax.Array:
    r"""Rounds float32 ``x`` to ``dtype`` up or down at random, unbiased: :math:`E[\mathrm{round}(x)] = x`.

    ``x`` goes to the neighbour above with probability equal to its distance
    from the neighbour below over the gap between them. Values that ``dtype``
    holds exactly, infinities and NaN are rounded to nearest, and so are
    values beyond ``dtype``'s largest finite value on either side: they give
    the largest finite value or overflow to infinity, as round to nearest
    (``x.astype(dtype)``, :func:`apply_updates`) does.

    Args:
      x: A float32 array.
      dtype: ``jnp.bfloat16`` or ``jnp.float16``.
      key: A PRNG key; the same key gives the same result.

    Returns:
      ``x`` rounded to ``dtype``.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import optax_sparse_adam as osa
      >>> x = jnp.full((10000,), 1.0 + 2.0**-10, jnp.float32)  # below bf16's resolution at 1
      >>> x.astype(jnp.bfloat16).astype(jnp.float32).mean()
      Array(1., dtype=float32)
      >>> y = osa.stochastic_round(x, jnp.bfloat16, jax.random.key(0))
      >>> float(y.astype(jnp.float32).mean().round(3))
      1.001
    """
    x = jnp.asarray(x, jnp.float32)
    return _round_with(x, dtype, jax.random.bits(key, x.shape, jnp.uint32))


def _round_with(x: jax.Array, dtype: Any, bits: jax.Array) -> jax.Array:
    """:func:`stochastic_round` with its random bits given, a ``uint32`` per element of float32 ``x``.

    bfloat16, the top half of a float32: the draw's top 16 bits are added below the half kept, and the sum is
    truncated. ``x`` goes up in magnitude with probability (its low half) / 2**16, which is exactly its distance
    from the neighbour below over the gap (the float32s between two bfloat16 neighbours are evenly spaced,
    subnormals too, and a carry into the exponent is the next neighbour). float16: ``x`` goes to the upper
    neighbour where the draw's top 24 bits, as a fraction, fall below that ratio. Either way to nearest where
    ``x`` is held exactly, is not finite or lies past the largest finite value.
    """
    nearest = jax.lax.optimization_barrier(x.astype(dtype))
    if jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16):
        u = jax.lax.bitcast_convert_type(x, jnp.uint32)
        drawn = jax.lax.bitcast_convert_type(((u + (bits >> 16)) >> 16).astype(jnp.uint16), jnp.bfloat16)
        return jnp.where((u & jnp.uint32(0x7FFFFFFF)) > jnp.uint32(0x7F7F0000), nearest, drawn)
    uniform = (bits >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)
    # The barrier keeps the round trip float32 -> dtype -> float32: XLA:GPU drops such convert pairs where excess
    # precision is allowed (its default), which made `near == x` everywhere under jit and rounded all to nearest.
    near = nearest.astype(jnp.float32)
    toward = jnp.where(near < x, jnp.asarray(jnp.inf, dtype), jnp.asarray(-jnp.inf, dtype))
    other = jax.lax.nextafter(nearest, toward)
    far = other.astype(jnp.float32)
    lo, hi = jnp.minimum(near, far), jnp.maximum(near, far)
    p_hi = (x - lo) / (hi - lo)
    up = uniform < p_hi
    rounded = jnp.where(up == (hi == near), nearest, other)
    # Round to nearest where dtype holds x exactly, where x is not finite, and at the ends of dtype's range:
    # beyond the largest finite value (where round to nearest overflows to +-inf, as apply_updates does)
    # and between it and the overflow threshold (where round to nearest gives the largest finite value).
    exact = (near == x) | ~jnp.isfinite(x) | ~jnp.isfinite(near) | ~jnp.isfinite(far)
    return jnp.where(exact, nearest, rounded)


def leaf_seeds(key: jax.Array, index: int) -> jax.Array:
    """The two 32-bit seeds of the sparse update leaf at position ``index`` of the parameters' tree.

    murmur3's finalizer over ``index`` and the words of ``jax.random.key_data(key)`` (any PRNG implementation, or a
    raw ``uint32`` key), then once more for the second seed: integer operations on a few scalars. Deriving them
    with threefry (``fold_in`` and ``random.bits``) cost about 0.1 ms of a step on XLA:CPU, before the row kernel
    could start.
    """
    words = jax.random.key_data(key).astype(jnp.uint32).ravel()
    h = _mix(jnp.uint32(index) * jnp.uint32(0x9E3779B9) + jnp.uint32(0x7F4A7C15))
    for j in range(words.shape[0]):
        h = _mix(h ^ words[j])
    return jnp.stack([h, _mix(h + jnp.uint32(0x9E3779B9))])


def _draws(seeds: jax.Array, keys: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """The random bits (a ``uint32``) of each element of each entry of a coalesced sparse leaf, from the leaf's
    two ``seeds`` (:func:`leaf_seeds`) and the entry's own key.

    Keyed by the row (or element) a draw rounds rather than by its packed slot: the slots' order depends on the
    order of the ids, on the path that summed them (the native kernel packs ids in order of first occurrence, the
    XLA path by its hash rounds) and, on GPUs, on which of the colliding writes of the hash rounds lands, so draws
    by slot would change with any of them. Each entry's key columns are hashed with the two seeds into the row's
    seed (murmur3's finalizer), and each element's draw is that seed plus the element's position times the golden
    ratio (:func:`_round_with` takes the bits it uses from it): a counter-based generator, one integer hash a row
    (a PRNG key per row cost a threefry block per element, several times the optimizer's step). Each element's
    draw is uniform and independent from step to step and from row to row (the row's seed is); within a row the
    draws are a randomly shifted Weyl sequence (the elements' rounding errors spread evenly, as stratified
    sampling spreads them, rather than independently). A hash per element cost 40 of the 300 microseconds of a
    bfloat16 table's fused row-wise Adagrad step on the CPU (1e6 x 64, 8,192 Zipf ids).
    """
    row = _mix(keys[:, 0].astype(jnp.uint32) ^ seeds[0])
    for j in range(1, keys.shape[1]):
        row = _mix(row ^ keys[:, j].astype(jnp.uint32))
    row = _mix(row ^ seeds[1])
    position = jnp.arange(math.prod(shape), dtype=jnp.uint32) * jnp.uint32(0x9E3779B9)
    return (row[:, None] + position[None, :]).reshape((keys.shape[0], *shape))


def apply_updates_stochastic(params: optax.Params, updates: optax.Updates, key: jax.Array) -> optax.Params:
    r"""Applies updates, rounding bfloat16 and float16 parameters stochastically.

    A step smaller than half the spacing of a bfloat16 parameter's value is
    lost to round-to-nearest, so a low-precision table stalls once its steps
    get small. Here ``p + u`` is computed in float32 and rounded to the
    parameter's dtype with :func:`stochastic_round`, so small steps survive on
    average. For a sparse update only the touched entries are rounded (and
    written); other parameters are added as :func:`apply_updates` adds them.
    The result is a function of ``key``: with ``i`` a parameter's position in
    the tree, a dense leaf draws with :func:`stochastic_round` from
    ``jax.random.fold_in(key, i)``, and each row a sparse update touches from
    an integer hash of the key's data, ``i``, the row's id and the element's
    position in the row, so the result does not depend on the order of the
    ids, on duplicates or padding, or on the platform's order of summing them;
    pass a new key every step: ``keys[step]`` of ``keys = jax.random.split(key,
    num_steps)`` made once (``jax.random.fold_in(key, step)`` in a jitted step
    runs threefry as a loop on the CPU, which costs more than the rounding). The
    duplicates of a sparse update are summed first, also those of one that
    breaks its ``unique_indices`` promise.

    Args:
      params: A tree of parameters.
      updates: A tree of updates (dense, sparse or ``None`` leaves).
      key: A PRNG key.

    Returns:
      The updated parameters, in their own dtypes.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import optax_sparse_adam as osa
      >>> p = jnp.ones((2, 4096), jnp.bfloat16)
      >>> u = osa.IndexedRows(jnp.array([1]), jnp.full((1, 4096), 1e-3, jnp.float32), 2)
      >>> new = osa.apply_updates_stochastic(p, u, jax.random.key(0))
      >>> new.dtype, float(new[0].astype(jnp.float32).mean())
      (dtype(bfloat16), 1.0)
      >>> round(float(new[1].astype(jnp.float32).mean()), 2)
      1.0
      >>> bool(new[1].astype(jnp.float32).max() > 1)  # some entries moved up a whole bf16 step
      True
    """
    return apply_stochastic(params, updates, key)


def apply_stochastic(
    params: optax.Params, updates: optax.Updates, key: jax.Array, first_rows: dict[int, jax.Array] | None = None
) -> optax.Params:
    """:func:`apply_updates_stochastic`, a sparse leaf's draws keyed by its rows' ids plus ``first_rows[i]`` for
    the parameter at position ``i`` where given: inside ``shard_map`` a table is its device's block, and its first
    row's global id makes its rows draw as the whole table's do (``RowSharding.update_and_apply`` with a key)."""
    first_rows = first_rows or {}
    treedef: Any
    pairs, treedef = jax.tree_util.tree_flatten_with_path(params)
    index = treedef.unflatten(list(range(len(pairs))))

    def leaf(path: Any, u: Any, p: Any, i: Any) -> tuple[Any]:
        if u is None or p is None:
            return (p,)
        p = jnp.asarray(p)
        if p.dtype not in HALF_FLOATS:
            return (apply_updates(p, u),)
        if not is_sparse(u):
            u = jnp.asarray(u)
            if u.shape != p.shape:
                raise param_error(
                    ValueError, _WHERE, path, f"update shape {u.shape} does not match the parameter shape {p.shape}"
                )
            x = p.astype(jnp.float32) + u.astype(jnp.float32)
            return (stochastic_round(x, p.dtype, jax.random.fold_in(key, i)),)
        leaf = coalesce_unless_known(to_sparse_leaf(u, p.shape, path, _WHERE))  # padding: zero values, dropped keys
        seeds = leaf_seeds(key, i)

        def round_rows(start: Any, chunk: Any, p: jax.Array) -> jax.Array:
            idx = chunk.row_index()
            x = take_rows(p, idx).astype(jnp.float32) + chunk.values.astype(jnp.float32)
            keys = chunk.keys if i not in first_rows else chunk.keys + first_rows[i].astype(chunk.keys.dtype)
            rounded = _round_with(x, p.dtype, _draws(seeds, keys, x.shape[1:]))
            return scatter_rows(p, idx, rounded, "set", unique=True)

        def xla() -> jax.Array:
            return for_each_chunk(leaf, round_rows, p)  # the summed rows fill the first slots

        # On the CPU, float32 rows of one sparse axis: one native pass over the touched rows, the same sums rounded
        # with the same draws (the keys distinct, as the kernel needs them: coalesced above).
        if leaf.n_sparse == 1 and _kernel_path.supports(p.shape, 1, leaf.values, params=p):
            if i in first_rows:
                seeds = jnp.concatenate([seeds, first_rows[i].astype(jnp.uint32).reshape(1)])
            return (
                _kernel_path.select(lambda: _ffi.add_rows_half_stochastic(p, leaf.keys[:, 0], leaf.values, seeds), xla),
            )
        return (xla(),)

    (new,) = map_leaves(
        leaf, updates, [(params, "parameters"), (index, "parameters")], where=_WHERE, tree_name="updates", n_out=1
    )
    return new
