"""Lazy decoupled weight decay: :func:`sparse_adamw` and :func:`lazy_decoupled_weight_decay`."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_sparse_adam._adam import (
    AdamFusion,
    EpsPlacement,
    _catch_up_hyperparams,
    _hyperparams,
    scale_by_sparse_adam,
)
from optax_sparse_adam._checks import (
    check_bool,
    check_decay_factor,
    check_dtype,
    check_hparam,
    check_learning_rate,
    check_params,
    check_state,
    mask_tree,
)
from optax_sparse_adam._fusion import compiled_when_eager
from optax_sparse_adam._learning_rate import with_learning_rate
from optax_sparse_adam._row_engine import apply_rule, at_count, map_rule, row_full, stamp
from optax_sparse_adam._tree import broadcast_rows

__all__ = ["LazyWeightDecayState", "lazy_decoupled_weight_decay", "sparse_adamw"]

_WHERE = "lazy_decoupled_weight_decay"


class LazyWeightDecayState(NamedTuple):
    """State of :func:`lazy_decoupled_weight_decay`.

    Attributes:
      count: Global step count, an int32 scalar (the learning-rate schedule's step).
      last_step: Per row (shape ``p.shape[:1]``, int32): the step at which the
        row last moved, 0 for a row that never did.
    """

    count: jax.Array  # type: ignore[assignment]  # Adam's field name, as in optax's states
    last_step: optax.Updates


def lazy_decoupled_weight_decay(
    learning_rate: optax.ScalarOrSchedule,
    weight_decay: jax.typing.ArrayLike = 1e-4,
    mask: Any = None,
) -> optax.GradientTransformationExtraArgs:
    r"""Scales by the learning rate and decays the touched rows, catching up on the steps they sat out.

    For each row :math:`r` the update touches at step :math:`t`, having last
    moved at step :math:`t_r` (0 if never), with :math:`s = t - t_r - 1` idle
    steps in between:

    .. math::

      \tilde p_r = (1 - \alpha_t \lambda)^s \, p_r, \qquad
      p_r \leftarrow \tilde p_r - \alpha_t (u_r + \lambda \tilde p_r).

    With a constant learning rate this is exactly the decay the row would have
    had from :func:`optax.adamw` over the idle steps (where it gets no other
    update from the lazy rule); with a schedule, the idle steps are decayed at
    the current step's rate :math:`\alpha_t`, not their own. Rows the update
    does not touch are bitwise unchanged. A dense update touches every row.
    This replaces ``scale_by_learning_rate``: its output is the final update.

    Args:
      learning_rate: A float or an optax schedule.
      weight_decay: Decay rate :math:`\lambda`. ``learning_rate * weight_decay`` must be below 1 (a row's decay
        over its idle steps is a power of ``1 - learning_rate * weight_decay``): numbers are checked here; under a
        schedule or an injected rate that reaches it, the rows the step decays become NaN.
      mask: ``None`` (decay all), a bool, a tree of bools that is a prefix of
        the parameters, or a function of the parameters returning one, as
        :func:`optax.add_decayed_weights`'s ``mask``; leaves masked out get
        the plain scaled update.

    Returns:
      An :class:`optax.GradientTransformationExtraArgs` whose state is a
      :class:`LazyWeightDecayState`; its ``update`` needs ``params``.

    Examples:
      >>> import jax.numpy as jnp
      >>> import optax_sparse_adam as osa
      >>> tx = osa.lazy_decoupled_weight_decay(0.5, weight_decay=0.1)
      >>> p = jnp.ones((2, 1), jnp.float32)
      >>> state = tx.init(p)
      >>> zero = osa.IndexedRows(jnp.array([0]), jnp.zeros((1, 1), jnp.float32), 2)
      >>> for _ in range(3):  # row 1 sits out three steps ...
      ...     u, state = tx.update(zero, state, p)
      ...     p = osa.apply_updates(p, u)
      >>> row1 = osa.IndexedRows(jnp.array([1]), jnp.zeros((1, 1), jnp.float32), 2)
      >>> u, state = tx.update(row1, state, p)
      >>> osa.apply_updates(p, u)[:, 0].round(4)  # ... and catches up: 0.95 ** 4
      Array([0.8574, 0.8145], dtype=float32)
    """
    check_learning_rate(learning_rate)
    check_hparam("weight_decay", weight_decay, lower=0.0, lower_open=False)
    check_decay_factor(learning_rate, weight_decay, _WHERE)

    def init_fn(params: optax.Params) -> LazyWeightDecayState:
        check_params(params, _WHERE)
        if mask is not None:
            mask_tree(mask, params, "mask", _WHERE)
        return LazyWeightDecayState(
            count=jnp.zeros([], jnp.int32),
            last_step=jax.tree.map(lambda p: row_full(p, 0, jnp.int32), params),
        )

    def update_fn(
        updates: optax.Updates, state: LazyWeightDecayState, params: optax.Params | None = None, **extra_args: Any
    ) -> tuple[optax.Updates, LazyWeightDecayState]:
        del extra_args
        check_state(state, LazyWeightDecayState, _WHERE)
        if params is None:
            raise ValueError(f"{_WHERE}: weight decay needs the parameters: call update(grads, state, params)")
        lr = at_count(learning_rate, state.count)
        count = optax.safe_increment(state.count)
        flags = mask_tree(True if mask is None else mask, params, "mask", _WHERE)

        def leaf(path: Any, u: Any, last: Any, p: Any, decays: Any) -> tuple[Any, Any]:
            if u is None:
                return None, last

            def rule(u: jax.Array, st: tuple[jax.Array, ...], reads: tuple[jax.Array, ...]) -> Any:
                (last_rows,), (p_rows,) = st, reads
                if not decays:
                    return -lr * u, (stamp(last_rows, count),)
                # In float32 at least: in bfloat16, 1 - lr * wd rounds to 1 for lr * wd < 0.002, losing the decay.
                dtype = jnp.promote_types(p_rows.dtype, jnp.float32)
                idle = broadcast_rows((count - last_rows - 1).astype(dtype), p_rows.ndim)
                p_wide = p_rows.astype(dtype)
                caught = jnp.exp(idle * jnp.log1p(-jnp.asarray(lr * weight_decay, dtype))) * p_wide
                step = -lr * (u + weight_decay * caught) + (caught - p_wide)
                return step, (stamp(last_rows, count),)

            out, (new_last,) = apply_rule(path, u, jnp.shape(p), (last,), (p,), rule, _WHERE, whole_rows=True)
            return out, new_last

        trees = [(state.last_step, "last_step"), (params, "parameters"), (flags, "mask")]
        out, last_step = map_rule(leaf, updates, trees, _WHERE, 2)
        return out, LazyWeightDecayState(count=count, last_step=last_step)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


@compiled_when_eager
def sparse_adamw(
    learning_rate: optax.ScalarOrSchedule,
    b1: jax.typing.ArrayLike = 0.9,
    b2: jax.typing.ArrayLike = 0.999,
    eps: jax.typing.ArrayLike = 1e-8,
    eps_root: jax.typing.ArrayLike = 0.0,
    mu_dtype: jax.typing.DTypeLike | None = None,
    weight_decay: jax.typing.ArrayLike = 1e-4,
    mask: Any = None,
    *,
    catch_up: bool = False,
    maximize: bool = False,
    eps_placement: EpsPlacement = "optax",
) -> optax.GradientTransformationExtraArgs:
    r"""Lazy Adam with decoupled weight decay: a drop-in for :func:`optax.adamw`.

    The touched rows :math:`S` take Adam's step :math:`u_S`
    (:func:`scale_by_sparse_adam`) and decay with it:

    .. math::

      p_S \leftarrow p_S - \alpha_t (u_S + \lambda p_S);

    untouched rows do not move and do not decay (TensorFlow's LazyAdam with
    decoupled decay, FBGEMM's ``DECOUPLE`` mode). With ``catch_up=True`` it
    is :func:`optax.adamw` fed the sparse gradient with zeros elsewhere: a
    row touched after :math:`s` idle steps first takes them as dense AdamW
    did, each idle step decaying the row by
    :math:`1 - \alpha_k \lambda` at its own learning rate and moving it on
    its decaying moments (the replay of ``sparse_adam(catch_up=True)``, each
    step's displacement scaled by the decay of the steps after it); a row no
    gradient ever touched decays from the first step on. The state is a
    :class:`CatchUpAdamWState`: the step each row is up to date through, and
    a Kahan-summed record of :math:`\log(1 - \alpha_t \lambda)` from which
    a schedule's decay over a long idle stretch is read. :func:`catch_up`
    brings every row up to date. Equal to :func:`optax.adamw` when every row
    is touched every step, with either setting. (The decay-only catch-up of
    earlier versions is :func:`lazy_decoupled_weight_decay`, chained after
    :func:`scale_by_sparse_adam`.)

    Args:
      learning_rate: A float or an optax schedule.
      b1: Decay rate of the first moment.
      b2: Decay rate of the second moment.
      eps: Term added to the denominator, outside the square root.
      eps_root: Term added inside the square root.
      mu_dtype: Dtype of the first moment; ``None`` uses the parameter's.
      weight_decay: Decay rate :math:`\lambda`: a number, or (without ``catch_up``) an optax schedule, as
        :func:`optax.add_decayed_weights` takes it (the two calls of that chain then run, in either door).
      mask: Which parameters decay, as :func:`optax.adamw`'s ``mask``.
      catch_up: Whether a returning row first takes the steps it sat out, as
        dense AdamW took them (decay and momentum). ``learning_rate * weight_decay`` must then be below 1 (the
        idle steps' decay is a power of ``1 - learning_rate * weight_decay``): numbers are checked here; under a
        schedule or an injected rate that reaches it, the rows the step decays become NaN.
      maximize: Whether to ascend rather than descend.
      eps_placement: ``"optax"`` or ``"torch"``, as in :func:`sparse_adam`.

    Returns:
      An :class:`optax.GradientTransformationExtraArgs`; apply its updates with
      :func:`optax_sparse_adam.apply_updates`.

    Examples:
      >>> import jax.numpy as jnp
      >>> import optax_sparse_adam as osa
      >>> tx = osa.sparse_adamw(0.1, weight_decay=0.5)
      >>> p = jnp.ones((2, 1), jnp.float32)
      >>> g = osa.IndexedRows(jnp.array([0]), jnp.ones((1, 1), jnp.float32), 2)
      >>> u, _ = tx.update(g, tx.init(p), p)
      >>> osa.apply_updates(p, u)[:, 0].round(3)  # 1 - 0.1 * (1 + 0.5): only row 0 decays
      Array([0.85, 1.  ], dtype=float32)

    References:
      Loshchilov and Hutter, `Decoupled Weight Decay Regularization
      <https://arxiv.org/abs/1711.05101>`_, 2019.
    """
    check_learning_rate(learning_rate)
    check_hparam("weight_decay", weight_decay, lower=0.0, lower_open=False)
    if check_bool("catch_up", catch_up):
        if callable(weight_decay):
            raise ValueError(
                "sparse_adamw(catch_up=True) takes a constant weight_decay (its record holds log(1 - lr * "
                "weight_decay) at one decay), not a schedule: pass a number, or use catch_up=False"
            )
        check_decay_factor(learning_rate, weight_decay, "sparse_adamw(catch_up=True)")
        from optax_sparse_adam import _catch_up  # it builds on sparse_adam's rule

        hp = _catch_up_hyperparams(b1, b2, eps, eps_root, maximize, eps_placement, False)
        return _catch_up.catch_up_adamw(learning_rate, hp, check_dtype(mu_dtype, "mu_dtype"), weight_decay, mask)
    adam = scale_by_sparse_adam(
        b1=b1, b2=b2, eps=eps, eps_root=eps_root, mu_dtype=mu_dtype, maximize=maximize, eps_placement=eps_placement
    )
    # update_and_apply runs the step in one pass per row: Adam's, with the decay of the row's parameters; tx.update
    # adds the decay and the learning rate in Adam's pass (the rows kernel reads the parameters' rows).
    fusion = AdamFusion(learning_rate, _hyperparams(b1, b2, eps, eps_root, maximize, eps_placement), weight_decay, mask)
    return with_learning_rate(adam, learning_rate, fusion, weight_decay=weight_decay, mask=mask, where="sparse_adamw")
