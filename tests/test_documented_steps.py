"""Every documented jitted training step, rebuilt as documented, compiles to an in-place, O(batch) step.

The README, the docs' pages, the notebooks, ``examples/demo.py``, ``examples/dlrm.py`` and the public docstrings show
train steps and promise that, with the parameters and state donated, the tables and moments are updated in place and
the step's temporary memory depends on the batch, not on the tables. Each example below rebuilds one of those steps
with the same calls and the same structure (the notebooks' and the demo's steps are their own code, executed),
compiles it for tables of two sizes (``ROWS``; abstract arrays: compiled, never allocated) and reads the compiled
step with :func:`osa.step_report`:

- ``in_place``: every table-sized argument donated, no table-sized copy, and the same temporary bytes at both
  sizes, well below one table;
- ``dense``: a step the docs say costs what the tables cost (``optax.adam``, the ``lazy_dense`` path on dense
  gradients): its temporaries grow by at least one table's worth with the table, as documented;
- ``not_donated``: a documented step that does not donate its tables: the report names them, as the "Donation"
  section of ``docs/which_path.md`` predicts (the `step_report` docstring's own example).

A documented step that does not do what its docs say is a strict ``xfail`` naming the problem (``known_issue``).
``test_rebuilt_from_the_documented_code`` checks that the lines each rebuild follows are still in its document, so a
change of the docs shows up here and the rebuild can follow it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import json
import os
import pathlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from flax.training import train_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_sparse_adam as osa
from optax_sparse_adam import nnx as osa_nnx

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Rows of each table (of each device's block for row-sharded tables): 400_000 x 32 float32 is 51.2 MB a table,
# where the batch's temporaries take at most 6.5 MB (the demo: 4,096 ids into each of two tables).
ROWS = (400_000, 800_000)
WIDTH = 32
K = 1024  # ids per table and step
F32, I32 = jnp.float32, jnp.int32


def table_bytes(rows: int) -> int:
    """Bytes of one table (one device's block of a row-sharded table) of ``rows`` rows."""
    return rows * WIDTH * 4


def sds(shape: tuple[int, ...], dtype: Any = F32, sharding: Any = None) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


Build = Callable[[int], tuple[Any, tuple[Any, ...]]]


@dataclasses.dataclass(frozen=True)
class Example:
    """A documented step: where it is, the lines it is rebuilt from, and what the docs say it costs."""

    where: str  # a file under the repository root, or ``osa.NAME`` for a docstring
    anchors: tuple[str, ...]  # lines of the documented code, verbatim
    build: Build  # rows -> (the jitted step, its abstract arguments)
    expect: str  # "in_place", "dense" or "not_donated"
    not_donated: tuple[str, ...] = ()  # for "not_donated": the arguments the report names
    also: str = ""  # another document holding some of the anchors
    paths: tuple[str, ...] = ("default",)  # kernel paths compiled: "default" (native on the CPU if built), "xla"
    rank_promotion: str = "raise"  # the suite's strictness, or "allow" for code written without it (the demo)
    known_issue: str = ""  # a documented step that does not do what the docs say: a strict xfail until fixed
    rows: tuple[int, int] = ROWS  # the two sizes it is compiled for
    min_bytes: int = table_bytes(ROWS[0]) // 4  # table-sized: a quarter of the smallest table-sized array, or more
    temp_limit: int = table_bytes(ROWS[0]) // 4  # the most temporary bytes an O(batch) step may take here


EXAMPLES: dict[str, Example] = {}


def example(name: str, where: str, *anchors: str, **kwargs: Any) -> Callable[[Build], Build]:
    def register(build: Build) -> Build:
        assert name not in EXAMPLES, name
        EXAMPLES[name] = Example(where, anchors, build, **{"expect": "in_place", **kwargs})
        return build

    return register


# Every step compiles on the default path (the native kernels on the CPU where they are built). The XLA path (what
# GPU and TPU run; there ``update_and_apply`` is ``tx.update`` then ``apply_updates``) is compiled for one step of
# each entry point: the quick start (pooled bags, partition_tables), IndexedRows with the two calls, a loss linear
# in the rows through value_and_row_grad and through lookup, and apply_updates. Steps inside shard_map, or on an
# Explicit mesh, run the XLA path anyway.
BOTH = ("default", "xla")


def document(where: str) -> str:
    if where.startswith("osa."):
        obj: Any = osa
        for attr in where.split(".")[1:]:
            obj = getattr(obj, attr) if hasattr(obj, attr) else importlib.import_module(f"{obj.__name__}.{attr}")
        return obj.__doc__ or ""
    path = ROOT / where
    if path.suffix == ".ipynb":
        return "\n".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"])
    return path.read_text()


def squeeze(text: str) -> str:
    """``text`` with every run of white space made one space: anchors match across line wraps and indentation."""
    return " ".join(text.split())


def batch_ids(shape: tuple[int, ...] = (K,), sharding: Any = None) -> jax.ShapeDtypeStruct:
    return sds(shape, I32, sharding)


# --------------------------------------------------------------------------------------------------------------------
# README: Quick start (an EmbeddingCollection, partition_tables, pooled bags), also the loop of
# docs/getting_started.md; the hand-built IndexedRows step of docs/guides/native_kernels.md, and its two-call form in
# docs/getting_started.md


def _quick_start(rows: int) -> tuple[Any, tuple[Any, ...]]:
    coll = osa.EmbeddingCollection(
        tables={"user": osa.TableSpec(rows, WIDTH), "item": osa.TableSpec(rows // 2, WIDTH)},
        features={
            "user": osa.FeatureSpec("user"),
            "history": osa.FeatureSpec("item", combiner="mean"),  # a bag of ids a user, averaged
            "candidate": osa.FeatureSpec("item"),
        },
    )
    params = {"emb": jax.eval_shape(coll.init, jax.random.key(0)), "w": sds((WIDTH,))}
    tx = osa.partition_tables(osa.sparse_adam(1e-3), optax.adam(1e-3), tables=lambda p: p["emb"])
    state = jax.eval_shape(tx.init, params)

    def loss_fn(params, bags, labels):
        f = coll.pool(params["emb"], bags)  # feature name -> (batch, WIDTH)
        logits = ((f["user"] + f["history"]) * f["candidate"]) @ params["w"]
        return optax.sigmoid_binary_cross_entropy(logits, labels).mean()

    @functools.partial(jax.jit, donate_argnums=(0, 1))  # tables and moments updated in place
    def step(params, state, ids, labels):  # ids: feature -> (batch,) or (batch, max_len) ids, -1 pads
        bags = coll.bags(ids)
        loss, grads = osa.value_and_row_grad(loss_fn, lambda p: p["emb"])(params, bags, labels)
        params, state = osa.update_and_apply(tx, grads, state, params)  # = tx.update + osa.apply_updates
        return params, state, loss

    ids = {"user": batch_ids(), "history": batch_ids((K, 8)), "candidate": batch_ids()}
    return step, (params, state, ids, sds((K,)))


example(
    "readme_quick_start",
    "README.md",
    'tables={"user": osa.TableSpec(1_000_000, 32), "item": osa.TableSpec(500_000, 32)},',
    '"history": osa.FeatureSpec("item", combiner="mean"),',
    'tx = osa.partition_tables(osa.sparse_adam(1e-3), optax.adam(1e-3), tables=lambda p: p["emb"])',
    'f = coll.pool(params["emb"], bags)',
    'logits = ((f["user"] + f["history"]) * f["candidate"]) @ params["w"]',
    "@functools.partial(jax.jit, donate_argnums=(0, 1))  # tables and moments updated in place\n"
    "def step(params, state, ids, labels):",
    "bags = coll.bags(ids)",
    'loss, grads = osa.value_and_row_grad(loss_fn, lambda p: p["emb"])(params, bags, labels)',
    "params, state = osa.update_and_apply(tx, grads, state, params)  # = tx.update + osa.apply_updates",
    "with nothing table-sized built.",
    paths=BOTH,
)(_quick_start)


def _native_kernels(rows: int, fused: bool) -> tuple[Any, tuple[Any, ...]]:
    params = {"table": sds((rows, WIDTH)), "w": sds((WIDTH,))}
    tx = osa.sparse_adam(1e-3)
    state = jax.eval_shape(tx.init, params)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, state, ids, row_grads, w_grad):
        grads = {"table": osa.IndexedRows(ids, row_grads, rows), "w": w_grad}
        if fused:
            return osa.update_and_apply(tx, grads, state, params)
        updates, state = tx.update(grads, state, params)  # "the two calls"
        return osa.apply_updates(params, updates), state

    return step, (params, state, batch_ids(), sds((K, WIDTH)), sds((WIDTH,)))


NATIVE_KERNELS = (
    "@functools.partial(jax.jit, donate_argnums=(0, 1))\ndef step(params, state, ids, row_grads, w_grad):",
    'grads = {"table": osa.IndexedRows(ids, row_grads, 1_000_000), "w": w_grad}',
)
example(
    "docs_native_kernels",
    "docs/guides/native_kernels.md",
    *NATIVE_KERNELS,
    "return osa.update_and_apply(tx, grads, state, params)",
    "Under donation the tables are updated in place.",
)(functools.partial(_native_kernels, fused=True))
example(
    "docs_native_kernels_two_calls",
    "docs/getting_started.md",
    *NATIVE_KERNELS,
    "updates, state = tx.update(grads, state, params)\nreturn osa.apply_updates(params, updates), state",
    "Gradients built by hand (`osa.IndexedRows(ids, row_grads, num_rows)`) and the two calls work everywhere too.",
    paths=BOTH,
)(functools.partial(_native_kernels, fused=False))


# --------------------------------------------------------------------------------------------------------------------
# docs/guides/row_gradients.md, "Many tables and multi-hot features": a Bags where value_and_row_grad takes ids


def _bags(rows: int) -> tuple[Any, tuple[Any, ...]]:
    params = {"emb": sds((rows, WIDTH)), "w": sds((WIDTH,))}
    tx = osa.sparse_adam(1e-3)

    def loss_fn(params, bags, y):
        return jnp.mean((osa.pool(params["emb"], bags) @ params["w"] - y) ** 2)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, state, ids, y):  # ids: (batch, max_len), -1 pads
        bags = osa.bags(ids, rows, combiner="mean")  # weights from the raw ids, outside the loss
        loss, grads = osa.value_and_row_grad(loss_fn, lambda p: p["emb"])(params, bags, y)
        params, state = osa.update_and_apply(tx, grads, state, params)
        return params, state, loss

    return step, (params, jax.eval_shape(tx.init, params), batch_ids((K, 8)), sds((K,)))


example(
    "docs_bags",
    "docs/guides/row_gradients.md",
    "A `Bags` can stand wherever `value_and_row_grad` takes an array of ids",
    "`osa.pool(rows, bags)` pools the same rows. The table's gradient is an\n  `IndexedRows` of the distinct ids",
    'osa.bags(ids, num_rows, *, offsets=None, lengths=None, weights=None, combiner="sum")',
)(_bags)


# --------------------------------------------------------------------------------------------------------------------
# docs/guides/row_gradients.md: the fast path (also the step of "When a step is slow" in docs/which_path.md), and
# the optax pipeline of docs/guides/optax_pipelines.md


def guide_loss_fn(params, ids, ratings):  # indexes the tables with the ids, as usual
    users, items = ids
    pred = jnp.sum(params["users"][users] * params["items"][items], axis=1)
    return jnp.mean((pred - ratings) ** 2)


def _fast_path(rows: int, fused: bool, tx: optax.GradientTransformation) -> tuple[Any, tuple[Any, ...]]:
    params = {"users": sds((rows, WIDTH)), "items": sds((rows, WIDTH))}
    opt_state = jax.eval_shape(tx.init, params)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, ids, ratings):
        loss, grads = osa.value_and_row_grad(guide_loss_fn, lambda p: (p["users"], p["items"]))(params, ids, ratings)
        if fused:
            params, opt_state = osa.update_and_apply(tx, grads, opt_state, params)
        else:  # or tx.update + osa.apply_updates
            updates, opt_state = tx.update(grads, opt_state, params)
            params = osa.apply_updates(params, updates)
        return params, opt_state, loss

    return train_step, (params, opt_state, (batch_ids(), batch_ids()), sds((K,)))


FAST_PATH = (
    "@functools.partial(jax.jit, donate_argnums=(0, 1))\ndef train_step(params, opt_state, ids, ratings):",
    'loss, grads = osa.value_and_row_grad(loss_fn, lambda p: (p["users"], p["items"]))(params, ids, ratings)',
    'pred = jnp.sum(params["users"][users] * params["items"][items], axis=1)',
    "params, opt_state = osa.update_and_apply(tx, grads, opt_state, params)  # or tx.update + osa.apply_updates",
)
PIPELINE = "tx = optax.chain(osa.sparse_aware(optax.clip_by_global_norm(1.0)), osa.sparse_adam(1e-3))"

ROW_GRADIENTS = "docs/guides/row_gradients.md"
example(
    "docs_fast_path",
    ROW_GRADIENTS,
    *FAST_PATH,
    "report = osa.step_report(train_step, params, opt_state, ids",
    also="docs/which_path.md",
)(functools.partial(_fast_path, fused=True, tx=osa.sparse_adam(1e-3)))
example("docs_fast_path_two_calls", ROW_GRADIENTS, *FAST_PATH)(
    functools.partial(_fast_path, fused=False, tx=osa.sparse_adam(1e-3))
)
example("docs_optax_pipeline", ROW_GRADIENTS, *FAST_PATH, PIPELINE, also="docs/guides/optax_pipelines.md")(
    functools.partial(
        _fast_path, fused=True, tx=optax.chain(osa.sparse_aware(optax.clip_by_global_norm(1.0)), osa.sparse_adam(1e-3))
    )
)


# --------------------------------------------------------------------------------------------------------------------
# docs/guides/flax.md


class NnxRecommender(nnx.Module):
    def __init__(self, n_users: int, n_items: int, *, rngs: nnx.Rngs) -> None:
        self.user = nnx.Embed(n_users, WIDTH, rngs=rngs)
        self.item = nnx.Embed(n_items, WIDTH, rngs=rngs)
        self.hidden = nnx.Linear(2 * WIDTH, 16, rngs=rngs)
        self.out = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, users: jax.Array, items: jax.Array) -> jax.Array:
        x = jnp.concatenate([self.user(users), self.item(items)], axis=-1)
        return self.out(jax.nn.gelu(self.hidden(x)))[..., 0]


def is_table(p: Any) -> Any:  # the Flax guide's lambda
    return jax.tree_util.tree_map_with_path(lambda path, _: "embedding" in jax.tree_util.keystr(path), p)


def _nnx(rows: int, fast: bool) -> tuple[Any, tuple[Any, ...]]:
    model = nnx.eval_shape(lambda: NnxRecommender(rows, rows, rngs=nnx.Rngs(0)))
    tx = osa.sparse_adam(1e-3) if fast else osa.sparse_adam(1e-3, lazy_dense=is_table)
    optimizer_cls = osa_nnx.Optimizer if fast else nnx.Optimizer  # the guide's fast path takes the fused door
    optimizer = nnx.eval_shape(lambda: optimizer_cls(model, tx, wrt=nnx.Param))

    @nnx.jit(donate_argnames=("model", "optimizer"))
    def train_step(model, optimizer, users, items, y):
        if fast:
            graphdef, params = nnx.split(model, nnx.Param)

            def loss_fn(p, ids):  # p: tables replaced by the rows looked up; ids: positions in them
                return jnp.mean((nnx.merge(graphdef, p)(*ids) - y) ** 2)

            loss, grads = osa.value_and_row_grad(loss_fn, lambda p: (p["user"]["embedding"], p["item"]["embedding"]))(
                params, (users, items)
            )
        else:  # an ordinary nnx step ("no change to the model or the step"), jitted as the fast path's

            def dense_loss(model):
                return jnp.mean((model(users, items) - y) ** 2)

            loss, grads = nnx.value_and_grad(dense_loss)(model)
        optimizer.update(model, grads)
        return loss

    return train_step, (model, optimizer, batch_ids(), batch_ids(), sds((K,)))


example(
    "docs_nnx_fast_path",
    "docs/guides/flax.md",
    "optimizer = osa_nnx.Optimizer(model, osa.sparse_adam(1e-3), wrt=nnx.Param)",
    '@nnx.jit(donate_argnames=("model", "optimizer"))\ndef train_step(model, optimizer, users, items, y):',
    "graphdef, params = nnx.split(model, nnx.Param)",
    "return jnp.mean((nnx.merge(graphdef, p)(*ids) - y) ** 2)",
    'loss, grads = osa.value_and_row_grad(loss_fn, lambda p: (p["user"]["embedding"], p["item"]["embedding"]))(',
    "optimizer.update(model, grads)",
)(functools.partial(_nnx, fast=True))
example(
    "docs_nnx_lazy_dense",
    "docs/guides/flax.md",
    "optimizer = nnx.Optimizer(model, osa.sparse_adam(1e-3, lazy_dense=is_table), wrt=nnx.Param)",
    'is_table = lambda p: jax.tree_util.tree_map_with_path(lambda path, _: "embedding" in jax.tree_util.keystr(path)',
    "This moves only the rows a batch looked up, but the gradient and the step still cost what the tables cost.",
    expect="dense",
)(functools.partial(_nnx, fast=False))


class LinenRecommender(nn.Module):
    n_users: int
    n_items: int

    @nn.compact
    def __call__(self, users: jax.Array, items: jax.Array) -> jax.Array:
        user = nn.Embed(self.n_users, WIDTH, name="user")(users)
        item = nn.Embed(self.n_items, WIDTH, name="item")(items)
        return nn.Dense(1)(jax.nn.gelu(nn.Dense(16)(jnp.concatenate([user, item], axis=-1))))[..., 0]


def _linen(rows: int, donate: bool = False) -> tuple[Any, tuple[Any, ...]]:
    model = LinenRecommender(rows, rows)

    def create() -> train_state.TrainState:
        one = jnp.zeros((1,), I32)
        params = model.init(jax.random.key(0), one, one)["params"]
        state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=osa.sparse_adam(1e-3))
        return state.replace(step=jnp.zeros((), jnp.int32))  # as the Flax guide advises, against a retrace

    def loss_fn(params, ids, y):
        m = model.clone(n_users=params["user"]["embedding"].shape[0], n_items=params["item"]["embedding"].shape[0])
        return jnp.mean((m.apply({"params": params}, *ids) - y) ** 2)

    def train_step(state, users, items, y):
        loss, grads = osa.value_and_row_grad(loss_fn, lambda p: (p["user"], p["item"]))(state.params, (users, items), y)
        return state.apply_gradients(grads=grads), loss

    step = jax.jit(train_step, donate_argnums=(0,)) if donate else jax.jit(train_step)
    return step, (jax.eval_shape(create), batch_ids(), batch_ids(), sds((K,)))


LINEN = (
    "@functools.partial(jax.jit, donate_argnums=0)  # the state's tables and moments updated in place\n"
    "def train_step(state, users, items, y):",
    'loss, grads = osa.value_and_row_grad(loss_fn, lambda p: (p["user"], p["item"]))(state.params, (users, items), y)',
    "return state.apply_gradients(grads=grads), loss",
    'm = model.clone(n_users=params["user"]["embedding"].shape[0], n_items=params["item"]["embedding"].shape[0])',
    'return jnp.mean((m.apply({"params": params}, *ids) - y) ** 2)',
    "`state.replace(step=jnp.zeros((), jnp.int32))` avoids it",
)
example("docs_linen_fast_path", "docs/guides/flax.md", *LINEN)(functools.partial(_linen, donate=True))


# --------------------------------------------------------------------------------------------------------------------
# docs/guides/sharding.md: sharded tables, routed (RowSharding) and under plain jit. Each device's block has ``rows``
# rows.


def sharded_loss_fn(params, ids, y):  # indexes the table with the ids, as for osa.value_and_row_grad
    return jnp.mean((params["emb"][ids] @ params["w"] - y) ** 2)


def _abstract_sharded(mesh: Any, specs: Any, tree: Any) -> Any:
    return jax.tree.map(lambda x, s: sds(x.shape, x.dtype, NamedSharding(mesh, s)), tree, specs)


def _row_sharding(rows: int, routing: dict[str, Any], fused: bool) -> tuple[Any, tuple[Any, ...]]:
    mesh = jax.make_mesh((jax.device_count(),), ("x",))
    rs = osa.RowSharding(mesh, "x", tables=lambda p: p["emb"], **routing)
    tx = osa.sparse_adam(1e-3)
    params = {"emb": sds((rows * jax.device_count(), WIDTH)), "w": sds((WIDTH,))}
    params = _abstract_sharded(mesh, rs.specs(params), params)  # = rs.shard(params)
    opt_state = jax.eval_shape(tx.init, params)  # moments sharded like their tables
    opt_state = _abstract_sharded(mesh, rs.state_specs(tx, opt_state, params), opt_state)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, ids, y):  # ids, y: split over "x" along their first axis
        loss, grads, info = rs.value_and_row_grad(sharded_loss_fn)(params, ids, y)
        if fused:
            params, opt_state = rs.update_and_apply(tx, grads, opt_state, params)
        else:  # rs.update then rs.apply_updates
            updates, opt_state = rs.update(tx, grads, opt_state, params)
            params = rs.apply_updates(params, updates)
        return params, opt_state, loss, info.overflow

    batch = NamedSharding(mesh, P("x") if routing.get("batch_axis") else P())
    return train_step, (params, opt_state, batch_ids(sharding=batch), sds((K,), F32, batch))


ROW_SHARDING = (
    'mesh = jax.make_mesh((jax.device_count(),), ("x",))\n'
    'rs = osa.RowSharding(mesh, "x", tables=lambda p: p["emb"], batch_axis="x", routing="all_to_all")',
    'params = rs.shard(params)  # tables P("x", None), everything else replicated',
    "opt_state = tx.init(params)  # moments sharded like their tables",
    "@functools.partial(jax.jit, donate_argnums=(0, 1))\ndef train_step(params, opt_state, ids, y):",
    "loss, grads, info = rs.value_and_row_grad(loss_fn)(params, ids, y)",
    "return params, opt_state, loss, info.overflow",
    "its temporaries depend on the batch, never on the table",
)
ROUTINGS = {
    "all_to_all": ({"batch_axis": "x", "routing": "all_to_all"}, '`batch_axis="x", routing="all_to_all"` (default)'),
    "all_gather": ({"batch_axis": "x", "routing": "all_gather"}, '`batch_axis="x", routing="all_gather"`'),
    "replicated": ({}, "| `batch_axis=None` | replicated |"),
}
for _name, (_routing, _anchor) in ROUTINGS.items():
    example(
        f"docs_row_sharding_{_name}",
        "docs/guides/sharding.md",
        *ROW_SHARDING,
        "params, opt_state = rs.update_and_apply(tx, grads, opt_state, params)",
        _anchor,
    )(functools.partial(_row_sharding, routing=_routing, fused=True))
example(
    "docs_row_sharding_two_calls",
    "docs/guides/sharding.md",
    *ROW_SHARDING,
    "`rs.update` then `rs.apply_updates` give the same result",
)(functools.partial(_row_sharding, routing=ROUTINGS["all_to_all"][0], fused=False))


def _plain_jit_sharded(rows: int, axis_type: Any) -> tuple[Any, tuple[Any, ...]]:
    mesh = jax.make_mesh((jax.device_count(),), ("x",), axis_types=(axis_type,))
    tx = osa.sparse_adam(1e-3)
    params = {"emb": sds((rows * jax.device_count(), WIDTH)), "w": sds((WIDTH,))}
    params = _abstract_sharded(mesh, {"emb": P("x", None), "w": P()}, params)
    with jax.set_mesh(mesh):  # "Under jit, call tx.init inside jax.set_mesh(mesh) on an Explicit mesh"
        opt_state = jax.eval_shape(tx.init, params)
    specs = optax.tree_utils.tree_map_params(
        tx, lambda _, s: s, opt_state, {"emb": P("x", None), "w": P()}, transform_non_params=lambda _: P()
    )
    opt_state = _abstract_sharded(mesh, specs, opt_state)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, ids, y):
        loss, grads = osa.value_and_row_grad(sharded_loss_fn, lambda p: p["emb"])(params, ids, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return osa.apply_updates(params, updates), opt_state, loss

    replicated = NamedSharding(mesh, P())
    return train_step, (params, opt_state, batch_ids(sharding=replicated), sds((K,), F32, replicated))


PLAIN_JIT = (
    "## Plain `jit`\n\nPut the table (and so its moments: `tx.init` keeps the parameters' shardings) on the mesh",
    '`mu` and `nu` keep `P("x", None)` and are updated in place.',
)
example("docs_plain_jit_sharded_explicit", "docs/guides/sharding.md", *PLAIN_JIT)(
    functools.partial(_plain_jit_sharded, axis_type=jax.sharding.AxisType.Explicit)
)
example(
    "docs_plain_jit_sharded_auto",
    "docs/guides/sharding.md",
    *PLAIN_JIT,
    "Tables sharded by rows on an `Auto` mesh stay sharded: each device updates its own rows.",
    also="docs/guides/native_kernels.md",
)(functools.partial(_plain_jit_sharded, axis_type=jax.sharding.AxisType.Auto))


# --------------------------------------------------------------------------------------------------------------------
# Docstrings: their examples, jitted with the parameters and state donated as the docs ask


@example(
    "docstring_value_and_row_grad",
    "osa.value_and_row_grad",
    'return (p["emb"][ids] @ p["w"]).sum()',
    'value, grads = osa.value_and_row_grad(loss, lambda p: p["emb"])(params, jnp.array([5, 5, 7]))',
    "updates, _ = tx.update(grads, tx.init(params), params)",
    'osa.apply_updates(params, updates)["emb"]',
    "the tables' step costs\n    O(ids per batch) under :func:`jax.jit`.",
    paths=BOTH,
)
def _docstring_value_and_row_grad(rows: int) -> tuple[Any, tuple[Any, ...]]:
    params = {"emb": sds((rows, WIDTH)), "w": sds((WIDTH,))}
    tx = osa.sparse_adam(0.1)

    def loss(p, ids):  # linear in the rows: see "When a step is slow"
        return (p["emb"][ids] @ p["w"]).sum()

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, state, ids):
        value, grads = osa.value_and_row_grad(loss, lambda p: p["emb"])(params, ids)
        updates, state = tx.update(grads, state, params)
        return osa.apply_updates(params, updates), state, value

    return step, (params, jax.eval_shape(tx.init, params), batch_ids())


@example(
    "docstring_lookup",
    "osa.lookup",
    "lk = osa.lookup(table, jnp.array([3, 1, 3, -1]))",
    "d_rows = jax.grad(lambda rows: rows[lk.inverse].sum())(lk.rows)",
    "lk.grad(d_rows)",
    "costs O(k), independent of the table's size",
    paths=BOTH,
)
def _docstring_lookup(rows: int) -> tuple[Any, tuple[Any, ...]]:
    table = sds((rows, WIDTH))
    tx = osa.sparse_adam(0.1)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(table, state, ids):
        lk = osa.lookup(table, ids)
        d_rows = jax.grad(lambda rows: rows[lk.inverse].sum())(lk.rows)  # linear in the rows
        updates, state = tx.update(lk.grad(d_rows), state, table)
        return osa.apply_updates(table, updates), state

    return step, (table, jax.eval_shape(tx.init, table), batch_ids())


@example(
    "docstring_row_sharding",
    "osa.RowSharding",
    'mesh = jax.make_mesh((1,), ("x",), devices=jax.devices()[:1])',
    'rs = osa.RowSharding(mesh, "x", tables=lambda p: p["emb"])',
    "rs.value_and_row_grad(loss)(params, jnp.array([3, 3, 5]))",
    "updates, state = rs.update(tx, grads, state, params)",
    "params = rs.apply_updates(params, updates)",
)
def _docstring_row_sharding(rows: int) -> tuple[Any, tuple[Any, ...]]:
    mesh = jax.make_mesh((1,), ("x",), devices=jax.devices()[:1])
    rs = osa.RowSharding(mesh, "x", tables=lambda p: p["emb"])
    params = {"emb": sds((rows, WIDTH)), "w": sds((WIDTH,))}
    params = _abstract_sharded(mesh, rs.specs(params), params)
    tx = osa.sparse_adam(0.1)
    state = jax.eval_shape(tx.init, params)
    state = _abstract_sharded(mesh, rs.state_specs(tx, state, params), state)

    def loss(p, ids):
        return (p["emb"][ids] @ p["w"]).sum()

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, state, ids):
        value, grads, _ = rs.value_and_row_grad(loss)(params, ids)
        updates, state = rs.update(tx, grads, state, params)
        return rs.apply_updates(params, updates), state, value

    return step, (params, state, batch_ids(sharding=NamedSharding(mesh, P())))


@example(
    "docstring_update_and_apply",
    "osa.update_and_apply",
    'grads = {"emb": osa.IndexedRows(jnp.array([2, 2, -1]), jnp.ones((3, 2), jnp.float32), 4)}',
    "params, state = osa.update_and_apply(tx, grads, state, params)",
    "Use it under\n    :func:`jax.jit` with the parameters and state donated.",
)
def _docstring_update_and_apply(rows: int) -> tuple[Any, tuple[Any, ...]]:
    params = {"emb": sds((rows, WIDTH))}
    tx = osa.sparse_adam(0.1)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, state, ids, values):
        grads = {"emb": osa.IndexedRows(ids, values, rows)}
        return osa.update_and_apply(tx, grads, state, params)

    return step, (params, jax.eval_shape(tx.init, params), batch_ids(), sds((K, WIDTH)))


@example(
    "docstring_apply_updates",
    "osa.apply_updates",
    "u = osa.IndexedRows(jnp.array([2, -1]), jnp.ones((2, 2), jnp.float32), 3)",
    "osa.apply_updates(p, u)",
    "Under :func:`jax.jit` with the\n    parameters donated (``donate_argnums``) the scatter is done in place.",
    paths=BOTH,
)
def _docstring_apply_updates(rows: int) -> tuple[Any, tuple[Any, ...]]:
    @functools.partial(jax.jit, donate_argnums=0)
    def step(p, ids, values):
        return osa.apply_updates(p, osa.IndexedRows(ids, values, rows))

    return step, (sds((rows, WIDTH)), batch_ids(), sds((K, WIDTH)))


@example(
    "docstring_sparse_aware",
    "osa.sparse_aware",
    "clip = osa.sparse_aware(optax.clip_by_global_norm(1.0))",
    "g = osa.IndexedRows(jnp.array([0, 0]), jnp.full((2, 1), 3.0, jnp.float32), 2)",
    "out, _ = clip.update(g, clip.init(jnp.zeros((2, 1), jnp.float32)))",
)
def _docstring_sparse_aware(rows: int) -> tuple[Any, tuple[Any, ...]]:
    params = {"emb": sds((rows, WIDTH)), "w": sds((WIDTH,))}
    clip = osa.sparse_aware(optax.clip_by_global_norm(1.0))
    tx = osa.sparse_adam(0.1)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, state, ids, values, w_grad):
        clip_state, adam_state = state
        g = {"emb": osa.IndexedRows(ids, values, rows), "w": w_grad}
        g, clip_state = clip.update(g, clip_state)
        updates, adam_state = tx.update(g, adam_state, params)
        return osa.apply_updates(params, updates), (clip_state, adam_state)

    state = jax.eval_shape(lambda p: (clip.init(p), tx.init(p)), params)
    return step, (params, state, batch_ids(), sds((K, WIDTH)), sds((WIDTH,)))


@example(
    "docstring_embedding_collection",
    "osa.EmbeddingCollection",
    'tables={"user": osa.TableSpec(1000, 8), "item": osa.TableSpec(500, 8)},',
    'f = coll.pool(p["emb"], batch)',
    'return jnp.sum((f["user"] + f["history"]) * f["candidate"] @ p["w"])',
    'value, grads = osa.value_and_row_grad(loss, lambda p: p["emb"])(params, batch)',
)
def _docstring_embedding_collection(rows: int) -> tuple[Any, tuple[Any, ...]]:
    coll = osa.EmbeddingCollection(
        tables={"user": osa.TableSpec(rows, WIDTH), "item": osa.TableSpec(rows // 2, WIDTH)},
        features={
            "user": osa.FeatureSpec("user"),
            "history": osa.FeatureSpec("item", "mean"),
            "candidate": osa.FeatureSpec("item"),
        },
    )
    params = {"emb": jax.eval_shape(coll.init, jax.random.key(0)), "w": sds((WIDTH,))}
    tx = osa.sparse_adam(0.1)

    def loss(p, batch):
        f = coll.pool(p["emb"], batch)
        return jnp.sum((f["user"] + f["history"]) * f["candidate"] @ p["w"])

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, state, ids):
        batch = coll.bags(ids)
        value, grads = osa.value_and_row_grad(loss, lambda p: p["emb"])(params, batch)
        params, state = osa.update_and_apply(tx, grads, state, params)
        return params, state, value

    ids = {"user": batch_ids(), "history": batch_ids((K, 3)), "candidate": batch_ids()}
    return step, (params, jax.eval_shape(tx.init, params), ids)


@example(
    "docstring_partition_tables",
    "osa.partition_tables",
    'tx = osa.partition_tables(osa.sparse_rowwise_adagrad(0.1), optax.adam(1e-3), lambda p: p["emb"])',
    'grads = {"emb": osa.IndexedRows(jnp.array([3]), jnp.ones((1, 4), jnp.float32), 100),',
    "params, state = osa.update_and_apply(tx, grads, state, params)",
)
def _docstring_partition_tables(rows: int) -> tuple[Any, tuple[Any, ...]]:
    params = {"emb": sds((rows, WIDTH)), "w": sds((WIDTH,))}
    tx = osa.partition_tables(osa.sparse_rowwise_adagrad(0.1), optax.adam(1e-3), lambda p: p["emb"])

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, state, ids, values, w_grad):
        grads = {"emb": osa.IndexedRows(ids, values, rows), "w": w_grad}
        return osa.update_and_apply(tx, grads, state, params)

    return step, (params, jax.eval_shape(tx.init, params), batch_ids(), sds((K, WIDTH)), sds((WIDTH,)))


@example(
    "docstring_nnx_embedding_bags",
    "osa.nnx.EmbeddingBags",
    "self.emb = EmbeddingBags(coll, rngs=rngs)",
    "graphdef, params = nnx.split(model, nnx.Param)",
    "return jnp.sum(nnx.merge(graphdef, params)(batch) ** 2)",
    'value, grads = osa.value_and_row_grad(loss, lambda p: p["emb"]["stacks"])(params, batch)',
    "optimizer = nnx.Optimizer(model, osa.sparse_adam(1e-2), wrt=nnx.Param)",
    "_ = optimizer.update(model, grads)",
)
def _docstring_nnx_embedding_bags(rows: int) -> tuple[Any, tuple[Any, ...]]:
    from optax_sparse_adam.nnx import EmbeddingBags

    coll = osa.EmbeddingCollection({"item": osa.TableSpec(rows, WIDTH)}, {"history": osa.FeatureSpec("item", "mean")})

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.emb = EmbeddingBags(coll, rngs=rngs)
            self.out = nnx.Linear(WIDTH, 1, rngs=rngs)

        def __call__(self, bags):
            return self.out(self.emb(bags)["history"])[:, 0]

    model = nnx.eval_shape(lambda: Model(nnx.Rngs(0)))
    optimizer = nnx.eval_shape(lambda: nnx.Optimizer(model, osa.sparse_adam(1e-2), wrt=nnx.Param))

    @nnx.jit(donate_argnames=("model", "optimizer"))  # as the Flax guide's nnx fast path
    def train_step(model, optimizer, ids):
        graphdef, params = nnx.split(model, nnx.Param)
        batch = coll.bags({"history": ids})

        def loss(params, batch):
            return jnp.sum(nnx.merge(graphdef, params)(batch) ** 2)

        value, grads = osa.value_and_row_grad(loss, lambda p: p["emb"]["stacks"])(params, batch)
        optimizer.update(model, grads)
        return value

    return train_step, (model, optimizer, batch_ids((K, 3)))


def _docstring_step_report(rows: int, donate: bool) -> tuple[Any, tuple[Any, ...]]:
    tx = osa.sparse_adam(0.1)

    def step(p, s, ids, g):
        return osa.update_and_apply(tx, osa.IndexedRows(ids, g, rows), s, p)

    p = sds((rows, WIDTH))
    args = (p, jax.eval_shape(tx.init, p), batch_ids(), sds((K, WIDTH)))
    return (jax.jit(step, donate_argnums=(0, 1)) if donate else jax.jit(step)), args


STEP_REPORT = (
    "return osa.update_and_apply(tx, osa.IndexedRows(ids, g, 4096), s, p)",
    ">>> osa.step_report(jax.jit(step, donate_argnums=(0, 1)), *args).in_place\n      True",
)
example("docstring_step_report", "osa.step_report", *STEP_REPORT)(
    functools.partial(_docstring_step_report, donate=True)
)
example(
    "docstring_step_report_not_donated",
    "osa.step_report",
    *STEP_REPORT,
    ">>> report = osa.step_report(jax.jit(step), *args)",
    "(False, ['args[0]', 'args[1][0].mu', 'args[1][0].nu'])",
    expect="not_donated",
    not_donated=("args[0]", "args[1][0].mu", "args[1][0].nu"),
)(functools.partial(_docstring_step_report, donate=False))


# --------------------------------------------------------------------------------------------------------------------
# examples/demo.py: the module itself, imported with DEMO_ROWS


@functools.cache
def demo(rows: int) -> Any:
    spec = importlib.util.spec_from_file_location(f"_documented_steps_demo_{rows}", ROOT / "examples" / "demo.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    old = os.environ.get("DEMO_ROWS")
    os.environ["DEMO_ROWS"] = str(rows)
    try:
        spec.loader.exec_module(module)
    finally:
        if old is None:
            del os.environ["DEMO_ROWS"]
        else:
            os.environ["DEMO_ROWS"] = old
    return module


def _demo(rows: int, name: str) -> tuple[Any, tuple[Any, ...]]:
    module = demo(rows)
    assert (rows, WIDTH) == (module.NUM_ROWS, module.DIM)
    step, tx = {"sparse": (module.sparse_step, module.sparse), "adam": (module.adam_step, module.adam)}[name]
    params = jax.eval_shape(module.init_params, jax.random.key(0))
    batch = (batch_ids((module.BATCH,)), batch_ids((module.BATCH,)), sds((module.BATCH,)))
    return step, (params, jax.eval_shape(tx.init, params), *batch)


DEMO_JIT = "# Donating params and state lets XLA update the tables in place."
example(
    "demo_sparse_step",
    "examples/demo.py",
    DEMO_JIT,
    "sparse_step = jax.jit(_sparse_step, donate_argnums=(0, 1))",
    rank_promotion="allow",
)(functools.partial(_demo, name="sparse"))
example(
    "demo_optax_adam_step",
    "examples/demo.py",
    "adam_step = jax.jit(_adam_step, donate_argnums=(0, 1))",
    "`optax.adam` rewrites every row of every table, and both moments, every step",  # the README's introduction
    expect="dense",
    also="README.md",
    rank_promotion="allow",
)(functools.partial(_demo, name="adam"))


# --------------------------------------------------------------------------------------------------------------------
# examples/dlrm.py: its step, rebuilt from ``main`` (where it is defined) with the module's own pieces


@functools.cache
def dlrm_module() -> Any:
    spec = importlib.util.spec_from_file_location("_documented_steps_dlrm", ROOT / "examples" / "dlrm.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _dlrm(rows: int, multi_hot: bool) -> tuple[Any, tuple[Any, ...]]:
    m = dlrm_module()
    width, batch = 16, 2048  # the script's defaults; ``rows`` is its --max-rows
    table_rows = [min(n, rows) for n in m.CARDINALITIES]
    bag_sizes = m.BAG_SIZES if multi_hot else [1] * len(table_rows)
    names = [f"f{f}" for f in range(len(table_rows))]
    coll = osa.EmbeddingCollection(
        tables={n: osa.TableSpec(r, width) for n, r in zip(names, table_rows, strict=True)},
        features={n: osa.FeatureSpec(n, "sum") for n in names},
    )
    num_vectors = len(names) + 1
    num_pairs = num_vectors * (num_vectors - 1) // 2

    def init_params(key: jax.Array) -> Any:
        k_emb, k_bot, k_top = jax.random.split(key, 3)
        return {
            "emb": coll.init(k_emb),
            "bottom": m.mlp_init(k_bot, [m.NUM_DENSE, 64, width]),
            "top": m.mlp_init(k_top, [width + num_pairs, 64, 1]),
        }

    params = jax.eval_shape(init_params, jax.random.key(0))
    tx = osa.partition_tables(osa.sparse_rowwise_adagrad(0.05), optax.adam(1e-3), lambda p: p["emb"])
    state = jax.eval_shape(tx.init, params)
    pairs = np.triu_indices(num_vectors, k=1)

    def loss_fn(p, bags, dense, labels):
        pooled = coll.pool(p["emb"], bags)
        x = m.mlp(p["bottom"], dense, final_relu=True)
        vectors = jnp.stack([x, *(pooled[n] for n in names)], axis=1)  # (batch, 27, width)
        dots = jnp.einsum("bid,bjd->bij", vectors, vectors)[:, pairs[0], pairs[1]]
        logits = m.mlp(p["top"], jnp.concatenate([x, dots], axis=1), final_relu=False)[:, 0]
        return optax.sigmoid_binary_cross_entropy(logits, labels).mean()

    @jax.jit(donate_argnums=(0, 1))
    def step(p, s, ids, dense, labels):
        bags = coll.bags(ids)
        loss, grads = osa.value_and_row_grad(loss_fn, lambda q: q["emb"])(p, bags, dense, labels)
        p, s = osa.update_and_apply(tx, grads, s, p)
        return p, s, loss

    ids = {n: batch_ids((batch, size)) for n, size in zip(names, bag_sizes, strict=True)}
    return step, (params, state, ids, sds((batch, m.NUM_DENSE)), sds((batch,)))


DLRM = (
    'tx = osa.partition_tables(osa.sparse_rowwise_adagrad(0.05), optax.adam(1e-3), lambda p: p["emb"])',
    "@jax.jit(donate_argnums=(0, 1))\n    def step(p, s, ids, dense, labels):",
    "bags = coll.bags(ids)",
    'loss, grads = osa.value_and_row_grad(loss_fn, lambda q: q["emb"])(p, bags, dense, labels)',
    "p, s = osa.update_and_apply(tx, grads, s, p)",
    'dots = jnp.einsum("bid,bjd->bij", vectors, vectors)[:, pairs[0], pairs[1]]',
    'features={n: osa.FeatureSpec(n, "sum") for n in names},',
)
# The script's default run (one id a feature; ``--multi-hot`` pools bags of the same padded form, and compiles for
# 13 s more). --max-rows of 4e6 and 8e6: stacks of 18.8 and 31.3 million rows (1.2 and 2.0 GB), the smallest
# table-sized array (row-wise Adagrad's accumulator) of 75 MB; a batch of 2,048 examples looks up 53,248 ids, and
# the step's temporaries take 32 MB.
DLRM_SIZES = {"rows": (4_000_000, 8_000_000), "min_bytes": 40_000_000, "rank_promotion": "allow"}
example("dlrm_step", "examples/dlrm.py", *DLRM, temp_limit=40_000_000, **DLRM_SIZES)(
    functools.partial(_dlrm, multi_hot=False)
)


# --------------------------------------------------------------------------------------------------------------------
# The notebooks: their own model and step cells, executed with the tables' sizes set here


def notebook_cells(name: str, *markers: str) -> list[str]:
    """The source of the code cell holding each marker, in order."""
    cells = json.loads((ROOT / "notebooks" / name).read_text())["cells"]
    sources = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    found = []
    for marker in markers:
        matching = [s for s in sources if marker in s]
        assert len(matching) == 1, f"{name}: {len(matching)} code cells hold {marker!r}"
        found.append(matching[0])
    return found


@functools.cache
def notebook(name: str, rows: int) -> dict[str, Any]:
    namespace: dict[str, Any] = {"jax": jax, "jnp": jnp, "np": np, "optax": optax, "osa": osa, "__name__": name}
    if name == "train_embeddings.ipynb":
        namespace |= {"NUM_USERS": rows, "NUM_ITEMS": rows, "DIM": WIDTH, "LEARNING_RATE": 2e-2}
        markers = ("def loss_fn", "def sparse_fast_step")
    else:
        namespace |= {"VOCAB": rows, "DIM": WIDTH, "LEARNING_RATE": 3e-3}
        markers = ("def loss_fn", "def fused_step")
    for source in notebook_cells(name, *markers):
        exec(compile(source, str(ROOT / "notebooks" / name), "exec"), namespace)
    return namespace


NEGATIVES = 5


def _notebook_step(rows: int, name: str, run: str) -> tuple[Any, tuple[Any, ...]]:
    namespace = notebook(name, rows)
    tx, step = namespace["steps"][run]
    params = jax.eval_shape(namespace["init_params"], jax.random.key(0))
    if name == "train_embeddings.ipynb":
        batch: tuple[Any, ...] = ((batch_ids(), batch_ids()), sds((K,)))
    else:
        batch = ((batch_ids(), batch_ids(), batch_ids((K, NEGATIVES))),)
    jitted = jax.jit(step, donate_argnums=(0, 1))  # params and state are updated in place
    return jitted, (params, jax.eval_shape(tx.init, params), *batch)


NOTEBOOK_JIT = '"step": jax.jit(step, donate_argnums=(0, 1)),'
TRAIN = "notebooks/train_embeddings.ipynb"
example(
    "train_embeddings_fast_path", TRAIN, NOTEBOOK_JIT, "so nothing table-sized is built and the step costs what the"
)(functools.partial(_notebook_step, name="train_embeddings.ipynb", run="sparse_adam, fast path"))
example(
    "train_embeddings_dense_path",
    TRAIN,
    NOTEBOOK_JIT,
    "This is the drop-in change, and it still\n   costs what the tables cost: the gradient is table-sized.",
    expect="dense",
)(functools.partial(_notebook_step, name="train_embeddings.ipynb", run="sparse_adam, dense path"))
example(
    "train_embeddings_optax_adam",
    TRAIN,
    NOTEBOOK_JIT,
    "every step reads and writes every row of both tables and of both\n   moments.",
    expect="dense",
)(functools.partial(_notebook_step, name="train_embeddings.ipynb", run="optax.adam"))
WORDS = "notebooks/word_embeddings.ipynb"
WORDS_JIT = '"step": jax.jit(step, donate_argnums=(0, 1)),  # tables and moments updated in place'
example("word_embeddings_fast_path", WORDS, WORDS_JIT, "The sparse paths cost what the batch costs.")(
    functools.partial(_notebook_step, name="word_embeddings.ipynb", run="sparse_adam, fast path")
)
FUSED = "params, state = osa.update_and_apply(sparse, grads, state, params)"
example("word_embeddings_fused", WORDS, WORDS_JIT, FUSED)(
    functools.partial(_notebook_step, name="word_embeddings.ipynb", run="sparse_adam, fused")
)
example("word_embeddings_catch_up", WORDS, WORDS_JIT, "The catch-up run also reads each touched")(
    functools.partial(_notebook_step, name="word_embeddings.ipynb", run="sparse_adam, catch-up")
)
example(
    "word_embeddings_optax_adam",
    WORDS,
    WORDS_JIT,
    "`optax.adam` costs what the tables cost: it builds table-sized gradients",
    expect="dense",
)(functools.partial(_notebook_step, name="word_embeddings.ipynb", run="optax.adam"))


# --------------------------------------------------------------------------------------------------------------------
# The checks


def reports(name: str, path: str = "default") -> tuple[osa.StepReport, osa.StepReport]:
    """The step compiled for tables of ``ROWS[0]`` and ``ROWS[1]`` rows (per device; the example's own sizes where it
    has them), as :func:`osa.step_report` reads it; table-sized means ``Example.min_bytes`` or more."""
    ex = EXAMPLES[name]
    out = []
    with contextlib.ExitStack() as stack:
        if path == "xla":
            if osa.kernel_path() == "xla":
                pytest.skip("the default path is the XLA path here (the native kernels were not built)")
            stack.enter_context(osa.use_kernels(False))
        stack.enter_context(jax.numpy_rank_promotion(ex.rank_promotion))
        for rows in ex.rows:
            step, args = ex.build(rows)
            out.append(osa.step_report(step, *args, min_bytes=ex.min_bytes))
    return out[0], out[1]


def describe(name: str, small: osa.StepReport, large: osa.StepReport) -> str:
    ex = EXAMPLES[name]
    return (
        f"{name} ({ex.where}):\n--- {ex.rows[0]:,} rows:\n{small}\n--- {ex.rows[1]:,} rows:\n{large}\n"
        f"temporaries: {small.temp_bytes:,} and {large.temp_bytes:,} bytes"
    )


def assert_in_place(name: str, small: osa.StepReport, large: osa.StepReport) -> None:
    """Every table donated, no table-sized copy, and temporaries that do not depend on the table's size."""
    why = describe(name, small, large)
    for report in (small, large):
        assert report.not_donated == (), f"tables not donated\n{why}"
        assert report.copies == (), f"table-sized copies\n{why}"
    assert large.temp_bytes == small.temp_bytes, f"temporaries grow with the table\n{why}"
    ex = EXAMPLES[name]
    assert large.temp_bytes < ex.temp_limit, f"table-sized temporaries\n{why}"
    if ex.temp_limit <= ex.min_bytes:
        assert small.in_place and large.in_place, why


def cases(expect: str) -> list[Any]:
    """``(name, kernel path)`` of each example expected to be ``expect``; a failure names the example."""
    out = []
    for name, ex in EXAMPLES.items():
        if ex.expect != expect:
            continue
        marks = [pytest.mark.xfail(strict=True, reason=ex.known_issue)] if ex.known_issue else []
        out += [pytest.param(name, path, id=f"{name}-{path}", marks=marks) for path in ex.paths]
    return out


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_rebuilt_from_the_documented_code(name: str) -> None:
    """The lines each rebuild follows are in its document: when the docs change, the rebuild must follow."""
    ex = EXAMPLES[name]
    text = squeeze(document(ex.where) + "\n" + (document(ex.also) if ex.also else ""))
    missing = [anchor for anchor in ex.anchors if squeeze(anchor) not in text]
    assert not missing, f"{name}: no longer in {ex.where}: {missing}"


@pytest.mark.parametrize(("name", "path"), cases("in_place"))
def test_documented_step_is_in_place_and_o_batch(name: str, path: str) -> None:
    small, large = reports(name, path)
    assert_in_place(name, small, large)
    if path == "xla":  # what GPU and TPU run: no native kernel in the compiled step
        assert large.kernel_path == "xla" and large.kernel_calls == 0, describe(name, small, large)


@pytest.mark.parametrize(("name", "path"), cases("dense"))
def test_documented_dense_step_costs_what_the_tables_cost(name: str, path: str) -> None:
    """What the docs say of these steps: their temporaries (the dense gradients) grow with the tables."""
    small, large = reports(name, path)
    why = describe(name, small, large)
    assert large.not_donated == (), f"documented as donated\n{why}"
    rows = EXAMPLES[name].rows
    growth = large.temp_bytes - small.temp_bytes
    assert growth >= table_bytes(rows[1]) - table_bytes(rows[0]), f"temporaries do not grow with the table\n{why}"
    assert not large.in_place, why


@pytest.mark.parametrize(("name", "path"), cases("not_donated"))
def test_documented_step_without_donation_is_reported(name: str, path: str) -> None:
    """A documented step that does not donate its tables: the report names every table and moment, and says so."""
    small, large = reports(name, path)
    why = describe(name, small, large)
    for report in (small, large):
        assert tuple(p for p, _ in report.not_donated) == EXAMPLES[name].not_donated, why
        assert not report.in_place, why
        assert "not donated" in str(report), why


def test_every_kind_of_documented_step_is_covered() -> None:
    """The README, the docs' pages, the docstrings, both examples and both notebooks each contribute steps."""
    kinds = {name.split("_")[0] for name in EXAMPLES}
    assert kinds == {"readme", "docs", "docstring", "demo", "dlrm", "train", "word"}
    assert len(cases("in_place")) >= 20
