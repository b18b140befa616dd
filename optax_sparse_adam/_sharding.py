"""Row-sharded tables: :class:`RowSharding` and :func:`all_gather_rows`.

A table too big for one device is split by rows over a mesh axis
(``PartitionSpec(axis, None)``): device ``i`` of ``n`` holds the block of
rows ``[i * num_rows / n, (i + 1) * num_rows / n)`` and its Adam moments. Ids
reach the rows' owners by *routing* inside ``jax.shard_map``; every device
then runs the library's own update on its block, with ids local to it, and
no collective touches a table. Per device and step: communication is
O(ids x width), compute is O(rows it owns in the batch) plus the routing, and
temporaries do not depend on the table's size.

Between the routed calls a table's gradient or update is an ordinary
:class:`IndexedRows` (or BCOO) in global ids, *owner-aligned*: its entries are
sharded over the same axis as the table, and the block on device ``i`` holds
only rows that device ``i`` owns (or padding). It has the usual meaning, so
:func:`~optax_sparse_adam.apply_updates` and ``tx.update`` also take it
under plain ``jit``; :meth:`RowSharding.update` and
:meth:`RowSharding.apply_updates` run them on each block instead.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.experimental import sparse as jsparse
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from optax_sparse_adam._apply import apply_updates as _apply_updates
from optax_sparse_adam._coalesce import coalesce, pack_distinct
from optax_sparse_adam._explicit_sharding import take_rows
from optax_sparse_adam._indexed_rows import IndexedRows, is_sparse
from optax_sparse_adam._keys import padding_key, to_sparse_leaf
from optax_sparse_adam._tree import broadcast_rows, is_leaf, leaves_like, path_str

__all__ = ["RoutingInfo", "RowSharding", "all_gather_rows"]

Routing = Literal["all_gather", "all_to_all"]
_P = PartitionSpec


class RoutingInfo(NamedTuple):
    """What routing did in one step (the same on every device).

    Attributes:
      overflow: int32, the number of distinct ids (summed over devices and
        tables) that did not fit their owner's bucket of ``capacity``. Any
        overflow sends the whole step through the all-gather route, exactly;
        no id is ever dropped. Size ``capacity`` so that it stays zero.
      fallback: bool, whether this step took the all-gather route.
    """

    overflow: jax.Array
    fallback: jax.Array


def _specs_like(tree: Any, spec: PartitionSpec) -> Any:
    """``spec`` for every array of ``tree`` (a sparse leaf keeps its static metadata)."""
    return jax.tree.map(lambda _: spec, tree)


class _Slot:
    """Stands in for the ``i``-th leaf of a tree while ``tables`` selects leaves."""

    def __init__(self, i: int) -> None:
        self.i = i


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
        if isinstance(leaf, jsparse.BCOO):
            if leaf.n_batch:
                raise ValueError(
                    f"all_gather_rows: BCOO with batch dimensions is not supported (n_batch={leaf.n_batch})"
                )
            if not (_varies(leaf.indices, axis_name) or _varies(leaf.data, axis_name)):
                return leaf
            data, indices = _vary(leaf.data, axis_name), _vary(leaf.indices, axis_name)
            return jsparse.BCOO((gather(data), gather(indices)), shape=leaf.shape)
        x = jnp.asarray(leaf)
        return jax.lax.psum(x, axis_name) if _varies(x, axis_name) else x

    return jax.tree.map(one, tree, is_leaf=is_leaf)


def _flatten_up_to(treedef: Any, tree: Any, where: str, what: str) -> list[Any]:
    """``tree``'s subtrees at the leaves of ``treedef`` (the parameters' structure), or an error naming the path."""
    return leaves_like(treedef, treedef.unflatten([None] * treedef.num_leaves), tree, where, what, "parameters")


# ------------------------------------------------------------------------ sparse leaves as (keys, values)


def _keys_values(leaf: Any, shape: tuple[int, ...], path: Any, where: str) -> tuple[jax.Array, jax.Array]:
    """``(k, s)`` int32 keys (padding: ``shape[:s]``) and values of a sparse leaf, validated."""
    sp = to_sparse_leaf(leaf, shape, path, where)
    return sp.keys, sp.values


def _coalesced(leaf: Any, shape: tuple[int, ...], path: Any, where: str) -> tuple[jax.Array, jax.Array]:
    """As :func:`_keys_values`, duplicates summed into the leading slots."""
    sp = coalesce(to_sparse_leaf(leaf, shape, path, where))
    return sp.keys, sp.values


def _distinct(keys: jax.Array, valid: jax.Array, num_rows: int) -> tuple[jax.Array, jax.Array]:
    """Distinct ids of ``keys`` (``(k,)``) packed first (``num_rows`` after them), and each id's slot."""
    k = keys.shape[0]
    target, packed = pack_distinct(keys[:, None], valid, padding_key((num_rows,), 1))
    # A padding id reads the last slot, which is padding whenever there is a padding id.
    return packed[:, 0], jnp.where(valid, target, k - 1)


def _rebuild(template: Any, keys: jax.Array, values: jax.Array, shape: tuple[int, ...]) -> Any:
    """A sparse leaf of ``template``'s type and flags with these keys (padding: ``shape[:s]`` or ``-1``)."""
    if isinstance(template, IndexedRows):
        ids = jnp.where(keys[:, 0] < shape[0], keys[:, 0], -1)
        return IndexedRows(ids, values, shape[0], unique_indices=template.unique_indices)
    return jsparse.BCOO((values, keys), shape=shape, unique_indices=template.unique_indices)


# ------------------------------------------------------------------------------------------- the class


@dataclasses.dataclass(frozen=True)
class RowSharding:
    """Tables split by rows over a mesh axis, and how a batch's ids reach their rows' owners.

    The tables that ``tables`` selects live as ``NamedSharding(mesh,
    P(axis, None, ...))``: device ``i`` of the axis's ``n`` owns rows
    ``[i * num_rows / n, (i + 1) * num_rows / n)`` (``num_rows`` must be a
    multiple of ``n``). Every other parameter is replicated. The methods
    mirror the library's step, each one ``jax.shard_map``-ped over ``mesh``:

    - :meth:`value_and_row_grad`: the fast path; ids are routed to the
      owners, the rows come back to the devices that look them up, and the
      row gradients go back to the owners;
    - :meth:`route`: an :class:`IndexedRows` or BCOO gradient in global ids
      (from anywhere) brought to the owners;
    - :meth:`update` and :meth:`apply_updates`: ``tx.update`` and
      :func:`~optax_sparse_adam.apply_updates` on each device's block only.

    Ids are either replicated (``batch_axis=None``: every device sees the
    whole batch; each keeps the ids it owns, with no communication for a
    gradient and one all-reduce of the rows for a lookup) or split over
    ``batch_axis`` (which must be ``axis``: data parallel over the devices
    holding the table), and then routed by

    - ``"all_gather"``: every device receives every id of the batch and, as
      rows forward and as gradients backward, every row looked up:
      ``K * (2 * width + 1)`` words per device for a global batch of ``K``
      ids, which does not fall as devices are added;
    - ``"all_to_all"``: each device sums its duplicates, buckets its distinct
      ids by owner with ``capacity`` slots per owner, and exchanges buckets
      (ids, then rows, then gradients): ``n * capacity * (2 * width + 1)``
      words per device, about ``K / n * (2 * width + 1)`` when ``capacity``
      fits the batch. A bucket over
      capacity on any device makes the whole step take the all-gather route
      (one scalar decides; only routing sits in that ``lax.cond``, never a
      table), so no id is dropped; :class:`RoutingInfo` reports the overflow.

    The value of a data-parallel loss is the mean over devices of ``fun`` on
    each device's share of the batch (a mean loss over equal shares is the
    whole batch's mean loss), and the dense gradients are its gradients,
    summed over the devices.

    Attributes:
      mesh: The device mesh (``jax.make_mesh``; ``Explicit`` or ``Auto``
        axes), over all processes' devices under ``jax.distributed``.
      axis: The mesh axis the tables' rows are split over.
      tables: Selects the tables from the parameters, e.g. ``lambda p:
        (p["user"], p["item"])``; it may only index into the tree.
      batch_axis: ``None`` for replicated ids, or ``axis`` for ids (and the
        other batch arguments) split over it along their first axis.
      routing: ``"all_to_all"`` (default) or ``"all_gather"``; used with
        ``batch_axis``.
      capacity: Slots per (device, owner) bucket for ``"all_to_all"``;
        ``None`` gives the even share ``m = k / n`` of a device's ``k`` ids
        plus ``4 * sqrt(m) + 4``, which uniformly spread ids overflow about
        once in a million buckets. Ids concentrated on a few owners (low ids
        of a Zipf law with contiguous row blocks) need more: permute the
        ids, or raise it, as :class:`RoutingInfo` shows.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import optax_sparse_adam as osa
      >>> mesh = jax.make_mesh((1,), ("x",), devices=jax.devices()[:1])
      >>> rs = osa.RowSharding(mesh, "x", tables=lambda p: p["emb"])
      >>> params = rs.shard({"emb": jnp.ones((8, 2), jnp.float32), "w": jnp.ones((2,), jnp.float32)})
      >>> params["emb"].sharding.spec == jax.P("x", None)
      True
      >>> tx = osa.sparse_adam(0.1)
      >>> state = tx.init(params)
      >>> def loss(p, ids):
      ...   return (p["emb"][ids] @ p["w"]).sum()
      >>> value, grads, info = rs.value_and_row_grad(loss)(params, jnp.array([3, 3, 5]))
      >>> updates, state = rs.update(tx, grads, state, params)
      >>> params = rs.apply_updates(params, updates)
      >>> value, params["emb"][2:6, 0]
      (Array(6., dtype=float32), Array([1. , 0.9, 1. , 0.9], dtype=float32))
    """

    mesh: Mesh
    axis: str
    tables: Callable[[Any], Any]
    _: dataclasses.KW_ONLY
    batch_axis: str | None = None
    routing: Routing = "all_to_all"
    capacity: int | None = None

    def __post_init__(self) -> None:
        names = tuple(self.mesh.axis_names)
        if self.axis not in names:
            raise ValueError(f"RowSharding: axis {self.axis!r} is not an axis of the mesh {names}")
        if self.batch_axis not in (None, self.axis):
            raise ValueError(
                f"RowSharding: batch_axis must be None (replicated ids) or the row axis {self.axis!r}, "
                f"got {self.batch_axis!r}"
            )
        if self.routing not in ("all_gather", "all_to_all"):
            raise ValueError(f"RowSharding: routing must be 'all_gather' or 'all_to_all', got {self.routing!r}")
        if self.capacity is not None and (not isinstance(self.capacity, int) or self.capacity < 1):
            raise ValueError(f"RowSharding: capacity must be a positive int or None, got {self.capacity!r}")

    # ---------------------------------------------------------------- layout

    @property
    def num_shards(self) -> int:
        return int(self.mesh.shape[self.axis])

    def _selected(self, tree: Any) -> tuple[list[Any], list[str], list[int], Any]:
        """Leaves, paths, the indices of the selected tables (in selection order) and the treedef."""
        treedef: Any
        path_leaves, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
        chosen = jax.tree.leaves(self.tables(treedef.unflatten([_Slot(i) for i in range(len(path_leaves))])))
        for s in chosen:
            if not isinstance(s, _Slot):
                raise TypeError(
                    "RowSharding: `tables` must select leaves of the parameters (index into the tree it is given), "
                    f"but it returned a {type(s).__name__}"
                )
        leaves = [leaf for _, leaf in path_leaves]
        paths = [path_str(path) for path, _ in path_leaves]
        for s in chosen:
            shape = tuple(getattr(leaves[s.i], "shape", ()))
            if not shape:
                raise ValueError(f"RowSharding: table {paths[s.i]} must have at least one axis")
            if shape[0] % self.num_shards:
                raise ValueError(
                    f"RowSharding: table {paths[s.i]} has {shape[0]} rows, not a multiple of the "
                    f"{self.num_shards} devices of axis {self.axis!r}; pad the table to a multiple"
                )
        return leaves, paths, [s.i for s in chosen], treedef

    def specs(self, params: Any) -> Any:
        """The ``PartitionSpec`` of each parameter: ``P(axis, None, ...)`` for tables, ``P()`` otherwise."""
        leaves, _, chosen, treedef = self._selected(params)
        return treedef.unflatten(
            [_P(self.axis, *([None] * (jnp.ndim(x) - 1))) if i in chosen else _P() for i, x in enumerate(leaves)]
        )

    def shardings(self, params: Any) -> Any:
        """The ``NamedSharding`` of each parameter (a restore target for orbax, ``out_shardings`` for jit)."""
        return jax.tree.map(lambda s: NamedSharding(self.mesh, s), self.specs(params))

    def shard(self, params: Any) -> Any:
        """``params`` placed on the mesh: tables split by rows, everything else replicated."""
        return jax.device_put(params, self.shardings(params))

    def state_specs(self, tx: Any, state: Any, params: Any) -> Any:
        """The ``PartitionSpec`` of each leaf of ``tx``'s state: the parameters' for moments, ``P()`` else."""
        return optax.tree_utils.tree_map_params(
            tx, lambda _, spec: spec, state, self.specs(params), transform_non_params=lambda _: _P()
        )

    def _put(self, tree: Any, specs: Any) -> Any:
        """``tree`` resharded to ``specs`` where the mesh has ``Explicit`` axes (``shard_map`` wants that)."""
        explicit = any(t == jax.sharding.AxisType.Explicit for t in self.mesh.axis_types)
        if not explicit:
            return tree

        def put(x: Any, spec: Any) -> Any:
            if x is None or isinstance(x, jax.ShapeDtypeStruct):
                return x
            return jax.sharding.reshard(x, NamedSharding(self.mesh, spec))

        return jax.tree.map(put, tree, specs, is_leaf=lambda x: x is None)

    def _map(self, body: Callable[..., Any], in_specs: Any, out_specs: Any, *args: Any) -> Any:
        args = tuple(self._put(a, s) for a, s in zip(args, in_specs, strict=True))
        return jax.shard_map(body, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs)(*args)

    def _block(self, num_rows: int) -> tuple[int, jax.Array]:
        """Rows per device and the first row of this device's block (inside ``shard_map``)."""
        shard = num_rows // self.num_shards
        return shard, jax.lax.axis_index(self.axis).astype(jnp.int32) * shard

    def _sparse_specs(self, leaf: Any) -> Any:
        """Specs of an owner-aligned sparse leaf: its entries split over ``axis``."""
        return _specs_like(leaf, _P(self.axis))

    def _tree_specs(self, params: Any, tree: Any) -> Any:
        """Specs for a gradient/update tree: owner-aligned sparse table leaves, the rest replicated."""
        _, _, chosen, treedef = self._selected(params)
        leaves = _flatten_up_to(treedef, tree, "RowSharding", "parameters")
        return treedef.unflatten(
            [
                self._sparse_specs(x) if i in chosen and is_sparse(x) else (None if x is None else _P())
                for i, x in enumerate(leaves)
            ]
        )

    # ------------------------------------------------------- sparse leaves, global <-> local block

    def _to_local(self, leaf: Any, path: Any, where: str) -> Any:
        """An owner-aligned global leaf (this device's entries) as a leaf of this device's block."""
        shape = tuple(leaf.shape)
        block, lo = self._block(shape[0])
        keys, values = _keys_values(leaf, shape, path, where)
        local = keys[:, 0] - lo
        owned = (keys[:, 0] < shape[0]) & (local >= 0) & (local < block)
        local_shape = (block, *shape[1:])
        keys = jnp.where(owned[:, None], keys.at[:, 0].set(local), jnp.asarray(local_shape[: keys.shape[1]]))
        return _rebuild(leaf, keys, values, local_shape)

    def _to_global(self, leaf: Any, template: Any, path: Any, where: str) -> Any:
        shape = tuple(template.shape)
        block, lo = self._block(shape[0])
        keys, values = _keys_values(leaf, (block, *shape[1:]), path, where)
        owned = keys[:, 0] < block
        keys = jnp.where(owned[:, None], keys.at[:, 0].add(lo), jnp.asarray(shape[: keys.shape[1]]))
        return _rebuild(template, keys, values, shape)

    # ---------------------------------------------------------------------------- update / apply

    def update(self, tx: optax.GradientTransformation, grads: Any, state: Any, params: Any) -> tuple[Any, Any]:
        """``tx.update(grads, state, params)`` on each device's block of the tables.

        ``grads`` holds owner-aligned sparse leaves for the tables (from
        :meth:`value_and_row_grad` or :meth:`route`) and replicated dense
        leaves. Each device updates the rows it owns and their moments, with no
        collective; the state keeps its shardings. ``tx`` runs per block, so
        a transformation that reduces over the whole tree
        (``clip_by_global_norm``) would see one block: apply such ones
        before routing.

        Returns:
          ``(updates, state)``: owner-aligned sparse updates for the tables.
        """
        g_specs = self._tree_specs(params, grads)
        p_specs = self.specs(params)
        s_specs = self.state_specs(tx, state, params)
        _, _, chosen, treedef = self._selected(params)

        def body(grads: Any, state: Any, params: Any) -> Any:
            flat = _flatten_up_to(treedef, grads, "RowSharding.update", "parameters")
            local = [
                self._to_local(g, (), "RowSharding.update") if i in chosen and is_sparse(g) else g
                for i, g in enumerate(flat)
            ]
            updates, state = tx.update(treedef.unflatten(local), state, params)
            out = _flatten_up_to(treedef, updates, "RowSharding.update", "parameters")
            out = [
                self._to_global(u, flat[i], (), "RowSharding.update") if i in chosen and is_sparse(u) else u
                for i, u in enumerate(out)
            ]
            return treedef.unflatten(out), state

        return self._map(body, (g_specs, s_specs, p_specs), (g_specs, s_specs), grads, state, params)

    def apply_updates(self, params: Any, updates: Any) -> Any:
        """:func:`~optax_sparse_adam.apply_updates` on each device's block; the tables keep their sharding."""
        u_specs = self._tree_specs(params, updates)
        p_specs = self.specs(params)
        _, _, chosen, treedef = self._selected(params)

        def body(params: Any, updates: Any) -> Any:
            flat = _flatten_up_to(treedef, updates, "RowSharding.apply_updates", "parameters")
            local = [
                self._to_local(u, (), "RowSharding.apply_updates") if i in chosen and is_sparse(u) else u
                for i, u in enumerate(flat)
            ]
            return _apply_updates(params, treedef.unflatten(local))

        return self._map(body, (p_specs, u_specs), p_specs, params, updates)

    # ----------------------------------------------------------------------------------- routing

    def _capacity(self, k: int) -> int:
        """Slots per bucket; by default the even share ``m = k / n`` plus four Poisson deviations, plus 4."""
        if self.capacity is not None:
            return self.capacity
        m = k / self.num_shards
        return min(k, math.ceil(m + 4 * math.sqrt(m) + 4))

    def _buckets(self, ids: jax.Array, valid: jax.Array, num_rows: int, capacity: int) -> tuple[jax.Array, jax.Array]:
        """Each entry's slot in an ``(n * capacity)`` send buffer grouped by owner (``n * capacity``: not sent).

        Returns the slots and this device's number of valid entries that did not fit.
        """
        n = self.num_shards
        owner = jnp.where(valid, ids // (num_rows // n), n)
        onehot = (owner[:, None] == jnp.arange(n, dtype=owner.dtype)[None, :]).astype(jnp.int32)
        rank = jnp.sum(jnp.cumsum(onehot, axis=0) * onehot, axis=1) - 1  # position within the owner's bucket
        fits = valid & (rank < capacity)
        dest = jnp.where(fits, owner * capacity + rank, n * capacity)
        return dest, jnp.sum(valid & ~fits, dtype=jnp.int32)

    def _gather_entries(self, keys: jax.Array, values: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Every device's entries, on every device."""
        keys, values = _vary(keys, self.axis), _vary(values, self.axis)
        return (
            jax.lax.all_gather(keys, self.axis, axis=0, tiled=True),
            jax.lax.all_gather(values, self.axis, axis=0, tiled=True),
        )

    def _keep_owned(self, keys: jax.Array, values: jax.Array, shape: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
        """Entries of rows this device owns; the others become padding (global keys)."""
        block, lo = self._block(shape[0])
        owned = (keys[:, 0] >= lo) & (keys[:, 0] < lo + block)
        pad = jnp.asarray(shape[: keys.shape[1]], jnp.int32)
        zero = jnp.zeros((), values.dtype)
        return jnp.where(owned[:, None], keys, pad), jnp.where(broadcast_rows(owned, values.ndim), values, zero)

    def _routes_by_buckets(self) -> bool:
        return self.batch_axis is not None and self.routing == "all_to_all"

    def _decide(self, overflows: list[jax.Array]) -> tuple[jax.Array, jax.Array]:
        """The step's total overflow over devices and tables, and whether it falls back: one scalar."""
        total = sum(overflows, jnp.zeros((), jnp.int32))
        if self._routes_by_buckets():
            total = jax.lax.psum(total, self.axis)
        return total, total > 0

    def _route_entries(
        self, keys: jax.Array, values: jax.Array, shape: tuple[int, ...]
    ) -> tuple[jax.Array, Callable[[jax.Array], tuple[jax.Array, jax.Array]]]:
        """Routes a sparse gradient's entries to their owners.

        Returns this device's overflow and ``finish(fallback)``, which gives the owner-aligned
        ``(keys, values)`` once every table's overflow has decided the step's route.
        """
        no = jnp.zeros((), jnp.int32)
        if self.batch_axis is None:
            return no, lambda _: self._keep_owned(keys, values, shape)
        if self.routing == "all_gather":
            return no, lambda _: self._keep_owned(*self._gather_entries(keys, values), shape)
        n, k = self.num_shards, keys.shape[0]
        capacity = self._capacity(k)
        size = max(n * k, n * capacity)
        pad = jnp.asarray(shape[: keys.shape[1]], jnp.int32)

        def padded(keys: jax.Array, values: jax.Array) -> tuple[jax.Array, jax.Array]:
            extra = size - keys.shape[0]
            keys = jnp.concatenate([keys, jnp.broadcast_to(pad, (extra, keys.shape[1]))])
            return keys, jnp.concatenate([values, jnp.zeros((extra, *values.shape[1:]), values.dtype)])

        valid = keys[:, 0] < shape[0]
        dest, overflow = self._buckets(keys[:, 0], valid, shape[0], capacity)

        def exchange(keys: jax.Array, values: jax.Array) -> tuple[jax.Array, jax.Array]:
            send_k = jnp.broadcast_to(pad, (n * capacity, keys.shape[1])).at[dest].set(keys, mode="drop")
            send_v = jnp.zeros((n * capacity, *values.shape[1:]), values.dtype).at[dest].set(values, mode="drop")
            recv_k = jax.lax.all_to_all(send_k.reshape(n, capacity, -1), self.axis, 0, 0, tiled=False)
            recv_v = jax.lax.all_to_all(send_v.reshape(n, capacity, *values.shape[1:]), self.axis, 0, 0, tiled=False)
            return padded(recv_k.reshape(n * capacity, -1), recv_v.reshape(n * capacity, *values.shape[1:]))

        def gather(keys: jax.Array, values: jax.Array) -> tuple[jax.Array, jax.Array]:
            return padded(*self._keep_owned(*self._gather_entries(keys, values), shape))

        def finish(fallback: jax.Array) -> tuple[jax.Array, jax.Array]:
            if capacity >= k:  # every bucket fits whatever the ids
                return exchange(keys, values)
            return jax.lax.cond(fallback, gather, exchange, keys, values)

        return overflow, finish

    def route(self, grads: Any, params: Any) -> tuple[Any, RoutingInfo]:
        """Brings the tables' sparse gradients (global ids) to the devices that own their rows.

        Args:
          grads: A gradient tree with the structure of ``params``. A table's
            leaf is an :class:`IndexedRows` or a BCOO in global ids, replicated
            (``batch_axis=None``) or split over ``batch_axis`` (each device
            holding the entries of its share of the batch); other leaves are
            replicated and passed through.
          params: The parameters (for the tables' shapes).

        Returns:
          ``(grads, info)``: the tables' leaves owner-aligned, for
          :meth:`update`; :class:`RoutingInfo`.
        """
        leaves, paths, chosen, treedef = self._selected(params)
        flat = _flatten_up_to(treedef, grads, "RowSharding.route", "parameters")
        sparse = [i for i in chosen if is_sparse(flat[i])]
        entry = _P() if self.batch_axis is None else _P(self.batch_axis)
        in_specs = treedef.unflatten(
            [_specs_like(x, entry) if i in sparse else (None if x is None else _P()) for i, x in enumerate(flat)]
        )
        out_leaves = [
            (
                IndexedRows(flat[i].indices, flat[i].values, flat[i].num_rows)
                if isinstance(flat[i], IndexedRows)
                else jsparse.BCOO((flat[i].data, flat[i].indices), shape=flat[i].shape)
            )
            if i in sparse
            else flat[i]
            for i in range(len(flat))
        ]
        out_specs = self._tree_specs(params, treedef.unflatten(out_leaves))
        shapes = [tuple(jnp.shape(x)) for x in leaves]

        def body(grads: Any) -> Any:
            g = _flatten_up_to(treedef, grads, "RowSharding.route", "parameters")
            routed = {}
            for i in sparse:
                where = "RowSharding.route"
                keys, values = (_coalesced if self.routing == "all_to_all" else _keys_values)(
                    g[i], shapes[i], paths[i], where
                )
                routed[i] = self._route_entries(keys, values, shapes[i])
            overflow, fallback = self._decide([o for o, _ in routed.values()])
            for i, (_, finish) in routed.items():
                g[i] = _rebuild(out_leaves[i], *finish(fallback), shapes[i])
            return treedef.unflatten(g), RoutingInfo(overflow, fallback)

        return self._map(
            body, (in_specs,), (out_specs, _specs_like(RoutingInfo(jnp.zeros(()), jnp.zeros(())), _P())), grads
        )

    # ---------------------------------------------------------------------------- fast path

    def _plan(self, ids: jax.Array, num_rows: int) -> tuple[jax.Array, Callable[[jax.Array], Any]]:
        """Routes a device's flat ids (inside ``shard_map``).

        Returns this device's overflow and ``finish(fallback)``, which gives ``(exchange, wanted,
        positions)`` once every table's overflow has decided the step's route: ``wanted`` are the local
        rows this device must read (``block`` for none); ``exchange`` maps them, read, to the rows of this
        device's ids (differentiably); ``positions`` index those rows as the ids indexed the table.
        """
        n, k = self.num_shards, ids.shape[0]
        block, lo = self._block(num_rows)
        no = jnp.zeros((), jnp.int32)

        def localize(uids: jax.Array) -> jax.Array:
            local = uids - lo
            return jnp.where((uids < num_rows) & (local >= 0) & (local < block), local, block)

        def distinct(ids: jax.Array) -> tuple[jax.Array, jax.Array]:
            return _distinct(
                jnp.where((ids >= 0) & (ids < num_rows), ids, num_rows), (ids >= 0) & (ids < num_rows), num_rows
            )

        if self.batch_axis is None:  # every device has every id: read mine, all-reduce
            uids, inverse = distinct(ids)
            return no, lambda _: ((lambda rows: jax.lax.psum(rows, self.axis)), localize(uids), inverse)

        mine = jnp.arange(k, dtype=jnp.int32)

        def gathered_plan(ids: jax.Array) -> tuple[jax.Array, jax.Array]:
            uids, inverse = distinct(jax.lax.all_gather(_vary(ids, self.axis), self.axis, tiled=True))
            return localize(uids), inverse

        def gathered_exchange(rows: jax.Array, select: jax.Array) -> jax.Array:
            return jax.lax.psum_scatter(rows[select], self.axis, scatter_dimension=0, tiled=True)

        if self.routing == "all_gather":
            wanted, inverse = gathered_plan(ids)
            return no, lambda _: ((lambda rows: gathered_exchange(rows, inverse)), wanted, mine)

        capacity = self._capacity(k)
        size = max(n * k, n * capacity)
        uids, inverse = distinct(ids)
        valid = uids < num_rows
        dest, overflow = self._buckets(uids, valid, num_rows, capacity)

        def pad_to(x: jax.Array, n_out: int, fill: int) -> jax.Array:
            return jnp.concatenate([x, jnp.full((n_out - x.shape[0],), fill, x.dtype)])

        def bucket_plan(ids: jax.Array) -> tuple[jax.Array, jax.Array]:
            owner_lo = (uids // block) * block
            ask = jnp.full((n * capacity,), block, jnp.int32).at[dest].set(uids - owner_lo, mode="drop")
            asked = jax.lax.all_to_all(ask.reshape(n, capacity), self.axis, 0, 0).reshape(n * capacity)
            return pad_to(asked, size, block), pad_to(dest[inverse], n * k, n * capacity)

        def bucket_exchange(rows: jax.Array, select: jax.Array) -> jax.Array:
            out = rows[: n * capacity].reshape(n, capacity, *rows.shape[1:])
            back = jax.lax.all_to_all(out, self.axis, 0, 0).reshape(n * capacity, *rows.shape[1:])
            return back.at[select[:k]].get(mode="fill", fill_value=0)

        def fallback_plan(ids: jax.Array) -> tuple[jax.Array, jax.Array]:
            wanted, select = gathered_plan(ids)
            return pad_to(wanted, size, block), select

        def finish(fallback: jax.Array) -> Any:
            if capacity >= k:  # every bucket fits whatever the ids
                wanted, select = bucket_plan(ids)
                return (lambda rows: bucket_exchange(rows, select)), wanted, mine
            wanted, select = jax.lax.cond(fallback, fallback_plan, bucket_plan, ids)

            def exchange(rows: jax.Array) -> jax.Array:
                return jax.lax.cond(fallback, gathered_exchange, bucket_exchange, rows, select)

            return exchange, wanted, mine

        return overflow, finish

    def value_and_row_grad(
        self, fun: Callable[..., Any], *, has_aux: bool = False
    ) -> Callable[..., tuple[Any, Any, RoutingInfo]]:
        """:func:`~optax_sparse_adam.value_and_row_grad` for row-sharded tables.

        The returned function takes ``(params, ids, *args)`` as
        :func:`~optax_sparse_adam.value_and_row_grad` does, one array of ids
        per table that ``tables`` selects (a table selected twice gets both
        arrays), and the ids and ``args`` split over ``batch_axis`` along
        their first axis (or replicated). ``fun(params_rows, positions,
        *args)`` runs on each device for its share of the batch, with the
        rows its ids look up, wherever they live.

        Returns:
          A function returning ``(value, grads, info)``: the loss (the mean
          over devices for a data-parallel batch); the gradients, owner-aligned
          :class:`IndexedRows` for the tables and summed dense arrays for the
          rest; :class:`RoutingInfo`. With ``has_aux``, ``value`` is
          ``(loss, aux)`` and a data-parallel ``aux`` comes from every device,
          stacked along a new first axis.
        """

        def wrapped(params: Any, ids: Any, *args: Any) -> tuple[Any, Any, RoutingInfo]:
            leaves, paths, chosen, treedef = self._selected(params)
            id_treedef: Any
            id_leaves, id_treedef = jax.tree.flatten(ids)
            if len(id_leaves) != len(chosen):
                raise ValueError(
                    f"RowSharding.value_and_row_grad: `tables` selected {len(chosen)} table(s) "
                    f"({', '.join(paths[i] for i in chosen)}) but `ids` holds {len(id_leaves)} array(s)"
                )
            for i, x in zip(chosen, id_leaves, strict=True):
                if not jnp.issubdtype(jnp.asarray(x).dtype, jnp.integer):
                    raise TypeError(
                        f"RowSharding.value_and_row_grad: the ids for table {paths[i]} must be integers, "
                        f"got dtype {jnp.asarray(x).dtype}"
                    )
            tables = sorted(set(chosen))
            by_table = {i: [j for j, c in enumerate(chosen) if c == i] for i in tables}
            p_specs = self.specs(params)
            batch = _P() if self.batch_axis is None else _P(self.batch_axis)
            id_specs = jax.tree.map(lambda _: batch, ids)
            arg_specs = jax.tree.map(lambda _: batch, args)
            shapes = {i: tuple(jnp.shape(leaves[i])) for i in tables}
            unique = self.batch_axis is None or self.routing == "all_gather"
            grad_template = treedef.unflatten(
                [
                    IndexedRows(jnp.zeros(1, jnp.int32), jnp.zeros((1, *shapes[i][1:])), shapes[i][0], unique)
                    if i in tables
                    else x
                    for i, x in enumerate(leaves)
                ]
            )
            g_specs = self._tree_specs(params, grad_template)
            stacked = has_aux and self.batch_axis is not None
            value_spec = (_P(), _P(self.axis)) if stacked else _P()
            n_batch = 1 if self.batch_axis is None else self.num_shards

            def body(params: Any, ids: Any, args: Any) -> Any:
                local = _flatten_up_to(treedef, params, "RowSharding.value_and_row_grad", "parameters")
                flat_ids = jax.tree.leaves(ids)
                exchanges: dict[int, Any] = {}
                wanted: dict[int, jax.Array] = {}
                positions: list[Any] = [None] * len(flat_ids)
                plans = {}
                for i in tables:
                    flat = [jnp.asarray(flat_ids[j]).reshape(-1).astype(jnp.int32) for j in by_table[i]]
                    plans[i] = self._plan(flat[0] if len(flat) == 1 else jnp.concatenate(flat), shapes[i][0])
                overflow, fallback = self._decide([o for o, _ in plans.values()])
                for i, (_, finish) in plans.items():
                    exchanges[i], wanted[i], pos = finish(fallback)
                    start = 0
                    for j in by_table[i]:
                        x = flat_ids[j]
                        positions[j] = pos[start : start + x.size].reshape(jnp.shape(x))
                        start += x.size
                rows = {i: take_rows(local[i], wanted[i]) for i in tables}
                pos_tree = id_treedef.unflatten(positions)

                def inner(diff: list[Any]) -> Any:
                    full = [exchanges[i](diff[i]) if i in tables else diff[i] for i in range(len(diff))]
                    out = fun(treedef.unflatten(full), pos_tree, *args)
                    if has_aux:
                        return out[0] / n_batch, out[1]
                    return out / n_batch

                diff = [rows[i] if i in tables else x for i, x in enumerate(local)]
                value, grads = jax.value_and_grad(inner, has_aux=has_aux)(diff)
                if self.batch_axis is not None:
                    if has_aux:
                        value = (jax.lax.psum(value[0], self.axis), jax.tree.map(lambda a: a[None], value[1]))
                    else:
                        value = jax.lax.psum(value, self.axis)
                out = []
                for i, g in enumerate(grads):
                    if i not in tables:
                        out.append(g)
                        continue
                    block, lo = self._block(shapes[i][0])
                    owned = wanted[i] < block
                    values = jnp.where(broadcast_rows(owned, g.ndim), g, jnp.zeros((), g.dtype))
                    out.append(
                        IndexedRows(jnp.where(owned, wanted[i] + lo, -1), values, shapes[i][0], unique_indices=unique)
                    )
                return value, treedef.unflatten(out), RoutingInfo(overflow, fallback)

            out_specs = (value_spec, g_specs, _specs_like(RoutingInfo(jnp.zeros(()), jnp.zeros(())), _P()))
            return self._map(body, (p_specs, id_specs, arg_specs), out_specs, params, ids, args)

        return wrapped
