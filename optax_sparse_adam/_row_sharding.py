"""Row-sharded tables: :class:`RowSharding`, the spec.

A table too big for one device is split by rows over a mesh axis
(``PartitionSpec(axis, None)``): device ``i`` of ``n`` holds the block of
rows ``[i * num_rows / n, (i + 1) * num_rows / n)`` and its Adam moments. Ids
reach the rows' owners by *routing* (:mod:`optax_sparse_adam._routing`) inside
``jax.shard_map``; every device then runs the library's own update on its
block, with ids local to it, and no collective touches a table. Per device and
step: communication is O(ids x width), compute is O(rows it owns in the batch)
plus the routing, and temporaries do not depend on the table's size.

Between the routed calls a table's gradient or update is an ordinary
:class:`IndexedRows` (or BCOO) in global ids, *owner-aligned*: its entries are
sharded over the same axis as the table, and the block on device ``i`` holds
only rows that device ``i`` owns (or padding). It has the usual meaning, so
:func:`~optax_sparse_adam.apply_updates` and ``tx.update`` also take it
under plain ``jit``; :meth:`RowSharding.update` and
:meth:`RowSharding.apply_updates` run them on each block instead. It is
marked so (``owner_axis``, static), and the routed steps take no table leaf
without their axis's mark.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from optax_sparse_adam import _routing
from optax_sparse_adam._apply import apply_updates as _apply_updates
from optax_sparse_adam._fused import fused_step
from optax_sparse_adam._indexed_rows import IndexedRows, bcoo_like, is_sparse, owner_axis
from optax_sparse_adam._routing import Route, RoutingInfo
from optax_sparse_adam._row_grad import Selection, check_ids, check_reads_rows_only, rows_read, select_tables
from optax_sparse_adam._row_ops import take_rows
from optax_sparse_adam._tree import broadcast_rows, leaves_like, param_error

__all__ = ["RowSharding"]

_P = PartitionSpec


def _specs_like(tree: Any, spec: PartitionSpec) -> Any:
    """``spec`` for every array of ``tree`` (a sparse leaf keeps its static metadata)."""
    return jax.tree.map(lambda _: spec, tree)


def _flatten_up_to(treedef: Any, tree: Any, where: str) -> list[Any]:
    """``tree``'s subtrees at the leaves of ``treedef`` (the parameters' structure), or an error naming the path."""
    return leaves_like(treedef, treedef.unflatten([None] * treedef.num_leaves), tree, where, "parameters", "parameters")


def _on_host(x: Any) -> Any:
    """``x``, a jax array over other processes' devices gathered whole (every process must call this alike)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return multihost_utils.process_allgather(x, tiled=True)
    return x


def _abstract(x: Any, shape: tuple[int, ...] | None = None) -> Any:
    """A placeholder for ``x`` (with ``shape`` if given) for tracing without compute."""
    if x is None:
        return None
    aval = jax.typeof(x)
    return jax.ShapeDtypeStruct(aval.shape if shape is None else shape, aval.dtype, weak_type=aval.weak_type)


_ROUTING_INFO_SPECS: Any = RoutingInfo(_P(), _P(), _P())  # type: ignore[arg-type]  # specs in place of arrays


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
      (ids, then rows, then gradients; all tables in each exchange):
      ``n * capacity * (2 * width + 1)``
      words per device, about ``K / n * (2 * width + 1)`` when ``capacity``
      fits the batch. Ids over capacity go in a second round of buckets,
      run only in a step where a bucket on some device overflows; ids over
      twice the capacity make the whole step take the all-gather route (one
      decision per step; only routing sits in those conditionals, never a
      table), so no id is dropped; :class:`RoutingInfo` reports the route.

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
        ids, or raise it, as :class:`RoutingInfo` shows. A table with fewer
        rows per device than this gets buckets of its rows per device (an
        owner holds no more distinct ids), which never overflow.

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
    routing: Literal["all_gather", "all_to_all"] = "all_to_all"
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

    def suggest_capacity(self, params: Any, batches: Iterable[Any], *, margin: float = 1.0) -> int:
        """A ``capacity`` for the ``"all_to_all"`` route, learned from recorded batches of ids.

        For each batch, each device's share of each table's ids (split over
        ``batch_axis`` as :meth:`value_and_row_grad` splits them) is
        deduplicated and bucketed by owner, as the routing does; the result is
        the largest bucket seen, times ``margin``, rounded up. Record a few
        hundred batches of the real id stream (or of the same distribution):
        ids concentrated on a few owners need far more than the default.

        Every step receives the capacity's bytes, so the default takes the
        largest bucket as it is: a later batch that crowds a bucket past it
        runs a second round in that step (:class:`RoutingInfo`), and only one
        past twice it takes the all-gather route. A ``margin`` over 1 trades
        bytes in every step for fewer second rounds.

        Args:
          params: The parameters (or ``jax.ShapeDtypeStruct`` placeholders),
            for the tables' sizes.
          batches: Trees of ids, each as :meth:`value_and_row_grad` takes them
            (NumPy or jax arrays, or :class:`Bags`; their global form). Under
            ``jax.distributed`` a jax array over other processes' devices is
            gathered first: call this on every process, with the same batches.
          margin: Headroom over the largest bucket seen (at least 1).

        Returns:
          The suggested ``capacity``, for ``dataclasses.replace(rs, capacity=...)``.
        """
        if not margin >= 1:
            raise ValueError(f"RowSharding.suggest_capacity: margin must be at least 1, got {margin!r}")
        sel = self._selected(params, "RowSharding.suggest_capacity")
        n = self.num_shards
        shares = n if self.batch_axis is not None else 1
        largest = 0
        for ids in batches:
            ids = jax.tree.map(_on_host, ids)
            leaves = [np.asarray(x) for x in check_ids(ids, sel, "RowSharding.suggest_capacity").leaves]
            for i in sorted(set(sel.chosen)):
                rows = int(np.shape(sel.leaves[i])[0])
                mine = [x for j, x in zip(sel.chosen, leaves, strict=True) if j == i]
                for d in range(shares):
                    share = np.concatenate([np.array_split(x, shares)[d].reshape(-1) for x in mine])
                    share = np.unique(share[(share >= 0) & (share < rows)])
                    largest = max(largest, int(np.bincount(share // (rows // n), minlength=n).max(initial=0)))
        return max(1, math.ceil(largest * margin))

    # ---------------------------------------------------------------- layout

    @property
    def num_shards(self) -> int:
        return int(self.mesh.shape[self.axis])

    @property
    def _route(self) -> Route:
        return "replicated" if self.batch_axis is None else self.routing

    def _selected(self, params: Any, where: str = "RowSharding") -> Selection:
        """The tables that ``tables`` selects, each with a number of rows divisible by the devices."""
        sel = select_tables(params, self.tables, where)
        for i in sel.chosen:
            rows = sel.leaves[i].shape[0]
            if rows % self.num_shards:
                raise ValueError(
                    f"{where}: table {sel.paths[i]} has {rows} rows, not a multiple of the "
                    f"{self.num_shards} devices of axis {self.axis!r}; pad the table to a multiple (an "
                    f"EmbeddingCollection's stack: EmbeddingCollection(..., shards={self.num_shards}) lays it out "
                    "for them)"
                )
        return sel

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
        """The ``PartitionSpec`` of each leaf of ``tx``'s state: the parameters' for the leaves in their place
        (moments, and per-row state such as row-wise accumulators or catch-up's last steps, split by row like
        their table), ``P()`` else."""

        return self._state_specs(tx, state, params, "RowSharding.state_specs")

    def _state_specs(self, tx: Any, state: Any, params: Any, where: str) -> Any:
        def fit(leaf: Any, spec: Any) -> Any:
            # A per-row leaf (rows,) of a table (rows, width) takes the table's spec for its dimensions.
            return _P(*tuple(spec)[: len(leaf.shape)]) if isinstance(spec, _P) else spec

        specs = self.specs(params)
        try:
            return optax.tree_utils.tree_map_params(tx, fit, state, specs, transform_non_params=lambda _: _P())
        except (TypeError, ValueError) as e:
            failed = e
        # tree_map_params runs tx.init on one placeholder for the whole tree, which a wrapper that labels the
        # parameters (optax.multi_transform, osa.partition_tables) cannot label. Where the state has the structure
        # tx.init gives these parameters, each of its leaves of a table's shape, or of the table's rows alone (a
        # per-row record), is split as the table; the others are replicated (a leaf taken for the other kind fails
        # the step's shapes, it does not pass with other numbers).
        built: Any = jax.tree.structure(jax.eval_shape(tx.init, params))  # jax's PyTreeDef: type checkers miss ==
        if built != jax.tree.structure(state):
            raise TypeError(
                f"{where}: the optimizer state ({type(state).__name__}) does not have the structure this `tx` "
                "builds for these parameters: it was built for another optimizer or other parameters; pass the "
                f"state that `tx.init(params)` returned for this `tx` ({str(failed).splitlines()[0]})"
            ) from failed
        leaves, _, chosen, _ = self._selected(params)
        split = {
            s: _P(self.axis, *([None] * (len(s) - 1))) for i in chosen for s in (leaves[i].shape, leaves[i].shape[:1])
        }
        return jax.tree.map(lambda x: split.get(tuple(jnp.shape(x)), _P()), state)

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

    def _tree_specs(self, params: Any, tree: Any) -> Any:
        """Specs for a gradient/update tree: owner-aligned sparse table leaves (entries split over ``axis``)."""
        _, _, chosen, treedef = self._selected(params)
        leaves = _flatten_up_to(treedef, tree, "RowSharding")
        return treedef.unflatten(
            [
                _specs_like(x, _P(self.axis)) if i in chosen and is_sparse(x) else (None if x is None else _P())
                for i, x in enumerate(leaves)
            ]
        )

    def _locals(self, tree: Any, sel: Selection, where: str, params: Any) -> tuple[list[Any], list[Any]]:
        """Inside ``shard_map``: ``tree``'s leaves, and the same with each table's sparse leaf local to the block,
        each checked first to be of its whole table's shape and routed over ``axis`` (``params``: the blocks), the
        error naming its path."""
        _, paths, chosen, treedef = sel
        flat = _flatten_up_to(treedef, tree, where)
        blocks = _flatten_up_to(treedef, params, where)
        n = self.num_shards
        for i in chosen:
            x, p = flat[i], blocks[i]
            whole = (p.shape[0] * n, *p.shape[1:])
            if is_sparse(x) and tuple(x.shape) != whole:
                raise param_error(
                    ValueError,
                    where,
                    paths[i],
                    f"the gradient ({type(x).__name__}) has shape {tuple(x.shape)} but the table has shape "
                    f"{whole}; build it for the whole table (num_rows=table.shape[0])",
                )
            if is_sparse(x) and owner_axis(x) != self.axis:
                raise param_error(
                    ValueError,
                    where,
                    paths[i],
                    f"the {type(x).__name__} of this table was not routed to the owners of its rows over axis "
                    f"{self.axis!r} (its owner_axis is {owner_axis(x)!r}), so each device would drop the entries it "
                    "does not own; pass gradients through `rs.route(grads, params)` or take them from "
                    "`rs.value_and_row_grad`, and give `rs.apply_updates` the updates of `rs.update`",
                )
        local = [
            _routing.to_local(x, self.axis, n, paths[i], where) if i in chosen and is_sparse(x) else x
            for i, x in enumerate(flat)
        ]
        return flat, local

    # ---------------------------------------------------------------------------- update / apply

    def update(self, tx: optax.GradientTransformation, grads: Any, state: Any, params: Any) -> tuple[Any, Any]:
        """``tx.update(grads, state, params)`` on each device's block of the tables.

        ``grads`` holds owner-aligned sparse leaves for the tables (from
        :meth:`value_and_row_grad` or :meth:`route`, which mark them with
        ``owner_axis``; a table leaf without the mark is refused) and
        replicated dense leaves. Each device updates the rows it owns and their moments, with no
        collective; the state keeps its shardings. ``tx`` runs per block, so
        a transformation that reduces over the whole tree
        (``clip_by_global_norm``) would see one block: apply such ones
        before routing.

        Returns:
          ``(updates, state)``: owner-aligned sparse updates for the tables.
        """
        g_specs = self._tree_specs(params, grads)
        p_specs = self.specs(params)
        where = "RowSharding.update"
        s_specs = self._state_specs(tx, state, params, where)
        sel = self._selected(params)
        _, paths, chosen, treedef = sel

        def body(grads: Any, state: Any, params: Any) -> Any:
            flat, local = self._locals(grads, sel, where, params)
            updates, state = tx.update(treedef.unflatten(local), state, params)
            out = _flatten_up_to(treedef, updates, where)
            out = [
                _routing.to_global(u, flat[i], self.axis, self.num_shards, paths[i], where)
                if i in chosen and is_sparse(u)
                else u
                for i, u in enumerate(out)
            ]
            return treedef.unflatten(out), state

        return self._map(body, (g_specs, s_specs, p_specs), (g_specs, s_specs), grads, state, params)

    def apply_updates(self, params: Any, updates: Any) -> Any:
        """:func:`~optax_sparse_adam.apply_updates` on each device's block; the tables keep their sharding."""
        u_specs = self._tree_specs(params, updates)
        p_specs = self.specs(params)
        sel = self._selected(params)
        treedef = sel.treedef

        def body(params: Any, updates: Any) -> Any:
            _, local = self._locals(updates, sel, "RowSharding.apply_updates", params)
            return _apply_updates(params, treedef.unflatten(local))

        return self._map(body, (p_specs, u_specs), p_specs, params, updates)

    def update_and_apply(
        self,
        tx: optax.GradientTransformation,
        grads: Any,
        state: Any,
        params: Any,
        *,
        key: jax.Array | None = None,
    ) -> tuple[Any, Any]:
        """:func:`~optax_sparse_adam.update_and_apply` on each device's block, in one ``shard_map``.

        Each table's owner-aligned gradient is made local to its block once,
        and the step is applied there (in one pass per row where the native
        kernels apply), with no round trip of the updates through global ids.

        With ``key`` (replicated), bfloat16 and float16 parameters are rounded
        stochastically, each table row drawing as it does on one device: the
        step equals ``update_and_apply(tx, grads, state, params, key=key)``
        on the whole tables.

        Returns:
          ``(params, state)`` after the step, with their shardings.
        """
        g_specs = self._tree_specs(params, grads)
        p_specs = self.specs(params)
        s_specs = self._state_specs(tx, state, params, "RowSharding.update_and_apply")
        sel = self._selected(params)
        _, _, chosen, treedef = sel

        def body(grads: Any, state: Any, params: Any, key: Any) -> Any:
            _, local = self._locals(grads, sel, "RowSharding.update_and_apply", params)
            first_rows = None
            if key is not None:  # each block's rows draw by their ids in the whole table
                block = jax.lax.axis_index(self.axis).astype(jnp.int32)
                position = {id(x): j for j, x in enumerate(jax.tree.leaves(params))}
                flat = _flatten_up_to(treedef, params, "RowSharding.update_and_apply")
                tables = [flat[i] for i in chosen]
                first_rows = {position[id(p)]: block * p.shape[0] for p in tables if id(p) in position}
            return fused_step(tx, treedef.unflatten(local), state, params, key, first_rows)

        out_specs = (p_specs, s_specs)
        if key is None:
            keyless = lambda g, s, p: body(g, s, p, None)  # noqa: E731
            return self._map(keyless, (g_specs, s_specs, p_specs), out_specs, grads, state, params)
        return self._map(body, (g_specs, s_specs, p_specs, _P()), out_specs, grads, state, params, key)

    # ----------------------------------------------------------------------------------- routing

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
        where = "RowSharding.route"
        flat = _flatten_up_to(treedef, grads, where)
        sparse = [i for i in chosen if is_sparse(flat[i])]
        entry = _P() if self.batch_axis is None else _P(self.batch_axis)
        in_specs = treedef.unflatten(
            [_specs_like(x, entry) if i in sparse else (None if x is None else _P()) for i, x in enumerate(flat)]
        )
        out_leaves = [
            (
                IndexedRows(flat[i].indices, flat[i].values, flat[i].num_rows, owner_axis=self.axis)
                if isinstance(flat[i], IndexedRows)
                else bcoo_like((flat[i].data, flat[i].indices), shape=flat[i].shape, owner_axis=self.axis)
            )
            if i in sparse
            else flat[i]
            for i in range(len(flat))
        ]
        out_specs = self._tree_specs(params, treedef.unflatten(out_leaves))
        shapes = [tuple(jnp.shape(x)) for x in leaves]
        axis, n, route = self.axis, self.num_shards, self._route
        entries = _routing.coalesced if route == "all_to_all" else _routing.keys_values

        def body(grads: Any) -> Any:
            g = _flatten_up_to(treedef, grads, where)
            gradients = [(*entries(g[i], shapes[i], paths[i], where), shapes[i]) for i in sparse]
            # One routing for all the tables: on the all-to-all route they share each exchange.
            overflows, finish = _routing.route_entries(gradients, axis, n, route, self.capacity)
            info = _routing.decide(overflows, axis, route)
            for i, (keys, values) in zip(sparse, finish(info), strict=True):
                g[i] = _routing.rebuild(out_leaves[i], keys, values, shapes[i], axis)
            return treedef.unflatten(g), info

        return self._map(body, (in_specs,), (out_specs, _ROUTING_INFO_SPECS), grads)

    # ---------------------------------------------------------------------------- fast path

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
        rows its ids look up, wherever they live. Like
        :func:`~optax_sparse_adam.value_and_row_grad`, it refuses (before any
        compute) a ``fun`` that uses a table other than by indexing it with
        the ids.

        Returns:
          A function returning ``(value, grads, info)``: the loss (the mean
          over devices for a data-parallel batch); the gradients, owner-aligned
          :class:`IndexedRows` for the tables and summed dense arrays for the
          rest; :class:`RoutingInfo`. With ``has_aux``, ``value`` is
          ``(loss, aux)`` and a data-parallel ``aux`` comes from every device,
          stacked along a new first axis.
        """

        where = "RowSharding.value_and_row_grad"

        def wrapped(params: Any, ids: Any, *args: Any) -> tuple[Any, Any, RoutingInfo]:
            sel = self._selected(params, where)
            leaves, paths, chosen, treedef = sel
            given = check_ids(ids, sel, where)
            id_leaves = ids = given.leaves  # NumPy ids too wide for JAX made padding, not wrapped
            rest = given.rest()  # a Bags' bags and weights: split like its ids
            tables = sorted(set(chosen))
            by_table = {i: [j for j, c in enumerate(chosen) if c == i] for i in tables}
            shapes = {i: tuple(jnp.shape(leaves[i])) for i in tables}
            axis, n, route = self.axis, self.num_shards, self._route
            n_batch = 1 if self.batch_axis is None else n
            for j, b in enumerate(given.bags):  # a data-parallel step splits bags by examples: each device its own
                why = "" if b is None else b.splits_into(n_batch)
                if why:
                    raise ValueError(
                        f"{where}: the Bags for table {paths[chosen[j]]} cannot be split over the {n} devices of "
                        f"batch_axis {self.batch_axis!r}: {why}; or replicate the ids (batch_axis=None)"
                    )

            # What `fun` sees on one device, as placeholders: the guard traces it and computes nothing.
            def per_device(x: Any) -> tuple[int, ...]:
                shape = tuple(jnp.shape(x))
                return shape if self.batch_axis is None else (shape[0] // n, *shape[1:])

            id_shapes = [per_device(x) for x in id_leaves]
            k = {i: sum(math.prod(id_shapes[j]) for j in by_table[i]) for i in tables}
            check_reads_rows_only(
                lambda d, pos, a: fun(
                    treedef.unflatten(d), given.with_positions(pos, [d[i] for i in chosen], a[1], n_batch), *a[0]
                ),
                [_abstract(x, (k[i], *shapes[i][1:]) if i in tables else None) for i, x in enumerate(leaves)],
                [jax.ShapeDtypeStruct(s, jnp.int32) for s in id_shapes],
                tuple(jax.tree.map(lambda x: _abstract(x, per_device(x)), t) for t in (args, rest)),
                {i: paths[i] for i in tables},
                axis_env=list(self.mesh.shape.items()),
                selection=sel,
            )

            p_specs = self.specs(params)
            batch = _P() if self.batch_axis is None else _P(self.batch_axis)
            id_specs = jax.tree.map(lambda _: batch, ids)
            arg_specs = jax.tree.map(lambda _: batch, args)
            unique = route != "all_to_all"
            grad_template = treedef.unflatten(
                [
                    IndexedRows(
                        jnp.zeros(1, jnp.int32), jnp.zeros((1, *shapes[i][1:])), shapes[i][0], unique, owner_axis=axis
                    )
                    if i in tables
                    else x
                    for i, x in enumerate(leaves)
                ]
            )
            g_specs = self._tree_specs(params, grad_template)
            stacked = has_aux and self.batch_axis is not None
            value_spec = (_P(), _P(axis)) if stacked else _P()

            def body(params: Any, ids: Any, args: Any, rest: Any) -> Any:
                local = _flatten_up_to(treedef, params, where)
                flat_ids = ids
                positions: list[Any] = [None] * len(flat_ids)
                table_ids = []
                for i in tables:
                    flat = [jnp.asarray(flat_ids[j]).reshape(-1) for j in by_table[i]]
                    table_ids.append((flat[0] if len(flat) == 1 else jnp.concatenate(flat), shapes[i][0]))
                # One plan for all the tables: on the all-to-all route they share each exchange.
                overflows, finish = _routing.plan(table_ids, axis, n, route, self.capacity)
                info = _routing.decide(overflows, axis, route)
                exchange, wanted_list, pos_list = finish(info)
                wanted = dict(zip(tables, wanted_list, strict=True))
                for i, pos in zip(tables, pos_list, strict=True):
                    start = 0
                    for j in by_table[i]:
                        x = flat_ids[j]
                        positions[j] = pos[start : start + x.size].reshape(jnp.shape(x))
                        start += x.size
                rows = {i: take_rows(local[i], wanted[i]) for i in tables}

                def inner(diff: list[Any]) -> Any:
                    read = dict(zip(tables, exchange([diff[i] for i in tables]), strict=True))
                    full = [read[i] if i in tables else diff[i] for i in range(len(diff))]
                    pos_tree = given.with_positions(positions, [read[i] for i in chosen], rest, n_batch)
                    out = fun(treedef.unflatten(full), pos_tree, *args)
                    if has_aux:
                        return out[0] / n_batch, out[1]
                    return out / n_batch

                diff = [rows[i] if i in tables else x for i, x in enumerate(local)]
                value, grads = jax.value_and_grad(inner, has_aux=has_aux)(diff)
                if self.batch_axis is not None:
                    if has_aux:
                        value = (jax.lax.psum(value[0], axis), jax.tree.map(lambda a: a[None], value[1]))
                    else:
                        value = jax.lax.psum(value, axis)
                out = []
                for i, g in enumerate(grads):
                    if i not in tables:
                        out.append(g)
                        continue
                    shard, lo = _routing.block(shapes[i][0], axis, n)
                    owned = wanted[i] < shard
                    # Through rows_read the gradient depends on the rows read, so the table is read before
                    # its update in place (a linear loss's gradient does not, and XLA copied the table).
                    keep = owned & rows_read(rows[i])
                    values = jnp.where(broadcast_rows(keep, g.ndim), g, jnp.zeros((), g.dtype))
                    out.append(
                        IndexedRows(
                            jnp.where(owned, wanted[i] + lo, -1),
                            values,
                            shapes[i][0],
                            unique_indices=unique,
                            owner_axis=axis,
                        )
                    )
                return value, treedef.unflatten(out), info

            out_specs = (value_spec, g_specs, _ROUTING_INFO_SPECS)
            rest_specs = jax.tree.map(lambda _: batch, rest)
            return self._map(body, (p_specs, id_specs, arg_specs, rest_specs), out_specs, params, ids, args, rest)

        return wrapped
