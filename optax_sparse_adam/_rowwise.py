"""Row-wise optimizers: one second-moment scalar per row, lazily.

:func:`scale_by_rowwise_adam` / :func:`sparse_rowwise_adam` keep Adam's first
moment per entry and its second moment per row (FBGEMM's
``PARTIAL_ROWWISE_ADAM``), optionally with per-row bias correction;
:func:`scale_by_rowwise_adagrad` / :func:`sparse_rowwise_adagrad` keep one
Adagrad accumulator per row (FBGEMM's ``EXACT_ROWWISE_ADAGRAD``, TorchRec's
``RowWiseAdagrad``). A row is the parameter's leading axis; a 1-D
parameter's rows are its entries, so for it the row-wise rules are the
element-wise ones.

Both run the native CPU kernels where they apply (float32 tables with one
sparse axis, see :mod:`._kernel_path`; fused, bfloat16 and float16 tables too), and :func:`sparse_rowwise_adam` and
:func:`sparse_rowwise_adagrad` carry what
:func:`~optax_sparse_adam.update_and_apply` needs to fuse their step
(:class:`RowwiseAdamFusion`, :class:`RowwiseAdagradFusion`, on their ``update``).
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_sparse_adam import _ffi, _kernel_path
from optax_sparse_adam._checks import (
    check_bool,
    check_dtype,
    check_hparam,
    check_learning_rate,
    check_params,
    check_state,
    literal_zero,
)
from optax_sparse_adam._fusion import compiled_when_eager
from optax_sparse_adam._learning_rate import stage, with_learning_rate
from optax_sparse_adam._row_engine import (
    Arrays,
    Kernel,
    apply_rule,
    decayed_rule,
    map_rule,
    row_full,
    row_mean_square,
    row_shape,
    scaled_rule,
    step_factor,
)
from optax_sparse_adam._row_ops import take_rows
from optax_sparse_adam._sparse_leaf import SparseLeaf
from optax_sparse_adam._tree import broadcast_rows, param_error

__all__ = [
    "ScaleByRowwiseAdagradState",
    "ScaleByRowwiseAdamState",
    "scale_by_rowwise_adagrad",
    "scale_by_rowwise_adam",
    "sparse_rowwise_adagrad",
    "sparse_rowwise_adam",
]


class ScaleByRowwiseAdamState(NamedTuple):
    """State of :func:`scale_by_rowwise_adam`.

    Attributes:
      count: Global step count, an int32 scalar.
      mu: First moment, per entry: the parameters' shapes, in ``mu_dtype``.
      nu: Second moment, per row: shape ``p.shape[:1]`` for each parameter
        ``p`` (``()`` for a scalar), float32 for parameters of 32 bits or fewer.
      row_count: With ``per_row_bias_correction``, each row's own number of
        updates (int32, shape ``p.shape[:1]``); otherwise ``optax.EmptyState()``.
    """

    count: jax.Array  # type: ignore[assignment]  # Adam's field name, as in optax's states
    mu: optax.Updates
    nu: optax.Updates
    row_count: Any


class ScaleByRowwiseAdagradState(NamedTuple):
    """State of :func:`scale_by_rowwise_adagrad`.

    Attributes:
      sum_of_squares: Per row (shape ``p.shape[:1]``): the initial value plus
        the sum over the row's updates of the mean of ``g^2`` over the row.
    """

    sum_of_squares: optax.Updates


def _row_dtype(p: Any) -> Any:
    return jnp.promote_types(jnp.asarray(p).dtype, jnp.float32)


def rowwise_adam_scalars(b1: Any, b2: Any, eps: Any, eps_root: Any, count: Any, neg_lr: Any = 1.0) -> jax.Array:
    """The row-wise Adam kernels' scalar operand at step ``count``, each value rounded to float32 as the rule rounds
    it; ``neg_lr`` is the learning-rate scale: of the fused step's update (:func:`update_and_apply`), or of the rows
    kernel's step rows."""
    bc1, bc2 = 1 - jnp.power(b1, count), 1 - jnp.power(b2, count)  # as the rule computes them
    return _ffi.float32_scalars(b1, 1 - b1, b2, 1 - b2, eps, eps_root, bc1, bc2, neg_lr)


def rowwise_adam_corrections(b1: Any, b2: Any, row_count: jax.Array, keys: jax.Array) -> jax.Array:
    """Per-row bias correction for the kernels: ``(k, 2)``, ``1 - b1^c`` and ``1 - b2^c`` at the new count ``c`` of
    each key's row, as the rule computes them (padding keys read a count of 0)."""
    c = optax.safe_increment(take_rows(row_count, keys))
    return jnp.stack([(1 - jnp.power(b1, c)).astype(jnp.float32), (1 - jnp.power(b2, c)).astype(jnp.float32)], 1)


def rowwise_adam_per_row(b1: Any, b2: Any, row_count: jax.Array, keys: jax.Array) -> tuple[jax.Array, ...]:
    """The kernels' per-row bias correction operands: the row counts, and where the rule computes ``1 - b^c`` in
    float32 nothing more (the kernel computes them once per row, with the ``powf`` XLA:CPU calls for the rule's
    power: no gather of the counts and no power per entry in XLA); otherwise (jax's 64-bit mode with Python-float
    betas, where the rule computes them in float64) :func:`rowwise_adam_corrections` too."""
    if all(jnp.result_type(b, row_count.dtype) == jnp.float32 for b in (b1, b2)):
        return (row_count,)
    return (row_count, rowwise_adam_corrections(b1, b2, row_count, keys))


def _adam_kernel(
    b1: Any, b2: Any, eps: Any, eps_root: Any, count: jax.Array, per_row: bool, scale: Any = None
) -> Kernel:
    """The native CPU kernel in the rule's place (state: mu, nu and, with per-row bias correction, the row counts);
    its step rows come out multiplied by ``scale`` (rounded to float32 first, as ``optax.scale`` rounds it)."""

    def supports(leaf: SparseLeaf, state: Arrays, reads: Arrays) -> bool:
        return _kernel_path.supports(leaf.shape, leaf.n_sparse, state[0], state[1], leaf.values)

    def run(leaf: SparseLeaf, state: Arrays, reads: Arrays) -> tuple[jax.Array, jax.Array, Arrays]:
        keys = leaf.keys[:, 0]
        scalars = rowwise_adam_scalars(b1, b2, eps, eps_root, count, step_factor(scale))
        extra = rowwise_adam_per_row(b1, b2, state[2], keys) if per_row else None
        m, v, out_keys, step, *c = _ffi.rowwise_adam_rows(
            state[0], state[1], keys, leaf.values, scalars, extra, unique=_kernel_path.unique_flag(leaf)
        )
        return out_keys[:, None], step, (m, v, *c)

    return Kernel(supports, run)


class RowwiseAdamFusion(NamedTuple):
    """What :func:`update_and_apply` needs of a :func:`sparse_rowwise_adam` to run its step in one pass per row."""

    learning_rate: optax.ScalarOrSchedule
    b1: Any
    b2: Any
    eps: Any
    eps_root: Any
    per_row_bias_correction: bool

    def apply(
        self, p: jax.Array, state: Arrays, leaf: SparseLeaf, scalars: jax.Array, seeds: jax.Array | None = None
    ) -> tuple[jax.Array, ...]:
        """The fused kernel on one leaf: ``(p, mu, nu[, row_count])``; a 16-bit ``p`` rounded stochastically with
        ``seeds``, else to nearest."""
        keys = leaf.keys[:, 0]
        extra = None
        if self.per_row_bias_correction:
            extra = rowwise_adam_per_row(self.b1, self.b2, state[2], keys)
        return _ffi.rowwise_adam_apply(
            p, state[0], state[1], keys, leaf.values, scalars, extra, seeds, unique=_kernel_path.unique_flag(leaf)
        )


def scale_by_rowwise_adam(
    b1: jax.typing.ArrayLike = 0.9,
    b2: jax.typing.ArrayLike = 0.999,
    eps: jax.typing.ArrayLike = 1e-8,
    eps_root: jax.typing.ArrayLike = 0.0,
    mu_dtype: jax.typing.DTypeLike | None = None,
    *,
    per_row_bias_correction: bool = False,
) -> optax.GradientTransformationExtraArgs:
    r"""Rescales updates by lazy Adam with one second-moment scalar per row.

    On the touched rows :math:`S` (duplicates summed), for a row :math:`r`
    with gradient :math:`g_r` of :math:`d` entries:

    .. math::

      m_r \leftarrow \beta_1 m_r + (1 - \beta_1) g_r, \qquad
      v_r \leftarrow \beta_2 v_r + (1 - \beta_2) \tfrac{1}{d} \textstyle\sum_j |g_{rj}|^2,

    .. math::

      u_r = \frac{m_r / (1 - \beta_1^{t_r})}{\sqrt{v_r / (1 - \beta_2^{t_r}) + \epsilon_{root}} + \epsilon},

    where :math:`t_r` is the global step count, or with
    ``per_row_bias_correction`` the number of updates row :math:`r` has had
    (so that a rarely seen row is corrected for its own few updates). Rows
    outside :math:`S` are bitwise unchanged. A dense gradient touches every
    row. The state saves nearly half of Adam's memory for wide rows. A
    gradient of a narrower float dtype than the moments (a bfloat16 table's,
    with ``mu_dtype=jnp.float32``) is widened to theirs first: its duplicates
    are summed, the rule computed and the update returned in float32, as
    ``optax.adam`` with a float32 ``mu`` returns float32 updates.

    On the CPU a native kernel runs the rule for float32 tables and moments
    with sparse gradients (see :func:`kernel_path`), and
    :func:`update_and_apply` runs the step fused on bfloat16 and float16
    tables with float32 moments too. It computes the rule's
    expressions as XLA:CPU compiles them, but sums each row's squares in one
    fixed order, where XLA chooses its own by shape and CPU. One step from
    the same state, measured over widths 1 to 513: ``mu`` and the row counts
    bitwise the XLA path's, ``nu`` within 1 ulp (bitwise with the global
    bias correction), the step within 2 ulps of itself; for width 1 (no row
    sum) every number bitwise. Stated, as for row-wise Adagrad (XLA's order
    of a row sum changes with the CPU): ``nu`` within 3 ulps, the step within
    4 of itself.

    Args:
      b1: Decay rate of the first moment.
      b2: Decay rate of the second moment.
      eps: Term added to the denominator, outside the square root.
      eps_root: Term added inside the square root.
      mu_dtype: Dtype of the first moment; ``None`` uses the parameter's.
      per_row_bias_correction: Correct each row by its own update count.

    Returns:
      An :class:`optax.GradientTransformationExtraArgs` whose state is a
      :class:`ScaleByRowwiseAdamState`.

    Examples:
      >>> import jax.numpy as jnp
      >>> import optax_sparse_adam as osa
      >>> tx = osa.scale_by_rowwise_adam()
      >>> state = tx.init(jnp.zeros((3, 2), jnp.float32))
      >>> state.nu.shape
      (3,)
      >>> g = osa.IndexedRows(jnp.array([1]), jnp.array([[3.0, 4.0]], jnp.float32), 3)
      >>> updates, state = tx.update(g, state)
      >>> updates.todense()[1].tolist()  # (3, 4) / sqrt((9 + 16) / 2) at step 1
      [0.8485..., 1.1313...]

    References:
      FBGEMM's ``PARTIAL_ROWWISE_ADAM`` optimizer (``fbgemm_gpu``).
    """
    check_hparam("b1", b1, lower=0.0, lower_open=False, upper=1.0)
    check_hparam("b2", b2, lower=0.0, lower_open=False, upper=1.0)
    check_hparam("eps", eps, lower=0.0, lower_open=True)
    check_hparam("eps_root", eps_root, lower=0.0, lower_open=False)
    mu_dtype = check_dtype(mu_dtype, "mu_dtype")
    per_row_bias_correction = check_bool("per_row_bias_correction", per_row_bias_correction)
    where = "scale_by_rowwise_adam"

    def init_fn(params: optax.Params) -> ScaleByRowwiseAdamState:
        check_params(params, where)
        nu = jax.tree.map(lambda p: row_full(p, 0, _row_dtype(p)), params)
        row_count: Any = optax.EmptyState()
        if per_row_bias_correction:
            row_count = jax.tree.map(lambda p: row_full(p, 0, jnp.int32), params)
        return ScaleByRowwiseAdamState(
            count=jnp.zeros([], jnp.int32),
            mu=optax.tree.zeros_like(params, dtype=mu_dtype),
            nu=nu,
            row_count=row_count,
        )

    def update(
        updates: optax.Updates, state: ScaleByRowwiseAdamState, params: optax.Params | None, scale: Any
    ) -> tuple[optax.Updates, ScaleByRowwiseAdamState]:
        check_state(state, ScaleByRowwiseAdamState, where)
        count = optax.safe_increment(state.count)

        def rule(g: jax.Array, st: tuple[jax.Array, ...], reads: tuple[jax.Array, ...]) -> Any:
            m, v = st[0], st[1]
            m = optax.tree.update_moment(g, m, b1, 1)
            v = jnp.asarray(b2 * v + (1 - b2) * row_mean_square(g).astype(v.dtype))
            if per_row_bias_correction:
                c = optax.safe_increment(st[2])
                bc1 = broadcast_rows(1 - jnp.power(b1, c), m.ndim).astype(m.dtype)
                bc2 = (1 - jnp.power(b2, c)).astype(v.dtype)
                new: tuple[jax.Array, ...] = (m, v, c)
            else:
                bc1 = (1 - jnp.power(b1, count)).astype(m.dtype)
                bc2 = (1 - jnp.power(b2, count)).astype(v.dtype)
                new = (m, v)
            denom = jnp.sqrt(v / bc2 + eps_root) + eps
            return (m / bc1) / broadcast_rows(denom, m.ndim).astype(m.dtype), new

        scaled = scaled_rule(rule, scale)
        kernel = _adam_kernel(b1, b2, eps, eps_root, count, per_row_bias_correction, scale)

        def leaf(path: Any, g: Any, m: Any, v: Any, *c: Any) -> tuple[Any, ...]:
            if g is None:
                return None, m, v, *c
            wide = jnp.promote_types(m.dtype, v.dtype)  # float32 for a bfloat16 table with a float32 nu
            out, new = apply_rule(
                path, g, jnp.shape(m), (m, v, *c), (), scaled, where, whole_rows=True, kernel=kernel, compute_dtype=wide
            )
            return (out, *new)

        trees = [(state.mu, "mu"), (state.nu, "nu")]
        if per_row_bias_correction:
            trees.append((state.row_count, "row_count"))
        out, mu, nu, *row_count = map_rule(leaf, updates, trees, where, 3 + int(per_row_bias_correction), params)
        return out, ScaleByRowwiseAdamState(
            count=count, mu=mu, nu=nu, row_count=row_count[0] if per_row_bias_correction else state.row_count
        )

    return stage(init_fn, update)


@compiled_when_eager
def sparse_rowwise_adam(
    learning_rate: optax.ScalarOrSchedule,
    b1: jax.typing.ArrayLike = 0.9,
    b2: jax.typing.ArrayLike = 0.999,
    eps: jax.typing.ArrayLike = 1e-8,
    eps_root: jax.typing.ArrayLike = 0.0,
    mu_dtype: jax.typing.DTypeLike | None = None,
    *,
    per_row_bias_correction: bool = False,
) -> optax.GradientTransformationExtraArgs:
    r"""Lazy Adam with a row-wise second moment (FBGEMM's ``PARTIAL_ROWWISE_ADAM``).

    ``chain(scale_by_rowwise_adam(...), <learning rate>)``; see
    :func:`scale_by_rowwise_adam` for the rule, then
    :math:`p_S \leftarrow p_S - \alpha_t u_S`.

    Args:
      learning_rate: A float or an optax schedule.
      b1: Decay rate of the first moment.
      b2: Decay rate of the second moment.
      eps: Term added to the denominator, outside the square root.
      eps_root: Term added inside the square root.
      mu_dtype: Dtype of the first moment; ``None`` uses the parameter's.
      per_row_bias_correction: Correct each row by its own update count.

    Returns:
      An :class:`optax.GradientTransformationExtraArgs`.

    Examples:
      >>> import jax.numpy as jnp
      >>> import optax_sparse_adam as osa
      >>> tx = osa.sparse_rowwise_adam(0.1)
      >>> p = jnp.ones((2, 2), jnp.float32)
      >>> g = osa.IndexedRows(jnp.array([0]), jnp.ones((1, 2), jnp.float32), 2)
      >>> u, _ = tx.update(g, tx.init(p), p)
      >>> osa.apply_updates(p, u).round(3)
      Array([[0.9, 0.9],
             [1. , 1. ]], dtype=float32)
    """
    check_learning_rate(learning_rate)
    inner = scale_by_rowwise_adam(
        b1=b1, b2=b2, eps=eps, eps_root=eps_root, mu_dtype=mu_dtype, per_row_bias_correction=per_row_bias_correction
    )
    # update_and_apply may fuse this chain into one pass per row: what it needs travels with tx.update.
    fusion = RowwiseAdamFusion(learning_rate, b1, b2, eps, eps_root, per_row_bias_correction)
    return with_learning_rate(inner, learning_rate, fusion)


def adagrad_scalars(eps: Any, weight_decay: Any, neg_lr: Any) -> jax.Array:
    """The row-wise Adagrad kernels' scalar operand, each value rounded to float32 as the rule rounds it.

    ``neg_lr`` is the learning-rate scale: of the fused step's update (:func:`update_and_apply`), or of the rows
    kernel's step rows (1 for the stage's own).
    """
    return _ffi.float32_scalars(eps, weight_decay, neg_lr)


def _adagrad_kernel(eps: Any, weight_decay: Any, decays: bool, scale: Any = None, decoupled: Any = None) -> Kernel:
    """The native CPU kernel in the rule's place (it reads the parameters for weight decay); its step rows come out
    multiplied by ``scale`` (rounded to float32 first, as ``optax.scale`` rounds it to the update's dtype). With
    ``decoupled``, a weight decay, the rule of :func:`._row_engine.decayed_rule` (the step rows plus ``decoupled``
    times the parameters' rows, before the scale)."""

    def supports(leaf: SparseLeaf, state: Arrays, reads: Arrays) -> bool:
        return _kernel_path.supports(leaf.shape, leaf.n_sparse, *state, *reads, leaf.values)

    def run(leaf: SparseLeaf, state: Arrays, reads: Arrays) -> tuple[jax.Array, jax.Array, Arrays]:
        wd = weight_decay if decays else 0.0 if decoupled is None else decoupled
        scalars = adagrad_scalars(eps, wd, step_factor(scale))
        acc, keys, step = _ffi.rowwise_adagrad_rows(
            state[0],
            leaf.keys[:, 0],
            leaf.values,
            scalars,
            reads[0] if reads else None,
            unique=_kernel_path.unique_flag(leaf),
            decoupled=decoupled is not None,
        )
        return keys[:, None], step, (acc,)

    return Kernel(supports, run)


def scale_by_rowwise_adagrad(
    eps: jax.typing.ArrayLike = 1e-10,
    initial_accumulator_value: jax.typing.ArrayLike = 0.0,
    weight_decay: jax.typing.ArrayLike = 0.0,
) -> optax.GradientTransformationExtraArgs:
    r"""Rescales updates by lazy row-wise Adagrad: one accumulator scalar per row.

    On the touched rows :math:`S` (duplicates summed), for a row :math:`r` of
    :math:`d` entries, with L2 weight decay :math:`\lambda` folded into the
    gradient as FBGEMM's ``weight_decay_mode=L2`` does:

    .. math::

      g_r \leftarrow g_r + \lambda p_r, \qquad
      a_r \leftarrow a_r + \tfrac{1}{d} \textstyle\sum_j g_{rj}^2, \qquad
      u_r = \frac{g_r}{\sqrt{a_r} + \epsilon}.

    Rows outside :math:`S` are bitwise unchanged. A 1-D parameter, or a table
    of width 1, gets element-wise Adagrad as ``torch.optim.Adagrad`` computes
    it (``eps`` outside the square root).

    A gradient of a narrower float dtype than the accumulators (a bfloat16 table's, with float32 accumulators) is
    widened to theirs first: its duplicates are summed, the rule computed and the update returned in float32.

    On the CPU a native kernel runs the rule for float32 tables with sparse
    gradients (see :func:`kernel_path`), and :func:`update_and_apply` runs the step fused on bfloat16 and float16
    tables too. It computes the rule's expressions
    as XLA:CPU compiles them, but sums each row's squares in one fixed order,
    where XLA chooses its own by shape and CPU. One step from the same state,
    measured over widths 1 to 513: the accumulators within 3 ulps of the XLA
    path's (4 with L2 weight decay; bitwise for width 1 without it), the step
    within 4 ulps of itself. With L2 decay and duplicate keys, XLA adds
    :math:`\lambda p_r` before a row's entries in small batches and after
    them in large ones, the kernel after them as the rule reads; there the
    step differs by the rounding of that sum, an ulp of
    :math:`|\lambda p_r| + \sum_e |g_e|` over :math:`\sqrt{a_r} + \epsilon`.

    Args:
      eps: Term added to the denominator, outside the square root.
      initial_accumulator_value: Starting value of every row's accumulator.
      weight_decay: L2 penalty added to the gradient (needs ``params``).

    Returns:
      An :class:`optax.GradientTransformationExtraArgs` whose state is a
      :class:`ScaleByRowwiseAdagradState`.

    Examples:
      >>> import jax.numpy as jnp
      >>> import optax_sparse_adam as osa
      >>> tx = osa.scale_by_rowwise_adagrad()
      >>> state = tx.init(jnp.zeros((3, 2), jnp.float32))
      >>> g = osa.IndexedRows(jnp.array([1]), jnp.array([[3.0, 4.0]], jnp.float32), 3)
      >>> updates, state = tx.update(g, state)
      >>> updates.todense()[1].tolist()  # (3, 4) / sqrt((9 + 16) / 2)
      [0.848528..., 1.131370...]
      >>> state.sum_of_squares
      Array([ 0. , 12.5,  0. ], dtype=float32)

    References:
      Duchi, Hazan and Singer, `Adaptive Subgradient Methods
      <https://jmlr.org/papers/v12/duchi11a.html>`_, 2011; FBGEMM's
      ``EXACT_ROWWISE_ADAGRAD`` and TorchRec's ``RowWiseAdagrad``.
    """
    check_hparam("eps", eps, lower=0.0, lower_open=True)
    check_hparam("initial_accumulator_value", initial_accumulator_value, lower=0.0, lower_open=False)
    check_hparam("weight_decay", weight_decay, lower=0.0, lower_open=False)
    where = "scale_by_rowwise_adagrad"

    def init_fn(params: optax.Params) -> ScaleByRowwiseAdagradState:
        check_params(params, where)
        return ScaleByRowwiseAdagradState(
            sum_of_squares=jax.tree.map(lambda p: row_full(p, initial_accumulator_value, _row_dtype(p)), params)
        )

    def update(
        updates: optax.Updates,
        state: ScaleByRowwiseAdagradState,
        params: optax.Params | None,
        scale: Any,
        decay: tuple[Any, Any] | None = None,
    ) -> tuple[optax.Updates, ScaleByRowwiseAdagradState]:
        """The stage's update, its updates times ``scale``; with ``decay``, ``(weight_decay, flags)`` (a bool a
        leaf of the parameters), each flagged leaf's updates first plus ``weight_decay`` times its parameters
        (``sparse_rowwise_adagrad(weight_decay_mode="decoupled")``'s decay stage, in the rule's pass)."""
        check_state(state, ScaleByRowwiseAdagradState, where)
        decays = not literal_zero(weight_decay)
        assert not (decays and decay is not None), "L2 decay or a decay stage after the rule, not both"
        if decays and params is None:
            raise ValueError(f"{where}: weight_decay needs the parameters: call update(grads, state, params)")

        def rule(g: jax.Array, st: tuple[jax.Array, ...], reads: tuple[jax.Array, ...]) -> Any:
            (acc,) = st
            if decays:
                g = g + weight_decay * reads[0].astype(g.dtype)
            acc = acc + row_mean_square(g).astype(acc.dtype)
            return g / broadcast_rows(jnp.sqrt(acc) + eps, g.ndim).astype(g.dtype), (acc,)

        later: Any = None if decay is None else decay[0]  # the decay stage's weight decay
        scaled = {False: scaled_rule(rule, scale), True: scaled_rule(decayed_rule(rule, later), scale)}
        kernels = {
            False: _adagrad_kernel(eps, weight_decay, decays, scale),
            True: _adagrad_kernel(eps, 0.0, False, scale, later),
        }

        def leaf(path: Any, g: Any, acc: Any, *p: Any) -> tuple[Any, ...]:
            if g is None:
                return None, acc
            shape = tuple(jnp.shape(p[0]) if p else jnp.shape(g) if not hasattr(g, "shape") else g.shape)
            if not p and row_shape(shape) != acc.shape:  # given the parameters, apply_rule checks the state
                raise param_error(
                    ValueError, where, path, f"gradient shape {shape} does not fit the accumulator's shape {acc.shape}"
                )
            after = decay is not None and bool(p[1])  # this leaf takes the decay stage
            reads = p[:1] if decays or after else ()
            out, (new,) = apply_rule(
                path,
                g,
                shape,
                (acc,),
                reads,
                scaled[after],
                where,
                whole_rows=True,
                kernel=kernels[after],
                compute_dtype=acc.dtype,
            )
            return out, new

        trees = [(state.sum_of_squares, "sum_of_squares")]
        if params is not None:
            trees.append((params, "parameters"))
        if decay is not None:
            trees.append((decay[1], "mask"))
        out, acc = map_rule(leaf, updates, trees, where, 2)
        return out, ScaleByRowwiseAdagradState(sum_of_squares=acc)

    return stage(init_fn, update)


WeightDecayMode = Literal["l2", "decoupled"]


class RowwiseAdagradFusion(NamedTuple):
    """What :func:`update_and_apply` needs of a :func:`sparse_rowwise_adagrad` to run its step in one pass per row.

    ``decay``: the apply kernel's mode, 0 none, 1 L2 (in the gradient), 2 decoupled (added to the step).
    """

    learning_rate: optax.ScalarOrSchedule
    eps: Any
    weight_decay: Any
    decay: int


@compiled_when_eager
def sparse_rowwise_adagrad(
    learning_rate: optax.ScalarOrSchedule,
    eps: jax.typing.ArrayLike = 1e-10,
    initial_accumulator_value: jax.typing.ArrayLike = 0.0,
    weight_decay: jax.typing.ArrayLike = 0.0,
    *,
    weight_decay_mode: WeightDecayMode = "l2",
) -> optax.GradientTransformationExtraArgs:
    r"""Lazy row-wise Adagrad, as FBGEMM's ``EXACT_ROWWISE_ADAGRAD`` and TorchRec's ``RowWiseAdagrad``.

    See :func:`scale_by_rowwise_adagrad` for the rule; then
    :math:`p_S \leftarrow p_S - \alpha_t u_S`. With
    ``weight_decay_mode="decoupled"`` the decay is not folded into the
    gradient but applied to the touched rows as
    :math:`p_S \leftarrow p_S - \alpha_t (u_S + \lambda p_S)` (FBGEMM's
    ``DECOUPLE`` mode). :func:`~optax_sparse_adam.update_and_apply` runs its
    step in one pass per touched row where the native CPU kernels apply.

    Args:
      learning_rate: A float or an optax schedule.
      eps: Term added to the denominator, outside the square root.
      initial_accumulator_value: Starting value of every row's accumulator.
      weight_decay: Weight decay :math:`\lambda` (0 for none).
      weight_decay_mode: ``"l2"`` or ``"decoupled"``.

    Returns:
      An :class:`optax.GradientTransformationExtraArgs`.

    Examples:
      >>> import jax.numpy as jnp
      >>> import optax_sparse_adam as osa
      >>> tx = osa.sparse_rowwise_adagrad(0.1)
      >>> p = jnp.ones((2, 2), jnp.float32)
      >>> g = osa.IndexedRows(jnp.array([0]), jnp.ones((1, 2), jnp.float32), 2)
      >>> u, _ = tx.update(g, tx.init(p), p)
      >>> osa.apply_updates(p, u).round(3)
      Array([[0.9, 0.9],
             [1. , 1. ]], dtype=float32)
    """
    check_learning_rate(learning_rate)
    if weight_decay_mode not in ("l2", "decoupled"):
        raise ValueError(f"Invalid weight_decay_mode: {weight_decay_mode!r}; it must be 'l2' or 'decoupled'")
    if weight_decay_mode == "l2":
        # As the rule decides: a literal 0 reads no parameters.
        decay = 0 if literal_zero(weight_decay) else 1
        # update_and_apply may fuse this chain into one pass per row: what it needs travels with tx.update.
        fusion = RowwiseAdagradFusion(learning_rate, eps, weight_decay, decay)
        inner = scale_by_rowwise_adagrad(eps, initial_accumulator_value, weight_decay)
        return with_learning_rate(inner, learning_rate, fusion)
    # Decoupled decay: a stage between the rule and the learning rate (chain(rule, sparse_aware(
    # add_decayed_weights), sparse_aware(scale_by_learning_rate))), taken in the rule's pass as the learning rate is.
    check_hparam("weight_decay", weight_decay, lower=0.0, lower_open=False)
    inner = scale_by_rowwise_adagrad(eps, initial_accumulator_value)
    # add_decayed_weights skips a literal 0 (the step as it is, even where p is not finite): so does the fused kernel.
    decay = 0 if literal_zero(weight_decay) else 2
    fusion = RowwiseAdagradFusion(learning_rate, eps, weight_decay, decay)
    return with_learning_rate(inner, learning_rate, fusion, weight_decay=weight_decay, where="sparse_rowwise_adagrad")
