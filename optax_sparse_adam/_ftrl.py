"""Lazy FTRL-proximal: :func:`sparse_ftrl`, TensorFlow's FTRL on the rows a gradient touches.

FTRL keeps two arrays per entry, an accumulator of squared gradients and a
``linear`` term, and *recomputes* the parameter from them at every update
(it reads the parameter only through the ``linear`` term's correction), so
the transformation holds the learning rate and its ``update`` needs the
parameters. Its update is the new parameter minus the old.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_sparse_adam import _ffi, _kernel_path
from optax_sparse_adam._checks import check_hparam, check_params, check_state
from optax_sparse_adam._fusion import FusableUpdate, compiled_when_eager
from optax_sparse_adam._row_engine import Arrays, Kernel, apply_rule, at_count, elementwise_kernel, map_rule
from optax_sparse_adam._sparse_leaf import SparseLeaf
from optax_sparse_adam._tree import param_error

__all__ = ["FtrlState", "sparse_ftrl"]

_WHERE = "sparse_ftrl"


class FtrlState(NamedTuple):
    """State of :func:`sparse_ftrl`.

    Attributes:
      count: Global step count, an int32 scalar (the learning-rate schedule's step).
      accumulator: Per entry (the parameters' shapes and dtypes): the initial
        value plus the sum of the squared gradients.
      linear: Per entry: FTRL's linear term (TensorFlow's ``linear`` slot,
        ``z`` in McMahan et al.), zero at first.
    """

    count: jax.Array  # type: ignore[assignment]  # Adam's field name, as in optax's states
    accumulator: optax.Updates
    linear: optax.Updates


def _is_zero(x: Any) -> bool:
    """Whether ``x`` is a concrete zero (a literal that lets the rule skip a term)."""
    return isinstance(x, int | float | np.number) and x == 0


class FtrlFusion(NamedTuple):
    """What :func:`update_and_apply` needs of a :func:`sparse_ftrl` to run its step in one pass per row.

    ``root``: how the kernels take :math:`n^{-c}`: 0 ``powf``, 1 ``sqrt``, 2 ``sqrt`` where :math:`c = -1/2` at
    run time (a traced power, as the rule's ``jnp.where``); ``shrinks``: whether the rule adds the shrinkage.
    """

    learning_rate: optax.ScalarOrSchedule
    hyperparams: tuple[Any, ...]  # l1, l2, l2 shrinkage, beta, learning_rate_power
    shrinks: bool
    root: int
    native: bool = True  # False where XLA rewrites the power into products (-c of 1, 2 or 3): the XLA path runs

    def rate(self, state: Any) -> Any:
        """The learning rate of the step from ``state`` (a chain's, holding an :class:`FtrlState`), as the rule
        takes it: the constant itself, or the schedule's value at the step count."""
        return at_count(self.learning_rate, optax.tree.get(state, "FtrlState").count)

    def scalars(self, lr: Any) -> tuple[jax.Array, bool]:
        """The kernels' scalar operand at learning rate ``lr`` and their ``divides`` flag.

        The scalars: ``1 / alpha`` (``alpha`` where the flag is set), ``l1``, ``2 (l2 + beta / (2 alpha))``,
        ``2 l2_shrinkage`` and ``c``, each as the rule computes it in float32. XLA divides by a learning rate it
        computes at run time (a schedule's, an injected one) and multiplies by the reciprocal of a constant one.
        """
        l1, l2, l2s, b, c = (jnp.asarray(x, jnp.float32) for x in self.hyperparams)
        alpha = jnp.asarray(lr, jnp.float32)
        divides = isinstance(lr, jax.core.Tracer)
        return jnp.stack([alpha if divides else 1 / alpha, l1, 2 * (l2 + b / (2 * alpha)), 2 * l2s, c]), divides

    def kernel(self, lr: Any) -> Kernel:
        """The native CPU kernel in the rule's place at learning rate ``lr`` (it reads the parameters)."""
        scalars, divides = self.scalars(lr)
        return elementwise_kernel("ftrl", scalars, root=self.root, shrinks=self.shrinks, divides=divides)

    def apply(
        self, p: jax.Array, st: Arrays, sp: SparseLeaf, scalars: jax.Array, divides: bool
    ) -> tuple[jax.Array, ...]:
        """The fused kernel on one leaf: ``(p, accumulator, linear)``, given :meth:`scalars` (the clipping's after
        the rule's)."""
        return _ffi.elementwise_apply(
            "ftrl",
            p,
            st,
            sp.keys[:, 0],
            sp.values,
            scalars,
            root=self.root,
            shrinks=self.shrinks,
            divides=divides,
            unique=_kernel_path.unique_flag(sp),
        )


@compiled_when_eager
def sparse_ftrl(
    learning_rate: optax.ScalarOrSchedule,
    learning_rate_power: jax.typing.ArrayLike = -0.5,
    initial_accumulator_value: jax.typing.ArrayLike = 0.1,
    l1_regularization_strength: jax.typing.ArrayLike = 0.0,
    l2_regularization_strength: jax.typing.ArrayLike = 0.0,
    l2_shrinkage_regularization_strength: jax.typing.ArrayLike = 0.0,
    beta: jax.typing.ArrayLike = 0.0,
) -> optax.GradientTransformationExtraArgs:
    r"""Lazy FTRL-proximal, as ``tf.keras.optimizers.Ftrl`` and TensorFlow's ``SparseApplyFtrlV2`` compute it.

    On the touched set :math:`S` (rows or entries, duplicates summed), with
    :math:`\alpha` the learning rate, :math:`c` ``learning_rate_power``,
    :math:`\lambda_1, \lambda_2, \lambda_s` the L1, L2 and L2-shrinkage
    strengths, :math:`p` the parameters, :math:`n` the accumulator and
    :math:`z` the linear term:

    .. math::

      \tilde g = g + 2 \lambda_s p, \qquad n' = n + g^2, \qquad
      z \leftarrow z + \tilde g - \frac{n'^{-c} - n^{-c}}{\alpha} \, p,

    .. math::

      p \leftarrow \begin{cases}
        \dfrac{\lambda_1 \operatorname{sign}(z) - z}{n'^{-c} / \alpha + 2 \lambda_2'} & |z| > \lambda_1 \\
        0 & \text{else,}
      \end{cases}
      \qquad \lambda_2' = \lambda_2 + \frac{\beta}{2 \alpha}, \qquad n \leftarrow n',

    with :math:`n'^{-c}` computed as :math:`\sqrt{n'}` for :math:`c = -1/2`,
    as TensorFlow does. These are the expressions, in their order, of
    TensorFlow's ``ApplyFtrlV2`` kernel (``tensorflow/core/kernels/
    training_ops.cc``) with the L2 strength ``tf.keras.optimizers.Ftrl``
    passes it (:math:`\lambda_2'`, which folds in ``beta``; Keras 3's
    ``keras/src/optimizers/ftrl.py`` computes the same). jax-tpu-embedding's
    FTRL (``FTRLOptimizerSpec``) is this rule without L2 shrinkage, with
    :math:`\beta` added to :math:`n'^{-c}` before the division by
    :math:`\alpha` (equal in exact arithmetic) and weight decay and clipping
    of its own. The update is the new parameter minus the old one, so that
    :func:`~optax_sparse_adam.apply_updates` lands on the new parameter to
    within one float32 rounding (exactly where the two are within a factor 2
    of each other).

    Outside :math:`S` nothing changes (the parameters, the accumulator and
    the linear term are bitwise as they were), as in TensorFlow's sparse
    kernel (``SparseApplyFtrlV2``, which Keras runs for ``IndexedSlices``
    gradients: "shrinkage will only happen on the active weights"). A dense
    gradient leaf touches every entry: it is TensorFlow's dense kernel.

    **Lazy and dense FTRL.** A zero gradient leaves :math:`n` and (with
    :math:`\lambda_s = 0`) :math:`z` exactly as they are, and the dense
    kernel's :math:`p` is a function of :math:`(z, n, \alpha)`: after an
    entry's first update, recomputing it gives the value it already holds.
    So with a constant learning rate, :math:`\lambda_s = 0` and parameters
    that start at zero (FTRL's usual start), this equals TensorFlow's dense
    kernel fed the dense gradient, zeros elsewhere, to the rounding of
    applying the update. It differs from the dense kernel (not from the
    sparse one) where the dense kernel moves entries with a zero gradient:
    with :math:`\lambda_s > 0` (each zero-gradient step adds
    :math:`2 \lambda_s p` to :math:`z`), with a learning-rate schedule
    (:math:`p` is recomputed with each step's :math:`\alpha`), and for a
    parameter that starts nonzero, which the dense kernel's first step sets
    to :math:`0` (:math:`z = 0`) while the lazy rule keeps it until the
    entry's first update.

    On the CPU native kernels run the rule for float32 tables and state
    with sparse gradients of one sparse axis (see :func:`kernel_path`),
    bitwise the XLA path's, and :func:`~optax_sparse_adam.update_and_apply`
    runs the step in one pass per touched row; but for a
    ``learning_rate_power`` of -1, -2 or -3, whose powers XLA:CPU turns into
    products rounded its own way: those run the XLA path.

    Args:
      learning_rate: A float or an optax schedule (of the step count).
      learning_rate_power: :math:`c \le 0`; :math:`-1/2` is Adagrad's
        scaling, :math:`0` a fixed learning rate.
      initial_accumulator_value: Starting value of every accumulator entry
        (:math:`\ge 0`).
      l1_regularization_strength: :math:`\lambda_1 \ge 0`.
      l2_regularization_strength: :math:`\lambda_2 \ge 0`, the stabilizing
        penalty of the proximal step.
      l2_shrinkage_regularization_strength: :math:`\lambda_s \ge 0`, an L2
        penalty on the parameter added to the gradient.
      beta: :math:`\beta \ge 0` of McMahan et al.

    Returns:
      An :class:`optax.GradientTransformationExtraArgs` whose state is an
      :class:`FtrlState`; its ``update`` needs ``params``, and its output is
      the final update (put other transformations before it, not after).

    Examples:
      >>> import jax.numpy as jnp
      >>> import optax_sparse_adam as osa
      >>> p = jnp.zeros((2, 2), jnp.float32)
      >>> g = osa.IndexedRows(jnp.array([0]), jnp.array([[1.0, -2.0]], jnp.float32), 2)
      >>> tx = osa.sparse_ftrl(0.1)
      >>> u, state = tx.update(g, tx.init(p), p)
      >>> osa.apply_updates(p, u).round(4)  # -0.1 g / sqrt(0.1 + g^2)
      Array([[-0.0953,  0.0988],
             [ 0.    ,  0.    ]], dtype=float32)
      >>> tx = osa.sparse_ftrl(0.1, l1_regularization_strength=1.5)
      >>> u, state = tx.update(g, tx.init(p), p)
      >>> osa.apply_updates(p, u).round(4)  # |z| = 1 <= 1.5 stays at 0
      Array([[0.    , 0.0247],
             [0.    , 0.    ]], dtype=float32)
      >>> state.linear[0]
      Array([ 1., -2.], dtype=float32)

    References:
      McMahan et al., `Ad Click Prediction: a View from the Trenches
      <https://research.google.com/pubs/archive/41159.pdf>`_, 2013
      (Algorithm 1); TensorFlow's ``ApplyFtrlV2`` and ``SparseApplyFtrlV2``
      kernels and ``tf.keras.optimizers.Ftrl``.
    """
    check_hparam("learning_rate", learning_rate, lower=0.0, lower_open=True)
    check_hparam("learning_rate_power", learning_rate_power, lower=-math.inf, lower_open=True)
    if not isinstance(learning_rate_power, jax.core.Tracer) and float(np.asarray(learning_rate_power)) > 0:
        raise ValueError(f"Invalid learning_rate_power: {learning_rate_power!r}; it must be <= 0")
    check_hparam("initial_accumulator_value", initial_accumulator_value, lower=0.0, lower_open=False)
    check_hparam("l1_regularization_strength", l1_regularization_strength, lower=0.0, lower_open=False)
    check_hparam("l2_regularization_strength", l2_regularization_strength, lower=0.0, lower_open=False)
    check_hparam(
        "l2_shrinkage_regularization_strength", l2_shrinkage_regularization_strength, lower=0.0, lower_open=False
    )
    check_hparam("beta", beta, lower=0.0, lower_open=False)
    shrinks = not _is_zero(l2_shrinkage_regularization_strength)
    power = learning_rate_power
    # TensorFlow takes a square root where the power is -1/2; a traced power chooses at run time.
    static_sqrt = None if isinstance(power, jax.core.Tracer | jax.Array) else float(np.asarray(power)) == -0.5

    hyperparams = (
        l1_regularization_strength,
        l2_regularization_strength,
        l2_shrinkage_regularization_strength,
        beta,
        power,
    )
    # XLA:CPU rewrites x ** 1, x ** 2 and x ** 3 into products, and rounds them and what reads them its own way.
    native = static_sqrt is None or float(np.asarray(power)) not in (-1.0, -2.0, -3.0)
    fusion = FtrlFusion(learning_rate, hyperparams, shrinks, 2 if static_sqrt is None else int(static_sqrt), native)

    def init_fn(params: optax.Params) -> FtrlState:
        check_params(params, _WHERE)
        return FtrlState(
            count=jnp.zeros([], jnp.int32),
            accumulator=optax.tree.full_like(params, initial_accumulator_value),
            linear=optax.tree.zeros_like(params),
        )

    def update_fn(
        updates: optax.Updates, state: FtrlState, params: optax.Params | None = None, **extra_args: Any
    ) -> tuple[optax.Updates, FtrlState]:
        del extra_args
        check_state(state, FtrlState, _WHERE)
        if params is None:
            raise ValueError(
                f"{_WHERE}: FTRL recomputes the parameters from its state: call update(grads, state, params)"
            )
        lr = at_count(learning_rate, state.count)

        def rule(g: jax.Array, st: tuple[jax.Array, ...], reads: tuple[jax.Array, ...]) -> Any:
            (n, z), (p,) = st, reads
            dtype = jnp.promote_types(jnp.promote_types(p.dtype, n.dtype), jnp.float32)
            g, n, z, p = (x.astype(dtype) for x in (g, n, z, p))
            alpha, l1, l2, l2s, b, c = (
                jnp.asarray(x, dtype)
                for x in (
                    lr,
                    l1_regularization_strength,
                    l2_regularization_strength,
                    l2_shrinkage_regularization_strength,
                    beta,
                    power,
                )
            )

            def scaled(x: jax.Array) -> jax.Array:  # x ** -c
                if static_sqrt is not None:
                    return jnp.sqrt(x) if static_sqrt else jnp.power(x, -c)
                return jnp.where(c == -0.5, jnp.sqrt(x), jnp.power(x, -c))

            g_shrunk = g + 2 * l2s * p if shrinks else g
            n_new = n + g * g
            root_new = scaled(n_new)
            z = z + (g_shrunk - (root_new - scaled(n)) / alpha * p)
            quadratic = root_new / alpha + 2 * (l2 + b / (2 * alpha))
            p_new = jnp.where(jnp.abs(z) > l1, (l1 * jnp.sign(z) - z) / quadratic, 0)
            return p_new - p, (n_new, z)

        def leaf(path: Any, g: Any, n: Any, z: Any, p: Any) -> tuple[Any, Any, Any]:
            if g is None:
                return None, n, z
            if jnp.shape(n) != jnp.shape(p) or jnp.shape(z) != jnp.shape(p):
                raise param_error(
                    ValueError,
                    _WHERE,
                    path,
                    f"the accumulator has shape {jnp.shape(n)} and the linear term {jnp.shape(z)} but the parameter "
                    f"has shape {jnp.shape(p)}: the state was built for other parameters; build it with `tx.init`",
                )
            out, (n, z) = apply_rule(
                path,
                g,
                jnp.shape(p),
                (n, z),
                (p,),
                rule,
                _WHERE,
                whole_rows=False,
                kernel=fusion.kernel(lr) if fusion.native else None,
            )
            return out, n, z

        trees = [(state.accumulator, "accumulator"), (state.linear, "linear"), (params, "parameters")]
        out, accumulator, linear = map_rule(leaf, updates, trees, _WHERE, 3)
        return out, FtrlState(count=optax.safe_increment(state.count), accumulator=accumulator, linear=linear)

    # update_and_apply may fuse the step into one pass per row: what it needs travels with update.
    return optax.GradientTransformationExtraArgs(init_fn, FusableUpdate(update_fn, fusion))
