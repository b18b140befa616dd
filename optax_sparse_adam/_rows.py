"""Sparse gradient representations: :class:`IndexedRows`, BCOO, and coalescing.

Every sparse leaf is brought to one internal form, :class:`SparseLeaf`: an
``(k, s)`` integer key per entry that addresses the first ``s`` axes of the
parameter, and the ``(k, *shape[s:])`` values. An :class:`IndexedRows` is the
case ``s == 1``; a BCOO with ``n_sparse == s`` maps onto it directly. Padding
entries (any key component out of range) are given the key ``shape[:s]``, which
every gather fills and every scatter drops, so a fixed capacity costs nothing
but the slots it carries.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import sparse as jsparse

from optax_sparse_adam._explicit_sharding import replicate, scatter_rows

__all__ = ["IndexedRows", "is_sparse"]


@dataclasses.dataclass(frozen=True)
class IndexedRows:
    """Row-sparse gradient or update for a parameter of shape ``(num_rows, *row_shape)``.

    Entry ``i`` adds ``values[i]`` to row ``indices[i]``. Duplicate indices are
    summed. An index ``< 0`` or ``>= num_rows`` is padding and is ignored, so a
    batch can keep a fixed capacity under :func:`jax.jit`.

    Attributes:
      indices: Integer array of shape ``(k,)``.
      values: Array of shape ``(k, *row_shape)``.
      num_rows: Number of rows of the parameter (static).
      unique_indices: Static promise that the in-range indices are distinct and
        that padding entries hold zeros; it lets the optimizer skip summing
        duplicates. Set it only where the promise holds, as in the gradients
        :meth:`RowLookup.grad` builds; an update keeps its gradient's flag.

    Adding an ``IndexedRows`` to a dense array (``table + rows``) adds its
    values to their rows with one scatter, so :func:`optax.apply_updates`, and
    with it ``nnx.Optimizer`` and ``TrainState.apply_gradients``, take sparse
    updates as they are.
    """

    __array_ufunc__ = None  # NumPy defers ``ndarray + IndexedRows`` to __radd__

    indices: jax.Array
    values: jax.Array
    num_rows: int
    unique_indices: bool = False

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the dense parameter this addresses."""
        return (self.num_rows, *self.values.shape[1:])

    @property
    def dtype(self) -> Any:
        return self.values.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __radd__(self, other: Any) -> jax.Array:
        """``other + self`` for a dense ``other`` of this shape: a scatter-add into its rows."""
        other = jnp.asarray(other)
        return to_sparse_leaf(self, other.shape, (), "IndexedRows.__add__").add_to(other)

    __add__ = __radd__

    def todense(self) -> jax.Array:
        """The dense equivalent: duplicates summed, padding dropped."""
        idx = jnp.where((self.indices >= 0) & (self.indices < self.num_rows), self.indices, self.num_rows)
        return jnp.zeros(self.shape, self.values.dtype).at[replicate(idx)].add(replicate(self.values), mode="drop")


jax.tree_util.register_dataclass(
    IndexedRows, data_fields=["indices", "values"], meta_fields=["num_rows", "unique_indices"]
)


def is_sparse(x: Any) -> bool:
    """Whether ``x`` is a sparse leaf this library understands (``IndexedRows`` or BCOO)."""
    return isinstance(x, (IndexedRows, jsparse.BCOO))


def is_leaf(x: Any) -> bool:
    """``is_leaf`` for tree functions: sparse leaves and ``None`` are leaves."""
    return x is None or is_sparse(x)


def flatten(tree: Any) -> tuple[list[tuple[Any, Any]], Any]:
    """``(path, leaf)`` pairs and the treedef, with sparse leaves and ``None`` as leaves."""
    return jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)


def flatten_up_to(treedef: Any, tree: Any, where: str, what: str) -> list[Any]:
    """``tree``'s subtrees at the leaves of ``treedef``, or a clear error when the trees differ."""
    try:
        return treedef.flatten_up_to(tree)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{where}: the update tree does not match the {what} tree: {e}") from None


def path_str(path: Any) -> str:
    return jax.tree_util.keystr(tuple(path)) or "<root>"


class SparseLeaf(NamedTuple):
    """Internal form of a sparse leaf; see the module docstring."""

    keys: jax.Array  # (k, s) int32, padding = shape[:s]
    values: jax.Array  # (k, *shape[s:])
    shape: tuple[int, ...]
    unique: bool  # keys are known distinct (and padding values zero)
    declared_unique: bool  # the static flags of the leaf it came from, kept on output
    declared_sorted: bool
    bcoo: bool
    sorted: bool = False  # keys known in lexicographic order (padding, = shape, last)

    @property
    def n_sparse(self) -> int:
        return self.keys.shape[1]

    def row_index(self) -> tuple[jax.Array, ...]:
        """Index tuple for ``x.at[...]`` over the first ``n_sparse`` axes."""
        return tuple(self.keys[:, j] for j in range(self.n_sparse))

    def valid(self) -> jax.Array:
        return self.keys[:, 0] < self.shape[0]

    def add_to(self, dense: jax.Array) -> jax.Array:
        """``dense`` plus this leaf: a scatter-add into the addressed entries, in ``dense``'s dtype."""

        def add(start: Any, chunk: SparseLeaf, dense: jax.Array) -> jax.Array:
            return scatter_rows(dense, chunk.row_index(), chunk.values.astype(dense.dtype), "add")

        return for_each_chunk(self, add, dense)

    def replace_values(self, values: jax.Array) -> SparseLeaf:
        return self._replace(values=values)

    def to_leaf(self) -> IndexedRows | jsparse.BCOO:
        """Back to the user-facing type it came from, with the same static metadata.

        Keeping the metadata keeps the update tree's structure equal to the
        gradient tree's, which optax's wrappers (``apply_if_finite``,
        ``MultiSteps``, ``lax.cond`` in general) rely on. A BCOO declared
        sorted is sorted again if coalescing reordered it.
        """
        if not self.bcoo:
            return IndexedRows(self.keys[:, 0], self.values, self.shape[0], unique_indices=self.declared_unique)
        leaf = self
        if self.declared_sorted and not self.sorted:
            k, n_sparse = self.keys.shape
            *keys, perm = jax.lax.sort(
                (*(self.keys[:, j] for j in range(n_sparse)), jnp.arange(k, dtype=jnp.int32)), num_keys=n_sparse
            )
            leaf = self._replace(keys=jnp.stack(keys, axis=1), values=self.values[perm], sorted=True)
        return jsparse.BCOO(
            (leaf.values, leaf.keys),
            shape=self.shape,
            indices_sorted=self.declared_sorted,
            unique_indices=self.declared_unique,
        )


def _error(kind: type[Exception], where: str, path: Any, msg: str) -> Exception:
    return kind(f"{where}: parameter {path_str(path)}: {msg}")


def to_sparse_leaf(leaf: IndexedRows | jsparse.BCOO, param_shape: tuple[int, ...], path: Any, where: str) -> SparseLeaf:
    """Validates ``leaf`` against its parameter's shape and converts it."""
    param_shape = tuple(param_shape)
    if not param_shape:
        raise _error(
            ValueError, where, path, f"a sparse gradient ({type(leaf).__name__}) cannot address a 0-d parameter"
        )
    if isinstance(leaf, jsparse.BCOO):
        if leaf.n_batch:
            raise _error(
                ValueError, where, path, f"BCOO with batch dimensions is not supported (n_batch={leaf.n_batch})"
            )
        if tuple(leaf.shape) != param_shape:
            raise _error(
                ValueError,
                where,
                path,
                f"BCOO shape {tuple(leaf.shape)} does not match the parameter shape {param_shape}",
            )
        if not jnp.issubdtype(leaf.indices.dtype, jnp.integer):
            raise _error(TypeError, where, path, f"BCOO indices must be integers, got dtype {leaf.indices.dtype}")
        keys, values, unique, bcoo = leaf.indices, leaf.data, bool(leaf.unique_indices), True
        declared_sorted = bool(leaf.indices_sorted)
    elif isinstance(leaf, IndexedRows):
        idx, values = jnp.asarray(leaf.indices), jnp.asarray(leaf.values)
        if not jnp.issubdtype(idx.dtype, jnp.integer):
            raise _error(TypeError, where, path, f"IndexedRows.indices must be integers, got dtype {idx.dtype}")
        if idx.ndim != 1:
            raise _error(ValueError, where, path, f"IndexedRows.indices must be 1-D, got shape {idx.shape}")
        if values.ndim < 1 or values.shape[0] != idx.shape[0]:
            raise _error(
                ValueError,
                where,
                path,
                f"IndexedRows has {idx.shape[0]} indices but values of shape {values.shape}",
            )
        if leaf.num_rows != param_shape[0]:
            raise _error(
                ValueError,
                where,
                path,
                f"IndexedRows.num_rows={leaf.num_rows} but the parameter has {param_shape[0]} rows",
            )
        if tuple(values.shape[1:]) != param_shape[1:]:
            raise _error(
                ValueError,
                where,
                path,
                f"IndexedRows row shape {tuple(values.shape[1:])} does not match "
                f"the parameter's row shape {param_shape[1:]}",
            )
        keys, unique, bcoo, declared_sorted = idx[:, None], bool(leaf.unique_indices), False, False
    else:  # pragma: no cover - callers dispatch on is_sparse
        raise TypeError(type(leaf))
    if not jnp.issubdtype(values.dtype, jnp.inexact):
        raise _error(TypeError, where, path, f"sparse values must be floating point, got dtype {values.dtype}")
    keys, values = replicate(keys.astype(jnp.int32)), replicate(values)
    n_sparse = keys.shape[1]
    dims = padding_key(param_shape, n_sparse)
    valid = jnp.all((keys >= 0) & (keys < dims), axis=1)
    keys = jnp.where(valid[:, None], keys, dims)
    return SparseLeaf(keys, values, param_shape, unique, unique, declared_sorted, bcoo, sorted=declared_sorted)


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
    unresolved = jnp.int32(-1)
    rep0 = jnp.where(valid, unresolved, k)
    if k <= 1:
        return jnp.where(valid, pos, k)
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


def coalesce(leaf: SparseLeaf) -> SparseLeaf:
    """Sums duplicate keys into one entry each, packed into the leading slots.

    The capacity ``k`` is kept, so shapes stay fixed under ``jit``: the
    distinct keys fill the first slots and padding with zero values the rest,
    which lets :func:`for_each_chunk` stop after the last distinct key. Entries
    whose duplicates sum to zero stay (they are touched). A leaf already known
    to be unique is returned as it is.
    """
    if leaf.unique:
        return leaf
    target, keys = pack_distinct(leaf.keys, leaf.valid(), padding_key(leaf.shape, leaf.n_sparse))
    values = jnp.zeros_like(leaf.values).at[target].add(leaf.values, mode="drop")
    return leaf._replace(keys=keys, values=values, unique=True, sorted=False)


def padding_key(shape: tuple[int, ...], n_sparse: int) -> jax.Array:
    """The ``(1, n_sparse)`` key that marks padding: ``shape[:n_sparse]``, out of range on every axis."""
    return jnp.asarray(np.array(shape[:n_sparse], dtype=np.int32))[None, :]


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


def _chunk_size(k: int) -> int:
    """Slots per chunk: up to 8 chunks of at least 512 slots, or one chunk."""
    for n in (8, 4, 2):
        if k % n == 0 and k // n >= 512:
            return k // n
    return k


def for_each_chunk(leaf: SparseLeaf, fn: Callable[[Any, SparseLeaf, Any], Any], carry: Any) -> Any:
    """Folds ``fn(start, chunk, carry)`` over the chunks of ``leaf`` up to its last valid slot.

    Gathers and scatters cost per slot, padding included, so a leaf whose
    valid entries are packed first (as :func:`coalesce` leaves them) is
    processed only as far as it holds rows: a batch of 8,192 ids with 2,400
    distinct rows touches 3 chunks of 1,024. The trip count is data-dependent
    but the shapes are not, so nothing retraces.
    """
    k = leaf.keys.shape[0]
    size = _chunk_size(k)
    if size == k:
        return fn(0, leaf, carry)
    used = jnp.max(jnp.where(leaf.valid(), jnp.arange(1, k + 1, dtype=jnp.int32), 0))

    def body(c: jax.Array, carry: Any) -> Any:
        start = c * size
        chunk = leaf._replace(
            keys=jax.lax.dynamic_slice_in_dim(leaf.keys, start, size),
            values=jax.lax.dynamic_slice_in_dim(leaf.values, start, size),
        )
        return fn(start, chunk, carry)

    return jax.lax.fori_loop(0, (used + size - 1) // size, body, carry)


def _expand(mask: jax.Array, ndim: int) -> jax.Array:
    return mask.reshape(mask.shape + (1,) * (ndim - mask.ndim))


def zero_padding(leaf: SparseLeaf) -> SparseLeaf:
    """Zeroes the values of padding entries (duplicates are left as they are)."""
    mask = _expand(leaf.valid(), leaf.values.ndim)
    return leaf.replace_values(jnp.where(mask, leaf.values, jnp.zeros((), leaf.values.dtype)))
