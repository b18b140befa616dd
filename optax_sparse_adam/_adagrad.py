"""Lazy element-wise Adagrad: :func:`scale_by_sparse_adagrad` and :func:`sparse_adagrad`.

:func:`optax.adagrad`'s rule on the entries a gradient touches, with its state
(:class:`optax.ScaleByRssState`). Under dense Adagrad an entry whose gradient
is zero keeps its accumulator (``0 + a == a``) and takes a zero step
(``rsqrt(a + eps) * 0``), so the lazy rule is dense Adagrad fed zeros
elsewhere, not an approximation of it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_sparse_adam import _ffi
from optax_sparse_adam._checks import check_hparam, check_learning_rate, check_params, check_state
from optax_sparse_adam._fusion import compiled_when_eager
from optax_sparse_adam._learning_rate import stage, with_learning_rate
from optax_sparse_adam._row_engine import apply_rule, elementwise_kernel, map_rule, scaled_rule, step_factor

__all__ = ["scale_by_sparse_adagrad", "sparse_adagrad"]

_WHERE = "scale_by_sparse_adagrad"


class AdagradFusion(NamedTuple):
    """What :func:`update_and_apply` needs of a :func:`sparse_adagrad` to run its step in one pass per row."""

    learning_rate: optax.ScalarOrSchedule
    eps: Any


def scale_by_sparse_adagrad(
    initial_accumulator_value: jax.typing.ArrayLike = 0.1,
    eps: jax.typing.ArrayLike = 1e-7,
) -> optax.GradientTransformationExtraArgs:
    r"""Rescales updates by lazy Adagrad: only the entries a gradient touches change.

    On the touched set :math:`S` (rows or entries, duplicates summed), with
    :func:`optax.scale_by_rss`'s expressions:

    .. math::

      a_S \leftarrow a_S + |g_S|^2, \qquad
      u_S = \begin{cases} g_S / \sqrt{a_S + \epsilon} & a_S > 0 \\ 0 & \text{else.} \end{cases}

    Outside :math:`S` the accumulator is bitwise unchanged and the update is a
    sparse leaf of the gradient's type holding the touched entries only. A
    dense gradient leaf touches every entry: the rule is then
    :func:`optax.scale_by_rss`'s, entry for entry. Dense Adagrad leaves an
    entry with a zero gradient exactly as it is (its accumulator gains
    :math:`0`, its update is :math:`0 \cdot (a + \epsilon)^{-1/2} = 0`), so
    this equals :func:`optax.scale_by_rss` fed the dense gradient, zeros
    elsewhere, whichever rows a step touches.

    Args:
      initial_accumulator_value: Starting value of every accumulator entry.
      eps: Term added to the accumulator inside the square root.

    Returns:
      An :class:`optax.GradientTransformationExtraArgs` whose state is an
      :class:`optax.ScaleByRssState` (``sum_of_squares``, the parameters'
      shapes and dtypes), as :func:`optax.scale_by_rss`'s.

    Examples:
      >>> import jax.numpy as jnp
      >>> import optax_sparse_adam as osa
      >>> tx = osa.scale_by_sparse_adagrad()
      >>> state = tx.init(jnp.zeros((3, 2), jnp.float32))
      >>> g = osa.IndexedRows(jnp.array([1]), jnp.array([[3.0, 4.0]], jnp.float32), 3)
      >>> updates, state = tx.update(g, state)
      >>> updates.todense()[1].tolist()  # 3 / sqrt(9.1), 4 / sqrt(16.1)
      [0.9944..., 0.9968...]
      >>> state.sum_of_squares[:, 0]
      Array([0.1, 9.1, 0.1], dtype=float32)

    References:
      Duchi, Hazan and Singer, `Adaptive Subgradient Methods
      <https://jmlr.org/papers/v12/duchi11a.html>`_, 2011; :func:`optax.adagrad`.
    """
    check_hparam("initial_accumulator_value", initial_accumulator_value, lower=0.0, lower_open=False)
    check_hparam("eps", eps, lower=0.0, lower_open=False)

    def init_fn(params: optax.Params) -> optax.ScaleByRssState:
        check_params(params, _WHERE)
        return optax.ScaleByRssState(sum_of_squares=optax.tree.full_like(params, initial_accumulator_value))

    def update(
        updates: optax.Updates, state: optax.ScaleByRssState, params: optax.Params | None, scale: Any
    ) -> tuple[optax.Updates, optax.ScaleByRssState]:
        check_state(state, optax.ScaleByRssState, _WHERE)

        def rule(g: jax.Array, st: tuple[jax.Array, ...], reads: tuple[jax.Array, ...]) -> Any:
            (acc,) = st
            acc = (g.conj() * g).real + acc  # optax.scale_by_rss's expressions, in its order
            inv_sqrt = jnp.where(acc > 0, jax.lax.rsqrt(acc + eps), 0.0)
            return inv_sqrt * g, (acc,)

        scaled = scaled_rule(rule, scale)
        # The kernels' scalars: eps, then the factor of the step rows (with_learning_rate's -lr, or 1).
        kernel = elementwise_kernel("adagrad", _ffi.float32_scalars(eps, step_factor(scale)))

        def leaf(path: Any, g: Any, acc: Any) -> tuple[Any, Any]:
            if g is None:
                return None, acc
            out, (new,) = apply_rule(
                path, g, jnp.shape(acc), (acc,), (), scaled, _WHERE, whole_rows=False, kernel=kernel
            )
            return out, new

        out, acc = map_rule(leaf, updates, [(state.sum_of_squares, "sum_of_squares")], _WHERE, 2, params)
        return out, optax.ScaleByRssState(sum_of_squares=acc)

    return stage(init_fn, update)


@compiled_when_eager
def sparse_adagrad(
    learning_rate: optax.ScalarOrSchedule,
    initial_accumulator_value: jax.typing.ArrayLike = 0.1,
    eps: jax.typing.ArrayLike = 1e-7,
) -> optax.GradientTransformationExtraArgs:
    r"""Lazy Adagrad: a drop-in for :func:`optax.adagrad` that moves only the touched entries.

    ``chain(scale_by_sparse_adagrad(...), <learning rate>)``; see
    :func:`scale_by_sparse_adagrad` for the rule, then
    :math:`p_S \leftarrow p_S - \alpha_t u_S`. Its state is
    :func:`optax.adagrad`'s, and it equals :func:`optax.adagrad` fed the
    dense gradient (zeros elsewhere) at every step, whichever rows the steps
    touch: a zero gradient does not move an entry under dense Adagrad. On
    the XLA path the parameters and accumulators are bitwise optax's where
    the update and its application are compiled apart (in one jitted step
    XLA:CPU contracts the dense ``p + (-lr) u`` into a fused multiply-add, a
    rounding apart from the sparse scatter-add), and where duplicate ids sum
    in the same order (``tests/test_adagrad.py``, 300 Zipf steps). The
    native CPU kernels (:func:`kernel_path`; :func:`update_and_apply` fuses
    the step into one pass per touched row) keep the accumulators bitwise
    and take ``1 / sqrt`` where XLA:CPU takes a refined hardware estimate of
    ``rsqrt``: each update within 3 ulps of itself. This
    is ``eps`` inside the square root, as optax places it;
    ``tf.keras.optimizers.Adagrad`` and ``torch.optim.Adagrad`` add it
    outside (:func:`sparse_rowwise_adagrad` on a table of width 1 is the
    latter).

    Args:
      learning_rate: A float or an optax schedule.
      initial_accumulator_value: Starting value of every accumulator entry.
      eps: Term added to the accumulator inside the square root.

    Returns:
      An :class:`optax.GradientTransformationExtraArgs`; apply its updates with
      :func:`optax_sparse_adam.apply_updates`.

    Examples:
      >>> import jax.numpy as jnp
      >>> import optax_sparse_adam as osa
      >>> tx = osa.sparse_adagrad(0.1)
      >>> p = jnp.ones((2, 2), jnp.float32)
      >>> g = osa.IndexedRows(jnp.array([0]), jnp.ones((1, 2), jnp.float32), 2)
      >>> u, _ = tx.update(g, tx.init(p), p)
      >>> osa.apply_updates(p, u).round(4)  # 1 - 0.1 / sqrt(1.1)
      Array([[0.9047, 0.9047],
             [1.    , 1.    ]], dtype=float32)
    """
    check_learning_rate(learning_rate)
    inner = scale_by_sparse_adagrad(initial_accumulator_value=initial_accumulator_value, eps=eps)
    # update_and_apply may fuse this chain into one pass per row: what it needs travels with tx.update.
    return with_learning_rate(inner, learning_rate, AdagradFusion(learning_rate, eps))
