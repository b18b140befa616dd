"""The lazy (sparse) Adam transformation: :func:`scale_by_sparse_adam` and :func:`sparse_adam`."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_sparse_adam import _rows
from optax_sparse_adam._compat import sparse_aware
from optax_sparse_adam._explicit_sharding import replicate, scatter_rows, take_rows

__all__ = ["scale_by_sparse_adam", "sparse_adam"]

EpsPlacement = Literal["optax", "torch"]
MaskOrFn = bool | Any | Callable[[optax.Params], Any]
_WHERE = "scale_by_sparse_adam"


def _check_hparam(name: str, value: Any, *, lower: float, lower_open: bool) -> None:
    """Checks a concrete scalar hyperparameter; traced or injected ones are left alone."""
    if value is None or callable(value) or isinstance(value, jax.core.Tracer):
        return
    arr = np.asarray(value)
    if arr.size != 1:
        return
    v = float(arr.reshape(()))
    bad = math.isnan(v) or (v <= lower if lower_open else v < lower)
    if name in ("b1", "b2"):
        bad = bad or v >= 1.0
        rule = "in [0, 1)"
    else:
        rule = f"> {lower:g}" if lower_open else f">= {lower:g}"
    if bad:
        raise ValueError(f"Invalid {name}: {value!r}; it must be {rule}")


def _resolve_mask(mask: MaskOrFn, params: Any) -> Any:
    return mask(params) if callable(mask) else mask


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
      v_S \leftarrow \beta_2 v_S + (1 - \beta_2) g_S^2,

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
    plain Adam (identical to :func:`optax.scale_by_adam`) unless
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
    for name, value, lower, lower_open in (
        ("b1", b1, 0.0, False),
        ("b2", b2, 0.0, False),
        ("eps", eps, 0.0, True),
        ("eps_root", eps_root, 0.0, False),
    ):
        _check_hparam(name, value, lower=lower, lower_open=lower_open)
    if eps_placement not in ("optax", "torch"):
        raise ValueError(f"Invalid eps_placement: {eps_placement!r}; it must be 'optax' or 'torch'")
    mu_dtype = None if mu_dtype is None else jax.dtypes.canonicalize_dtype(mu_dtype)

    def init_fn(params: optax.Params) -> optax.ScaleByAdamState:
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
        count = optax.safe_increment(state.count)
        bc1 = 1 - b1**count  # the same expression as optax, for bitwise equality
        bc2 = 1 - b2**count

        def moments(g: Any, m: Any, v: Any, touched: Any = None) -> tuple[jax.Array, jax.Array, jax.Array]:
            """New (m, v) and the step for gradient rows ``g`` and moment rows ``m``, ``v``.

            Where ``touched`` is given, the other rows keep ``m`` and ``v`` (and get a zero step).
            """
            if maximize:
                g = -g
            if touched is None:
                m = (1 - b1) * g + b1 * m
                v = (1 - b2) * (g * g) + b2 * v
            else:
                m = jnp.where(touched, (1 - b1) * g + b1 * m, m)
                v = jnp.where(touched, (1 - b2) * (g * g) + b2 * v, v)
            if eps_placement == "optax":
                step = (m / bc1.astype(m.dtype)) / (jnp.sqrt(v / bc2.astype(v.dtype) + eps_root) + eps)
            else:
                scale = jnp.sqrt(bc2) / bc1
                step = scale.astype(m.dtype) * m / (jnp.sqrt(v + eps_root) + eps)
            if touched is not None:
                step = jnp.where(touched, step, jnp.zeros((), step.dtype))
            return m, v, step

        def leaf_update(path: Any, g: Any, m: Any, v: Any, lazy: Any) -> tuple[Any, Any, Any]:
            if g is None:
                return None, m, v
            if not isinstance(m, jax.Array | np.ndarray):
                raise ValueError(
                    f"{_WHERE}: parameter {_rows.path_str(path)}: the gradient is a leaf but the "
                    f"optimizer state holds a subtree {jax.tree.structure(m)}"
                )
            m, v = jnp.asarray(m), jnp.asarray(v)
            m_dtype = m.dtype if mu_dtype is None else mu_dtype
            if _rows.is_sparse(g):
                sp = _rows.coalesce(_rows.to_sparse_leaf(g, m.shape, path, _WHERE))

                def rows_update(start: Any, chunk: _rows.SparseLeaf, carry: Any) -> Any:
                    m, v, out = carry
                    idx = chunk.row_index()
                    m_rows = take_rows(m, idx)
                    v_rows = take_rows(v, idx)
                    new_m, new_v, step = moments(chunk.values, m_rows, v_rows)
                    valid = _rows._expand(chunk.valid(), step.ndim)
                    step = jnp.where(valid, step, jnp.zeros((), step.dtype)).astype(out.dtype)
                    return (
                        scatter_rows(m, idx, new_m.astype(m_dtype), "set"),
                        scatter_rows(v, idx, new_v.astype(v.dtype), "set"),
                        jax.lax.dynamic_update_slice_in_dim(out, step, start, 0),
                    )

                out = replicate(jnp.zeros_like(sp.values), like=m)
                m, v, out = _rows.for_each_chunk(sp, rows_update, (m, v, out))
                return sp.replace_values(out).to_leaf(), m, v
            g = jnp.asarray(g)
            if g.shape != m.shape:
                raise ValueError(
                    f"{_WHERE}: parameter {_rows.path_str(path)}: gradient shape {g.shape} "
                    f"does not match the parameter shape {m.shape}"
                )
            if not _is_true(lazy, path):
                new_m, new_v, step = moments(g, m, v)
                return step.astype(g.dtype), new_m.astype(m_dtype), new_v.astype(v.dtype)
            # Lazy: a row is touched when any entry is nonzero (NaN counts). A float max
            # reduces without materializing a table-sized mask.
            axes = tuple(range(1, g.ndim))
            touched = jnp.max(jnp.abs(g), axis=axes, keepdims=True) != 0 if g.ndim > 1 else g != 0
            new_m, new_v, step = moments(g, m, v, touched)
            return step.astype(g.dtype), new_m.astype(m_dtype), new_v.astype(v.dtype)

        grads, treedef = _rows.flatten(updates)
        mus = _rows.flatten_up_to(treedef, state.mu, _WHERE, "optimizer state's mu (the parameters')")
        nus = _rows.flatten_up_to(treedef, state.nu, _WHERE, "optimizer state's nu (the parameters')")
        mask = _resolve_mask(lazy_dense, params if params is not None else updates)
        lazies = _rows.flatten_up_to(
            treedef,
            jax.tree.map(
                lambda m, x: jax.tree.map(lambda _: m, x, is_leaf=_rows.is_leaf), mask, updates, is_leaf=_rows.is_leaf
            ),
            _WHERE,
            "lazy_dense",
        )
        results = [leaf_update(path, g, *rest) for (path, g), *rest in zip(grads, mus, nus, lazies, strict=True)]
        out_u, out_m, out_v = (list(col) for col in zip(*results, strict=True)) if results else ([], [], [])
        # A None gradient over a subtree of parameters carried that subtree
        # through as one "leaf", so unflattening restores the state's structure.
        new_state = optax.ScaleByAdamState(count=count, mu=treedef.unflatten(out_m), nu=treedef.unflatten(out_v))
        return treedef.unflatten(out_u), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _is_true(flag: Any, path: Any) -> bool:
    if isinstance(flag, bool | np.bool_):
        return bool(flag)
    raise TypeError(
        f"{_WHERE}: parameter {_rows.path_str(path)}: lazy_dense must give a Python bool per leaf, got {flag!r}"
    )


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
    rule where ``lazy_dense`` selects them. See :func:`scale_by_sparse_adam`
    for the update rule:

    .. math::

      p_S \leftarrow p_S - \alpha_t \, u_S.

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
    return optax.chain(
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
        # A scale is linear per entry: no need to sum duplicates first.
        sparse_aware(optax.scale_by_learning_rate(learning_rate), coalesce=False),
    )
