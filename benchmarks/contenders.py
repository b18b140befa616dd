"""Optimizer-step contenders, the batches they see, and the timing loop.

A contender turns a :class:`Config` and its :class:`Batches` into a
:data:`Stepper`: a callable that runs one optimizer step on its own table and
returns once the step has finished. The table, the moments and any fixed
gradient live inside the stepper, so dropping it frees them.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import math
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import floor
import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch

import optax_sparse_adam as osa

LEARNING_RATE = 1e-3
ZIPF_EXPONENT = 1.2
# Ranks of the Zipf law are spread over the table by a multiplicative hash, so
# the hot rows are scattered through memory rather than packed at its start.
_SPREAD = 2654435761

Distribution = Literal["zipf", "uniform"]
Stepper = Callable[[int], None]


@dataclasses.dataclass(frozen=True, order=True)
class Config:
    """One point of the grid: a float32 table of ``rows x width`` and a batch of ``batch`` ids."""

    rows: int
    width: int
    batch: int
    dist: Distribution

    @property
    def label(self) -> str:
        return f"{count_label(self.rows)} x {self.width}, {self.batch} ids, {self.dist}"

    @property
    def table_bytes(self) -> int:
        return self.rows * self.width * 4


def count_label(n: int) -> str:
    """``10000000`` as ``1e7``; other numbers as they are."""
    exp = round(math.log10(n)) if n > 0 else 0
    return f"1e{exp}" if n == 10**exp else str(n)


@dataclasses.dataclass(frozen=True)
class Batches:
    """Id batches for one configuration, one per step: as many as a contender runs steps, so each is fresh.

    Every contender sees the same sequence on its own table, so no contender's
    rows are warm in the cache from a batch it saw before (the pool only
    cycles past the steps of a timing plan).

    Attributes:
      ids: ``int32`` arrays of shape ``(batch,)``, one per step.
      values: The ``(batch, width)`` float32 gradient rows, shared by every entry
        (their content does not change the cost of a step).
      distinct: Mean number of distinct ids per batch.
    """

    ids: list[np.ndarray]
    values: np.ndarray
    distinct: float


def sample_ids(rng: np.random.Generator, rows: int, size: int, dist: Distribution) -> np.ndarray:
    """Draws ``size`` row ids in ``[0, rows)``.

    ``"zipf"`` draws ranks from Zipf(1.2) truncated to the table (rank ``r``
    with probability proportional to ``r ** -1.2``, by rejection) and spreads
    them over the table with a fixed bijective hash; ``"uniform"`` draws rows
    uniformly.
    """
    if dist == "uniform":
        return rng.integers(0, rows, size=size, dtype=np.int64).astype(np.int32)
    drawn: list[np.ndarray] = []
    have = 0
    while have < size:
        ranks = rng.zipf(ZIPF_EXPONENT, size=2 * size) - 1
        ranks = ranks[ranks < rows]
        drawn.append(ranks)
        have += ranks.size
    ranks = np.concatenate(drawn)[:size]
    # gcd(_SPREAD, 10**k) == 1, so this permutes [0, rows) for the grid's sizes.
    return ((ranks * _SPREAD) % rows).astype(np.int32)


def make_batches(cfg: Config, pool: int, seed: int) -> Batches:
    """Draws ``pool`` batches of ids and one block of gradient rows for ``cfg``."""
    rng = np.random.default_rng(seed)
    ids = [sample_ids(rng, cfg.rows, cfg.batch, cfg.dist) for _ in range(pool)]
    values = rng.standard_normal((cfg.batch, cfg.width), dtype=np.float32)
    distinct = float(np.mean([np.unique(i).size for i in ids]))
    return Batches(ids=ids, values=values, distinct=distinct)


class Contender(NamedTuple):
    """A way of running one optimizer step.

    Attributes:
      name: Short key used in ``results.json`` and the plots.
      label: Human-readable name for the tables.
      dense: Whether a step streams whole table-sized arrays (such contenders
        are skipped where those arrays do not fit).
      tables: About how many table-sized arrays it holds while it runs.
      make: Builds the stepper for a configuration.
      native: Whether it needs the library's native CPU kernels (skipped where they were not built).
    """

    name: str
    label: str
    dense: bool
    tables: int
    make: Callable[[Config, Batches], Stepper]
    native: bool = False


class JaxStepper:
    """Runs a jitted, donated ``step(params, state, *inputs) -> (params, state)``.

    The inputs of step ``i`` are ``inputs[i % len(inputs)]``, placed on the
    device beforehand so that no host transfer is timed. ``kernels`` chooses
    the library's native CPU kernels or its XLA path (``osa.use_kernels``),
    for tracing and for every call, as jit's cache keys on it.
    """

    def __init__(
        self,
        step: Callable[..., Any],
        params: Any,
        state: Any,
        inputs: Sequence[tuple[Any, ...]],
        kernels: bool = True,
    ):
        self._step = step
        self._params, self._state = params, state
        self._inputs = [tuple(jax.device_put(x) for x in args) for args in inputs]
        self._kernels = kernels

    def __call__(self, i: int) -> None:
        with osa.use_kernels(self._kernels):
            self._params, self._state = self._step(self._params, self._state, *self._inputs[i % len(self._inputs)])
        jax.block_until_ready((self._params, self._state))


@functools.partial(jax.jit, static_argnums=0)
def _scatter_dense(shape: tuple[int, int], ids: jax.Array, values: jax.Array) -> jax.Array:
    return jnp.zeros(shape, jnp.float32).at[ids].add(values)


def _dense_grad_jax(cfg: Config, batches: Batches) -> jax.Array:
    """The dense equivalent of the first batch's gradient."""
    return _scatter_dense((cfg.rows, cfg.width), batches.ids[0], batches.values)


def _dense_grad_torch(cfg: Config, batches: Batches) -> torch.Tensor:
    grad = torch.zeros((cfg.rows, cfg.width), dtype=torch.float32)
    return grad.index_add_(0, torch.from_numpy(batches.ids[0]).long(), torch.from_numpy(batches.values))


def _table_jax(cfg: Config) -> jax.Array:
    return jnp.full((cfg.rows, cfg.width), 0.01, jnp.float32)


def make_optax_adam(cfg: Config, batches: Batches) -> Stepper:
    """``optax.adam`` on a dense gradient, jitted with params and state donated."""
    tx = optax.adam(LEARNING_RATE)

    def step(params: jax.Array, state: Any, grad: jax.Array) -> tuple[jax.Array, Any]:
        updates, state = tx.update(grad, state, params)
        return optax.apply_updates(params, updates), state

    params = _table_jax(cfg)
    return JaxStepper(jax.jit(step, donate_argnums=(0, 1)), params, tx.init(params), [(_dense_grad_jax(cfg, batches),)])


def make_osa_dense(cfg: Config, batches: Batches) -> Stepper:
    """This library on a dense gradient with ``lazy_dense=True`` (rows with a nonzero are touched)."""
    tx = osa.sparse_adam(LEARNING_RATE, lazy_dense=True)

    def step(params: jax.Array, state: Any, grad: jax.Array) -> tuple[jax.Array, Any]:
        updates, state = tx.update(grad, state)
        return osa.apply_updates(params, updates), state

    params = _table_jax(cfg)
    return JaxStepper(jax.jit(step, donate_argnums=(0, 1)), params, tx.init(params), [(_dense_grad_jax(cfg, batches),)])


def sparse_step(
    num_rows: int, fused: bool = False, tx: optax.GradientTransformation | None = None
) -> tuple[optax.GradientTransformation, Callable[..., Any]]:
    """The library's sparse step on an ``IndexedRows`` gradient, and its transformation (not jitted): ``tx``, by
    default ``osa.sparse_adam(LEARNING_RATE)``.

    ``fused``: ``osa.update_and_apply`` rather than ``tx.update`` and ``osa.apply_updates``.
    """
    tx = osa.sparse_adam(LEARNING_RATE) if tx is None else tx

    def step(params: jax.Array, state: Any, ids: jax.Array, values: jax.Array) -> tuple[jax.Array, Any]:
        grads = osa.IndexedRows(ids, values, num_rows)
        if fused:
            return osa.update_and_apply(tx, grads, state, params)
        updates, state = tx.update(grads, state, params)  # params: catch-up moves them
        return osa.apply_updates(params, updates), state

    return tx, step


def sparse_stepper(
    cfg: Config,
    batches: Batches,
    *,
    fused: bool,
    kernels: bool = True,
    tx: optax.GradientTransformation | None = None,
) -> JaxStepper:
    """The library's sparse step (:func:`sparse_step`, of ``tx``, by default ``sparse_adam``) on a table of
    ``cfg``'s shape, its state, and ``batches``' ids and gradient rows, jitted and donated."""
    tx, step = sparse_step(cfg.rows, fused, tx)
    params = _table_jax(cfg)
    inputs = [(ids, batches.values) for ids in batches.ids]
    return JaxStepper(jax.jit(step, donate_argnums=(0, 1)), params, tx.init(params), inputs, kernels)


def make_osa_sparse(cfg: Config, batches: Batches) -> Stepper:
    """This library on ``IndexedRows`` gradients: ``tx.update`` + ``apply_updates`` on the native CPU kernels."""
    return sparse_stepper(cfg, batches, fused=False)


def make_osa_fused(cfg: Config, batches: Batches) -> Stepper:
    """``osa.update_and_apply``: one native pass per touched row for p, m and v."""
    return sparse_stepper(cfg, batches, fused=True)


def make_osa_sparse_xla(cfg: Config, batches: Batches) -> Stepper:
    """``tx.update`` + ``apply_updates`` on the portable XLA path (``osa.use_kernels(False)``)."""
    return sparse_stepper(cfg, batches, fused=False, kernels=False)


def make_floor(cfg: Config, batches: Batches) -> Stepper:
    """The memory floor: a native kernel that reads and writes the rows of p, m and v each id touches, nothing else.

    The kernel is the benchmark's own (``floor.py``), built on first use; it runs
    on as many threads as the library's kernels (``osa.use_kernels(threads=...)``).
    """
    from optax_sparse_adam import _kernel_path

    def step(params: jax.Array, state: Any, ids: jax.Array, values: jax.Array) -> tuple[jax.Array, Any]:
        m, v = state
        params, m, v = floor.touch_rows((params, m, v), ids, values, threads=_kernel_path.threads())
        return params, (m, v)

    params = _table_jax(cfg)
    state = (jnp.zeros_like(params), jnp.zeros_like(params))
    inputs = [(ids, batches.values) for ids in batches.ids]
    return JaxStepper(jax.jit(step, donate_argnums=(0, 1)), params, state, inputs)


class TorchSparseAdam:
    """``torch.optim.SparseAdam`` on an uncoalesced COO gradient (it coalesces inside ``step``), as a stepper;
    ``tensors()``: its parameter and moments (the moments made at its first step)."""

    def __init__(self, cfg: Config, batches: Batches) -> None:
        self.param = torch.nn.Parameter(torch.full((cfg.rows, cfg.width), 0.01, dtype=torch.float32))
        self.opt = torch.optim.SparseAdam([self.param], lr=LEARNING_RATE)
        self.ids = [torch.from_numpy(i).long()[None] for i in batches.ids]
        self.values = torch.from_numpy(batches.values)
        self.size = (cfg.rows, cfg.width)

    def __call__(self, i: int) -> None:
        self.param.grad = torch.sparse_coo_tensor(
            self.ids[i % len(self.ids)], self.values, self.size, check_invariants=False
        )
        self.opt.step()

    def tensors(self) -> list[torch.Tensor]:
        state = self.opt.state[self.param]
        return [self.param.data, state["exp_avg"], state["exp_avg_sq"]]


make_torch_sparse_adam = TorchSparseAdam


def make_torch_adam(cfg: Config, batches: Batches) -> Stepper:
    """``torch.optim.Adam(fused=True)`` on a dense gradient: torch's fastest Adam on the CPU.

    The default (per-tensor) implementation allocates table-sized temporaries
    every step and ran 5-7x slower than ``fused=True`` here.
    """
    param = torch.nn.Parameter(torch.full((cfg.rows, cfg.width), 0.01, dtype=torch.float32))
    opt = torch.optim.Adam([param], lr=LEARNING_RATE, fused=True)
    param.grad = _dense_grad_torch(cfg, batches)

    def run(i: int) -> None:
        del i
        opt.step()

    return run


# PyTorch runs on the thread count the process set once (run.py --threads); switching it per step
# left its thread pools cold and made torch.optim.Adam 10x slower than its dense work.
_ALL_CONTENDERS: tuple[Contender, ...] = (
    Contender("osa_sparse", "optax_sparse_adam, native: tx.update + apply_updates", False, 3, make_osa_sparse, True),
    Contender("osa_fused", "optax_sparse_adam, native: update_and_apply", False, 3, make_osa_fused, True),
    Contender(
        "osa_sparse_xla", "optax_sparse_adam, XLA path: tx.update + apply_updates", False, 3, make_osa_sparse_xla
    ),
    Contender("floor", "floor: touched rows of p, m, v read and written", False, 3, make_floor),
    Contender("torch_sparse_adam", "torch.optim.SparseAdam", False, 3, make_torch_sparse_adam),
    Contender("optax_adam", "optax.adam (dense)", True, 5, make_optax_adam),
    Contender("osa_dense", "optax_sparse_adam, dense (lazy_dense=True)", True, 5, make_osa_dense),
    Contender("torch_adam", "torch.optim.Adam(fused=True) (dense)", True, 4, make_torch_adam),
)


def _runnable_here(contenders: tuple[Contender, ...]) -> tuple[Contender, ...]:
    """The contenders that can run on this machine: the floor needs a C++17 compiler to build its kernel."""
    why = floor.unavailable()
    if why is None:
        return contenders
    print(f"note: skipping the floor contender: {why}", file=sys.stderr)
    return tuple(c for c in contenders if c.name != "floor")


CONTENDERS: tuple[Contender, ...] = _runnable_here(_ALL_CONTENDERS)


@dataclasses.dataclass(frozen=True)
class TimingPlan:
    """How many steps to run.

    Attributes:
      warmup: Untimed steps first (compilation, first-touch page faults, lazy
        state); a slow contender stops after two once those after the first
        have taken half of ``budget_s``.
      timed: Timed steps for a fast contender.
      min_timed: Fewest timed steps for a slow one.
      budget_s: Seconds of timed steps a slow contender gets (its step count is
        cut to fit, down to ``min_timed``).
      rounds: The timed steps are split into this many rounds; contenders that
        share memory take turns round by round, so that drifting load on a
        shared machine hits them alike.
    """

    warmup: int
    timed: int
    min_timed: int
    budget_s: float
    rounds: int


def _timed(stepper: Stepper, i: int) -> float:
    start = time.perf_counter()
    stepper(i)
    return time.perf_counter() - start


def time_steppers(steppers: dict[str, Stepper], plan: TimingPlan) -> dict[str, list[float]]:
    """Times each stepper's steps in seconds, interleaving them round by round."""
    counts: dict[str, int] = {}
    for name, stepper in steppers.items():
        warm: list[float] = []
        while len(warm) < plan.warmup and (len(warm) < 2 or sum(warm[1:]) < plan.budget_s / 2):
            warm.append(_timed(stepper, len(warm)))
        # The first warm-up step compiles; the fastest of the others estimates a step.
        estimate = min(warm[1:] or warm or [0.0])
        fit = int(plan.budget_s / estimate) if estimate > 0 else plan.timed
        counts[name] = max(plan.min_timed, min(plan.timed, fit))
    samples: dict[str, list[float]] = {name: [] for name in steppers}
    for r in range(plan.rounds):
        for name, stepper in steppers.items():
            todo = counts[name] * (r + 1) // plan.rounds - len(samples[name])
            for _ in range(todo):
                samples[name].append(_timed(stepper, plan.warmup + len(samples[name])))
    return samples


def fbgemm_unavailable() -> str | None:
    """Why FBGEMM's CPU TBE cannot run here, or None."""
    try:
        import fbgemm_gpu  # noqa: F401
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (  # noqa: F401
            SplitTableBatchedEmbeddingBagsCodegen,
        )
    except Exception as e:  # any import failure (missing package, ABI mismatch with torch) skips it
        return (
            f"FBGEMM's CPU TBE does not import ({type(e).__name__}: {e}); "
            "install it with `python -m pip install fbgemm-gpu-cpu==1.8.0 --no-deps`"
        )
    return None


def release() -> None:
    """Frees what dropped steppers held."""
    gc.collect()
