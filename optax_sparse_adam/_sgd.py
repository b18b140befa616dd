"""Lazy SGD with momentum, and its exact catch-up: :func:`sparse_sgd`.

Plain SGD is lazy already: a zero gradient does not move a row. With
momentum (:func:`optax.trace`) dense SGD keeps moving a row after its last
gradient, ``m <- momentum * m`` and ``p <- p - lr_k m`` each step; lazy
momentum (TensorFlow's ``SparseApplyMomentum``) updates the trace of the
touched rows only. With ``catch_up=True`` a row that returns after ``s`` idle
steps first takes the idle steps' movement, a sum over the steps of the
learning rate times a power of the momentum, which has a closed form for a
constant learning rate; under a schedule it is catch-up Adam's series with
one term, read from a window of the last steps or from the state's record
by last step.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_sparse_adam import _ffi, _kernel_path
from optax_sparse_adam._catch_up import (
    CatchUpUpdate,
    IdleRecord,
    RowReplay,
    _base_table,
    _coefficients,
    _concrete,
    _kept,
    _power,
    _SeriesPlan,
    _window,
    caught_up_update,
    flagged_steps,
    flagged_updates,
    idle_record,
    of_keys,
    rate_at,
    record_step,
    scalar_as_one_row,
)
from optax_sparse_adam._checks import (
    check_bool,
    check_dtype,
    check_hparam,
    check_learning_rate,
    check_params,
    check_state,
)
from optax_sparse_adam._fusion import Clipped, compiled_when_eager
from optax_sparse_adam._learning_rate import stage, with_learning_rate
from optax_sparse_adam._row_engine import (
    Arrays,
    Kernel,
    Rule,
    apply_rule,
    at_count,
    elementwise_kernel,
    map_rule,
    row_full,
    scaled_rule,
    stamp,
    step_factor,
)
from optax_sparse_adam._sparse_aware import sparse_aware
from optax_sparse_adam._sparse_leaf import SparseLeaf
from optax_sparse_adam._tree import broadcast_rows, param_error

__all__ = ["CatchUpSgdState", "sparse_sgd"]

_WHERE = "sparse_sgd"
_CATCH_UP_WHERE = f"{_WHERE}(catch_up=True)"


class CatchUpSgdState(NamedTuple):
    """State of ``sparse_sgd(..., momentum, catch_up=True)``.

    Attributes:
      count: Global step count, an int32 scalar (the learning-rate schedule's step).
      trace: The momentum, as :class:`optax.TraceState`'s ``trace``.
      last_step: Per row (shape ``p.shape[:1]``, int32): the step (the value of
        ``count`` after it) through which the row is up to date, 0 for a row
        that never moved.
      idle_record: Under a learning-rate schedule, the idle steps' sum of rows
        idle longer than the window (``K`` steps, 180 for a momentum of 0.9:
        see :func:`sparse_sgd`), by their last step, for the
        last 65,536 last steps (an :class:`IdleRecord`: 0.5 MiB, one for all
        the parameters); a single entry for no step at a constant learning
        rate (a closed form gives the sum) or a momentum not known when the
        step is traced.
    """

    count: jax.Array  # type: ignore[assignment]  # Adam's field name, as in optax's states
    trace: optax.Updates
    last_step: optax.Updates
    idle_record: IdleRecord


def _trace_rule(momentum: Any, nesterov: bool) -> Rule:
    """:func:`optax.trace`'s step on the touched rows: ``(update, (trace,))``, in optax's expressions."""

    def rule(g: jax.Array, st: tuple[jax.Array, ...], reads: tuple[jax.Array, ...]) -> Any:
        (t,) = st
        t = g + momentum * t
        return (g + momentum * t if nesterov else t), (t,)

    return rule


class MomentumFusion(NamedTuple):
    """What :func:`update_and_apply` needs of a lazy ``sparse_sgd(..., momentum)`` to run its step in one pass per
    row."""

    learning_rate: optax.ScalarOrSchedule
    momentum: Any
    nesterov: bool


def _lazy_trace(momentum: Any, nesterov: bool, accumulator_dtype: Any) -> optax.GradientTransformationExtraArgs:
    """:func:`optax.trace` on the touched rows only; untouched rows keep their trace and get no update."""
    where = "sparse_sgd(momentum)"

    def init_fn(params: optax.Params) -> optax.TraceState:
        check_params(params, where)
        return optax.TraceState(trace=optax.tree.zeros_like(params, dtype=accumulator_dtype))

    def update(
        updates: optax.Updates, state: optax.TraceState, params: optax.Params | None, scale: Any
    ) -> tuple[optax.Updates, optax.TraceState]:
        check_state(state, optax.TraceState, where)
        rule = scaled_rule(_trace_rule(momentum, nesterov), scale)
        # The kernels' scalars: the momentum, then the factor of the step rows (with_learning_rate's -lr, or 1).
        kernel = elementwise_kernel("momentum", _ffi.float32_scalars(momentum, step_factor(scale)), nesterov=nesterov)

        def leaf(path: Any, g: Any, t: Any) -> tuple[Any, Any]:
            if g is None:
                return None, t
            out, (t,) = apply_rule(path, g, jnp.shape(t), (t,), (), rule, where, whole_rows=False, kernel=kernel)
            return out, t

        out, trace = map_rule(leaf, updates, [(state.trace, "trace")], where, 2, params)
        return out, optax.TraceState(trace=trace)

    return stage(init_fn, update)


def idle_cap(momentum: Any) -> Any:
    r"""How many idle steps a row replays one by one under a learning-rate schedule.

    The smallest :math:`K` with :math:`\mu^K \le 2^{-24} (1 - \mu)`: the idle
    steps after the :math:`K`-th together move a row by less than
    :math:`2^{-24}` times what its first idle step would move it at the
    largest learning rate among them (:math:`\alpha \mu |m_0|`), and are left
    out; the trace still decays over every idle step. 180 for
    :math:`\mu = 0.9`, 2,114 for :math:`0.99`; 0 for :math:`\mu = 0`. A
    Python int for a concrete momentum, an int32 array for a traced one.
    """
    if isinstance(momentum, jax.core.Tracer | jax.Array):
        traced = jnp.asarray(momentum, jnp.float32)
        k = jnp.ceil((-24 * math.log(2) + jnp.log1p(-traced)) / jnp.log(traced))
        return jnp.where(traced > 0, jnp.clip(k, 0, 1 << 24), 0).astype(jnp.int32)
    mu = float(np.asarray(momentum))
    if mu <= 0:
        return 0
    return max(0, math.ceil((-24 * math.log(2) + math.log1p(-mu)) / math.log(mu)))


def _geometric(momentum: Any, idle: jax.Array) -> jax.Array:
    r""":math:`\sum_{k=1}^{s} \mu^k = \mu (1 - \mu^s) / (1 - \mu)` per row, in float32.

    Computed as :math:`-\mu \operatorname{expm1}(s \log \mu) / (1 - \mu)`, with
    :math:`\log \mu` and :math:`1 - \mu` taken in double where :math:`\mu` is a
    number: no cancellation in :math:`1 - \mu^s` when :math:`\mu^s` is close to
    1, so the sum is within a few float32 ulps for any :math:`s`.
    """
    s = idle.astype(jnp.float32)
    mu: Any
    log_mu: Any
    one_minus: Any
    if isinstance(momentum, jax.core.Tracer | jax.Array):
        mu = jnp.asarray(momentum, jnp.float32)
        log_mu, one_minus = jnp.log(mu), 1 - mu
    else:
        m = float(np.asarray(momentum))
        mu, log_mu, one_minus = m, (math.log(m) if m > 0 else -math.inf), 1.0 - m
    total = mu * -jnp.expm1(jnp.where(idle > 0, s, 0.0) * log_mu) / one_minus
    return jnp.where(idle > 0, total, 0.0)


def _scheduled_sum(momentum: Any, schedule: optax.Schedule, last: jax.Array, idle: jax.Array, cap: Any) -> jax.Array:
    r""":math:`\sum_{k=1}^{\min(s, K)} \alpha(t_0 + k - 1) \mu^k` per row, :math:`t_0` = ``last``, :math:`s` = ``idle``.

    By Horner's rule, from the last term kept to the first, so that the small
    terms are added first: :math:`\mu (\alpha_1 + \mu (\alpha_2 + \dots))`; one
    pass over the rows a step, as many passes as the longest idle run kept.
    """
    n = jnp.minimum(idle, cap)
    mu = jnp.asarray(momentum, jnp.float32)

    def rates(counts: jax.Array) -> jax.Array:
        return rate_at(schedule, counts).astype(jnp.float32)

    def body(carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        k, acc = carry
        acc = jnp.where(k <= n, mu * (rates(last + k - 1) + acc), acc)
        return k - 1, acc

    start = jnp.max(n, initial=0).astype(jnp.int32)
    zeros = jnp.zeros_like(last, jnp.float32)  # varying as last is (inside shard_map, the carry keeps its type)
    return jax.lax.while_loop(lambda c: c[0] >= 1, body, (start, zeros))[1]


_MAX_WINDOW = 1 << 16  # idle_cap above which a schedule's sums are taken per row (_scheduled_sum)


def _rate_term(tau: Any, lr: Any, xp: Any) -> Any:
    """The one term's factor at an idle step with count ``tau``: its learning rate ``lr`` (float32)."""
    return xp.broadcast_to(xp.asarray(lr, xp.float32), xp.shape(tau))[..., None]


def _schedule_plan(learning_rate: optax.ScalarOrSchedule, momentum: Any, cap: Any) -> _SeriesPlan | None:
    r"""Under a schedule and a momentum known when the step is traced, the idle steps' sum as catch-up Adam takes
    its series, one term with :math:`\rho = \mu`: :math:`C(s) = \sum_{k=1}^{\min(s, K)} \alpha(t_0 + k - 1)
    \mu^k` is, for rows idle :math:`s \le K` steps, entry :math:`s - 1` of a window computed once a step from the
    last ``K`` steps' rates (``_catch_up._window``), and for rows idle longer a function of the last step
    :math:`t_0` alone, which the state's :class:`IdleRecord` keeps (``_catch_up._far``); ``None`` otherwise (a
    closed form, or :func:`_scheduled_sum` for a traced momentum). Summing each id's ``K`` terms over the schedule
    took 3.6 ms of a 1e6 x 64 table's step at 8,192 Zipf ids and ``K = 180``, against 0.5 ms at a constant rate.
    Up to ``K = 65,536`` (a momentum of about 0.9997): the window's blocked sums take about ``2 K**1.5`` products a
    step and three ``sqrt(K)``-square tables of powers, which past that grow too large to plan."""
    mu = _concrete(momentum)
    if not callable(learning_rate) or mu is None or not 0.0 < mu < 1.0 or int(cap) > _MAX_WINDOW:
        return None
    return _SeriesPlan(cap=int(cap), rho=np.asarray([mu]), binv=1.0, table=None, rates=_rate_term)


def _catch_up_sgd(
    learning_rate: optax.ScalarOrSchedule, momentum: Any, nesterov: bool, accumulator_dtype: Any
) -> optax.GradientTransformationExtraArgs:
    """SGD with momentum whose touched rows first take the movement of the steps they sat out."""
    where = _CATCH_UP_WHERE
    cap = idle_cap(momentum)
    rule_now = _trace_rule(momentum, nesterov)
    plan = _schedule_plan(learning_rate, momentum, cap)
    lr_at = functools.partial(rate_at, learning_rate)

    def init_fn(params: optax.Params) -> CatchUpSgdState:
        check_params(params, where)
        return CatchUpSgdState(
            count=jnp.zeros([], jnp.int32),
            trace=optax.tree.zeros_like(params, dtype=accumulator_dtype),
            last_step=jax.tree.map(lambda p: row_full(p, 0, jnp.int32), params),
            idle_record=idle_record((plan,), learning_rate),
        )

    def idle_coefficients(last: jax.Array, done: jax.Array, record: IdleRecord) -> tuple[jax.Array, jax.Array]:
        """Per row of ``last``, brought up to step ``done``: its idle steps, and ``(C, momentum**idle)`` with ``C``
        the sum over them of the learning rate times a power of the momentum (its first ``K`` terms,
        :func:`idle_cap`: the rest move a row by less than ``2**-24`` of its first idle step), under a schedule
        from the window of the last ``K`` steps or the state's ``record`` (:func:`_schedule_plan`). The native
        kernel picks these per row (a window of C by idle steps, under a schedule the state's record too, the
        momentum's table of powers) or reads them per id."""
        idle = jnp.where(last > 0, done - last, 0).astype(jnp.int32)
        # Idle step k (k = 1..s, at step last + k) has the trace mu^k m0 and moves the row by
        # -lr(last + k - 1) mu^k m0 (times mu more with Nesterov's update, g + mu m).
        table = None if callable(learning_rate) else _geometric_table(momentum, cap, nesterov)
        if table is not None:  # Nesterov's factor in the table
            coefficient = jnp.asarray(learning_rate, jnp.float32) * jnp.asarray(table)[jnp.minimum(idle, cap)]
        else:
            if plan is not None:
                coefficient = _coefficients(plan, lr_at, last, idle, done, record=record)[:, 0]
            elif callable(learning_rate):  # a momentum not known when the step is traced
                coefficient = _scheduled_sum(momentum, learning_rate, last, idle, cap)
            else:
                coefficient = jnp.asarray(learning_rate, jnp.float32) * _geometric(momentum, idle)
            if nesterov:
                coefficient = jnp.asarray(momentum, jnp.float32) * coefficient
        return idle, jnp.stack([coefficient, _power(momentum, idle)], axis=-1)

    @scalar_as_one_row
    def replay_rows(
        p0: jax.Array, moments: tuple[jax.Array, ...], last: jax.Array, done: jax.Array, record: IdleRecord
    ) -> Any:
        """Rows last moved at step ``last`` brought up to step ``done``: ``(p, (trace,))``."""
        (m0,) = moments
        idle, coefficients = idle_coefficients(last, done, record)
        coefficient, decay = coefficients[..., 0], coefficients[..., 1]
        moved = broadcast_rows(idle > 0, p0.ndim)
        wide = jnp.promote_types(m0.dtype, jnp.float32)
        m = jnp.where(moved, (m0.astype(wide) * broadcast_rows(decay, m0.ndim)).astype(m0.dtype), m0)
        shift = -broadcast_rows(coefficient, p0.ndim).astype(wide) * m0.astype(wide)
        return (p0.astype(wide) + shift).astype(p0.dtype), (m,)

    def rule_at(done: jax.Array, count: jax.Array, lr: Any, record: IdleRecord) -> Rule:
        """The sparse leaf rule of step ``count`` on ``(trace, last_step)``: the touched rows replay their idle
        steps up to ``done``, then take the momentum step at learning rate ``lr``; ``record``, the state's (as
        this step writes it)."""

        def rule(g: jax.Array, st: tuple[jax.Array, ...], reads: tuple[jax.Array, ...]) -> Any:
            (m0, last), (p0,) = st, reads
            p_idle, (m,) = replay_rows(p0, (m0,), last, done, record)
            moved = broadcast_rows(jnp.where(last > 0, done - last, 0) > 0, p0.ndim)
            u, (t,) = rule_now(g, (m,), ())
            step = jnp.asarray(-lr, dtype=u.dtype) * u  # as optax.scale_by_learning_rate
            return caught_up_update(p0, p_idle, step, moved), (t, stamp(last, count))

        return rule

    def update_fn(
        updates: optax.Updates, state: CatchUpSgdState, params: optax.Params | None = None, **extra_args: Any
    ) -> tuple[optax.Updates, CatchUpSgdState]:
        del extra_args
        check_state(state, CatchUpSgdState, where)
        if params is None:
            raise ValueError(f"{where}: catching up moves the parameters: call update(grads, state, params)")
        done = state.count  # steps taken before this one
        count = optax.safe_increment(state.count)
        lr = at_count(learning_rate, done)
        record = record_step(state.idle_record, plan, lr_at, done)  # read as written (see catch_up_adam)
        rule = rule_at(done, count, lr, record)
        kernel = fusion.rows_kernel(done, count, lr, record)

        def leaf(path: Any, g: Any, m: Any, last: Any, p: Any) -> tuple[Any, Any, Any]:
            if g is None:
                return None, m, last
            if jnp.shape(m) != jnp.shape(p):
                raise param_error(
                    ValueError,
                    where,
                    path,
                    f"the trace has shape {jnp.shape(m)} but the parameter has shape {jnp.shape(p)}: the state "
                    "was built for other parameters; build it with `tx.init(params)`",
                )
            out, (m, last) = apply_rule(
                path, g, jnp.shape(p), (m, last), (p,), rule, where, whole_rows=True, kernel=kernel
            )
            return out, m, last

        trees = [(state.trace, "trace"), (state.last_step, "last_step"), (params, "parameters")]
        out, trace, last_step = map_rule(leaf, updates, trees, where, 3)
        return out, CatchUpSgdState(count=count, trace=trace, last_step=last_step, idle_record=record)

    rows = RowReplay(
        CatchUpSgdState,
        ("trace",),
        lambda p, moments, last, st, _: replay_rows(p, moments, last, st.count, st.idle_record),
    )
    fusion = CatchUpMomentumFusion(learning_rate, momentum, nesterov, idle_coefficients, cap, plan, lr_at, rule_at)
    return optax.GradientTransformationExtraArgs(init_fn, CatchUpUpdate(update_fn, fusion, rows=rows))


class CatchUpMomentumFusion(NamedTuple):
    """What :func:`update_and_apply` needs of a ``sparse_sgd(..., momentum, catch_up=True)`` to run its step in one
    pass per row: the momentum kernels' hyperparameters, ``idle_coefficients(last, done, record)`` (each row's idle
    steps and their closed form's coefficients; ``record`` the state's), :func:`idle_cap`, the schedule's plan of
    the idle steps' sums (:func:`_schedule_plan`, or ``None``), the learning rate of the step after ``d`` steps,
    ``lr_at(d)``, and ``rule_at(done, count, lr, record)``, the XLA rule, which takes the rows the kernels flag."""

    learning_rate: optax.ScalarOrSchedule
    momentum: Any
    nesterov: bool
    idle_coefficients: Callable[[jax.Array, jax.Array, IdleRecord], tuple[jax.Array, jax.Array]]
    cap: Any
    plan: _SeriesPlan | None
    lr_at: Callable[[jax.Array], jax.Array]
    rule_at: Callable[[jax.Array, jax.Array, Any, IdleRecord], Rule]

    def apply(
        self,
        p: jax.Array,
        state: tuple[jax.Array, ...],
        leaf: SparseLeaf,
        scalars: jax.Array,
        done: jax.Array,
        count: jax.Array,
        record: IdleRecord,
        clip: Clipped | None = None,
    ) -> tuple[jax.Array, ...]:
        """:func:`update_and_apply`'s step on one sparse leaf, by the native kernel: ``(p, trace, last_step)``, the
        rows replayed up to step ``done`` (the count before the step), then stepped to ``count``. At a constant
        learning rate and momentum the kernel picks each touched row's coefficients itself, from its record, the
        window of ``C`` by idle steps and the momentum's table of powers; under a schedule, from the window of the
        last steps and the state's ``record`` (the rows whose entry it does not hold, flagged, are taken by the
        XLA rule); else they are computed here per key, as the XLA path computes them per row."""
        trace, last = state
        if clip is not None:
            scalars = clip.append_to(scalars)
        p, trace, last, flagged = self._kernel(p, trace, last, leaf, scalars, done, count, record)
        if not self._reads_record(record):
            return p, trace, last
        rule = self.rule_at(done, count, self._lr(done), record)
        return flagged_steps(flagged, p, (trace, last), leaf, rule, _CATCH_UP_WHERE, clip)

    def _kernel(
        self,
        p: jax.Array,
        trace: jax.Array,
        last: jax.Array,
        leaf: SparseLeaf,
        scalars: jax.Array,
        done: jax.Array,
        count: jax.Array,
        record: IdleRecord,
        *,
        rows: bool = False,
    ) -> tuple[jax.Array, ...]:
        """One of the two kernels (:func:`._ffi.catch_up_momentum`) on ``leaf``, with its coefficient operands."""
        keys = leaf.keys[:, 0]
        window, powers, per_key = self.idle_operands(last, keys, done, record)
        reads = self._reads_record(record)
        return _ffi.catch_up_momentum(
            p,
            trace,
            last,
            keys,
            leaf.values,
            scalars,
            window,
            powers,
            per_key,
            count,
            done,
            (record.coefficients, record.last_steps) if reads else None,
            cap=self.kernel_cap(record),
            nesterov=self.nesterov,
            unique=_kernel_path.unique_flag(leaf),
            rows=rows,
        )

    def _lr(self, done: jax.Array) -> Any:
        return at_count(self.learning_rate, done)

    def _reads_record(self, record: IdleRecord) -> bool:
        """Whether the kernels take the idle steps' sums from the window and the state's record (a schedule, with
        the momentum known when the step is traced), flagging the long-idle rows whose entry it does not hold."""
        return self._table() is None and self.plan is not None and _kept(record)

    def kernel_cap(self, record: IdleRecord) -> int:
        """The window's length the kernels take: :func:`idle_cap` at a constant learning rate and momentum, and
        under a schedule where they read the state's record; else 0 (their coefficients per key)."""
        return int(self.cap) if self._table() is not None or self._reads_record(record) else 0

    def _table(self) -> np.ndarray | None:
        return None if callable(self.learning_rate) else _geometric_table(self.momentum, self.cap, self.nesterov)

    def idle_operands(
        self, last: jax.Array, keys: jax.Array, done: jax.Array, record: IdleRecord
    ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        """The kernels' coefficient operands ``(window, powers, per_key)``: at a constant learning rate and
        momentum the window of ``C`` by idle steps and the momentum's table of powers, from which the kernel picks
        each touched row's coefficients itself; under a schedule where the kernel reads the state's record, the
        window computed here from the last steps' rates (times the momentum with Nesterov, as
        ``idle_coefficients`` multiplies each row's sum) and the table of powers; else ``per_key``, computed here
        as the XLA path computes them per row."""
        window = jnp.zeros((1,), jnp.float32)
        powers = jnp.zeros((1024,), jnp.float32)
        table = self._table()
        if self._reads_record(record):
            assert self.plan is not None  # _reads_record
            window = _window(self.plan, self.lr_at, done, gathered=False)[:, 0]
            if self.nesterov:
                window = jnp.asarray(self.momentum, jnp.float32) * window
            return window, jnp.asarray(_base_table(float(self.momentum)).reshape(-1)), None
        if table is None:
            return window, powers, self.idle_coefficients(of_keys(last, keys), done, record)[1]
        if self.cap > 0:  # C of rows idle d = 1 .. cap steps, in entry d - 1: idle_coefficients' product
            window = jnp.asarray(self.learning_rate, jnp.float32) * jnp.asarray(table[1:])
        return window, jnp.asarray(_base_table(float(self.momentum)).reshape(-1)), None

    def rows_kernel(self, done: jax.Array, count: jax.Array, lr: Any, record: IdleRecord) -> Kernel:
        """The catch-up momentum rows kernel in the XLA rule's place (``tx.update`` on the CPU): float32 tables,
        a per-row ``int32`` record; ``lr`` the step's learning rate, ``record`` the state's record of long-idle
        sums. The rows it flags take the XLA rule, their updates placed in the kernel's slots by key."""

        def supports(leaf: SparseLeaf, state: Arrays, reads: Arrays) -> bool:
            (p,), (trace, last) = reads, state
            return (
                last.dtype == jnp.int32
                and last.shape == p.shape[:1]
                and _kernel_path.supports(leaf.shape, leaf.n_sparse, trace, p, leaf.values)
            )

        def run(leaf: SparseLeaf, state: Arrays, reads: Arrays) -> tuple[jax.Array, jax.Array, Arrays]:
            (p,), (trace, last) = reads, state
            scalars = _ffi.float32_scalars(self.momentum, -jnp.asarray(lr, jnp.float32))
            trace, last, keys, step, flagged = self._kernel(
                p, trace, last, leaf, scalars, done, count, record, rows=True
            )
            if self._reads_record(record):
                rule = self.rule_at(done, count, lr, record)
                step, (trace, last) = flagged_updates(flagged, keys, step, leaf, p, (trace, last), rule)
            return keys[:, None], step, (trace, last)

        return Kernel(supports, run)


def _geometric_table(momentum: Any, cap: Any, nesterov: bool) -> np.ndarray | None:
    r""":math:`\sum_{k=1}^{d} \mu^k = \mu (1 - \mu^d) / (1 - \mu)` (times :math:`\mu` with Nesterov) for ``d = 0
    .. cap``, in double rounded once to float32 (``-mu expm1(d log mu) / (1 - mu)``: no cancellation when
    :math:`\mu^d` is near 1), for a number ``0 <= momentum < 1``; ``None`` for a traced one."""
    mu = _concrete(momentum)
    if mu is None or not 0.0 <= mu < 1.0:
        return None
    return _geometric_numbers(mu, int(cap), nesterov)


@functools.lru_cache(maxsize=64)
def _geometric_numbers(mu: float, cap: int, nesterov: bool) -> np.ndarray:
    d = np.arange(cap + 1, dtype=np.float64)
    log_mu = math.log(mu) if mu > 0 else -math.inf
    with np.errstate(invalid="ignore"):
        total = (mu if nesterov else 1.0) * mu * -np.expm1(d * log_mu) / (1.0 - mu)
    total[0] = 0.0  # also where mu == 0 (0 * -inf)
    out = np.nan_to_num(total).astype(np.float32)
    out.flags.writeable = False
    return out


@compiled_when_eager
def sparse_sgd(
    learning_rate: optax.ScalarOrSchedule,
    momentum: jax.typing.ArrayLike | None = None,
    nesterov: bool = False,
    accumulator_dtype: jax.typing.DTypeLike | None = None,
    *,
    catch_up: bool = False,
) -> optax.GradientTransformationExtraArgs:
    r"""Lazy SGD, with lazy or exactly caught-up momentum: a drop-in for :func:`optax.sgd`.

    Without momentum, :math:`p_S \leftarrow p_S - \alpha_t g_S` on the touched
    rows :math:`S` (duplicates summed): dense SGD fed zeros elsewhere, since a
    zero gradient does not move a row. With momentum :math:`\mu`, as
    :func:`optax.sgd` (:func:`optax.trace`):

    .. math::

      m_S \leftarrow g_S + \mu m_S, \qquad
      p_S \leftarrow p_S - \alpha_t u_S, \qquad
      u_S = m_S \ \text{or, with Nesterov,} \ g_S + \mu m_S,

    with :math:`\alpha_t` the learning rate at the step count before the step.
    Lazily (``catch_up=False``, TensorFlow's ``SparseApplyMomentum``; torch's
    sparse SGD takes no momentum) untouched rows keep their trace and do not
    move, where dense SGD keeps moving them on their decaying momentum. With
    ``catch_up=True`` a row touched at step :math:`t` after :math:`s` idle
    steps (last moved at step :math:`t_0 = t - s - 1`) first takes those
    steps, as dense SGD took them with a zero gradient:

    .. math::

      m \leftarrow \mu^s m, \qquad
      p \leftarrow p - \Big(\sum_{k=1}^{s} \alpha_{t_0 + k - 1} \mu^k\Big) \, m
      \quad (\text{times } \mu \text{ with Nesterov}),

    then step :math:`t`. For a constant learning rate the sum is
    :math:`\alpha \mu (1 - \mu^s) / (1 - \mu)`, computed as
    :math:`-\alpha \mu \operatorname{expm1}(s \log \mu) / (1 - \mu)` (no
    cancellation for :math:`\mu^s` near 1; :math:`\log \mu` and
    :math:`1 - \mu` in double for a numeric :math:`\mu`); for a schedule it
    is each idle step's own learning rate (the schedule at that step's count)
    times its power of the momentum, summed over up to :math:`K` idle steps
    (``idle_cap``: the smallest :math:`K` with :math:`\mu^K \le 2^{-24}
    (1 - \mu)`, 180 for :math:`\mu = 0.9`), the later ones moving the row by
    less than :math:`2^{-24}` of its first idle step at their largest rate.
    The sums of rows idle at most :math:`K` steps come from a window computed
    once a step over the last :math:`K` steps; those of rows idle longer
    depend on the row's last step alone, and the state records them by last
    step (``idle_record``, an :class:`IdleRecord`), as catch-up Adam's. The
    parameters then equal :func:`optax.sgd`'s fed the dense gradient
    (zeros elsewhere) to float32 rounding, as close to exact arithmetic as
    float32 optax is, which rounds the row at each idle step
    (``tests/test_sgd.py``: over 300 Zipf steps both within 8e-7 of the
    largest parameter of a float64 loop, with schedules and Nesterov). The
    state keeps
    the step each row is up to date through, so ``update`` needs ``params``;
    sparse leaves must address whole rows. Under ``inject_hyperparams`` the
    idle steps use the current injected learning rate. :func:`catch_up`
    brings every row up to date, and ``value_and_row_grad(..., catch_up=tx)``
    hands the loss caught-up rows, as for :func:`sparse_adam`.

    On the CPU lazy momentum (a float32 trace, sparse gradients of one
    sparse axis) runs native kernels (see :func:`kernel_path`), and
    :func:`~optax_sparse_adam.update_and_apply` runs its step in one pass per
    touched row: Nesterov's bitwise the XLA path's, the plain trace within
    the rounding of its sum (XLA:CPU picks by shape whether it contracts
    ``g + momentum * t``, and where ids repeat it adds them one by one onto
    ``momentum * t``); with ``catch_up=True`` one fused kernel also
    catches each touched row up, from the coefficients the XLA path
    computes per row, which it picks itself (under a schedule, from a window
    of the last steps' sums and the state's record; computed per id first
    for an injected momentum, a momentum of 0 or past about 0.9997, or a
    state that keeps no record): Nesterov's bitwise the XLA path's, but for
    the rows it flags under a schedule (a record entry it does not hold),
    which the XLA rule takes within a rounding of the replayed row.

    Dense gradient leaves take :func:`optax.sgd`'s step: for a leaf that gets
    a dense gradient every step, bitwise where the update and its
    application are compiled apart (in one jitted step XLA:CPU picks the
    fused multiply-adds per graph, an ulp apart); with ``catch_up`` a dense
    leaf's rows that sat out steps catch up first.

    Args:
      learning_rate: A float or an optax schedule.
      momentum: The momentum :math:`\mu \ge 0` (:math:`< 1` with
        ``catch_up``), or ``None`` for plain SGD.
      nesterov: Whether to use Nesterov's update.
      accumulator_dtype: Dtype of the trace; ``None`` uses the parameter's.
      catch_up: Whether a returning row first takes the steps it sat out
        (no effect without momentum).

    Returns:
      An :class:`optax.GradientTransformationExtraArgs`: without ``catch_up``
      with :func:`optax.sgd`'s state layout (``(TraceState, EmptyState)``, or
      ``(EmptyState, EmptyState)`` without momentum); with ``catch_up`` and
      momentum a :class:`CatchUpSgdState`, and its output is the final
      update. Apply its updates with :func:`optax_sparse_adam.apply_updates`.

    Examples:
      >>> import jax.numpy as jnp
      >>> import optax_sparse_adam as osa
      >>> def run(tx):
      ...     p = jnp.ones((2, 1), jnp.float32)
      ...     state = tx.init(p)
      ...     for rows, value in [(0, 1.0), (1, 0.0), (1, 0.0), (0, 0.0)]:  # row 0 sits out steps 2 and 3
      ...         g = osa.IndexedRows(jnp.array([rows]), jnp.full((1, 1), value, jnp.float32), 2)
      ...         p, state = osa.update_and_apply(tx, g, state, p)
      ...     return p[:, 0].round(4)
      >>> run(osa.sparse_sgd(0.1, momentum=0.9))  # lazy: row 0 moves at steps 1 and 4 only
      Array([0.81, 1.  ], dtype=float32)
      >>> run(osa.sparse_sgd(0.1, momentum=0.9, catch_up=True))  # as optax.sgd: 1 - 0.1 (1 + 0.9 + 0.81 + 0.729)
      Array([0.6561, 1.    ], dtype=float32)

    References:
      Sutskever et al., `On the importance of initialization and momentum in
      deep learning <http://proceedings.mlr.press/v28/sutskever13.pdf>`_,
      2013; :func:`optax.sgd`.
    """
    check_learning_rate(learning_rate)
    nesterov = check_bool("nesterov", nesterov)
    catch_up = check_bool("catch_up", catch_up)
    accumulator_dtype = check_dtype(accumulator_dtype, "accumulator_dtype")
    scale = sparse_aware(optax.scale_by_learning_rate(learning_rate))
    if momentum is None:
        return optax.chain(optax.identity(), scale)
    check_hparam("momentum", momentum, lower=0.0, lower_open=False, upper=1.0 if catch_up else math.inf)
    if catch_up:
        return _catch_up_sgd(learning_rate, momentum, nesterov, accumulator_dtype)
    # update_and_apply may fuse this chain into one pass per row: what it needs travels with tx.update.
    fusion = MomentumFusion(learning_rate, momentum, nesterov)
    return with_learning_rate(_lazy_trace(momentum, nesterov, accumulator_dtype), learning_rate, fusion)
