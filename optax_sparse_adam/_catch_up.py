"""Exact catch-up for lazy Adam: ``sparse_adam(..., catch_up=True)`` and :func:`catch_up`.

Dense Adam keeps moving a row after its last gradient: each step with a zero
gradient decays the moments (``m <- b1 m``, ``v <- b2 v``) and moves the
parameter by the learning rate times the bias-corrected ratio. Those idle
steps depend only on the row's state and the step numbers, so a row that
returns after ``s`` idle steps can replay them when it is next touched, in
one pass over the touched rows. :func:`replay` does it with dense Adam's own
float32 arithmetic, step by step, up to :func:`idle_cap` steps, after which
the rest of the idle steps move the row by less than ``2**-24`` times the
largest learning rate among them; the moments decay over every idle step.

Step by step costs up to :func:`idle_cap` passes over the touched rows. On
float32 rows with ``eps_root == 0`` and concrete betas, the idle steps' sum
has a closed form instead: with ``x = sqrt(v0)`` and ``z = eps / x``, idle
step ``k`` moves an element by ``-(m0 / x) lr_k rho^k f(tau_k) / (1 + z c_k)``
(``rho = b1 / sqrt(b2)``; ``f``, ``c_k`` from the bias corrections), and
``1 / (1 + y) = sum_j (-y)^j`` makes the displacement ``-(m0 / x) sum_j
(-z)^j C_j``, a polynomial in ``z`` whose coefficients ``C_j`` depend on the
row's last step and the current step only: one set per row, from a table
over the last :func:`idle_cap` steps (rows idle fewer steps) or a table
over the row's last step (rows idle longer, constant learning rate), so the
elements pay a few multiply-adds each. Elements whose ``z`` is too large for
``_TERMS`` terms to reach float32 resolution replay step by step: on the CPU
in the native kernels (the fused step's; :func:`._ffi.catch_up_adam_replay`,
which replays every row of a table for :func:`catch_up` and caught-up lookups;
or :func:`._ffi.catch_up_adam_steps` for the rows of an XLA rule), from the
window's learning rates and a table of the bias corrections
(:func:`_correction_table`); on the XLA path in a loop.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_sparse_adam import _ffi, _kernel_path
from optax_sparse_adam._adam import (
    AdamHyperparams,
    _dense_adam,
    _moments,
    _step,
    _torch_corrections,
    kernel_flags,
    kernel_scalars,
)
from optax_sparse_adam._apply import apply_updates
from optax_sparse_adam._checks import check_dense_gradient, check_params, check_state, mask_tree
from optax_sparse_adam._coalesce import coalesce, distinct_ids
from optax_sparse_adam._fusion import Clipped, FusableUpdate
from optax_sparse_adam._indexed_rows import is_sparse
from optax_sparse_adam._row_engine import Kernel, Rule, _run_rows, apply_rule, map_rule, row_full, row_shape, stamp
from optax_sparse_adam._row_ops import explicit_sharding
from optax_sparse_adam._sparse_leaf import SparseLeaf
from optax_sparse_adam._tree import broadcast_rows, compiled_on_arrays, is_leaf, leaf_paths, param_error

__all__ = [
    "CatchUpAdamState",
    "CatchUpAdamWState",
    "IdleRecord",
    "catch_up",
    "catch_up_adam",
    "catch_up_adamw",
    "idle_cap",
    "replay",
]

_WHERE = "sparse_adam(catch_up=True)"
_WHERE_ADAMW = "sparse_adamw(catch_up=True)"


class CatchUpAdamState(NamedTuple):
    """State of ``sparse_adam(..., catch_up=True)``.

    Attributes:
      count: Global step count, an int32 scalar.
      mu: First moments, as :class:`optax.ScaleByAdamState`'s.
      nu: Second moments, as :class:`optax.ScaleByAdamState`'s.
      last_step: Per row (shape ``p.shape[:1]``, int32): the step (the value of
        ``count`` after it) through which the row is up to date, 0 for a row
        that never moved.
      idle_record: Under a learning-rate schedule, the coefficients of the
        idle steps of rows idle longer than the window, by their last step,
        for the last 65,536 last steps (an :class:`IdleRecord`: 2.25 MiB, one
        for all the parameters); a single entry for no step where a table holds
        them (a constant learning rate).
    """

    count: jax.Array  # type: ignore[assignment]  # Adam's field name, as in optax's states
    mu: optax.Updates
    nu: optax.Updates
    last_step: optax.Updates
    idle_record: IdleRecord


@dataclasses.dataclass(frozen=True)
class Replayer:
    """What replaying idle steps needs: the learning rate and Adam's hyperparameters, and in a step, the state's
    record of the long-idle coefficients (an :class:`IdleRecord`; ``None`` outside a step)."""

    learning_rate: optax.ScalarOrSchedule
    hp: AdamHyperparams
    record: IdleRecord | None = dataclasses.field(default=None, compare=False)
    variant: int | None = None  # the record's variant (AdamW's: 0 without the decay, 1 with it)

    def lr(self, done: jax.Array) -> jax.Array:
        """The learning rate of the steps after ``done`` steps (an int32 array of any shape)."""
        return rate_at(self.learning_rate, done)

    def reading(self, record: IdleRecord | None, variant: int | None = None) -> Replayer:
        """This replayer, reading the long-idle coefficients of ``record`` (a state's :class:`IdleRecord`; of its
        ``variant``, where it has several)."""
        return dataclasses.replace(self, record=record, variant=variant)


def rate_at(learning_rate: optax.ScalarOrSchedule, done: jax.Array) -> jax.Array:
    """The learning rate of the steps after ``done`` steps (an int32 array of any shape): the constant, or the
    schedule evaluated at each count."""
    if not callable(learning_rate):
        return jnp.asarray(learning_rate)
    try:
        vmapped = _vmapped(learning_rate)
    except TypeError:  # a schedule that cannot be weakly referenced
        vmapped = jax.vmap(learning_rate)
    return vmapped(done.reshape(-1)).reshape(done.shape)


# id(schedule) -> (a weak reference to it, its vmapped jit); an entry goes with its schedule, or, past
# _MAX_SCHEDULES entries, the least recently used goes (a schedule whose own traced program refers back to it, such as a
# jax.custom_jvp whose rule closes over it, is kept alive by its entry's jit).
_VMAPPED: dict[int, tuple[weakref.ref[Any], Callable[[jax.Array], jax.Array]]] = {}
_MAX_SCHEDULES = 256


def _vmapped(schedule: Callable[[jax.Array], jax.Array]) -> Callable[[jax.Array], jax.Array]:
    """``schedule`` vmapped, under a ``jit`` of its own: a step evaluates the schedule at many places (the windows
    and loops of each table), and the jit traces it once for each shape of counts and setting of the kernels (eight
    tables' catch-up AdamW step under a schedule traced it 240 times, an eighth of the step's trace). Kept as long
    as the schedule lives (the least recently used of more than ``_MAX_SCHEDULES`` going first), by identity (a
    schedule built inside a traced function, closing over its tracers, goes with its optimizer, and so do its
    traces); the jit holds the schedule weakly. As for any jitted function, what a schedule reads besides its
    argument is read when it is traced."""
    key = id(schedule)
    entry = _VMAPPED.get(key)
    if entry is not None and entry[0]() is schedule:
        _VMAPPED[key] = _VMAPPED.pop(key)  # the most recently used goes last: the bound drops the least recent
        return entry[1]

    def forget(ref: weakref.ref[Any]) -> None:
        if _VMAPPED.get(key, (None,))[0] is ref:
            _VMAPPED.pop(key, None)

    ref = weakref.ref(schedule, forget)  # TypeError where it cannot be weakly referenced

    def call(counts: jax.Array) -> jax.Array:
        fn = ref()
        assert fn is not None  # traced only when called for the schedule, which is then alive
        return jax.vmap(fn)(counts)

    call.__name__ = call.__qualname__ = str(getattr(schedule, "__name__", "schedule"))  # the jit's name in a jaxpr
    vmapped = jax.jit(call)
    _VMAPPED.pop(key, None)  # a dead schedule's entry whose callback has not run yet
    while len(_VMAPPED) >= _MAX_SCHEDULES:
        _VMAPPED.pop(next(iter(_VMAPPED)), None)  # the least recently used: traced again if its schedule comes back
    _VMAPPED[key] = (ref, vmapped)
    return vmapped


def caught_up_update(p0: jax.Array, p: jax.Array, step: jax.Array, moved: jax.Array) -> jax.Array:
    """A catch-up rule's update: where a row replayed idle steps (``moved``, broadcast over its entries), the
    difference that takes the stored ``p0`` to the replayed ``p`` plus ``step``, rounded to the parameters' dtype,
    so that ``apply_updates`` puts the row where the dense optimizer's steps took it; elsewhere ``step`` itself."""
    narrow = jnp.dtype(p0.dtype) != jnp.dtype(step.dtype)
    if narrow:
        # XLA:GPU drops a wide -> narrow -> wide convert pair where excess precision is allowed (its default; see
        # _stochastic_rounding._round_with): the barriers keep the roundings to p0's dtype, that of the replay which
        # made p and this one.
        p = jax.lax.optimization_barrier(p)
    rounded = (p + step).astype(p0.dtype)
    if narrow:
        rounded = jax.lax.optimization_barrier(rounded)
    # Where p0 is an infinity, the replayed row itself (inf - inf is NaN; p0 + row is the row where the replay kept
    # the infinity, as the dense optimizer's steps leave it): the kernels' CaughtUpUpdate.
    start = p0.astype(step.dtype)
    caught = rounded.astype(step.dtype) - jnp.where(jnp.isinf(start), 0, start)
    return jnp.where(moved, caught, step)


ReplayRows = Callable[[jax.Array, tuple[jax.Array, ...], jax.Array, jax.Array, Any], Any]


def scalar_as_one_row(replay_rows: ReplayRows) -> ReplayRows:
    """``replay_rows(p, moments, last, done, record) -> (p, moments)`` that takes a scalar parameter (its moments and
    last step scalars too) as a table of one row."""

    @functools.wraps(replay_rows)
    def replay(p: jax.Array, moments: tuple[jax.Array, ...], last: jax.Array, done: jax.Array, record: Any) -> Any:
        if jnp.ndim(p) != 0:
            return replay_rows(p, moments, last, done, record)
        p, moments = replay_rows(p[None], tuple(x[None] for x in moments), last[None], done, record)
        return p[0], tuple(x[0] for x in moments)

    return replay


@dataclasses.dataclass(frozen=True)
class Decay:
    """Decoupled weight decay through the idle steps (AdamW's): the idle step with count ``tau`` multiplies the row
    by ``gamma(tau) = 1 - lr(tau - 1) * weight_decay`` and adds its Adam step.

    Attributes:
      weight_decay: The decay rate, a number.
      log_gamma: ``log(1 - lr * weight_decay)`` in double for a constant learning rate, else ``None``.
      far_log: With a schedule: per row, the log of the product of ``gamma`` over the row's idle steps (from the
        state's record); used for the rows idle longer than the window.
    """

    weight_decay: Any
    log_gamma: float | None
    far_log: jax.Array | None = None

    def log(self, lr_at: Callable[[jax.Array], jax.Array], tau: jax.Array) -> jax.Array:
        """``log(gamma)`` of the idle steps with counts ``tau`` (0 where ``tau < 1``), in float32, ``lr_at(d)`` the
        learning rate of the step after ``d`` steps. Products of ``gamma`` are taken as sums of these: a product of
        ``k`` rounded ``gamma`` would carry ``k`` times the rounding of ``1 - lr wd`` (the same each step), where
        dense AdamW's own roundings differ from step to step."""
        lr = lr_at(jnp.maximum(tau, 1) - 1)
        rate = jnp.asarray(lr, jnp.float32) * jnp.asarray(self.weight_decay, jnp.float32)
        return jnp.where(tau >= 1, jnp.log1p(-rate), 0.0)

    @property
    def scheduled(self) -> bool:
        """Whether ``gamma`` changes from step to step (no ``log_gamma``: a schedule, or a rate or decay not known
        when the step is traced), so that a long-idle row's product of ``gamma`` comes from the state's record,
        and in the native kernels from the row's decay mark."""
        return self.log_gamma is None

    def far(self, idle: jax.Array) -> jax.Array:
        """The product of ``gamma`` over each row's ``idle`` steps (int32), for rows idle longer than the window:
        with a constant learning rate ``gamma ** idle`` (:func:`table_power`), else from the state's record."""
        if self.log_gamma is not None:
            return table_power(power_table(self.log_gamma), idle)
        assert self.far_log is not None, "a schedule's decay needs the state's record"
        return jnp.exp(self.far_log)

    def rest(self, idle: jax.Array, n: jax.Array, through: jax.Array) -> jax.Array:
        """The product of ``gamma`` over each row's idle steps after its first ``n`` (``n <= idle``): with a
        constant learning rate ``gamma ** (idle - n)`` (:func:`table_power`, as the native kernels compute it),
        else ``far(idle) * exp(-through)``, ``through`` the log of the product over the first ``n`` (unread at a
        constant rate)."""
        if self.log_gamma is not None:
            return table_power(power_table(self.log_gamma), idle - n)
        return self.far(idle) * jnp.exp(-through)


def idle_cap(b1: Any, b2: Any) -> jax.Array:
    r"""The number of idle steps :func:`replay` takes one by one.

    An idle step :math:`k` after the row's last gradient moves it by at most
    :math:`\alpha\, A\, r^k`, with :math:`r = \beta_1 / \sqrt{\beta_2}` and
    :math:`A = 1 / \sqrt{(1 - \beta_2)(1 - \beta_1^2 / \beta_2)}` (the bias
    corrections only shrink it after the first step; :math:`|m| / \sqrt{v}`
    of moments fed the same gradients is at most
    :math:`(1 - \beta_1) A`). The cap is the smallest :math:`K` with
    :math:`A\, r^{K+1} / (1 - r) \le 2^{-24}`: all idle steps after the
    :math:`K`-th move the row by less than :math:`2^{-24}` times the largest
    learning rate among them. Needs :math:`\beta_1 < \sqrt{\beta_2}`.
    """
    b1, b2 = jnp.asarray(b1, jnp.float32), jnp.asarray(b2, jnp.float32)
    r = b1 / jnp.sqrt(b2)
    log_bound = -0.5 * jnp.log((1 - b2) * (1 - b1 * b1 / b2)) - jnp.log1p(-r) + 24 * math.log(2)
    k = jnp.ceil(log_bound / -jnp.log(r)) - 1
    k = jnp.where(jnp.isfinite(k), jnp.clip(k, 0, 1 << 24), 1 << 24)
    return jnp.where(r > 0, k, 0).astype(jnp.int32)


def replay(
    p: jax.Array,
    m: jax.Array,
    v: jax.Array,
    last: jax.Array,
    done: jax.Array,
    replayer: Replayer,
    decay: Decay | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Rows ``(p, m, v)`` last moved at step ``last`` (per row), brought up to step ``done``.

    Each idle step is dense Adam's with a zero gradient: ``m <- b1 m``,
    ``v <- b2 v``, ``p <- p + (-lr_k) u_k`` with the step's own learning rate
    and bias corrections, for the first :func:`idle_cap` idle steps; after
    those only the moments decay (``b1**n``, ``b2**n``). Rows with
    ``last == 0`` never moved (zero moments) and stay as they are. Where
    :func:`_series_plan` finds one, the parameters' displacement is the
    closed form of the module's docstring (one rounding, where the steps
    take one a step); elsewhere, and for the elements it cannot take, the
    steps are taken one by one in dense Adam's own arithmetic. With ``decay``
    each idle step also multiplies the row by its ``gamma`` first (AdamW's
    decoupled decay): the row is scaled by the product over its idle steps,
    and each step's displacement by the product over the steps after it; a
    row that never moved (zero moments) decays too, from step 0.
    """
    hp = replayer.hp
    idle = (done - last if decay is not None else jnp.where(last > 0, done - last, 0)).astype(jnp.int32)
    plan = _series_plan(replayer, p.dtype, m.dtype, v.dtype, decay=decay)
    if plan is None:
        return _replay_steps(p, m, v, last, idle, replayer, decay)
    weights = None if decay is None else _DecayWeights(decay, replayer.lr, idle, done, plan.cap)
    record = replayer.record, replayer.variant
    coefficients = _coefficients(plan, replayer.lr, last, idle, done, weights, *record)  # (rows, _TERMS)
    inv = 1 / jnp.sqrt(v)
    z = jnp.asarray(hp.eps, jnp.float32) * inv
    moving = broadcast_rows(idle > 0, p.ndim)
    # Taken step by step: elements the series does not reach float32 resolution for in _TERMS terms (tiny or
    # zero v, NaN), and nothing else; a row with none runs no step. Where m == 0 the idle steps move nothing.
    by_steps = moving & ~(z * plan.binv <= _RATIO) & (m != 0)
    rows_by_steps = jnp.any(by_steps, axis=tuple(range(1, p.ndim))) if p.ndim > 1 else by_steps
    c = [broadcast_rows(coefficients[:, j], p.ndim) for j in range(_TERMS)]
    series = c[-1]
    for cj in reversed(c[:-1]):
        series = cj - z * series  # Horner: sum_j (-z)^j C_j
    shift = jnp.where(moving & ~by_steps & (m != 0), -(m * inv) * series, 0.0)
    p_steps = _stepped(p, m, v, last, jnp.where(rows_by_steps, idle, 0), done, replayer, plan, decay)
    scaled = p if weights is None else broadcast_rows(weights.rows, p.ndim) * p
    p_new = jnp.where(by_steps, p_steps, (scaled + shift).astype(p.dtype))
    decay1, decay2 = (broadcast_rows(_power(b, idle), m.ndim) for b in (hp.b1, hp.b2))
    return p_new, (m * decay1).astype(m.dtype), (v * decay2).astype(v.dtype)


def _stepped(
    p: jax.Array,
    m: jax.Array,
    v: jax.Array,
    last: jax.Array,
    idle: jax.Array,
    done: jax.Array,
    replayer: Replayer,
    plan: _SeriesPlan,
    decay: Decay | None,
) -> jax.Array:
    """The rows ``p`` after their idle steps one by one (:func:`_replay_steps`; rows with ``idle == 0`` as they
    are), nothing run where no row has any. On the CPU, Adam's and AdamW's steps run in a native kernel, which
    takes the window's rates and the plan's bias corrections (and AdamW's weight decay, with ``gamma``'s powers
    at a constant rate); the rows it cannot take (a schedule's steps beyond the window) it flags, and the XLA
    loop takes those."""

    def xla(p: jax.Array, m: jax.Array, v: jax.Array, last: jax.Array, idle: jax.Array) -> jax.Array:
        return jax.lax.cond(
            jnp.any(idle > 0), lambda: _replay_steps(p, m, v, last, idle, replayer, decay)[0], lambda: p
        )

    if plan.corrections is None or p.shape[0] == 0 or not _kernel_path.supports(p.shape, 1, p, m, v):
        return xla(p, m, v, last, idle)

    def native(p: jax.Array, m: jax.Array, v: jax.Array, last: jax.Array, idle: jax.Array) -> jax.Array:
        hp = replayer.hp
        long_neg_lr, neg_rates, corrections = _step_operands(plan, replayer, done)
        wd = () if decay is None else (decay.weight_decay,)
        limits = jnp.stack([jnp.asarray(x, jnp.float32) for x in (hp.b1, hp.b2, hp.eps, long_neg_lr, 1.0, *wd)])
        log_gamma = None if decay is None else decay.log_gamma  # a constant rate's decay: gamma's table
        powers = jnp.asarray(power_table(log_gamma) if log_gamma is not None else np.zeros((0, 256), np.float32))
        stepped, flags = _ffi.catch_up_adam_steps(
            p,
            m,
            v,
            last,
            idle,
            limits,
            neg_rates,
            corrections,
            powers,
            cap=plan.cap,
            torch_eps=hp.eps_placement == "torch",
            decay=decay is not None,
        )
        flagged = flags > 0
        if not _may_flag(plan, replayer, decay):
            return stepped
        return jax.lax.cond(
            jnp.any(flagged),
            lambda: jnp.where(
                broadcast_rows(flagged, p.ndim), xla(p, m, v, last, jnp.where(flagged, idle, 0)), stepped
            ),
            lambda: stepped,
        )

    return _kernel_path.select(native, xla, p, m, v, last, idle)


def _step_operands(plan: _SeriesPlan, replayer: Replayer, done: jax.Array) -> tuple[Any, jax.Array, jax.Array]:
    """What the kernels' idle steps read (``long_neg_lr``, ``neg_rates``, ``corrections``), as
    :func:`_replay_steps` computes it: the steps' ``-lr`` over the window (newest first), and for rows idle longer
    the constant rate (NaN under a schedule: the kernels flag those rows where they need the steps); the plan's
    bias corrections (a row of ones where it has none)."""
    tau = done - jnp.arange(max(plan.cap, 1), dtype=jnp.int32)
    neg_rates = jnp.broadcast_to(-replayer.lr(jnp.maximum(tau, 1) - 1), tau.shape).astype(jnp.float32)
    long_neg_lr = jnp.nan if callable(replayer.learning_rate) else -replayer.lr(done)
    table = plan.corrections if plan.corrections is not None else np.ones((1, 2), np.float32)
    return long_neg_lr, neg_rates, jnp.asarray(table)


# The series in z = eps / sqrt(v): _TERMS terms, taken where each idle step's ratio z / beta_k is at most _RATIO,
# so that the first term left out is below _RATIO**_TERMS = 2**-24 of the sum.
_TERMS = 8
_RATIO = 0.125
_MAX_CAP = 4096  # idle_cap above which (b1 close to sqrt(b2)) rows replay step by step
_MAX_TABLE = 1 << 18  # steps of bias correction above which (b2 very close to 1) long-idle rows loop over their steps


# h(tau, lr, xp): the factor of each term at the idle step with count tau and learning rate lr (shape
# tau.shape + (terms,)), in float32 (xp jnp) or double (xp np).
Rates = Callable[[Any, Any, Any], Any]


@dataclasses.dataclass(frozen=True)
class _SeriesPlan:
    """What the closed form of :func:`replay` needs, fixed when the step is traced.

    Attributes:
      cap: :func:`idle_cap` (``K``).
      rho: ``b1 * b2 ** (-(j + 1) / 2)`` for each term ``j``, in double.
      binv: ``b2 ** (-K / 2)``, the largest ``1 / beta_k`` over the replayed steps.
      table: For a constant learning rate, the coefficients of rows idle more than ``K`` steps, by their last step
        (clipped to the last entry, where the bias corrections have reached 1 in float32); else ``None``.
      rates: The terms' factors at an idle step (:func:`_rates` for Adam).
      corrections: The bias corrections of the idle step with count ``tau`` (:func:`_corrections`), in row
        ``tau``, the last row standing for every later count; for the native kernel's steps (elements the series
        does not take). ``None`` where the corrections take more than ``_MAX_TABLE`` steps to reach 1.
    """

    cap: int
    rho: np.ndarray
    binv: float
    table: np.ndarray | None
    rates: Rates
    corrections: np.ndarray | None = None


def replay_table(
    p: jax.Array,
    m: jax.Array,
    v: jax.Array,
    last: jax.Array,
    done: jax.Array,
    replayer: Replayer,
    decay: Decay | None = None,
    mark: jax.Array | None = None,
    old_log: Any = 0.0,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`replay` on every row of a table, for :func:`catch_up`.

    On the CPU, for float32 tables the closed form takes (:func:`_series_plan`) whose long-idle coefficients a table
    or the state's record holds, each row is replayed in place by a native kernel (:func:`._ffi.catch_up_adam_replay`)
    as the fused step replays a touched row (moments bitwise the XLA path's, the parameters within the fused step's
    bounds), so that donated tables take no table-sized temporaries; the rows it flags (their idle steps or
    coefficients not at hand: under a schedule, rows idle past the state's record; with no table of the bias
    corrections, or AdamW's rate or decay given as arrays, rows that need their idle steps one by one past the
    window) then take :func:`replay`, on the kernel's results, a chunk of rows at a time (:func:`_replay_flagged`).
    Elsewhere (the XLA path; no closed form, or long-idle coefficients only per row: a learning rate given as an
    array) :func:`replay` itself, a block of rows at a time (:func:`in_row_blocks`). With AdamW's ``decay`` (its
    ``far_log`` from ``mark``), ``mark`` is the rows' decay marks and ``old_log`` the state's log of the decay.
    """
    if p.ndim == 0:  # a scalar parameter: a table of one row
        if decay is not None and decay.far_log is not None:
            decay = dataclasses.replace(decay, far_log=decay.far_log[None])
        row_mark = None if mark is None else mark[None]
        out = replay_table(p[None], m[None], v[None], last[None], done, replayer, decay, row_mark, old_log)
        return out[0][0], out[1][0], out[2][0]
    kernel_decay = None if decay is None else Decay(decay.weight_decay, decay.log_gamma)
    plan = _series_plan(replayer, p.dtype, m.dtype, v.dtype, decay=kernel_decay)
    marks = () if mark is None else (mark,)

    def xla(p: jax.Array, m: jax.Array, v: jax.Array, last: jax.Array, *_: jax.Array) -> Any:
        far = () if decay is None or decay.far_log is None else (decay.far_log,)

        def block(p: jax.Array, m: jax.Array, v: jax.Array, last: jax.Array, *far: jax.Array) -> Any:
            # A schedule's decay over each row's idle steps (per row, from the marks): the block's rows of it.
            rows_decay = decay if decay is None or not far else dataclasses.replace(decay, far_log=far[0])
            return replay(p, m, v, last, done, replayer, rows_decay)

        return in_row_blocks(block, (p, m, v), (last, *far))

    record = None if plan is None else _record_read(plan, replayer)
    if (
        plan is None
        or (plan.cap > 0 and plan.table is None and record is None)  # long-idle coefficients only by row
        or (kernel_decay is not None and kernel_decay.scheduled and mark is None)  # the decay's log per row
        or last.dtype != jnp.int32
        or last.shape != p.shape[:1]
        or p.shape[0] == 0
        or not _kernel_path.supports(p.shape, 1, p, m, v, *marks)
    ):
        return xla(p, m, v, last)

    def native(p: jax.Array, m: jax.Array, v: jax.Array, last: jax.Array, *mark: jax.Array) -> Any:
        hp = replayer.hp
        weights = None if kernel_decay is None else _DecayWeights(kernel_decay, replayer.lr, None, done, plan.cap)
        far = None if record is None else record.coefficients
        ops = _kernel_operands(plan, replayer, done, kernel_decay, weights, far, (old_log, old_log))
        wd = 0.0 if decay is None else decay.weight_decay
        hps = jnp.stack([jnp.asarray(x, jnp.float32) for x in (hp.b1, hp.b2, hp.eps, wd)])
        new_p, new_m, new_v, flags = _ffi.catch_up_adam_replay(
            p,
            m,
            v,
            last,
            mark[0] if mark else None,
            hps,
            ops,
            done,
            None if record is None else record.last_steps,
            cap=plan.cap,
            torch_eps=hp.eps_placement == "torch",
            decay=kernel_decay is not None,
            far_offset=_record_offset(record, replayer),
            decay_from_marks=kernel_decay is not None and kernel_decay.scheduled,
        )
        if not _may_flag(plan, replayer, kernel_decay):
            return new_p, new_m, new_v
        return _replay_flagged(new_p, new_m, new_v, last, flags > 0, done, replayer, decay)

    return _kernel_path.select(native, xla, p, m, v, last, *marks)


_FLAGGED_CHUNK = 4096  # rows: the flagged rows of a table are replayed this many at a time
_BLOCK_BYTES = 16 << 20  # in_row_blocks: the bytes of the rows of its operands in a block


def in_row_blocks(
    fn: Callable[..., tuple[jax.Array, ...]], updated: tuple[jax.Array, ...], read: tuple[jax.Array, ...] = ()
) -> tuple[jax.Array, ...]:
    """``fn(*updated, *read)``, the new values of ``updated``, computed a block of rows at a time.

    Every operand has the table's rows as its leading axis, and ``fn`` treats each row on its own (a replay). A
    table whose operands' rows hold more than :data:`_BLOCK_BYTES` is taken in blocks of about that many bytes, in
    a loop that writes each block's results into ``updated`` in place, so that the temporaries of ``fn``'s
    arithmetic are a block's, not the table's: on the XLA path, the one a GPU or TPU runs, a table's replay would
    otherwise build several table-sized temporaries. A smaller table is one call of ``fn``. Each row's arithmetic
    is the same either way.

    The rows are cut into ``groups`` runs of equal length (the largest power of two that divides the rows, up to a
    block's rows), and a block takes as many rows of each run, at the same place in each: a table split over
    devices by rows, in a number of parts that divides ``groups``, is taken in blocks within each device's rows
    (the runs are the loop arrays' leading axis, the split one). Split in another number of parts (not a power of
    two, or one that does not divide the rows), each block is gathered from every device; inside ``shard_map``
    the operands are one device's rows, and nothing is gathered.
    """
    operands = (*updated, *read)
    rows = updated[0].shape[0]
    assert all(x.shape[:1] == (rows,) for x in operands), [x.shape for x in operands]
    row_bytes = sum(math.prod(x.shape[1:]) * x.dtype.itemsize for x in operands)
    block = max(1, _BLOCK_BYTES // max(row_bytes, 1))
    if rows <= block:
        return tuple(fn(*operands))
    groups = min(rows & -rows, 1 << (block.bit_length() - 1))
    run, per = rows // groups, block // groups  # each run's rows, and how many of them a block takes

    def by_runs(x: jax.Array) -> jax.Array:
        return x.reshape(groups, run, *x.shape[1:])

    runs = [by_runs(x) for x in read]

    def body(i: jax.Array, new: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        # The last block ends at the runs' end and overlaps the one before it: its rows already written keep the
        # values read (computed again, not written again).
        start = jnp.minimum(i * per, run - per)

        # The block's rows of `updated` are read from the arrays being written (not yet written there), so that
        # no copy of the table is kept beside them, and in a conditional branch (always taken), so that XLA cannot
        # fuse the reads into the writes: where one array's write reads another array written in place, XLA
        # copies whole tables (an optimization_barrier does not stop it; the conditional's results are buffers of
        # their own, a block's).
        def take() -> tuple[jax.Array, ...]:
            return tuple(jax.lax.dynamic_slice_in_dim(x, start, per, axis=1) for x in (*new, *runs))

        # (The other branch's zeros are like the block's, their sharding too, on an Explicit mesh.)
        blocks = jax.lax.cond(start >= 0, take, lambda: tuple(jnp.zeros_like(x) for x in take()))
        taken = [x.reshape(groups * per, *x.shape[2:]) for x in blocks]
        fresh = jnp.tile(start + jnp.arange(per) >= i * per, groups)
        out = [jnp.where(broadcast_rows(fresh, y.ndim), y, x) for x, y in zip(taken, fn(*taken), strict=False)]
        return tuple(
            jax.lax.dynamic_update_slice_in_dim(x, y.reshape(x.shape[0], per, *x.shape[2:]), start, axis=1)
            for x, y in zip(new, out, strict=True)
        )

    new = jax.lax.fori_loop(0, -(-run // per), body, tuple(by_runs(x) for x in updated))
    return tuple(x.reshape(rows, *x.shape[2:]) for x in new)


def _replay_flagged(
    p: jax.Array,
    m: jax.Array,
    v: jax.Array,
    last: jax.Array,
    flagged: jax.Array,
    done: jax.Array,
    replayer: Replayer,
    decay: Decay | None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The rows ``flagged`` (per row) of a table replayed by :func:`replay`, the others left as they are: the
    flagged rows' indices listed once, then gathered :data:`_FLAGGED_CHUNK` at a time in a loop (none flagged: no
    iteration), so that its temporaries are that many rows (and an index a row), not the table's. Under ``vmap``
    the loop runs as long as the batch element with the most flagged rows needs, every element's tables selected
    in each iteration."""
    rows = p.shape[0]
    chunk = min(rows, _FLAGGED_CHUNK)
    chunks = -(-rows // chunk)
    # The flagged rows' indices, then `rows` (out of range: gathered as zeros, dropped when written back).
    (order,) = jnp.nonzero(flagged, size=chunks * chunk, fill_value=rows)
    count = jnp.count_nonzero(flagged)
    Carry = tuple[jax.Array, jax.Array, jax.Array, jax.Array]

    def body(carry: Carry) -> Carry:
        i, p, m, v = carry
        idx = jax.lax.dynamic_slice_in_dim(order, i * chunk, chunk)

        def take(x: jax.Array) -> jax.Array:
            return x.at[idx].get(mode="fill", fill_value=0)

        chunk_decay = decay
        if decay is not None and decay.far_log is not None:
            chunk_decay = dataclasses.replace(decay, far_log=take(decay.far_log))
        out = replay(take(p), take(m), take(v), take(last), done, replayer, chunk_decay)
        p, m, v = (x.at[idx].set(r, mode="drop") for x, r in zip((p, m, v), out, strict=True))
        return i + 1, p, m, v

    _, p, m, v = jax.lax.while_loop(lambda c: c[0] * chunk < count, body, (jnp.int32(0), p, m, v))
    return p, m, v


def _concrete(x: Any) -> float | None:
    """``x`` as a float where it is a concrete number, else ``None``."""
    if isinstance(x, numbers.Real):
        return float(x)
    if isinstance(x, np.ndarray | np.generic) and np.ndim(x) == 0:
        return float(x)
    return None


def _series_plan(replayer: Replayer, *dtypes: Any, decay: Decay | None = None) -> _SeriesPlan | None:
    """The closed form's plan, or ``None`` where the idle steps are taken one by one: rows not all float32 (the
    steps round to the row's dtype each time), ``eps_root != 0`` (no series in ``z``), betas traced
    (``inject_hyperparams``), or ``b1`` so close to ``sqrt(b2)`` that ``idle_cap`` exceeds ``_MAX_CAP``."""
    hp = replayer.hp
    b1, b2, eps, eps_root = (_concrete(x) for x in (hp.b1, hp.b2, hp.eps, hp.eps_root))
    if any(jnp.dtype(d) != jnp.float32 for d in dtypes) or b1 is None or b2 is None or eps is None:
        return None
    if eps_root != 0.0 or not 0.0 < b2 < 1.0 or not 0.0 <= b1 < math.sqrt(b2):
        return None
    cap = _concrete_cap(b1, b2)
    if cap > _MAX_CAP:
        return None
    rho = b1 * b2 ** (-(np.arange(_TERMS) + 1) / 2)
    rates = _AdamRates(b1, b2, hp.eps_placement, hp)
    # With decay and a constant rate, the table's k-th term carries gamma^-k; the row's gamma^idle multiplies it.
    table_rho = rho if decay is None or decay.log_gamma is None else rho * math.exp(-decay.log_gamma)
    table = _long_idle_table(replayer.learning_rate, rates, max(b1, b2), cap, table_rho)
    corrections = _correction_table(rates, max(b1, b2))
    return _SeriesPlan(cap=cap, rho=rho, binv=b2 ** (-cap / 2), table=table, rates=rates, corrections=corrections)


@functools.lru_cache(maxsize=64)
def _concrete_cap(b1: float, b2: float) -> int:
    """:func:`idle_cap` of numbers, computed eagerly once per pair (a dozen small XLA programs, which each trace of a
    step compiled or looked up again: about 0.4 s of every catch-up step's trace)."""
    with jax.ensure_compile_time_eval():
        return int(idle_cap(b1, b2))


def _rates(tau: Any, lr: Any, hp: AdamHyperparams, xp: Any) -> Any:
    """``h_j(tau)``: the learning rate times the bias corrections' factor of term ``j`` at step ``tau``, shape
    ``tau.shape + (_TERMS,)``: in float32 as the steps compute the corrections (``xp`` jnp), or in double (NumPy,
    for the table). With optax's placement of ``eps``, ``h_j = lr sqrt(c2)^(j + 1) / c1``, the powers of
    ``sqrt(c2)`` taken as products (a float ``pow`` per term was most of the long-idle coefficients' cost under a
    schedule, 221 of them per last step); with torch's, ``lr sqrt(c2) / c1`` for every ``j``."""
    if xp is np:
        c1, c2 = 1 - float(hp.b1) ** tau, 1 - float(hp.b2) ** tau
    elif hp.eps_placement == "optax":
        c1, c2 = 1 - hp.b1**tau, 1 - hp.b2**tau  # as _idle_step
    else:
        c1, c2 = _torch_corrections(hp, tau)
    root = xp.sqrt(c2)
    powers = [xp.ones_like(root)]
    for _ in range(_TERMS - 1):
        powers.append(powers[-1] * root if hp.eps_placement == "optax" else powers[0])
    return (lr * root / c1)[..., None] * xp.stack(powers, axis=-1)


@dataclasses.dataclass(frozen=True)
class _AdamRates:
    """:func:`_rates` for one set of hyperparameters, hashable by their values (the table's cache key)."""

    b1: float
    b2: float
    eps_placement: str
    hp: AdamHyperparams = dataclasses.field(compare=False)

    def __call__(self, tau: Any, lr: Any, xp: Any) -> Any:
        return _rates(tau, lr, self.hp, xp)


def _long_idle_table(learning_rate: Any, rates: Rates, beta: float, cap: int, rho: np.ndarray) -> np.ndarray | None:
    """``G_j(last) = sum_{k=1..K} h_j(last + k) rho_j^k`` for ``last`` from 0 to the step after which the bias
    corrections (powers of ``beta``, the larger decay rate) are 1 in float32 (the last entry then holds every later
    ``last``), in double, by the recurrence ``G(l) = rho (h(l + 1) + G(l + 1)) - rho^(K + 1) h(l + 1 + K)``;
    ``None`` for a schedule, for ``K == 0``, or past ``_MAX_TABLE`` steps."""
    lr = _concrete(learning_rate)
    if lr is None or cap == 0 or rho.max() >= 1.0:
        return None
    return _table(lr, rates, beta, cap, tuple(rho.tolist()))


@functools.lru_cache(maxsize=64)
def _table(lr: float, rates: Rates, beta: float, cap: int, rho_terms: tuple[float, ...]) -> np.ndarray | None:
    """:func:`_long_idle_table`'s table, built once per set of hyperparameters (a step traces it several times)."""
    rho = np.asarray(rho_terms)
    settle = math.ceil(25 * math.log(2) / -math.log(beta)) if beta > 0 else 1
    if settle > _MAX_TABLE:
        return None
    steady = lr * rho * (1 - rho**cap) / (1 - rho)
    h = rates(np.arange(1, settle + cap + 2, dtype=np.float64), lr, np)  # h[i] = h(i + 1)
    h[settle:] = lr  # bias corrections of 1, as in float32
    table = np.empty((settle + 1, rho.size))
    table[settle] = steady
    tail = rho ** (cap + 1)
    for last in range(settle - 1, -1, -1):
        table[last] = rho * (h[last] + table[last + 1]) - tail * h[last + cap]
    return table.astype(np.float32)


@functools.lru_cache(maxsize=64)
def _correction_table(rates: _AdamRates, beta: float) -> np.ndarray | None:
    """``(c1, c2)`` of :func:`_corrections` for the counts ``0 .. settle + 1`` (``settle``: the step after which
    powers of ``beta``, the larger decay rate, are below float32 resolution), ``(n, 2)`` float32, computed by XLA
    on the CPU as :func:`_replay_steps` computes them in the step, so that the kernel's idle steps divide by the
    same values; ``None`` past ``_MAX_TABLE`` steps, or where the last row is not ``(1, 1)``."""
    settle = math.ceil(25 * math.log(2) / -math.log(beta)) if beta > 0 else 1
    if settle > _MAX_TABLE:
        return None
    with jax.ensure_compile_time_eval(), jax.default_device(jax.local_devices(backend="cpu")[0]):
        c1, c2 = _corrections(rates.hp, jnp.arange(settle + 2, dtype=jnp.int32))
        table = np.stack([np.asarray(c1, np.float32), np.asarray(c2, np.float32)], axis=1)
    return table if np.all(table[-1] == 1.0) else None


class _DecayWeights:
    """AdamW's weights of the idle steps, for :func:`_coefficients` and :func:`replay`: over the window of the last
    ``K`` steps, ``after[o]``, the product of ``gamma`` over the ``o`` steps after step ``done - o`` (the weight of
    that step's displacement), and ``through[o]``, the product over steps ``done - o .. done``; per row of
    ``idle`` (where given), ``rows``, the product over all its idle steps (the scale of the row), and ``far``,
    that of a row idle longer than the window (:meth:`Decay.far`)."""

    def __init__(
        self, decay: Decay, lr_at: Callable[[jax.Array], jax.Array], idle: jax.Array | None, done: jax.Array, cap: int
    ) -> None:
        self.decay, self.lr_at = decay, lr_at
        logs = jnp.cumsum(decay.log(lr_at, done - jnp.arange(max(cap, 1), dtype=jnp.int32)))
        self.through = jnp.exp(logs)
        self.after = jnp.exp(jnp.concatenate([jnp.zeros(1, jnp.float32), logs[:-1]]))
        if idle is not None:
            self.far = decay.far(idle)
            recent = self.through[jnp.clip(idle - 1, 0, self.through.shape[0] - 1)]
            self.rows = jnp.where(idle > cap, self.far, jnp.where(idle > 0, recent, 1.0))


def _coefficients(
    plan: _SeriesPlan,
    lr: Callable[[jax.Array], jax.Array],
    last: jax.Array,
    idle: jax.Array,
    done: jax.Array,
    weights: _DecayWeights | None = None,
    record: IdleRecord | None = None,
    variant: int | None = None,
) -> jax.Array:
    """``C_j`` per row, shape ``(*last.shape, terms)``: zeros where ``idle == 0``. ``lr(d)``: the learning rate
    of the step after ``d`` steps. With ``weights`` each idle step's term carries the decay of the steps after it.
    ``record``: the state's record of long-idle coefficients (its ``variant``, where it has several)."""
    terms = plan.rho.size
    if plan.cap == 0:  # b1 == 0: idle steps do not move a row
        return jnp.zeros((*last.shape, terms), jnp.float32)
    recent = _window(plan, lr, done, weights)[jnp.clip(idle - 1, 0, plan.cap - 1)]
    long_idle = idle > plan.cap
    far, by_row = _far(plan, lr, last, long_idle, weights, record, variant)
    if not by_row:
        far = far[jnp.clip(last, 0, far.shape[0] - 1)]
    if weights is not None:  # the table's or the loop's terms carry 1 / (the decay of the steps up to theirs)
        far = far * weights.far[:, None]
    out = jnp.where(long_idle[:, None], far, recent)
    return jnp.where((idle > 0)[:, None], out, 0.0)


def _window(
    plan: _SeriesPlan,
    lr: Callable[[jax.Array], jax.Array],
    done: jax.Array,
    weights: _DecayWeights | None = None,
    gathered: bool = True,
) -> jax.Array:
    """``C_j`` of rows idle ``d <= K`` steps, in row ``d - 1``, shape ``(K, terms)`` (``K >= 1``): ``C_j(d) =
    sum_{o < d} h_j(done - o) rho_j^(d - o)``, the recurrence ``C(d) = rho (h(done - d + 1) + C(d - 1))`` taken in
    blocks of about ``sqrt(K)`` steps (:func:`_window_powers`): each block's own sum, then the blocks' ends carried
    forward; ``gathered``: whether rows' reads gather from it in XLA (rather than a kernel reading it as an
    operand)."""
    tau = done - jnp.arange(plan.cap, dtype=jnp.int32)
    # The steps before the first (tau < 1) are masked out, and their rates taken at tau = 1: at tau = 0 the bias
    # correction 1 - b1**0 is 0, and its infinite quotient made reverse-mode derivatives NaN (0 times inf).
    safe = jnp.maximum(tau, 1)
    h = jnp.where((tau >= 1)[:, None], plan.rates(safe, lr(safe - 1), jnp), 0.0)
    if weights is not None:
        h = h * weights.after[:, None]

    def blocked() -> jax.Array:
        within, across, into = (jnp.asarray(x) for x in _window_powers(tuple(plan.rho), plan.cap))
        blocks, size = across.shape[1], within.shape[1]
        x = jnp.pad(h, ((0, blocks * size - plan.cap), (0, 0))).reshape(blocks, size, -1)
        dot = functools.partial(jnp.einsum, precision=jax.lax.Precision.HIGHEST)
        local = dot("jro,boj->brj", within, x)  # each block's sum over its own steps
        ends = dot("jbc,cj->bj", across, local[:, -1])  # C at each block's last step
        before = jnp.concatenate([jnp.zeros_like(ends[:1]), ends[:-1]])  # C at the step before each block
        out = local + into.T[None] * before[:, None]
        return out.reshape(blocks * size, -1)[: plan.cap]

    if not gathered:  # a kernel's operand, a buffer already
        return blocked()
    # The window is computed once, into a buffer the rows' reads read: left to fusion, XLA:CPU recomputes the
    # window's last sum inside a gather for each row's read (a fifth of sparse_adam(catch_up=True)'s fused step at
    # 8,192 Zipf ids when it gathered them; jax.lax.optimization_barrier does not stop it, XLA:CPU expands barriers
    # before fusing). A conditional's result is a buffer fusion does not reach into; its predicate always holds.
    # (Where a kernel reads the window, the conditional would only cost its step some 30 microseconds on the CPU.)
    return jax.lax.cond(done >= 0, blocked, lambda: jnp.zeros_like(h))


@functools.lru_cache(maxsize=64)
def _window_powers(rho: tuple[float, ...], cap: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The powers of ``rho`` :func:`_window` sums with, in double rounded once to float32, for ``cap`` steps in
    ``blocks`` blocks of ``size``: ``within[j, r, o] = rho_j^(r - o + 1)`` (``o <= r``, else 0), the weight of a
    block's step ``o`` at its step ``r``; ``across[j, b, c] = rho_j^(size (b - c))`` (``c <= b``), that of block
    ``c``'s last step at block ``b``'s; ``into[j, r] = rho_j^(r + 1)``, that of the step before a block at its step
    ``r``. (A scan over the steps instead: some 400 more operations, half of a catch-up step's compile time.)"""
    size = math.isqrt(cap - 1) + 1  # ceil(sqrt(cap))
    blocks = -(-cap // size)
    r = np.array(rho, np.float64)[:, None, None]
    steps = np.arange(size)
    within = np.where(steps[:, None] >= steps[None, :], r ** (steps[:, None] - steps[None, :] + 1), 0.0)
    gaps = np.arange(blocks)[:, None] - np.arange(blocks)[None, :]
    across = np.where(gaps >= 0, r ** (size * np.maximum(gaps, 0)), 0.0)
    into = r[:, 0] ** (steps + 1)
    out = within.astype(np.float32), across.astype(np.float32), into.astype(np.float32)
    for x in out:  # shared by every step traced with these powers (the cache)
        x.flags.writeable = False
    return out


def _far(
    plan: _SeriesPlan,
    lr: Callable[[jax.Array], jax.Array],
    last: jax.Array,
    long_idle: jax.Array,
    weights: _DecayWeights | None = None,
    record: IdleRecord | None = None,
    variant: int | None = None,
) -> tuple[jax.Array, bool]:
    """``G_j`` of the rows idle more than ``K`` steps (``long_idle``), before AdamW's ``weights.far``: with a
    constant learning rate the plan's table, by the row's last step (clipped to its last entry), and ``False``;
    else one entry per row of ``last``, and ``True``: from the state's ``record`` where it holds the row's last
    step (its ``variant``, where it has several), the others by :func:`_long_idle_loop` (which runs nothing
    where no row is left to it)."""
    if plan.table is not None:
        return jnp.asarray(plan.table), False
    if not _kept(record):
        return _long_idle_loop(plan, lr, last, long_idle, weights), True
    assert record is not None  # _kept
    slot = jnp.mod(last, record.last_steps.shape[0])
    held = long_idle & (record.last_steps[slot] == last)
    looped = _long_idle_loop(plan, lr, last, long_idle & ~held, weights)
    # A gather at the variant's index: slicing the variant first copied it whole (2 MiB) every step.
    held_coefficients = record.coefficients[slot] if variant is None else record.coefficients[variant, slot]
    return jnp.where(held[:, None], held_coefficients, looped), True


# The last steps whose long-idle coefficients a state records (IdleRecord): 2 MiB of float32 for Adam's eight
# terms. Under optax.warmup_cosine_decay_schedule a step of 8,192 Zipf ids on 1e6 rows spent some 1.2 ms computing
# them for its rows' distinct last steps, against 0.6 ms for the rest of the step; a row idle longer than the
# record reaches back still has them computed that way, once per distinct last step.
_RECORD_STEPS = 1 << 16


class IdleRecord(NamedTuple):
    """A catch-up state's record of the idle steps' coefficients of rows idle longer than the window, under a
    learning-rate schedule (where a table holds them, at a constant rate, the record is a single entry for no step).

    The coefficients ``G_j(L)`` of a row whose last step is ``L`` depend on ``L`` alone, and are the window's
    oldest coefficients at step ``L + K`` (``K`` the window's steps, ``idle_cap``): each step writes them in
    row ``L mod steps``, and a later step reads them for its rows last moved at ``L`` and idle more than ``K``
    steps, one gather a row where it computed ``K`` steps of the schedule and the bias corrections for each
    distinct last step. A row whose entry was overwritten since (idle ``K + steps`` steps or more; ``steps`` is
    65,536) has its coefficients computed that way still, once per distinct last step, as has a row of a state
    whose record its steps did not write (a state built by hand): ``last_steps`` says which last step each entry
    is for. Where the state keeps no record, it holds one entry for no step (orbax saves no empty arrays). On the
    CPU the catch-up kernels read the entries themselves, and leave a row whose entry is for another step to the
    XLA path. ``sparse_sgd(momentum, catch_up=True)`` keeps one too, for its sums over the idle steps.

    Attributes:
      coefficients: ``G_j(L)`` in row ``L mod steps``, float32, shape ``(steps, terms)`` (8 terms for Adam's
        series, 1 for AMSGrad's and momentum SGD's), or ``(2, steps, terms)`` for AdamW's, without and with its
        decay (``(1, ...)`` where the weight decay is 0); ``steps`` is 1 where the state keeps no record.
      last_steps: The last step ``L`` each row of ``coefficients`` holds, int32, shape ``(steps,)``; -1 for none.
    """

    coefficients: jax.Array
    last_steps: jax.Array


def _kept(record: IdleRecord | None) -> bool:
    """Whether ``record`` is a state's record kept by its steps, not the single entry for no step of a state that
    keeps none (:func:`record_steps`)."""
    return record is not None and record.last_steps.shape[0] > 1


def record_steps(plans: tuple[_SeriesPlan | None, ...], learning_rate: Any) -> int:
    """How many last steps a state's :class:`IdleRecord` holds: :data:`_RECORD_STEPS` where one of ``plans`` has
    no table of the long-idle coefficients (a schedule; bias corrections too slow to reach 1 for a table) and the
    learning rate is a schedule or a number; else 1, an entry for no step (a table, no closed form, or a rate
    ``inject_hyperparams`` passes as an array, which the idle steps take at its current value)."""
    if not callable(learning_rate) and _concrete(learning_rate) is None:
        return 1
    if any(plan is not None and plan.cap > 0 and plan.table is None for plan in plans):
        return max(_RECORD_STEPS, 1)
    return 1


def idle_record(plans: tuple[_SeriesPlan | None, ...], learning_rate: Any, variants: int | None = None) -> IdleRecord:
    """A new state's :class:`IdleRecord`, holding nothing yet: ``(steps, terms)`` coefficients
    (:func:`record_steps`; ``(variants, steps, terms)`` where leaves differ: AdamW's without and with its decay)."""
    terms = max((plan.rho.size for plan in plans if plan is not None), default=1)  # never empty (orbax)
    steps = record_steps(plans, learning_rate)
    shape = (steps, terms) if variants is None else (variants, steps, terms)
    return IdleRecord(jnp.zeros(shape, jnp.float32), jnp.full((steps,), -1, jnp.int32))


def record_step(
    record: IdleRecord,
    plan: _SeriesPlan | None,
    lr_at: Callable[[jax.Array], jax.Array],
    done: jax.Array,
    decay: Decay | None = None,
    variant: int | None = None,
) -> IdleRecord:
    """``record`` (with ``variant``, of that variant) after the step that takes the state's count from ``done``
    (``lr_at(d)``: the learning rate of the step after ``d`` steps):
    ``G_j(done - K)`` in row ``(done - K) mod steps``. That is the window's last row at ``done``, ``C_j(K) =
    sum_{k=1..K} h_j(done - K + k) rho_j^k``; with AdamW's ``decay`` each term carries the decay of the steps after
    it (:class:`_DecayWeights`), and the row is divided by the decay of all ``K``, leaving each term divided by the
    decay of the steps up to it, as :func:`_long_idle_loop` takes it. The step reads the record it returns: the
    row it adds is for a last step no row of the step has (those idle more than ``K``), and a donated record is
    updated in place (reading the old one cost two copies of it)."""
    if not _kept(record) or plan is None or plan.cap == 0:
        return record
    steps = record.last_steps.shape[0]
    weights = None if decay is None else _DecayWeights(decay, lr_at, None, done, plan.cap)
    row = _window(plan, lr_at, done, weights, gathered=False)[-1].astype(jnp.float32)
    if weights is not None:
        row = row / weights.through[-1]
    last = (done - plan.cap).astype(jnp.int32)
    slot = jnp.mod(last, steps)
    zero = jnp.zeros((), jnp.int32)  # the indices of one type (a Python 0 is an int64 in jax's 64-bit mode)
    if variant is None:
        coefficients = jax.lax.dynamic_update_slice(record.coefficients, row[None], (slot, zero))
    else:
        at = (jnp.asarray(variant, jnp.int32), slot, zero)
        coefficients = jax.lax.dynamic_update_slice(record.coefficients, row[None, None], at)
    return IdleRecord(coefficients, jax.lax.dynamic_update_slice(record.last_steps, last[None], (slot,)))


def _long_idle_loop(
    plan: _SeriesPlan,
    lr: Callable[[jax.Array], jax.Array],
    last: jax.Array,
    rows: jax.Array,
    weights: _DecayWeights | None = None,
) -> jax.Array:
    """``G_j(last)`` for the ``rows`` idle more than ``K`` steps, one step at a time (a schedule, or bias
    corrections too long for a table); nothing runs where no row is. With ``weights`` the ``k``-th term is divided
    by the decay of the row's first ``k`` idle steps. ``G`` is a function of the last step alone: on the CPU and
    TPUs it is computed once for each distinct last step among the ``rows``, in chunks of ``_LAST_STEPS`` as far as
    they go (a batch's long-idle rows share few last steps, and each costs ``K`` evaluations of the schedule and
    the bias corrections), and gathered; on GPUs, where a step is bound by launches, for every entry at once."""
    rho = jnp.asarray(plan.rho, jnp.float32)

    def coefficients(last: jax.Array, unroll: int = _UNROLL) -> jax.Array:
        def body(k: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
            total, power, through = carry
            power = power * rho[None, :]
            tau = last + k.astype(last.dtype)  # k is an int64 in jax's 64-bit mode
            term = plan.rates(tau, lr(tau - 1), jnp) * power
            if weights is not None:  # through: the log of the decay of the row's first k idle steps
                through = through + weights.decay.log(weights.lr_at, tau)[:, None].astype(through.dtype)
                term = term * jnp.exp(-through)
            return total + term.astype(total.dtype), power, through

        zeros = _zeros(last, plan.rho.size)
        init = (zeros, jnp.ones_like(zeros), zeros[..., :1])  # through: one per row (one exp per row and step)
        return jax.lax.fori_loop(1, plan.cap + 1, body, init, unroll=unroll)[0]

    def by_last_step(last: jax.Array) -> jax.Array:
        n, size = last.shape[0], min(last.shape[0], _LAST_STEPS)
        unused = jnp.iinfo(jnp.int32).max
        # The rows' distinct last steps packed first, and each entry's slot (a sort and a search of the steps took
        # 1.2 of this function's 1.9 ms at 8,192 entries and 286 distinct long-idle last steps).
        distinct, slot = distinct_ids(jnp.where(rows, last, -1), unused)
        count = jnp.sum(distinct != unused)

        def chunk(c: jax.Array, out: jax.Array) -> jax.Array:
            start = jnp.minimum(c * size, n - size)  # the last chunk may overlap the one before: the same values
            block = coefficients(jax.lax.dynamic_slice_in_dim(distinct, start, size))
            return jax.lax.dynamic_update_slice_in_dim(out, block, start, 0)

        out = jax.lax.fori_loop(0, (count + size - 1) // size, chunk, _zeros(last, plan.rho.size))
        # Zero for the other entries (a last chunk past the distinct steps computes garbage from the sentinel).
        return jnp.where(rows[:, None], out[slot], 0.0)

    def run(last: jax.Array) -> jax.Array:
        gpu = functools.partial(coefficients, unroll=_UNROLL_GPU)
        default = coefficients if last.ndim != 1 or last.shape[0] <= _LAST_STEPS else by_last_step
        return jax.lax.platform_dependent(last, cuda=gpu, rocm=gpu, default=default)

    return jax.lax.cond(jnp.any(rows), run, lambda last: _zeros(last, plan.rho.size), last)


_LAST_STEPS = 64  # distinct last steps a chunk of the long-idle coefficients' loop


# Idle steps a trip of the per-row loops over a window's steps. A GPU runs each trip of a loop as kernel launches of
# its own and a copy of the condition to the host (221 trips at optax's betas took 4 ms of AdamW's step under a
# schedule on an H200): 16 a trip there. Elsewhere, 1: each step's copy of the body (the schedule's too) is compiled,
# and on the CPU a single copy compiles faster and runs no slower. AdamW's catch-up step under a schedule, 1 against
# 4 (Intel Xeon, 2 cores): 26 tables of 10,000 x 16 compiled in 9.3 to 9.6 s against 11.5 to 14.3 s (12.7 to 13.4
# against 15.9 to 19.4 on the XLA path); at 1e6 x 64 with 8,192 Zipf ids the XLA path's step took 2.5 to 2.6 ms
# against 2.9 to 3.1, and the kernel's the same within the noise (its XLA fallback runs for the rows it flags). An
# earlier measurement, of another configuration: 5.1 s to compile at 16, 1.7 s at 4. TPUs take 1 as well,
# unmeasured. The same operations in the same order either way; XLA may contract multiply-adds its own way in a body
# copied more times, so the parameters may differ by rounding.
_UNROLL = 1
_UNROLL_GPU = 16


def _zeros(last: jax.Array, terms: int) -> jax.Array:
    """Zeros of shape ``(*last.shape, terms)``, varying over the manual axes ``last`` varies over (inside
    ``shard_map``, a loop's carry must keep its type)."""
    return jnp.broadcast_to(jnp.zeros_like(last, jnp.float32)[..., None], (*last.shape, terms))


def _replay_steps(
    p: jax.Array,
    m: jax.Array,
    v: jax.Array,
    last: jax.Array,
    idle: jax.Array,
    replayer: Replayer,
    decay: Decay | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`replay` step by step, in dense Adam's own arithmetic (AdamW's with ``decay``), for ``idle`` steps per
    row; with ``decay`` the steps past the first ``K`` still decay the row."""
    hp = replayer.hp
    n = jnp.minimum(idle, idle_cap(hp.b1, hp.b2))

    Carry = tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]

    def cond(carry: Carry) -> jax.Array:
        return carry[0] < jnp.max(n, initial=0)

    def body(carry: Carry) -> Carry:
        k, p, m, v, through = carry
        k = k + 1
        tau = last + k  # the idle step's count, as Adam's bias corrections take it
        active = broadcast_rows(k <= n, p.ndim)
        m_new = (hp.b1 * m).astype(m.dtype)
        v_new = (hp.b2 * v).astype(v.dtype)
        step = _idle_step(m_new, v_new, tau, hp)
        if decay is not None:  # as optax.add_decayed_weights
            step = step + decay.weight_decay * p.astype(step.dtype)
            if decay.scheduled:  # the log Decay.rest reads under a schedule (not at a constant rate)
                through = jnp.where(k <= n, through + decay.log(replayer.lr, tau), through)
        lr = replayer.lr(tau - 1)
        p_new = (p + broadcast_rows(-lr, p.ndim).astype(step.dtype) * step).astype(p.dtype)
        return k, jnp.where(active, p_new, p), jnp.where(active, m_new, m), jnp.where(active, v_new, v), through

    def loop(unroll: int, start: Carry) -> Carry:
        def trip(carry: Carry) -> Carry:  # unroll steps a trip (those past a row's n leave it as it is)
            return jax.lax.fori_loop(0, unroll, lambda _, carry: body(carry), carry, unroll=True)

        return jax.lax.while_loop(cond, trip, start)

    start = (jnp.zeros([], jnp.int32), p, m, v, jnp.zeros_like(idle, jnp.float32))  # varying as idle is (shard_map)
    gpu, other = functools.partial(loop, _UNROLL_GPU), functools.partial(loop, _UNROLL)
    _, p, m, v, through = jax.lax.platform_dependent(start, cuda=gpu, rocm=gpu, default=other)
    if decay is not None:  # the idle steps past the first K decay the row, and move it by less than 2**-24
        rest_decay = jnp.where(idle > n, decay.rest(idle, n, through), 1.0)
        p = (broadcast_rows(rest_decay, p.ndim) * p).astype(p.dtype)
    m = (m * broadcast_rows(_power(hp.b1, idle - n), m.ndim)).astype(m.dtype)
    v = (v * broadcast_rows(_power(hp.b2, idle - n), v.ndim)).astype(v.dtype)
    return p, m, v


def _power(b: Any, n: jax.Array) -> jax.Array:
    """``b ** n`` in float32 for an int32 ``n`` (1 where ``n <= 0``, also for ``b == 0``).

    For a number ``0 <= b < 1``, :func:`table_power` of its :func:`power_table`: within two ulps or so of
    ``b ** n`` for any ``n`` (``exp(n log b)`` in float32 is off by ``|n log b| 2**-24`` relative, 60 ulps at
    ``b = 0.999`` and ``n = 10**6``), and what the native kernels compute themselves from the same table."""
    beta = _concrete(b)
    if beta is not None and 0.0 <= beta < 1.0:
        return table_power(_base_table(beta), n)
    return jnp.where(n > 0, jnp.power(jnp.asarray(b, jnp.float32), n.astype(jnp.float32)), 1.0)


def _base_table(b: float) -> np.ndarray:
    """:func:`power_table` of a number ``0 <= b < 1``."""
    return power_table(math.log(b) if b > 0.0 else -math.inf)


@functools.lru_cache(maxsize=64)
def power_table(log_b: float) -> np.ndarray:
    """``(4, 256)`` float32: entry ``[i, j]`` is ``b ** (j * 256**i)``, ``exp(j 256**i log b)`` in double rounded
    to float32 (and 0 below float32's smallest normal number), for ``log_b = log(b)`` (``-inf`` for ``b = 0``)."""
    exponents = np.arange(256, dtype=np.float64)[None, :] * 256.0 ** np.arange(4, dtype=np.float64)[:, None]
    with np.errstate(invalid="ignore", over="ignore", under="ignore"):
        table = np.exp(exponents * log_b)
    table[:, 0] = 1.0  # b ** 0, also where log_b is -inf
    table = table.astype(np.float32)
    table[table < np.finfo(np.float32).tiny] = 0.0
    table.flags.writeable = False
    return table


def table_power(table: np.ndarray, n: jax.Array) -> jax.Array:
    """``b ** n`` for an int32 ``n`` (1 where ``n <= 0``) from ``b``'s :func:`power_table`: the product of the
    entries of ``n``'s four base-256 digits, lowest first, each product below float32's smallest normal number
    taken as 0 (the same whether or not denormals are flushed). Rounded three times from correctly rounded
    entries: within two ulps or so of ``b ** n``. catch_up_adam.cc's ``TablePower`` computes it alike, bitwise."""
    k = jnp.maximum(n, 0)
    # The four entries in one gather (a gather each made a third of AdamW's catch-up program).
    lanes = np.arange(4, dtype=np.int32).reshape((1,) * k.ndim + (4,))
    digits = ((k[..., None] >> (8 * lanes)) & 255) + 256 * lanes
    entries = jnp.asarray(table).reshape(-1).at[digits].get(mode="promise_in_bounds")
    out = entries[..., 0]
    for i in (1, 2, 3):
        out = out * entries[..., i]
        out = jnp.where(out < np.finfo(np.float32).tiny, jnp.float32(0.0), out)
    return out


def _corrections(hp: AdamHyperparams, tau: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The bias corrections of the idle steps with counts ``tau`` (any shape), as :func:`_idle_step` divides by
    them: ``1 - b**tau`` (optax's placement of ``eps``) or torch's (:func:`._adam._torch_corrections`)."""
    if hp.eps_placement == "optax":
        return 1 - hp.b1**tau, 1 - hp.b2**tau  # as optax.tree.bias_correction
    return _torch_corrections(hp, tau)


def _idle_step(m: jax.Array, v: jax.Array, tau: jax.Array, hp: AdamHyperparams) -> jax.Array:
    """:func:`._adam._step` with a step count per row (``tau``), in the same arithmetic."""
    c1, c2 = _corrections(hp, tau)
    if hp.eps_placement == "optax":
        m_hat = m / broadcast_rows(c1, m.ndim).astype(m.dtype)
        v_hat = v / broadcast_rows(c2, v.ndim).astype(v.dtype)
        return m_hat / (jnp.sqrt(v_hat + hp.eps_root) + hp.eps)
    scale = broadcast_rows(jnp.sqrt(c2) / c1, m.ndim)
    return scale.astype(m.dtype) * m / (jnp.sqrt(v + hp.eps_root) + hp.eps)


def _scaled(u: jax.Array, lr: jax.Array) -> jax.Array:
    """``-lr * u`` as :func:`optax.scale_by_learning_rate` computes it."""
    return jnp.asarray(-lr, dtype=u.dtype) * u


def _rule(replayer: Replayer, done: jax.Array, count: jax.Array, lr: jax.Array) -> Rule:
    """The sparse leaf rule of step ``count``: the touched rows replay their idle steps up to ``done``, then take
    Adam's step; the update takes a replayed row to where dense Adam's steps took it."""
    hp = replayer.hp

    def rule(g: jax.Array, st: tuple[jax.Array, ...], reads: tuple[jax.Array, ...]) -> Any:
        (m0, v0, last), (p0,) = st, reads
        p, m, v = replay(p0, m0, v0, last, done, replayer)
        m, v = _moments(g, m, v, hp)
        step = _scaled(_step(m, v, count, hp), lr)
        moved = broadcast_rows(p != p0 if p.ndim <= 1 else jnp.any(p != p0, axis=tuple(range(1, p.ndim))), p.ndim)
        return caught_up_update(p0, p, step, moved), (m, v, stamp(last, count))

    return rule


def _kernel_operands(
    plan: _SeriesPlan,
    replayer: Replayer,
    done: jax.Array,
    decay: Decay | None = None,
    weights: _DecayWeights | None = None,
    far: jax.Array | None = None,
    logs: tuple[Any, Any] = (0.0, 0.0),
) -> _ffi.CatchUpOperands:
    """What the catch-up Adam kernels read of a step beyond the rows (see :func:`._ffi.catch_up_adam_apply`); ``far``,
    the long-idle coefficients per key where the plan has no table."""
    hp = replayer.hp
    bases = [_base_table(b) for b in (_concrete(hp.b1), _concrete(hp.b2)) if b is not None]
    if decay is not None and decay.log_gamma is not None:
        bases.append(power_table(decay.log_gamma))
    powers = jnp.asarray(np.concatenate(bases))
    through = weights.through if weights is not None else jnp.ones(1, jnp.float32)
    window = zeros = jnp.zeros((1, _TERMS), jnp.float32)  # b1 == 0: no idle step moves a row, every coefficient 0
    if plan.cap > 0:
        window = _window(plan, replayer.lr, done, weights, gathered=False)
        if far is None:
            assert plan.table is not None
            far = jnp.asarray(plan.table)
    long_neg_lr, neg_rates, corrections = _step_operands(plan, replayer, done)
    has_table = float(plan.corrections is not None)
    new_log, old_log = logs
    scalars = (plan.binv, _RATIO, long_neg_lr, has_table, new_log, old_log)
    limits = jnp.stack([jnp.asarray(x, jnp.float32) for x in scalars])
    far = zeros if far is None else far
    # float32, as the kernels read them: in jax's 64-bit mode the NumPy tables and a schedule's rates are float64.
    ops = (window, far, powers, through, limits, neg_rates, corrections)
    return _ffi.CatchUpOperands(*(jnp.asarray(x, jnp.float32) for x in ops))


def _rows_kernel(
    replayer: Replayer, done: jax.Array, count: jax.Array, lr: jax.Array, adamw: AdamWLeaf | None = None
) -> Kernel:
    """The catch-up Adam rows kernel in the XLA rule's place (``tx.update`` on the CPU; with ``adamw``, AdamW's rule,
    with its decay on a leaf its mask decays, and Adam's catch-up with AdamW's record on one it leaves out), where
    the closed form applies to float32 tables; elsewhere the XLA rule runs. The rows it flags (:func:`_may_flag`:
    idle steps not at hand, under a schedule or without a table of bias corrections, or long-idle coefficients the
    state's record does not hold) keep their records and take
    the XLA rule, on those rows alone, their updates placed in the kernel's slots by key."""
    hp = replayer.hp
    decay = None if adamw is None else adamw.decay.of(adamw.flag, None)

    def plan_of(state: tuple[jax.Array, ...], p: jax.Array) -> _SeriesPlan | None:
        return _series_plan(replayer, p.dtype, state[0].dtype, state[1].dtype, decay=decay)

    def supports(leaf: SparseLeaf, state: tuple[jax.Array, ...], reads: tuple[jax.Array, ...]) -> bool:
        (p,), last = reads, state[2]
        return (
            plan_of(state, p) is not None
            and last.dtype == jnp.int32
            and last.shape == p.shape[:1]
            and p.dtype == jnp.float32
            and _kernel_path.supports(leaf.shape, leaf.n_sparse, *state[:2], *state[3:], leaf.values, params=p)
        )

    def run(leaf: SparseLeaf, state: tuple[jax.Array, ...], reads: tuple[jax.Array, ...]) -> Any:
        (p,) = reads
        plan = plan_of(state, p)
        assert plan is not None, "supports() checks the plan"
        extra = () if decay is None else (jnp.asarray(decay.weight_decay),)
        scalars = kernel_scalars(hp, count, -jnp.asarray(lr, jnp.float32), *extra)
        keyed, (*stepped, out_keys, out, flagged) = _call(
            _ffi.catch_up_adam_rows, plan, replayer, p, state, leaf, scalars, count, done, decay, adamw
        )
        tables = tuple(stepped)
        if not _may_flag(plan, replayer, keyed.decay):
            return out_keys[:, None], out, tables
        rule, _ = _flagged_rule(replayer, done, count, lr, adamw)
        out, tables = flagged_updates(flagged, out_keys, out, leaf, p, tables, rule)
        return out_keys[:, None], out, tables

    return Kernel(supports, run)


def flagged_entries(leaf: SparseLeaf, flagged: jax.Array, rows: int) -> SparseLeaf:
    """The entries of ``leaf`` whose rows a catch-up kernel flagged (``flagged``, one per entry), the others made
    padding (``rows``, the table's rows)."""
    return leaf._replace(keys=jnp.where(flagged[:, None] > 0, leaf.keys, rows))


def flagged_updates(
    flagged: jax.Array,
    out_keys: jax.Array,
    out: jax.Array,
    leaf: SparseLeaf,
    p: jax.Array,
    tables: tuple[jax.Array, ...],
    rule: Rule,
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """A catch-up rows kernel's results ``(out, tables)`` (its update rows ``out`` at ``out_keys``), where it
    flagged rows of ``leaf`` (``flagged``, one per entry): those rows' updates and records by the XLA ``rule``
    (the kernel left their records as they were), their updates placed in the kernel's slots by key. Run only
    where a row is flagged."""

    def by_steps() -> tuple[jax.Array, ...]:
        distinct = coalesce(flagged_entries(leaf, flagged, p.shape[0]))
        new, stepped = _run_rows(distinct, p.shape, tables, (p,), rule, out.dtype)
        return _placed(out_keys, out, distinct.keys[:, 0], stepped, p.shape[0]), *new

    out, *new = jax.lax.cond(jnp.any(flagged > 0), by_steps, lambda: (out, *tables))
    return out, tuple(new)


def flagged_steps(
    flagged: jax.Array,
    p: jax.Array,
    tables: tuple[jax.Array, ...],
    leaf: SparseLeaf,
    rule: Rule,
    where: str,
    clip: Clipped | None = None,
) -> tuple[jax.Array, ...]:
    """A catch-up apply kernel's results ``(p, *tables)``, where it flagged rows of ``leaf`` (``flagged``, one per
    entry): those rows stepped by the XLA ``rule`` (the kernel left them and their records as they were), which
    reads and writes them (``where`` names it in errors). With a global-norm ``clip``, ``leaf`` holds the table's
    entries, which are summed, then clipped, as the kernel sums and clips them. Run only where a row is
    flagged."""

    def by_steps() -> tuple[jax.Array, ...]:
        rows = flagged_entries(leaf, flagged, p.shape[0])
        if clip is not None:  # the table's entries, summed here, then clipped
            rows = coalesce(rows)
            (div, mul), t = clip.scalars(), rows.values
            # optax.clip_by_global_norm's expression, select(trigger, t, (t / g_norm) * max_norm): XLA:CPU keeps
            # that division a division, where a bare (t / div) * mul becomes t * (1 / div) * mul and the moments
            # round apart from the two calls'.
            rows = rows._replace(values=jax.lax.select((div == 1) & (mul == 1), t, (t / div) * mul))
        # rows is known distinct where the leaf is: the rule does not coalesce it again.
        out, new = apply_rule((), rows.to_leaf(), p.shape, tables, (p,), rule, where, whole_rows=True)
        return apply_updates(p, out), *new

    return tuple(jax.lax.cond(jnp.any(flagged > 0), by_steps, lambda: (p, *tables)))


def _placed(keys: jax.Array, rows: jax.Array, by: jax.Array, by_rows: jax.Array, num_rows: int) -> jax.Array:
    """``rows`` (one per entry of ``keys``), those of the in-range keys that ``by`` holds replaced by the rows of
    ``by_rows`` at those keys (the keys distinct in each)."""
    order = jnp.argsort(by)
    ordered = by[order]
    at = jnp.clip(jnp.searchsorted(ordered, keys), 0, by.shape[0] - 1)
    hit = (ordered[at] == keys) & (keys >= 0) & (keys < num_rows)
    return jnp.where(broadcast_rows(hit, rows.ndim), by_rows[order[at]], rows)


def fused_apply(
    replayer: Replayer,
    p: jax.Array,
    state: tuple[jax.Array, ...],
    leaf: SparseLeaf,
    scalars: jax.Array,
    done: jax.Array,
    count: jax.Array,
    record: IdleRecord | None = None,
    clip: Clipped | None = None,
    adamw: AdamWLeaf | None = None,
) -> tuple[jax.Array, ...]:
    """:func:`update_and_apply`'s step on one sparse leaf, by the native kernel: ``(p, mu, nu, last_step)``, and
    with ``adamw`` (``sparse_adamw(catch_up=True)``'s leaf), ``(p, mu, nu, last_step, decay_mark)`` from a
    ``state`` with the decay mark last. The touched rows are replayed up to step ``done`` (the state's count before
    the step) and take step ``count`` (after it).

    What the XLA path computes per row to replay it the kernel computes per touched row from its record, as the XLA
    path does: its idle steps, the moments' decays (:func:`_power`, from the same tables), and with AdamW's decay
    the row's decay over its idle steps and the long-idle terms' weight (from gamma's table and the window's
    products; under a schedule, a long-idle row's from its decay mark and the state's log, ``exp(old_log - mark)``,
    with C's ``exp``, which may round an ulp apart from XLA's). Its series coefficients
    it picks from the window and the long-idle table (:func:`_window`, :func:`_far`; under a schedule, from the
    state's ``record``, an :class:`IdleRecord`, by the row's last step) as :func:`_coefficients` does. The kernel
    replays and steps each touched row in one pass, taking the idle steps one by one for the elements the series
    does not take (from the window's learning rates and the plan's bias corrections), and records it in place (its
    last step; AdamW's decay mark). Rows it flags (such steps of a row idle longer than the window under a
    schedule; a long-idle row whose entry the record does not hold; no table of corrections) keep their records and
    take the XLA rule on those rows alone, which reads and writes them.
    With a global-norm ``clip``, ``leaf`` is the table's entries, which the kernel sums and clips row by row (its
    two scalars after Adam's), and which are summed and clipped alike for the flagged rows.
    """
    decay = None if adamw is None else adamw.decay.of(adamw.flag, None)
    plan = _series_plan(replayer, p.dtype, state[0].dtype, state[1].dtype, decay=decay)
    assert plan is not None, "fusable() checks the plan"
    replayer = replayer.reading(record, None if adamw is None else adamw.decay.variant(adamw.flag))
    if clip is not None:
        scalars = clip.append_to(scalars)
    # The kernel records the rows it steps (the last step, AdamW's decay mark) in place; the rows it flags keep
    # their records for the XLA rule below, which reads and writes them.
    keyed, (p, *tables, flagged) = _call(
        _ffi.catch_up_adam_apply, plan, replayer, p, state, leaf, scalars, count, done, decay, adamw
    )

    if not _may_flag(plan, replayer, keyed.decay):
        return p, *tables
    rule, where = _flagged_rule(replayer, done, count, replayer.lr(done), adamw)
    return flagged_steps(flagged, p, tuple(tables), leaf, rule, where, clip)


def _call(
    kernel: Callable[..., tuple[Any, ...]],
    plan: _SeriesPlan,
    replayer: Replayer,
    p: jax.Array,
    state: tuple[jax.Array, ...],
    leaf: SparseLeaf,
    scalars: jax.Array,
    count: jax.Array,
    done: jax.Array,
    decay: Decay | None,
    adamw: AdamWLeaf | None,
) -> tuple[_ByKey, tuple[Any, ...]]:
    """One of the catch-up Adam kernels (:func:`._ffi.catch_up_adam_apply`, :func:`._ffi.catch_up_adam_rows`) on a
    sparse leaf and its ``state`` (with AdamW's decay mark fourth), with what it reads per key (:func:`_by_key`)
    and of the step (:func:`_kernel_operands`): ``(keyed, results)``, the results without the decay mark (``None``)
    where there is no ``adamw``."""
    keys = leaf.keys[:, 0]
    keyed = _by_key(plan, replayer, state, keys, done, decay)
    # The record's coefficients as they are: reshaping AdamW's (variants, steps, terms) made XLA copy them.
    far = keyed.far if keyed.record is None else keyed.record.coefficients
    logs = (adamw.new_log, adamw.old_log) if adamw is not None else (0.0, 0.0)
    ops = _kernel_operands(plan, replayer, done, keyed.decay, keyed.weights, far, logs)
    mark = state[3] if adamw is not None else None
    results = kernel(
        p,
        *state[:3],
        mark,
        keys,
        leaf.values,
        scalars,
        ops,
        count,
        done,
        far_steps=None if keyed.record is None else keyed.record.last_steps,
        cap=plan.cap,
        decay=keyed.decay is not None,
        far_by_key=keyed.far is not None,
        far_offset=keyed.record_offset,
        decay_from_marks=keyed.decay is not None and keyed.decay.scheduled,
        **kernel_flags(replayer.hp, leaf),
    )
    return keyed, tuple(r for r in results if r is not None)


def _flagged_rule(
    replayer: Replayer, done: jax.Array, count: jax.Array, lr: jax.Array, adamw: AdamWLeaf | None
) -> tuple[Rule, str]:
    """The XLA rule that takes the rows a catch-up Adam kernel flagged (AdamW's with ``adamw``), with its name for
    errors."""
    if adamw is None:
        return _rule(replayer, done, count, lr), _WHERE
    return adamw.rule(replayer, done, count, lr), _WHERE_ADAMW


class _ByKey(NamedTuple):
    """What the catch-up Adam kernels take per key where they have no table for it (:func:`_by_key`)."""

    decay: Decay | None  # AdamW's decay
    weights: _DecayWeights | None  # its products over the window
    far: jax.Array | None  # (k, 8): the long-idle coefficients per key, where the plan has no table nor the record
    record: IdleRecord | None = None  # the state's record, which the kernels read (where the plan has no table)
    record_offset: int = 0  # its variant's first row in its coefficients, taken as rows of terms


def _by_key(
    plan: _SeriesPlan,
    replayer: Replayer,
    state: tuple[jax.Array, ...],
    keys: jax.Array,
    done: jax.Array,
    decay: Decay | None,
) -> _ByKey:
    """The kernels read each touched row's record and compute its idle steps, the moments' decays (from tables of
    b1's and b2's powers) and AdamW's decay (from gamma's table, and the window's products; under a schedule, a
    long-idle row's from its decay mark and the state's log), as the XLA path does per row, and pick its series
    coefficients from the window or the long-idle table (:func:`_coefficients`). Computed here per key (``keys``,
    the leaf's entries; ``state`` with the last steps third), only the long-idle coefficients that neither a table
    nor the state's record holds (a state that keeps no record, with a schedule or bias corrections that take too
    long to reach 1). The kernels read the long-idle coefficients from the state's record themselves where it keeps
    one (:func:`_record_read`), and flag the rows whose entry it does not hold, which the XLA rule takes."""
    record = _record_read(plan, replayer)
    offset = _record_offset(record, replayer)
    far_by_key = record is None and plan.cap > 0 and plan.table is None
    weights = None if decay is None else _DecayWeights(decay, replayer.lr, None, done, plan.cap)
    far = None
    if far_by_key:
        last_k = of_keys(state[2], keys)
        # with decay a row decays through its idle steps from step 0 on, moved or not
        idle = (done - last_k if decay is not None else jnp.where(last_k > 0, done - last_k, 0)).astype(jnp.int32)
        far, _ = _far(plan, replayer.lr, last_k, idle > plan.cap, weights, replayer.record, replayer.variant)
    return _ByKey(decay, weights, far, record, offset)


def _record_read(plan: _SeriesPlan, replayer: Replayer) -> IdleRecord | None:
    """The state's record of long-idle coefficients where the kernels read it (the plan has no table of them, and
    the state keeps one): each long-idle row's entry, where it is for the row's last step; a row whose entry it is
    not (idle longer than the record reaches, or a state whose steps did not write it) is flagged, and the XLA rule
    computes its coefficients (:func:`_far`). Read by key here, the record cost a gather a key of the last step,
    and another of the entry and its tag: about 85 microseconds of a step at 8,192 Zipf ids."""
    record = replayer.record
    return record if plan.cap > 0 and plan.table is None and _kept(record) else None


def _record_offset(record: IdleRecord | None, replayer: Replayer) -> int:
    """The row where the replayer's variant of the record starts in the kernels' flat view of its coefficients
    (:func:`_record_read`; AdamW's record holds its variants without and with the decay one after the other); 0
    without a record."""
    return 0 if record is None else (replayer.variant or 0) * record.last_steps.shape[0]


def _may_flag(plan: _SeriesPlan, replayer: Replayer, decay: Decay | None) -> bool:
    """Whether the kernels can flag a row, that is leave its idle steps to the XLA rule: catch_up_adam.cc's
    ``IdleSteps::CanStep`` fails only without a table of bias corrections, or for a row idle longer than the
    window under a schedule (``long_neg_lr`` NaN) or, with AdamW's decay, without a table of ``gamma``'s powers
    (a rate or decay not known when the step is traced: ``inject_hyperparams``, arrays); and where the kernels
    read the state's record (:func:`_record_read`), a long-idle row whose entry it does not hold is flagged. Where
    none of these can happen, the step holds no XLA fallback for flagged rows (most of AdamW's catch-up
    program)."""
    no_gamma = decay is not None and decay.scheduled
    reads_record = _record_read(plan, replayer) is not None  # flags rows whose entry the record does not hold
    return plan.corrections is None or callable(replayer.learning_rate) or no_gamma or reads_record


def of_keys(record: jax.Array, keys: jax.Array) -> jax.Array:
    """Each key's entry of a per-row ``record`` (the last steps, AdamW's decay marks; 0 for padding keys), for a
    fused step."""
    rows = record.shape[0]
    return jnp.where((keys >= 0) & (keys < rows), record[jnp.clip(keys, 0, rows - 1)], 0)


class CatchUpFusion(NamedTuple):
    """What :func:`update_and_apply` needs of a ``sparse_adam(catch_up=True)`` to run its step in one pass per row."""

    replayer: Replayer

    def fusable(self) -> bool:
        """Whether float32 tables take the kernel: the closed form applies (see :func:`_series_plan`)."""
        return _series_plan(self.replayer, jnp.float32) is not None


def catch_up_adam(
    learning_rate: optax.ScalarOrSchedule, hp: AdamHyperparams, mu_dtype: Any
) -> optax.GradientTransformationExtraArgs:
    """Lazy Adam whose touched rows first replay their idle steps (``sparse_adam(..., catch_up=True)``)."""
    replayer = Replayer(learning_rate, hp)
    plan = _series_plan(replayer, jnp.float32)  # the record's, as the float32 tables' (the kernels') plan

    def init_fn(params: optax.Params) -> CatchUpAdamState:
        check_params(params, _WHERE)
        return CatchUpAdamState(
            count=jnp.zeros([], jnp.int32),
            mu=optax.tree.zeros_like(params, dtype=mu_dtype),
            nu=optax.tree.zeros_like(params),
            last_step=jax.tree.map(lambda p: row_full(p, 0, jnp.int32), params),
            idle_record=idle_record((plan,), learning_rate),
        )

    def update_fn(
        updates: optax.Updates, state: CatchUpAdamState, params: optax.Params | None = None, **extra_args: Any
    ) -> tuple[optax.Updates, CatchUpAdamState]:
        del extra_args
        check_state(state, CatchUpAdamState, _WHERE)
        if params is None:
            raise ValueError(f"{_WHERE}: catching up moves the parameters: call update(grads, state, params)")
        count = optax.safe_increment(state.count)
        lr = replayer.lr(state.count)
        # The record this step reads is the one it writes: the row it adds (for the last step done - K) no row of
        # this step reads, and XLA updates a donated record in place, where reading the old one cost two copies.
        record = record_step(state.idle_record, plan, replayer.lr, state.count)
        reading = replayer.reading(record)
        trees = [
            (state.mu, "optimizer state's mu"),
            (state.nu, "optimizer state's nu"),
            (state.last_step, "optimizer state's last_step"),
            (params, "parameters"),
        ]

        def plain(path: Any, g: Any, m: Any, v: Any, last: Any, p: Any) -> tuple[Any, Any, Any]:
            if g is None or is_sparse(g):
                return None, None, None
            return check_dense_gradient(path, g, jnp.shape(p), _WHERE), m, v

        plain_g, plain_m, plain_v = map_rule(plain, updates, trees, _WHERE, 3)
        dense = _dense_adam(plain_g, plain_m, plain_v, state.count, hp)  # as optax.adam

        rule = _rule(reading, state.count, count, lr)
        kernel = _rows_kernel(reading, state.count, count, lr)

        def leaf(path: Any, g: Any, m: Any, v: Any, last: Any, p: Any, du: Any, dm: Any, dv: Any) -> Any:
            if g is None:
                return None, m, v, last
            if not is_sparse(g):
                return _scaled(du, lr), dm, dv, jnp.full_like(last, count)
            out, (m, v, last) = apply_rule(
                path, g, jnp.shape(p), (m, v, last), (p,), rule, _WHERE, whole_rows=True, kernel=kernel
            )
            return out, m, v, last

        trees += [(tree, "dense step") for tree in dense]
        out, mu, nu, last_step = map_rule(leaf, updates, trees, _WHERE, 4)
        return out, CatchUpAdamState(count=count, mu=mu, nu=nu, last_step=last_step, idle_record=record)

    def replay_rows(p: jax.Array, moments: tuple[jax.Array, ...], last: jax.Array, state: Any, info: Any) -> Any:
        m, v = moments
        p, m, v = replay_table(p, m, v, last, state.count, replayer.reading(state.idle_record))
        return p, (m, v)

    rows = RowReplay(CatchUpAdamState, ("mu", "nu"), replay_rows)
    return optax.GradientTransformationExtraArgs(init_fn, CatchUpUpdate(update_fn, CatchUpFusion(replayer), rows=rows))


@dataclasses.dataclass(frozen=True, eq=False)
class RowReplay:
    """What :func:`catch_up` and caught-up lookups need of a catch-up optimizer.

    Attributes:
      state_type: Its state's type: a NamedTuple with ``count``, ``last_step`` and the per-element ``moments``.
      moments: The names of the state's per-element (or per-row) fields, in the order ``replay`` takes them.
      replay: ``replay(p, moments, last, state, info) -> (p, moments)``: rows last moved at step ``last`` (per
        row) brought up to the state's step, as the optimizer's update replays them; ``info`` is the leaf's entry
        of ``infos(params)``.
      infos: What ``replay`` needs to know of each parameter leaf (AdamW: whether its mask decays it), from the
        parameters; ``None`` for every leaf by default.
      fresh_rows_move: Whether a row that never moved changes over idle steps (AdamW's decay), so that
        :func:`catch_up` marks it up to date too.
      per_row: The ``moments`` that hold one value a row (shape ``p.shape[:1]``, as ``last_step``); the others
        hold one a parameter element.
    """

    state_type: type
    moments: tuple[str, ...]
    replay: Callable[[jax.Array, tuple[jax.Array, ...], jax.Array, Any, Any], Any]
    infos: Callable[[Any], list[Any]] | None = None
    fresh_rows_move: bool = False
    per_row: tuple[str, ...] = ()

    def leaf_infos(self, params: Any) -> list[Any]:
        """``infos(params)``, or ``None`` for each leaf."""
        if self.infos is None:
            return [None] * len(jax.tree.leaves(params, is_leaf=is_leaf))
        return self.infos(params)

    def check_shapes(self, where: str, path: Any, shape: tuple[int, ...], last: Any, moments: tuple[Any, ...]) -> None:
        """That a parameter's ``last_step`` and ``moments`` have the shapes ``init`` gives them, before a replay
        reads them by its rows (a state built for a table of other rows was read out of place, or failed in JAX)."""
        for name, x in zip(("last_step", *self.moments), (last, *moments), strict=True):
            want = row_shape(shape) if name == "last_step" or name in self.per_row else tuple(shape)
            if tuple(jnp.shape(x)) != want:
                raise param_error(
                    ValueError,
                    where,
                    path,
                    f"shape {tuple(shape)} but its optimizer state's {name} has shape {tuple(jnp.shape(x))}, not "
                    f"{want}: the state was built for other parameters; pass the state `tx.init(params)` built",
                )


@dataclasses.dataclass(frozen=True, eq=False)
class CatchUpUpdate(FusableUpdate):
    """A catch-up optimizer's ``update``, carrying what lookups and :func:`catch_up` need (``rows``) and how
    :func:`update_and_apply` fuses it (``fusion``, ``None`` where it does not)."""

    rows: RowReplay = dataclasses.field(kw_only=True)


def find(tx: Any, state: Any, where: str, params_structure: Any) -> tuple[RowReplay, Any]:
    """How ``tx`` (an optimizer built with ``catch_up=True``) replays rows, and its state inside ``state``, checked
    to have been built for parameters of ``params_structure``."""
    update = getattr(tx, "update", None)
    if not isinstance(update, CatchUpUpdate):
        raise TypeError(
            f"{where}: the optimizer must be one built with catch_up=True (osa.sparse_adam, sparse_adamw, "
            f"sparse_amsgrad or sparse_sgd with momentum) itself, not wrapped or chained further; got "
            f"{type(tx).__name__} (sparse_sgd without momentum moves no row a step does not touch: it has nothing "
            "to catch up, and takes no catch_up here)"
        )
    kind = update.rows.state_type
    found = [x for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, kind)) if isinstance(x, kind)]
    if len(found) != 1:
        raise ValueError(f"{where}: the optimizer state must hold one {kind.__name__}, it holds {len(found)}")
    first = update.rows.moments[0]
    structure = jax.tree.structure(getattr(found[0], first), is_leaf=_is_leaf_or_masked)
    table_paths = leaf_paths(params_structure)
    if structure != params_structure and leaf_paths(structure) != table_paths:
        raise ValueError(
            f"{where}: the optimizer state's {first} has structure {structure} but the parameters "
            f"have {params_structure}; pass the parameters and the state built for them"
        )
    return update.rows, _plain_scalars(found[0], table_paths)


def _plain_scalars(state: Any, table_paths: list[tuple[Any, ...]]) -> Any:
    """``state`` (a catch-up state) with the arrays of its fields other than the tables' (the count, the decay's
    log, the idle record) as arrays: an ``nnx.Optimizer``'s state holds each in an ``OptVariable``, which the
    replay's arithmetic does not take. The tables' fields are read by their leaves (:func:`state_leaves`)."""

    def plain(x: Any) -> Any:
        if isinstance(x, tuple) and hasattr(x, "_fields"):
            return type(x)(*(plain(y) for y in x))
        structure: Any  # jax's PyTreeDef, whose methods type checkers do not see
        leaves, structure = jax.tree.flatten(x)
        held = len(leaves) == 1 and structure.num_nodes == 2 and not isinstance(x, dict | list | tuple)
        return leaves[0] if held else x  # a variable holding one array

    fields = {}
    for name in state._fields:
        x = getattr(state, name)
        structure: Any = jax.tree.structure(x, is_leaf=_is_leaf_or_masked)
        tables = structure.num_leaves == len(table_paths) and leaf_paths(structure) == table_paths
        fields[name] = x if tables else plain(x)
    return state._replace(**fields)


def _is_leaf_or_masked(x: Any) -> bool:
    """A leaf, or where a partition (``partition_tables``, ``optax.multi_transform``) gave the leaf to another
    optimizer, the ``optax.MaskedNode`` that holds its place in this one's state."""
    return is_leaf(x) or isinstance(x, optax.MaskedNode)


def state_leaves(tree: Any) -> list[Any]:
    """The leaves of a state field, with a ``MaskedNode`` for each parameter another optimizer owns."""
    return jax.tree.leaves(tree, is_leaf=_is_leaf_or_masked)


def _replace(state: Any, new: Any) -> Any:
    """``state`` with its one state of ``new``'s type replaced by ``new``."""
    kind = type(new)
    return jax.tree.map(lambda x: new if isinstance(x, kind) else x, state, is_leaf=lambda x: isinstance(x, kind))


def catch_up(
    tx: optax.GradientTransformation, params: optax.Params, opt_state: optax.OptState
) -> tuple[optax.Params, optax.OptState]:
    r"""Brings every row of every parameter up to the current step of a catch-up optimizer.

    ``sparse_adam(..., catch_up=True)`` lets a row sit out the steps in which
    no gradient touches it, and replays them when one does next (or when a
    lookup with ``catch_up`` reads it). This replays them for every row now,
    so that the parameters and moments are those of dense :func:`optax.adam`
    fed the same gradients (zeros elsewhere): call it before evaluating on
    rows the training did not touch lately, exporting, or a final checkpoint.
    It costs O(table) per parameter: call it rarely. Called on arrays, it
    compiles one program for the optimizer and the shapes, which the next such
    call reuses (jit it yourself to donate the arrays). On the CPU's native
    kernels, Adam's and AdamW's float32 tables are replayed in place (donated,
    they take no table-sized temporary, only a few integers a row; the rows
    the kernel leaves to the XLA path, under a schedule those idle past the
    state's record, take it a few thousand rows at a time); elsewhere (the XLA
    path, a GPU's or TPU's, and a learning rate given as an array) it replays
    them a block of rows at a time (about 16 MiB of the rows of the table and
    its state), each block written in place, so that its temporaries are a few
    blocks' size, not the table's. A table split over devices by rows on an
    ``Explicit`` mesh is replayed on each device's rows (inside
    ``shard_map``). On an ``Auto`` mesh each device takes its own rows where
    the number of parts is a power of two that divides the rows (and is at
    most a block's rows); split otherwise, each block is gathered from every
    device: call ``catch_up`` inside ``shard_map`` on each device's rows.
    AMSGrad's and momentum SGD's tables are replayed whole, with temporaries
    of one or two tables' size (on the XLA path, several). Training can go on
    from the state it returns.

    Args:
      tx: An optimizer built with ``catch_up=True``: :func:`sparse_adam`,
        :func:`sparse_adamw`, :func:`sparse_amsgrad`, or :func:`sparse_sgd`
        with momentum.
      params: The parameters.
      opt_state: ``tx``'s state.

    Returns:
      ``(params, opt_state)`` with every row up to date.

    Examples:
      >>> import jax.numpy as jnp
      >>> import optax_sparse_adam as osa
      >>> tx = osa.sparse_adam(0.1, catch_up=True)
      >>> params = jnp.zeros((2, 1), jnp.float32)
      >>> state = tx.init(params)
      >>> g = osa.IndexedRows(jnp.array([0]), jnp.ones((1, 1), jnp.float32), 2)
      >>> for _ in range(2):  # row 0 moves at step 1 only, then sits out step 2
      ...     params, state = osa.update_and_apply(tx, g, state, params)
      ...     g = osa.IndexedRows(jnp.array([1]), jnp.zeros((1, 1), jnp.float32), 2)
      >>> params[:, 0].round(4)
      Array([-0.1,  0. ], dtype=float32)
      >>> params, state = osa.catch_up(tx, params, state)
      >>> params[:, 0].round(4)  # as optax.adam: step 2 moves row 0 by 0.1 * (0.09 / 0.19) / sqrt(0.000999 / 0.001999)
      Array([-0.167,  0.   ], dtype=float32)
    """
    # Called on arrays: one compiled program, kept for the next call (run op by op, the replay's loops and
    # conditionals, built anew on each call, compiled again every time).
    return _catch_up_on_arrays(tx, params, opt_state, like=(0, 1))


def _catch_up(
    tx: optax.GradientTransformation, params: optax.Params, opt_state: optax.OptState
) -> tuple[optax.Params, optax.OptState]:
    structure: Any  # jax's PyTreeDef, which type checkers do not see
    path_leaves, structure = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_leaf)
    rows, state = find(tx, opt_state, "catch_up", structure)
    names = rows.moments

    def leaf(path: Any, p: Any, info: Any, last: Any, *moments: Any) -> tuple[Any, ...]:
        if isinstance(last, optax.MaskedNode):  # a parameter another optimizer of a partition owns
            return p, last, *moments
        rows.check_shapes("catch_up", path, jnp.shape(p), last, moments)
        p, moments = _replay_on_each_device(rows, jnp.asarray(p), moments, last, state, info)
        return p, jnp.where((last > 0) | rows.fresh_rows_move, state.count, last), *moments

    flat = [state_leaves(getattr(state, name)) for name in ("last_step", *names)]
    infos = rows.leaf_infos(params)
    outs = [leaf(path, p, info, *xs) for (path, p), info, *xs in zip(path_leaves, infos, *flat, strict=True)]
    new_params, last, *moments = (structure.unflatten([o[i] for o in outs]) for i in range(2 + len(names)))
    new = state._replace(last_step=last, **dict(zip(names, moments, strict=True)))
    return new_params, _replace(opt_state, new)


_catch_up_on_arrays = compiled_on_arrays(_catch_up, "catch_up")


def _replay_on_each_device(
    rows: RowReplay, p: jax.Array, moments: tuple[Any, ...], last: jax.Array, state: Any, info: Any
) -> tuple[jax.Array, tuple[Any, ...]]:
    """``rows.replay`` of a table; where it is split over an ``Explicit`` mesh's axis by rows, on each device's rows
    inside ``shard_map`` (a row's replay reads only its own row and the state's counters and records, which every
    device holds): the replay's reads of tables of coefficients by row would otherwise need their result's
    sharding spelled out, gather by gather."""
    sharding = explicit_sharding(p)
    specs = [jax.typeof(x).sharding.spec for x in (p, *moments, last)] if sharding is not None else []
    # The moments split as the table is (padded to its rank), the rows' last steps as its rows.
    padded = [(*spec, *[None] * (p.ndim - len(spec))) for spec in specs[:-1]]
    if sharding is None or p.ndim == 0 or padded.count(padded[0]) != len(padded) or specs[-1][:1] != specs[0][:1]:
        return rows.replay(p, moments, last, state, info)
    # The state without its tables (a replay reads its count and records), whole on every device.
    shared = state._replace(last_step=None, **dict.fromkeys(rows.moments))
    whole = jax.sharding.PartitionSpec()

    def replay(p: jax.Array, moments: tuple[Any, ...], last: jax.Array, shared: Any) -> Any:
        return rows.replay(p, moments, last, shared, info)

    p_spec, *moment_specs, last_spec = specs
    return jax.shard_map(
        replay,
        mesh=sharding.mesh,
        in_specs=(p_spec, tuple(moment_specs), last_spec, jax.tree.map(lambda _: whole, shared)),
        out_specs=(p_spec, tuple(moment_specs)),
    )(p, moments, last, shared)


class CatchUpAdamWState(NamedTuple):
    """State of ``sparse_adamw(..., catch_up=True)``.

    Attributes:
      count: Global step count, an int32 scalar.
      mu: First moments, as :class:`optax.ScaleByAdamState`'s.
      nu: Second moments, as :class:`optax.ScaleByAdamState`'s.
      last_step: Per row (shape ``p.shape[:1]``, int32): the step through which the row is up to date, 0 for a row
        that never moved.
      log_decay: The sum over the steps taken of ``log(1 - lr_t * weight_decay)``, a float32 pair (the sum and
        its compensation, summed as Kahan's algorithm does).
      decay_mark: Per row (shape ``p.shape[:1]``, float32): ``log_decay`` when the row was last up to date. The
        difference is the log of the decay over the row's idle steps, which a learning-rate schedule leaves with no
        closed form.
      idle_record: Under a learning-rate schedule, the coefficients of the idle steps of rows idle longer than the
        window, by their last step, for the last 65,536 last steps: for the parameters the decay leaves out and,
        where the weight decay can be nonzero, for those it decays (an :class:`IdleRecord`: 4.25 MiB, one for all
        the parameters); a single entry for no step where a table holds them (a constant learning rate).
    """

    count: jax.Array  # type: ignore[assignment]  # Adam's field name, as in optax's states
    mu: optax.Updates
    nu: optax.Updates
    last_step: optax.Updates
    log_decay: jax.Array
    decay_mark: optax.Updates
    idle_record: IdleRecord


@dataclasses.dataclass(frozen=True)
class AdamWDecay:
    """``sparse_adamw(catch_up=True)``'s decay: the rate, ``log(1 - lr * weight_decay)`` in double where both are
    numbers (else ``None``: the idle steps' decay past the window is read from the state's record), and whether
    the rate can be nonzero."""

    weight_decay: Any
    log_gamma: float | None
    decaying: bool

    def decays(self, flag: bool) -> bool:
        """Whether a leaf whose mask entry is ``flag`` decays."""
        return bool(flag) and self.decaying

    def of(self, flag: bool, far_log: jax.Array | None) -> Decay | None:
        """The :class:`Decay` of a leaf whose mask entry is ``flag`` (``None`` for a leaf that does not decay),
        ``far_log`` the log of the decay over each row's idle steps from the state's record."""
        if not self.decays(flag):
            return None
        return Decay(self.weight_decay, self.log_gamma, None if self.log_gamma is not None else far_log)

    def variant(self, flag: bool) -> int:
        """The variant of the state's record of long-idle coefficients a leaf whose mask entry is ``flag`` reads:
        that with the decay (1) where the leaf decays, else that without (0)."""
        return 1 if self.decays(flag) else 0


@dataclasses.dataclass(frozen=True)
class AdamWLeaf:
    """What a step of ``sparse_adamw(catch_up=True)`` needs on one leaf beyond Adam's: the decay, the leaf's mask
    entry, and the state's record of ``log(1 - lr_t * weight_decay)`` before (``old_log``) and after this step."""

    decay: AdamWDecay
    flag: bool
    old_log: jax.Array
    new_log: jax.Array

    def rule(self, replayer: Replayer, done: jax.Array, count: jax.Array, lr: jax.Array) -> Rule:
        """The sparse leaf rule of step ``count`` on ``(mu, nu, last_step, decay_mark)``: the touched rows replay
        their idle steps up to ``done``, decay included, then take AdamW's step; the update takes a replayed row
        to where dense AdamW's steps took it."""
        hp, weight_decay = replayer.hp, self.decay.weight_decay
        decays = self.decay.decays(self.flag)

        def rule(g: jax.Array, st: tuple[jax.Array, ...], reads: tuple[jax.Array, ...]) -> Any:
            (m0, v0, last, mark), (p0,) = st, reads
            p, m, v = replay(p0, m0, v0, last, done, replayer, self.decay.of(self.flag, self.old_log - mark))
            m, v = _moments(g, m, v, hp)
            u = _step(m, v, count, hp)
            if decays:  # as optax.add_decayed_weights, on the caught-up row
                u = u + jnp.asarray(weight_decay, u.dtype) * p.astype(u.dtype)
            step = _scaled(u, lr)
            idle = done - last if decays else jnp.where(last > 0, done - last, 0)
            moved = broadcast_rows(idle > 0, p0.ndim)
            new_mark = jnp.minimum(mark, self.new_log)  # the record only falls: see stamp
            return caught_up_update(p0, p, step, moved), (m, v, stamp(last, count), new_mark)

        return rule


class CatchUpAdamWFusion(NamedTuple):
    """What :func:`update_and_apply` needs of a ``sparse_adamw(catch_up=True)`` to run its step in one pass per
    row: the catch-up kernel with AdamW's decay (:func:`fused_apply` with an :class:`AdamWLeaf`)."""

    replayer: Replayer
    decay: AdamWDecay
    mask: Any

    def fusable(self) -> bool:
        """Whether float32 tables take the kernel: the closed form applies (see :func:`_series_plan`)."""
        return _series_plan(self.replayer, jnp.float32) is not None

    def flags(self, params: Any) -> Any:
        """Whether each parameter decays: the mask as a tree of bools."""
        return mask_tree(True if self.mask is None else self.mask, params, "mask", _WHERE_ADAMW)

    def apply(
        self,
        p: jax.Array,
        state: tuple[jax.Array, ...],
        leaf: SparseLeaf,
        flag: bool,
        scalars: jax.Array,
        done: jax.Array,
        count: jax.Array,
        old_log: jax.Array,
        new_log: jax.Array,
        idle_record: IdleRecord,
        clip: Clipped | None = None,
    ) -> tuple[jax.Array, ...]:
        """The fused step on one leaf: ``(p, mu, nu, last_step, decay_mark)``. ``scalars`` are the AdamW kernel's
        (the weight decay the eleventh), dropped to Adam's ten for a leaf that does not decay; ``idle_record``, the
        state's."""
        adamw = AdamWLeaf(self.decay, bool(flag), old_log, new_log)
        if not self.decay.decays(flag):
            scalars = scalars[:10]
        return fused_apply(self.replayer, p, state, leaf, scalars, done, count, idle_record, clip, adamw)


def catch_up_adamw(
    learning_rate: optax.ScalarOrSchedule, hp: AdamHyperparams, mu_dtype: Any, weight_decay: Any, mask: Any
) -> optax.GradientTransformationExtraArgs:
    """AdamW whose touched rows first replay their idle steps, decay included (``sparse_adamw(catch_up=True)``).
    Under ``inject_hyperparams`` (a traced learning rate or weight decay) the idle steps' decay is read from the
    state's record, and their learning rate is the current one, as for ``sparse_adam``."""
    where = _WHERE_ADAMW
    replayer = Replayer(learning_rate, hp)
    lr_const, wd_const = _concrete(learning_rate), _concrete(weight_decay)
    log_gamma = None if lr_const is None or wd_const is None else math.log1p(-lr_const * wd_const)
    adamw = AdamWDecay(weight_decay, log_gamma, wd_const is None or wd_const != 0.0)
    fusion = CatchUpAdamWFusion(replayer, adamw, mask)
    # The record's plans, as the float32 tables' (the kernels'): without the decay, and with it where it can be
    # nonzero.
    decay = Decay(weight_decay, log_gamma) if adamw.decaying else None
    plans: tuple[_SeriesPlan | None, ...] = (_series_plan(replayer, jnp.float32),)
    if decay is not None:
        plans += (_series_plan(replayer, jnp.float32, decay=decay),)

    def flags_of(params: Any) -> list[bool]:
        return [bool(f) for f in jax.tree.leaves(fusion.flags(params), is_leaf=is_leaf)]

    def init_fn(params: optax.Params) -> CatchUpAdamWState:
        check_params(params, where)
        flags_of(params)  # checks the mask against the parameters
        per_row = jax.tree.map(lambda p: row_full(p, 0, jnp.float32), params)
        return CatchUpAdamWState(
            count=jnp.zeros([], jnp.int32),
            mu=optax.tree.zeros_like(params, dtype=mu_dtype),
            nu=optax.tree.zeros_like(params),
            last_step=jax.tree.map(lambda p: row_full(p, 0, jnp.int32), params),
            log_decay=jnp.zeros(2, jnp.float32),
            decay_mark=per_row,
            idle_record=idle_record(plans, learning_rate, len(plans)),
        )

    def replay_rows(p: jax.Array, moments: tuple[jax.Array, ...], last: jax.Array, state: Any, flag: bool) -> Any:
        m, v, mark = moments
        decay = adamw.of(flag, state.log_decay[0] - mark)
        reading = replayer.reading(state.idle_record, adamw.variant(flag))
        p, m, v = replay_table(p, m, v, last, state.count, reading, decay, mark, state.log_decay[0])
        return p, (m, v, jnp.full_like(mark, state.log_decay[0]))

    def update_fn(
        updates: optax.Updates, state: CatchUpAdamWState, params: optax.Params | None = None, **extra_args: Any
    ) -> tuple[optax.Updates, CatchUpAdamWState]:
        del extra_args
        check_state(state, CatchUpAdamWState, where)
        if params is None:
            raise ValueError(f"{where}: catching up needs the parameters: call update(grads, state, params)")
        done, count = state.count, optax.safe_increment(state.count)
        lr = replayer.lr(done)
        record = state.idle_record  # read as written (see catch_up_adam)
        for i, (plan, d) in enumerate(zip(plans, (None, decay), strict=False)):
            record = record_step(record, plan, replayer.lr, done, d, variant=i)
        # Kahan's sum of log(1 - lr_t wd): the record a schedule's idle steps are decayed from.
        term = jnp.log1p(-jnp.asarray(lr, jnp.float32) * jnp.asarray(weight_decay, jnp.float32)) - state.log_decay[1]
        total = state.log_decay[0] + term
        log_decay = jnp.stack([total, (total - state.log_decay[0]) - term])
        flags = flags_of(params)
        trees = [
            (state.mu, "optimizer state's mu"),
            (state.nu, "optimizer state's nu"),
            (state.last_step, "optimizer state's last_step"),
            (state.decay_mark, "optimizer state's decay_mark"),
            (params, "parameters"),
        ]

        def plain(path: Any, g: Any, m: Any, v: Any, last: Any, mark: Any, p: Any) -> tuple[Any, Any, Any]:
            if g is None or is_sparse(g):
                return None, None, None
            return check_dense_gradient(path, g, jnp.shape(p), where), m, v

        plain_g, plain_m, plain_v = map_rule(plain, updates, trees, where, 3)
        dense = _dense_adam(plain_g, plain_m, plain_v, done, hp)  # as optax.adamw's scale_by_adam

        def leaf(path: Any, g: Any, m: Any, v: Any, last: Any, mark: Any, p: Any, *rest: Any) -> Any:
            *dense_out, flag = rest
            du, dm, dv = dense_out
            if g is None:
                return None, m, v, last, mark
            if not is_sparse(g):
                u = du + weight_decay * p if adamw.decays(flag) else du  # as optax.adamw
                return _scaled(u, lr), dm, dv, jnp.full_like(last, count), jnp.full_like(mark, log_decay[0])
            leaf_decay = AdamWLeaf(adamw, flag, state.log_decay[0], log_decay[0])
            reading = replayer.reading(record, adamw.variant(flag))
            rule = leaf_decay.rule(reading, done, count, lr)
            kernel = _rows_kernel(reading, done, count, lr, leaf_decay)
            out, new = apply_rule(
                path, g, jnp.shape(p), (m, v, last, mark), (p,), rule, where, whole_rows=True, kernel=kernel
            )
            return (out, *new)

        flag_tree = jax.tree.unflatten(jax.tree.structure(params, is_leaf=is_leaf), flags)
        trees += [(tree, "dense step") for tree in dense] + [(flag_tree, "mask")]
        out, mu, nu, last_step, decay_mark = map_rule(leaf, updates, trees, where, 5)
        return out, CatchUpAdamWState(count, mu, nu, last_step, log_decay, decay_mark, record)

    rows = RowReplay(
        CatchUpAdamWState, ("mu", "nu", "decay_mark"), replay_rows, flags_of, adamw.decaying, per_row=("decay_mark",)
    )
    return optax.GradientTransformationExtraArgs(init_fn, CatchUpUpdate(update_fn, fusion, rows=rows))
