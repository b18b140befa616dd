"""Routing ids and sparse entries to the devices that own their rows, inside ``jax.shard_map``.

A table split by rows over a mesh axis of ``n`` devices puts rows
``[i * num_rows / n, (i + 1) * num_rows / n)`` on device ``i``. The functions
here run on each device, inside ``shard_map`` over that axis, and take the
axis name, its size ``n`` and the *route*:

- ``"replicated"``: every device has every id and keeps the ones it owns (a
  lookup is one all-reduce of the rows, a gradient needs no communication);
- ``"all_gather"``: ids split over the axis; every device receives every id,
  as rows forward and as gradients backward, every row looked up;
- ``"all_to_all"``: each device sums its duplicates, buckets its distinct ids
  by owner with ``capacity`` slots per owner and exchanges buckets. Ids over
  capacity go in a second round of buckets, run only in a step where some
  bucket overflows; ids over twice the capacity send the whole step through
  the all-gather route (the step's :func:`decide` chooses, the same on every
  device): no id is dropped.

Between routed calls a table's sparse leaf is in global ids and
*owner-aligned*: device ``i``'s block of its entries holds only rows that
device ``i`` owns (or padding). :func:`to_local` and :func:`to_global` convert
such a block to and from ids local to the device's rows.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp

from optax_sparse_adam._coalesce import coalesce_unless_known, distinct_ids
from optax_sparse_adam._indexed_rows import IndexedRows, bcoo_like, is_bcoo
from optax_sparse_adam._row_ops import scatter_rows, take_rows
from optax_sparse_adam._sparse_leaf import to_sparse_leaf
from optax_sparse_adam._tree import broadcast_rows, is_leaf

__all__ = [
    "Route",
    "RoutingInfo",
    "all_gather_rows",
    "block",
    "coalesced",
    "decide",
    "keys_values",
    "plan",
    "rebuild",
    "route_entries",
    "to_global",
    "to_local",
]

Route = Literal["replicated", "all_gather", "all_to_all"]


class RoutingInfo(NamedTuple):
    """What routing did in one step (the same on every device).

    With ``routing="all_to_all"`` each device sends its distinct ids to their
    owners in buckets of ``capacity`` slots per owner. Ids that do not fit go
    in a second round of buckets, which runs only in a step that needs it;
    ids that do not fit two rounds send the whole step through the all-gather
    route. Every route is exact: no id is ever dropped.

    Attributes:
      overflow: int32, the number of distinct ids (summed over devices and
        tables) that did not fit their owner's bucket of ``capacity`` in the
        first round. Size ``capacity`` so that it stays zero
        (:meth:`RowSharding.suggest_capacity`).
      fallback: bool, whether this step took the all-gather route (some
        bucket held more than twice ``capacity`` ids).
      second_round: bool, whether this step ran a second round of buckets
        and not the all-gather route. (In a step that takes the all-gather
        route, a table whose ids two rounds always fit, fewer ids than twice
        ``capacity`` a device, still runs its own second round.)
    """

    overflow: jax.Array
    fallback: jax.Array
    second_round: jax.Array


def _vary(x: jax.Array, axis: str) -> jax.Array:
    """``x`` marked as varying over ``axis`` (a no-op when it already is, or without type checking)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    varying = getattr(mat, "varying", getattr(aval, "vma", None))
    if varying is None or axis in varying:
        return x
    return jax.lax.pcast(x, axis, to="varying")


def _varies(x: jax.Array, axis: str) -> bool:
    """Whether ``x`` may differ between the devices of ``axis`` (inside ``shard_map``)."""
    probe = jax.typeof(jax.lax.axis_index(axis))
    mat = getattr(probe, "manual_axis_type", None)
    tracked: Any = getattr(mat, "varying", getattr(probe, "vma", frozenset()))
    if axis not in tracked:  # shard_map(check_vma=False): no way to tell, so assume it varies
        return True
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    return axis in getattr(mat, "varying", getattr(aval, "vma", frozenset()))


def all_gather_rows(tree: Any, axis_name: str) -> Any:
    """The sum of a gradient tree over a data-parallel axis, sparse leaves included.

    ``jax.lax.psum`` over an :class:`IndexedRows` or a BCOO adds the indices
    of the devices' gradients as well as their values, which silently
    addresses other rows. The sum of sparse gradients is their
    concatenation: this all-gathers each sparse leaf's indices and values
    (capacity times the axis size; duplicates are summed by the optimizer)
    and ``psum``-s each dense leaf. Use it inside ``jax.shard_map`` (or any
    context where ``axis_name`` is bound).

    Inside ``shard_map`` (with its default type checking), the gradient of a
    replicated parameter taken there already arrives summed over the axis;
    summing again would multiply it by the device count. A leaf that does not
    vary over ``axis_name`` is therefore left as it is: it is the same on
    every device and already the total.

    Args:
      tree: A gradient tree; leaves may be arrays, sparse leaves or ``None``.
      axis_name: The data-parallel axis to sum over.

    Returns:
      The tree with each leaf summed over ``axis_name``; a sparse leaf's
      capacity grows by the factor of the axis size.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import optax_sparse_adam as osa
      >>> def per_device(ids):
      ...   g = osa.IndexedRows(ids, jnp.ones((1, 2), jnp.float32), 4)
      ...   return osa.all_gather_rows(g, "batch").todense()
      >>> mesh = jax.make_mesh((1,), ("batch",), devices=jax.devices()[:1])
      >>> ids = jax.device_put(jnp.array([2]), jax.NamedSharding(mesh, jax.P("batch")))
      >>> jax.shard_map(per_device, mesh=mesh, in_specs=jax.P("batch"), out_specs=jax.P())(ids)
      Array([[0., 0.],
             [0., 0.],
             [1., 1.],
             [0., 0.]], dtype=float32)
    """

    def gather(x: jax.Array) -> jax.Array:  # the same on every device afterwards, as a psum's result
        return jax.lax.all_gather(x, axis_name, axis=0, tiled=True, to="invarying")

    def one(leaf: Any) -> Any:
        if leaf is None:
            return None
        if isinstance(leaf, IndexedRows):
            if not (_varies(leaf.indices, axis_name) or _varies(leaf.values, axis_name)):
                return leaf
            ids, values = _vary(leaf.indices, axis_name), _vary(leaf.values, axis_name)
            return IndexedRows(gather(ids), gather(values), leaf.num_rows)
        if is_bcoo(leaf):
            if leaf.n_batch:
                raise ValueError(
                    f"all_gather_rows: BCOO with batch dimensions is not supported (n_batch={leaf.n_batch})"
                )
            if not (_varies(leaf.indices, axis_name) or _varies(leaf.data, axis_name)):
                return leaf
            data, indices = _vary(leaf.data, axis_name), _vary(leaf.indices, axis_name)
            return bcoo_like((gather(data), gather(indices)), shape=leaf.shape, owner_axis=None)
        x = jnp.asarray(leaf)
        return jax.lax.psum(x, axis_name) if _varies(x, axis_name) else x

    return jax.tree.map(one, tree, is_leaf=is_leaf)


# ------------------------------------------------------------------------ sparse leaves as (keys, values)


def keys_values(leaf: Any, shape: tuple[int, ...], path: Any, where: str) -> tuple[jax.Array, jax.Array]:
    """``(k, s)`` int32 keys (padding: ``shape[:s]``) and values of a sparse leaf, validated."""
    sp = to_sparse_leaf(leaf, shape, path, where)
    return sp.keys, sp.values


def coalesced(leaf: Any, shape: tuple[int, ...], path: Any, where: str) -> tuple[jax.Array, jax.Array]:
    """As :func:`keys_values`, duplicates summed into the leading slots: also those of a leaf distinct only by the
    user's ``unique_indices`` promise (the buckets of a table with fewer rows per device than the capacity hold
    one entry per row, and a broken promise's duplicates would overflow them unsent)."""
    sp = coalesce_unless_known(to_sparse_leaf(leaf, shape, path, where))
    return sp.keys, sp.values


def rebuild(template: Any, keys: jax.Array, values: jax.Array, shape: tuple[int, ...], owner_axis: str | None) -> Any:
    """A sparse leaf of ``template``'s kind and flags with these keys (padding: ``shape[:s]`` or ``-1``), marked
    as routed over ``owner_axis`` (``None``: not routed, as a block's local leaf)."""
    if isinstance(template, IndexedRows):
        ids = jnp.where(keys[:, 0] < shape[0], keys[:, 0], -1)
        return IndexedRows(ids, values, shape[0], unique_indices=template.unique_indices, owner_axis=owner_axis)
    return bcoo_like((values, keys), shape=shape, owner_axis=owner_axis, unique_indices=template.unique_indices)


def _with_first_key(keys: jax.Array, first: jax.Array) -> jax.Array:
    """``keys`` with its first column replaced by ``first``."""
    return jnp.concatenate([first[:, None], keys[:, 1:]], axis=1)


# ------------------------------------------------------------------------ global <-> local block


def block(num_rows: int, axis: str, n: int) -> tuple[int, jax.Array]:
    """Rows per device and the first row of this device's block."""
    shard = num_rows // n
    return shard, jax.lax.axis_index(axis).astype(jnp.int32) * shard


def to_local(leaf: Any, axis: str, n: int, path: Any, where: str) -> Any:
    """An owner-aligned global leaf (this device's entries) as a leaf of this device's block."""
    shape = tuple(leaf.shape)
    shard, lo = block(shape[0], axis, n)
    keys, values = keys_values(leaf, shape, path, where)
    local = keys[:, 0] - lo
    owned = (keys[:, 0] < shape[0]) & (local >= 0) & (local < shard)
    local_shape = (shard, *shape[1:])
    keys = jnp.where(owned[:, None], _with_first_key(keys, local), jnp.asarray(local_shape[: keys.shape[1]]))
    return rebuild(leaf, keys, values, local_shape, None)


def to_global(leaf: Any, template: Any, axis: str, n: int, path: Any, where: str) -> Any:
    """A leaf of this device's block as an owner-aligned global leaf of ``template``'s type and shape."""
    shape = tuple(template.shape)
    shard, lo = block(shape[0], axis, n)
    keys, values = keys_values(leaf, (shard, *shape[1:]), path, where)
    owned = keys[:, 0] < shard
    keys = jnp.where(owned[:, None], _with_first_key(keys, keys[:, 0] + lo), jnp.asarray(shape[: keys.shape[1]]))
    return rebuild(template, keys, values, shape, axis)


# ----------------------------------------------------------------------------------- routing


def _capacity(k: int, n: int, capacity: int | None) -> int:
    """Slots per bucket; by default the even share ``m = k / n`` plus four Poisson deviations, plus 4."""
    if capacity is not None:
        return capacity
    m = k / n
    return min(k, math.ceil(m + 4 * math.sqrt(m) + 4))


def _buckets(
    ids: jax.Array, valid: jax.Array, num_rows: int, n: int, capacity: int
) -> tuple[tuple[jax.Array, jax.Array], jax.Array, jax.Array]:
    """Each entry's slot in the ``(n * capacity)`` send buffer of each of the two rounds, grouped by owner
    (``n * capacity``: not sent in that round).

    An owner's first ``capacity`` entries go in the first round, its next ``capacity`` in the second. Returns the
    two rounds' slots and this device's numbers of valid entries that did not fit the first round, and the
    second.
    """
    owner = jnp.where(valid, ids // (num_rows // n), n)
    onehot = (owner[:, None] == jnp.arange(n, dtype=owner.dtype)[None, :]).astype(jnp.int32)
    rank = jnp.sum(jnp.cumsum(onehot, axis=0) * onehot, axis=1) - 1  # position within the owner's bucket
    first = valid & (rank < capacity)
    second = valid & (rank >= capacity) & (rank < 2 * capacity)
    dest = (
        jnp.where(first, owner * capacity + rank, n * capacity),
        jnp.where(second, owner * capacity + rank - capacity, n * capacity),
    )
    over = (jnp.sum(valid & ~first, dtype=jnp.int32), jnp.sum(valid & ~first & ~second, dtype=jnp.int32))
    return dest, *over


def _pairs(x: jax.Array) -> jax.Array:
    """A complex ``x`` as its real and imaginary parts along a new last axis; any other ``x`` as it is."""
    return jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1) if jnp.iscomplexobj(x) else x


def _unpaired(x: jax.Array, dtype: Any) -> jax.Array:
    """The inverse of :func:`_pairs` for an array of ``dtype``."""
    return jax.lax.complex(x[..., 0], x[..., 1]) if jnp.issubdtype(dtype, jnp.complexfloating) else x


def _split(joined: jax.Array, widths: list[int]) -> list[jax.Array]:
    """The pieces of ``joined`` along its axis 1, of these widths (the arrays concatenated into it)."""
    return jnp.split(joined, list(itertools.accumulate(widths))[:-1], axis=1)


def _bytes(x: jax.Array) -> jax.Array:
    """``x``'s bytes, ``uint8`` of shape ``(*x.shape, bytes per element)`` (a complex number as its real and
    imaginary parts, a bool as a byte)."""
    shape = x.shape
    x = _pairs(x)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    per = jnp.dtype(x.dtype).itemsize * (x.ndim - len(shape) + 1)
    return jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(*shape, per)


def _from_bytes(b: jax.Array, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """The array of this shape and dtype whose bytes (:func:`_bytes`) ``b`` holds."""
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return _unpaired(_from_bytes(b, (*shape, 2), jnp.finfo(dtype).dtype), dtype)
    if dtype == jnp.bool_:
        return _from_bytes(b, shape, jnp.uint8).astype(jnp.bool_)
    size = dtype.itemsize
    return jax.lax.bitcast_convert_type(b.reshape(*shape, size) if size > 1 else b.reshape(shape), dtype)


def _gather(xs: list[jax.Array], axis: str, n: int) -> list[jax.Array]:
    """Every device's ``xs``, on every device (each along its first axis, as ``jax.lax.all_gather(x, axis,
    tiled=True)`` gathers it), in one all-gather of their bytes (not differentiable): XLA:CPU keys every all-gather of
    a program alike, and two in flight at once could meet in one rendezvous."""
    flat = [_bytes(_vary(x, axis)).reshape(-1) for x in xs]
    got = jax.lax.all_gather(jnp.concatenate(flat), axis, axis=0, tiled=True).reshape(n, -1)
    return [
        _from_bytes(b, (n * x.shape[0], *x.shape[1:]), x.dtype)
        for x, b in zip(xs, _split(got, [f.shape[0] for f in flat]), strict=True)
    ]


def _gathered_entries(
    gradients: list[tuple[jax.Array, jax.Array, tuple[int, ...]]], axis: str, n: int
) -> list[tuple[jax.Array, jax.Array]]:
    """Every device's entries of each gradient ``(keys, values, shape)``, on every device, those of rows this device
    owns kept (one all-gather for all)."""
    got = _gather([x for k, v, _ in gradients for x in (k, v)], axis, n)
    return [_keep_owned(got[2 * i], got[2 * i + 1], s, axis, n) for i, (_, _, s) in enumerate(gradients)]


def _scatter_sum(xs: list[jax.Array], axis: str, n: int) -> list[jax.Array]:
    """Each of ``xs`` (``(n * k, ...)``, floats) summed over the devices of ``axis`` and scattered along its first
    axis, as ``jax.lax.psum_scatter(x, axis, scatter_dimension=0, tiled=True)`` does, in one reduce-scatter
    (differentiable). The sums are in float32 (float64 where a table is), whatever the tables beside: 16-bit floats
    are summed in float32 and rounded once, and a complex table's real and imaginary parts alike."""
    parts = [_pairs(x) for x in xs]
    wide = jnp.float64 if any(jnp.dtype(x.dtype).itemsize == 8 for x in parts) else jnp.float32
    flat = [x.astype(wide).reshape(n, -1) for x in parts]
    got = jax.lax.psum_scatter(jnp.concatenate(flat, axis=1), axis, scatter_dimension=0, tiled=True)
    return [
        _unpaired(summed.reshape(part.shape[0] // n, *part.shape[1:]).astype(part.dtype), x.dtype)
        for x, part, summed in zip(xs, parts, _split(got, [f.shape[1] for f in flat]), strict=True)
    ]


def _keep_owned(
    keys: jax.Array, values: jax.Array, shape: tuple[int, ...], axis: str, n: int
) -> tuple[jax.Array, jax.Array]:
    """Entries of rows this device owns; the others become padding (global keys)."""
    shard, lo = block(shape[0], axis, n)
    owned = (keys[:, 0] >= lo) & (keys[:, 0] < lo + shard)
    pad = jnp.asarray(shape[: keys.shape[1]], jnp.int32)
    zero = jnp.zeros((), values.dtype)
    return jnp.where(owned[:, None], keys, pad), jnp.where(broadcast_rows(owned, values.ndim), values, zero)


def decide(overflows: list[tuple[jax.Array, jax.Array]], axis: str, route: Route) -> RoutingInfo:
    """The step's route from each table's ``(first-round, second-round)`` overflow on this device."""
    zero = jnp.zeros((), jnp.int32)
    first = sum((o[0] for o in overflows), zero)
    second = sum((o[1] for o in overflows), zero)
    if route == "all_to_all":
        first, second = jax.lax.psum(first, axis), jax.lax.psum(second, axis)
    return RoutingInfo(first, second > 0, (first > 0) & (second == 0))


def _no_overflow() -> tuple[jax.Array, jax.Array]:
    return jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32)


class _Bucketed:
    """A device's ``k`` distinct ids (or entries) of a table on the all-to-all route: ``cap`` slots per owner and
    round, a second round where the first can overflow, the all-gather route standing by where two may not fit;
    ``size`` rows of results on every route. ``limit``: the most distinct ids one owner holds (its rows), which
    also bounds a bucket: a table with fewer rows per owner than the capacity gets buckets of its rows, and
    never overflows."""

    def __init__(self, k: int, axis: str, n: int, capacity: int | None, limit: int) -> None:
        self.k, self.axis, self.n = k, axis, n
        self.cap = cap = max(1, min(_capacity(k, n, capacity), limit))
        most = min(k, limit)  # the most ids one owner's bucket can be given
        self.rounds = 1 if cap >= most else 2
        self.size = max(n * k, self.rounds * n * cap)
        self.fallback = 2 * cap < most


class _Entries(_Bucketed):
    """One sparse gradient's entries on the all-to-all route: bucketed by owner, in two rounds."""

    def __init__(
        self, keys: jax.Array, values: jax.Array, shape: tuple[int, ...], axis: str, n: int, capacity: int | None
    ) -> None:
        # An owner's distinct keys: its rows, times the other indexed dimensions' sizes.
        limit = shape[0] // n * math.prod(shape[1 : keys.shape[1]])
        super().__init__(keys.shape[0], axis, n, capacity, limit)
        self.keys, self.values, self.shape = keys, values, shape
        self.pad = jnp.asarray(shape[: keys.shape[1]], jnp.int32)
        self.dests, *overflow = _buckets(keys[:, 0], keys[:, 0] < shape[0], shape[0], n, self.cap)
        self.overflow = (overflow[0], overflow[1])

    def empty(self) -> tuple[jax.Array, jax.Array]:
        """A round's buffers with no entry: padding keys, zero values."""
        width = self.n * self.cap
        keys = jnp.broadcast_to(self.pad, (width, self.keys.shape[1]))
        return keys, jnp.zeros((width, *self.values.shape[1:]), self.values.dtype)

    def sent(self, round_: int) -> list[jax.Array]:
        """A round's send buffers, keys and values."""
        return [
            scatter_rows(x, self.dests[round_], y, "set")
            for x, y in zip(self.empty(), (self.keys, self.values), strict=True)
        ]

    def nothing(self) -> list[jax.Array]:  # what a round with no entry in any bucket receives
        return [_vary(x, self.axis) for x in self.empty()]

    def padded(self, keys: jax.Array, values: jax.Array) -> tuple[jax.Array, jax.Array]:
        extra = self.size - keys.shape[0]
        keys = jnp.concatenate([keys, jnp.broadcast_to(self.pad, (extra, keys.shape[1]))])
        return keys, jnp.concatenate([values, jnp.zeros((extra, *values.shape[1:]), values.dtype)])


def route_entries(
    gradients: list[tuple[jax.Array, jax.Array, tuple[int, ...]]], axis: str, n: int, route: Route, capacity: int | None
) -> tuple[list[tuple[jax.Array, jax.Array]], Callable[[RoutingInfo], list[tuple[jax.Array, jax.Array]]]]:
    """Routes sparse gradients' entries, ``(keys, values, shape)`` each, to their owners.

    Returns each gradient's overflows on this device (first and second round) and ``finish(decision)``, which gives
    each one's owner-aligned ``(keys, values)`` once the overflows have decided the step's route (:func:`decide`).
    The gradients share each collective, keys and values alike (as bytes): on the all-to-all route one all-to-all
    in a step (both rounds in it where a second runs), on the all-gather route one all-gather.
    """
    if not gradients:
        return [], lambda _: []
    none = [_no_overflow() for _ in gradients]
    if route == "replicated":
        return none, lambda _: [_keep_owned(k, v, s, axis, n) for k, v, s in gradients]
    if route == "all_gather":
        return none, lambda _: _gathered_entries(gradients, axis, n)
    entries = [_Entries(k, v, s, axis, n, capacity) for k, v, s in gradients]
    two = [t for t, e in enumerate(entries) if e.rounds == 2]

    def exchange(decision: RoutingInfo, tabs: list[int]) -> dict[int, tuple[jax.Array, jax.Array]]:
        # On any first-round overflow: a gradient with no all-gather branch (two rounds always fit it) runs its second
        # round also in a step that another sends down the all-gather route.
        received = _rounds(
            decision, tabs, two, lambda t, r: entries[t].sent(r), lambda t: entries[t].nothing(), axis, n
        )
        return {t: entries[t].padded(*(jnp.concatenate(part) for part in zip(*received[t], strict=True))) for t in tabs}

    standby = [t for t, e in enumerate(entries) if e.fallback]  # gradients the all-gather route takes in its steps

    def gathered(tabs: list[int]) -> dict[int, tuple[jax.Array, jax.Array]]:
        got = _gathered_entries([gradients[t] for t in tabs], axis, n)
        return {t: entries[t].padded(*x) for t, x in zip(tabs, got, strict=True)}

    def finish(decision: RoutingInfo) -> list[tuple[jax.Array, jax.Array]]:
        return _by_route(decision, len(entries), standby, lambda tabs: exchange(decision, tabs), gathered)

    return [e.overflow for e in entries], finish


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _exchange(xs: Any, axis: str, n: int) -> Any:
    """The arrays of the tree ``xs``, each ``(n * cap, ...)`` in ``n`` blocks by destination, exchanged between the
    devices of ``axis`` as :func:`jax.lax.all_to_all` exchanges one, all in one all-to-all of their bytes: one
    collective, not one per array (XLA:CPU keys every all-to-all of a program alike, and two in flight at once could
    meet in one rendezvous), and each array's own bytes, whatever its dtype and the others'. Differentiable: the
    gradient is the same exchange of the cotangents."""
    leaves, treedef = jax.tree.flatten(xs)
    flat = [_bytes(x).reshape(n, -1) for x in leaves]
    got = jax.lax.all_to_all(jnp.concatenate(flat, axis=1), axis, 0, 0)
    return jax.tree.unflatten(
        treedef,
        [
            _from_bytes(b, x.shape, x.dtype)
            for x, b in zip(leaves, _split(got, [f.shape[1] for f in flat]), strict=True)
        ],
    )


def _exchange_forward(xs: Any, axis: str, n: int) -> tuple[Any, None]:
    return _exchange(xs, axis, n), None


def _exchange_backward(axis: str, n: int, _: None, cotangents: Any) -> tuple[Any]:
    return (_exchange(cotangents, axis, n),)  # a permutation of blocks: its transpose is itself


_exchange.defvjp(_exchange_forward, _exchange_backward)


def _by_route(
    decision: RoutingInfo,
    count: int,
    standby: list[int],
    buckets: Callable[[list[int]], dict[int, Any]],
    gathered: Callable[[list[int]], dict[int, Any]],
) -> list[Any]:
    """The result of each of ``count`` tables, ``buckets(tables)`` (by table) the all-to-all route's: in a step that
    takes the all-gather route, ``gathered(tables)`` for the tables of ``standby`` (those two rounds may not fit)
    and the others' buckets as ever; one ``lax.cond`` for all."""
    everyone = list(range(count))
    rest = [t for t in everyone if t not in standby]

    def in_buckets() -> list[Any]:
        out = buckets(everyone)
        return [out[t] for t in everyone]

    def fallen_back() -> list[Any]:
        out = {**(buckets(rest) if rest else {}), **gathered(standby)}
        return [out[t] for t in everyone]

    if not count:
        return []
    return jax.lax.cond(decision.fallback, fallen_back, in_buckets) if standby else in_buckets()


def _rounds(
    decision: RoutingInfo,
    tabs: list[int],
    two: list[int],
    sent: Callable[[int, int], Any],
    nothing: Callable[[int], Any],
    axis: str,
    n: int,
) -> dict[int, list[Any]]:
    """What each table of ``tabs`` receives in each of its rounds, ``sent(t, round)`` its send buffers (a tree of
    arrays) and ``nothing(t)`` what a round with nothing in any bucket receives: one :func:`_exchange` of the first
    round's buffers, or in a step that runs the second round (those of ``two`` that ``tabs`` holds), one of both
    rounds' buffers. One exchange whichever: none left to run beside another."""
    seconds = [t for t in two if t in tabs]
    firsts = [sent(t, 0) for t in tabs]
    if not seconds:
        return {t: [x] for t, x in zip(tabs, _exchange(firsts, axis, n), strict=True)}
    lasts = [sent(t, 1) for t in seconds]
    got_firsts, got_lasts = jax.lax.cond(
        decision.overflow > 0,
        lambda: _exchange((firsts, lasts), axis, n),
        lambda: (_exchange(firsts, axis, n), [nothing(t) for t in seconds]),
    )
    out = {t: [x] for t, x in zip(tabs, got_firsts, strict=True)}
    for t, x in zip(seconds, got_lasts, strict=True):
        out[t].append(x)
    return out


def _pad_to(x: jax.Array, n_out: int, fill: int) -> jax.Array:
    return jnp.concatenate([x, jnp.full((n_out - x.shape[0],), fill, x.dtype)])


def _localize(uids: jax.Array, num_rows: int, axis: str, n: int) -> jax.Array:
    """Global ids as rows of this device's block (``num_rows / n``: not this device's)."""
    shard, lo = block(num_rows, axis, n)
    local = uids - lo
    return jnp.where((uids < num_rows) & (local >= 0) & (local < shard), local, shard)


class _Lookup(_Bucketed):
    """One table's lookup on the all-to-all route: its distinct ids bucketed by owner, in two rounds."""

    def __init__(self, ids: jax.Array, num_rows: int, axis: str, n: int, capacity: int | None) -> None:
        super().__init__(ids.shape[0], axis, n, capacity, num_rows // n)
        cap = self.cap
        self.ids, self.num_rows = ids, num_rows
        self.shard = num_rows // n
        self.uids, self.inverse = distinct_ids(ids, num_rows)
        self.dests, *overflow = _buckets(self.uids, self.uids < num_rows, num_rows, n, cap)
        self.overflow = (overflow[0], overflow[1])
        # Each distinct id's slot among the rows the rounds bring back: the first round's n * cap, then the second's.
        first, second = self.dests
        self.slot = jnp.where(
            first < n * cap, first, jnp.where(second < n * cap, n * cap + second, self.rounds * n * cap)
        )

    def empty(self) -> jax.Array:
        """A round's buffer with no id (``shard`` in every slot)."""
        return jnp.full((self.n * self.cap,), self.shard, jnp.int32)

    def asked(self, round_: int) -> jax.Array:
        """A round's send buffer: the id in each bucket slot, local to its owner (``shard``: none)."""
        owner_lo = (self.uids // self.shard) * self.shard
        return scatter_rows(self.empty(), self.dests[round_], self.uids - owner_lo, "set")

    def no_ids(self) -> jax.Array:  # what a round with no id in any bucket receives
        return _vary(self.empty(), self.axis)

    def bucket_plan(self, received: list[jax.Array]) -> tuple[jax.Array, jax.Array]:
        """``(wanted, select)`` from the ids the rounds received: the rows to read and send back, and where this
        device's ids find theirs among the rows the rounds bring back."""
        n, k = self.n, self.k
        select = _pad_to(take_rows(self.slot, self.inverse), n * k, self.rounds * n * self.cap)
        return _pad_to(jnp.concatenate(received), self.size, self.shard), select

    def sent_back(self, rows: jax.Array, round_: int) -> jax.Array:
        """The rows read for a round's ids, to send back."""
        width = self.n * self.cap
        return rows[round_ * width : (round_ + 1) * width]


def _gathered_plans(tables: list[tuple[jax.Array, int]], axis: str, n: int) -> list[tuple[jax.Array, jax.Array]]:
    """The all-gather route's ``(wanted, select)`` of each table ``(ids, num_rows)``: every device's distinct ids,
    and where this device's are among them (one all-gather for all)."""
    out = []
    for ids, (_, num_rows) in zip(_gather([ids for ids, _ in tables], axis, n), tables, strict=True):
        uids, inverse = distinct_ids(ids, num_rows)
        out.append((_localize(uids, num_rows, axis, n), inverse))
    return out


def _gathered_exchange(rows: list[jax.Array], select: list[jax.Array], axis: str, n: int) -> list[jax.Array]:
    """The all-gather route's rows: each table's rows read for every device's ids, summed to their devices."""
    return _scatter_sum([take_rows(r, s) for r, s in zip(rows, select, strict=True)], axis, n)


def plan(
    tables: list[tuple[jax.Array, int]], axis: str, n: int, route: Route, capacity: int | None
) -> tuple[list[tuple[jax.Array, jax.Array]], Callable[[RoutingInfo], Any]]:
    """Routes a device's flat ids for the lookups of several tables, ``(ids, num_rows)`` each (the fast path).

    Returns each table's overflows on this device (first and second round) and ``finish(decision)``, which gives
    ``(exchange, wanted, positions)`` once the overflows have decided the step's route (:func:`decide`):
    ``wanted[t]`` are the local rows of table ``t`` this device must read (``num_rows / n`` for none);
    ``exchange`` maps the list of them, read, to the rows of this device's ids of each table (differentiably);
    ``positions[t]`` index those rows as the ids indexed the table. The tables share each collective: on the
    all-to-all route, in a step, one all-to-all of the ids asked for and one of the rows sent back (their bytes,
    whatever the tables' widths and dtypes; both rounds in each where a second runs), and one of the gradients
    back; on the all-gather route one all-gather of the ids and one reduce-scatter of the rows.
    """
    if not tables:
        return [], lambda _: ((lambda rows: []), [], [])
    mines = [jnp.arange(ids.shape[0], dtype=jnp.int32) for ids, _ in tables]
    no_overflow = [_no_overflow() for _ in tables]
    if route == "replicated":  # every device has every id: read mine, all-reduce
        distinct = [distinct_ids(ids, num_rows) for ids, num_rows in tables]
        wanted = [_localize(u, num_rows, axis, n) for (u, _), (_, num_rows) in zip(distinct, tables, strict=True)]

        def psums(rows: list[jax.Array]) -> list[jax.Array]:
            return [jax.lax.psum(r, axis) for r in rows]

        return no_overflow, lambda _: (psums, wanted, [inverse for _, inverse in distinct])

    if route == "all_gather":
        gathered = _gathered_plans(tables, axis, n)

        def scatters(rows: list[jax.Array]) -> list[jax.Array]:
            return _gathered_exchange(rows, [s for _, s in gathered], axis, n)

        return no_overflow, lambda _: (scatters, [w for w, _ in gathered], mines)

    lookups = [_Lookup(ids, num_rows, axis, n, capacity) for ids, num_rows in tables]
    two = [t for t, lk in enumerate(lookups) if lk.rounds == 2]

    def bucket_plans(decision: RoutingInfo, tabs: list[int]) -> dict[int, tuple[jax.Array, jax.Array]]:
        received = _rounds(
            decision, tabs, two, lambda t, r: lookups[t].asked(r), lambda t: lookups[t].no_ids(), axis, n
        )
        return {t: lookups[t].bucket_plan(received[t]) for t in tabs}

    def bucket_exchange(
        rows: dict[int, jax.Array], select: dict[int, jax.Array], decision: RoutingInfo
    ) -> dict[int, jax.Array]:
        def nothing(t: int) -> jax.Array:
            return _vary(jnp.zeros_like(lookups[t].sent_back(rows[t], 1)), axis)

        back = _rounds(decision, list(rows), two, lambda t, r: lookups[t].sent_back(rows[t], r), nothing, axis, n)
        return {t: take_rows(jnp.concatenate(back[t]), select[t][: lookups[t].k]) for t in rows}

    standby = [t for t, lk in enumerate(lookups) if lk.fallback]  # tables the all-gather route takes in its steps

    def gathered_plans(tabs: list[int]) -> dict[int, tuple[jax.Array, jax.Array]]:
        got = _gathered_plans([tables[t] for t in tabs], axis, n)
        return {t: (_pad_to(w, lookups[t].size, lookups[t].shard), s) for t, (w, s) in zip(tabs, got, strict=True)}

    def finish(decision: RoutingInfo) -> Any:
        plans = _by_route(decision, len(lookups), standby, lambda tabs: bucket_plans(decision, tabs), gathered_plans)
        wanted = [w for w, _ in plans]
        select = dict(enumerate(s for _, s in plans))

        def exchange(rows: list[jax.Array]) -> list[jax.Array]:
            def in_buckets(tabs: list[int]) -> dict[int, jax.Array]:
                return bucket_exchange({t: rows[t] for t in tabs}, select, decision)

            def gathered(tabs: list[int]) -> dict[int, jax.Array]:
                got = _gathered_exchange([rows[t] for t in tabs], [select[t] for t in tabs], axis, n)
                return dict(zip(tabs, got, strict=True))

            return _by_route(decision, len(lookups), standby, in_buckets, gathered)

        return exchange, wanted, mines

    return [lk.overflow for lk in lookups], finish
