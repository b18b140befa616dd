"""How an optimizer's ``update`` carries what :func:`update_and_apply` needs to fuse it, and how that step finds it.

An optimizer the fused step can run in one pass per row returns an
``update`` function that carries its ``fusion`` (learning rate,
hyperparameters). Called directly, :func:`update_and_apply` reads it from
``tx.update``. Wrapped (``optax.inject_hyperparams``, ``optax.chain`` with
stages before it, ``optax.multi_transform``), the optimizer's ``update`` is
called by the wrapper's: :func:`update_and_apply` runs the wrapper's update
inside :func:`recording`, and every fusable update called there leaves a
:class:`Call` with what it was given and what it returned. Where the
wrapper passes that call's updates and new state through untouched (the
very same traced arrays), the fused kernel's results can stand in for them.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any, NamedTuple

import optax

__all__: list[str] = []


class Call(NamedTuple):
    """One call of a fusable ``update`` inside :func:`recording`: its arguments and its results."""

    fusion: Any
    grads: Any
    state: Any
    params: Any
    updates: Any
    new_state: Any


_CALLS: contextvars.ContextVar[list[Call] | None] = contextvars.ContextVar("optax_sparse_adam_calls", default=None)


@contextlib.contextmanager
def recording() -> Iterator[list[Call]]:
    """Collects the :class:`Call` of every fusable ``update`` called inside (a nested block collects its own)."""
    calls: list[Call] = []
    token = _CALLS.set(calls)
    try:
        yield calls
    finally:
        _CALLS.reset(token)


def record(fusion: Any, grads: Any, state: Any, params: Any, out: tuple[Any, Any]) -> None:
    """Adds a call to the innermost :func:`recording`, if any."""
    calls = _CALLS.get()
    if calls is not None and fusion is not None:
        calls.append(Call(fusion, grads, state, params, *out))


@dataclasses.dataclass(frozen=True, eq=False)
class FusableUpdate:
    """An optimizer's ``update`` function that also carries how to fuse it with the parameters' update."""

    update: optax.TransformUpdateExtraArgsFn
    fusion: Any  # an AdamFusion, a RowwiseAdagradFusion, or a _partition.PartitionFusion

    def __call__(
        self, updates: optax.Updates, state: optax.OptState, params: optax.Params | None = None, **extra_args: Any
    ) -> tuple[optax.Updates, optax.OptState]:
        out = self.update(updates, state, params, **extra_args)
        record(self.fusion, updates, state, params, out)
        return out
