"""Benchmarks the embedding part of a DLRM training step: pooled lookups, their backward, the optimizer.

Run from the repository root::

    python benchmarks/dlrm.py                # 1e6-row caps, width 16, into benchmarks/results/
    python benchmarks/dlrm.py --quick        # 20,000-row caps and a few steps: checks that it all runs
    python benchmarks/dlrm.py --width 64

The model is the sparse half of DLRM on the Criteo tables: 26 categorical
features, one table each, with Criteo Kaggle's cardinalities capped at
``--cap`` rows. One step looks up every feature's bag of ids, sums each bag
(SUM pooling), backpropagates a FIXED upstream gradient ``G`` on the pooled
outputs (the loss is ``sum_f sum(pooled[f] * G[f])``, so its gradient with
respect to ``pooled`` is ``G``; the dense MLPs are left out) and applies the
optimizer to the rows touched. Two configurations:

- ``kaggle``: one-hot features, 2,048 examples (as the DLRM Kaggle benchmark);
- ``dlrmv2``: MLPerf DLRMv2's multi-hot bags (fixed sizes per feature,
  214 ids per example), 256 examples.

Ids are drawn from Zipf(1.2) ranks truncated to each table and spread over it
by a fixed bijective hash plus a random shift per table. Every contender sees
the same sequence of fresh batches (``--pool`` of them, cycled), on its own
tables, and the contenders of a configuration take turns round by round in
one process, so their ratios compare figures taken side by side (the dense
``optax.adam``, which streams the whole stack, is timed after them, with
fewer steps). Figures are
medians of wall times after warm-up steps; JAX steps are jitted with the
parameters and the optimizer state donated, and timed until
``jax.block_until_ready``; PyTorch steps until they return.

PyTorch and FBGEMM run on ``--threads`` threads (``torch.set_num_threads``,
default 2), as do the library's native kernels; ``OMP_WAIT_POLICY`` is
``PASSIVE`` unless set (see below). Before timing, one step of the library's
row-wise Adagrad is checked against FBGEMM's and one of its Adam against
``torch.optim.SparseAdam`` on small tables.

Writes ``dlrm.json`` and ``dlrm.png`` into ``--out`` (default
``benchmarks/results``; other widths, thread counts and ``--quick`` get their
own file names) and prints a Markdown table per configuration.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

# PyTorch's and FBGEMM's OpenMP threads sleep at a barrier rather than spin (unless the caller chose otherwise): on
# the 2-core machine, shared with other work, spinning OpenMP threads made FBGEMM's CPU backward take 1-2 s a step
# (90% of its time in libgomp) where it otherwise takes a few ms. Set before torch is imported, and recorded.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import floor
import jax
import jax.numpy as jnp
import numpy as np
import optax
import report
import torch
from contenders import JaxStepper, Stepper, TimingPlan, fbgemm_unavailable, release, sample_ids, time_steppers

import optax_sparse_adam as osa

# Criteo Kaggle (Display Advertising Challenge) cardinalities of the 26 categorical features C1..C26.
CARDINALITIES = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip
# MLPerf DLRMv2's multi-hot bag size of each feature.
DLRMV2_BAGS = (3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1)
FEATURES = tuple(f"C{i + 1}" for i in range(len(CARDINALITIES)))

ADAM_LR = 1e-3
ADAGRAD_LR = 1e-2
ADAGRAD_EPS = 1e-8  # the library's and FBGEMM's row-wise Adagrad get the same eps
ROWS_SEED = 1234  # the per-table shifts of the hash


@dataclasses.dataclass(frozen=True)
class DlrmConfig:
    """One configuration: the batch size, each feature's bag size, the row cap and the width."""

    name: str
    batch: int
    bag_sizes: tuple[int, ...]
    cap: int
    width: int

    @property
    def rows(self) -> tuple[int, ...]:
        return tuple(min(c, self.cap) for c in CARDINALITIES)

    @property
    def total_rows(self) -> int:
        return sum(self.rows)

    @property
    def ids_per_batch(self) -> int:
        return self.batch * sum(self.bag_sizes)

    @property
    def label(self) -> str:
        hot = "one-hot" if set(self.bag_sizes) == {1} else f"multi-hot ({sum(self.bag_sizes)} ids per example)"
        return (
            f"{self.name}: {self.batch} examples, {hot}, 26 tables capped at {self.cap:,} rows "
            f"({self.total_rows:,} in all), width {self.width}"
        )


def standard_configs(cap: int, width: int) -> dict[str, DlrmConfig]:
    """The two configurations: one-hot Kaggle-style features on 2,048 examples, and DLRMv2's bags on 256."""
    return {
        "kaggle": DlrmConfig("kaggle", 2048, (1,) * len(FEATURES), cap, width),
        "dlrmv2": DlrmConfig("dlrmv2", 256, DLRMV2_BAGS, cap, width),
    }


@dataclasses.dataclass
class Data:
    """The batches of one configuration, in every contender's form, and the fixed upstream gradient.

    Attributes:
      ids: Per batch, feature name to ``(batch,)`` (one-hot) or ``(batch, bag)`` int32 ids into its own table.
      stacked_distinct: Per batch, the distinct ids into the stacked table, padded with ``total_rows`` to one length.
      distinct: Mean number of distinct rows per batch (over all tables).
      g: ``(26, batch, width)`` float32: the upstream gradient of each feature's pooled outputs.
    """

    ids: list[dict[str, np.ndarray]]
    stacked_distinct: list[np.ndarray]
    distinct: float
    g: np.ndarray


def make_data(cfg: DlrmConfig, pool: int, seed: int) -> Data:
    """Draws ``pool`` batches of Zipf ids for ``cfg``, and the fixed gradient."""
    rng = np.random.default_rng(seed)
    shifts = np.random.default_rng(ROWS_SEED).integers(0, 2**31, size=len(FEATURES))
    starts = np.cumsum((0, *cfg.rows))[:-1]
    batches, distinct = [], []
    for _ in range(pool):
        batch = {}
        for f, rows, bag, shift in zip(FEATURES, cfg.rows, cfg.bag_sizes, shifts, strict=True):
            # sample_ids spreads Zipf ranks over the table by a multiplicative hash (a bijection: its
            # multiplier is prime); the shift moves each table's hottest row away from row 0.
            ids = ((sample_ids(rng, rows, cfg.batch * bag, "zipf").astype(np.int64) + shift) % rows).astype(np.int32)
            batch[f] = ids if bag == 1 else ids.reshape(cfg.batch, bag)
        batches.append(batch)
        stacked = [batch[f].reshape(-1) + start for f, start in zip(FEATURES, starts, strict=True)]
        distinct.append(np.unique(np.concatenate(stacked)))
    width = max(d.size for d in distinct)
    padded = [np.pad(d, (0, width - d.size), constant_values=cfg.total_rows).astype(np.int32) for d in distinct]
    g = rng.standard_normal((len(FEATURES), cfg.batch, cfg.width), dtype=np.float32)
    return Data(batches, padded, float(np.mean([d.size for d in distinct])), g)


# ---------------------------------------------------------------------------------------------------------------------
# The library's contenders.


def collection(cfg: DlrmConfig) -> osa.EmbeddingCollection:
    return osa.EmbeddingCollection(
        tables={f: osa.TableSpec(rows, cfg.width) for f, rows in zip(FEATURES, cfg.rows, strict=True)}
    )


def pooled_loss(pooled: dict[str, jax.Array], g: jax.Array) -> jax.Array:
    """``sum_f sum(pooled[f] * g[f])``: its gradient with respect to ``pooled[f]`` is ``g[f]``."""
    return sum(jnp.sum(pooled[f] * g[j]) for j, f in enumerate(FEATURES))  # type: ignore[return-value]


def stacked_loss_fn(coll: osa.EmbeddingCollection) -> Callable[..., jax.Array]:
    def loss(params: dict[str, jax.Array], bags: dict[str, osa.Bags], g: jax.Array) -> jax.Array:
        return pooled_loss(coll.pool(params, bags), g)

    return loss


def init_stack(coll: osa.EmbeddingCollection, seed: int) -> dict[str, jax.Array]:
    return coll.init(jax.random.key(seed))


def lib_inputs(data: Data, g: jax.Array) -> list[tuple[Any, ...]]:
    return [({f: jnp.asarray(x) for f, x in batch.items()}, g) for batch in data.ids]


def make_osa_stacked(
    cfg: DlrmConfig,
    data: Data,
    g: jax.Array,
    tx: optax.GradientTransformation,
    seed: int,
) -> JaxStepper:
    """One stacked table (``EmbeddingCollection``), ``value_and_row_grad``, ``update_and_apply``."""
    coll = collection(cfg)
    grad_fn = osa.value_and_row_grad(stacked_loss_fn(coll), lambda p: p)

    def step(params: Any, state: Any, inputs: dict[str, jax.Array], g: jax.Array) -> tuple[Any, Any]:
        _, grads = grad_fn(params, coll.bags(inputs), g)
        return osa.update_and_apply(tx, grads, state, params)

    params = init_stack(coll, seed)
    return JaxStepper(jax.jit(step, donate_argnums=(0, 1)), params, tx.init(params), lib_inputs(data, g))


def make_osa_adam(cfg: DlrmConfig, data: Data, g: jax.Array, seed: int) -> Stepper:
    return make_osa_stacked(cfg, data, g, osa.sparse_adam(ADAM_LR), seed)


def make_osa_rowwise_adagrad(cfg: DlrmConfig, data: Data, g: jax.Array, seed: int) -> Stepper:
    return make_osa_stacked(cfg, data, g, osa.sparse_rowwise_adagrad(ADAGRAD_LR, eps=ADAGRAD_EPS), seed)


def make_osa_adam_26(cfg: DlrmConfig, data: Data, g: jax.Array, seed: int) -> Stepper:
    """26 separate tables: one ``value_and_row_grad`` over 26 leaves, each with its own ``osa.bags``."""
    coll = collection(cfg)
    tx = osa.sparse_adam(ADAM_LR)
    rows = dict(zip(FEATURES, cfg.rows, strict=True))

    def loss(params: dict[str, jax.Array], bags: dict[str, osa.Bags], g: jax.Array) -> jax.Array:
        return pooled_loss({f: osa.pool(params[f], bags[f]) for f in FEATURES}, g)

    grad_fn = osa.value_and_row_grad(loss, lambda p: p)

    def step(params: Any, state: Any, inputs: dict[str, jax.Array], g: jax.Array) -> tuple[Any, Any]:
        bags = {f: osa.bags(inputs[f], rows[f]) for f in FEATURES}
        _, grads = grad_fn(params, bags, g)
        return osa.update_and_apply(tx, grads, state, params)

    stack = init_stack(coll, seed)  # the same initial rows as the stacked contenders
    params = {f: jnp.array(coll.table(stack, f)) for f in FEATURES}
    del stack
    return JaxStepper(jax.jit(step, donate_argnums=(0, 1)), params, tx.init(params), lib_inputs(data, g))


def make_optax_adam(cfg: DlrmConfig, data: Data, g: jax.Array, seed: int) -> Stepper:
    """Dense ``optax.adam`` on the stacked table: ``jax.grad`` of the same pooled loss (a table-sized gradient)."""
    coll = collection(cfg)
    tx = optax.adam(ADAM_LR)
    loss = stacked_loss_fn(coll)

    def step(params: Any, state: Any, inputs: dict[str, jax.Array], g: jax.Array) -> tuple[Any, Any]:
        grads = jax.grad(loss)(params, coll.bags(inputs), g)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    params = init_stack(coll, seed)
    return JaxStepper(jax.jit(step, donate_argnums=(0, 1)), params, tx.init(params), lib_inputs(data, g))


def make_floor(cfg: DlrmConfig, data: Data, g: jax.Array, seed: int) -> Stepper:
    """The benchmark's floor kernel over the stacked table: each distinct touched row of p, m, v read and written once.

    The distinct ids of each batch are computed beforehand, on the host, so the
    floor does no lookup, no deduplication, no pooling and no Adam arithmetic:
    it is the memory traffic any Adam step must do (the forward read of the
    same rows is left to the cache).
    """
    del g, seed
    from optax_sparse_adam import _kernel_path

    def step(params: jax.Array, state: Any, keys: jax.Array, values: jax.Array) -> tuple[jax.Array, Any]:
        m, v = state
        params, m, v = floor.touch_rows((params, m, v), keys, values, threads=_kernel_path.threads())
        return params, (m, v)

    params = jnp.full((cfg.total_rows, cfg.width), 0.01, jnp.float32)
    state = (jnp.zeros_like(params), jnp.zeros_like(params))
    values = jnp.full((data.stacked_distinct[0].size, cfg.width), 1e-6, jnp.float32)
    inputs = [(keys, values) for keys in data.stacked_distinct]
    return JaxStepper(jax.jit(step, donate_argnums=(0, 1)), params, state, inputs)


# ---------------------------------------------------------------------------------------------------------------------
# PyTorch and FBGEMM.


def torch_g(data: Data) -> list[torch.Tensor]:
    return [torch.from_numpy(data.g[j]) for j in range(len(FEATURES))]


def make_fbgemm(cfg: DlrmConfig, data: Data, g: jax.Array, seed: int) -> Stepper:
    """FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen`` on the CPU: forward, then ``backward(G)`` (fused update)."""
    del g
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    torch.manual_seed(seed)
    specs = [(rows, cfg.width, EmbeddingLocation.HOST, ComputeDevice.CPU) for rows in cfg.rows]
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        specs,
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=ADAGRAD_LR,
        eps=ADAGRAD_EPS,
        pooling_mode=PoolingMode.SUM,
    )
    inputs = []
    for batch in data.ids:
        # Table-major: the bags of table 0 for every example, then table 1's, ...
        indices = torch.from_numpy(np.concatenate([batch[f].reshape(-1) for f in FEATURES]).astype(np.int64))
        lengths = np.repeat(np.asarray(cfg.bag_sizes, np.int64), cfg.batch)
        offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
        inputs.append((indices, offsets))
    # The output is (batch, 26 * width): each example's pooled features side by side.
    grad = torch.from_numpy(np.ascontiguousarray(data.g.transpose(1, 0, 2).reshape(cfg.batch, -1)))

    def run(i: int) -> None:
        indices, offsets = inputs[i % len(inputs)]
        tbe(indices, offsets).backward(grad)

    return run


def make_torch_sparse_adam(cfg: DlrmConfig, data: Data, g: jax.Array, seed: int) -> Stepper:
    """26 ``nn.EmbeddingBag(mode="sum", sparse=True)``, backward of G, ``torch.optim.SparseAdam``."""
    del g
    torch.manual_seed(seed)
    bags = [torch.nn.EmbeddingBag(rows, cfg.width, mode="sum", sparse=True) for rows in cfg.rows]
    opt = torch.optim.SparseAdam([b.weight for b in bags], lr=ADAM_LR)
    grads = torch_g(data)
    inputs = [
        [torch.from_numpy(batch[f].astype(np.int64)).reshape(cfg.batch, -1) for f in FEATURES] for batch in data.ids
    ]

    def run(i: int) -> None:
        outs = [b(x) for b, x in zip(bags, inputs[i % len(inputs)], strict=True)]
        torch.autograd.backward(outs, grads)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return run


@dataclasses.dataclass(frozen=True)
class Contender:
    name: str
    label: str
    measures: str
    make: Callable[[DlrmConfig, Data, jax.Array, int], Stepper]
    dense: bool = False


CONTENDERS = (
    Contender(
        "osa_adam",
        "library Adam, stacked",
        "EmbeddingCollection (1 stack): coll.bags + value_and_row_grad (dedup, gather, pool, backward) "
        "+ update_and_apply(osa.sparse_adam) (native kernels), jitted, donated",
        make_osa_adam,
    ),
    Contender(
        "osa_rowwise_adagrad",
        "library row-wise Adagrad, stacked",
        "as library Adam, with osa.sparse_rowwise_adagrad (update_and_apply: native kernels)",
        make_osa_rowwise_adagrad,
    ),
    Contender(
        "osa_adam_26",
        "library Adam, 26 tables",
        "as library Adam, with 26 separate tables: 26 osa.bags, one value_and_row_grad over 26 leaves, "
        "update_and_apply over 26 leaves",
        make_osa_adam_26,
    ),
    Contender(
        "fbgemm_rowwise_adagrad",
        "FBGEMM TBE row-wise Adagrad",
        "fbgemm_gpu SplitTableBatchedEmbeddingBagsCodegen (CPU, HOST, SUM), EXACT_ROWWISE_ADAGRAD: "
        "forward + backward(G), the update fused into the backward",
        make_fbgemm,
    ),
    Contender(
        "torch_sparse_adam",
        "torch EmbeddingBag + SparseAdam",
        "26 nn.EmbeddingBag(mode='sum', sparse=True): forward, autograd.backward(G), SparseAdam.step, zero_grad",
        make_torch_sparse_adam,
    ),
    Contender(
        "optax_adam",
        "optax.adam (dense)",
        "jax.grad of the same pooled loss on the stacked table (a table-sized gradient) + optax.adam, jitted, donated",
        make_optax_adam,
        dense=True,
    ),
    Contender(
        "floor",
        "floor (p, m, v rows)",
        "benchmark kernel: each distinct touched row of the stacked p, m, v read and written once "
        "(distinct ids precomputed on the host; no lookup, pooling or arithmetic)",
        make_floor,
    ),
)


def max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True))


def agreement(seed: int) -> dict[str, Any]:
    """Checks, on 3 small tables, that the contenders that should agree compute the same step.

    One step from the same initial tables, ids and upstream gradient: the
    library's row-wise Adagrad against FBGEMM's ``EXACT_ROWWISE_ADAGRAD``, and
    the library's Adam (``eps_placement="torch"``) against
    ``torch.optim.SparseAdam``, which adds ``eps`` to ``sqrt(v)`` before its
    bias correction. Returns the largest absolute difference of the updated
    tables for each pair.
    """
    rows, width, batch, sizes = (50, 30, 7), 16, 8, (2, 1, 3)
    rng = np.random.default_rng(seed)
    init = [rng.standard_normal((r, width)).astype(np.float32) for r in rows]
    ids = [rng.integers(0, r, (batch, n)).astype(np.int32) for r, n in zip(rows, sizes, strict=True)]
    g = rng.standard_normal((len(rows), batch, width)).astype(np.float32)
    names = [f"t{t}" for t in range(len(rows))]
    coll = osa.EmbeddingCollection(tables={n: osa.TableSpec(r, width) for n, r in zip(names, rows, strict=True)})
    (stack,) = coll.stacks

    def library(tx: optax.GradientTransformation) -> list[np.ndarray]:
        def loss(p: Any, b: Any, g: jax.Array) -> jax.Array:
            f = coll.pool(p, b)
            return sum(jnp.sum(f[n] * g[t]) for t, n in enumerate(names))  # type: ignore[return-value]

        params = {stack: jnp.asarray(np.concatenate(init))}
        bags = coll.bags({n: jnp.asarray(i) for n, i in zip(names, ids, strict=True)})
        _, grads = osa.value_and_row_grad(loss, lambda p: p)(params, bags, jnp.asarray(g))
        new, _ = osa.update_and_apply(tx, grads, tx.init(params), params)
        return [np.asarray(coll.table(new, n)) for n in names]

    out: dict[str, Any] = {}
    if fbgemm_unavailable() is None:
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            SplitTableBatchedEmbeddingBagsCodegen,
        )

        tbe = SplitTableBatchedEmbeddingBagsCodegen(
            [(r, width, EmbeddingLocation.HOST, ComputeDevice.CPU) for r in rows],
            optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            learning_rate=ADAGRAD_LR,
            eps=ADAGRAD_EPS,
            pooling_mode=PoolingMode.SUM,
        )
        with torch.no_grad():
            for w, x in zip(tbe.split_embedding_weights(), init, strict=True):
                w.copy_(torch.from_numpy(x))
        indices = torch.from_numpy(np.concatenate([i.reshape(-1) for i in ids]).astype(np.int64))
        offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(np.repeat(sizes, batch))]).astype(np.int64))
        tbe(indices, offsets).backward(torch.from_numpy(np.ascontiguousarray(g.transpose(1, 0, 2).reshape(batch, -1))))
        theirs = [w.detach().numpy() for w in tbe.split_embedding_weights()]
        ours = library(osa.sparse_rowwise_adagrad(ADAGRAD_LR, eps=ADAGRAD_EPS))
        out["rowwise_adagrad_vs_fbgemm_max_abs_diff"] = max_diff(ours, theirs)
    bags = [torch.nn.EmbeddingBag(r, width, mode="sum", sparse=True) for r in rows]
    with torch.no_grad():
        for b, x in zip(bags, init, strict=True):
            b.weight.copy_(torch.from_numpy(x))
    opt = torch.optim.SparseAdam([b.weight for b in bags], lr=ADAM_LR)
    outs = [b(torch.from_numpy(i.astype(np.int64))) for b, i in zip(bags, ids, strict=True)]
    torch.autograd.backward(outs, [torch.from_numpy(x) for x in g])
    opt.step()
    theirs = [b.weight.detach().numpy() for b in bags]
    ours = library(osa.sparse_adam(ADAM_LR, eps_placement="torch"))
    out["adam_vs_torch_sparse_adam_max_abs_diff"] = max_diff(ours, theirs)
    return out


# ---------------------------------------------------------------------------------------------------------------------
# The profile of the library's Adam step.


def profile_osa_adam(cfg: DlrmConfig, data: Data, g: jax.Array, plan: TimingPlan, seed: int) -> dict[str, Any]:
    """Times the library Adam step cumulatively, stage by stage, and its optimizer alone.

    Stages (each a separate jitted function, run on the same batches):
    ``bags`` builds the stacked bags; ``+ lookup`` adds the deduplication and
    the gather of distinct rows (``osa.lookup``); ``+ pool`` adds the forward
    pooling; ``value_and_row_grad`` is the whole forward and backward,
    returning the row gradients (with the bags as ``coll.bags`` builds them,
    then with their ``blocks`` dropped, so that ``osa.pool`` takes its
    segment-sum path rather than a slice per block); ``update_and_apply`` is
    the optimizer alone, on precomputed row gradients; ``step`` is the
    contender itself. XLA optimizes each function as a whole, so differences
    between stages are estimates.
    """
    coll = collection(cfg)
    (stack,) = coll.stacks
    loss = stacked_loss_fn(coll)
    grad_fn = osa.value_and_row_grad(loss, lambda p: p)
    tx = osa.sparse_adam(ADAM_LR)
    params = init_stack(coll, seed)
    inputs = lib_inputs(data, g)

    def s_bags(p: Any, x: Any, g: jax.Array) -> Any:
        return coll.bags(x)

    def s_lookup(p: Any, x: Any, g: jax.Array) -> Any:
        b = coll.bags(x)[stack]
        lk = osa.lookup(p[stack], b.ids)
        return lk.rows, lk.inverse, b.bag, b.weights

    def s_pool(p: Any, x: Any, g: jax.Array) -> Any:
        b = coll.bags(x)[stack]
        lk = osa.lookup(p[stack], b.ids)
        return osa.pool(lk.rows, dataclasses.replace(b, ids=lk.inverse, num_rows=lk.rows.shape[0]))

    def s_grad(p: Any, x: Any, g: jax.Array) -> Any:
        return grad_fn(p, coll.bags(x), g)[1]

    def s_grad_ragged(p: Any, x: Any, g: jax.Array) -> Any:
        # The same bags with their block structure dropped: pool's segment-sum path, not its per-block slices.
        bags = {k: dataclasses.replace(b, blocks=None) for k, b in coll.bags(x).items()}
        return grad_fn(p, bags, g)[1]

    def stage(fn: Callable[..., Any]) -> Stepper:
        jitted = jax.jit(fn)
        device_inputs = [jax.device_put(i) for i in inputs]

        def run(i: int) -> None:
            jax.block_until_ready(jitted(params, *device_inputs[i % len(device_inputs)]))

        return run

    steppers: dict[str, Stepper] = {
        "bags": stage(s_bags),
        "+ lookup (dedup + gather)": stage(s_lookup),
        "+ pool (forward)": stage(s_pool),
        "value_and_row_grad (forward + backward)": stage(s_grad),
    }
    if "blocks" in {f.name for f in dataclasses.fields(osa.Bags)}:
        steppers["value_and_row_grad, bags without blocks"] = stage(s_grad_ragged)
    # The optimizer alone, on each batch's row gradients computed beforehand.
    grads_fn = jax.jit(s_grad)
    grads = [grads_fn(params, *i) for i in inputs]

    def opt_step(p: Any, state: Any, grads: Any) -> Any:
        return osa.update_and_apply(tx, grads, state, p)

    opt_params = init_stack(coll, seed + 1)
    steppers["update_and_apply (optimizer alone)"] = JaxStepper(
        jax.jit(opt_step, donate_argnums=(0, 1)), opt_params, tx.init(opt_params), [(gr,) for gr in grads]
    )
    steppers["step (the contender)"] = make_osa_adam(cfg, data, g, seed + 2)
    samples = time_steppers(steppers, plan)
    return {name: summarize(s) for name, s in samples.items()}


# ---------------------------------------------------------------------------------------------------------------------
# Timing, the report.


def summarize(samples_s: list[float]) -> dict[str, Any]:
    ms = sorted(1e3 * s for s in samples_s)
    q = statistics.quantiles(ms, n=4) if len(ms) > 1 else [ms[0]] * 3
    return {"median_ms": statistics.median(ms), "min_ms": ms[0], "q1_ms": q[0], "q3_ms": q[2], "n": len(ms)}


def load() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "load average: {:.2f}, {:.2f}, {:.2f}".format(*os.getloadavg())


def run_config(cfg: DlrmConfig, args: argparse.Namespace, plan: TimingPlan, dense_plan: TimingPlan) -> dict[str, Any]:
    started = time.perf_counter()
    data = make_data(cfg, args.pool, args.seed)
    g = jnp.asarray(data.g)
    results: dict[str, dict[str, Any]] = {}
    steppers: dict[str, Stepper] = {}
    why_fbgemm = fbgemm_unavailable()
    for c in CONTENDERS:
        if c.name not in args.contenders:
            continue
        if c.name == "fbgemm_rowwise_adagrad" and why_fbgemm is not None:
            print(f"  skipping {c.name}: {why_fbgemm}", file=sys.stderr)
            results[c.name] = {"skipped": why_fbgemm}
            continue
        if c.name == "floor" and (why := floor.unavailable()) is not None:
            print(f"  skipping the floor: {why}", file=sys.stderr)
            results[c.name] = {"skipped": why}
            continue
        if c.dense:
            continue
        print(f"  building {c.name}", file=sys.stderr)
        stepper = c.make(cfg, data, g, args.seed)
        # Two untimed steps first (on the pool's last batches): compilation, and FBGEMM's and torch's first
        # steps (seconds each here), which would otherwise make time_steppers count it as a slow contender.
        for i in (args.pool - 2, args.pool - 1):
            stepper(i)
        steppers[c.name] = stepper
    print(f"  {load()}", file=sys.stderr)
    print(f"  timing {len(steppers)} contenders, interleaved", file=sys.stderr)
    for name, samples in time_steppers(steppers, plan).items():
        results[name] = summarize(samples)
    del steppers
    release()
    # The dense contender is timed on its own (it streams the whole stack every step), with fewer steps.
    for c in CONTENDERS:
        if c.dense and c.name in args.contenders:
            print(f"  timing {c.name} (dense, fewer steps)", file=sys.stderr)
            stepper = c.make(cfg, data, g, args.seed)
            results[c.name] = summarize(time_steppers({c.name: stepper}, dense_plan)[c.name])
            del stepper
            release()
    profile = None
    if args.profile and "osa_adam" in args.contenders:
        print("  profiling the library Adam step", file=sys.stderr)
        profile = profile_osa_adam(cfg, data, g, plan, args.seed)
    fb = results.get("fbgemm_rowwise_adagrad", {})

    def ratios(key: str) -> dict[str, float]:
        return {n: r[key] / fb[key] for n, r in results.items() if key in fb and key in r}

    def over(a: str, b: str, key: str) -> float | None:
        x, y = results.get(a, {}).get(key), results.get(b, {}).get(key)
        return x / y if x and y else None

    record = {
        "config": dataclasses.asdict(cfg),
        "label": cfg.label,
        "total_rows": cfg.total_rows,
        "ids_per_batch": cfg.ids_per_batch,
        "distinct_rows_per_batch": data.distinct,
        "results": results,
        "ratios_vs_fbgemm": ratios("median_ms"),
        "ratios_vs_fbgemm_min": ratios("min_ms"),
        "tables_26_over_stacked": over("osa_adam_26", "osa_adam", "median_ms"),
        "tables_26_over_stacked_min": over("osa_adam_26", "osa_adam", "min_ms"),
        "profile_osa_adam": profile,
        "wall_s": time.perf_counter() - started,
    }
    del data, g
    release()
    return record


def _ms(x: float) -> str:
    return f"{x:.3f}" if x < 1 else f"{x:.2f}" if x < 100 else f"{x:.0f}"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def markdown(record: dict[str, Any]) -> str:
    lines = [
        f"### {record['label']}",
        "",
        f"{record['ids_per_batch']:,} ids per batch, "
        f"{record['distinct_rows_per_batch']:,.0f} distinct rows on average.",
        "",
        "Median step time, the fastest step (less sensitive to other load on a shared machine), the quartiles, "
        "the timed steps, and the median's and the fastest's ratios to FBGEMM's.",
        "",
        "| contender | median ms | min ms | q1 - q3 ms | steps | median / FBGEMM | min / FBGEMM |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    labels = {c.name: c.label for c in CONTENDERS}
    for name, r in record["results"].items():
        if "median_ms" not in r:
            lines.append(f"| {labels[name]} | skipped: {r['skipped']} | | | | | |")
            continue
        ratio, ratio_min = record["ratios_vs_fbgemm"].get(name), record["ratios_vs_fbgemm_min"].get(name)
        lines.append(
            f"| {labels[name]} | {_ms(r['median_ms'])} | {_ms(r['min_ms'])} | {_ms(r['q1_ms'])} - {_ms(r['q3_ms'])} "
            f"| {r['n']} | {_ratio(ratio)} | {_ratio(ratio_min)} |"
        )
    t, t_min = record["tables_26_over_stacked"], record["tables_26_over_stacked_min"]
    if t is not None:
        verdict = "met" if t <= 1.25 else "not met"
        lines += [
            "",
            f"- 26 separate tables / one stacked table (library Adam): {t:.2f}x median, {_ratio(t_min)} fastest "
            f"(target <= 1.25x on the median: {verdict})",
        ]
    if record["profile_osa_adam"]:
        lines += ["", "Library Adam step, cumulative stages (separate jitted functions):", ""]
        lines += ["| stage | median ms | min ms |", "| --- | ---: | ---: |"]
        for k, v in record["profile_osa_adam"].items():
            lines.append(f"| {k} | {_ms(v['median_ms'])} | {_ms(v['min_ms'])} |")
    return "\n".join(lines)


def results_markdown(doc: dict[str, Any]) -> str:
    """The results of a run, from its results document: the body of the docs' DLRM benchmark page."""
    m = doc["machine"]
    osa_info = m.get("optax_sparse_adam", {})
    head = (
        f"Measured at commit `{str(osa_info.get('commit', 'unknown'))[:7]}`"
        f"{' (modified tree)' if osa_info.get('modified') else ''} on {m.get('cores')} cores ({m.get('cpu')}), "
        f"{m.get('date_utc')}, load average {', '.join(f'{x:.2f}' for x in m.get('load_average_start', []))} at "
        f"the start; torch and FBGEMM on {doc['settings']['threads']} threads, OMP_WAIT_POLICY="
        f"{doc['settings'].get('omp_wait_policy')}"
        + ("; `osa.tune_malloc()` called first" if doc["settings"].get("tune_malloc") else "")
        + ". `python benchmarks/dlrm.py` rewrites the results file."
    )
    parts = [head] + [markdown(record).replace("### ", "#### ", 1) for record in doc["configs"]]
    return "\n\n".join(parts)


def plot(doc: dict[str, Any], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = doc["configs"]
    fig, axes = plt.subplots(1, len(records), figsize=(6.5 * len(records), 4.2), squeeze=False)
    labels = {c.name: c.label for c in CONTENDERS}
    for ax, record in zip(axes[0], records, strict=True):
        names = [n for n, r in record["results"].items() if "median_ms" in r]
        medians = [record["results"][n]["median_ms"] for n in names]
        colors = [
            "tab:blue" if n.startswith("osa") else "black" if n == "floor" else "tab:green" if "fbgemm" in n else
            "tab:red" if n == "optax_adam" else "tab:orange"
            for n in names
        ]  # fmt: skip
        y = np.arange(len(names))
        ax.barh(y, medians, color=colors)
        mins = [record["results"][n]["min_ms"] for n in names]
        ax.plot(mins, y, "k|", markersize=12)
        ax.set_yticks(y, [labels[n] for n in names])
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlim(min(mins) / 2, max(medians) * 5)  # room for the labels
        ax.set_xlabel("ms per step, log scale: median (bar), fastest step (|)")
        cfg = record["config"]
        ax.set_title(f"{cfg['name']}: {cfg['batch']} examples, cap {cfg['cap']:,}, width {cfg['width']}", fontsize=10)
        for yi, m in zip(y, medians, strict=True):
            ax.text(m, yi, f" {_ms(m)}", va="center", fontsize=8)
        ax.grid(axis="x", which="both", alpha=0.3)
    fig.suptitle("DLRM embedding step (pooled lookup, backward of fixed G, optimizer): 26 Criteo tables", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="20,000-row caps and a few steps: a smoke run")
    parser.add_argument("--cap", type=int, default=None, help="rows per table at most (default 1e6; 20,000 quick)")
    parser.add_argument("--width", type=int, default=16, help="embedding width (default 16)")
    parser.add_argument("--pool", type=int, default=32, help="batches drawn per configuration, cycled (default 32)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads and the library's kernel threads")
    parser.add_argument("--configs", nargs="+", choices=("kaggle", "dlrmv2"), default=["kaggle", "dlrmv2"])
    names = [c.name for c in CONTENDERS]
    parser.add_argument("--contenders", nargs="+", choices=names, default=names)
    parser.add_argument("--no-profile", dest="profile", action="store_false", help="skip the library Adam profile")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tune-malloc", action="store_true", help="osa.tune_malloc() first (results in dlrm*_malloc.json)"
    )
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        default=pathlib.Path(__file__).resolve().parent / "results",
        help="output folder (default: benchmarks/results)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.tune_malloc and not osa.tune_malloc():
        raise SystemExit("--tune-malloc: this process's C library is not glibc")
    torch.set_num_threads(args.threads)
    with osa.use_kernels(True, threads=min(args.threads, 16)):
        run(args)


def run(args: argparse.Namespace) -> None:
    started = time.perf_counter()
    cap = args.cap or (20_000 if args.quick else 10**6)
    if args.quick:
        plan = TimingPlan(warmup=2, timed=6, min_timed=2, budget_s=1.0, rounds=2)
        dense_plan = TimingPlan(warmup=2, timed=3, min_timed=2, budget_s=1.0, rounds=1)
    else:
        plan = TimingPlan(warmup=5, timed=80, min_timed=10, budget_s=3.0, rounds=16)
        dense_plan = TimingPlan(warmup=3, timed=10, min_timed=5, budget_s=6.0, rounds=1)
    configs = standard_configs(cap, args.width)
    machine = report.machine_info(args.threads)
    agree = agreement(args.seed)
    print(
        "Agreement after one step on small tables (max |difference| of the tables): "
        + ", ".join(f"{k} {v:.2g}" for k, v in agree.items()),
        flush=True,
    )
    print("Contenders:\n" + "\n".join(f"- {c.label}: {c.measures}" for c in CONTENDERS) + "\n", flush=True)
    print(f"{load()}  ({os.cpu_count()} cores; kernel path {osa.kernel_path()})", file=sys.stderr)
    records = []
    for name in args.configs:
        cfg = configs[name]
        print(f"{cfg.label}", file=sys.stderr)
        records.append(run_config(cfg, args, plan, dense_plan))
        print("\n" + markdown(records[-1]) + "\n", flush=True)
    machine["load_average_end"] = os.getloadavg()
    machine["uptime_end"] = load()
    doc = {
        "quick": args.quick,
        "machine": machine,
        "settings": {
            "plan": dataclasses.asdict(plan),
            "dense_plan": dataclasses.asdict(dense_plan),
            "pool": args.pool,
            "threads": args.threads,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "seed": args.seed,
            "zipf_exponent": 1.2,
            "adam_lr": ADAM_LR,
            "adagrad_lr": ADAGRAD_LR,
            "adagrad_eps": ADAGRAD_EPS,
            "kernel_path": osa.kernel_path(),
            "tune_malloc": args.tune_malloc,
            "wall_s": time.perf_counter() - started,
        },
        "agreement": agree,
        "contenders": {c.name: {"label": c.label, "measures": c.measures} for c in CONTENDERS},
        "configs": records,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    # dlrm.json for the default run; other settings get their own files (dlrm_quick.json, dlrm_w64_t1.json).
    suffix = "_quick" if args.quick else ""
    suffix += "" if args.width == 16 else f"_w{args.width}"
    suffix += "" if args.threads == 2 else f"_t{args.threads}"
    suffix += "_malloc" if args.tune_malloc else ""
    json_path, png_path = args.out / f"dlrm{suffix}.json", args.out / f"dlrm{suffix}.png"
    json_path.write_text(json.dumps(doc, indent=1) + "\n")
    plot(doc, png_path)
    print(f"wrote {json_path} and {png_path} in {time.perf_counter() - started:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
