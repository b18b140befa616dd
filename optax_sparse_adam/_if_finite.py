"""``optax.apply_if_finite`` whose step :func:`update_and_apply` fuses: :func:`apply_if_finite`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from optax_sparse_adam import _ffi, _kernel_path
from optax_sparse_adam._fusion import FusableUpdate, compiled_when_eager

__all__ = ["IfFiniteFusion", "apply_if_finite", "if_finite_step", "is_finite"]


@dataclasses.dataclass(frozen=True)
class IfFiniteFusion:
    """What :func:`update_and_apply` needs of an :func:`apply_if_finite` to fuse its inner step."""

    inner: optax.GradientTransformation
    max_consecutive_errors: int


@compiled_when_eager
def apply_if_finite(
    inner: optax.GradientTransformation, max_consecutive_errors: int
) -> optax.GradientTransformationExtraArgs:
    """:func:`optax.apply_if_finite`, with a fused step through :func:`update_and_apply`.

    The same transformation as optax's: its ``init`` is optax's, so its state
    is an :class:`optax.ApplyIfFiniteState` (checkpoints move between the two),
    and ``tx.update`` is optax's rule with the very same results, but for one
    repair: where the inner update's shapes or dtypes differ from the
    gradient's, a skipped step returns zeros of the update's (shardings
    included), not optax's zeros like the gradient. A row-wise optimizer
    returns a bfloat16 or float16 gradient's update in float32 (its
    arithmetic's dtype), where optax's wrapper fails in :func:`jax.lax.cond`
    (branches of different types). The inner update is traced once. A
    step whose gradient holds a NaN or an infinity (in any array, the padding
    entries of a sparse leaf too) leaves the inner state as it was, and adds
    zeros to the parameters; after ``max_consecutive_errors`` such steps in a
    row the next one is applied all the same.

    What differs is :func:`update_and_apply`. optax's wrapper calls the inner
    ``update`` inside a :func:`jax.lax.cond`, where the fused step cannot
    reach it, so ``update_and_apply(optax.apply_if_finite(...), ...)`` takes
    the two calls. Here ``update_and_apply`` checks the gradient (one pass
    over its values) and runs ``update_and_apply(inner, ...)`` in the branch
    that accepts the step: the tables are updated in place, one pass per
    touched row where the kernels apply, and no table is copied. That holds
    where it is the outermost transformation (it may wrap chains,
    ``multi_transform`` and the rest); wrapped in turn, its update runs as
    optax's, inside ``lax.cond``, and takes the two calls. A skipped
    step leaves every parameter bitwise as it was; the two calls add optax's
    zero update, which turns a ``-0.0`` into ``0.0`` (in a table, at row 0,
    where a sparse leaf's zeros land). Dense leaves (and a whole dense table)
    are stepped by the inner transformation's XLA arithmetic in the accepting
    branch, where XLA contracts the parameter's add into the step's
    multiply-adds as it cannot across the two calls' ``lax.cond``: they may
    differ from the two calls' by an ulp.

    Args:
      inner: The transformation to guard, e.g. :func:`sparse_adam`.
      max_consecutive_errors: How many non-finite steps in a row are skipped.

    Returns:
      An :class:`optax.GradientTransformationExtraArgs`.

    Examples:
      >>> import jax.numpy as jnp
      >>> import optax_sparse_adam as osa
      >>> params = {"emb": jnp.ones((4, 2), jnp.float32)}
      >>> tx = osa.apply_if_finite(osa.sparse_adam(0.1), max_consecutive_errors=3)
      >>> state = tx.init(params)
      >>> bad = {"emb": osa.IndexedRows(jnp.array([1]), jnp.array([[jnp.nan, 1.0]]), 4)}
      >>> params, state = osa.update_and_apply(tx, bad, state, params)
      >>> params["emb"][1], int(state.notfinite_count)
      (Array([1., 1.], dtype=float32), 1)
    """
    init = optax.apply_if_finite(inner, max_consecutive_errors).init  # optax's state
    guarded = optax.with_extra_args_support(inner)  # the fusion keeps `inner` as given

    def update(updates, state, params=None, **extra_args):  # type: ignore[no-untyped-def]
        traced: list[Any] = []  # the inner update's types, as the accepting branch traces it

        def accept() -> Any:
            out = guarded.update(updates, state.inner_state, params, **extra_args)
            traced.append(jax.tree.map(jax.typeof, out[0]))
            return out

        def reject() -> Any:
            # lax.cond traces its true branch first (jax 0.10 to 0.11): the accepting one, whose types this one then
            # takes. Were the order to change, this branch would trace the inner update once more (eval_shape).
            return _zeros_of(updates, traced[0] if traced else jax.eval_shape(accept)[0]), state.inner_state

        return if_finite_step(updates, state, max_consecutive_errors, accept, reject)

    return optax.GradientTransformationExtraArgs(
        init, FusableUpdate(update, IfFiniteFusion(inner, max_consecutive_errors))
    )


def if_finite_step(
    grads: Any,
    state: optax.ApplyIfFiniteState,
    max_consecutive_errors: int,
    accept: Callable[[], tuple[Any, Any]],
    reject: Callable[[], tuple[Any, Any]],
) -> tuple[Any, optax.ApplyIfFiniteState]:
    """:func:`optax.apply_if_finite`'s bookkeeping around a step: ``accept()`` or ``reject()``, each returning a
    result and the inner state, in the branches of a :func:`jax.lax.cond`, and the counters as optax keeps them.
    The update of :func:`apply_if_finite` and its fused step (``update_and_apply``) both take this."""
    finite = is_finite(grads)
    notfinite_count = jnp.where(finite, jnp.zeros([], jnp.int32), optax.safe_increment(state.notfinite_count))
    out, inner_state = jax.lax.cond(jnp.logical_or(finite, notfinite_count > max_consecutive_errors), accept, reject)
    return out, optax.ApplyIfFiniteState(
        notfinite_count=notfinite_count,
        last_finite=finite,
        total_notfinite=jnp.where(finite, state.total_notfinite, optax.safe_increment(state.total_notfinite)),
        inner_state=inner_state,
    )


def _zeros_of(updates: Any, types: Any) -> Any:
    """The skipped step's update: optax's zeros (like the gradient) where they have the inner update's shapes and
    dtypes, as they do but for a row-wise optimizer's float32 update of a narrower gradient; else zeros of the
    update's types, shardings included."""
    zeros = optax.tree.zeros_like(updates)
    try:
        fits = jax.tree.leaves(jax.tree.map(lambda z, t: z.shape == t.shape and z.dtype == t.dtype, zeros, types))
    except (ValueError, TypeError):  # trees of other structures
        fits = [False]
    if all(fits):
        return zeros
    return jax.tree.map(lambda t: jnp.zeros(t.shape, t.dtype, out_sharding=_explicit(t.sharding)), types)


def _explicit(sharding: Any) -> Any:
    """``sharding`` where its mesh has an explicit axis (what ``out_sharding`` takes), else ``None``."""
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty or jax.sharding.AxisType.Explicit not in mesh.axis_types:
        return None
    return sharding


# Elements from which a float32 array is checked by the native kernel on the CPU (a smaller one costs XLA less than
# the kernel's call).
_NATIVE_FROM = 1 << 14


def _finite(x: jax.Array) -> jax.Array:
    """Whether the inexact array ``x`` is finite: exactly where ``sum(x * 0)`` is (every finite element gives a
    zero, every infinity or NaN a NaN, and a sum of zeros cannot overflow). XLA:CPU vectorizes that sum, on one
    thread; ``all(isfinite(x))``, a reduction of booleans, took about twice as long on a batch of gradient rows. A
    large float32 array is checked on the CPU by a native kernel instead (over the threads, the elements' exponent
    bits): the same answer."""

    def xla(x: jax.Array) -> jax.Array:
        return jnp.isfinite(jnp.sum(x * 0))

    if x.dtype == jnp.float32 and x.size >= _NATIVE_FROM and _kernel_path.supports_rows((x.size, 1), x):
        return _kernel_path.select(_ffi.all_finite, xla, x)
    return xla(x)


def is_finite(tree: Any) -> jax.Array:
    """Whether every array of ``tree`` is finite, as :func:`optax.apply_if_finite` decides it."""
    arrays = [jnp.asarray(x) for x in jax.tree.leaves(tree)]
    flags = [_finite(x) for x in arrays if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.array(flags)) if flags else jnp.array(True)
