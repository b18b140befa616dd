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

import collections
import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, TypeVar, cast

import jax
import jax.numpy as jnp
import optax
from jax.extend.core import get_opaque_trace_state

from optax_sparse_adam._indexed_rows import is_sparse
from optax_sparse_adam._tree import laid_out_as, on_arrays

__all__: list[str] = []


class Call(NamedTuple):
    """One call of a fusable ``update`` inside :func:`recording`: its arguments and its results."""

    fusion: Any
    grads: Any
    state: Any
    params: Any
    updates: Any
    new_state: Any


# The innermost recording's calls, and the trace it began in (by a weak reference): a call made in another trace (a
# lax.cond branch, a scan body inside a wrapper's update) is not recorded, for its values belong to that trace and are
# out of the step's reach; held, they would outlive it.
_CALLS: contextvars.ContextVar[tuple[list[Any], Any] | None] = contextvars.ContextVar(
    "optax_sparse_adam_calls", default=None
)


def _trace() -> Any:
    return get_opaque_trace_state(convention="optax_sparse_adam")


def _calls() -> list[Any] | None:
    """The innermost recording's list, where the running code is in the trace it began in."""
    entry = _CALLS.get()
    return entry[0] if entry is not None and entry[1] == _trace() else None


@contextlib.contextmanager
def recording() -> Iterator[list[Any]]:
    """Collects the :class:`Call` of every fusable ``update`` called inside, and the :class:`Clipped` of every
    clipped sparse leaf (a nested block collects its own)."""
    calls: list[Any] = []
    token = _CALLS.set((calls, _trace()))
    try:
        yield calls
    finally:
        _CALLS.reset(token)


class Clipped(NamedTuple):
    """A sparse leaf that ``sparse_aware(optax.clip_by_global_norm(c))`` clipped inside :func:`recording`.

    Attributes:
      leaf: The clipped leaf it returned (summed rows, clipped).
      entries: What a fused kernel sums and clips in its place: the
        :class:`~optax_sparse_adam._sparse_leaf.SparseLeaf` of the entries it was given, as given (the padding
        of entries promised distinct may hold anything: the kernels skip padding keys, and code reading these
        values must leave padding out too).
      divisor: ``g_norm``, or 1 where the norm was below ``c``.
      factor: ``c``, or 1 where the norm was below ``c``: each summed row ``g`` became ``(g / divisor) * factor``.
      max_norm: ``c`` as a float32 scalar where this leaf is the only one the clipping saw, its norm the entries'
        own: a kernel that takes ``c`` alone then computes the norm as it sums the rows (or, of entries known
        distinct, from the entries), in the same call
        (:meth:`norm_appended_to`), and the pass that computed ``divisor`` and ``factor`` drops out; else ``None``.
    """

    leaf: Any
    entries: Any
    divisor: Any
    factor: Any
    max_norm: Any = None

    def scalars(self) -> jax.Array:
        """``[divisor, factor]``, the two scalars the kernels take after their own to clip each summed row."""
        return jnp.stack([self.divisor, self.factor])

    def append_to(self, scalars: jax.Array) -> jax.Array:
        """A kernel's ``scalars`` followed by the clipping's two."""
        return jnp.concatenate([scalars, self.scalars()])

    def norm_appended_to(self, scalars: jax.Array) -> jax.Array:
        """A kernel's ``scalars`` followed by ``max_norm`` alone, where there is one (the kernel then takes the
        norm from the entries itself); else by the clipping's two."""
        if self.max_norm is None:
            return self.append_to(scalars)
        return jnp.concatenate([scalars, jnp.reshape(self.max_norm, (1,))])


def recording_active() -> bool:
    """Whether a :func:`recording` block is collecting (in the trace it began in)."""
    return _calls() is not None


def record_clip(leaf: Any, entries: Any, divisor: Any, factor: Any, max_norm: Any = None) -> None:
    """Adds a :class:`Clipped` to the innermost :func:`recording`, if any."""
    calls = _calls()
    if calls is not None:
        calls.append(Clipped(leaf, entries, divisor, factor, max_norm))


def record(fusion: Any, grads: Any, state: Any, params: Any, out: tuple[Any, Any]) -> None:
    """Adds a call to the innermost :func:`recording`, if any."""
    calls = _calls()
    if calls is not None and fusion is not None:
        calls.append(Call(fusion, grads, state, params, *out))


@dataclasses.dataclass(frozen=True, eq=False)
class FusableUpdate:
    """An optimizer's ``update`` function that also carries how to fuse it with the parameters' update, and how
    the optimizer was built (``recipe``, where :func:`compiled_when_eager` built it)."""

    update: optax.TransformUpdateExtraArgsFn
    fusion: Any  # an AdamFusion, a RowwiseAdagradFusion, or a _partition.PartitionFusion
    recipe: Recipe | None = dataclasses.field(default=None, kw_only=True)

    def __call__(
        self, updates: optax.Updates, state: optax.OptState, params: optax.Params | None = None, **extra_args: Any
    ) -> tuple[optax.Updates, optax.OptState]:
        if self.recipe is not None and self.recipe.takes(updates, state, params, extra_args):
            compiled = self.recipe.update(updates, state, params)
            if compiled is not None:
                return compiled
        out = self.update(updates, state, params, **extra_args)
        record(self.fusion, updates, state, params, out)
        return out


# The place of an array among a recipe's arguments, and the mark of an optimizer there that has a recipe.
_ARRAY, _BUILT = object(), object()


@dataclasses.dataclass(frozen=True, eq=False)
class Recipe:
    """How an optimizer was built: its factory, the structure and the other values of its arguments (``key``), and
    their jax arrays (``arrays``: injected hyperparameters, a stochastic rounding key)."""

    key: tuple[Any, ...]
    arrays: tuple[jax.Array, ...]

    @staticmethod
    def takes(updates: Any, state: Any, params: Any, extra_args: dict[str, Any]) -> bool:
        """Whether a call runs compiled: sparse gradients (dense ones run op by op, as optax's optimizers do, and
        equal them bitwise so), jax arrays alone, no trace, no extra arguments."""
        return (
            not extra_args
            and any(is_sparse(x) for x in jax.tree.leaves(updates, is_leaf=is_sparse))
            and not recording_active()
            and on_arrays(updates, state, params)
        )

    def update(self, updates: Any, state: Any, params: Any) -> tuple[Any, Any] | None:
        """The optimizer's ``update`` as one program, compiled for the first optimizer built alike and kept for the
        next (``optax.inject_hyperparams`` builds one at every step; its hyperparameters are the arrays); its state
        laid out as the caller's. ``None`` where the optimizer's key changes at every call (see
        :func:`_compiled_update`): the caller then runs it op by op."""
        program = _compiled_update(self.key)
        if program is None:
            return None
        new_updates, new_state = program(self.arrays, updates, state, params)
        return new_updates, laid_out_as(new_state, state)


def _built(x: Any) -> bool:
    """Whether ``x`` is an optimizer a :func:`compiled_when_eager` factory built (with its recipe)."""
    return isinstance(x, optax.GradientTransformation) and getattr(x.update, "recipe", None) is not None


def _rebuild(key: tuple[Any, ...], given: Iterator[jax.Array]) -> Any:
    """The optimizer of recipe ``key`` (its factory's own, without a recipe), its arrays taken from ``given``."""
    factory, treedef, statics = key
    leaves = [next(given) if x is _ARRAY else _rebuild(x[1], given) if x[0] is _BUILT else x[1] for x in statics]
    args, kwargs = jax.tree.unflatten(treedef, leaves)
    return factory(*args, **kwargs)


# The programs of the last _PROGRAMS_KEPT recipes called (each holds its recipe's static arguments), and at each
# place (a factory and its arguments' structure) the calls since the last that found its program.
_PROGRAMS: collections.OrderedDict[tuple[Any, ...], Callable[..., Any]] = collections.OrderedDict()
_PROGRAMS_KEPT = 16
_MISSES: dict[tuple[Any, ...], int] = {}
_MAX_MISSES = 4


def _compiled_update(key: tuple[Any, ...]) -> Callable[..., Any] | None:
    """The jitted update of recipe ``key``; ``None`` where the last ``_MAX_MISSES`` calls at its place each built
    a program of their own: an argument built anew at every step (a mask or schedule defined inside the function
    ``inject_hyperparams`` calls, a chain inside a wrapper) makes every call a new key, and compiling each costs
    more than running it op by op. A call that finds its program opens the place again."""
    program = _PROGRAMS.get(key)
    place = key[:2]
    if program is not None:
        _PROGRAMS.move_to_end(key)
        _MISSES[place] = 0
        return program
    if _MISSES.get(place, 0) >= _MAX_MISSES:
        return None
    _MISSES[place] = _MISSES.get(place, 0) + 1

    def update(arrays: tuple[jax.Array, ...], updates: Any, state: Any, params: Any) -> Any:
        return _rebuild(key, iter(arrays)).update(updates, state, params)

    update.__name__ = update.__qualname__ = f"{key[0].__name__}_update"  # the program's name in a profile
    program = _PROGRAMS[key] = jax.jit(update)
    while len(_PROGRAMS) > _PROGRAMS_KEPT:
        _PROGRAMS.popitem(last=False)
    return program


def _recipe(factory: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Recipe | None:
    """``factory(*args, **kwargs)``'s :class:`Recipe`; ``None`` where an argument is traced or can be neither an
    operand nor a key (a NumPy array). An optimizer among the arguments built by such a factory enters by its own
    recipe, so that a wrapper of an optimizer built anew at each step (by ``optax.inject_hyperparams``) keeps its
    key."""
    leaves, treedef = jax.tree.flatten((args, kwargs), is_leaf=_built)
    statics: list[Any] = []
    arrays: list[jax.Array] = []
    for x in leaves:
        if isinstance(x, jax.core.Tracer):
            return None
        if isinstance(x, jax.Array):
            statics.append(_ARRAY)
            arrays.append(x)
        elif _built(x):
            statics.append((_BUILT, x.update.recipe.key))
            arrays.extend(x.update.recipe.arrays)
        else:
            statics.append((type(x), x))  # the type too: 1, 1.0 and True are equal keys, and may build apart
    key = (factory, treedef, tuple(statics))
    try:
        hash(key)
    except TypeError:
        return None
    return Recipe(key, tuple(arrays))


_Factory = TypeVar("_Factory", bound=Callable[..., Any])


def compiled_when_eager(factory: _Factory) -> _Factory:
    """An optimizer factory whose optimizer's ``update``, called on jax arrays outside any trace (op by op, a
    step's conditionals and loops would be traced and compiled again on every call: from 0.1 s a step for
    ``sparse_adam`` to seconds for a catch-up step under a schedule), runs as one compiled program, kept for the
    next optimizer built alike. Under a trace (the caller's ``jit``, ``vmap``, a recording of
    :func:`update_and_apply`), with extra arguments, or on NumPy arrays, it runs as it is."""

    @functools.wraps(factory)
    def build(*args: Any, **kwargs: Any) -> Any:
        tx = factory(*args, **kwargs)
        if isinstance(tx.update, FusableUpdate):
            recipe = _recipe(factory, args, kwargs)
            if recipe is not None:
                tx = tx._replace(update=dataclasses.replace(tx.update, recipe=recipe))
        return tx

    return cast(_Factory, build)
