"""Lazy AMSGrad, and AMSGrad caught up exactly: :func:`scale_by_sparse_amsgrad` and :func:`sparse_amsgrad`.

AMSGrad's idle steps are simpler than Adam's: a zero gradient decays ``v``,
so the bias-corrected ``v`` falls and ``nu_max`` (a maximum) stays where it
is; the denominator is then the same at every idle step, and a row idle
``s`` steps since step ``t0`` moves by its first moment times one sum,
``sum_k lr_{t0 + k - 1} b1^k / (1 - b1^(t0 + k))``, a single coefficient per
row, read from :mod:`._catch_up`'s window scan and long-idle table.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_sparse_adam import _catch_up, _ffi, _kernel_path
from optax_sparse_adam._adam import _hyperparams, kernel_scalars
from optax_sparse_adam._catch_up import IdleRecord
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
    apply_rule,
    map_rule,
    row_full,
    scaled_rule,
    stamp,
    step_factor,
)
from optax_sparse_adam._sparse_leaf import SparseLeaf
from optax_sparse_adam._tree import broadcast_rows

__all__ = ["CatchUpAmsgradState", "scale_by_sparse_amsgrad", "sparse_amsgrad"]

_WHERE = "scale_by_sparse_amsgrad"


class CatchUpAmsgradState(NamedTuple):
    """State of ``sparse_amsgrad(..., catch_up=True)``.

    Attributes:
      count: Global step count, an int32 scalar.
      mu: First moments, as :class:`optax.ScaleByAmsgradState`'s.
      nu: Second moments, as :class:`optax.ScaleByAmsgradState`'s.
      nu_max: The largest bias-corrected second moments, as :class:`optax.ScaleByAmsgradState`'s.
      last_step: Per row (shape ``p.shape[:1]``, int32): the step (the value of
        ``count`` after it) through which the row is up to date, 0 for a row
        that never moved.
      idle_record: Under a learning-rate schedule, the coefficient of the idle
        steps of rows idle longer than the window, by their last step, for
        the last 65,536 last steps (a :class:`IdleRecord`: 0.5 MiB, one for all
        the parameters); a single entry for no step where a table holds them
        (a constant learning rate).
    """

    count: jax.Array  # type: ignore[assignment]  # optax's field name
    mu: optax.Updates
    nu: optax.Updates
    nu_max: optax.Updates
    last_step: optax.Updates
    idle_record: IdleRecord


def _amsgrad_moments(g: jax.Array, m: jax.Array, v: jax.Array, v_max: jax.Array, b1: Any, b2: Any, count: Any) -> Any:
    """:func:`optax.scale_by_amsgrad`'s new moments, in its expressions."""
    m = optax.tree.update_moment(g, m, b1, 1)
    v = optax.tree.update_moment_per_elem_norm(g, v, b2, 2)
    return m, v, jnp.maximum(v_max, optax.tree.bias_correction(v, b2, count))


def _amsgrad_kernel(hp: Any, count: jax.Array, scale: Any = None) -> Kernel:
    """The native CPU kernel in the rule's place: the Adam kernels' scalars, its step rows multiplied by ``scale``
    (rounded to float32 first, as ``optax.scale`` rounds it)."""

    def supports(leaf: SparseLeaf, state: Arrays, reads: Arrays) -> bool:
        return _kernel_path.supports(leaf.shape, leaf.n_sparse, *state, leaf.values)

    def run(leaf: SparseLeaf, state: Arrays, reads: Arrays) -> tuple[jax.Array, jax.Array, Arrays]:
        scalars = kernel_scalars(hp, count, step_factor(scale))
        m, v, v_max, keys, step = _ffi.sparse_amsgrad_rows(
            state[0], state[1], state[2], leaf.keys[:, 0], leaf.values, scalars, unique=_kernel_path.unique_flag(leaf)
        )
        return keys[:, None], step, (m, v, v_max)

    return Kernel(supports, run)


def scale_by_sparse_amsgrad(
    b1: jax.typing.ArrayLike = 0.9,
    b2: jax.typing.ArrayLike = 0.999,
    eps: jax.typing.ArrayLike = 1e-8,
    eps_root: jax.typing.ArrayLike = 0.0,
    mu_dtype: jax.typing.DTypeLike | None = None,
) -> optax.GradientTransformationExtraArgs:
    r"""Rescales updates by lazy AMSGrad: only the rows a gradient touches move.

    On the touched set :math:`S` (duplicates summed), with the global step
    count :math:`t`:

    .. math::

      m_S \leftarrow \beta_1 m_S + (1 - \beta_1) g_S, \quad
      v_S \leftarrow \beta_2 v_S + (1 - \beta_2) |g_S|^2, \quad
      \hat v^{max}_S \leftarrow \max\Big(\hat v^{max}_S, \frac{v_S}{1 - \beta_2^t}\Big),

    .. math::

      u_S = \frac{m_S / (1 - \beta_1^t)}{\sqrt{\hat v^{max}_S + \epsilon_{root}} + \epsilon}.

    Outside :math:`S` the state is bitwise unchanged and nothing moves. A dense
    gradient leaf touches every row: the rule is then :func:`optax.scale_by_amsgrad`'s.

    Args:
      b1: Decay rate of the first moment.
      b2: Decay rate of the second moment.
      eps: Term added to the denominator, outside the square root.
      eps_root: Term added inside the square root.
      mu_dtype: Dtype of the first moment; ``None`` uses the parameter's.

    Returns:
      An :class:`optax.GradientTransformationExtraArgs` whose state is an
      :class:`optax.ScaleByAmsgradState` (``count``, ``mu``, ``nu``, ``nu_max``).

    Examples:
      >>> import jax.numpy as jnp
      >>> import optax_sparse_adam as osa
      >>> tx = osa.scale_by_sparse_amsgrad()
      >>> state = tx.init(jnp.zeros((3, 1), jnp.float32))
      >>> g = osa.IndexedRows(jnp.array([2]), jnp.ones((1, 1), jnp.float32), 3)
      >>> updates, state = tx.update(g, state)
      >>> updates.todense().round(3)
      Array([[0.],
             [0.],
             [1.]], dtype=float32)

    References:
      Reddi, Kale and Kumar, `On the Convergence of Adam and Beyond
      <https://openreview.net/forum?id=ryQu7f-RZ>`_, 2018.
    """
    check_hparam("b1", b1, lower=0.0, lower_open=False, upper=1.0)
    check_hparam("b2", b2, lower=0.0, lower_open=False, upper=1.0)
    check_hparam("eps", eps, lower=0.0, lower_open=True)
    check_hparam("eps_root", eps_root, lower=0.0, lower_open=False)
    mu_dtype = check_dtype(mu_dtype, "mu_dtype")

    def init_fn(params: optax.Params) -> optax.ScaleByAmsgradState:
        check_params(params, _WHERE)
        return optax.ScaleByAmsgradState(
            count=jnp.zeros([], jnp.int32),
            mu=optax.tree.zeros_like(params, dtype=mu_dtype),
            nu=optax.tree.zeros_like(params),
            nu_max=optax.tree.zeros_like(params),
        )

    def update(
        updates: optax.Updates, state: optax.ScaleByAmsgradState, params: optax.Params | None, scale: Any
    ) -> tuple[optax.Updates, optax.ScaleByAmsgradState]:
        check_state(state, optax.ScaleByAmsgradState, _WHERE)
        count = optax.safe_increment(state.count)

        def rule(g: jax.Array, st: tuple[jax.Array, ...], reads: tuple[jax.Array, ...]) -> Any:
            m, v, v_max = st
            m, v, v_max = _amsgrad_moments(g, m, v, v_max, b1, b2, count)
            m_hat = optax.tree.bias_correction(m, b1, count)
            return m_hat / (jnp.sqrt(v_max + eps_root) + eps), (m, v, v_max)

        scaled = scaled_rule(rule, scale)
        kernel = _amsgrad_kernel(_hyperparams(b1, b2, eps, eps_root, False, "optax"), count, scale)

        def leaf(path: Any, g: Any, m: Any, v: Any, v_max: Any) -> tuple[Any, ...]:
            if g is None:
                return None, m, v, v_max
            out, new = apply_rule(
                path, g, jnp.shape(v), (m, v, v_max), (), scaled, _WHERE, whole_rows=False, kernel=kernel
            )
            return (out, *new)

        trees = [(state.mu, "mu"), (state.nu, "nu"), (state.nu_max, "nu_max")]
        out, mu, nu, nu_max = map_rule(leaf, updates, trees, _WHERE, 4, params)
        return out, optax.ScaleByAmsgradState(count=count, mu=mu, nu=nu, nu_max=nu_max)

    return stage(init_fn, update)


@compiled_when_eager
def sparse_amsgrad(
    learning_rate: optax.ScalarOrSchedule,
    b1: jax.typing.ArrayLike = 0.9,
    b2: jax.typing.ArrayLike = 0.999,
    eps: jax.typing.ArrayLike = 1e-8,
    eps_root: jax.typing.ArrayLike = 0.0,
    mu_dtype: jax.typing.DTypeLike | None = None,
    *,
    catch_up: bool = False,
) -> optax.GradientTransformationExtraArgs:
    r"""Lazy AMSGrad, or AMSGrad caught up exactly: a drop-in for :func:`optax.amsgrad`.

    See :func:`scale_by_sparse_amsgrad` for the rule; then
    :math:`p_S \leftarrow p_S - \alpha_t u_S`. Equal to :func:`optax.amsgrad`
    when every row is touched every step.

    With ``catch_up=True`` a row touched at step :math:`t` after :math:`s`
    idle steps (last moved at step :math:`t_0 = t - s - 1`) first takes the
    steps dense AMSGrad took with a zero gradient. They decay the moments,
    :math:`m \leftarrow \beta_1^s m`, :math:`v \leftarrow \beta_2^s v`, and
    leave :math:`\hat v^{max}` alone (the bias-corrected :math:`v` only falls
    while the gradient is zero), so the denominator is the same at each of
    them and the row moves by

    .. math::

      -\frac{m}{\sqrt{\hat v^{max} + \epsilon_{root}} + \epsilon}
      \sum_{k=1}^{s} \frac{\alpha_{t_0 + k - 1} \beta_1^k}{1 - \beta_1^{t_0 + k}},

    each idle step with its own learning rate (a schedule is evaluated at
    those steps) and bias correction, then step :math:`t`. The sum is taken
    over the first :math:`K` idle steps, the smallest :math:`K` with
    :math:`\beta_1^{K+1} \le 2^{-24} (1 - \beta_1)^2` (202 for
    :math:`\beta_1 = 0.9`): the later ones add less than :math:`2^{-24}` of
    the first idle step's movement at their largest rate. The parameters
    and moments then equal :func:`optax.amsgrad`'s fed the dense gradient
    (zeros elsewhere) to float32 rounding (``tests/test_amsgrad.py``).
    The state (:class:`CatchUpAmsgradState`) keeps the step each row is up
    to date through, so ``update`` needs ``params``; sparse leaves must
    address whole rows. :func:`catch_up` brings every row up to date and
    ``value_and_row_grad(..., catch_up=tx)`` hands the loss caught-up rows,
    as for :func:`sparse_adam`. ``b1`` must be a number (not injected).

    Args:
      learning_rate: A float or an optax schedule.
      b1: Decay rate of the first moment.
      b2: Decay rate of the second moment.
      eps: Term added to the denominator, outside the square root.
      eps_root: Term added inside the square root.
      mu_dtype: Dtype of the first moment; ``None`` uses the parameter's.
      catch_up: Whether a row the gradient touches first takes the steps it
        sat out, as dense AMSGrad took them.

    Returns:
      An :class:`optax.GradientTransformationExtraArgs`; apply its updates with
      :func:`optax_sparse_adam.apply_updates`. With ``catch_up`` its output
      is the final update.

    Examples:
      >>> import jax.numpy as jnp
      >>> import optax_sparse_adam as osa
      >>> tx = osa.sparse_amsgrad(0.1)
      >>> p = jnp.ones((3, 1), jnp.float32)
      >>> g = osa.IndexedRows(jnp.array([0]), jnp.ones((1, 1), jnp.float32), 3)
      >>> u, _ = tx.update(g, tx.init(p), p)
      >>> osa.apply_updates(p, u)[:, 0].round(3)
      Array([0.9, 1. , 1. ], dtype=float32)
    """
    check_learning_rate(learning_rate)
    if check_bool("catch_up", catch_up):
        return _catch_up_amsgrad(learning_rate, b1, b2, eps, eps_root, mu_dtype)
    inner = scale_by_sparse_amsgrad(b1=b1, b2=b2, eps=eps, eps_root=eps_root, mu_dtype=mu_dtype)
    # update_and_apply runs the step in one pass per row on the AMSGrad kernel: the Adam kernel's scalars serve it.
    fusion = AmsgradFusion(learning_rate, _hyperparams(b1, b2, eps, eps_root, False, "optax"))
    return with_learning_rate(inner, learning_rate, fusion)


class AmsgradFusion(NamedTuple):
    """What :func:`update_and_apply` needs of a lazy :func:`sparse_amsgrad` to run its step in one pass per row."""

    learning_rate: optax.ScalarOrSchedule
    hp: Any  # the Adam kernels' hyperparameters (_adam.AdamHyperparams)


def idle_cap(b1: float) -> int:
    """The idle steps :func:`sparse_amsgrad`'s catch-up sums: the smallest ``K`` with
    ``b1**(K + 1) <= 2**-24 (1 - b1)**2`` (0 for ``b1 == 0``)."""
    if b1 == 0.0:
        return 0
    return max(0, math.ceil((24 * math.log(2) - 2 * math.log1p(-b1)) / -math.log(b1)) - 1)


@dataclasses.dataclass(frozen=True)
class _Rates:
    """The one term's factor at an idle step with count ``tau``: ``lr / (1 - b1**tau)``, in float32 as
    :func:`optax.tree.bias_correction` computes the correction, or in double for the long-idle table."""

    b1: float

    def __call__(self, tau: Any, lr: Any, xp: Any) -> Any:
        c1 = 1 - (float(self.b1) ** tau if xp is np else self.b1**tau)
        return (lr / c1)[..., None]


def _catch_up_amsgrad(
    learning_rate: optax.ScalarOrSchedule, b1: Any, b2: Any, eps: Any, eps_root: Any, mu_dtype: Any
) -> optax.GradientTransformationExtraArgs:
    """AMSGrad whose touched rows first take the steps they sat out (``sparse_amsgrad(..., catch_up=True)``)."""
    where = "sparse_amsgrad(catch_up=True)"
    check_hparam("b1", b1, lower=0.0, lower_open=False, upper=1.0)
    check_hparam("b2", b2, lower=0.0, lower_open=False, upper=1.0)
    check_hparam("eps", eps, lower=0.0, lower_open=True)
    check_hparam("eps_root", eps_root, lower=0.0, lower_open=False)
    mu_dtype = check_dtype(mu_dtype, "mu_dtype")
    beta = _catch_up._concrete(b1)
    if beta is None:
        raise TypeError(
            f"{where}: b1 must be a number, got {type(b1).__name__}: the idle steps' sum is planned when the step is "
            "traced (under optax.inject_hyperparams, list b1 in static_args)"
        )
    cap = idle_cap(beta)
    rho = np.asarray([beta])
    rates = _Rates(beta)
    plan = _catch_up._SeriesPlan(
        cap=cap, rho=rho, binv=1.0, table=_catch_up._long_idle_table(learning_rate, rates, beta, cap, rho), rates=rates
    )

    hp = _hyperparams(b1, b2, eps, eps_root, False, "optax")  # the Adam kernels' (AMSGrad: optax's placement)
    lr_at = functools.partial(_catch_up.rate_at, learning_rate)

    def idle_coefficients(last: jax.Array, done: jax.Array, record: IdleRecord) -> tuple[jax.Array, jax.Array]:
        """Per row of ``last``, brought up to step ``done``: its idle steps, and ``(C, b1**idle, b2**idle)`` with
        ``C`` the sum over them of ``lr_t b1**k / (1 - b1**t)`` (the ``k``-th idle step, of count ``t``), capped
        at :func:`idle_cap` steps, read from the state's ``record`` for rows idle longer than the window under a
        schedule. The native kernel reads these per id, so both paths compute them here."""
        idle = jnp.where(last > 0, done - last, 0).astype(jnp.int32)
        coefficient = _catch_up._coefficients(plan, lr_at, last, idle, done, record=record)[:, 0]
        return idle, jnp.stack([coefficient, _catch_up._power(b1, idle), _catch_up._power(b2, idle)], axis=1)

    @_catch_up.scalar_as_one_row
    def replay_rows(
        p: jax.Array, moments: tuple[jax.Array, ...], last: jax.Array, done: jax.Array, record: IdleRecord
    ) -> Any:
        """Rows last moved at step ``last`` brought up to step ``done``: ``(p, (mu, nu, nu_max))``."""
        m, v, v_max = moments
        idle, coefficients = idle_coefficients(last, done, record)
        coefficient, decay1, decay2 = (broadcast_rows(coefficients[:, j], p.ndim) for j in range(3))
        wide = jnp.promote_types(p.dtype, jnp.float32)
        shift = coefficient * (m.astype(wide) / (jnp.sqrt(v_max + eps_root) + eps)).astype(wide)
        moved = broadcast_rows(idle > 0, p.ndim)
        p = jnp.where(moved, (p.astype(wide) - shift).astype(p.dtype), p)
        return p, ((m * decay1).astype(m.dtype), (v * decay2).astype(v.dtype), v_max)

    def init_fn(params: optax.Params) -> CatchUpAmsgradState:
        check_params(params, where)
        return CatchUpAmsgradState(
            count=jnp.zeros([], jnp.int32),
            mu=optax.tree.zeros_like(params, dtype=mu_dtype),
            nu=optax.tree.zeros_like(params),
            nu_max=optax.tree.zeros_like(params),
            last_step=jax.tree.map(lambda p: row_full(p, 0, jnp.int32), params),
            idle_record=_catch_up.idle_record((plan,), learning_rate),
        )

    def update_fn(
        updates: optax.Updates, state: CatchUpAmsgradState, params: optax.Params | None = None, **extra_args: Any
    ) -> tuple[optax.Updates, CatchUpAmsgradState]:
        del extra_args
        check_state(state, CatchUpAmsgradState, where)
        if params is None:
            raise ValueError(f"{where}: catching up moves the parameters: call update(grads, state, params)")
        done = state.count  # steps taken before this one
        count = optax.safe_increment(state.count)
        lr = lr_at(done)
        record = _catch_up.record_step(state.idle_record, plan, lr_at, done)  # read as written (catch_up_adam)

        def rule(g: jax.Array, st: tuple[jax.Array, ...], reads: tuple[jax.Array, ...]) -> Any:
            (m0, v0, v_max0, last), (p0,) = st, reads
            p, (m, v, v_max) = replay_rows(p0, (m0, v0, v_max0), last, done, record)
            m, v, v_max = _amsgrad_moments(g, m, v, v_max, b1, b2, count)
            u = optax.tree.bias_correction(m, b1, count) / (jnp.sqrt(v_max + eps_root) + eps)
            step = jnp.asarray(-lr, dtype=u.dtype) * u  # as optax.scale_by_learning_rate
            moved = broadcast_rows(jnp.where(last > 0, done - last, 0) > 0, p0.ndim)
            return _catch_up.caught_up_update(p0, p, step, moved), (m, v, v_max, stamp(last, count))

        kernel = _catch_up_rows_kernel(plan, hp, lr_at, lr, done, count, record)

        def leaf(path: Any, g: Any, m: Any, v: Any, v_max: Any, last: Any, p: Any) -> tuple[Any, ...]:
            if g is None:
                return None, m, v, v_max, last
            state = (m, v, v_max, last)
            out, new = apply_rule(path, g, jnp.shape(p), state, (p,), rule, where, whole_rows=True, kernel=kernel)
            return (out, *new)

        trees = [
            (state.mu, "mu"),
            (state.nu, "nu"),
            (state.nu_max, "nu_max"),
            (state.last_step, "last_step"),
            (params, "parameters"),
        ]
        out, mu, nu, nu_max, last_step = map_rule(leaf, updates, trees, where, 5)
        new = CatchUpAmsgradState(count=count, mu=mu, nu=nu, nu_max=nu_max, last_step=last_step, idle_record=record)
        return out, new

    rows = _catch_up.RowReplay(
        CatchUpAmsgradState,
        ("mu", "nu", "nu_max"),
        lambda p, moments, last, st, _: replay_rows(p, moments, last, st.count, st.idle_record),
    )
    fusion = CatchUpAmsgradFusion(learning_rate, hp, plan, lr_at)
    return optax.GradientTransformationExtraArgs(init_fn, _catch_up.CatchUpUpdate(update_fn, fusion, rows=rows))


class CatchUpAmsgradFusion(NamedTuple):
    """What :func:`update_and_apply` needs of a ``sparse_amsgrad(catch_up=True)`` to run its step in one pass per
    row: the lazy AMSGrad kernel's scalars, the idle steps' plan (window, long-idle table) and the learning rate of
    the step after ``d`` steps, ``lr_at(d)``."""

    learning_rate: optax.ScalarOrSchedule
    hp: Any  # the Adam kernels' hyperparameters (_adam.AdamHyperparams)
    plan: Any  # _catch_up._SeriesPlan, one term (b1)
    lr_at: Callable[[jax.Array], jax.Array]

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
        """:func:`update_and_apply`'s step on one sparse leaf, by the native kernel: ``(p, mu, nu, nu_max,
        last_step)``, the rows replayed up to step ``done`` (the count before the step), then stepped to ``count``;
        ``record``, the state's long-idle coefficients.
        The kernel reads each touched row's record and takes its idle steps' coefficient from the window or the
        long-idle table, and the moments' decays from the tables of ``b1``'s and ``b2``'s powers, as
        ``idle_coefficients`` computes them per row on the XLA path; computed here per key, only what no table
        holds (long-idle coefficients under a schedule, ``b2**idle`` for a ``b2`` not known when the step is
        traced). It catches each touched row up, steps it and records its last step in one pass."""
        m, v, v_max, last = state
        keys = leaf.keys[:, 0]
        ops = idle_operands(self.plan, self.hp, self.lr_at, last, keys, done, record)
        if clip is not None:
            scalars = clip.append_to(scalars)
        unique = _kernel_path.unique_flag(leaf)
        tables = (p, m, v, v_max, last)
        return _ffi.catch_up_amsgrad(tables, keys, leaf.values, scalars, ops, count, done, unique=unique)


def idle_operands(
    plan: Any,
    hp: Any,
    lr_at: Callable[[jax.Array], jax.Array],
    last: jax.Array,
    keys: jax.Array,
    done: jax.Array,
    record: IdleRecord,
) -> _ffi.AmsgradIdleOperands:
    """What the AMSGrad catch-up kernels read to take each touched row's idle steps from its record (see
    :func:`._ffi.catch_up_amsgrad`): the window and the long-idle table, the tables of ``b1``'s and ``b2``'s
    powers; computed here per key, only what no table holds (long-idle coefficients under a schedule, from the
    state's ``record``; ``b2**idle`` for a ``b2`` not known when the step is traced)."""
    b2 = _catch_up._concrete(hp.b2)
    b2_table = b2 is not None and 0.0 <= b2 < 1.0
    far_by_key = plan.cap > 0 and plan.table is None
    last_k = idle = None
    if far_by_key or not b2_table:
        last_k = _catch_up.of_keys(last, keys)
        idle = jnp.where(last_k > 0, done - last_k, 0).astype(jnp.int32)
    window = far = jnp.zeros((1,), jnp.float32)  # b1 == 0: no idle step moves a row
    if plan.cap > 0:
        window = _catch_up._window(plan, lr_at, done, gathered=False)[:, 0]
        if far_by_key:
            assert last_k is not None and idle is not None
            far = _catch_up._far(plan, lr_at, last_k, idle > plan.cap, record=record)[0][:, 0]
        else:
            far = jnp.asarray(plan.table)[:, 0]
    b1 = _catch_up._concrete(hp.b1)
    assert b1 is not None, "_catch_up_amsgrad checks b1"
    tables = [_catch_up._base_table(b1)]
    decay2 = None
    if b2 is not None and b2_table:
        tables.append(_catch_up._base_table(b2))
    else:
        assert idle is not None
        decay2 = _catch_up._power(hp.b2, idle)
    powers = jnp.asarray(np.concatenate([t.reshape(-1) for t in tables]))
    # float32, as the kernels read them: in jax's 64-bit mode the NumPy tables and a schedule's rates are float64.
    window, far, powers = (jnp.asarray(x, jnp.float32) for x in (window, far, powers))
    decay2 = None if decay2 is None else jnp.asarray(decay2, jnp.float32)
    return _ffi.AmsgradIdleOperands(window, far, powers, decay2, plan.cap, far_by_key)


def _catch_up_rows_kernel(
    plan: Any,
    hp: Any,
    lr_at: Callable[[jax.Array], jax.Array],
    lr: Any,
    done: jax.Array,
    count: jax.Array,
    record: IdleRecord,
) -> Kernel:
    """The AMSGrad catch-up rows kernel in the XLA rule's place (``tx.update`` on the CPU): float32 tables, a
    per-row ``int32`` record; ``record``, the state's long-idle coefficients."""

    def supports(leaf: SparseLeaf, state: Arrays, reads: Arrays) -> bool:
        (p,), last = reads, state[3]
        return (
            last.dtype == jnp.int32
            and last.shape == p.shape[:1]
            and _kernel_path.supports(leaf.shape, leaf.n_sparse, *state[:3], p, leaf.values)
        )

    def run(leaf: SparseLeaf, state: Arrays, reads: Arrays) -> tuple[jax.Array, jax.Array, Arrays]:
        (p,), (m, v, v_max, last) = reads, state
        keys = leaf.keys[:, 0]
        ops = idle_operands(plan, hp, lr_at, last, keys, done, record)
        scalars = kernel_scalars(hp, count, -jnp.asarray(lr, jnp.float32))
        unique = _kernel_path.unique_flag(leaf)
        tables = (p, m, v, v_max, last)
        m, v, v_max, last, keys, out = _ffi.catch_up_amsgrad(
            tables, keys, leaf.values, scalars, ops, count, done, unique=unique, rows=True
        )
        return keys[:, None], out, (m, v, v_max, last)

    return Kernel(supports, run)
