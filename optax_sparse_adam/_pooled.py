"""Pooled multi-hot lookups: bags of ids, each bag's rows combined into one vector.

A multi-hot feature gives each example a bag of ids (a user's last clicked
items, a document's words); the model reads the weighted sum of their rows,
or their mean, or their sum over the root of the bag's size. :class:`Bags`
holds a batch of such bags in one flat form, whatever the input's form
(padded, offsets, lengths), with the combiner folded into a weight per id:
the pooled vector of bag ``b`` is ``sum_i weights[i] * table[ids[i]]`` over
the ids ``i`` of ``b``. Since the weights are computed from the raw ids when
the bags are built, outside the loss, :func:`pool` only gathers rows at the
ids and sums them, which is all :func:`value_and_row_grad` lets a loss do
with its ids: a pooled model gets row gradients as it is.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, get_args

import jax
import jax.numpy as jnp
import numpy as np

from optax_sparse_adam._indexed_rows import as_index_array, normalise_keys
from optax_sparse_adam._row_ops import take_rows, warn_if_gpu_scatter_add_is_slow

Combiner = Literal["sum", "mean", "sqrtn"]


@dataclasses.dataclass(frozen=True)
class Bags:
    """A batch of bags of ids into one table, with a weight per id (a pytree).

    Build it with :func:`bags`; read it with :func:`pool`.

    Attributes:
      ids: ``(n,)`` int32 row ids; padding entries hold ``num_rows``.
      bag: ``(n,)`` int32 bag of each id; padding entries hold ``num_bags``.
      weights: ``(n,)`` float32 weight of each id in its bag's sum, the
        combiner folded in; ``0`` for padding.
      num_bags: Number of bags (static): the batch size.
      num_rows: Number of rows of the table (static).
      blocks: Static ``((bags, size), ...)`` when the entries are blocks of
        bags of one size each, laid out bag after bag (the padded and
        one-id forms), so that pooling is a reshape and a sum, not a
        scatter; ``None`` for ragged bags.
      parts: Static number of equal parts the entries are laid out in, one
        per device of a data-parallel step (:class:`RowSharding` with a
        ``batch_axis`` of that many devices): part ``d`` holds, block by
        block, the ``d``-th ``1/parts`` of each block's bags. Bags in one
        block are in that order for any number of parts that divides them;
        :meth:`EmbeddingCollection.bags` lays several features out so.
      combiner: Static: the combiner folded into the weights (``"sum"``,
        ``"mean"`` or ``"sqrtn"``), or ``None`` where the bags mix several
        (a stack's bags of features with different combiners).
    """

    ids: jax.Array
    bag: jax.Array
    weights: jax.Array
    num_bags: int
    num_rows: int
    blocks: tuple[tuple[int, int], ...] | None = None
    parts: int = 1
    combiner: str | None = None

    def splits_into(self, n: int) -> str:
        """Why these bags cannot be split over ``n`` devices by examples, each device pooling its own (``""``: they
        can)."""
        if n == 1:
            return ""
        if self.blocks is None:
            return "their bags are ragged (offsets or lengths), and a device's share of the entries would cut bags"
        if self.parts != n and not (self.parts == 1 and len(self.blocks) == 1):
            return (
                f"their entries are laid out in {self.parts} part(s), not one per device of the {n}; build them "
                f"for {n} (EmbeddingCollection(..., shards={n}))"
            )
        if any(nb % n for nb, _ in self.blocks):
            return f"their bags ({', '.join(str(nb) for nb, _ in self.blocks)} a block) do not split over {n} devices"
        return ""

    def part(self, n: int, ids: jax.Array, bag: jax.Array, weights: jax.Array, num_rows: int) -> Bags:
        """One device's part (``ids``, ``bag``, ``weights``, split by :meth:`splits_into`'s ``n``) as bags of its
        own over ``num_rows`` rows: its share of each block's bags, numbered from zero."""
        assert self.blocks is not None and not self.splits_into(n)
        blocks = tuple((nb // n, size) for nb, size in self.blocks)
        num_bags = sum(nb for nb, _ in blocks)
        starts = np.cumsum([0] + [nb for nb, _ in blocks])[:-1]
        local = np.concatenate(
            [np.repeat(np.arange(nb, dtype=np.int32), size) + s for (nb, size), s in zip(blocks, starts, strict=True)]
            or [np.zeros(0, np.int32)]
        )
        bag = jnp.where(bag < self.num_bags, local, num_bags).astype(jnp.int32)
        return Bags(ids, bag, weights, num_bags, num_rows, blocks, combiner=self.combiner)


jax.tree_util.register_dataclass(
    Bags, data_fields=["ids", "bag", "weights"], meta_fields=["num_bags", "num_rows", "blocks", "parts", "combiner"]
)


def bags(
    ids: jax.typing.ArrayLike,
    num_rows: int,
    *,
    offsets: jax.typing.ArrayLike | None = None,
    lengths: jax.typing.ArrayLike | None = None,
    weights: jax.typing.ArrayLike | None = None,
    combiner: Combiner = "sum",
) -> Bags:
    r"""Bags of ids for :func:`pool`, from any of the usual ragged forms.

    With per-id weights :math:`w_i` (1 by default) over the valid ids of a bag
    :math:`B`, the pooled vector is :math:`\sum_{i \in B} c_i\, e_{id_i}`
    where

    .. math::

      c_i = w_i \;(\text{sum}), \qquad
      c_i = \frac{w_i}{\sum_{j \in B} w_j} \;(\text{mean}), \qquad
      c_i = \frac{w_i}{\sqrt{\sum_{j \in B} w_j^2}} \;(\text{sqrtn}),

    as TensorFlow's and jax-tpu-embedding's combiners define them. An empty
    bag (no valid id, or weights summing to zero) pools to zeros.

    Args:
      ids: Integer ids, either ``(batch, max_len)`` (the padded form: bag
        ``b`` is row ``b``), or ``(n,)`` with ``offsets`` or ``lengths``, or
        ``(batch,)`` alone (one id per bag). Ids ``< 0`` or ``>= num_rows``
        are padding: they count for nothing, in the sum or in the mean.
      num_rows: Number of rows of the table (a static int).
      offsets: ``(batch + 1,)`` start of each bag in ``ids``, then the end of
        the last (the CSR form of TorchRec's jagged tensors); entries before
        ``offsets[0]`` or from ``offsets[-1]`` on are padding. They must be
        in order, from 0 up to at most ``n``.
      lengths: ``(batch,)`` size of each bag, the bags laid out in order from
        the start of ``ids``; entries after them are padding. They must not
        be negative, and sum to at most ``n``. Where ``offsets`` or
        ``lengths`` are known (outside ``jit``, or NumPy arrays) that is
        checked; traced, they are taken as they are.
      weights: Per-id weights, of the shape of ``ids`` (floating point).
      combiner: ``"sum"``, ``"mean"`` or ``"sqrtn"``.

    Returns:
      A :class:`Bags`.

    Examples:
      >>> import jax.numpy as jnp
      >>> import optax_sparse_adam as osa
      >>> table = jnp.arange(8.0, dtype=jnp.float32).reshape(4, 2)
      >>> b = osa.bags(jnp.array([[0, 1], [3, -1]]), 4, combiner="mean")
      >>> osa.pool(table, b)
      Array([[1., 2.],
             [6., 7.]], dtype=float32)
      >>> b = osa.bags(jnp.array([0, 1, 3]), 4, offsets=jnp.array([0, 2, 2, 3]))
      >>> osa.pool(table, b)
      Array([[2., 4.],
             [0., 0.],
             [6., 7.]], dtype=float32)
    """
    if combiner not in get_args(Combiner):
        raise ValueError(f"bags: combiner must be one of {get_args(Combiner)}, got {combiner!r}")
    if isinstance(num_rows, bool) or not isinstance(num_rows, int | np.integer) or not 0 <= num_rows < 2**31:
        raise ValueError(f"bags: num_rows must be a static int in [0, 2**31), got {num_rows!r}")
    num_rows = int(num_rows)
    ids = as_index_array(ids)
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"bags: ids must be integers, got dtype {ids.dtype}")
    split = _explicit_axes(ids) or (_explicit_axes(weights) if weights is not None else ())
    if split:
        raise ValueError(
            f"bags: the ids are split over the Explicit mesh axes {split}, where laying them out in bags would need "
            "each reshape's output sharding; build the bags before splitting them "
            "(jax.device_put(coll.bags(ids), NamedSharding(mesh, P(axis)))), or use an Auto mesh (see 'Sharded "
            "tables and many processes' in the docs)"
        )
    if offsets is not None and lengths is not None:
        raise ValueError("bags: give offsets or lengths, not both")
    w = None
    if weights is not None:
        w = jnp.asarray(weights)
        if w.shape != ids.shape:
            raise ValueError(f"bags: weights must have the shape of ids {ids.shape}, got {w.shape}")
        if not jnp.issubdtype(w.dtype, jnp.floating):
            raise TypeError(f"bags: weights must be floating point, got dtype {w.dtype}")
        w = w.reshape(-1).astype(jnp.float32)
    blocks: tuple[tuple[int, int], ...] | None = None
    if ids.ndim == 2 and offsets is None and lengths is None:
        num_bags, blocks = ids.shape[0], ((ids.shape[0], ids.shape[1]),)
        bag = jnp.repeat(jnp.arange(num_bags, dtype=jnp.int32), ids.shape[1], total_repeat_length=ids.size)
    elif ids.ndim == 1:
        if offsets is None and lengths is None:
            num_bags, blocks = ids.shape[0], ((ids.shape[0], 1),)
            bag = jnp.arange(ids.shape[0], dtype=jnp.int32)
        else:
            if lengths is not None:
                lengths = _integers("lengths", lengths)
                _check_layout("lengths", lengths, ids.shape[0])
                offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(lengths, dtype=jnp.int32)])
            else:
                offsets = _integers("offsets", offsets)
                _check_layout("offsets", offsets, ids.shape[0])
            if offsets.shape[0] < 1:
                raise ValueError("bags: offsets must hold batch + 1 entries (at least one)")
            num_bags = offsets.shape[0] - 1
            entry = jnp.arange(ids.shape[0], dtype=jnp.int32)
            bag = jnp.searchsorted(offsets, entry, side="right").astype(jnp.int32) - 1
            bag = jnp.where((bag >= 0) & (entry < offsets[-1]), bag, num_bags)
    else:
        raise ValueError(
            f"bags: ids must be (batch, max_len), or (n,) with offsets or lengths, or (batch,); got shape {ids.shape}"
        )
    keys = normalise_keys(ids.reshape(-1, 1), (num_rows,))[:, 0]
    valid = (keys < num_rows) & (bag < num_bags)
    w = jnp.ones(keys.shape, jnp.float32) if w is None else w
    w = jnp.where(valid, w, 0.0)
    if combiner != "sum":
        seg = jnp.where(valid, bag, num_bags)
        norm = w if combiner == "mean" else w * w
        total = jax.ops.segment_sum(norm, seg, num_segments=num_bags + 1)[seg]
        total = total if combiner == "mean" else jnp.sqrt(total)
        w = jnp.where(total != 0, w / jnp.where(total != 0, total, 1.0), 0.0)
    ids, bag = jnp.where(valid, keys, num_rows), jnp.where(valid, bag, num_bags).astype(jnp.int32)
    return Bags(ids, bag, w, num_bags, num_rows, blocks, combiner=combiner)


def _explicit_axes(x: Any) -> tuple[str, ...]:
    """The Explicit mesh axes ``x`` is split over (inside ``jit``, by its type), if any."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh, spec = getattr(sharding, "mesh", None), getattr(sharding, "spec", None)
    if mesh is None or spec is None:
        return ()
    explicit = {
        name
        for name, kind in zip(mesh.axis_names, getattr(mesh, "axis_types", ()), strict=False)
        if kind == jax.sharding.AxisType.Explicit
    }
    named = [a for entry in spec if entry is not None for a in (entry if isinstance(entry, tuple) else (entry,))]
    return tuple(a for a in named if a in explicit)


def _integers(name: str, x: Any) -> jax.Array:
    x = jnp.asarray(x)
    if x.ndim != 1 or not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"bags: {name} must be a 1-D integer array, got {x.dtype}{list(x.shape)}")
    return x.astype(jnp.int32)


def _check_layout(name: str, x: jax.Array, entries: int) -> None:
    """Where ``lengths`` or ``offsets`` are known (not traced), that they lay out bags within the ``entries`` ids:
    lengths not negative, offsets in order, and no bag past the last id (each would pool other entries than
    those meant, or miss some). Traced, they are taken as they are."""
    if isinstance(x, jax.core.Tracer):
        return
    v = np.asarray(x, np.int64)
    if name == "lengths":
        wrong = "a negative length" if (v < 0).any() else None
        end = int(v.sum())
    else:
        wrong = "offsets out of order" if (np.diff(v) < 0).any() or (v[:1] < 0).any() else None
        end = int(v[-1]) if v.size else 0
    if wrong is None and end > entries:
        wrong = f"bags ending at entry {end}, past the {entries} ids"
    if wrong is not None:
        raise ValueError(
            f"bags: {name} must lay out bags within the ids (lengths at least 0, offsets from 0 up, in order, the "
            f"last at most the number of ids); got {wrong}"
        )


def pool(table: jax.Array, bags: Bags) -> jax.Array:
    """The pooled vector of each bag: ``(num_bags, *row_shape)``, in the table's dtype.

    Reads the rows at ``bags.ids`` and sums each bag's, weighted, in float32
    for narrower tables. Inside a loss given to :func:`value_and_row_grad`
    (with the bags in ``ids``), ``table`` is the gathered rows and the bags'
    ids their positions, so the same call pools the same rows and the table's
    gradient comes back as row gradients.

    Args:
      table: ``(num_rows, *row_shape)``: a table, or the rows a lookup gathered.
      bags: The bags, from :func:`bags`.

    Returns:
      An array of shape ``(bags.num_bags, *table.shape[1:])``.
    """
    if not isinstance(bags, Bags):
        raise TypeError(f"pool: bags must be a Bags (from osa.bags), got {type(bags).__name__}")
    table = jnp.asarray(table)
    if table.ndim == 0 or table.shape[0] != bags.num_rows:
        raise ValueError(
            f"pool: the bags were built for a table of {bags.num_rows} rows but the table has shape {table.shape}; "
            "build them for this table (osa.bags(..., num_rows=table.shape[0])), as their ids past their rows "
            "were made padding"
        )
    warn_if_gpu_scatter_add_is_slow("pool")
    acc = jnp.promote_types(table.dtype, jnp.float32)
    rows = take_rows(table, bags.ids).astype(acc)
    weighted = rows * bags.weights.astype(acc).reshape(-1, *([1] * (table.ndim - 1)))
    if bags.blocks is None:
        return jax.ops.segment_sum(weighted, bags.bag, num_segments=bags.num_bags).astype(table.dtype)
    # Bags of one size, bag after bag: a sum over each block's second axis (its gradient a broadcast, not a
    # gather). The blocks are cut by one split, whose gradient is one concatenation (a slice's is a pad to the
    # whole: one per block). Bags in several parts: each part's share of each block, the parts in order.
    s, row = bags.parts, weighted.shape[1:]
    ends = np.cumsum([n // s * size for n, size in bags.blocks])[:-1].tolist()
    split = weighted.reshape(s, -1, *row)  # (parts, a part's entries, ...)
    blocks = jnp.split(split, ends, axis=1) if ends else [split]
    parts = [
        b.reshape(n, size, *row).sum(1) if size != 1 else b.reshape(n, *row)
        for b, (n, size) in zip(blocks, bags.blocks, strict=True)
    ]
    return (jnp.concatenate(parts) if len(parts) != 1 else parts[0]).astype(table.dtype)
