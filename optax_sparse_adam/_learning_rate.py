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
import optax

from optax_sparse_adam._fusion import FusableUpdate
from optax_sparse_adam._row_engine import at_count
from optax_sparse_adam._sparse_aware import sparse_aware
from optax_sparse_adam._tree import is_leaf

__all__: list[str] = []

# A stage's update: (updates, state, params, scale) -> (updates, state), its updates multiplied by `scale` as
# optax.scale multiplies them (jnp.asarray(scale, u.dtype) * u), or as they are where `scale` is None.
StageUpdate = Callable[[optax.Updates, optax.OptState, optax.Params | None, Any], tuple[optax.Updates, optax.OptState]]


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
    inner: optax.GradientTransformationExtraArgs, learning_rate: optax.ScalarOrSchedule, fusion: Any
) -> optax.GradientTransformationExtraArgs:
    """``optax.chain(inner, sparse_aware(optax.scale_by_learning_rate(learning_rate)))`` for a :func:`stage`
    ``inner``, its state the chain's, whose ``tx.update`` multiplies the stage's updates by ``-lr`` inside the
    stage's pass (on a rows kernel, its step rows as it writes them) rather than in a second pass over them;
    ``fusion`` travels with it for :func:`update_and_apply`."""
    assert isinstance(inner.update, _StageUpdate), "with_learning_rate takes a stage()"
    update = inner.update.scalable
    scale = sparse_aware(optax.scale_by_learning_rate(learning_rate))
    tx = optax.chain(inner, scale)

    def update_fn(
        updates: optax.Updates, state: Any, params: optax.Params | None = None, **extra_args: Any
    ) -> tuple[optax.Updates, Any]:
        if not (isinstance(state, tuple) and len(state) == 2):
            return tx.update(updates, state, params, **extra_args)  # the chain reports what is wrong
        inner_state, scale_state = state
        count = scale_state.count if callable(learning_rate) else None  # a constant rate's stage counts nothing
        updates, inner_state = update(updates, inner_state, params, -1 * at_count(learning_rate, count))
        _, scale_state = scale.update(jax.tree.map(lambda _: None, updates, is_leaf=is_leaf), scale_state)
        return updates, (inner_state, scale_state)

    return optax.GradientTransformationExtraArgs(tx.init, FusableUpdate(update_fn, fusion))
