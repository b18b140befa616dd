"""Lazy (sparse) Adam: :func:`scale_by_sparse_adam` and :func:`sparse_adam`.

Adam is a rule on the lazy-row engine (:mod:`._row_engine`), with the native
CPU kernel as the rule's stand-in where it applies; dense leaves that no
``lazy_dense`` mask selects take :func:`optax.scale_by_adam` itself, so that
they equal :func:`optax.adam` bitwise (with ``eps_placement="torch"``,
``torch.optim.Adam``'s rule). :func:`sparse_adam` carries what
:func:`~optax_sparse_adam.update_and_apply` needs to fuse it
(:class:`AdamFusion`, on its ``update``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, Literal, NamedTuple, TypedDict

import jax
import jax.numpy as jnp
import optax

from optax_sparse_adam import _ffi, _kernel_path
from optax_sparse_adam._checks import (
    check_bool,
    check_dense_gradient,
    check_dtype,
    check_hparam,
    check_learning_rate,
    check_mask,
    check_params,
    check_state,
    mask_tree,
)
from optax_sparse_adam._fusion import compiled_when_eager
from optax_sparse_adam._indexed_rows import is_sparse
from optax_sparse_adam._learning_rate import stage, with_learning_rate
from optax_sparse_adam._row_engine import (
    Arrays,
    Kernel,
    Rule,
    apply_rule,
    decayed_rule,
    map_rule,
    scaled_rule,
    step_factor,
    touched_rows,
)
from optax_sparse_adam._sparse_leaf import SparseLeaf
from optax_sparse_adam._tree import is_leaf, param_error

__all__ = ["scale_by_sparse_adam", "sparse_adam"]

EpsPlacement = Literal["optax", "torch"]
MaskOrFn = bool | Any | Callable[[optax.Params], Any]
_WHERE = "scale_by_sparse_adam"


class AdamHyperparams(NamedTuple):
    """The hyperparameters the rule reads (possibly traced under ``inject_hyperparams``)."""

    b1: Any
    b2: Any
    eps: Any
    eps_root: Any
    maximize: bool
    eps_placement: EpsPlacement
    log_b1: float | None  # log(b1) in double where b1 is a concrete number, else None (see _torch_corrections)
    log_b2: float | None


def _moments(g: jax.Array, m: jax.Array, v: jax.Array, hp: AdamHyperparams) -> tuple[jax.Array, jax.Array]:
    """Adam's new moments, with optax's own expressions (``|g|^2`` for complex ``g``)."""
    if hp.maximize:
        g = -g
    return optax.tree.update_moment(g, m, hp.b1, 1), optax.tree.update_moment_per_elem_norm(g, v, hp.b2, 2)


def _log_beta(b: Any) -> float | None:
    """``log(b)`` in double for a concrete ``b`` (``-inf`` for 0); ``None`` for a JAX array, perhaps traced."""
    if isinstance(b, jax.Array):
        return None
    b = float(b)
    return math.log(b) if b > 0 else -math.inf


def _torch_corrections(hp: AdamHyperparams, count: jax.Array) -> tuple[jax.Array, jax.Array]:
    """torch's bias corrections ``1 - b1**t`` and ``1 - b2**t``, accurate to float32 rounding.

    torch computes them in double from the betas as given. ``1 - b**t`` in
    float32, from a ``b`` rounded to float32, is off by up to ``t`` ulps of
    ``b`` relative to ``1 - b**t`` (about 1e-5 at ``b2 = 0.999``); instead,
    ``-expm1(t log b)``, with ``log b`` taken in double at construction where
    ``b`` is a number, and in float32 at run time where it is an array
    (``inject_hyperparams``), is within a few float32 ulps of torch's value.
    """
    t = count.astype(jnp.float32)

    def correction(b: Any, log_b: float | None) -> jax.Array:
        log = jnp.log(jnp.asarray(b).astype(jnp.float32)) if log_b is None else log_b
        return -jnp.expm1(t * log)

    return correction(hp.b1, hp.log_b1), correction(hp.b2, hp.log_b2)


def _step(m: jax.Array, v: jax.Array, count: jax.Array, hp: AdamHyperparams) -> jax.Array:
    """Adam's step from the new moments on sparse and ``lazy_dense`` leaves, for either placement of ``eps``."""
    if hp.eps_placement == "optax":
        m_hat = optax.tree.bias_correction(m, hp.b1, count)
        v_hat = optax.tree.bias_correction(v, hp.b2, count)
        return m_hat / (jnp.sqrt(v_hat + hp.eps_root) + hp.eps)
    bc1, bc2 = _torch_corrections(hp, count)
    scale = jnp.sqrt(bc2) / bc1  # torch.optim.SparseAdam's step scale; kernel_scalars computes it alike
    return scale.astype(m.dtype) * m / (jnp.sqrt(v + hp.eps_root) + hp.eps)


def _rule(hp: AdamHyperparams, count: jax.Array) -> Rule:
    """Adam on the touched rows: ``(step, (mu, nu))``."""

    def rule(g: jax.Array, state: Arrays, reads: Arrays) -> tuple[jax.Array, Arrays]:
        m, v = _moments(g, state[0], state[1], hp)
        return _step(m, v, count, hp), (m, v)

    return rule


def _lazy_rule(hp: AdamHyperparams, count: jax.Array) -> Rule:
    """Adam on the rows of a dense gradient that hold a nonzero (or NaN); other rows stay bitwise.

    The step is computed from the selected moments, so that XLA updates the
    donated moments in place: a step read from the old moments would need a
    copy of each (two table-sized temporaries).
    """

    def rule(g: jax.Array, state: Arrays, reads: Arrays) -> tuple[jax.Array, Arrays]:
        touched = touched_rows(g)
        m, v = _moments(g, state[0], state[1], hp)
        m, v = jnp.where(touched, m, state[0]), jnp.where(touched, v, state[1])
        return jnp.where(touched, _step(m, v, count, hp), jnp.zeros((), g.dtype)), (m, v)

    return rule


def _as_dense_struct(x: Any) -> Any:
    """A sparse leaf as the ``jax.ShapeDtypeStruct`` of its dense equivalent; anything else as it is."""
    return jax.ShapeDtypeStruct(x.shape, x.dtype) if is_sparse(x) else x


def kernel_scalars(hp: AdamHyperparams, count: jax.Array, neg_lr: Any = 1.0, *extra: Any) -> jax.Array:
    """The kernels' scalar operand at step ``count``, each value rounded to float32 as the rule rounds it.

    ``neg_lr`` is the learning-rate scale: of the fused step (:func:`update_and_apply`), or the factor the rows
    kernel multiplies its step rows by (1: the step itself); ``extra`` follow it (the AdamW kernel's weight decay).
    """

    def f32(x: Any) -> jax.Array:
        return jnp.asarray(x).astype(jnp.float32)

    if hp.eps_placement == "optax":
        bc1, bc2 = 1 - hp.b1**count, 1 - hp.b2**count  # as optax.tree.bias_correction computes them
    else:
        bc1, bc2 = _torch_corrections(hp, count)  # as _step computes them
    values = (hp.b1, 1 - hp.b1, hp.b2, 1 - hp.b2, hp.eps, hp.eps_root, bc1, bc2, jnp.sqrt(bc2) / bc1, neg_lr)
    return jnp.stack([f32(x) for x in (*values, *extra)])


def _kernel(hp: AdamHyperparams, count: jax.Array, scale: Any = 1.0, weight_decay: Any = None) -> Kernel:
    """The native CPU kernel in the rule's place; its step rows come out multiplied by ``scale`` (rounded to
    float32 first, as ``optax.scale`` rounds it to the update's dtype). With ``weight_decay``, the rule of
    :func:`._row_engine.decayed_rule`: each step row plus ``weight_decay`` times the parameters' row (a float32
    table, the rule's one read), before the scale."""

    def supports(leaf: SparseLeaf, state: Arrays, reads: Arrays) -> bool:
        return _kernel_path.supports(leaf.shape, leaf.n_sparse, *state, *reads, leaf.values)

    def run(leaf: SparseLeaf, state: Arrays, reads: Arrays) -> tuple[jax.Array, jax.Array, Arrays]:
        extra = () if weight_decay is None else (weight_decay,)
        scalars = kernel_scalars(hp, count, scale, *extra)
        p = reads[0] if reads else None
        m, v, keys, step = _ffi.sparse_adam_rows(
            state[0], state[1], leaf.keys[:, 0], leaf.values, scalars, **kernel_flags(hp, leaf), p=p
        )
        return keys[:, None], step, (m, v)

    return Kernel(supports, run)


class KernelFlags(TypedDict):
    """The kernels' static flags (``unique``: :func:`._kernel_path.unique_flag`)."""

    torch_eps: bool
    maximize: bool
    unique: int


def kernel_flags(hp: AdamHyperparams, leaf: SparseLeaf) -> KernelFlags:
    """The kernels' static flags for a leaf."""
    unique = _kernel_path.unique_flag(leaf)
    return {"torch_eps": hp.eps_placement == "torch", "maximize": hp.maximize, "unique": unique}


def _dense_adam(grads: Any, mu: Any, nu: Any, state_count: jax.Array, hp: AdamHyperparams) -> tuple[Any, Any, Any]:
    """``(updates, mu, nu)`` of plain Adam over a tree of dense leaves (``None`` elsewhere).

    With ``eps_placement="optax"`` this is :func:`optax.scale_by_adam` itself on
    the tree, so XLA sees the graph it sees for :func:`optax.adam`, with the
    same jit boundaries, and the numbers are identical, jitted or not. With
    ``"torch"`` it is ``torch.optim.Adam``'s rule, which places ``eps`` as
    optax does, with torch's bias corrections (:func:`_torch_corrections`).
    """
    if hp.maximize:
        grads = jax.tree.map(lambda g: -g, grads)
    if hp.eps_placement == "optax":
        tx = optax.scale_by_adam(hp.b1, hp.b2, hp.eps, hp.eps_root)
        updates, state = tx.update(grads, optax.ScaleByAdamState(count=state_count, mu=mu, nu=nu))
        new_mu, new_nu = state.mu, state.nu
    else:
        new_mu = optax.tree.update_moment(grads, mu, hp.b1, 1)
        new_nu = optax.tree.update_moment_per_elem_norm(grads, nu, hp.b2, 2)
        bc1, bc2 = _torch_corrections(hp, optax.safe_increment(state_count))

        def step(m: jax.Array, v: jax.Array) -> jax.Array:
            m_hat, v_hat = m / bc1.astype(m.dtype), v / bc2.astype(v.dtype)
            return m_hat / (jnp.sqrt(v_hat + hp.eps_root) + hp.eps)

        updates = jax.tree.map(step, new_mu, new_nu)
    cast = lambda new, old: jax.tree.map(lambda x, y: x.astype(y.dtype), new, old)  # noqa: E731
    # The updates in optax's dtype: the gradient's promoted with the moments' (as apply_rule's update_dtype).
    return updates, cast(new_mu, mu), cast(new_nu, nu)


def _update(
    hp: AdamHyperparams,
    lazy_dense: Any,
    updates: Any,
    state: optax.ScaleByAdamState,
    params: Any,
    scale: Any = None,
    decay: tuple[Any, Any] | None = None,
) -> tuple[optax.Updates, optax.ScaleByAdamState]:
    """:func:`scale_by_sparse_adam`'s update; with ``scale``, its updates multiplied by it as ``optax.scale`` would
    (``jnp.array(scale, dtype) * u``), on the rows kernel inside its pass (:func:`sparse_adam`'s learning rate).
    With ``decay``, ``(weight_decay, flags)`` (a bool a leaf of the parameters), each leaf flagged first takes
    ``optax.add_decayed_weights(weight_decay)``'s ``u + weight_decay * p`` before the scale (:func:`sparse_adamw`):
    on a table's rows, inside the rule's pass (the rows kernel reads the parameters' rows)."""
    check_state(state, optax.ScaleByAdamState, _WHERE)
    count = optax.safe_increment(state.count)
    # Without params, a mask function sees the gradients with each sparse leaf as the array it stands for.
    like = params if params is not None else jax.tree.map(_as_dense_struct, updates, is_leaf=is_leaf)
    lazy = mask_tree(lazy_dense, like, "lazy_dense", _WHERE)
    trees = [(state.mu, "optimizer state's mu"), (state.nu, "optimizer state's nu"), (lazy, "lazy_dense mask")]

    def plain(path: Any, g: Any, m: Any, v: Any, lazy: bool, *p: Any) -> tuple[Any, Any, Any]:
        """The leaf's gradient, ``mu`` and ``nu`` if it takes plain dense Adam, else ``None``s."""
        if p and p[0] is not None and g is not None and jnp.shape(p[0]) != jnp.shape(m):
            raise param_error(
                ValueError,
                _WHERE,
                path,
                f"the optimizer state's mu has shape {jnp.shape(m)} but the parameter has shape "
                f"{jnp.shape(p[0])}: the state was built for other parameters; build it with `tx.init(params)`",
            )
        if g is None or is_sparse(g) or lazy:
            return None, None, None
        return check_dense_gradient(path, g, jnp.shape(m), _WHERE), m, v

    with_params = trees + ([] if params is None else [(params, "parameters")])
    plain_g, plain_m, plain_v = map_rule(plain, updates, with_params, _WHERE, 3)
    dense = _dense_adam(plain_g, plain_m, plain_v, state.count, hp)  # all at once, as optax.adam does
    weight_decay: Any = None if decay is None else decay[0]
    rules = {
        decays: tuple(
            scaled_rule(decayed_rule(r, weight_decay) if decays else r, scale)
            for r in (_rule(hp, count), _lazy_rule(hp, count))
        )
        for decays in (False, True)
    }
    kernels = {decays: _kernel(hp, count, step_factor(scale), weight_decay if decays else None) for decays in rules}

    def leaf(path: Any, g: Any, m: Any, v: Any, lazy: bool, *rest: Any) -> tuple[Any, Any, Any]:
        # With decay, the leaf's parameters and its flag come before the dense step: read where it decays.
        decays = decay is not None and bool(rest[1])
        reads: tuple[Any, ...] = (rest[0],) if decays else ()
        dense = rest[-3:]
        if g is not None and not is_sparse(g) and not lazy:
            u, m, v = dense
            if decays:
                u = u + weight_decay * reads[0]
            return (u if scale is None else jnp.asarray(scale, u.dtype) * u), m, v
        rule, lazy_rule = rules[decays]
        leaf_rule = lazy_rule if lazy and not is_sparse(g) else rule
        out, (m, v) = apply_rule(
            path, g, jnp.shape(m), (m, v), reads, leaf_rule, _WHERE, whole_rows=False, kernel=kernels[decays]
        )
        return out, m, v

    if decay is not None:
        trees += [(params, "parameters"), (decay[1], "mask")]
    trees += [(tree, "dense step") for tree in dense]
    updates, mu, nu = map_rule(leaf, updates, trees, _WHERE, 3)
    return updates, optax.ScaleByAdamState(count=count, mu=mu, nu=nu)


def scale_by_sparse_adam(
    b1: jax.typing.ArrayLike = 0.9,
    b2: jax.typing.ArrayLike = 0.999,
    eps: jax.typing.ArrayLike = 1e-8,
    eps_root: jax.typing.ArrayLike = 0.0,
    mu_dtype: jax.typing.DTypeLike | None = None,
    *,
    maximize: bool = False,
    eps_placement: EpsPlacement = "optax",
    lazy_dense: MaskOrFn = False,
) -> optax.GradientTransformationExtraArgs:
    r"""Rescales updates by lazy Adam: only the rows a gradient touches move.

    For a sparse gradient leaf (:class:`IndexedRows` or a BCOO), duplicates are
    summed into a touched set :math:`S`, and only :math:`S` is updated:

    .. math::

      m_S \leftarrow \beta_1 m_S + (1 - \beta_1) g_S, \qquad
      v_S \leftarrow \beta_2 v_S + (1 - \beta_2) |g_S|^2,

    with the step, for ``eps_placement="optax"``,

    .. math::

      u_S = \frac{m_S / (1 - \beta_1^t)}{\sqrt{v_S / (1 - \beta_2^t) + \epsilon_{root}} + \epsilon}

    and for ``eps_placement="torch"`` (as ``torch.optim.SparseAdam``)

    .. math::

      u_S = \frac{\sqrt{1 - \beta_2^t}}{1 - \beta_1^t}
            \frac{m_S}{\sqrt{v_S + \epsilon_{root}} + \epsilon}.

    Outside :math:`S`, ``mu`` and ``nu`` are bitwise unchanged and the update is
    a sparse leaf of the same type holding exactly the touched entries. The
    step count :math:`t` advances on every call. A dense gradient leaf that
    ``lazy_dense`` selects takes the same rule, a row counting as touched when
    any of its entries is nonzero. Any other dense gradient leaf gets plain
    Adam on every entry, with ``eps`` placed as optax places it,

    .. math::

      u = \frac{m / (1 - \beta_1^t)}{\sqrt{v / (1 - \beta_2^t) + \epsilon_{root}} + \epsilon},

    whatever ``eps_placement`` is: with ``"optax"`` it is
    :func:`optax.scale_by_adam` itself; with ``"torch"`` it is
    ``torch.optim.Adam``'s rule, so that one optimizer reproduces torch's usual
    pair, ``SparseAdam`` for the sparse tables and ``Adam`` for the rest. With
    ``"torch"`` the bias corrections :math:`1 - \beta^t` (of both rules) are
    torch's, which computes them in double precision: they are computed as
    :math:`-\operatorname{expm1}(t \log \beta)`, with :math:`\log \beta` taken
    in double where :math:`\beta` is a number, and are within float32 rounding
    of torch's (optax computes :math:`1 - \beta^t` in float32, off by up to
    ~1e-5 relative at :math:`\beta_2 = 0.999`). Where ``inject_hyperparams``
    makes :math:`\beta` a float32 array, :math:`\log \beta` is taken in
    float32 from the rounded :math:`\beta`. A ``None`` leaf is skipped.

    Args:
      b1: Decay rate of the first moment.
      b2: Decay rate of the second moment.
      eps: Term added to the denominator, outside the square root.
      eps_root: Term added inside the square root.
      mu_dtype: Dtype of the first moment; ``None`` uses the parameter's.
      maximize: Whether to ascend rather than descend (negates the gradient).
      eps_placement: ``"optax"`` or ``"torch"`` (sparse and ``lazy_dense``
        leaves as ``torch.optim.SparseAdam``, other dense leaves as
        ``torch.optim.Adam``); see above.
      lazy_dense: Which dense gradient leaves to treat lazily: a bool, a tree
        of bools (a prefix of the parameters), or a function of the parameters
        returning one, as in optax's ``mask`` arguments.

    Returns:
      An :class:`optax.GradientTransformationExtraArgs` whose state is an
      :class:`optax.ScaleByAdamState`.

    Examples:
      >>> import jax.numpy as jnp
      >>> import optax_sparse_adam as osa
      >>> tx = osa.scale_by_sparse_adam()
      >>> params = {"table": jnp.zeros((4, 2), jnp.float32)}
      >>> state = tx.init(params)
      >>> g = osa.IndexedRows(jnp.array([1, 1, -1]), jnp.ones((3, 2), jnp.float32), 4)
      >>> updates, state = tx.update({"table": g}, state)
      >>> updates["table"].todense().round(3)
      Array([[0., 0.],
             [1., 1.],
             [0., 0.],
             [0., 0.]], dtype=float32)

    References:
      Kingma and Ba, `Adam: A Method for Stochastic Optimization
      <https://arxiv.org/abs/1412.6980>`_, 2014; PyTorch's
      ``torch.optim.SparseAdam`` and ``torch.optim.Adam``.
    """
    hp = _hyperparams(b1, b2, eps, eps_root, maximize, eps_placement)
    mu_dtype = check_dtype(mu_dtype, "mu_dtype")
    check_mask("lazy_dense", lazy_dense)

    def init_fn(params: optax.Params) -> optax.ScaleByAdamState:
        check_params(params, _WHERE)
        mask_tree(lazy_dense, params, "lazy_dense", _WHERE)  # a mask that does not fit the parameters fails here
        return optax.ScaleByAdamState(
            count=jnp.zeros([], jnp.int32),
            mu=optax.tree.zeros_like(params, dtype=mu_dtype),
            nu=optax.tree.zeros_like(params),
        )

    return stage(init_fn, functools.partial(_update, hp, lazy_dense))


@compiled_when_eager
def sparse_adam(
    learning_rate: optax.ScalarOrSchedule,
    b1: jax.typing.ArrayLike = 0.9,
    b2: jax.typing.ArrayLike = 0.999,
    eps: jax.typing.ArrayLike = 1e-8,
    eps_root: jax.typing.ArrayLike = 0.0,
    mu_dtype: jax.typing.DTypeLike | None = None,
    *,
    maximize: bool = False,
    eps_placement: EpsPlacement = "optax",
    lazy_dense: MaskOrFn = False,
    catch_up: bool = False,
) -> optax.GradientTransformationExtraArgs:
    r"""Lazy Adam for sparse gradients: a drop-in for :func:`optax.adam`.

    Sparse gradient leaves (:class:`IndexedRows`, BCOO) update only the rows
    they touch, in parameters and in both moments, so a step costs
    O(touched rows). Dense leaves get exactly :func:`optax.adam` (with
    ``eps_placement="torch"``, ``torch.optim.Adam``), or the lazy rule where
    ``lazy_dense`` selects them.

    Let :math:`\alpha_t` represent the learning rate and :math:`\beta_1,
    \beta_2, \varepsilon, \bar{\varepsilon}` the arguments ``b1``, ``b2``,
    ``eps`` and ``eps_root``. Let :math:`g_t` be the gradient, with its
    duplicate entries summed, and :math:`S_t` the rows (or entries) it
    touches: every row of a dense leaf, the in-range keys of a sparse leaf,
    the rows holding a nonzero of a ``lazy_dense`` leaf. With
    :math:`m_0 = v_0 = 0`, at step :math:`t`, for the rows in :math:`S_t`:

    .. math::

      \begin{align*}
        m_t &\leftarrow \beta_1 \cdot m_{t-1} + (1-\beta_1) \cdot g_t \\
        v_t &\leftarrow \beta_2 \cdot v_{t-1} + (1-\beta_2) \cdot |g_t|^2 \\
        \hat{m}_t &\leftarrow m_t / {(1-\beta_1^t)} \\
        \hat{v}_t &\leftarrow v_t / {(1-\beta_2^t)} \\
        p_t &\leftarrow p_{t-1} - \alpha_t \cdot \hat{m}_t / \left({\sqrt{\hat{v}_t +
          \bar{\varepsilon}} + \varepsilon} \right)
      \end{align*}

    and :math:`m, v, p` are unchanged outside :math:`S_t`. The step count
    :math:`t` is global and advances on every call.

    ``eps_placement="torch"`` reproduces torch's usual pair of optimizers,
    ``torch.optim.SparseAdam`` for the sparse tables and ``torch.optim.Adam``
    for the rest. On sparse leaves and ``lazy_dense`` leaves the last line is
    ``SparseAdam``'s,

    .. math::

      p_t \leftarrow p_{t-1} - \alpha_t \frac{\sqrt{1-\beta_2^t}}{1-\beta_1^t}
        \, m_t / \left(\sqrt{v_t + \bar{\varepsilon}} + \varepsilon\right);

    other dense leaves keep the lines above, which are ``Adam``'s. In both,
    :math:`1 - \beta^t` is computed as torch computes it, in double precision
    (to float32 rounding: :math:`-\operatorname{expm1}(t \log \beta)`, with
    :math:`\log \beta` in double where :math:`\beta` is a number), not in
    float32 as optax does; see :func:`scale_by_sparse_adam`.

    **Exact catch-up.** Lazy Adam is not Adam: after its last gradient, dense
    Adam keeps moving a row for many steps (its momentum decays by
    :math:`\beta_1` a step), lazy Adam stops it. With ``catch_up=True`` a row
    that returns after :math:`s` idle steps, last moved at step :math:`t_0`,
    first takes the steps dense Adam would have taken with a zero gradient,
    each with its own learning rate and bias corrections,

    .. math::

      m \leftarrow \beta_1 m, \quad v \leftarrow \beta_2 v, \quad
      p \leftarrow p - \alpha_{k} \, \hat m_k / (\sqrt{\hat v_k + \bar\varepsilon} + \varepsilon),
      \qquad k = t_0 + 1, \dots, t_0 + s,

    in dense Adam's float32 arithmetic, then step :math:`t`. The first
    :math:`K` idle steps are replayed one by one; the steps after them only
    decay the moments (by :math:`\beta^{s-K}`), since together they would
    move the row by less than :math:`2^{-24}` times their largest learning
    rate. With :math:`r = \beta_1 / \sqrt{\beta_2}`, idle step :math:`k`
    moves a row by at most :math:`\alpha_k A r^k`, where
    :math:`A = ((1 - \beta_2)(1 - \beta_1^2 / \beta_2))^{-1/2}`, and
    :math:`K` is the smallest with :math:`A r^{K+1} / (1 - r) \le 2^{-24}`
    (221 for the default betas, 2,798 for :math:`\beta_1 = 0.99`). Requires
    :math:`\beta_1 < \sqrt{\beta_2}`.

    The state (:class:`CatchUpAdamState`) keeps, per row, the step through
    which the row is up to date, so ``update`` needs ``params``. For the loss
    to read the rows dense Adam would read, build the gradient with
    ``value_and_row_grad(loss, tables, catch_up=tx)`` and pass
    ``opt_state=state`` to it; :func:`catch_up` brings every row up to date
    (O(table), for evaluation, export or a final checkpoint). Sparse leaves
    must address whole rows; dense leaves are :func:`optax.adam`.
    :func:`update_and_apply` runs it as its two calls, on the XLA path: the
    replay costs up to :math:`K` element-wise passes over the touched rows,
    many times the plain fused step (``benchmarks/catch_up.py`` measures
    both). Under ``inject_hyperparams`` the idle steps use the current
    injected learning rate: past values are not kept.

    Args:
      learning_rate: A float or an optax schedule.
      b1: Decay rate of the first moment.
      b2: Decay rate of the second moment.
      eps: Term added to the denominator, outside the square root.
      eps_root: Term added inside the square root.
      mu_dtype: Dtype of the first moment; ``None`` uses the parameter's.
      maximize: Whether to ascend rather than descend.
      eps_placement: ``"optax"`` (as :func:`optax.adam`) or ``"torch"`` (sparse
        and ``lazy_dense`` leaves as ``torch.optim.SparseAdam``, other dense
        leaves as ``torch.optim.Adam``).
      lazy_dense: Which dense gradient leaves to treat lazily (a row is touched
        when any of its entries is nonzero): a bool, a tree of bools, or a
        function of the parameters returning one.
      catch_up: Whether a row the gradient touches first replays the steps it
        sat out (see below); the state is then a :class:`CatchUpAdamState`.

    Returns:
      An :class:`optax.GradientTransformationExtraArgs`. Apply its updates with
      :func:`optax_sparse_adam.apply_updates`.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import optax_sparse_adam as osa
      >>> params = {"emb": jnp.ones((5, 2), jnp.float32), "w": jnp.ones((2,), jnp.float32)}
      >>> tx = osa.sparse_adam(0.1)
      >>> state = tx.init(params)
      >>> grads = {"emb": osa.IndexedRows(jnp.array([3]), jnp.ones((1, 2), jnp.float32), 5),
      ...          "w": jnp.ones((2,), jnp.float32)}
      >>> updates, state = tx.update(grads, state, params)
      >>> params = osa.apply_updates(params, updates)
      >>> params["emb"].round(3)
      Array([[1. , 1. ],
             [1. , 1. ],
             [1. , 1. ],
             [0.9, 0.9],
             [1. , 1. ]], dtype=float32)

    References:
      Kingma and Ba, `Adam: A Method for Stochastic Optimization
      <https://arxiv.org/abs/1412.6980>`_, 2014; PyTorch's
      ``torch.optim.SparseAdam`` and ``torch.optim.Adam``.
    """
    check_learning_rate(learning_rate)
    if check_bool("catch_up", catch_up):
        from optax_sparse_adam import _catch_up  # it builds on this module's rule

        return _catch_up.catch_up_adam(
            learning_rate,
            _catch_up_hyperparams(b1, b2, eps, eps_root, maximize, eps_placement, lazy_dense),
            check_dtype(mu_dtype, "mu_dtype"),
        )
    hp = _hyperparams(b1, b2, eps, eps_root, maximize, eps_placement)
    adam = scale_by_sparse_adam(
        b1=b1,
        b2=b2,
        eps=eps,
        eps_root=eps_root,
        mu_dtype=mu_dtype,
        maximize=maximize,
        eps_placement=eps_placement,
        lazy_dense=lazy_dense,
    )
    # update_and_apply may fuse this chain into one pass per row: what it needs travels with tx.update.
    return with_learning_rate(adam, learning_rate, AdamFusion(learning_rate, hp))


def _hyperparams(b1: Any, b2: Any, eps: Any, eps_root: Any, maximize: Any, eps_placement: Any) -> AdamHyperparams:
    """Adam's hyperparameters, checked."""
    check_hparam("b1", b1, lower=0.0, lower_open=False, upper=1.0)
    check_hparam("b2", b2, lower=0.0, lower_open=False, upper=1.0)
    check_hparam("eps", eps, lower=0.0, lower_open=True)
    check_hparam("eps_root", eps_root, lower=0.0, lower_open=False)
    if eps_placement not in ("optax", "torch"):
        raise ValueError(f"Invalid eps_placement: {eps_placement!r}; it must be 'optax' or 'torch'")
    maximize = check_bool("maximize", maximize)
    return AdamHyperparams(b1, b2, eps, eps_root, maximize, eps_placement, _log_beta(b1), _log_beta(b2))


def _catch_up_hyperparams(
    b1: Any, b2: Any, eps: Any, eps_root: Any, maximize: Any, eps_placement: Any, lazy_dense: Any
) -> AdamHyperparams:
    """Adam's hyperparameters, checked for ``catch_up=True``."""
    hp = _hyperparams(b1, b2, eps, eps_root, maximize, eps_placement)
    if lazy_dense is not False:
        raise ValueError("sparse_adam: catch_up=True does not take lazy_dense; give the tables sparse gradients")
    if hp.log_b1 is not None and hp.log_b2 is not None and not 2 * hp.log_b1 < hp.log_b2:
        raise ValueError(
            f"sparse_adam: catch_up=True needs b1 < sqrt(b2), so that a row's idle steps move it by a convergent "
            f"series; got b1={b1!r}, b2={b2!r}"
        )
    return hp


class AdamFusion(NamedTuple):
    """What :func:`update_and_apply` needs of a :func:`sparse_adam` (or a lazy :func:`sparse_adamw`: its
    ``weight_decay`` and ``mask``) to run its step in one pass per row."""

    learning_rate: optax.ScalarOrSchedule
    hp: AdamHyperparams
    weight_decay: Any = None
    mask: Any = None
