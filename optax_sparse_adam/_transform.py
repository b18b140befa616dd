"""The lazy (sparse) Adam transformation: :func:`scale_by_sparse_adam` and :func:`sparse_adam`.

Each gradient leaf takes one of three rules, each a function of one leaf:
:func:`_dense_adam` (plain Adam, optax's own expressions),
:func:`_lazy_dense_adam` (Adam on the rows of a dense gradient that hold a
nonzero) and :func:`_sparse_adam` (Adam on the rows a sparse leaf touches).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_sparse_adam import _fused, _native
from optax_sparse_adam._coalesce import coalesce
from optax_sparse_adam._explicit_sharding import replicate, scatter_rows, take_rows
from optax_sparse_adam._indexed_rows import is_sparse
from optax_sparse_adam._keys import SparseLeaf, for_each_chunk, to_sparse_leaf
from optax_sparse_adam._sparse_aware import sparse_aware
from optax_sparse_adam._tree import broadcast_rows, check_state, map_leaves, mask_tree, param_error

__all__ = ["scale_by_sparse_adam", "sparse_adam"]

EpsPlacement = Literal["optax", "torch"]
MaskOrFn = bool | Any | Callable[[optax.Params], Any]
_WHERE = "scale_by_sparse_adam"


class _Adam(NamedTuple):
    """The hyperparameters every leaf rule reads (possibly traced under ``inject_hyperparams``)."""

    b1: Any
    b2: Any
    eps: Any
    eps_root: Any
    maximize: bool
    eps_placement: EpsPlacement


def _moments(g: jax.Array, m: jax.Array, v: jax.Array, adam: _Adam) -> tuple[jax.Array, jax.Array]:
    """Adam's new moments, with optax's own expressions (``|g|^2`` for complex ``g``)."""
    if adam.maximize:
        g = -g
    return optax.tree.update_moment(g, m, adam.b1, 1), optax.tree.update_moment_per_elem_norm(g, v, adam.b2, 2)


def _step(m: jax.Array, v: jax.Array, count: jax.Array, adam: _Adam) -> jax.Array:
    """Adam's step from the new moments, for either placement of ``eps``."""
    if adam.eps_placement == "optax":
        m_hat = optax.tree.bias_correction(m, adam.b1, count)
        v_hat = optax.tree.bias_correction(v, adam.b2, count)
        return m_hat / (jnp.sqrt(v_hat + adam.eps_root) + adam.eps)
    scale = jnp.sqrt(1 - adam.b2**count) / (1 - adam.b1**count)
    return scale.astype(m.dtype) * m / (jnp.sqrt(v + adam.eps_root) + adam.eps)


def _dense_adam(grads: Any, mu: Any, nu: Any, state_count: jax.Array, adam: _Adam) -> tuple[Any, Any, Any]:
    """``(updates, mu, nu)`` of plain Adam over a tree of dense leaves (``None`` elsewhere).

    With ``eps_placement="optax"`` this is :func:`optax.scale_by_adam` itself on
    the tree, so XLA sees the graph it sees for :func:`optax.adam`, with the
    same jit boundaries, and the numbers are identical, jitted or not.
    """
    if adam.maximize:
        grads = jax.tree.map(lambda g: -g, grads)
    if adam.eps_placement == "optax":
        tx = optax.scale_by_adam(adam.b1, adam.b2, adam.eps, adam.eps_root)
        updates, state = tx.update(grads, optax.ScaleByAdamState(count=state_count, mu=mu, nu=nu))
        new_mu, new_nu = state.mu, state.nu
    else:
        new_mu = optax.tree.update_moment(grads, mu, adam.b1, 1)
        new_nu = optax.tree.update_moment_per_elem_norm(grads, nu, adam.b2, 2)
        count = optax.safe_increment(state_count)
        updates = jax.tree.map(lambda m, v: _step(m, v, count, adam), new_mu, new_nu)
    cast = lambda new, old: jax.tree.map(lambda x, y: x.astype(y.dtype), new, old)  # noqa: E731
    return cast(updates, grads), cast(new_mu, mu), cast(new_nu, nu)


def _lazy_dense_adam(
    g: jax.Array, m: jax.Array, v: jax.Array, count: jax.Array, adam: _Adam
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(update, mu, nu)`` of lazy Adam on a dense leaf: rows holding a nonzero (or NaN) are touched.

    The selects sit inside the moment updates and the mask is reduced with a
    float max, so XLA updates the moments in place without a table-sized mask.
    """
    touched = jnp.max(jnp.abs(g), axis=tuple(range(1, g.ndim)), keepdims=True) != 0 if g.ndim > 1 else g != 0
    new_m, new_v = _moments(g, m, v, adam)
    new_m = jnp.where(touched, new_m, m)
    new_v = jnp.where(touched, new_v, v)
    step = jnp.where(touched, _step(new_m, new_v, count, adam), jnp.zeros((), g.dtype))
    return step.astype(g.dtype), new_m.astype(m.dtype), new_v.astype(v.dtype)


def _sparse_adam(
    leaf: SparseLeaf, m: jax.Array, v: jax.Array, count: jax.Array, adam: _Adam
) -> tuple[SparseLeaf, jax.Array, jax.Array]:
    """``(update, mu, nu)`` of lazy Adam on the rows a sparse leaf touches, duplicates summed first.

    The update holds each touched row's step once, in the slots of the summed
    leaf; ``mu`` and ``nu`` change in those rows only.
    """
    leaf = coalesce(leaf)

    def rows_update(start: Any, chunk: SparseLeaf, carry: Any) -> Any:
        m, v, out = carry
        idx = chunk.row_index()
        new_m, new_v = _moments(chunk.values, take_rows(m, idx), take_rows(v, idx), adam)
        step = _step(new_m, new_v, count, adam)
        step = jnp.where(broadcast_rows(chunk.valid(), step.ndim), step, jnp.zeros((), step.dtype))
        return (
            scatter_rows(m, idx, new_m.astype(m.dtype), "set"),
            scatter_rows(v, idx, new_v.astype(v.dtype), "set"),
            jax.lax.dynamic_update_slice_in_dim(out, step.astype(out.dtype), start, 0),
        )

    m, v, out = for_each_chunk(leaf, rows_update, (m, v, replicate(jnp.zeros_like(leaf.values), like=m)))
    return leaf._replace(values=out), m, v


def _sparse_adam_rule(
    leaf: SparseLeaf, m: jax.Array, v: jax.Array, count: jax.Array, adam: _Adam
) -> tuple[SparseLeaf, jax.Array, jax.Array]:
    """:func:`_sparse_adam` on the native CPU kernel where it applies (see ``_native``), else in XLA."""
    if not _native.supports(m.shape, leaf.n_sparse, m, v, leaf.values):
        return _sparse_adam(leaf, m, v, count, adam)
    scalars = _native.adam_scalars(adam.b1, adam.b2, adam.eps, adam.eps_root, 1 - adam.b1**count, 1 - adam.b2**count)
    flags = {"torch_eps": adam.eps_placement == "torch", "maximize": adam.maximize, "unique": leaf.distinct}

    def native() -> tuple[jax.Array, ...]:
        new_m, new_v, keys, step = _native.sparse_adam_rows(m, v, leaf.keys[:, 0], leaf.values, scalars, **flags)
        return keys[:, None], step, new_m, new_v

    def xla() -> tuple[jax.Array, ...]:
        out, new_m, new_v = _sparse_adam(leaf, m, v, count, adam)
        return out.keys, out.values, new_m, new_v

    keys, step, new_m, new_v = _native.select(native, xla)
    # As coalesce leaves it: distinct keys packed first, or a distinct leaf's keys in place.
    return leaf._replace(keys=keys, values=step, distinct=True, sorted=leaf.distinct and leaf.sorted), new_m, new_v


def _check_hparam(name: str, value: Any, *, lower: float, lower_open: bool, upper: float = math.inf) -> None:
    """Checks a concrete scalar hyperparameter; schedules and traced (injected) values are left alone."""
    if callable(value) or isinstance(value, jax.core.Tracer):
        return
    arr = np.asarray(value)
    if arr.dtype.kind not in "iuf":
        raise TypeError(f"Invalid {name}: {value!r}; it must be a real number")
    if arr.size != 1:
        raise ValueError(f"Invalid {name}: an array of shape {arr.shape}; it must be a scalar")
    v = float(arr.reshape(()))
    ok = (v > lower if lower_open else v >= lower) and (v < upper) and math.isfinite(v)
    if not ok:
        lo = f"> {lower:g}" if lower_open else f">= {lower:g}"
        rule = f"in [{lower:g}, {upper:g})" if math.isfinite(upper) else f"finite and {lo}"
        raise ValueError(f"Invalid {name}: {value!r}; it must be {rule}")


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
    step count :math:`t` advances on every call. A dense gradient leaf gets
    plain Adam (:func:`optax.scale_by_adam`'s expressions) unless
    ``lazy_dense`` selects it, in which case a row counts as touched when any of
    its entries is nonzero. A ``None`` leaf is skipped.

    Args:
      b1: Decay rate of the first moment.
      b2: Decay rate of the second moment.
      eps: Term added to the denominator, outside the square root.
      eps_root: Term added inside the square root.
      mu_dtype: Dtype of the first moment; ``None`` uses the parameter's.
      maximize: Whether to ascend rather than descend (negates the gradient).
      eps_placement: ``"optax"`` or ``"torch"``; see above.
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
      ``torch.optim.SparseAdam``.
    """
    _check_hparam("b1", b1, lower=0.0, lower_open=False, upper=1.0)
    _check_hparam("b2", b2, lower=0.0, lower_open=False, upper=1.0)
    _check_hparam("eps", eps, lower=0.0, lower_open=True)
    _check_hparam("eps_root", eps_root, lower=0.0, lower_open=False)
    if eps_placement not in ("optax", "torch"):
        raise ValueError(f"Invalid eps_placement: {eps_placement!r}; it must be 'optax' or 'torch'")
    if not isinstance(maximize, bool | np.bool_):
        raise TypeError(f"Invalid maximize: {maximize!r}; it must be a bool")
    if mu_dtype is not None:
        try:
            mu_dtype = jax.dtypes.canonicalize_dtype(mu_dtype)
        except TypeError as e:
            raise TypeError(f"Invalid mu_dtype: {mu_dtype!r}; it must be a floating dtype such as jnp.float32") from e
        if not jnp.issubdtype(mu_dtype, jnp.inexact):
            raise TypeError(f"Invalid mu_dtype: {mu_dtype}; it must be a floating dtype such as jnp.float32")
    if not callable(lazy_dense):
        for path, flag in jax.tree_util.tree_leaves_with_path(lazy_dense):
            if not isinstance(flag, bool | np.bool_):
                raise TypeError(
                    f"Invalid lazy_dense: {flag!r} at {jax.tree_util.keystr(path) or '<root>'}; it must be a "
                    "bool, a tree of bools (a prefix of the parameters), or a function returning one"
                )
    adam = _Adam(b1, b2, eps, eps_root, bool(maximize), eps_placement)

    def init_fn(params: optax.Params) -> optax.ScaleByAdamState:
        mask_tree(lazy_dense, params, "lazy_dense", _WHERE)  # a mask that does not fit the parameters fails here
        return optax.ScaleByAdamState(
            count=jnp.zeros([], jnp.int32),
            mu=optax.tree.zeros_like(params, dtype=mu_dtype),
            nu=optax.tree.zeros_like(params),
        )

    def update_fn(
        updates: optax.Updates,
        state: optax.ScaleByAdamState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, optax.ScaleByAdamState]:
        del extra_args
        check_state(state, optax.ScaleByAdamState, _WHERE)
        count = optax.safe_increment(state.count)

        def check(path: Any, g: Any, m: Any, v: Any, lazy: Any, *p: Any) -> tuple[Any, Any, Any]:
            """The leaf's gradient, ``mu`` and ``nu`` if it takes the plain dense rule, else ``None``s."""
            if g is None:
                return None, None, None
            if not isinstance(m, jax.Array | np.ndarray):
                raise param_error(
                    ValueError,
                    _WHERE,
                    path,
                    f"the gradient is a leaf but the optimizer state holds a subtree {jax.tree.structure(m)}",
                )
            if p and p[0] is not None and jnp.shape(p[0]) != m.shape:
                raise param_error(
                    ValueError,
                    _WHERE,
                    path,
                    f"the optimizer state's mu has shape {m.shape} but the parameter has shape {jnp.shape(p[0])}: "
                    "the state was built for other parameters; build it with `tx.init(params)`",
                )
            if is_sparse(g):
                return None, None, None
            g = jnp.asarray(g)
            if g.shape != m.shape:
                raise param_error(
                    ValueError, _WHERE, path, f"gradient shape {g.shape} does not match the parameter shape {m.shape}"
                )
            if not jnp.issubdtype(g.dtype, jnp.inexact):
                raise param_error(
                    TypeError,
                    _WHERE,
                    path,
                    f"the gradient has dtype {g.dtype}; Adam needs floating-point gradients: cast the gradient, "
                    "or give this parameter a None gradient (or optax.set_to_zero) if it is not trained",
                )
            return (None, None, None) if lazy else (g, m, v)

        def leaf_rule(path: Any, g: Any, m: Any, v: Any, lazy: Any, *dense: Any) -> tuple[Any, Any, Any]:
            if g is None:
                return None, m, v
            if is_sparse(g):
                leaf = to_sparse_leaf(g, jnp.shape(m), path, _WHERE, emits=True)
                sparse, m, v = _sparse_adam_rule(leaf, jnp.asarray(m), jnp.asarray(v), count, adam)
                return sparse.to_leaf(), m, v
            if lazy:
                return _lazy_dense_adam(jnp.asarray(g), jnp.asarray(m), jnp.asarray(v), count, adam)
            return dense

        lazy = mask_tree(lazy_dense, params if params is not None else updates, "lazy_dense", _WHERE)
        leaves = [(state.mu, "optimizer state's mu"), (state.nu, "optimizer state's nu"), (lazy, "lazy_dense mask")]
        with_params = leaves + ([] if params is None else [(params, "parameters")])
        plain_g, plain_m, plain_v = map_leaves(check, updates, with_params, where=_WHERE, tree_name="gradient", n_out=3)
        dense = _dense_adam(plain_g, plain_m, plain_v, state.count, adam)  # all at once, as optax.adam does
        leaves += [(tree, "dense step") for tree in dense]
        updates, mu, nu = map_leaves(leaf_rule, updates, leaves, where=_WHERE, tree_name="gradient", n_out=3)
        return updates, optax.ScaleByAdamState(count=count, mu=mu, nu=nu)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


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
) -> optax.GradientTransformationExtraArgs:
    r"""Lazy Adam for sparse gradients: a drop-in for :func:`optax.adam`.

    Sparse gradient leaves (:class:`IndexedRows`, BCOO) update only the rows
    they touch, in parameters and in both moments, so a step costs
    O(touched rows). Dense leaves get exactly :func:`optax.adam`, or the lazy
    rule where ``lazy_dense`` selects them.

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
    :math:`t` is global and advances on every call. With
    ``eps_placement="torch"`` the last line is ``torch.optim.SparseAdam``'s,
    :math:`p_t \leftarrow p_{t-1} - \alpha_t \frac{\sqrt{1-\beta_2^t}}{1-\beta_1^t}
    \, m_t / (\sqrt{v_t + \bar{\varepsilon}} + \varepsilon)`.

    Args:
      learning_rate: A float or an optax schedule.
      b1: Decay rate of the first moment.
      b2: Decay rate of the second moment.
      eps: Term added to the denominator, outside the square root.
      eps_root: Term added inside the square root.
      mu_dtype: Dtype of the first moment; ``None`` uses the parameter's.
      maximize: Whether to ascend rather than descend.
      eps_placement: ``"optax"`` (as :func:`optax.adam`) or ``"torch"`` (as
        ``torch.optim.SparseAdam``).
      lazy_dense: Which dense gradient leaves to treat lazily (a row is touched
        when any of its entries is nonzero): a bool, a tree of bools, or a
        function of the parameters returning one.

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
      <https://arxiv.org/abs/1412.6980>`_, 2014.
    """
    _check_hparam("learning_rate", learning_rate, lower=0.0, lower_open=True)
    tx = optax.chain(
        scale_by_sparse_adam(
            b1=b1,
            b2=b2,
            eps=eps,
            eps_root=eps_root,
            mu_dtype=mu_dtype,
            maximize=maximize,
            eps_placement=eps_placement,
            lazy_dense=lazy_dense,
        ),
        sparse_aware(optax.scale_by_learning_rate(learning_rate)),
    )
    # update_and_apply may fuse this chain into one pass per row.
    _fused.register(tx, _fused.FusedSpec(learning_rate, b1, b2, eps, eps_root, maximize, eps_placement))
    return tx
