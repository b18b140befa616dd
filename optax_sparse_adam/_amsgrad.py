"""Lazy AMSGrad: :func:`scale_by_sparse_amsgrad` and :func:`sparse_amsgrad`."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from optax_sparse_adam._checks import check_dtype, check_hparam, check_params, check_state
from optax_sparse_adam._row_engine import apply_rule, map_rule
from optax_sparse_adam._sparse_aware import sparse_aware

__all__ = ["scale_by_sparse_amsgrad", "sparse_amsgrad"]

_WHERE = "scale_by_sparse_amsgrad"


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

    def update_fn(
        updates: optax.Updates, state: optax.ScaleByAmsgradState, params: optax.Params | None = None, **extra_args: Any
    ) -> tuple[optax.Updates, optax.ScaleByAmsgradState]:
        del params, extra_args
        check_state(state, optax.ScaleByAmsgradState, _WHERE)
        count = optax.safe_increment(state.count)

        def rule(g: jax.Array, st: tuple[jax.Array, ...], reads: tuple[jax.Array, ...]) -> Any:
            m, v, v_max = st
            m = optax.tree.update_moment(g, m, b1, 1)
            v = optax.tree.update_moment_per_elem_norm(g, v, b2, 2)
            v_max = jnp.maximum(v_max, optax.tree.bias_correction(v, b2, count))
            m_hat = optax.tree.bias_correction(m, b1, count)
            return m_hat / (jnp.sqrt(v_max + eps_root) + eps), (m, v, v_max)

        def leaf(path: Any, g: Any, m: Any, v: Any, v_max: Any) -> tuple[Any, ...]:
            if g is None:
                return None, m, v, v_max
            out, new = apply_rule(path, g, jnp.shape(v), (m, v, v_max), (), rule, _WHERE, whole_rows=False)
            return (out, *new)

        trees = [(state.mu, "mu"), (state.nu, "nu"), (state.nu_max, "nu_max")]
        out, mu, nu, nu_max = map_rule(leaf, updates, trees, _WHERE, 4)
        return out, optax.ScaleByAmsgradState(count=count, mu=mu, nu=nu, nu_max=nu_max)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def sparse_amsgrad(
    learning_rate: optax.ScalarOrSchedule,
    b1: jax.typing.ArrayLike = 0.9,
    b2: jax.typing.ArrayLike = 0.999,
    eps: jax.typing.ArrayLike = 1e-8,
    eps_root: jax.typing.ArrayLike = 0.0,
    mu_dtype: jax.typing.DTypeLike | None = None,
) -> optax.GradientTransformationExtraArgs:
    r"""Lazy AMSGrad: a drop-in for :func:`optax.amsgrad` that moves only the touched rows.

    See :func:`scale_by_sparse_amsgrad` for the rule; then
    :math:`p_S \leftarrow p_S - \alpha_t u_S`. Equal to :func:`optax.amsgrad`
    when every row is touched every step.

    Args:
      learning_rate: A float or an optax schedule.
      b1: Decay rate of the first moment.
      b2: Decay rate of the second moment.
      eps: Term added to the denominator, outside the square root.
      eps_root: Term added inside the square root.
      mu_dtype: Dtype of the first moment; ``None`` uses the parameter's.

    Returns:
      An :class:`optax.GradientTransformationExtraArgs`; apply its updates with
      :func:`optax_sparse_adam.apply_updates`.

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
    check_hparam("learning_rate", learning_rate, lower=0.0, lower_open=True)
    return optax.chain(
        scale_by_sparse_amsgrad(b1=b1, b2=b2, eps=eps, eps_root=eps_root, mu_dtype=mu_dtype),
        sparse_aware(optax.scale_by_learning_rate(learning_rate)),
    )
