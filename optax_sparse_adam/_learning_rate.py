"""An optimizer's scaling stage and the learning rate in one pass: :func:`with_learning_rate`.

Most of the library's optimizers are ``optax.chain(stage,
sparse_aware(optax.scale_by_learning_rate(lr)))``, as optax builds its own. Run
as written, ``tx.update`` makes a second pass over the stage's update rows to
multiply them by ``-lr``: on the CPU, a pass of XLA's over every row of a
batch after the rows kernel wrote them. A stage that can scale its own updates
(its update takes the factor, its rule and rows kernel multiply by it) takes
the learning rate in its pass instead: the same multiplication of the same
values, so the same numbers, and the same state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from optax_sparse_adam._checks import literal_zero, mask_tree
from optax_sparse_adam._fusion import FusableUpdate
from optax_sparse_adam._row_engine import at_count
from optax_sparse_adam._sparse_aware import sparse_aware
from optax_sparse_adam._tree import is_leaf

__all__: list[str] = []

# A stage's update: (updates, state, params, scale) -> (updates, state), its updates multiplied by `scale` as
# optax.scale multiplies them (jnp.asarray(scale, u.dtype) * u), or as they are where `scale` is None; a stage
# that decays (with_learning_rate's weight_decay) takes a fifth argument, (weight_decay, flags).
StageUpdate = Callable[..., tuple[optax.Updates, optax.OptState]]


@dataclasses.dataclass(frozen=True, eq=False)
class _StageUpdate:
    """A stage's ``update`` as optax calls it, its updates as they are; ``scalable`` also takes the factor."""

    scalable: StageUpdate

    def __call__(
        self, updates: optax.Updates, state: optax.OptState, params: optax.Params | None = None, **extra_args: Any
    ) -> tuple[optax.Updates, optax.OptState]:
        del extra_args
        return self.scalable(updates, state, params, None)


def stage(init_fn: optax.TransformInitFn, update: StageUpdate) -> optax.GradientTransformationExtraArgs:
    """A scaling stage (``scale_by_...``) whose updates :func:`with_learning_rate` can scale in its pass."""
    return optax.GradientTransformationExtraArgs(init_fn, _StageUpdate(update))


def with_learning_rate(
    inner: optax.GradientTransformationExtraArgs,
    learning_rate: optax.ScalarOrSchedule,
    fusion: Any,
    *,
    weight_decay: Any = None,
    mask: Any = None,
    where: str = "",
) -> optax.GradientTransformationExtraArgs:
    """``optax.chain(inner, sparse_aware(optax.scale_by_learning_rate(learning_rate)))`` for a :func:`stage`
    ``inner``, its state the chain's, whose ``tx.update`` multiplies the stage's updates by ``-lr`` inside the
    stage's pass (on a rows kernel, its step rows as it writes them) rather than in a second pass over them;
    ``fusion`` travels with it for :func:`update_and_apply`.

    With ``weight_decay``, ``sparse_aware(optax.add_decayed_weights(weight_decay, mask))`` sits between the two,
    as in :func:`optax.adamw`, and the stage (whose update then also takes ``(weight_decay, flags)``, a bool a
    leaf of the parameters) adds the decay in the same pass: the parameters' rows read where the rows are
    written. Where the decay is a schedule, or reaches a leaf whose updates or parameters are not float32, the
    chain itself runs (its numbers there are not the stage's). ``where`` names the optimizer in errors about
    ``mask``."""
    assert isinstance(inner.update, _StageUpdate), "with_learning_rate takes a stage()"
    update = inner.update.scalable
    scale = sparse_aware(optax.scale_by_learning_rate(learning_rate))
    between = () if weight_decay is None else (sparse_aware(optax.add_decayed_weights(weight_decay, mask)),)
    tx = optax.chain(inner, *between, scale)
    # add_decayed_weights skips a literal zero (the updates as they are, even where p is not finite); a schedule
    # of weight decays keeps a count, which the chain advances.
    skips = literal_zero(weight_decay)
    scheduled = callable(weight_decay)

    def update_fn(
        updates: optax.Updates, state: Any, params: optax.Params | None = None, **extra_args: Any
    ) -> tuple[optax.Updates, Any]:
        if not (isinstance(state, tuple) and len(state) == 2 + len(between)) or (between and params is None):
            return tx.update(updates, state, params, **extra_args)  # the chain reports what is wrong
        flags = None
        if between and not skips:
            flags = mask_tree(True if mask is None else mask, params, "mask", where)
            if scheduled or not _decays_in_float32(updates, params, flags):
                return tx.update(updates, state, params, **extra_args)
        inner_state, *kept, scale_state = state  # add_decayed_weights' own state: empty (masked or not), kept
        count = scale_state.count if callable(learning_rate) else None  # a constant rate's stage counts nothing
        factor = -1 * at_count(learning_rate, count)
        if flags is not None:
            updates, inner_state = update(updates, inner_state, params, factor, (weight_decay, flags))
        else:
            updates, inner_state = update(updates, inner_state, params, factor)
        _, scale_state = scale.update(jax.tree.map(lambda _: None, updates, is_leaf=is_leaf), scale_state)
        return updates, (inner_state, *kept, scale_state)

    return optax.GradientTransformationExtraArgs(tx.init, FusableUpdate(update_fn, fusion))


def _decays_in_float32(updates: optax.Updates, params: optax.Params, flags: Any) -> bool:
    """Whether every leaf the decay reaches has float32 updates and parameters: there the stage's pass computes
    the chain's numbers. With another dtype the chain rounds each update to its dtype before it adds the decay and
    scales, and a 16-bit table's rows are no kernel's read: the chain itself runs."""
    leaves = jax.tree.leaves(updates, is_leaf=lambda x: x is None or is_leaf(x))
    ps, fs = jax.tree.leaves(params), jax.tree.leaves(flags)
    if not len(leaves) == len(ps) == len(fs):
        return False
    f32 = jnp.dtype(jnp.float32)
    return all(
        u is None or not f or (jnp.dtype(u.dtype) == f32 and jnp.dtype(p.dtype) == f32)
        for u, p, f in zip(leaves, ps, fs, strict=True)
    )
