"""Row gradients for embedding tables: :func:`lookup` and :func:`value_and_row_grad`.

Differentiating a loss with respect to a whole table makes JAX build a
table-sized gradient, zeros but for the rows a batch looked up. The fast path
differentiates with respect to those rows instead: a batch's ids are
deduplicated, each distinct row is gathered once, and the model indexes the
small array of gathered rows. The gradient of that array is already summed per
distinct row, so it becomes an :class:`IndexedRows` with ``unique_indices=True``
and the optimizer step costs O(rows looked up) from end to end.

The pieces (selecting the tables, checking the ids, packing distinct ids, and
the guard that refuses a loss that uses a table, or the ids, other than to
read the ids' rows of that table) also
serve :meth:`RowSharding.value_and_row_grad`, so both paths accept and refuse
the same losses.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
import optax

from optax_sparse_adam import _catch_up, _kernel_path
from optax_sparse_adam._coalesce import distinct_ids
from optax_sparse_adam._indexed_rows import IndexedRows, as_index_array
from optax_sparse_adam._pooled import Bags
from optax_sparse_adam._row_ops import replicate, take_rows, warn_if_gpu_scatter_add_is_slow
from optax_sparse_adam._sparse_leaf import mark_distinct
from optax_sparse_adam._tree import broadcast_rows, is_leaf, path_str

__all__ = [
    "RowLookup",
    "Selection",
    "check_ids",
    "check_reads_rows_only",
    "lookup",
    "rows_read",
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
        valid = (self.indices < self.num_rows) & rows_read(self.rows)
        values = jnp.where(broadcast_rows(valid, d_rows.ndim), d_rows, jnp.zeros((), d_rows.dtype))
        return mark_distinct(IndexedRows(self.indices, values, self.num_rows, unique_indices=True))


def rows_read(rows: jax.Array) -> jax.Array:
    """``True`` for each row, computed from the row's first value (its bits OR 1 are never 0).

    The table's gradient goes through it, so it depends on the rows read: XLA
    then reads the table before the step updates it in place. A loss linear in
    the rows has a gradient that does not depend on them otherwise, and XLA
    copied the whole donated table to keep the read and the write apart.
    """
    width = math.prod(rows.shape[1:])
    if width == 0 or rows.shape[0] == 0:  # nothing to read (and reshape(0, -1) has no answer)
        return jnp.ones(rows.shape[0], bool)
    flat = rows.reshape(rows.shape[0], width)
    first = flat[:, 0]
    if jnp.iscomplexobj(first):
        first = jnp.real(first)
    bits = jax.lax.bitcast_convert_type(first, jnp.dtype(f"uint{first.dtype.itemsize * 8}"))
    return (bits | 1) != 0


jax.tree_util.register_dataclass(RowLookup, data_fields=["indices", "rows", "inverse"], meta_fields=["num_rows"])


def lookup(table: jax.Array, ids: jax.typing.ArrayLike) -> RowLookup:
    """Deduplicates ``ids`` and gathers each distinct row of ``table`` once.

    Deduplication works on the ``k`` ids alone and costs O(k), independent of the table's size (a few rounds of
    hashing and scatters; on GPUs one sort of the ids instead, O(k log k)). Differentiate
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
    ids = as_index_array(ids)
    _check_table("lookup", "the table", table.shape)
    _check_ids_dtype("lookup", "the table", ids.dtype)
    indices, inverse = distinct_ids(replicate(ids.reshape(-1)), table.shape[0])
    rows = take_rows(table, indices)
    return RowLookup(indices, rows, inverse.reshape(ids.shape), table.shape[0])


# What the guard knows of a value in the loss's jaxpr. A value it knows nothing of (None) is an ordinary one: it may
# feed anything but a table's rows.
@dataclasses.dataclass(frozen=True)
class _Table:
    """A selected table's gathered rows, or a view of them (a cast, a copy)."""

    leaf: int


@dataclasses.dataclass(frozen=True)
class _Param:
    """Another leaf of the parameters, or a view of it: an ordinary value, tracked to be named in messages."""

    leaf: int


@dataclasses.dataclass(frozen=True)
class _Positions:
    """Positions of ids in the rows of a table in ``owners``, moved about by shape-only ops.

    With ``cols`` None every element is a position; otherwise the value holds a gather's index vectors (its last
    axis), whose columns ``cols`` are positions and whose other columns are ordinary values (``t[ids, 0]``).
    """

    owners: frozenset[int]
    cols: frozenset[int] | None = None


@dataclasses.dataclass(frozen=True)
class _Wrapped:
    """``lt(p, 0)`` or ``add(p, c)`` of positions ``p``: how jnp indexing wraps negative indices.

    Only ``select_n(lt(p, 0), p, add(p, c))`` may use them; it gives ``p``, since positions are never negative.
    """

    owners: frozenset[int]
    origin: str  # the primitive that made it: "lt" or "add"


@dataclasses.dataclass(frozen=True)
class _Const:
    """A scalar constant: a literal, or one that ``pvary`` marks as varying over a mesh axis."""

    value: Any


_Kind = _Table | _Param | _Positions | _Wrapped | _Const | None


class _Guard(NamedTuple):
    paths: dict[int, str]  # the tables' paths, and the other parameters' where known, by leaf number
    bound: int  # the most rows a table holds inside `fun`: a cast of positions must hold every position


# Primitives that hand on a table unchanged in value (a view of it): their result is still "the table".
_TABLE_VIEWS = frozenset({"convert_element_type", "copy", "copy_p", "stop_gradient", "reduce_precision"})
# Primitives that only move elements about: applied to positions, their result holds positions.
_SHAPE_OPS = frozenset(
    {"reshape", "squeeze", "expand_dims", "broadcast_in_dim", "slice", "transpose", "rev", "copy", "copy_p"}
)


def _tracked(kind: _Kind) -> bool:
    """Whether a value is a table or comes from the positions: the guard checks every use of such values."""
    return isinstance(kind, _Table | _Positions | _Wrapped)


def _flat_positions(kind: _Kind) -> bool:
    return isinstance(kind, _Positions) and kind.cols is None


def _check_uses(jaxpr: Any, kinds: dict[Any, _Kind], guard: _Guard) -> list[_Kind]:
    """Raises unless ``jaxpr`` reads each table only at the positions of its ids, and uses positions for nothing else.

    Args:
      jaxpr: A ``jax.extend.core.Jaxpr``.
      kinds: What is known of its input variables (tables, other parameters, positions).
      guard: The paths for messages, and the bound on positions.

    Returns:
      What is known of its outputs.
    """
    kinds = dict(kinds)

    def kind(v: Any) -> _Kind:
        if isinstance(v, jex.Literal):
            return _Const(np.asarray(v.val).item()) if np.ndim(v.val) == 0 else None
        return kinds.get(v) if isinstance(v, jex.Var) else None

    for eqn in jaxpr.eqns:
        ins = [kind(v) for v in eqn.invars]
        if any(k is not None and not isinstance(k, _Const) for k in ins) or eqn.primitive.name == "pvary":
            for v, k in zip(eqn.outvars, _eqn_kinds(eqn, ins, guard), strict=True):
                if k is not None:
                    kinds[v] = k
    return [kind(v) for v in jaxpr.outvars]


def _eqn_kinds(eqn: Any, ins: list[_Kind], guard: _Guard) -> list[_Kind]:
    """What is known of the outputs of ``eqn``, whose inputs are ``ins``; raises on a use the guard refuses."""
    name = eqn.primitive.name
    first, rest_plain = ins[0], not any(_tracked(k) for k in ins[1:])
    if name == "gather":
        return [_gather(eqn, ins, guard)]
    if name == "dynamic_slice":
        return [_dynamic_slice(eqn, ins, guard)]
    if name == "concatenate":
        return [_concatenate(eqn, ins, guard)]
    if name == "cond":
        return _cond(eqn, ins, guard)
    if name in ("scan", "while"):
        return _loop(eqn, ins, guard)
    if name == "pvary":  # marks values as varying over mesh axes (inside shard_map), unchanged
        return ins
    if name == _kernel_path.select_p.name:  # a kernel or the XLA path, computing alike: judged by the XLA path
        xla = _inner(eqn.params["xla"])
        return _check_uses(xla, dict(zip(xla.invars, ins, strict=True)), guard)
    subs = [p for p in eqn.params.values() if isinstance(p, jex.ClosedJaxpr | jex.Jaxpr)]
    if len(subs) == 1 and len(_inner(subs[0]).invars) == len(ins):  # jit, custom_jvp/vjp, remat: forward into it
        inner = _inner(subs[0])
        return _check_uses(inner, dict(zip(inner.invars, ins, strict=True)), guard)
    if isinstance(first, _Table | _Param) and name in _TABLE_VIEWS and rest_plain:
        return [first]
    if _flat_positions(first) and rest_plain:
        assert isinstance(first, _Positions)
        if name in _SHAPE_OPS:
            return [first]
        if name == "convert_element_type" and _holds(eqn.params["new_dtype"], guard.bound):
            return [first]
        if name == "lt" and ins[1] == _Const(0):
            return [_Wrapped(first.owners, "lt")]
        if name == "add" and isinstance(ins[1], _Const):
            return [_Wrapped(first.owners, "add")]
    if (
        name == "select_n"
        and isinstance(first, _Wrapped)
        and first.origin == "lt"
        and isinstance(ins[1], _Positions)
        and ins[1].cols is None
        and all(_flat_positions(k) or (isinstance(k, _Wrapped) and k.origin == "add") for k in ins[2:])
    ):
        return [ins[1]]  # select_n(p < 0, p, p + c) is p: jnp indexing's wrapping of negative indices
    if not any(_tracked(k) for k in ins):
        return [None] * len(eqn.outvars)  # parameters other than the tables are ordinary values
    raise _refusal(name, ins, guard)


def _gather(eqn: Any, ins: list[_Kind], guard: _Guard) -> _Kind:
    operand, indices = ins
    if isinstance(indices, _Positions) and not isinstance(operand, _Positions | _Wrapped):
        if not isinstance(operand, _Table):
            what = (
                f"parameter {guard.paths[operand.leaf]}, which `tables` does not select,"
                if isinstance(operand, _Param)
                else "an array that `tables` does not select"
            )
            raise _misuse_ids(indices.owners, f"`gather` indexes {what} with them", guard)
        table = guard.paths[operand.leaf]
        if operand.leaf not in indices.owners:
            raise _misuse_ids(indices.owners, f"`gather` indexes table {table} with them", guard)
        dims = eqn.params["dimension_numbers"]
        cols = range(eqn.invars[1].aval.shape[-1]) if indices.cols is None else sorted(indices.cols)
        axes = [dims.start_index_map[c] for c in cols]
        if axes != [0] or 0 in dims.operand_batching_dims:
            axis = next((a for a in axes if a != 0), 0)
            raise _misuse_ids(indices.owners, f"`gather` indexes axis {axis} of table {table} with them", guard)
        if eqn.params["slice_sizes"][0] != 1:
            raise _misuse_ids(indices.owners, f"`gather` reads several rows of table {table} from each", guard)
        return None
    if isinstance(operand, _Table) and not _tracked(indices):
        raise _misuse(guard.paths[operand.leaf], "it is indexed at positions that do not come from the ids (gather)")
    if _flat_positions(operand) and not _tracked(indices):
        return operand  # positions picked out at ordinary indices: still positions
    if not _tracked(operand) and not _tracked(indices):
        return None
    raise _refusal("gather", ins, guard)


def _dynamic_slice(eqn: Any, ins: list[_Kind], guard: _Guard) -> _Kind:
    operand, starts = ins[0], ins[1:]
    if isinstance(operand, _Table):
        table = guard.paths[operand.leaf]
        if not any(_tracked(k) for k in starts):
            raise _misuse(table, "it is indexed at positions that do not come from the ids (dynamic_slice)")
        row = starts[0]
        if _flat_positions(row) and not any(_tracked(k) for k in starts[1:]):
            assert isinstance(row, _Positions)
            if operand.leaf not in row.owners:
                raise _misuse_ids(row.owners, f"`dynamic_slice` indexes table {table} with them", guard)
            if eqn.params["slice_sizes"][0] != 1:
                raise _misuse_ids(row.owners, f"`dynamic_slice` reads several rows of table {table} from each", guard)
            return None
        for axis, k in enumerate(starts[1:], start=1):
            if isinstance(k, _Positions):
                raise _misuse_ids(k.owners, f"`dynamic_slice` indexes axis {axis} of table {table} with them", guard)
        raise _refusal("dynamic_slice", ins, guard)
    if not any(_tracked(k) for k in starts):
        return operand if _flat_positions(operand) else _eqn_plain(eqn, ins, guard)
    positions = next((k for k in starts if isinstance(k, _Positions)), None)
    if positions is not None and not _tracked(operand):
        what = (
            f"parameter {guard.paths[operand.leaf]}, which `tables` does not select,"
            if isinstance(operand, _Param)
            else "an array that `tables` does not select"
        )
        raise _misuse_ids(positions.owners, f"`dynamic_slice` indexes {what} with them", guard)
    raise _refusal("dynamic_slice", ins, guard)


def _eqn_plain(eqn: Any, ins: list[_Kind], guard: _Guard) -> _Kind:
    if any(_tracked(k) for k in ins):
        raise _refusal(eqn.primitive.name, ins, guard)
    return None


def _concatenate(eqn: Any, ins: list[_Kind], guard: _Guard) -> _Kind:
    if not any(_tracked(k) for k in ins):
        return None
    if any(isinstance(k, _Table | _Wrapped) for k in ins):
        raise _refusal("concatenate", ins, guard)
    owners = frozenset.intersection(*(k.owners for k in ins if isinstance(k, _Positions)))
    if all(_flat_positions(k) for k in ins):
        return _Positions(owners)
    # Positions beside ordinary values along the last axis: the index vectors of `t[ids, 0]` or `t[ids, :2]`.
    dim = eqn.params["dimension"]
    if dim != len(eqn.outvars[0].aval.shape) - 1:
        raise _misuse_ids(owners, "`concatenate` joins them to other values", guard)
    cols: set[int] = set()
    start = 0
    for v, k in zip(eqn.invars, ins, strict=True):
        width = v.aval.shape[dim]
        if isinstance(k, _Positions):
            cols.update(range(start, start + width) if k.cols is None else (start + c for c in k.cols))
        start += width
    return _Positions(owners, frozenset(cols))


def _cond(eqn: Any, ins: list[_Kind], guard: _Guard) -> list[_Kind]:
    if _tracked(ins[0]):
        raise _refusal("cond", ins[:1], guard)  # a branch chosen by the positions, not the ids
    outs = []
    for branch in eqn.params["branches"]:
        inner = _inner(branch)
        outs.append(_check_uses(inner, dict(zip(inner.invars, ins[1:], strict=True)), guard))
    joined: list[_Kind] = []
    for ks in zip(*outs, strict=True):
        if all(k == ks[0] for k in ks):
            joined.append(ks[0])
        elif all(_flat_positions(k) for k in ks):
            joined.append(_Positions(frozenset.intersection(*(k.owners for k in ks if isinstance(k, _Positions)))))
        elif not any(_tracked(k) for k in ks):
            joined.append(None)
        else:  # a table or positions from some branches only
            raise _refusal("cond", list(ks), guard, "returns {} from some branches only")
    return joined


def _loop(eqn: Any, ins: list[_Kind], guard: _Guard) -> list[_Kind]:
    """``scan`` and ``while``: positions may be loop constants or scanned over, never carried."""
    name, params = eqn.primitive.name, eqn.params
    if name == "scan":
        n_consts, n_carry = _scan_counts(params)
        consts, carry, xs = ins[:n_consts], ins[n_consts : n_consts + n_carry], ins[n_consts + n_carry :]
    else:
        n_consts = params["cond_nconsts"] + params["body_nconsts"]
        consts, carry, xs = ins[:n_consts], ins[n_consts:], []
    for k in carry:
        if isinstance(k, _Positions | _Wrapped):
            raise _misuse_ids(k.owners, f"`{name}` carries them from step to step", guard)
    for k in xs:
        if _tracked(k) and not _flat_positions(k):
            raise _refusal(name, [k], guard)
    if name == "scan":
        body = _inner(params["jaxpr"])
        outs = _check_uses(body, dict(zip(body.invars, ins, strict=True)), guard)
        carry_out, ys = outs[:n_carry], outs[n_carry:]
    else:
        cond, body = _inner(params["cond_jaxpr"]), _inner(params["body_jaxpr"])
        n_cond = params["cond_nconsts"]
        (pred,) = _check_uses(cond, dict(zip(cond.invars, [*consts[:n_cond], *carry], strict=True)), guard)
        if _tracked(pred):
            raise _refusal(name, [pred], guard)
        carry_out = _check_uses(body, dict(zip(body.invars, [*consts[n_cond:], *carry], strict=True)), guard)
        ys = []
    for k_in, k_out in zip(carry, carry_out, strict=True):
        if (_tracked(k_in) or _tracked(k_out)) and k_in != k_out:
            raise _refusal(name, [k_out if _tracked(k_out) else k_in], guard)
    for k in ys:
        if _tracked(k) and not _flat_positions(k):
            raise _refusal(name, [k], guard)
    return [*(k if _tracked(k) else None for k in carry), *(k if _tracked(k) else None for k in ys)]


def _scan_counts(params: dict[str, Any]) -> tuple[int, int]:
    """How many of a ``scan``'s operands are loop constants and how many the carry, the scanned ``xs`` after them.

    Up to jax 0.10 the equation counts them (``num_consts``, ``num_carry``); from jax 0.11 its ``ft_in`` holds the
    three groups as a flat tree of (consts, carry, xs), the structure jax's own scan rules unpack.
    """
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


def _inner(jaxpr: Any) -> Any:
    return jaxpr.jaxpr if isinstance(jaxpr, jex.ClosedJaxpr) else jaxpr


def _holds(dtype: Any, bound: int) -> bool:
    return bool(jnp.issubdtype(dtype, jnp.integer)) and int(jnp.iinfo(dtype).max) >= bound - 1


def _refusal(name: str, ins: list[_Kind], guard: _Guard, how: str = "") -> ValueError:
    """The error for primitive ``name`` using a table or positions among ``ins`` as the guard does not allow.

    ``how`` says what ``name`` does with them, ``{}`` standing for "it" or "them"; by default it reads a table and
    computes with positions.
    """
    for k in ins:
        if isinstance(k, _Table):
            return _misuse(guard.paths[k.leaf], f"`{name}` {(how or 'reads {}').format('it')}")
    for k in ins:
        if isinstance(k, _Wrapped):  # blame the computation, not what jnp indexing does with its result
            return _misuse_ids(k.owners, f"`{k.origin}` computes with them", guard)
        if isinstance(k, _Positions) and k.cols is not None:
            return _misuse_ids(k.owners, "`concatenate` joins them to other values", guard)
        if isinstance(k, _Positions):
            return _misuse_ids(k.owners, f"`{name}` {(how or 'computes with {}').format('them')}", guard)
    raise AssertionError(f"_refusal({name}): no table or positions among the inputs")


def _misuse(table: str, how: str) -> ValueError:
    return ValueError(
        f"value_and_row_grad: the loss uses table {table} other than by indexing it with the ids ({how}). Inside "
        "`fun` the table holds only the rows the batch looks up, so a term over the whole table (an L2 penalty, "
        "tied input/output embeddings, a softmax over all rows) would be computed on those rows and be silently "
        "wrong. Index tables only with the given ids; compute whole-table terms outside `fun` (an L2 penalty "
        "becomes weight decay on the touched rows: sparse_aware(optax.add_decayed_weights(...))), or use "
        "jax.value_and_grad with lazy_dense for such a table."
    )


def _misuse_ids(owners: frozenset[int], how: str, guard: _Guard) -> ValueError:
    whose = f"for table {' or '.join(guard.paths[i] for i in sorted(owners))}" if owners else "of several tables"
    return ValueError(
        f"value_and_row_grad: the loss uses the ids {whose} other than by indexing it with the ids ({how}). "
        "Inside `fun` each id is replaced by its position in the rows the batch looks up, so arithmetic on the ids, "
        "a mask or feature computed from them, or another array indexed with them would be silently wrong. Do "
        "arithmetic on the ids before the lookup (pass `ids + 1` as the ids, not `table[ids + 1]`); compute masks "
        "and features from the raw ids outside `fun` and pass them in as an extra argument; select in `tables` "
        "every parameter the ids index (a per-id bias, a second table), each paired with its own array of ids."
    )


def check_reads_rows_only(
    fun: Callable[[Any, Any, Any], Any],
    rows: list[Any],
    positions: Any,
    extra: Any,
    tables: dict[int, str],
    *,
    axis_env: Sequence[tuple[str, int]] | None = None,
    selection: Selection | None = None,
) -> None:
    """Raises unless ``fun(rows, positions, extra)`` uses the tables and the positions only to read rows.

    Traces ``fun`` once with :func:`jax.make_jaxpr` (no compute: ``rows`` and
    ``extra`` may hold :class:`jax.ShapeDtypeStruct` placeholders) and walks
    its jaxpr, into ``jit``, ``cond``, ``scan``, ``while``, ``custom_jvp``,
    ``custom_vjp`` and ``remat``. A table (``rows[i]`` for ``i`` in
    ``tables``) may be viewed (cast, copied) and gathered along its rows (axis
    0) at its own ids' positions, and nothing else. The positions may reach
    such a gather through shape-only ops (reshape, squeeze, broadcast, slice,
    transpose, concatenation of positions, casts to an integer type that holds
    them) and the wrapping of negative indices that jnp indexing emits
    (``select_n(p < 0, p, p + n)``), and nothing else: not arithmetic, not a
    comparison, not another array, not a loop's carry, not the outputs.
    ``extra`` is traced too, as ordinary values.

    Args:
      fun: The loss on the gathered rows, as a function of three trees.
      rows: The parameters' leaves, each table replaced by its gathered rows.
      positions: The positions of the ids in the gathered rows.
      extra: Further traced arguments of ``fun``.
      tables: The tables' leaf numbers in ``rows`` and their paths, for the message.
      axis_env: Mesh axes bound while tracing (``fun`` runs inside ``shard_map``).
      selection: The parameters' :class:`Selection`: pairs each leaf of
        ``positions`` with its table and names the other parameters in
        messages. Without it, positions may index any of the tables.
    """
    probe = jax.make_jaxpr(fun, axis_env=axis_env)(rows, positions, extra)
    invars = probe.jaxpr.invars
    n_rows, n_positions = len(jax.tree.leaves(rows)), len(jax.tree.leaves(positions))
    row_vars = jax.tree.unflatten(jax.tree.structure(rows), invars[:n_rows])
    kinds: dict[Any, _Kind] = {}
    paths = dict(tables)
    if selection is not None:
        paths = {**dict(enumerate(selection.paths)), **paths}
        kinds.update({v: _Param(i) for i, v in enumerate(row_vars) if isinstance(v, jex.Var) and i not in tables})
    kinds.update({row_vars[i]: _Table(i) for i in tables})
    owners = [frozenset(tables)] * n_positions if selection is None else [frozenset({i}) for i in selection.chosen]
    kinds.update({v: _Positions(o) for v, o in zip(invars[n_rows : n_rows + n_positions], owners, strict=True)})
    bound = max((int(row_vars[i].aval.shape[0]) for i in tables), default=0)
    guard = _Guard(paths, bound)
    for k in _check_uses(probe.jaxpr, kinds, guard):
        if isinstance(k, _Table):
            raise _misuse(paths[k.leaf], "`fun` returns it")
        if isinstance(k, _Positions | _Wrapped):
            raise _misuse_ids(k.owners, "`fun` returns them", guard)


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


class Ids(NamedTuple):
    """The ids a caller gave, one entry per selected table: an integer array, or the ids of a :class:`Bags`."""

    leaves: list[jax.Array]  # the ids to look up
    bags: list[Bags | None]  # the Bags each came from, if any
    treedef: Any  # of the ids tree, a Bags as one leaf

    def with_positions(
        self, positions: list[Any], rows: list[Any], rest: list[Any] | None = None, parts: int = 1
    ) -> Any:
        """The ids tree with each array of ids replaced by its positions (a Bags keeps its weights).

        ``rows`` are the gathered rows the positions index, one array per entry of ``positions``: a Bags becomes
        bags of their rows, as :func:`pool` checks. ``rest`` replaces the Bags' other fields (``(bag, weights)`` per
        Bags), as :meth:`rest` lists them. With ``parts`` (one device's share of a batch split over that many), each
        Bags becomes the device's own bags (:meth:`Bags.part`).
        """
        rest = self.rest() if rest is None else rest

        def one(p: Any, b: Bags | None, r: Any, gathered: Any) -> Any:
            if b is None:
                return p
            n = int(jnp.shape(gathered)[0])
            if parts == 1:
                return dataclasses.replace(b, ids=p, bag=r[0], weights=r[1], num_rows=n)
            return b.part(parts, p, r[0], r[1], n)

        return self.treedef.unflatten([one(*x) for x in zip(positions, self.bags, rest, rows, strict=True)])

    def rest(self) -> list[Any]:
        """Each Bags' fields other than its ids (``None`` for plain ids), as :meth:`with_positions` takes them."""
        return [None if b is None else (b.bag, b.weights) for b in self.bags]


def check_ids(ids: Any, selection: Selection, where: str) -> Ids:
    """``ids``'s leaves, one integer array (or :class:`Bags`) per selected table."""
    id_treedef: Any
    id_leaves, id_treedef = jax.tree.flatten(ids, is_leaf=lambda x: isinstance(x, Bags))
    chosen, paths = selection.chosen, selection.paths
    if len(id_leaves) != len(chosen):
        raise ValueError(
            f"{where}: `tables` selected {len(chosen)} table(s) ({', '.join(paths[i] for i in chosen)}) "
            f"but `ids` holds {len(id_leaves)} array(s); give one array of ids per selected table"
        )
    found: list[Bags | None] = [x if isinstance(x, Bags) else None for x in id_leaves]
    arrays = []
    for i, x, b in zip(chosen, id_leaves, found, strict=True):
        if b is None:
            arrays.append(as_index_array(x))
            _check_ids_dtype(where, f"table {paths[i]}", arrays[-1].dtype)
            continue
        rows = int(jnp.shape(selection.leaves[i])[0])
        if b.num_rows != rows:
            raise ValueError(
                f"{where}: the Bags for table {paths[i]} were built for {b.num_rows} rows, but the table has "
                f"{rows}; build them with osa.bags(ids, {rows}, ...)"
            )
        arrays.append(b.ids)
    return Ids(arrays, found, id_treedef)


def _check_table(where: str, name: str, shape: tuple[int, ...]) -> None:
    if not shape:
        raise ValueError(f"{where}: {name} must have at least one axis (its rows), got a scalar")


def _check_ids_dtype(where: str, name: str, dtype: Any) -> None:
    if not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"{where}: the ids for {name} must be integers, got dtype {dtype}")


def _caught_up(
    lookups: dict[int, RowLookup], tx: Any, opt_state: Any, params: Any, treedef: Any
) -> dict[int, RowLookup]:
    """The lookups with each row's idle steps replayed, as ``tx`` (a catch-up optimizer) will replay them."""
    where = "value_and_row_grad(..., catch_up=tx)"
    if opt_state is None:
        raise TypeError(f"{where}: pass the optimizer's state as the keyword argument opt_state")
    replay, state = _catch_up.find(tx, opt_state, where, treedef)
    last, *moments = (_catch_up.state_leaves(getattr(state, f)) for f in ("last_step", *replay.moments))
    infos, out = replay.leaf_infos(params), {}
    path_leaves = jax.tree_util.tree_leaves_with_path(params, is_leaf=is_leaf)
    for i, lk in lookups.items():
        if isinstance(last[i], optax.MaskedNode):
            raise ValueError(
                f"{where}: table {i} of the tables is not trained by the catch-up optimizer given (its state holds "
                "no rows for it): pass the optimizer that trains the tables, e.g. partition_tables' tables_tx"
            )
        path, table = path_leaves[i]
        replay.check_shapes(where, path, jnp.shape(table), last[i], tuple(x[i] for x in moments))
        taken = tuple(take_rows(x[i], lk.indices) for x in moments)
        rows, _ = replay.replay(lk.rows, taken, take_rows(last[i], lk.indices), state, infos[i])
        out[i] = dataclasses.replace(lk, rows=rows)
    return out


def value_and_row_grad(
    fun: Callable[..., Any], tables: Callable[[Any], Any], *, has_aux: bool = False, catch_up: Any = None
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

    A row read at several ids gets the sum of their gradients, which autodiff
    writes as a scatter-add: XLA:GPU sums its colliding updates in no fixed
    order, so on a GPU the row gradients may differ by an ulp from run to run
    (``XLA_FLAGS=--xla_gpu_deterministic_ops=true`` makes them repeat), and
    jaxlib 0.10.2 to 0.11.0 run it far slower there (a ``RuntimeWarning`` says
    so; use jaxlib 0.11.1 or newer).

    Since ``fun`` sees rows and positions, not tables and ids, it may use each
    table only by reading its rows at its own ids (``table[ids]``,
    ``jnp.take(table, ids, axis=0)``, ``table[ids, 0]``, through reshapes,
    slices, ``jit``, ``cond``, ``scan``), and the ids for nothing else. Before
    any compute, this refuses with a ``ValueError`` a ``fun`` that reads a
    whole table (an L2 penalty, a softmax over all rows), computes with the
    ids (``table[ids + 1]``, ``table[ids % n]``, a mask ``ids != 0``, a
    feature), indexes a parameter that ``tables`` does not select with them
    (a per-id bias), or indexes a table's other axes with them: compute such
    terms from the raw ids outside ``fun`` and pass them in, or select the
    parameter in ``tables`` too.

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
      catch_up: An optimizer built with ``catch_up=True``
        (:func:`sparse_adam`, :func:`sparse_adamw`, :func:`sparse_amsgrad`, or
        :func:`sparse_sgd` with momentum): the returned function then takes its state as the
        keyword argument ``opt_state`` and hands ``fun`` each row as the dense
        optimizer would hold it,
        with the steps the row sat out replayed (the optimizer's ``update``
        replays them again and writes them back). Without it ``fun`` reads
        the rows as they are stored, lagging by their idle steps.

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
        warn_if_gpu_scatter_add_is_slow("value_and_row_grad")
        opt_state = kwargs.pop("opt_state", None) if catch_up is not None else None
        leaves, paths, chosen, treedef = sel = select_tables(params, tables, "value_and_row_grad")
        given = check_ids(ids, sel, "value_and_row_grad")
        id_leaves = given.leaves
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
        if catch_up is not None:
            lookups = _caught_up(lookups, catch_up, opt_state, params, treedef)
        positions_tree = given.with_positions(positions, [lookups[i].rows for i in chosen])

        def inner(diff: list[Any]) -> Any:
            return fun(treedef.unflatten(diff), positions_tree, *args, **kwargs)

        diff = [lookups[i].rows if i in lookups else leaf for i, leaf in enumerate(leaves)]
        check_reads_rows_only(  # a Bags' bag and weights are ordinary values, not positions
            lambda d, pos, rest: fun(
                treedef.unflatten(d), given.with_positions(pos, [d[i] for i in chosen], rest), *args, **kwargs
            ),
            diff,
            positions,
            given.rest(),
            {i: paths[i] for i in lookups},
            selection=sel,
        )
        value, grads = jax.value_and_grad(inner, has_aux=has_aux)(diff)
        grads = [lookups[i].grad(g) if i in lookups else g for i, g in enumerate(grads)]
        return value, treedef.unflatten(grads)

    return wrapped
