"""One call for an optimizer step and its application: :func:`update_and_apply`."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_sparse_adam import _ffi, _kernel_path
from optax_sparse_adam._adagrad import AdagradFusion
from optax_sparse_adam._adam import AdamFusion, kernel_flags, kernel_scalars
from optax_sparse_adam._amsgrad import AmsgradFusion, CatchUpAmsgradFusion
from optax_sparse_adam._apply import apply_updates
from optax_sparse_adam._catch_up import CatchUpAdamWFusion, CatchUpFusion, fused_apply
from optax_sparse_adam._checks import mask_tree
from optax_sparse_adam._ftrl import FtrlFusion
from optax_sparse_adam._fusion import Call, Clipped, recording
from optax_sparse_adam._if_finite import IfFiniteFusion, if_finite_step
from optax_sparse_adam._indexed_rows import is_sparse
from optax_sparse_adam._partition import PartitionFusion, masked, merge
from optax_sparse_adam._row_engine import Arrays, row_shape
from optax_sparse_adam._row_ops import HALF_FLOATS
from optax_sparse_adam._rowwise import RowwiseAdagradFusion, RowwiseAdamFusion, adagrad_scalars, rowwise_adam_scalars
from optax_sparse_adam._sgd import CatchUpMomentumFusion, MomentumFusion
from optax_sparse_adam._sparse_leaf import SparseLeaf, to_sparse_leaf
from optax_sparse_adam._stochastic_rounding import apply_stochastic, leaf_seeds
from optax_sparse_adam._tree import compiled_on_arrays, is_leaf

__all__ = ["update_and_apply"]


def update_and_apply(
    tx: optax.GradientTransformation,
    grads: optax.Updates,
    state: optax.OptState,
    params: optax.Params,
    *,
    key: jax.Array | None = None,
) -> tuple[optax.Params, optax.OptState]:
    r"""One optimizer step applied to the parameters: ``tx.update`` then :func:`apply_updates`.

    The result equals

    .. code-block:: python

      updates, state = tx.update(grads, state, params)
      params = osa.apply_updates(params, updates)

    for any ``tx`` (but for a ``-0.0`` at row 0 of a table in a step that
    :func:`apply_if_finite` skips: see there). Where ``tx`` is an optimizer built by
    :func:`~optax_sparse_adam.sparse_adam` (``catch_up`` too),
    :func:`~optax_sparse_adam.sparse_adamw` (``catch_up`` too),
    :func:`~optax_sparse_adam.sparse_amsgrad` (``catch_up`` too),
    :func:`~optax_sparse_adam.sparse_rowwise_adam`,
    :func:`~optax_sparse_adam.sparse_rowwise_adagrad`,
    :func:`~optax_sparse_adam.sparse_adagrad`, :func:`~optax_sparse_adam.sparse_ftrl` or
    :func:`~optax_sparse_adam.sparse_sgd` with momentum (``catch_up`` too), or wraps one in a way
    that passes its updates and state through untouched
    (``optax.inject_hyperparams``, stages such as
    ``sparse_aware(clip_by_global_norm(c))`` before it,
    ``optax.multi_transform``, :func:`partition_tables`,
    :func:`apply_if_finite`), and the native CPU
    kernels apply (:func:`kernel_path` is ``"native-cpu"``; float32 tables
    with one sparse axis, and for the row-wise optimizers bfloat16 and float16
    ones too, see below), each sparse leaf is done in one pass per touched
    row that reads and writes its parameters and its optimizer state
    together, without materializing the update:

    .. math::

      p_S \leftarrow p_S - \alpha_t \, u_S

    with :math:`u_S` the step of :func:`scale_by_sparse_adam` (of
    :func:`scale_by_rowwise_adam`; of :func:`scale_by_rowwise_adagrad`, plus :math:`\lambda p_S` with decoupled
    weight decay; of the other optimizers' rules; FTRL's update is its new parameter minus the old, and a catch-up
    optimizer's row first takes the steps it sat out). It checks
    what the two calls check (int8 or uint8 indices too narrow to mark a
    table's padding are refused on every path). Its numbers are those of the
    kernels (see :func:`kernel_path`): from the same state, ``nu`` bitwise
    that of the two calls on the XLA path, ``mu`` within one ulp of the larger
    of its old and new values, the parameters within two ulps of themselves
    plus one of the largest update, because XLA:CPU chooses by shape which
    multiply-adds it fuses (and where ``maximize`` negates the gradient). For
    the row-wise optimizers see :func:`scale_by_rowwise_adam` and
    :func:`scale_by_rowwise_adagrad` for how their numbers relate to the two calls', and the native kernels guide
    for the element-wise optimizers (Adagrad, FTRL, momentum). After
    ``sparse_aware(optax.clip_by_global_norm(c))``, every fused kernel (lazy Adam, AdamW, AMSGrad, catch-up Adam,
    AdamW and AMSGrad, row-wise Adam and row-wise Adagrad, element-wise Adagrad, FTRL and momentum, with catch-up
    too) sums a table's entries and clips each row itself, bitwise
    as the two calls on the kernels clip them (for the catch-up optimizers on ids given as distinct, as they clip
    them computed on their own: see the native kernels guide). On
    other platforms, for other leaves, under differentiation and in
    :func:`jax.export` artifacts the two calls run. Use it under
    :func:`jax.jit` with the parameters and state donated. Called on arrays
    (outside a jitted function), it runs as one compiled program, kept for the
    next call with the same optimizer and shapes; it then keeps the arrays it
    is given, and writes new ones.

    Row-wise Adagrad and row-wise Adam (their state float32) also run fused on
    bfloat16 and float16 tables: each touched row is widened to float32, updated,
    and rounded once to the table's dtype, to nearest as :func:`apply_updates`
    rounds it. With ``key``, bfloat16 and float16 parameters are rounded
    stochastically: the step equals ``tx.update`` then
    :func:`apply_updates_stochastic` with that key (pass a new one every step:
    ``keys[step]`` of keys split once, see :func:`apply_updates_stochastic`), fused for those two optimizers (the
    kernel draws as :func:`apply_updates_stochastic` draws, from the key it
    folds in for the leaf); other optimizers, and wrapped ones, run the two
    calls with a key. Float32 parameters are added as without it. The 16-bit
    parameters are those of the two calls but where ``p + u`` formed in float32
    differs by the rounding XLA's fusions already allow on float32 tables: one
    ulp of the table's dtype, rarely (``tests/test_half_table_kernels.py``).

    Args:
      tx: An optax transformation.
      grads: Gradients, with sparse leaves where ``tx`` takes them.
      state: ``tx``'s state.
      params: The parameters.
      key: A PRNG key to round bfloat16 and float16 parameters stochastically, or ``None`` to round them to
        nearest.

    Returns:
      ``(params, state)`` after the step.

    Examples:
      >>> import jax.numpy as jnp
      >>> import optax_sparse_adam as osa
      >>> params = {"emb": jnp.ones((4, 2), jnp.float32)}
      >>> tx = osa.sparse_adam(0.1)
      >>> state = tx.init(params)
      >>> grads = {"emb": osa.IndexedRows(jnp.array([2, 2, -1]), jnp.ones((3, 2), jnp.float32), 4)}
      >>> params, state = osa.update_and_apply(tx, grads, state, params)
      >>> params["emb"].round(3)
      Array([[1. , 1. ],
             [1. , 1. ],
             [0.9, 0.9],
             [1. , 1. ]], dtype=float32)
    """
    # Called on arrays: one compiled program, kept for the next call (run op by op, the step's conditionals, built
    # anew on each call, compiled again every time: 2.3 s a step for sparse_adam(schedule, catch_up=True) on a table
    # of 100 rows; and each step count's bias correction too).
    return _fused_step_on_arrays(tx, grads, state, params, key, like=(2, 1))


def fused_step(
    tx: optax.GradientTransformation,
    grads: optax.Updates,
    state: optax.OptState,
    params: optax.Params,
    key: jax.Array | None = None,
    first_rows: dict[int, jax.Array] | None = None,
) -> tuple[optax.Params, optax.OptState]:
    """:func:`update_and_apply`; with ``key``, the rows of the parameter at position ``i`` (of
    ``jax.tree.leaves(params)``) draw as the rows from ``first_rows[i]`` on of a larger table (a block of a
    row-sharded one inside ``shard_map``: see :func:`._stochastic_rounding.apply_stochastic`)."""
    fusion = getattr(tx.update, "fusion", None)
    fusable = _fusable(fusion)
    apply: Callable[[Any, Any], Any] = apply_updates
    if key is not None and any(getattr(p, "dtype", None) in HALF_FLOATS for p in jax.tree.leaves(params)):
        apply = functools.partial(apply_stochastic, key=key, first_rows=first_rows)
        if fusable is None or not fusable.half_params:  # the kernels that round stochastically are the row-wise ones
            updates, state = tx.update(grads, state, params)
            return apply(params, updates), state
    else:
        key = None
    if isinstance(fusion, PartitionFusion) and isinstance(state, optax.PartitionState):
        return _partitioned(fusion, grads, state, params)
    if isinstance(fusion, IfFiniteFusion) and isinstance(state, optax.ApplyIfFiniteState):
        return _if_finite(fusion, grads, state, params)
    if fusable is None and _kernel_path.enabled():
        return _wrapped(tx, grads, state, params)
    fused = _fusable_leaves(fusable, grads, state, params) if fusable is not None and _kernel_path.enabled() else {}
    if fusable is None or not fused:
        updates, state = tx.update(grads, state, params)
        return apply(params, updates), state

    grad_leaves, treedef = _flatten(grads)
    # Everything else takes the plain path: the step count and a schedule's count advance there.
    rest = treedef.unflatten([None if i in fused else g for i, (_, g) in enumerate(grad_leaves)])
    updates, new_state = tx.update(rest, state, params)
    new_params = apply(params, updates)

    lr = fusable.learning_rate
    if callable(lr):
        lr = lr(optax.tree.get(state, fusable.count_owner).count)
    scalars = fusable.scalars(state, new_state, -1 * lr)
    p_leaves = treedef.flatten_up_to(params)
    state_leaves = [treedef.flatten_up_to(tree) for tree in fusable.trees(state)]
    options = fusable.leaf_options(treedef, params)
    seeds = _seeds(key, treedef, params, fused, first_rows or {})

    def native() -> list[tuple[jax.Array, ...]]:
        return [
            fusable.run(p_leaves[i], tuple(leaves[i] for leaves in state_leaves), sp, scalars, options[i], seeds[i])
            for i, sp in fused.items()
        ]

    def xla() -> list[tuple[jax.Array, ...]]:
        only = treedef.unflatten([g if i in fused else None for i, (_, g) in enumerate(grad_leaves)])
        updates, s = tx.update(only, state, params)
        p = treedef.flatten_up_to(apply(params, updates))
        trees = [treedef.flatten_up_to(tree) for tree in fusable.trees(s)]
        return [(p[i], *(leaves[i] for leaves in trees)) for i in fused]

    results = dict(zip(fused, _kernel_path.select(native, xla), strict=True))
    out_p = treedef.flatten_up_to(new_params)
    out_state = [treedef.flatten_up_to(tree) for tree in fusable.trees(new_state)]
    for i, (p, *new) in results.items():
        out_p[i] = p
        for leaves, x in zip(out_state, new, strict=True):
            leaves[i] = x
    trees = {name: treedef.unflatten(leaves) for name, leaves in zip(fusable.fields, out_state, strict=True)}
    return treedef.unflatten(out_p), optax.tree.set(new_state, **trees)


_fused_step_on_arrays = compiled_on_arrays(fused_step, "update_and_apply")


class _Fusable(NamedTuple):
    """What differs between the optimizers :func:`update_and_apply` fuses; the fused step itself is shared.

    Attributes:
      learning_rate: The chain's learning rate (a schedule reads the chain's ``ScaleByScheduleState``).
      where: The transformation whose rule the kernel runs, for errors.
      owner: The name of the state class (in the chain's state) holding the trees the kernel updates.
      fields: Their field names, one state leaf per parameter each.
      fits: ``fits(p, state_leaves)``: whether the state leaves are the parameter's.
      scalars: ``scalars(state, new_state, neg_lr)``: the kernel's scalar operand, from the chain's state before and
        after the step.
      apply: ``apply(p, state_leaves, leaf, scalars, option) -> (p, *state_leaves)``: the fused kernel on one leaf.
      count_owner: The name of the state class whose ``count`` a schedule reads.
      options: ``options(params)``: a tree of static per-parameter options for ``apply`` (AdamW's mask).
      clips: Whether ``apply`` takes a leaf's entries in place of a leaf that
        ``sparse_aware(clip_by_global_norm)`` clipped, and clips each summed row itself.
      with_clip: ``with_clip(scalars, clipped)``: the scalars ``apply`` then takes: by default the kernel's followed
        by the clipping's ``max_norm`` where it recorded one (the table the only leaf it saw: the kernel takes the
        norm itself) or else its two scalars (:class:`~optax_sparse_adam._fusion.Clipped`); the catch-up
        optimizers' scalars are a tuple, which takes the ``Clipped`` itself last (their kernels take the two).
      half_params: Whether ``apply`` also takes bfloat16 and float16 parameters (rounded to nearest, or
        stochastically given a sixth argument, the seeds of :func:`._stochastic_rounding.leaf_seeds`), the
        gradient's values of a narrower float dtype converted to float32 first, as the rule converts them.
    """

    learning_rate: optax.ScalarOrSchedule
    where: str
    owner: str
    fields: tuple[str, ...]
    fits: Callable[[jax.Array, Arrays], bool]
    scalars: Callable[[Any, Any, Any], Any]
    apply: Callable[..., tuple[jax.Array, ...]]  # (p, state leaves, leaf, scalars, option[, seeds])
    count_owner: str = "ScaleByScheduleState"
    options: Callable[[Any], Any] = lambda params: jax.tree.map(lambda _: None, params, is_leaf=is_leaf)
    clips: bool = False
    with_clip: Callable[[Any, Clipped], Any] = lambda scalars, clip: clip.norm_appended_to(scalars)
    half_params: bool = False

    def run(
        self, p: jax.Array, st: Arrays, sp: SparseLeaf, scalars: Any, option: Any, seeds: jax.Array | None = None
    ) -> tuple[jax.Array, ...]:
        """``apply`` on one leaf; with ``seeds``, a 16-bit ``p`` rounded stochastically."""
        args = (p, st, sp, scalars, option) if seeds is None else (p, st, sp, scalars, option, seeds)
        return self.apply(*args)

    def leaf_options(self, treedef: Any, params: Any) -> list[Any]:
        """``options(params)``, a static option per parameter for ``apply``, as a list along ``treedef``."""
        return treedef.flatten_up_to(self.options(params))

    def trees(self, state: Any) -> tuple[Any, ...]:
        """The state trees the kernel updates, found by name in the chain's state."""
        found = optax.tree.get(state, self.owner)
        return tuple(getattr(found, name) for name in self.fields)


def _fusable(fusion: Any) -> _Fusable | None:
    """How to fuse the optimizer that carries ``fusion``; ``None`` for one this module does not fuse (among them a
    weight decay given as a schedule: the kernels take it as a number, and the two calls run)."""
    if callable(getattr(fusion, "weight_decay", None)):
        return None
    if isinstance(fusion, AdamFusion):
        hp, wd, mask = fusion.hp, fusion.weight_decay, fusion.mask
        decayed = () if wd is None else (wd,)

        def adam_apply(p: jax.Array, st: Arrays, sp: SparseLeaf, scalars: Any, decays: Any) -> tuple[jax.Array, ...]:
            if wd is not None and not decays:
                # A parameter the mask leaves out of the decay: plain Adam (the weight decay is the eleventh scalar,
                # before the clipping's two).
                scalars = jnp.concatenate([scalars[:10], scalars[11:]])
            flags = kernel_flags(hp, sp)
            return _ffi.sparse_adam_apply(p, st[0], st[1], sp.keys[:, 0], sp.values, scalars, **flags, decay=decays)

        return _Fusable(
            fusion.learning_rate,
            "scale_by_sparse_adam",
            "ScaleByAdamState",
            ("mu", "nu"),
            fits=lambda p, st: p.shape == st[0].shape == st[1].shape,
            scalars=lambda state, new_state, neg_lr: kernel_scalars(
                hp, optax.tree.get(new_state, "ScaleByAdamState").count, neg_lr, *decayed
            ),
            apply=adam_apply,
            options=lambda params: mask_tree(
                wd is not None and (True if mask is None else mask), params, "mask", "sparse_adamw"
            ),
            clips=True,
        )
    if isinstance(fusion, CatchUpFusion) and fusion.fusable():
        replayer = fusion.replayer
        return _Fusable(
            replayer.learning_rate,
            "sparse_adam(catch_up=True)",
            "CatchUpAdamState",
            ("mu", "nu", "last_step"),
            fits=lambda p, st: p.shape == st[0].shape == st[1].shape and st[2].shape == row_shape(p.shape),
            scalars=lambda state, new_state, neg_lr: (
                kernel_scalars(replayer.hp, optax.tree.get(new_state, "CatchUpAdamState").count, neg_lr),
                *_counts(state, new_state, "CatchUpAdamState"),
                optax.tree.get(new_state, "CatchUpAdamState").idle_record,  # the long-idle coefficients it reads
            ),
            apply=lambda p, st, sp, scalars, _: fused_apply(replayer, p, st, sp, *scalars),
            count_owner="CatchUpAdamState",
            clips=True,
            # The kernel's scalars, the step counts and the record; the clipping goes to fused_apply, which also
            # clips the rows it leaves to the XLA rule.
            with_clip=lambda scalars, clip: (*scalars, clip),
        )
    if isinstance(fusion, CatchUpAdamWFusion) and fusion.fusable():
        adamw = fusion

        def adamw_scalars(state: Any, new_state: Any, neg_lr: Any) -> tuple[jax.Array, ...]:
            old, new = (optax.tree.get(s, "CatchUpAdamWState") for s in (state, new_state))
            scalars = kernel_scalars(adamw.replayer.hp, new.count, neg_lr, adamw.decay.weight_decay)
            counts = _counts(state, new_state, "CatchUpAdamWState")
            return scalars, *counts, old.log_decay[0], new.log_decay[0], new.idle_record

        return _Fusable(
            adamw.replayer.learning_rate,
            "sparse_adamw(catch_up=True)",
            "CatchUpAdamWState",
            ("mu", "nu", "last_step", "decay_mark"),
            fits=lambda p, st: (
                p.shape == st[0].shape == st[1].shape and st[2].shape == st[3].shape == row_shape(p.shape)
            ),
            scalars=adamw_scalars,
            apply=lambda p, st, sp, scalars, flag: adamw.apply(p, st, sp, flag, *scalars),
            count_owner="CatchUpAdamWState",
            options=adamw.flags,
            clips=True,
            with_clip=lambda scalars, clip: (*scalars, clip),  # after the record of the decay, as catch-up Adam's
        )
    if isinstance(fusion, AmsgradFusion):
        hp = fusion.hp
        return _Fusable(
            fusion.learning_rate,
            "scale_by_sparse_amsgrad",
            "ScaleByAmsgradState",
            ("mu", "nu", "nu_max"),
            fits=lambda p, st: p.shape == st[0].shape == st[1].shape == st[2].shape,
            scalars=lambda state, new_state, neg_lr: kernel_scalars(
                hp, optax.tree.get(new_state, "ScaleByAmsgradState").count, neg_lr
            ),
            apply=lambda p, st, sp, scalars, _: _ffi.sparse_amsgrad_apply(
                p, st[0], st[1], st[2], sp.keys[:, 0], sp.values, scalars, unique=_kernel_path.unique_flag(sp)
            ),
            clips=True,
        )
    if isinstance(fusion, CatchUpAmsgradFusion):
        amsgrad = fusion
        return _Fusable(
            amsgrad.learning_rate,
            "sparse_amsgrad(catch_up=True)",
            "CatchUpAmsgradState",
            ("mu", "nu", "nu_max", "last_step"),
            fits=lambda p, st: (
                p.shape == st[0].shape == st[1].shape == st[2].shape and st[3].shape == row_shape(p.shape)
            ),
            scalars=lambda state, new_state, neg_lr: (
                kernel_scalars(amsgrad.hp, optax.tree.get(new_state, "CatchUpAmsgradState").count, neg_lr),
                *_counts(state, new_state, "CatchUpAmsgradState"),
                optax.tree.get(new_state, "CatchUpAmsgradState").idle_record,
            ),
            apply=lambda p, st, sp, scalars, _: amsgrad.apply(p, st, sp, *scalars),
            count_owner="CatchUpAmsgradState",
            clips=True,
            # the step counts and the record, then the clipping, as catch-up Adam's
            with_clip=lambda scalars, clip: (*scalars, clip),
        )
    if isinstance(fusion, RowwiseAdagradFusion):
        eps, weight_decay, decay = fusion.eps, fusion.weight_decay, fusion.decay
        return _Fusable(
            fusion.learning_rate,
            "scale_by_rowwise_adagrad",
            "ScaleByRowwiseAdagradState",
            ("sum_of_squares",),
            fits=lambda p, st: st[0].shape == row_shape(p.shape),
            scalars=lambda state, new_state, neg_lr: adagrad_scalars(eps, weight_decay, neg_lr),
            apply=lambda p, st, sp, scalars, _, seeds=None: _ffi.rowwise_adagrad_apply(
                p, st[0], sp.keys[:, 0], sp.values, scalars, seeds, decay=decay, unique=_kernel_path.unique_flag(sp)
            ),
            clips=True,
            half_params=True,
        )
    if isinstance(fusion, RowwiseAdamFusion):
        adam = fusion
        per_row = adam.per_row_bias_correction
        return _Fusable(
            adam.learning_rate,
            "scale_by_rowwise_adam",
            "ScaleByRowwiseAdamState",
            ("mu", "nu", "row_count") if per_row else ("mu", "nu"),
            fits=lambda p, st: p.shape == st[0].shape and all(x.shape == row_shape(p.shape) for x in st[1:]),
            scalars=lambda state, new_state, neg_lr: rowwise_adam_scalars(
                adam.b1,
                adam.b2,
                adam.eps,
                adam.eps_root,
                optax.tree.get(new_state, "ScaleByRowwiseAdamState").count,
                neg_lr,
            ),
            apply=lambda p, st, sp, scalars, _, seeds=None: adam.apply(p, st, sp, scalars, seeds),
            clips=True,
            half_params=True,
        )
    if isinstance(fusion, AdagradFusion):
        eps = fusion.eps
        return _Fusable(
            fusion.learning_rate,
            "scale_by_sparse_adagrad",
            "ScaleByRssState",
            ("sum_of_squares",),
            fits=lambda p, st: p.shape == st[0].shape,
            scalars=lambda state, new_state, neg_lr: _ffi.float32_scalars(eps, neg_lr),
            apply=_elementwise_apply("adagrad"),
            clips=True,
        )
    if isinstance(fusion, MomentumFusion):
        momentum, nesterov = fusion.momentum, fusion.nesterov
        return _Fusable(
            fusion.learning_rate,
            "sparse_sgd(momentum)",
            "TraceState",
            ("trace",),
            fits=lambda p, st: p.shape == st[0].shape,
            scalars=lambda state, new_state, neg_lr: _ffi.float32_scalars(momentum, neg_lr),
            apply=_elementwise_apply("momentum", nesterov=nesterov),
            clips=True,
        )
    if isinstance(fusion, CatchUpMomentumFusion):
        sgd = fusion
        return _Fusable(
            sgd.learning_rate,
            "sparse_sgd(catch_up=True)",
            "CatchUpSgdState",
            ("trace", "last_step"),
            fits=lambda p, st: p.shape == st[0].shape and st[1].shape == row_shape(p.shape),
            scalars=lambda state, new_state, neg_lr: (
                _ffi.float32_scalars(sgd.momentum, neg_lr),
                *_counts(state, new_state, "CatchUpSgdState"),
                optax.tree.get(new_state, "CatchUpSgdState").idle_record,  # the long-idle sums it reads
            ),
            apply=lambda p, st, sp, scalars, _: sgd.apply(p, st, sp, *scalars),
            count_owner="CatchUpSgdState",
            clips=True,
            # the step counts and the record, then the clipping, as catch-up Adam's
            with_clip=lambda scalars, clip: (*scalars, clip),
        )
    if isinstance(fusion, FtrlFusion) and fusion.native:
        ftrl = fusion
        return _Fusable(
            ftrl.learning_rate,
            "sparse_ftrl",
            "FtrlState",
            ("accumulator", "linear"),
            fits=lambda p, st: p.shape == st[0].shape == st[1].shape,
            # The learning rate as given (a constant stays one: XLA multiplies by its reciprocal), not -neg_lr.
            scalars=lambda state, new_state, neg_lr: ftrl.scalars(ftrl.rate(state)),
            apply=lambda p, st, sp, scalars, _: ftrl.apply(p, st, sp, *scalars),
            count_owner="FtrlState",
            clips=True,
            with_clip=lambda scalars, clip: (clip.norm_appended_to(scalars[0]), scalars[1]),  # (scalars, divides)
        )
    return None


def _elementwise_apply(target: str, **flags: int) -> Callable[..., tuple[jax.Array, ...]]:
    """A :class:`_Fusable`'s ``apply`` by the element-wise apply kernel ``target``, with the handler's ``flags``."""

    def apply(p: jax.Array, st: Arrays, sp: SparseLeaf, scalars: jax.Array, _: Any) -> tuple[jax.Array, ...]:
        unique = _kernel_path.unique_flag(sp)
        return _ffi.elementwise_apply(target, p, st, sp.keys[:, 0], sp.values, scalars, unique=unique, **flags)

    return apply


def _seeds(
    key: jax.Array | None, treedef: Any, params: Any, fused: dict[int, Any], first_rows: dict[int, jax.Array]
) -> dict[int, jax.Array | None]:
    """The stochastic rounding seeds of each fused leaf with a 16-bit parameter (``None`` for the others, and for
    all without ``key``): those :func:`apply_updates_stochastic` draws with, ``leaf_seeds(key, i)`` with ``i`` the
    parameter's position among the leaves of ``params``, and where ``first_rows`` gives one, the row id its row 0
    draws as (the kernels' third word of seeds)."""
    p_leaves = treedef.flatten_up_to(params)
    if key is None:
        return dict.fromkeys(fused)
    index = treedef.flatten_up_to(jax.tree.unflatten(jax.tree.structure(params), range(len(jax.tree.leaves(params)))))
    seeds: dict[int, jax.Array | None] = {}
    for i in fused:
        if p_leaves[i].dtype not in HALF_FLOATS:
            seeds[i] = None
            continue
        leaf = leaf_seeds(key, index[i])
        if index[i] in first_rows:
            leaf = jnp.concatenate([leaf, first_rows[index[i]].astype(jnp.uint32).reshape(1)])
        seeds[i] = leaf
    return seeds


def _counts(state: Any, new_state: Any, owner: str) -> tuple[jax.Array, jax.Array]:
    """A catch-up step's ``(done, count)``: the step count before it (the rows are replayed up to it) and after it.
    Not ``count - 1``: the count saturates at ``2**31 - 1``, where the two are equal."""
    return optax.tree.get(state, owner).count, optax.tree.get(new_state, owner).count


def _partitioned(
    fusion: PartitionFusion, grads: Any, state: optax.PartitionState, params: Any
) -> tuple[Any, optax.PartitionState]:
    """A :func:`partition_tables` step: each part's own :func:`update_and_apply` on its masked trees."""
    labels = fusion.labels(params)
    parts, inner_states = {}, {}
    for group, tx in fusion.transforms.items():
        inner = state.inner_states[group]
        parts[group], new = update_and_apply(
            tx, masked(grads, labels, group), inner.inner_state, masked(params, labels, group)
        )
        inner_states[group] = inner._replace(inner_state=new)
    return merge(labels, parts), state._replace(inner_states=inner_states)


def _if_finite(
    fusion: IfFiniteFusion, grads: Any, state: optax.ApplyIfFiniteState, params: Any
) -> tuple[Any, optax.ApplyIfFiniteState]:
    """An :func:`apply_if_finite` step: optax's bookkeeping, with the inner step fused in the accepting branch.

    Inside :func:`jax.lax.cond` the donated tables are still updated in place: the rejecting branch returns
    them as they were, so XLA needs no copy of them (``tests/test_if_finite.py`` checks the compiled step).
    """

    def accept() -> tuple[Any, Any]:
        return update_and_apply(fusion.inner, grads, state.inner_state, params)

    def reject() -> tuple[Any, Any]:
        # The parameters as they were. optax's rejecting branch returns zeros, which the two calls add: added here,
        # a sparse leaf's (all at row 0) would make XLA copy the table to keep both branches in place, and a dense
        # leaf's XLA would fold away (x + 0 to x). The values are those of the two calls but for a -0.0, which
        # their zeros, added out of their cond, turn into 0.0; and the inner update is traced here no more.
        return params, state.inner_state

    return if_finite_step(grads, state, fusion.max_consecutive_errors, accept, reject)


def _wrapped(
    tx: optax.GradientTransformation, grads: Any, state: Any, params: Any
) -> tuple[optax.Params, optax.OptState]:
    """A step of an optimizer the fused step knows, called inside a wrapper: the wrapper's update, then the
    kernels' results in place of the rows' updates and state wherever the wrapper passed those through untouched.

    The wrapper's ``update`` runs as written (``inject_hyperparams`` evaluating its schedules, stages before the
    optimizer transforming the gradients) inside :func:`recording`. Each call of a fusable optimizer there is
    taken on the gradients it was given, and where its update of a leaf reaches ``tx``'s updates as the very same
    arrays, its parameter is that of ``params`` and every new state leaf of that leaf is in ``tx``'s new state,
    the kernel computes the parameter and the state from those inputs; XLA drops the two calls' work for them.
    Any leaf a wrapper changed, copied or selected (stages after the optimizer) keeps the two calls, and so does a
    call a wrapper made in a trace of its own (``optax.apply_if_finite``'s ``lax.cond`` branch): :func:`recording`
    does not record it.
    """
    with recording() as calls:
        updates, new_state = tx.update(grads, state, params)
    u_leaves, treedef = _flatten(updates)
    try:
        p_leaves = treedef.flatten_up_to(params)
    except (ValueError, TypeError):
        return apply_updates(params, updates), new_state
    position = {_ids(u): j for j, (_, u) in enumerate(u_leaves) if is_sparse(u)}
    in_state = {id(x) for x in jax.tree.leaves(new_state)}
    clipped = {_ids(c.leaf): c for c in calls if isinstance(c, Clipped)}
    done: dict[int, jax.Array] = {}
    replaced: dict[int, jax.Array] = {}
    for call in calls:
        if not isinstance(call, Call):
            continue
        fusable = _fusable(call.fusion)
        if fusable is None:
            continue
        fused = _fusable_leaves(fusable, call.grads, call.state, call.params)
        if not fused:
            continue
        call_treedef = _flatten(call.grads)[1]
        c_updates = call_treedef.flatten_up_to(call.updates)
        c_params = call_treedef.flatten_up_to(call.params)
        c_old = [call_treedef.flatten_up_to(tree) for tree in fusable.trees(call.state)]
        c_new = [call_treedef.flatten_up_to(tree) for tree in fusable.trees(call.new_state)]
        c_grads = call_treedef.flatten_up_to(call.grads)
        targets = {}
        for i in fused:
            j = position.get(_ids(c_updates[i])) if is_sparse(c_updates[i]) else None
            news = [leaves[i] for leaves in c_new]
            if j is not None and j not in done and p_leaves[j] is c_params[i] and all(id(x) in in_state for x in news):
                targets[i] = j
        if not targets:
            continue
        lr = fusable.learning_rate
        if callable(lr):
            lr = lr(optax.tree.get(call.state, fusable.count_owner).count)
        scalars = fusable.scalars(call.state, call.new_state, -1 * lr)

        options = fusable.leaf_options(call_treedef, call.params)
        args = []
        for i in targets:
            leaf, leaf_scalars = fused[i], scalars
            clip = clipped.get(_ids(c_grads[i])) if fusable.clips else None
            if clip is not None:  # the kernel sums and clips the entries' rows itself
                leaf = clip.entries
                leaf_scalars = fusable.with_clip(scalars, clip)
            args.append((c_params[i], tuple(leaves[i] for leaves in c_old), leaf, options[i], leaf_scalars))
        xla_args = [(c_params[i], c_updates[i], tuple(leaves[i] for leaves in c_new)) for i in targets]
        for (i, j), (p, *st) in zip(targets.items(), _select(fusable, args, xla_args), strict=True):
            done[j] = p
            replaced.update((id(leaves[i]), x) for leaves, x in zip(c_new, st, strict=True))
    if not done:
        return apply_updates(params, updates), new_state
    rest = treedef.unflatten([None if j in done else u for j, (_, u) in enumerate(u_leaves)])
    out_p = treedef.flatten_up_to(apply_updates(params, rest))
    for j, p in done.items():
        out_p[j] = p
    return treedef.unflatten(out_p), jax.tree.map(lambda x: replaced.get(id(x), x), new_state)


def _select(fusable: _Fusable, args: list[Any], xla_args: list[Any]) -> list[tuple[jax.Array, ...]]:
    """The fused kernel on each ``(p, state_leaves, leaf, option, scalars)`` of ``args``; where it does not run, the
    two calls' results, ``apply_updates(p, updates)`` and the new state leaves of each ``(p, updates, new)``."""

    def native() -> list[tuple[jax.Array, ...]]:
        return [fusable.apply(p, st, sp, scalars, option) for p, st, sp, option, scalars in args]

    def xla() -> list[tuple[jax.Array, ...]]:
        return [(apply_updates(p, u), *new) for p, u, new in xla_args]

    return _kernel_path.select(native, xla)


def _ids(leaf: Any) -> tuple[int, ...]:
    """What identifies a sparse update leaf: its arrays, by identity."""
    return tuple(id(x) for x in jax.tree.leaves(leaf))


def _flatten(tree: Any) -> tuple[list[tuple[Any, Any]], Any]:
    """``(path, leaf)`` pairs and the treedef, sparse leaves and ``None`` as leaves."""
    return jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)


def _fusable_leaves(fusable: _Fusable, grads: Any, state: Any, params: Any) -> dict[int, SparseLeaf]:
    """The sparse gradient leaves the fused kernel handles, by position, validated.

    Trees that do not match, or a state of another shape, give none: the two plain calls then report them.
    """
    grad_leaves, treedef = _flatten(grads)
    try:
        p_leaves = treedef.flatten_up_to(params)
        state_leaves = [treedef.flatten_up_to(tree) for tree in fusable.trees(state)]
    except (ValueError, TypeError, AttributeError, IndexError, KeyError):
        return {}
    fused = {}
    for i, ((path, g), p, *st) in enumerate(zip(grad_leaves, p_leaves, *state_leaves, strict=True)):
        if not (is_sparse(g) and all(isinstance(x, jax.Array) for x in (p, *st))):
            continue
        if not fusable.fits(p, tuple(st)) or p.shape[0] == 0:  # a table of no rows: nothing to fuse
            continue
        sp = to_sparse_leaf(g, p.shape, path, fusable.where, emits=True)
        floats = [x for x in st if x.dtype != jnp.int32]  # per-row steps (catch-up's last_step) are int32
        if fusable.half_params and all(x.dtype == jnp.float32 for x in floats) and sp.values.dtype in HALF_FLOATS:
            sp = sp._replace(values=sp.values.astype(jnp.float32))  # as the rule converts them
        # A kernel that takes float32 parameters only checks them with the other float32 operands.
        operands = (*floats, sp.values) if fusable.half_params else (*floats, sp.values, p)
        if _kernel_path.supports(p.shape, sp.n_sparse, *operands, params=p if fusable.half_params else None):
            fused[i] = sp
    return fused
