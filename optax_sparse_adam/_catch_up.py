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
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_sparse_adam._adam import AdamHyperparams, _dense_adam, _moments, _step, _torch_corrections
from optax_sparse_adam._checks import check_params, check_state
from optax_sparse_adam._indexed_rows import is_sparse
from optax_sparse_adam._row_engine import apply_rule, map_rule, row_shape
from optax_sparse_adam._tree import broadcast_rows, is_leaf, param_error

__all__ = ["CatchUpAdamState", "catch_up", "catch_up_adam", "idle_cap", "replay"]

_WHERE = "sparse_adam(catch_up=True)"


class CatchUpAdamState(NamedTuple):
    """State of ``sparse_adam(..., catch_up=True)``.

    Attributes:
      count: Global step count, an int32 scalar.
      mu: First moments, as :class:`optax.ScaleByAdamState`'s.
      nu: Second moments, as :class:`optax.ScaleByAdamState`'s.
      last_step: Per row (shape ``p.shape[:1]``, int32): the step (the value of
        ``count`` after it) through which the row is up to date, 0 for a row
        that never moved.
    """

    count: jax.Array  # type: ignore[assignment]  # Adam's field name, as in optax's states
    mu: optax.Updates
    nu: optax.Updates
    last_step: optax.Updates


@dataclasses.dataclass(frozen=True)
class Replayer:
    """What replaying idle steps needs: the learning rate and Adam's hyperparameters."""

    learning_rate: optax.ScalarOrSchedule
    hp: AdamHyperparams

    def lr(self, done: jax.Array) -> jax.Array:
        """The learning rate of the steps after ``done`` steps (an int32 array of any shape)."""
        if not callable(self.learning_rate):
            return jnp.asarray(self.learning_rate)
        flat = done.reshape(-1)
        return jax.vmap(self.learning_rate)(flat).reshape(done.shape)


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
    p: jax.Array, m: jax.Array, v: jax.Array, last: jax.Array, done: jax.Array, replayer: Replayer
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Rows ``(p, m, v)`` last moved at step ``last`` (per row), brought up to step ``done``.

    Each idle step is dense Adam's with a zero gradient, in its own
    arithmetic: ``m <- b1 m``, ``v <- b2 v``, ``p <- p + (-lr_k) u_k`` with
    the step's own learning rate and bias corrections; after
    :func:`idle_cap` steps only the moments decay (``b1**n``, ``b2**n``).
    Rows with ``last == 0`` never moved (zero moments) and stay as they are.
    """
    hp = replayer.hp
    idle = jnp.where(last > 0, done - last, 0).astype(jnp.int32)
    n = jnp.minimum(idle, idle_cap(hp.b1, hp.b2))

    Carry = tuple[jax.Array, jax.Array, jax.Array, jax.Array]

    def cond(carry: Carry) -> jax.Array:
        return carry[0] < jnp.max(n, initial=0)

    def body(carry: Carry) -> Carry:
        k, p, m, v = carry
        k = k + 1
        tau = last + k  # the idle step's count, as Adam's bias corrections take it
        active = broadcast_rows(k <= n, p.ndim)
        m_new = (hp.b1 * m).astype(m.dtype)
        v_new = (hp.b2 * v).astype(v.dtype)
        step = _idle_step(m_new, v_new, tau, hp)
        lr = replayer.lr(tau - 1)
        p_new = (p + broadcast_rows(-lr, p.ndim).astype(step.dtype) * step).astype(p.dtype)
        return k, jnp.where(active, p_new, p), jnp.where(active, m_new, m), jnp.where(active, v_new, v)

    _, p, m, v = jax.lax.while_loop(cond, body, (jnp.zeros([], jnp.int32), p, m, v))
    rest = broadcast_rows((idle - n).astype(jnp.float32), m.ndim)
    m = (m * _power(hp.b1, rest)).astype(m.dtype)
    v = (v * _power(hp.b2, rest)).astype(v.dtype)
    return p, m, v


def _power(b: Any, n: jax.Array) -> jax.Array:
    """``b ** n`` for a float32 ``n >= 0`` (1 where ``n == 0``, also for ``b == 0``)."""
    return jnp.where(n > 0, jnp.power(jnp.asarray(b, jnp.float32), n), 1.0)


def _idle_step(m: jax.Array, v: jax.Array, tau: jax.Array, hp: AdamHyperparams) -> jax.Array:
    """:func:`._adam._step` with a step count per row (``tau``), in the same arithmetic."""
    if hp.eps_placement == "optax":
        m_hat = m / broadcast_rows(1 - hp.b1**tau, m.ndim).astype(m.dtype)  # as optax.tree.bias_correction
        v_hat = v / broadcast_rows(1 - hp.b2**tau, v.ndim).astype(v.dtype)
        return m_hat / (jnp.sqrt(v_hat + hp.eps_root) + hp.eps)
    bc1, bc2 = _torch_corrections(hp, tau)
    scale = broadcast_rows(jnp.sqrt(bc2) / bc1, m.ndim)
    return scale.astype(m.dtype) * m / (jnp.sqrt(v + hp.eps_root) + hp.eps)


def _scaled(u: jax.Array, lr: jax.Array) -> jax.Array:
    """``-lr * u`` as :func:`optax.scale_by_learning_rate` computes it."""
    return jnp.asarray(-lr, dtype=u.dtype) * u


def catch_up_adam(
    learning_rate: optax.ScalarOrSchedule, hp: AdamHyperparams, mu_dtype: Any
) -> optax.GradientTransformationExtraArgs:
    """Lazy Adam whose touched rows first replay their idle steps (``sparse_adam(..., catch_up=True)``)."""
    replayer = Replayer(learning_rate, hp)

    def init_fn(params: optax.Params) -> CatchUpAdamState:
        check_params(params, _WHERE)
        return CatchUpAdamState(
            count=jnp.zeros([], jnp.int32),
            mu=optax.tree.zeros_like(params, dtype=mu_dtype),
            nu=optax.tree.zeros_like(params),
            last_step=jax.tree.map(lambda p: jnp.zeros(row_shape(jnp.shape(p)), jnp.int32), params),
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
        trees = [
            (state.mu, "optimizer state's mu"),
            (state.nu, "optimizer state's nu"),
            (state.last_step, "optimizer state's last_step"),
            (params, "parameters"),
        ]

        def plain(path: Any, g: Any, m: Any, v: Any, last: Any, p: Any) -> tuple[Any, Any, Any]:
            if g is None or is_sparse(g):
                return None, None, None
            return g, m, v

        plain_g, plain_m, plain_v = map_rule(plain, updates, trees, _WHERE, 3)
        dense = _dense_adam(plain_g, plain_m, plain_v, state.count, hp)  # as optax.adam

        def rule(g: jax.Array, st: tuple[jax.Array, ...], reads: tuple[jax.Array, ...]) -> Any:
            (m0, v0, last), (p0,) = st, reads
            p, m, v = replay(p0, m0, v0, last, state.count, replayer)
            m, v = _moments(g, m, v, hp)
            step = _scaled(_step(m, v, count, hp), lr)
            moved = broadcast_rows(p != p0 if p.ndim <= 1 else jnp.any(p != p0, axis=tuple(range(1, p.ndim))), p.ndim)
            # A row that replayed idle steps: the update takes it to where dense Adam's steps took it.
            caught = jnp.asarray(p + step).astype(p.dtype).astype(step.dtype) - p0.astype(step.dtype)
            return jnp.where(moved, caught, step), (m, v, jnp.full_like(last, count))

        def leaf(path: Any, g: Any, m: Any, v: Any, last: Any, p: Any, du: Any, dm: Any, dv: Any) -> Any:
            if g is None:
                return None, m, v, last
            if not is_sparse(g):
                return _scaled(du, lr), dm, dv, jnp.full_like(last, count)
            out, (m, v, last) = apply_rule(path, g, jnp.shape(p), (m, v, last), (p,), rule, _WHERE, whole_rows=True)
            return out, m, v, last

        trees += [(tree, "dense step") for tree in dense]
        out, mu, nu, last_step = map_rule(leaf, updates, trees, _WHERE, 4)
        return out, CatchUpAdamState(count=count, mu=mu, nu=nu, last_step=last_step)

    return optax.GradientTransformationExtraArgs(init_fn, CatchUpUpdate(update_fn, replayer))


@dataclasses.dataclass(frozen=True, eq=False)
class CatchUpUpdate:
    """A catch-up optimizer's ``update``, carrying its :class:`Replayer` for lookups and :func:`catch_up`."""

    update: optax.TransformUpdateExtraArgsFn
    replayer: Replayer

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[optax.Updates, optax.OptState]:
        return self.update(*args, **kwargs)


def find(tx: Any, state: Any, where: str, params_structure: Any) -> tuple[Replayer, CatchUpAdamState]:
    """The replayer of ``tx`` (a ``sparse_adam(..., catch_up=True)``) and its state inside ``state``, checked to
    have been built for parameters of ``params_structure``."""
    update = getattr(tx, "update", None)
    if not isinstance(update, CatchUpUpdate):
        raise TypeError(
            f"{where}: the optimizer must be one built by osa.sparse_adam(..., catch_up=True) itself (not wrapped or "
            f"chained further), got {type(tx).__name__}"
        )
    found = [
        x
        for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, CatchUpAdamState))
        if isinstance(x, CatchUpAdamState)
    ]
    if len(found) != 1:
        raise ValueError(f"{where}: the optimizer state must hold one CatchUpAdamState, it holds {len(found)}")
    if jax.tree.structure(found[0].mu, is_leaf=is_leaf) != params_structure:
        raise ValueError(
            f"{where}: the optimizer state's mu has structure {jax.tree.structure(found[0].mu)} but the parameters "
            f"have {params_structure}; pass the parameters and the state built for them"
        )
    return update.replayer, found[0]


def _replace(state: Any, new: CatchUpAdamState) -> Any:
    """``state`` with its one :class:`CatchUpAdamState` replaced by ``new``."""
    return jax.tree.map(
        lambda x: new if isinstance(x, CatchUpAdamState) else x,
        state,
        is_leaf=lambda x: isinstance(x, CatchUpAdamState),
    )


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
    It costs O(table) per parameter, with a few table-sized temporaries: call
    it rarely. Training can go on from the state it returns.

    Args:
      tx: An optimizer built by ``osa.sparse_adam(..., catch_up=True)``.
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
    structure: Any  # jax's PyTreeDef, which type checkers do not see
    path_leaves, structure = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_leaf)
    replayer, state = find(tx, opt_state, "catch_up", structure)

    def leaf(path: Any, p: Any, m: Any, v: Any, last: Any) -> tuple[Any, ...]:
        if jnp.shape(p) != jnp.shape(m):
            raise param_error(ValueError, "catch_up", path, f"shape {jnp.shape(p)} but its mu has {jnp.shape(m)}")
        p, m, v = replay(jnp.asarray(p), m, v, last, state.count, replayer)
        return p, m, v, jnp.where(last > 0, state.count, last)

    flat = [jax.tree.leaves(t, is_leaf=is_leaf) for t in (state.mu, state.nu, state.last_step)]
    outs = [leaf(path, p, *xs) for (path, p), *xs in zip(path_leaves, *flat, strict=True)]
    new_params, mu, nu, last = (structure.unflatten([o[i] for o in outs]) for i in range(4))
    return new_params, _replace(opt_state, state._replace(mu=mu, nu=nu, last_step=last))
