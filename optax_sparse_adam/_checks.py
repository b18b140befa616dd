"""Argument checks shared by every transformation: one home, one wording.

Each check raises ``ValueError`` or ``TypeError`` naming the argument (and,
for a leaf, its path in the tree) and what to do, at trace time. Schedules and
values traced under ``optax.inject_hyperparams`` are left alone.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_sparse_adam._indexed_rows import is_sparse
from optax_sparse_adam._tree import is_leaf, param_error

__all__ = [
    "check_bool",
    "check_dense_gradient",
    "check_dtype",
    "check_hparam",
    "check_learning_rate",
    "check_mask",
    "check_params",
    "check_state",
    "mask_tree",
]


def literal_zero(x: Any) -> bool:
    """Whether ``x`` is a Python number equal to 0: a weight decay that decays nothing, which
    ``optax.add_decayed_weights`` skips (and the kernels read no parameters for); an array zero is not one."""
    return isinstance(x, int | float) and x == 0


def check_decay_factor(learning_rate: Any, weight_decay: Any, where: str) -> None:
    """Refuses a learning rate and weight decay, both numbers, whose product is 1 or more: a row's decay over the
    steps it sat out is taken as a power of ``1 - learning_rate * weight_decay`` (by its logarithm), which is
    defined for a factor above 0 alone. Schedules and arrays are left alone (see the optimizers' docs)."""
    numbers_ = [x for x in (learning_rate, weight_decay) if isinstance(x, int | float | np.generic) and np.ndim(x) == 0]
    if len(numbers_) < 2:
        return
    product = float(learning_rate) * float(weight_decay)
    if product >= 1.0:
        raise ValueError(
            f"{where}: learning_rate * weight_decay is {product:g} (learning_rate {learning_rate!r}, weight_decay "
            f"{weight_decay!r}); it must be below 1: each step multiplies a row by 1 - learning_rate * "
            "weight_decay, and the decay of the steps a row sat out is taken as a power of that factor, which is "
            "defined only above 0. Lower the weight decay or the rate, or use sparse_adamw without catch_up, which "
            "decays each touched row by one step's factor"
        )


def check_hparam(name: str, value: Any, *, lower: float, lower_open: bool, upper: float = math.inf) -> None:
    """Checks a concrete scalar hyperparameter; schedules and traced (injected) values are left alone."""
    if callable(value) or isinstance(value, jax.core.Tracer):
        return
    arr = np.asarray(value)
    # inject_hyperparams casts to the parameters' dtype: bfloat16 (kind "V" to NumPy) is a real number too.
    if not (arr.dtype.kind in "iuf" or jnp.issubdtype(arr.dtype, jnp.floating)):
        raise TypeError(f"Invalid {name}: {value!r}; it must be a real number")
    if arr.ndim != 0:  # a one-element array of another shape would break broadcasting at every use
        raise ValueError(
            f"Invalid {name}: an array of shape {arr.shape}; it must be a scalar (a Python float or a 0-d array)"
        )
    v = float(arr)
    ok = (v > lower if lower_open else v >= lower) and (v < upper) and math.isfinite(v)
    if not ok:
        lo = f"> {lower:g}" if lower_open else f">= {lower:g}"
        rule = f"in [{lower:g}, {upper:g})" if math.isfinite(upper) else f"finite and {lo}"
        raise ValueError(f"Invalid {name}: {value!r}; it must be {rule}")


def check_learning_rate(value: Any) -> None:
    """Checks a concrete learning rate: a number > 0 (as ``torch.optim.SparseAdam`` has it), or a concrete jax
    array >= 0, as ``optax.inject_hyperparams`` passes a schedule's value when it builds the optimizer outside a
    trace (at ``init``, and at each eager step): a warmup from 0 reaches the optimizer as ``Array(0.)``, a step that
    moves no parameter, as optax takes it."""
    check_hparam("learning_rate", value, lower=0.0, lower_open=not isinstance(value, jax.Array))


def check_bool(name: str, value: Any) -> bool:
    """``value`` as a Python bool; a structural option must be one (it steers Python control flow)."""
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"Invalid {name}: {value!r}; it must be a bool")
    return bool(value)


def check_dtype(dtype: Any, name: str) -> Any:
    """A canonical floating (or complex) dtype, or ``None``; a clear error otherwise."""
    if dtype is None:
        return None
    try:
        dtype = jax.dtypes.canonicalize_dtype(dtype)
    except TypeError as e:
        raise TypeError(f"Invalid {name}: {dtype!r}; it must be a floating dtype such as jnp.float32") from e
    if not jnp.issubdtype(dtype, jnp.inexact):
        raise TypeError(f"Invalid {name}: {dtype}; it must be a floating dtype such as jnp.float32")
    return dtype


def check_mask(name: str, mask: Any) -> None:
    """A mask argument: a bool, a tree of bools, or a function returning one (checked when called)."""
    if callable(mask):
        return
    for path, flag in jax.tree_util.tree_leaves_with_path(mask):
        if not isinstance(flag, bool | np.bool_):
            raise TypeError(
                f"Invalid {name}: {flag!r} at {jax.tree_util.keystr(path) or '<root>'}; it must be a "
                "bool, a tree of bools (a prefix of the parameters), or a function returning one"
            )


def check_dense_gradient(path: Any, g: Any, shape: tuple[int, ...], where: str) -> jax.Array:
    """A dense gradient leaf as an array of the parameter's ``shape`` and a floating dtype."""
    g = jnp.asarray(g)
    if g.shape != tuple(shape):
        raise param_error(
            ValueError, where, path, f"gradient shape {g.shape} does not match the parameter shape {tuple(shape)}"
        )
    if not jnp.issubdtype(g.dtype, jnp.inexact):
        raise param_error(
            TypeError,
            where,
            path,
            f"the gradient has dtype {g.dtype}; this optimizer needs floating-point gradients: cast the gradient, "
            "or give this parameter a None gradient (or optax.set_to_zero) if it is not trained",
        )
    return g


def check_params(params: Any, where: str) -> None:
    """The parameters given to ``init`` are dense arrays: a sparse leaf is a gradient or update, not a parameter."""
    for path, p in jax.tree_util.tree_leaves_with_path(params, is_leaf=is_leaf):
        if p is not None and is_sparse(p):
            raise param_error(
                TypeError,
                where,
                path,
                f"the parameter is a sparse {type(p).__name__}; parameters must be dense arrays (a sparse leaf is a "
                "gradient or an update, not a parameter): pass the dense table, e.g. `leaf.todense()`",
            )


def check_state(state: Any, cls: type, where: str) -> None:
    """The state passed to ``update`` is the one ``init`` builds."""
    if not isinstance(state, cls):
        raise TypeError(
            f"{where}: the optimizer state is a {type(state).__name__}, not the {cls.__name__} this "
            "transformation's init builds; pass the state that `tx.init(params)` returned for this `tx`"
        )


def mask_tree(mask: Any, params: Any, name: str, where: str) -> Any:
    """``mask`` (a bool, a tree of bools that is a prefix of ``params``, or a function of ``params``) per leaf."""
    flags = mask(params) if callable(mask) else mask
    try:
        tree = jax.tree.map(
            lambda flag, sub: jax.tree.map(lambda _: flag, sub, is_leaf=is_leaf), flags, params, is_leaf=is_leaf
        )
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"{where}: {name} must be a bool, or a tree of bools that is a prefix of the parameters (or a "
            f"function returning one), but its structure does not fit the parameters: {e}"
        ) from None
    for path, flag in jax.tree_util.tree_leaves_with_path(tree, is_leaf=is_leaf):
        if not isinstance(flag, bool | np.bool_):
            raise param_error(TypeError, where, path, f"{name} must give a Python bool per leaf, got {flag!r}")
    return tree
