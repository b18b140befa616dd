"""Row gradients for embedding tables: :func:`lookup` and :func:`value_and_row_grad`.

Differentiating a loss with respect to a whole table makes JAX build a
table-sized gradient, zeros but for the rows a batch looked up. The fast path
differentiates with respect to those rows instead: a batch's ids are
deduplicated, each distinct row is gathered once, and the model indexes the
small array of gathered rows. The gradient of that array is already summed per
distinct row, so it becomes an :class:`IndexedRows` with ``unique_indices=True``
and the optimizer step costs O(rows looked up) from end to end.

The pieces (selecting the tables, checking the ids, packing distinct ids, and
the guard that refuses a loss that reads a table other than at the ids) also
serve :meth:`RowSharding.value_and_row_grad`, so both paths accept and refuse
the same losses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.extend.core as jex
import jax.numpy as jnp

from optax_sparse_adam._coalesce import pack_distinct
from optax_sparse_adam._indexed_rows import IndexedRows, normalise_keys
from optax_sparse_adam._row_ops import replicate, take_rows
from optax_sparse_adam._sparse_leaf import padding_key
from optax_sparse_adam._tree import broadcast_rows, is_leaf, path_str

__all__ = [
    "RowLookup",
    "Selection",
    "check_ids",
    "check_reads_rows_only",
    "distinct_ids",
    "lookup",
    "select_tables",
    "value_and_row_grad",
]


@dataclasses.dataclass(frozen=True)
class RowLookup:
    """The distinct rows that a batch of ids looks up in a table, gathered once.

    ``rows[inverse]`` equals ``table[ids]`` for in-range ids, and is zero for
    padding ids (``< 0`` or ``>= num_rows``). The capacity ``k`` is the number
    of ids, so shapes are fixed under :func:`jax.jit`; the slots that do not
    hold a distinct in-range id are padding.

    Attributes:
      indices: ``(k,)`` int32: the distinct in-range ids, one slot each, in
        the leading slots; ``num_rows`` in the slots after them.
      rows: ``(k, *row_shape)``: ``table[indices]``, zeros in padding slots.
      inverse: int32 with the shape of the ids: the slot of each id in
        ``rows``.
      num_rows: Number of rows of the table (static).
    """

    indices: jax.Array
    rows: jax.Array
    inverse: jax.Array
    num_rows: int

    def grad(self, d_rows: jax.Array) -> IndexedRows:
        """The table's gradient, given the gradient ``d_rows`` of a loss with respect to ``rows``.

        Args:
          d_rows: An array with the shape of ``rows``.

        Returns:
          An :class:`IndexedRows` holding ``d_rows`` under ``indices``, with
          padding slots zeroed and ``unique_indices=True``, so that the
          optimizer needs no coalescing of its own.
        """
        d_rows = jnp.asarray(d_rows)
        if d_rows.shape != self.rows.shape:
            raise ValueError(f"RowLookup.grad: d_rows has shape {d_rows.shape}, expected {self.rows.shape}")
        valid = broadcast_rows(self.indices < self.num_rows, d_rows.ndim)
        values = jnp.where(valid, d_rows, jnp.zeros((), d_rows.dtype))
        return IndexedRows(self.indices, values, self.num_rows, unique_indices=True)


jax.tree_util.register_dataclass(RowLookup, data_fields=["indices", "rows", "inverse"], meta_fields=["num_rows"])


def lookup(table: jax.Array, ids: jax.typing.ArrayLike) -> RowLookup:
    """Deduplicates ``ids`` and gathers each distinct row of ``table`` once.

    Deduplication is sort-free (a few rounds of hashing and scatters over the
    ``k`` ids) and costs O(k), independent of the table's size. Differentiate
    a loss with respect to ``rows``, index it with ``inverse`` where the model
    would index the table with ``ids``, and turn the gradient into the table's
    with :meth:`RowLookup.grad`. :func:`value_and_row_grad` does all of this
    for a tree of parameters.

    Args:
      table: An array of shape ``(num_rows, *row_shape)``.
      ids: Integer ids of any shape. Ids ``< 0`` or ``>= num_rows`` are
        padding: they look up zeros and receive no gradient.

    Returns:
      A :class:`RowLookup` with capacity ``k = ids.size``.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import optax_sparse_adam as osa
      >>> table = jnp.arange(8.0, dtype=jnp.float32).reshape(4, 2)
      >>> lk = osa.lookup(table, jnp.array([3, 1, 3, -1]))
      >>> lk.rows[lk.inverse]
      Array([[6., 7.],
             [2., 3.],
             [6., 7.],
             [0., 0.]], dtype=float32)
      >>> d_rows = jax.grad(lambda rows: rows[lk.inverse].sum())(lk.rows)
      >>> lk.grad(d_rows).todense()
      Array([[0., 0.],
             [1., 1.],
             [0., 0.],
             [2., 2.]], dtype=float32)
    """
    table = jnp.asarray(table)
    ids = jnp.asarray(ids)
    _check_table("lookup", "the table", table.shape)
    _check_ids_dtype("lookup", "the table", ids.dtype)
    indices, inverse = distinct_ids(replicate(ids.reshape(-1)), table.shape[0])
    rows = take_rows(table, indices)
    return RowLookup(indices, rows, inverse.reshape(ids.shape), table.shape[0])


def distinct_ids(ids: jax.Array, num_rows: int) -> tuple[jax.Array, jax.Array]:
    """The distinct in-range ids of a flat batch, packed into the leading slots, and each id's slot.

    Sort-free (:func:`~optax_sparse_adam._coalesce.pack_distinct`), O(k) for
    ``k`` ids whatever the table's size.

    Args:
      ids: ``(k,)`` integer ids; ids ``< 0`` or ``>= num_rows`` are padding.
      num_rows: The number of rows of the table.

    Returns:
      ``(indices, inverse)``: ``(k,)`` int32 distinct ids, ``num_rows`` in the
      slots after them; ``(k,)`` int32 slot of each id, where a padding id
      gets the last slot (padding whenever there is a padding id).
    """
    keys = normalise_keys(ids[:, None], (num_rows,))
    valid = keys[:, 0] < num_rows
    # The distinct ids go into the leading slots, so that the optimizer stops after the last one (for_each_chunk).
    target, packed = pack_distinct(keys, valid, padding_key((num_rows,), 1))
    return packed[:, 0], jnp.where(valid, target, ids.shape[0] - 1)


# Primitives that hand on a table unchanged in value (a view of it): their result is still "the table".
_TABLE_VIEWS = frozenset({"convert_element_type", "copy", "copy_p", "stop_gradient", "reduce_precision"})
# Primitives that read rows of a table at given positions: allowed when the positions come from the ids.
_ROW_READS = frozenset({"gather", "dynamic_slice"})


def _check_table_uses(jaxpr: Any, tables: dict[Any, str], tainted: set[Any]) -> tuple[dict[int, str], set[int]]:
    """Raises unless each table in ``jaxpr`` is only read at positions computed from the ids.

    Args:
      jaxpr: A ``jax.extend.core.Jaxpr``.
      tables: Its variables that hold a table's gathered rows (or a view of them), with the table's path.
      tainted: Its variables computed from the ids' positions.

    Returns:
      Which outputs (by position) are tables, and which are computed from the positions.
    """
    tables, tainted = dict(tables), set(tainted)

    def is_var(v: Any) -> bool:
        return isinstance(v, jex.Var)

    for eqn in jaxpr.eqns:
        ins = eqn.invars
        used = [tables[v] for v in ins if is_var(v) and v in tables]
        name = eqn.primitive.name
        if used:
            subs = [p for p in eqn.params.values() if isinstance(p, jex.ClosedJaxpr | jex.Jaxpr)]
            branches = eqn.params.get("branches")
            if name in _TABLE_VIEWS:
                tables[eqn.outvars[0]] = used[0]
            elif name in _ROW_READS and is_var(ins[0]) and ins[0] in tables and used.count(used[0]) == 1:
                if not any(is_var(v) and v in tainted for v in ins[1:]):
                    raise _misuse(used[0], f"it is indexed at positions that do not come from the ids ({name})")
            elif len(subs) == 1 and len(_inner(subs[0]).invars) == len(ins):
                inner = _inner(subs[0])
                out_tables, out_tainted = _check_table_uses(
                    inner,
                    {iv: tables[v] for iv, v in zip(inner.invars, ins, strict=True) if is_var(v) and v in tables},
                    {iv for iv, v in zip(inner.invars, ins, strict=True) if is_var(v) and v in tainted},
                )
                tables.update({eqn.outvars[i]: n for i, n in out_tables.items()})
                tainted.update(eqn.outvars[i] for i in out_tainted)
            elif name == "cond" and branches is not None:
                for branch in branches:
                    inner = _inner(branch)
                    _check_table_uses(
                        inner,
                        {
                            iv: tables[v]
                            for iv, v in zip(inner.invars, ins[1:], strict=True)
                            if is_var(v) and v in tables
                        },
                        {iv for iv, v in zip(inner.invars, ins[1:], strict=True) if is_var(v) and v in tainted},
                    )
            else:
                raise _misuse(used[0], f"`{name}` reads it")
        if any(is_var(v) and (v in tainted or v in tables) for v in ins):
            tainted.update(eqn.outvars)
    return (
        {i: tables[v] for i, v in enumerate(jaxpr.outvars) if is_var(v) and v in tables},
        {i for i, v in enumerate(jaxpr.outvars) if is_var(v) and v in tainted},
    )


def _inner(jaxpr: Any) -> Any:
    return jaxpr.jaxpr if isinstance(jaxpr, jex.ClosedJaxpr) else jaxpr


def _misuse(table: str, how: str) -> ValueError:
    return ValueError(
        f"value_and_row_grad: the loss uses table {table} other than by indexing it with the ids ({how}). Inside "
        "`fun` the table holds only the rows the batch looks up, so a term over the whole table (an L2 penalty, "
        "tied input/output embeddings, a softmax over all rows) would be computed on those rows and be silently "
        "wrong. Index tables only with the given ids; compute whole-table terms outside `fun` (an L2 penalty "
        "becomes weight decay on the touched rows: sparse_aware(optax.add_decayed_weights(...))), or use "
        "jax.value_and_grad with lazy_dense for such a table."
    )


def check_reads_rows_only(
    fun: Callable[[Any, Any, Any], Any],
    rows: list[Any],
    positions: Any,
    extra: Any,
    tables: dict[int, str],
    *,
    axis_env: Sequence[tuple[str, int]] | None = None,
) -> None:
    """Raises unless ``fun(rows, positions, extra)`` uses each table only by indexing it at the positions.

    Traces ``fun`` once with :func:`jax.make_jaxpr` (no compute: ``rows`` and
    ``extra`` may hold :class:`jax.ShapeDtypeStruct` placeholders) and walks
    its jaxpr: a table (``rows[i]`` for ``i`` in ``tables``) may be viewed
    (cast, copied) and read at positions computed from ``positions``, and
    nothing else. ``extra`` is traced too but is no source of positions.

    Args:
      fun: The loss on the gathered rows, as a function of three trees.
      rows: The parameters' leaves, each table replaced by its gathered rows.
      positions: The positions of the ids in the gathered rows.
      extra: Further traced arguments of ``fun``.
      tables: The tables' leaf numbers in ``rows`` and their paths, for the message.
      axis_env: Mesh axes bound while tracing (``fun`` runs inside ``shard_map``).
    """
    probe = jax.make_jaxpr(fun, axis_env=axis_env)(rows, positions, extra)
    invars = probe.jaxpr.invars
    n_rows, n_positions = len(jax.tree.leaves(rows)), len(jax.tree.leaves(positions))
    row_vars = jax.tree.unflatten(jax.tree.structure(rows), invars[:n_rows])
    _check_table_uses(
        probe.jaxpr, {row_vars[i]: path for i, path in tables.items()}, set(invars[n_rows : n_rows + n_positions])
    )


class _Slot:
    """Stands in for the ``i``-th leaf of the parameters while ``tables`` selects leaves."""

    def __init__(self, i: int) -> None:
        self.i = i


class Selection(NamedTuple):
    """The parameters' leaves and paths, the selected tables' leaf numbers (in selection order), the treedef."""

    leaves: list[Any]
    paths: list[str]
    chosen: list[int]
    treedef: Any


def select_tables(params: Any, tables: Callable[[Any], Any], where: str) -> Selection:
    """The leaves that ``tables`` selects from ``params``, each checked to be a table (at least one axis).

    ``tables`` is called on the tree's structure with a placeholder for each
    leaf, so it may only index into the tree.
    """
    treedef: Any  # jax's PyTreeDef, which type checkers do not see
    path_leaves, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_leaf)
    must_select = (
        f"{where}: `tables` must select leaves of params (index into the tree it is given, "
        "e.g. `lambda p: (p['user'], p['item'])`), not compute with them"
    )
    try:
        selected = jax.tree.leaves(tables(treedef.unflatten([_Slot(i) for i in range(len(path_leaves))])))
    except (TypeError, ValueError, AttributeError, IndexError, KeyError) as e:
        raise TypeError(f"{must_select}; calling it on the tree's leaves failed: {e}") from None
    for s in selected:
        if not isinstance(s, _Slot):
            raise TypeError(f"{must_select}; it returned a {type(s).__name__}")
    leaves = [leaf for _, leaf in path_leaves]
    paths = [path_str(path) for path, _ in path_leaves]
    for s in selected:
        leaf = leaves[s.i]
        _check_table(where, f"table {paths[s.i]}", tuple(leaf.shape) if hasattr(leaf, "shape") else jnp.shape(leaf))
    return Selection(leaves, paths, [s.i for s in selected], treedef)


def check_ids(ids: Any, selection: Selection, where: str) -> tuple[list[jax.Array], Any]:
    """``ids``'s leaves, one integer array per selected table, and its treedef."""
    id_treedef: Any
    id_leaves, id_treedef = jax.tree.flatten(ids)
    chosen, paths = selection.chosen, selection.paths
    if len(id_leaves) != len(chosen):
        raise ValueError(
            f"{where}: `tables` selected {len(chosen)} table(s) ({', '.join(paths[i] for i in chosen)}) "
            f"but `ids` holds {len(id_leaves)} array(s); give one array of ids per selected table"
        )
    id_leaves = [jnp.asarray(x) for x in id_leaves]
    for i, x in zip(chosen, id_leaves, strict=True):
        _check_ids_dtype(where, f"table {paths[i]}", x.dtype)
    return id_leaves, id_treedef


def _check_table(where: str, name: str, shape: tuple[int, ...]) -> None:
    if not shape:
        raise ValueError(f"{where}: {name} must have at least one axis (its rows), got a scalar")


def _check_ids_dtype(where: str, name: str, dtype: Any) -> None:
    if not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"{where}: the ids for {name} must be integers, got dtype {dtype}")


def value_and_row_grad(
    fun: Callable[..., Any], tables: Callable[[Any], Any], *, has_aux: bool = False
) -> Callable[..., tuple[Any, Any]]:
    """Like :func:`jax.value_and_grad`, with row gradients for the embedding tables.

    The returned function takes ``(params, ids, *args, **kwargs)``. It looks
    up ``ids`` in the tables that ``tables`` selects (:func:`lookup`), and
    calls ``fun(params_rows, positions, *args, **kwargs)``, where
    ``params_rows`` is ``params`` with each table replaced by its gathered rows
    and ``positions`` is ``ids`` with each id replaced by its slot in them. A
    model that indexes its tables with the ids therefore computes the same
    loss when given ``params_rows`` and ``positions`` instead; the loss is
    differentiated with respect to ``params_rows``, and each table's gradient
    comes back as an :class:`IndexedRows` (``unique_indices=True``), every other
    leaf's as a dense array. No table-sized array is built, so with
    :func:`sparse_adam` and :func:`apply_updates` the tables' step costs
    O(ids per batch) under :func:`jax.jit`.

    A table selected more than once (say, for positive and negative samples)
    is looked up once, with all of its ids; its positions index the same rows.

    With ``flax.nnx``, split the model (``graphdef, params = nnx.split(model,
    nnx.Param)``) and merge it with ``params_rows`` inside ``fun``; the
    gradients go to ``nnx.Optimizer.update`` as they are, since an
    :class:`IndexedRows` update adds into its table's rows. With
    ``flax.linen``, whose modules check a parameter's shape against their
    attributes, apply a clone of the module whose table sizes are the lookups'
    capacity (e.g. ``model.clone(num_users=ids.size)``); the stock
    ``TrainState.apply_gradients`` takes the gradients.

    Args:
      fun: The loss, ``fun(params, positions, *args, **kwargs)``, returning a
        scalar (or ``(scalar, aux)`` with ``has_aux``).
      tables: Selects the tables from a tree with the structure of ``params``,
        e.g. ``lambda p: (p["user"], p["item"])``; it may only index into the
        tree. Each selected leaf, in order, is paired with one leaf of ``ids``.
      has_aux: Whether ``fun`` returns ``(value, aux)``.

    Returns:
      A function of ``(params, ids, *args, **kwargs)`` returning ``(value,
      grads)``, with ``grads`` of the structure of ``params``.

    Examples:
      >>> import jax.numpy as jnp
      >>> import optax_sparse_adam as osa
      >>> params = {"emb": jnp.ones((1000, 2), jnp.float32), "w": jnp.ones((2,), jnp.float32)}
      >>> def loss(p, ids):
      ...   return (p["emb"][ids] @ p["w"]).sum()
      >>> value, grads = osa.value_and_row_grad(loss, lambda p: p["emb"])(params, jnp.array([5, 5, 7]))
      >>> value
      Array(6., dtype=float32)
      >>> grads["emb"].values.shape, grads["w"]
      ((3, 2), Array([3., 3.], dtype=float32))
      >>> tx = osa.sparse_adam(0.1)
      >>> updates, _ = tx.update(grads, tx.init(params), params)
      >>> osa.apply_updates(params, updates)["emb"][4:8]
      Array([[1. , 1. ],
             [0.9, 0.9],
             [1. , 1. ],
             [0.9, 0.9]], dtype=float32)
    """

    def wrapped(params: Any, ids: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        leaves, paths, chosen, treedef = sel = select_tables(params, tables, "value_and_row_grad")
        id_leaves, id_treedef = check_ids(ids, sel, "value_and_row_grad")
        by_table: dict[int, list[int]] = {}
        for j, i in enumerate(chosen):
            by_table.setdefault(i, []).append(j)
        lookups: dict[int, RowLookup] = {}
        positions: list[Any] = [None] * len(id_leaves)
        for i, js in by_table.items():
            flat = [id_leaves[j].reshape(-1) for j in js]
            lk = lookup(leaves[i], flat[0] if len(flat) == 1 else jnp.concatenate(flat))
            lookups[i] = lk
            start = 0
            for j, f in zip(js, flat, strict=True):
                positions[j] = lk.inverse[start : start + f.shape[0]].reshape(id_leaves[j].shape)
                start += f.shape[0]
        positions_tree = id_treedef.unflatten(positions)

        def inner(diff: list[Any]) -> Any:
            return fun(treedef.unflatten(diff), positions_tree, *args, **kwargs)

        diff = [lookups[i].rows if i in lookups else leaf for i, leaf in enumerate(leaves)]
        check_reads_rows_only(
            lambda d, pos, _: fun(treedef.unflatten(d), pos, *args, **kwargs),
            diff,
            positions_tree,
            (),
            {i: paths[i] for i in lookups},
        )
        value, grads = jax.value_and_grad(inner, has_aux=has_aux)(diff)
        grads = [lookups[i].grad(g) if i in lookups else g for i, g in enumerate(grads)]
        return value, treedef.unflatten(grads)

    return wrapped
