"""Many tables and features in one pass: :class:`EmbeddingCollection`.

A recommender reads dozens of tables, some through several features. Looked
up one by one, every table pays its own deduplication and its own optimizer
call (sharded, the tables of a step share its exchanges either way). The
collection stacks the tables of one width and dtype into one parameter (as
FBGEMM's table-batched embeddings and jax-tpu-embedding's stacked tables do)
and shifts each feature's ids by its table's first row, so a step over all
of them does one lookup, one deduplication and one optimizer pass per stack.
The stacks are ordinary
arrays: every optimizer, :func:`update_and_apply`, :class:`RowSharding` and
checkpointing take them as they take one table.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any, get_args

import jax
import jax.numpy as jnp
import numpy as np

from optax_sparse_adam._indexed_rows import as_index_array, normalise_keys
from optax_sparse_adam._pooled import Bags, Combiner, bags, pool
from optax_sparse_adam._row_ops import explicit_sharding

__all__ = ["EmbeddingCollection", "FeatureSpec", "TableSpec"]

Initializer = Callable[[jax.Array, tuple[int, ...], Any], jax.Array]


@dataclasses.dataclass(frozen=True)
class TableSpec:
    """One embedding table.

    Attributes:
      num_rows: Its vocabulary size.
      width: Its embedding width.
      dtype: Its dtype.
      initializer: ``init(key, shape, dtype)``; by default that of
        ``flax.nnx.Embed`` (variance scaling 1, fan-in over the width).
    """

    num_rows: int
    width: int
    dtype: Any = jnp.float32
    initializer: Initializer | None = None

    def __post_init__(self) -> None:
        for name in ("num_rows", "width"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < (name == "width"):
                raise ValueError(f"TableSpec: {name} must be a non-negative int (width positive), got {value!r}")
        if not jnp.issubdtype(self.dtype, jnp.floating):
            raise TypeError(f"TableSpec: dtype must be floating point, got {self.dtype}")


@dataclasses.dataclass(frozen=True)
class FeatureSpec:
    """One feature: the table it reads, and how it combines a bag's rows (see :func:`bags`)."""

    table: str
    combiner: Combiner = "sum"


_DEFAULT_INIT = jax.nn.initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0)


@functools.partial(jax.jit, static_argnums=1)
def _default_tables(keys: tuple[jax.Array, ...], specs: tuple[tuple[int, int, Any], ...]) -> list[jax.Array]:
    """Tables of ``(rows, width, dtype)`` drawn by the default initializer, one from each key."""
    # A table of no rows has no fan-in for the initializer's scale (it divides by it): it holds nothing to draw.
    return [
        jnp.asarray(_DEFAULT_INIT(k, (rows, width), dtype), dtype) if rows > 0 else jnp.zeros((0, width), dtype)
        for k, (rows, width, dtype) in zip(keys, specs, strict=True)
    ]


@dataclasses.dataclass(frozen=True, eq=False)
class EmbeddingCollection:
    """Tables and the features that read them, stacked by width and dtype.

    The parameters are a dict with one ``(rows, width)`` array per stack,
    named ``f"{dtype}_{width}"`` (``"float32_16"``; ``"float32_16_shards8"``
    laid out for 8 devices, see below); a table is a block of its stack's
    rows (:meth:`table`), and :meth:`stack` lays tables out as stacks. A
    step builds the batch's bags with
    :meth:`bags` and pools them with :meth:`pool`, inside a loss given to
    :func:`value_and_row_grad` with the stacks as its tables and the bags as
    their ids:

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import optax_sparse_adam as osa
      >>> coll = osa.EmbeddingCollection(
      ...     tables={"user": osa.TableSpec(1000, 8), "item": osa.TableSpec(500, 8)},
      ...     features={"user": osa.FeatureSpec("user"), "history": osa.FeatureSpec("item", "mean"),
      ...               "candidate": osa.FeatureSpec("item")},
      ... )
      >>> params = {"emb": coll.init(jax.random.key(0)), "w": jnp.ones((8,), jnp.float32)}
      >>> {k: v.shape for k, v in params["emb"].items()}
      {'float32_8': (1500, 8)}
      >>> batch = coll.bags({"user": jnp.array([3, 7]), "history": jnp.array([[1, 2, -1], [4, -1, -1]]),
      ...                    "candidate": jnp.array([9, 2])})
      >>> def loss(p, batch):
      ...   f = coll.pool(p["emb"], batch)
      ...   return jnp.sum((f["user"] + f["history"]) * f["candidate"] @ p["w"])
      >>> value, grads = osa.value_and_row_grad(loss, lambda p: p["emb"])(params, batch)
      >>> g = grads["emb"]["float32_8"]  # row gradients of the one stack: an osa.IndexedRows
      >>> int(jnp.sum(jnp.any(g.todense() != 0, axis=1)))  # rows touched: 3, 7 of user; 1, 2, 4, 9 of item
      6

    Split over devices by :class:`RowSharding`, a stack is cut into equal
    blocks of rows, one a device. With ``shards`` set to that number of
    devices, each block holds an even share of every table (table ``t``'s
    row ``i`` is in block ``i // ceil(rows_t / shards)``), so every device
    owns a share of every table, not whole tables, and the ids of all the
    stack's tables share one bucket per owner on the all-to-all route; and
    :meth:`bags` lays each stack's entries out in one part per device
    (``Bags.parts``), so that a data-parallel step (``batch_axis``)
    splits the bags by examples (where every feature splits: a ragged
    feature or a batch that does not divide gives bags in one part, which
    pool anywhere but on such a step). A table's rows are then padded to a
    multiple of ``shards``; the padding rows are never read. Parameters of
    one layout do not pass for another's (the stacks' names differ):
    ``new.stack({n: old.table(params, n) for n in old.tables})`` moves them.

    Attributes:
      tables: Name to :class:`TableSpec`.
      features: Name to :class:`FeatureSpec`; by default one ``"sum"``
        feature per table, of the table's name.
      shards: The number of devices the stacks will be split over by rows
        (1: not split, the tables one after another).
    """

    tables: Mapping[str, TableSpec]
    features: Mapping[str, FeatureSpec] | None = None
    shards: int = 1

    def __post_init__(self) -> None:
        tables = dict(self.tables)
        for name, t in tables.items():
            if not isinstance(t, TableSpec):
                raise TypeError(f"EmbeddingCollection: table {name!r} must be a TableSpec, got {type(t).__name__}")
        features = {n: FeatureSpec(n) for n in tables} if self.features is None else dict(self.features)
        for name, f in features.items():
            if not isinstance(f, FeatureSpec):
                raise TypeError(f"EmbeddingCollection: feature {name!r} must be a FeatureSpec, got {type(f).__name__}")
            if f.table not in tables:
                raise ValueError(
                    f"EmbeddingCollection: feature {name!r} reads table {f.table!r}, which is not among the "
                    f"tables {sorted(tables)}"
                )
            if f.combiner not in get_args(Combiner):
                raise ValueError(
                    f"EmbeddingCollection: feature {name!r} combines its bags by {f.combiner!r}; the combiner must "
                    f"be one of {get_args(Combiner)}"
                )
        shards = self.shards
        if isinstance(shards, bool) or not isinstance(shards, int | np.integer) or shards < 1:
            raise ValueError(f"EmbeddingCollection: shards must be a positive int, got {shards!r}")
        stacks: dict[str, list[str]] = {}
        for name, t in tables.items():
            stacks.setdefault(self._stack_key(t, shards), []).append(name)
        offsets, blocks = {}, {}
        shares = {n: -(-t.num_rows // shards) for n, t in tables.items()}  # each table's rows in a block
        for key, names in stacks.items():
            start = 0  # each table's first row in a block of the stack, and the block's rows
            for n in names:
                offsets[n] = start
                start += shares[n]
            if start * shards >= 2**31:
                raise ValueError(
                    f"EmbeddingCollection: the tables of stack {key} ({', '.join(names)}) hold {start * shards} "
                    "rows; a stack holds at most 2**31 - 1: split the tables over two collections"
                )
            blocks[key] = start
        object.__setattr__(self, "tables", tables)
        object.__setattr__(self, "features", features)
        object.__setattr__(self, "shards", int(shards))
        object.__setattr__(self, "_stacks", stacks)
        object.__setattr__(self, "_offsets", offsets)
        object.__setattr__(self, "_shares", shares)
        object.__setattr__(self, "_blocks", blocks)

    @staticmethod
    def _stack_key(t: TableSpec, shards: int) -> str:
        """A stack's name: its dtype and width, and the layout where it is laid out for devices (so that a
        checkpoint of one layout does not restore into another)."""
        name = f"{jnp.dtype(t.dtype).name}_{t.width}"
        return name if shards == 1 else f"{name}_shards{shards}"

    def _stack_of(self, table: str) -> str:
        return self._stack_key(self.tables[table], self.shards)

    @property
    def stacks(self) -> dict[str, tuple[str, ...]]:
        """Each stack's name and its tables, in order."""
        return {k: tuple(v) for k, v in self._stacks.items()}  # type: ignore[attr-defined]

    def init(self, key: jax.Array) -> dict[str, jax.Array]:
        """The stacked tables, each table initialized by its own initializer from its own key."""
        keys = dict(zip(self.tables, jax.random.split(key, len(self.tables)), strict=True))
        # The tables left to the default initializer in one jitted call: one compilation for all their shapes (one
        # by one, the initializer compiled once per distinct shape: 19 compilations of ~0.33 s for the DLRM
        # example's 26 tables). A table's own initializer runs as given.
        default = [n for n, t in self.tables.items() if t.initializer is None]
        specs = tuple((self.tables[n].num_rows, self.tables[n].width, jnp.dtype(self.tables[n].dtype)) for n in default)
        made = dict(zip(default, _default_tables(tuple(keys[n] for n in default), specs), strict=True))
        for n, t in self.tables.items():
            if t.initializer is not None:
                made[n] = jnp.asarray(t.initializer(keys[n], (t.num_rows, t.width), t.dtype), t.dtype)
        return self.stack(made)

    def stack(self, tables: Mapping[str, jax.typing.ArrayLike]) -> dict[str, jax.Array]:
        """The stacks holding these tables (name to its ``(num_rows, width)`` rows), in this collection's layout.

        With :meth:`table` it moves parameters between layouts, say from a collection of ``shards=8`` to one of
        ``shards=4``: ``new.stack({n: old.table(params, n) for n in old.tables})``; and it loads tables trained
        elsewhere.
        """
        missing, extra = set(self.tables) - set(tables), set(tables) - set(self.tables)
        if missing or extra:
            raise ValueError(
                f"EmbeddingCollection.stack: give every table once; missing {sorted(missing)}, unknown {sorted(extra)}"
            )
        s = self.shards
        out = {}
        for stack, names in self._stacks.items():  # type: ignore[attr-defined]
            parts = []
            for n in names:
                t = self.tables[n]
                x = jnp.asarray(tables[n])
                if x.shape != (t.num_rows, t.width) or x.dtype != jnp.dtype(t.dtype):
                    raise ValueError(
                        f"EmbeddingCollection.stack: table {n!r} must be {jnp.dtype(t.dtype).name}"
                        f"[{t.num_rows}, {t.width}], got {x.dtype}{list(x.shape)}"
                    )
                share = self._shares[n]  # type: ignore[attr-defined]  # padded with zeros to it in each block
                x = jnp.concatenate([x, jnp.zeros((share * s - t.num_rows, t.width), t.dtype)]) if s > 1 else x
                parts.append(x.reshape(s, share, t.width))
            stacked = jnp.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
            out[stack] = stacked.reshape(-1, stacked.shape[-1])
        return out

    def stack_ids(self, name: str, ids: jax.typing.ArrayLike) -> jax.Array:
        """Table ``name``'s ids as rows of its stack (ids outside the table: the stack's rows, padding)."""
        if name not in self.tables:
            raise KeyError(f"EmbeddingCollection.stack_ids: no table {name!r} among {sorted(self.tables)}")
        ids = as_index_array(ids)
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise TypeError(f"EmbeddingCollection.stack_ids: ids must be integers, got dtype {ids.dtype}")
        rows, share = self.tables[name].num_rows, self._shares[name]  # type: ignore[attr-defined]
        block, start = self._blocks[self._stack_of(name)], self._offsets[name]  # type: ignore[attr-defined]
        # Any id outside the table (negative, too large, or past int32) becomes `rows`, as osa.bags reads ids.
        keys = normalise_keys(ids.reshape(-1, 1), (rows,))[:, 0].reshape(ids.shape).astype(jnp.int32)
        return jnp.where(keys < rows, keys // share * block + start + keys % share, block * self.shards)

    def table(self, params: Mapping[str, jax.Array], name: str) -> jax.Array:
        """Table ``name``'s rows in ``params`` (a block of its stack, or a share of each block), for evaluation or
        export."""
        if name not in self.tables:
            raise KeyError(f"EmbeddingCollection.table: no table {name!r} among {sorted(self.tables)}")
        start, t = self._offsets[name], self.tables[name]  # type: ignore[attr-defined]
        key = self._stack_of(name)
        if key not in params:
            raise KeyError(
                f"EmbeddingCollection.table: no stack {key!r} in the parameters (stacks {sorted(params)}): they are "
                f"another collection's, or laid out for another number of shards (this one's: {self.shards}); "
                "move them with EmbeddingCollection.stack"
            )
        stack = params[key]
        rows = self._blocks[key] * self.shards  # type: ignore[attr-defined]
        if tuple(stack.shape) != (rows, t.width):
            raise ValueError(
                f"EmbeddingCollection.table: stack {key!r} is {list(stack.shape)}; this collection's is "
                f"[{rows}, {t.width}]: the parameters are another collection's"
            )
        if self.shards == 1:
            return stack[start : start + t.num_rows]
        share = self._shares[name]  # type: ignore[attr-defined]
        split = explicit_sharding(stack)
        if split is not None:  # split by rows over an Explicit mesh: the table's share of each block, gathered
            stack = jax.sharding.reshard(stack, jax.sharding.NamedSharding(split.mesh, jax.P()))
        blocks = stack.reshape(self.shards, -1, *stack.shape[1:])
        return blocks[:, start : start + share].reshape(-1, *stack.shape[1:])[: t.num_rows]

    def bags(
        self,
        inputs: Mapping[str, Any],
        weights: Mapping[str, jax.typing.ArrayLike] | None = None,
    ) -> dict[str, Bags]:
        """The bags of a batch, one :class:`Bags` per stack, for :meth:`pool`.

        Args:
          inputs: Feature name to its ids: a ``(batch, max_len)`` padded
            array (``-1`` pads), a ``(batch,)`` array (one id each), or a
            :class:`Bags` built with :func:`bags` for its table's rows (the
            offsets and lengths forms). Every feature, one batch size.
          weights: Feature name to per-id weights of its ids' shape, for
            the features that have them.

        Returns:
          Stack name to the bags of all its features, their ids shifted to
          their tables' rows in the stack.
        """
        features = self.features
        assert features is not None
        weights = dict(weights or {})
        missing, extra = set(features) - set(inputs), set(inputs) - set(features)
        unknown_w = set(weights) - set(features)
        if missing or extra or unknown_w:
            raise ValueError(
                f"EmbeddingCollection.bags: inputs must name every feature once; missing {sorted(missing)}, "
                f"unknown {sorted(extra | unknown_w)}"
            )
        per_feature: dict[str, Bags] = {}
        for name, spec in features.items():
            rows = self.tables[spec.table].num_rows
            x = inputs[name]
            if isinstance(x, Bags):
                if name in weights:
                    raise ValueError(
                        f"EmbeddingCollection.bags: feature {name!r} is a Bags; give its weights to bags()"
                    )
                if x.num_rows != rows:
                    raise ValueError(
                        f"EmbeddingCollection.bags: the Bags of feature {name!r} were built for {x.num_rows} rows; "
                        f"its table {spec.table!r} has {rows}"
                    )
                if x.combiner != spec.combiner:  # folded into the weights: it cannot be changed here
                    raise ValueError(
                        f"EmbeddingCollection.bags: the Bags of feature {name!r} combine by {x.combiner!r} but its "
                        f"FeatureSpec says {spec.combiner!r}; build them with osa.bags(..., "
                        f"combiner={spec.combiner!r})"
                    )
                per_feature[name] = x
            else:
                try:
                    per_feature[name] = bags(x, rows, weights=weights.get(name), combiner=spec.combiner)
                except (TypeError, ValueError) as e:  # bags' own checks, which do not know the feature's name
                    raise type(e)(f"EmbeddingCollection.bags: feature {name!r}: {e}") from e
        sizes = {b.num_bags for b in per_feature.values()}
        if len(sizes) > 1:
            raise ValueError(
                "EmbeddingCollection.bags: every feature needs the batch size; got "
                + ", ".join(f"{n}: {b.num_bags}" for n, b in per_feature.items())
            )
        batch = sizes.pop() if sizes else 0
        # One part a device where every feature splits by examples; else (a ragged feature, an evaluation batch
        # that does not divide) one part, which pools anywhere and which a data-parallel step refuses, saying why.
        s = self.shards
        if s > 1 and any(dataclasses.replace(b, parts=1).splits_into(s) for b in per_feature.values()):
            s = 1
        out = {}
        for stack in self.stacks:
            names = [n for n, f in features.items() if self._stack_of(f.table) == stack]
            total, n_bags = self._blocks[stack] * self.shards, len(names) * batch  # type: ignore[attr-defined]
            ids, bag, w = [], [], []
            for j, n in enumerate(names):
                b = per_feature[n]
                ids.append(self.stack_ids(features[n].table, b.ids))  # padding: the stack's rows
                bag.append(jnp.where(b.bag < b.num_bags, b.bag + j * batch, n_bags))
                w.append(b.weights)
            if not names:  # tables no feature reads: nothing to look up, one empty block
                ids, bag, w = [jnp.zeros((0,), jnp.int32)], [jnp.zeros((0,), jnp.int32)], [jnp.zeros((0,))]
            blocks: tuple[tuple[int, int], ...] | None = () if names else ((0, 0),)
            for n in names:  # regular blocks stay regular; one ragged feature makes the stack ragged
                fb = per_feature[n].blocks
                blocks = None if fb is None or blocks is None else blocks + fb
            merged = blocks or None

            parts = s if names else 1

            def joined(xs: list[jax.Array], parts: int = parts) -> jax.Array:  # a part a device: its every feature
                if parts == 1:
                    return jnp.concatenate(xs)
                return jnp.concatenate([x.reshape(parts, -1) for x in xs], axis=1).reshape(-1)

            combiners = {per_feature[n].combiner for n in names}
            combiner = combiners.pop() if len(combiners) == 1 else None
            out[stack] = Bags(joined(ids), joined(bag), joined(w), n_bags, total, merged, parts, combiner)
        return out

    def pool(self, params: Mapping[str, jax.Array], bags: Mapping[str, Bags]) -> dict[str, jax.Array]:
        """Each feature's pooled vectors, ``(batch, width)``: one gather and one sum per stack.

        ``params`` are the stacks (or, inside :func:`value_and_row_grad`, their
        gathered rows) and ``bags`` what :meth:`bags` built for them.
        """
        features = self.features
        assert features is not None
        read = [stack for stack in self.stacks if any(self._stack_of(f.table) == stack for f in features.values())]
        if not isinstance(bags, Mapping):
            raise TypeError(
                f"EmbeddingCollection.pool: bags must be what EmbeddingCollection.bags returns, a Bags for each stack "
                f"({', '.join(map(repr, read))}); got a {type(bags).__name__}"
            )
        if missing := [stack for stack in read if stack not in bags]:
            raise ValueError(
                f"EmbeddingCollection.pool: bags holds no Bags for stack(s) {missing} (its keys: {list(bags)}); "
                "build them with EmbeddingCollection.bags(inputs), which keys them by stack"
            )
        out: dict[str, jax.Array] = {}
        for stack in self.stacks:
            names = [n for n, f in features.items() if self._stack_of(f.table) == stack]
            if not names:
                continue
            # One split, not a slice per feature: a slice's gradient is a stack-sized pad, one per feature.
            parts = jnp.split(pool(params[stack], bags[stack]), len(names))
            out.update(zip(names, parts, strict=True))
        return {n: out[n] for n in features}
