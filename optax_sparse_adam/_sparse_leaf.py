"""The internal form of a sparse leaf: validated int32 keys, what was declared, and what is known.

Every sparse leaf is brought to one internal form, :class:`SparseLeaf`: an
``(k, s)`` int32 key per entry that addresses the first ``s`` axes of the
parameter, and the ``(k, *shape[s:])`` values. An :class:`IndexedRows` is the
case ``s == 1``; a BCOO with ``n_sparse == s`` maps onto it directly. An entry
with any key component out of range, compared in the index's own dtype before
any cast, is padding and gets the key ``shape[:s]``, which every gather fills
and every scatter drops, so a fixed capacity costs nothing but the slots it
carries.

An update leaf that the library emits carries a private record of what is
known about it (:class:`Known`), so that the next stage of a step (the
learning rate, :func:`apply_updates`) uses its keys as they are instead of
validating and normalising them again. Any tree operation that rebuilds the
leaf drops the record, and the leaf is then checked in full.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from optax_sparse_adam._indexed_rows import (
    IndexedRows,
    as_index_array,
    bcoo_like,
    is_bcoo,
    normalise_keys,
    owner_axis,
)

if TYPE_CHECKING:
    from jax.experimental import sparse as jsparse
from optax_sparse_adam._row_ops import replicate, scatter_rows
from optax_sparse_adam._tree import broadcast_rows, param_error

_KNOWN_ATTR = "_osa_known"


class Declared(NamedTuple):
    """What the user's leaf declares: restored on every update leaf built from it."""

    bcoo: bool  # a BCOO (else an IndexedRows)
    index_dtype: np.dtype
    unique: bool  # the leaf's static unique_indices
    sorted: bool  # a BCOO's static indices_sorted
    owner_axis: str | None = None  # a row-sharded table's routed layout (IndexedRows.owner_axis)


def _declared(leaf: Any, index_dtype: np.dtype) -> Declared:
    if isinstance(leaf, IndexedRows):
        return Declared(False, index_dtype, leaf.unique_indices, False, leaf.owner_axis)
    return Declared(True, index_dtype, bool(leaf.unique_indices), bool(leaf.indices_sorted), owner_axis(leaf))


class Known(NamedTuple):
    """What the library established about an update leaf it emitted (see the module docstring)."""

    shape: tuple[int, ...]
    distinct: bool
    sorted: bool
    promised: bool = False  # distinct only by the user's unique_indices, unchecked


class SparseLeaf(NamedTuple):
    """Internal form of a sparse leaf; see the module docstring."""

    keys: jax.Array  # (k, s) int32, padding = shape[:s]
    values: jax.Array  # (k, *shape[s:])
    shape: tuple[int, ...]
    declared: Declared
    distinct: bool  # keys known distinct, and padding values zero
    sorted: bool  # keys known in lexicographic order (padding last)
    promised: bool = False  # `distinct` rests on the user's unique_indices only; the kernels check it

    @property
    def n_sparse(self) -> int:
        return self.keys.shape[1]

    def row_index(self) -> tuple[jax.Array, ...]:
        """Index tuple over the first ``n_sparse`` axes, for the row gathers and scatters of ``_row_ops``."""
        return tuple(self.keys[:, j] for j in range(self.n_sparse))

    def valid(self) -> jax.Array:
        return self.keys[:, 0] < self.shape[0]

    def add_to(self, dense: jax.Array) -> jax.Array:
        """``dense`` plus this leaf: a scatter-add into the addressed entries, in ``dense``'s dtype."""

        def add(start: Any, chunk: SparseLeaf, dense: jax.Array) -> jax.Array:
            return scatter_rows(dense, chunk.row_index(), chunk.values.astype(dense.dtype), "add")

        return for_each_chunk(self, add, dense)

    def relaid(self, keys: jax.Array, values: jax.Array, **flags: Any) -> SparseLeaf:
        """This leaf with its entries in new slots (and ``flags`` set): no longer laid out entry by entry as it came,
        so it loses a routed leaf's owner mark (``Declared.owner_axis``)."""
        declared = self.declared._replace(owner_axis=None)
        return self._replace(keys=keys, values=values, declared=declared, **flags)

    def repacked(self, keys: jax.Array, values: jax.Array) -> SparseLeaf:
        """This leaf summed into new slots, its distinct keys packed first (:meth:`relaid`)."""
        return self.relaid(keys, values, distinct=True, sorted=False, promised=False)

    def zero_padding(self) -> SparseLeaf:
        """Zeroes the values of padding entries (duplicates are left as they are)."""
        mask = broadcast_rows(self.valid(), self.values.ndim)
        return self._replace(values=jnp.where(mask, self.values, jnp.zeros((), self.values.dtype)))

    def to_leaf(self) -> IndexedRows | jsparse.BCOO:
        """Back to the user-facing type it came from, with the same static metadata and index dtype.

        Keeping the metadata keeps the update tree's structure equal to the
        gradient tree's, which optax's ``lax.cond``-based wrappers
        (``apply_if_finite``, ``MultiSteps``) rely on. A BCOO declared sorted
        is sorted again if coalescing reordered it.
        """
        declared = self.declared
        if not declared.bcoo:
            rows = IndexedRows(
                self.keys[:, 0].astype(declared.index_dtype),
                self.values,
                self.shape[0],
                unique_indices=declared.unique,
                owner_axis=declared.owner_axis,
            )
            object.__setattr__(rows, _KNOWN_ATTR, Known(self.shape, self.distinct, self.sorted, self.promised))
            return rows
        leaf = self
        if declared.sorted and not self.sorted:
            k, n_sparse = self.keys.shape
            *keys, perm = jax.lax.sort(
                (*(self.keys[:, j] for j in range(n_sparse)), jnp.arange(k, dtype=jnp.int32)), num_keys=n_sparse
            )
            leaf = self.relaid(jnp.stack(keys, axis=1), self.values[perm], sorted=True)
        bcoo = bcoo_like(
            (leaf.values, leaf.keys.astype(declared.index_dtype)),
            shape=self.shape,
            owner_axis=leaf.declared.owner_axis,
            indices_sorted=declared.sorted,
            unique_indices=declared.unique,
        )
        setattr(bcoo, _KNOWN_ATTR, Known(self.shape, self.distinct, leaf.sorted, self.promised))
        return bcoo


def mark_distinct(rows: IndexedRows) -> IndexedRows:
    """Marks ``rows`` the library built with distinct keys (padding ``num_rows``, zero values) as known distinct."""
    object.__setattr__(rows, _KNOWN_ATTR, Known(rows.shape, True, False))
    return rows


def padding_key(shape: tuple[int, ...], n_sparse: int) -> jax.Array:
    """The ``(1, n_sparse)`` key that marks padding: ``shape[:n_sparse]``, out of range on every axis."""
    return jnp.asarray(np.array(shape[:n_sparse], dtype=np.int32))[None, :]


def to_sparse_leaf(
    leaf: IndexedRows | jsparse.BCOO, param_shape: tuple[int, ...], path: Any, where: str, *, emits: bool = False
) -> SparseLeaf:
    """Validates ``leaf`` against its parameter's shape and converts it.

    Args:
      leaf: The user's sparse leaf.
      param_shape: Its parameter's shape.
      path: Its path in the tree, for errors.
      where: The public function asking, for errors.
      emits: Whether the caller builds an update leaf of the same type from it,
        which must then be able to mark padding in the leaf's index dtype.
    """
    param_shape = tuple(param_shape)
    known = getattr(leaf, _KNOWN_ATTR, None)
    if isinstance(known, Known) and known.shape == param_shape:  # emitted by this library: use it as it is
        if isinstance(leaf, IndexedRows):
            index, values = as_index_array(leaf.indices)[:, None], leaf.values
        else:
            index, values = leaf.indices, leaf.data
        declared = _declared(leaf, index.dtype)
        return SparseLeaf(
            index.astype(jnp.int32), values, param_shape, declared, known.distinct, known.sorted, known.promised
        )
    if not param_shape:
        raise param_error(
            ValueError, where, path, f"a sparse gradient ({type(leaf).__name__}) cannot address a 0-d parameter"
        )
    if is_bcoo(leaf):
        if leaf.n_batch:
            raise param_error(
                ValueError,
                where,
                path,
                f"BCOO with batch dimensions is not supported (n_batch={leaf.n_batch}); "
                "use `jax.experimental.sparse.bcoo_update_layout(g, n_batch=0)`",
            )
        if tuple(leaf.shape) != param_shape:
            raise param_error(
                ValueError,
                where,
                path,
                f"BCOO shape {tuple(leaf.shape)} does not match the parameter shape {param_shape}",
            )
        if leaf.n_sparse == 0:
            raise param_error(
                ValueError,
                where,
                path,
                "a BCOO with n_sparse=0 addresses no rows (each entry is the whole array): pass its sum as a dense "
                "gradient (`g.todense()`), or build it with n_sparse=1 (whole rows) or more",
            )
        index, values = leaf.indices, leaf.data
        if not jnp.issubdtype(index.dtype, jnp.integer):
            raise param_error(TypeError, where, path, f"BCOO indices must be integers, got dtype {index.dtype}")
        declared = _declared(leaf, index.dtype)
    elif isinstance(leaf, IndexedRows):
        index, values = as_index_array(leaf.indices), jnp.asarray(leaf.values)
        if not jnp.issubdtype(index.dtype, jnp.integer):
            raise param_error(TypeError, where, path, f"IndexedRows.indices must be integers, got dtype {index.dtype}")
        if index.ndim != 1:
            raise param_error(ValueError, where, path, f"IndexedRows.indices must be 1-D, got shape {index.shape}")
        if values.ndim < 1 or values.shape[0] != index.shape[0]:
            raise param_error(
                ValueError, where, path, f"IndexedRows has {index.shape[0]} indices but values of shape {values.shape}"
            )
        if leaf.num_rows != param_shape[0]:
            raise param_error(
                ValueError,
                where,
                path,
                f"the gradient is an IndexedRows for {leaf.num_rows} rows but the parameter has {param_shape[0]} "
                "rows; build it with num_rows=table.shape[0]",
            )
        if tuple(values.shape[1:]) != param_shape[1:]:
            raise param_error(
                ValueError,
                where,
                path,
                f"IndexedRows row shape {tuple(values.shape[1:])} does not match "
                f"the parameter's row shape {param_shape[1:]}",
            )
        index = index[:, None]
        declared = _declared(leaf, index.dtype)
    else:  # pragma: no cover - callers dispatch on is_sparse
        raise TypeError(type(leaf))
    if not jnp.issubdtype(values.dtype, jnp.inexact):
        raise param_error(TypeError, where, path, f"sparse values must be floating point, got dtype {values.dtype}")
    dims = param_shape[: index.shape[1]]
    if max(dims) >= 2**31:
        raise param_error(
            ValueError,
            where,
            path,
            f"the sparse axes {dims} hold 2**31 or more entries; keys are int32, so split the parameter",
        )
    if emits and max(dims) > jnp.iinfo(declared.index_dtype).max:
        raise param_error(
            TypeError,
            where,
            path,
            f"indices of dtype {declared.index_dtype} cannot mark padding for sparse axes {dims} (the update "
            "keeps the gradient's index dtype and marks padding with the axis sizes); use int32 indices",
        )
    keys, values = replicate(normalise_keys(index, dims)), replicate(values)
    return SparseLeaf(keys, values, param_shape, declared, declared.unique, declared.sorted, declared.unique)


# On GPUs a leaf of at most this many slots is processed in one pass: the chunks' loop has a data-dependent trip
# count, and a GPU copies a while loop's condition to the host each round. On an H100 (jaxlib 0.11.2), lazy Adam's
# XLA-path step at 8,192 Zipf ids (2,048 distinct) over 10^6 x 64 took 0.50 ms in chunks and 0.38 ms in one pass;
# at 2^20 ids the chunks won where most slots were padding (Zipf over 10^6 rows: 1.45 against 1.73 ms).
GPU_ONE_PASS_SLOTS = 1 << 16


def _chunk_size(k: int) -> int:
    """Slots per chunk: up to 8 chunks of at least 512 slots, or one chunk."""
    for n in (8, 4, 2):
        if k % n == 0 and k // n >= 512:
            return k // n
    return k


def for_each_chunk(leaf: SparseLeaf, fn: Callable[[Any, SparseLeaf, Any], Any], carry: Any) -> Any:
    """Folds ``fn(start, chunk, carry)`` over the chunks of ``leaf`` up to its last valid slot.

    Gathers and scatters cost per slot, padding included, so a leaf whose
    valid entries are packed first (as coalescing leaves them) is processed
    only as far as it holds rows: a batch of 8,192 ids with 2,400 distinct
    rows touches 3 chunks of 1,024. The trip count is data-dependent but the
    shapes are not, so nothing retraces. On CUDA and ROCm GPUs a leaf of up to
    :data:`GPU_ONE_PASS_SLOTS` slots is processed in one pass (chosen when the
    step is lowered for its platform).
    """
    k = leaf.keys.shape[0]
    size = _chunk_size(k)
    if size == k:
        return fn(0, leaf, carry)

    def chunked() -> Any:
        used = jnp.max(jnp.where(leaf.valid(), jnp.arange(1, k + 1, dtype=jnp.int32), 0))

        def body(c: jax.Array, carry: Any) -> Any:
            start = c * size
            chunk = leaf._replace(
                keys=jax.lax.dynamic_slice_in_dim(leaf.keys, start, size),
                values=jax.lax.dynamic_slice_in_dim(leaf.values, start, size),
            )
            return fn(start, chunk, carry)

        return jax.lax.fori_loop(0, (used + size - 1) // size, body, carry)

    if k > GPU_ONE_PASS_SLOTS:
        return chunked()

    def one_pass() -> Any:
        return fn(0, leaf, carry)

    return jax.lax.platform_dependent(cuda=one_pass, rocm=one_pass, default=chunked)
