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

import math
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp

from optax_sparse_adam._coalesce import coalesce
from optax_sparse_adam._indexed_rows import IndexedRows, is_bcoo
from optax_sparse_adam._row_grad import distinct_ids
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
            return type(leaf)((gather(data), gather(indices)), shape=leaf.shape)
        x = jnp.asarray(leaf)
        return jax.lax.psum(x, axis_name) if _varies(x, axis_name) else x

    return jax.tree.map(one, tree, is_leaf=is_leaf)


# ------------------------------------------------------------------------ sparse leaves as (keys, values)


def keys_values(leaf: Any, shape: tuple[int, ...], path: Any, where: str) -> tuple[jax.Array, jax.Array]:
    """``(k, s)`` int32 keys (padding: ``shape[:s]``) and values of a sparse leaf, validated."""
    sp = to_sparse_leaf(leaf, shape, path, where)
    return sp.keys, sp.values


def coalesced(leaf: Any, shape: tuple[int, ...], path: Any, where: str) -> tuple[jax.Array, jax.Array]:
    """As :func:`keys_values`, duplicates summed into the leading slots."""
    sp = coalesce(to_sparse_leaf(leaf, shape, path, where))
    return sp.keys, sp.values


def rebuild(template: Any, keys: jax.Array, values: jax.Array, shape: tuple[int, ...]) -> Any:
    """A sparse leaf of ``template``'s type and flags with these keys (padding: ``shape[:s]`` or ``-1``)."""
    if isinstance(template, IndexedRows):
        ids = jnp.where(keys[:, 0] < shape[0], keys[:, 0], -1)
        return IndexedRows(ids, values, shape[0], unique_indices=template.unique_indices)
    return type(template)((values, keys), shape=shape, unique_indices=template.unique_indices)


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
    return rebuild(leaf, keys, values, local_shape)


def to_global(leaf: Any, template: Any, axis: str, n: int, path: Any, where: str) -> Any:
    """A leaf of this device's block as an owner-aligned global leaf of ``template``'s type and shape."""
    shape = tuple(template.shape)
    shard, lo = block(shape[0], axis, n)
    keys, values = keys_values(leaf, (shard, *shape[1:]), path, where)
    owned = keys[:, 0] < shard
    keys = jnp.where(owned[:, None], _with_first_key(keys, keys[:, 0] + lo), jnp.asarray(shape[: keys.shape[1]]))
    return rebuild(template, keys, values, shape)


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


def _gather_entries(keys: jax.Array, values: jax.Array, axis: str) -> tuple[jax.Array, jax.Array]:
    """Every device's entries, on every device."""
    keys, values = _vary(keys, axis), _vary(values, axis)
    return (
        jax.lax.all_gather(keys, axis, axis=0, tiled=True),
        jax.lax.all_gather(values, axis, axis=0, tiled=True),
    )


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


def route_entries(
    keys: jax.Array, values: jax.Array, shape: tuple[int, ...], axis: str, n: int, route: Route, capacity: int | None
) -> tuple[tuple[jax.Array, jax.Array], Callable[[RoutingInfo], tuple[jax.Array, jax.Array]]]:
    """Routes a sparse gradient's entries to their owners.

    Returns this device's overflows (first and second round) and ``finish(decision)``, which gives the
    owner-aligned ``(keys, values)`` once every table's overflow has decided the step's route (:func:`decide`).
    """
    if route == "replicated":
        return _no_overflow(), lambda _: _keep_owned(keys, values, shape, axis, n)
    if route == "all_gather":
        return _no_overflow(), lambda _: _keep_owned(*_gather_entries(keys, values, axis), shape, axis, n)
    k = keys.shape[0]
    cap = _capacity(k, n, capacity)
    rounds = 1 if cap >= k else 2  # a second round where the first can overflow
    size = max(n * k, rounds * n * cap)
    pad = jnp.asarray(shape[: keys.shape[1]], jnp.int32)

    def padded(keys: jax.Array, values: jax.Array) -> tuple[jax.Array, jax.Array]:
        extra = size - keys.shape[0]
        keys = jnp.concatenate([keys, jnp.broadcast_to(pad, (extra, keys.shape[1]))])
        return keys, jnp.concatenate([values, jnp.zeros((extra, *values.shape[1:]), values.dtype)])

    valid = keys[:, 0] < shape[0]
    dests, *overflow = _buckets(keys[:, 0], valid, shape[0], n, cap)

    def one_round(dest: jax.Array) -> tuple[jax.Array, jax.Array]:
        send_k = scatter_rows(jnp.broadcast_to(pad, (n * cap, keys.shape[1])), dest, keys, "set")
        send_v = scatter_rows(jnp.zeros((n * cap, *values.shape[1:]), values.dtype), dest, values, "set")
        recv_k = jax.lax.all_to_all(send_k.reshape(n, cap, -1), axis, 0, 0, tiled=False)
        recv_v = jax.lax.all_to_all(send_v.reshape(n, cap, *values.shape[1:]), axis, 0, 0, tiled=False)
        return recv_k.reshape(n * cap, -1), recv_v.reshape(n * cap, *values.shape[1:])

    def skipped_round() -> tuple[jax.Array, jax.Array]:  # what a round with no id in any bucket receives
        keys_in = jnp.broadcast_to(pad, (n * cap, keys.shape[1]))
        return _vary(keys_in, axis), _vary(jnp.zeros((n * cap, *values.shape[1:]), values.dtype), axis)

    def exchange(decision: RoutingInfo) -> tuple[jax.Array, jax.Array]:
        first = one_round(dests[0])
        if rounds == 1:
            return padded(*first)
        # On any first-round overflow: a table with no all-gather branch (two rounds always fit it) runs its second
        # round also in a step that another table sends down the all-gather route.
        second = jax.lax.cond(decision.overflow > 0, lambda: one_round(dests[1]), skipped_round)
        return padded(*(jnp.concatenate(pair) for pair in zip(first, second, strict=True)))

    def gather() -> tuple[jax.Array, jax.Array]:
        return padded(*_keep_owned(*_gather_entries(keys, values, axis), shape, axis, n))

    def finish(decision: RoutingInfo) -> tuple[jax.Array, jax.Array]:
        if 2 * cap >= k:  # two rounds fit whatever the ids
            return exchange(decision)
        return jax.lax.cond(decision.fallback, gather, lambda: exchange(decision))

    return (overflow[0], overflow[1]), finish


def plan(
    ids: jax.Array, num_rows: int, axis: str, n: int, route: Route, capacity: int | None
) -> tuple[tuple[jax.Array, jax.Array], Callable[[RoutingInfo], Any]]:
    """Routes a device's flat ids for a lookup (the fast path).

    Returns this device's overflows (first and second round) and ``finish(decision)``, which gives ``(exchange,
    wanted, positions)`` once every table's overflow has decided the step's route (:func:`decide`): ``wanted``
    are the local rows this device must read (``num_rows / n`` for none); ``exchange`` maps them, read, to the
    rows of this device's ids (differentiably); ``positions`` index those rows as the ids indexed the table.
    """
    k = ids.shape[0]
    shard, lo = block(num_rows, axis, n)

    def localize(uids: jax.Array) -> jax.Array:
        local = uids - lo
        return jnp.where((uids < num_rows) & (local >= 0) & (local < shard), local, shard)

    if route == "replicated":  # every device has every id: read mine, all-reduce
        uids, inverse = distinct_ids(ids, num_rows)
        return _no_overflow(), lambda _: ((lambda rows: jax.lax.psum(rows, axis)), localize(uids), inverse)

    mine = jnp.arange(k, dtype=jnp.int32)

    def gathered_plan() -> tuple[jax.Array, jax.Array]:
        uids, inverse = distinct_ids(jax.lax.all_gather(_vary(ids, axis), axis, tiled=True), num_rows)
        return localize(uids), inverse

    def gathered_exchange(rows: jax.Array, select: jax.Array) -> jax.Array:
        return jax.lax.psum_scatter(take_rows(rows, select), axis, scatter_dimension=0, tiled=True)

    if route == "all_gather":
        wanted, inverse = gathered_plan()
        return _no_overflow(), lambda _: ((lambda rows: gathered_exchange(rows, inverse)), wanted, mine)

    cap = _capacity(k, n, capacity)
    rounds = 1 if cap >= k else 2  # a second round where the first can overflow
    size = max(n * k, rounds * n * cap)
    uids, inverse = distinct_ids(ids, num_rows)
    valid = uids < num_rows
    dests, *overflow = _buckets(uids, valid, num_rows, n, cap)
    # Each distinct id's slot among the rows the rounds bring back: the first round's n * cap, then the second's.
    slot = jnp.where(dests[0] < n * cap, dests[0], jnp.where(dests[1] < n * cap, n * cap + dests[1], rounds * n * cap))

    def pad_to(x: jax.Array, n_out: int, fill: int) -> jax.Array:
        return jnp.concatenate([x, jnp.full((n_out - x.shape[0],), fill, x.dtype)])

    def ask(dest: jax.Array) -> jax.Array:
        owner_lo = (uids // shard) * shard
        asked = scatter_rows(jnp.full((n * cap,), shard, jnp.int32), dest, uids - owner_lo, "set")
        return jax.lax.all_to_all(asked.reshape(n, cap), axis, 0, 0).reshape(n * cap)

    def back(rows: jax.Array) -> jax.Array:
        return jax.lax.all_to_all(rows.reshape(n, cap, *rows.shape[1:]), axis, 0, 0).reshape(rows.shape)

    def bucket_plan(decision: RoutingInfo) -> tuple[jax.Array, jax.Array]:
        asked = ask(dests[0])
        if rounds == 2:
            skip = lambda: _vary(jnp.full((n * cap,), shard, jnp.int32), axis)  # noqa: E731
            asked = jnp.concatenate([asked, jax.lax.cond(decision.overflow > 0, lambda: ask(dests[1]), skip)])
        return pad_to(asked, size, shard), pad_to(take_rows(slot, inverse), n * k, rounds * n * cap)

    def bucket_exchange(rows: jax.Array, select: jax.Array, decision: RoutingInfo) -> jax.Array:
        out = back(rows[: n * cap])
        if rounds == 2:
            second = rows[n * cap : 2 * n * cap]
            skip = lambda: _vary(jnp.zeros_like(second), axis)  # noqa: E731
            out = jnp.concatenate([out, jax.lax.cond(decision.overflow > 0, lambda: back(second), skip)])
        return take_rows(out, select[:k])

    def fallback_plan() -> tuple[jax.Array, jax.Array]:
        wanted, select = gathered_plan()
        return pad_to(wanted, size, shard), select

    def finish(decision: RoutingInfo) -> Any:
        if 2 * cap >= k:  # two rounds fit whatever the ids
            wanted, select = bucket_plan(decision)
            return (lambda rows: bucket_exchange(rows, select, decision)), wanted, mine
        wanted, select = jax.lax.cond(decision.fallback, fallback_plan, lambda: bucket_plan(decision))

        def exchange(rows: jax.Array) -> jax.Array:
            return jax.lax.cond(
                decision.fallback,
                lambda: gathered_exchange(rows, select),
                lambda: bucket_exchange(rows, select, decision),
            )

        return exchange, wanted, mine

    return (overflow[0], overflow[1]), finish
