"""The native CPU kernels' calls: one wrapper per XLA FFI handler, partitioned by row shards.

Each wrapper lowers to ``jax.ffi.ffi_call`` with its operands aliased to its
results, so a donated table is updated in place. Under SPMD partitioning a
row-sharded table runs the kernel on each device's block
(:func:`_by_row_shards`). Whether a kernel runs at all is decided in
:mod:`._kernel_path`.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import PartitionSpec as P

from optax_sparse_adam._kernel_path import PREFIX, threads


def _ffi_call(target: str, results: Any, **kwargs: Any) -> Callable[..., Any]:
    """``jax.ffi.ffi_call``, its results typed as varying over every manual mesh axis an operand varies over.

    Inside ``shard_map`` each device runs the kernel on its own operands, so a
    result differs between devices wherever an operand does; a custom call
    cannot state that, and a result left invariant would count as the same on
    every device (a ``psum`` of it would multiply it by the axis size).
    """
    call = jax.ffi.ffi_call(target, results, **kwargs)

    def run(*args: Any, **attrs: Any) -> Any:
        out = call(*args, **attrs)
        axes = frozenset().union(*(_varying(a) for a in args))
        return jax.tree.map(lambda o: _vary(o, axes), out) if axes else out

    return run


def _varying(x: Any) -> frozenset[str]:
    """The manual mesh axes ``x`` varies over (none outside ``shard_map``)."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)  # jax 0.10; earlier and later releases call it vma
    return frozenset(manual.varying if manual is not None else getattr(aval, "vma", ()))


def _vary(x: jax.Array, axes: frozenset[str]) -> jax.Array:
    missing = tuple(sorted(axes - _varying(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def float32_scalars(*values: Any) -> jax.Array:
    """A kernel's ``scalars`` operand: ``values`` in order, each rounded to float32 as the rule rounds it."""
    return jnp.stack([jnp.asarray(x).astype(jnp.float32) for x in values])


def _attrs(num_rows: int, **flags: bool | int) -> dict[str, np.int64]:
    attrs = {"num_rows": np.int64(num_rows), **{k: np.int64(v) for k, v in flags.items()}}
    attrs["threads"] = np.int64(threads())
    return attrs


def _rows2d(values: jax.Array) -> jax.Array:
    return values.reshape(values.shape[0], math.prod(values.shape[1:]))


_ROWS = "osa_rows"  # mesh axes of the row blocks of a sharded table, and of their replicas
_REPLICAS = "osa_replicas"
_BY_ROWS = ("n w", "n")  # operands and results split by rows: tables, and per-row state


def _row_blocks(sharding: Any, shape: tuple[int, ...]) -> np.ndarray:
    """The devices of a table's sharding as a (row blocks, replicas) grid, block b holding the b-th rows.

    A table split otherwise (columns, uneven blocks) comes back as one block:
    the partitioner then gathers it, which is correct but not in place.
    """
    index = sharding.devices_indices_map(shape)
    devices = sorted(index, key=lambda d: d.id)
    starts: dict[int, list[Any]] = {}
    for d in devices:
        rows, *rest = index[d]
        if any(r.indices(n) != (0, n, 1) for r, n in zip(rest, shape[1:], strict=True)):
            return np.array(devices, dtype=object)[None, :]
        starts.setdefault(rows.start or 0, []).append(d)
    blocks = [starts[k] for k in sorted(starts)]
    if shape[0] % len(blocks) or len({len(b) for b in blocks}) != 1:
        return np.array(devices, dtype=object)[None, :]
    return np.array(blocks, dtype=object)


def _check_holds_no_tracer(fn: Callable[..., Any]) -> None:
    """Raise if ``fn``, or a function it closes over or is bound to (closures, default arguments, a partial's
    arguments, a method's instance), holds a tracer, which would outlive its trace."""
    seen: set[int] = set()
    todo: list[Any] = [fn]
    while todo:
        f = todo.pop()
        if id(f) in seen:
            continue
        seen.add(id(f))
        held: list[tuple[str, Any]] = []
        if isinstance(f, functools.partial):
            held += [("a partial's argument", a) for a in (*f.args, *f.keywords.values())]
            held.append(("a partial's function", f.func))
        elif inspect.ismethod(f):
            held += [("the method's instance", f.__self__), ("the method's function", f.__func__)]
        elif inspect.isfunction(f):
            for name, cell in zip(f.__code__.co_freevars, f.__closure__ or (), strict=True):
                try:
                    held.append((repr(name), cell.cell_contents))
                except ValueError:  # a cell not yet filled
                    continue
            held += [("a default argument", d) for d in (*(f.__defaults__ or ()), *(f.__kwdefaults__ or {}).values())]
        for name, value in held:
            for leaf in jax.tree_util.tree_leaves(value):
                if isinstance(leaf, jax.core.Tracer):
                    raise TypeError(
                        f"{getattr(f, '__qualname__', f)!r} holds a tracer ({name}); a row-shard kernel's function "
                        "outlives its trace: pass the value as an operand, or close over its shape"
                    )
                if inspect.isfunction(leaf) or inspect.ismethod(leaf) or isinstance(leaf, functools.partial):
                    todo.append(leaf)


def _by_row_shards(fn: Callable[..., tuple[jax.Array, ...]], rule: str, summed: tuple[int, ...] = ()) -> Any:
    """``fn(row_begin, *tables, *rest)`` made to run on each row shard of its tables under SPMD partitioning.

    ``rule`` names the axes of the operands and results (Shardy's notation):
    ``n w`` for a 2-D table, ``n`` for one scalar per row (sharded by rows as
    the table is), ``k`` for keys, ``k w`` for rows, ``s`` for scalars. The
    tables come first among operands and results (the first one's sharding
    decides the row blocks); the other operands
    are replicated, and so are the other results: those listed in ``summed``
    are summed over the shards (each shard writes zeros where it holds no
    row), the others come out alike on every shard. On one device, or inside
    ``shard_map``, ``fn`` runs as it is with ``row_begin = 0``.

    ``fn`` lives as long as the step's jaxpr (its partitioning rule keeps it),
    so it must hold no tracer: pass traced values as operands, and close over
    their shapes and dtypes only (checked here).
    """
    _check_holds_no_tracer(fn)

    @custom_partitioning
    def call(*args: jax.Array) -> tuple[jax.Array, ...]:
        return fn(jnp.zeros((), jnp.int32), *args)

    def partition(mesh: Any, arg_shapes: Any, result_shape: Any) -> Any:
        table = arg_shapes[0]
        grid = _row_blocks(table.sharding, table.shape)
        mesh = jax.sharding.Mesh(grid, (_ROWS, _REPLICAS))
        local_rows = table.shape[0] // grid.shape[0]
        rows = jax.sharding.NamedSharding(mesh, P(_ROWS))
        whole = jax.sharding.NamedSharding(mesh, P())

        def lower(*args: jax.Array) -> tuple[jax.Array, ...]:
            row_begin = jax.lax.axis_index(_ROWS).astype(jnp.int32) * local_rows
            out = list(fn(row_begin, *args))
            for i in summed:
                out[i] = jax.lax.psum(out[i], _ROWS)
            return tuple(out)

        ins, outs = (side.split(", ") for side in rule.split(" -> "))
        arg_shardings = tuple(rows if f in _BY_ROWS else whole for f in ins)
        out_shardings = tuple(rows if f in _BY_ROWS else whole for f in outs)
        return mesh, lower, out_shardings, arg_shardings

    # Factors in order of first appearance (Shardy wants them sorted so); all but the rows are replicated.
    factors = dict.fromkeys(rule.replace(",", " ").replace("->", " ").split())
    call.def_partition(
        partition=partition,
        infer_sharding_from_operands=lambda mesh, args, result: partition(mesh, args, result)[2],
        sharding_rule=rule,
        need_replication_factors=tuple(f for f in factors if f != "n"),
    )
    # Under vmap (custom_partitioning has no batching rule), one call per batch element, in a loop.
    return jax.custom_batching.sequential_vmap(call)


def sparse_adam_rows(
    m: jax.Array,
    v: jax.Array,
    keys: jax.Array,
    values: jax.Array,
    scalars: jax.Array,
    *,
    torch_eps: bool,
    maximize: bool,
    unique: int,
    p: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The sparse leaf rule on the CPU: ``(m, v, keys, step)``, moments updated in place.

    ``keys`` are ``(k,)`` int32 row indices (out of range: padding); the step
    rows come back packed as :func:`coalesce` packs them (each distinct key
    once, first, then padding keys ``num_rows`` with zero rows), or with
    ``unique`` (1: the user's promise, checked; 2: keys the library made
    distinct) in the entries' own slots. With the float32 parameters ``p`` (read only), ``sparse_adamw``'s rule:
    each step row ``neg_lr * (step + weight_decay * p)`` (a fused multiply-add, as XLA:CPU contracts it), the
    weight decay an eleventh scalar.
    """
    attrs = _attrs(m.shape[0], torch_eps=torch_eps, maximize=maximize, unique=unique)
    shape = values.shape
    tables = () if p is None else (p,)

    def fn(row_begin: jax.Array, *args: jax.Array):
        # The moments first (their sharding decides the row blocks); the handler takes the parameters first.
        m, v, *params, keys, values, scalars = args
        table = jax.ShapeDtypeStruct(m.shape, m.dtype)
        rows = (jax.ShapeDtypeStruct(keys.shape, jnp.int32), jax.ShapeDtypeStruct(values.shape, values.dtype))
        n = len(params)
        return _ffi_call(
            PREFIX + ("sparse_adamw_rows" if params else "sparse_adam_rows"),
            (table, table, *rows),
            input_output_aliases={n: 0, n + 1: 1},
            vmap_method="sequential",
        )(*params, m, v, keys, values, scalars, row_begin, **attrs)

    rule = "n w, n w, " + "n w, " * len(tables) + "k, k w, s -> n w, n w, k, k w"
    m2, v2, keys, step = _by_row_shards(fn, rule, summed=(3,))(
        _rows2d(m), _rows2d(v), *(_rows2d(t) for t in tables), keys, _rows2d(values), scalars
    )
    return m2.reshape(m.shape), v2.reshape(v.shape), keys, step.reshape(shape)


def sparse_adam_apply(
    p: jax.Array,
    m: jax.Array,
    v: jax.Array,
    keys: jax.Array,
    values: jax.Array,
    scalars: jax.Array,
    *,
    torch_eps: bool,
    maximize: bool,
    unique: int,
    decay: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The sparse leaf rule and ``p += neg_lr * step`` in one pass over each touched row: ``(p, m, v)``.

    With ``decay``, ``sparse_adamw``'s lazy step ``p += neg_lr * (step + weight_decay * p)``, the weight decay
    an eleventh scalar. Two more scalars ``(divisor, factor)`` after those clip each summed gradient row first,
    ``(g / divisor) * factor`` (``sparse_aware(optax.clip_by_global_norm(c))``'s rule).
    """
    attrs = _attrs(p.shape[0], torch_eps=torch_eps, maximize=maximize, unique=unique)
    target = PREFIX + ("sparse_adamw_apply" if decay else "sparse_adam_apply")

    def fn(row_begin: jax.Array, p: jax.Array, m: jax.Array, v: jax.Array, *rest: jax.Array):
        table = jax.ShapeDtypeStruct(p.shape, p.dtype)
        return _ffi_call(
            target,
            (table, table, table),
            input_output_aliases={0: 0, 1: 1, 2: 2},
            vmap_method="sequential",
        )(p, m, v, *rest, row_begin, **attrs)

    rule = "n w, n w, n w, k, k w, s -> n w, n w, n w"
    out = _by_row_shards(fn, rule)(_rows2d(p), _rows2d(m), _rows2d(v), keys, _rows2d(values), scalars)
    new_p, new_m, new_v = (x.reshape(p.shape) for x in out)
    return new_p, new_m, new_v


def sparse_amsgrad_apply(
    p: jax.Array,
    m: jax.Array,
    v: jax.Array,
    v_max: jax.Array,
    keys: jax.Array,
    values: jax.Array,
    scalars: jax.Array,
    *,
    unique: int,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """``sparse_amsgrad``'s lazy step and ``p += neg_lr * step`` in one pass over each touched row:
    ``(p, m, v, v_max)``; ``scalars`` as the Adam kernels take them (with the clipping's two, as
    :func:`sparse_adam_apply`)."""
    attrs = _attrs(p.shape[0], unique=unique)

    def fn(row_begin: jax.Array, *args: jax.Array):
        table = jax.ShapeDtypeStruct(args[0].shape, args[0].dtype)
        return _ffi_call(
            PREFIX + "sparse_amsgrad_apply",
            (table, table, table, table),
            input_output_aliases={i: i for i in range(4)},
            vmap_method="sequential",
        )(*args, row_begin, **attrs)

    rule = "n w, n w, n w, n w, k, k w, s -> n w, n w, n w, n w"
    out = _by_row_shards(fn, rule)(*map(_rows2d, (p, m, v, v_max)), keys, _rows2d(values), scalars)
    new_p, new_m, new_v, new_v_max = (x.reshape(p.shape) for x in out)
    return new_p, new_m, new_v, new_v_max


class AmsgradIdleOperands(NamedTuple):
    """What the AMSGrad catch-up kernels read of a step beyond the rows (see :func:`catch_up_amsgrad_apply`):
    ``far_by_key`` and ``cap`` are their static attributes."""

    window: jax.Array
    far: jax.Array
    powers: jax.Array
    decay2: jax.Array | None
    cap: int
    far_by_key: bool


def catch_up_amsgrad(
    tables: tuple[jax.Array, ...],
    keys: jax.Array,
    values: jax.Array,
    scalars: jax.Array,
    ops: AmsgradIdleOperands,
    count: jax.Array,
    done: jax.Array,
    *,
    unique: int,
    rows: bool = False,
) -> tuple[jax.Array, ...]:
    """``sparse_amsgrad(catch_up=True)``'s kernels on ``tables = (p, m, v, v_max, last_step)``.

    The fused step (``catch_up_amsgrad_apply``): :func:`sparse_amsgrad_apply`, each touched row first taking the
    steps it sat out in closed form: ``(p, m, v, v_max, last_step)``, each touched row's ``last_step`` recorded in
    place as ``max(last_step, count)``. With ``rows``, the leaf rule for ``tx.update`` (``catch_up_amsgrad_rows``):
    ``(m, v, v_max, last_step, keys, updates)``, ``p`` read only, each touched row replayed in a scratch copy and its
    update, packed as :func:`sparse_amsgrad_rows` packs its step rows, the step (``scalars``' ``neg_lr`` times
    AMSGrad's), or where the row sat out a step, ``(replayed + step) - p`` (``replayed + step`` where ``p`` is
    infinite), as the XLA rule computes it.

    The kernels read each touched row's idle steps from its record, ``idle = done - last`` (0 where ``last ==
    0``), and as ``_amsgrad``'s ``idle_coefficients`` computes them per row: ``C`` (the sum over the idle steps of
    ``lr_t b1**k / (1 - b1**t)``) from ``window[idle - 1]`` (``(max(cap, 1),)``, rows idle ``1 <= idle <= cap``)
    or ``far`` (rows idle longer: by the row's last step, clipped to its last entry, or with ``far_by_key`` by
    key; 0 for ``cap == 0``); ``b1**idle`` and ``b2**idle`` from ``powers`` (:func:`._catch_up.power_table`'s
    tables, ``b1``'s then ``b2``'s), or ``b2**idle`` from ``decay2`` per key where ``b2`` has no table."""
    p, m, v, v_max, last_step = tables
    name = "catch_up_amsgrad_rows" if rows else "catch_up_amsgrad_apply"
    attrs = _attrs(p.shape[0], cap=ops.cap, far_by_key=ops.far_by_key, decay2=ops.decay2 is not None, unique=unique)

    key_shape = keys.shape  # the shape alone: fn, kept in the step's jaxpr, holds no tracer

    def fn(row_begin: jax.Array, *args: jax.Array):
        table = jax.ShapeDtypeStruct(args[0].shape, args[0].dtype)
        record = jax.ShapeDtypeStruct(args[4].shape, args[4].dtype)
        out: tuple[jax.ShapeDtypeStruct, ...]
        if rows:
            packed = (jax.ShapeDtypeStruct(key_shape, jnp.int32), jax.ShapeDtypeStruct(args[6].shape, args[6].dtype))
            out, aliases = (table, table, table, record, *packed), {1: 0, 2: 1, 3: 2, 4: 3}
        else:
            out, aliases = (table, table, table, table, record), {i: i for i in range(5)}
        return _ffi_call(PREFIX + name, out, input_output_aliases=aliases, vmap_method="sequential")(
            *args, row_begin, **attrs
        )

    # Without per-key decays, an empty one, replicated (z).
    by_key = "k" if ops.decay2 is not None else "z"
    decay2 = ops.decay2 if ops.decay2 is not None else jnp.zeros((0,), jnp.float32)
    counts = jnp.stack([jnp.asarray(count, jnp.int32), jnp.asarray(done, jnp.int32)])
    results = "n w, n w, n w, n, k, k w" if rows else "n w, n w, n w, n w, n"
    rule = f"n w, n w, n w, n w, n, k, k w, s, a, f, q, {by_key}, o -> {results}"
    operands = (_rows2d(p), _rows2d(m), _rows2d(v), _rows2d(v_max), last_step, keys, _rows2d(values), scalars)
    summed = (5,) if rows else ()
    out = _by_row_shards(fn, rule, summed=summed)(*operands, ops.window, ops.far, ops.powers, decay2, counts)
    if rows:
        return (*(x.reshape(m.shape) for x in out[:3]), out[3], out[4], out[5].reshape(values.shape))
    return (*(x.reshape(p.shape) for x in out[:4]), out[4])


def sparse_amsgrad_rows(
    m: jax.Array, v: jax.Array, v_max: jax.Array, keys: jax.Array, values: jax.Array, scalars: jax.Array, *, unique: int
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """``sparse_amsgrad``'s leaf rule on the CPU: ``(m, v, v_max, keys, step)``, the moments updated in place and
    the step rows (times ``scalars``' ``neg_lr``) packed as in :func:`sparse_adam_rows`."""
    attrs = _attrs(m.shape[0], unique=unique)
    shape = values.shape

    def fn(row_begin: jax.Array, m: jax.Array, v: jax.Array, v_max: jax.Array, *rest: jax.Array):
        table = jax.ShapeDtypeStruct(m.shape, m.dtype)
        rows = (jax.ShapeDtypeStruct(rest[0].shape, jnp.int32), jax.ShapeDtypeStruct(rest[1].shape, rest[1].dtype))
        return _ffi_call(
            PREFIX + "sparse_amsgrad_rows",
            (table, table, table, *rows),
            input_output_aliases={0: 0, 1: 1, 2: 2},
            vmap_method="sequential",
        )(m, v, v_max, *rest, row_begin, **attrs)

    rule = "n w, n w, n w, k, k w, s -> n w, n w, n w, k, k w"
    out = _by_row_shards(fn, rule, summed=(4,))(_rows2d(m), _rows2d(v), _rows2d(v_max), keys, _rows2d(values), scalars)
    new_m, new_v, new_v_max, keys, step = out
    return new_m.reshape(m.shape), new_v.reshape(m.shape), new_v_max.reshape(m.shape), keys, step.reshape(shape)


class CatchUpOperands(NamedTuple):
    """What the catch-up Adam kernels read of a step beyond the rows, scalars and per-key values (see
    :func:`catch_up_adam_apply`)."""

    window: jax.Array
    far: jax.Array
    powers: jax.Array
    through: jax.Array
    limits: jax.Array
    neg_rates: jax.Array
    corrections: jax.Array


def catch_up_adam_rows(
    p: jax.Array,
    m: jax.Array,
    v: jax.Array,
    last_step: jax.Array,
    decay_mark: jax.Array | None,
    keys: jax.Array,
    values: jax.Array,
    scalars: jax.Array,
    ops: CatchUpOperands,
    count: jax.Array,
    done: jax.Array,
    far_steps: jax.Array | None = None,
    *,
    cap: int,
    torch_eps: bool,
    maximize: bool,
    unique: int,
    decay: bool = False,
    far_by_key: bool = False,
    far_offset: int = 0,
    decay_from_marks: bool = False,
) -> tuple[Any, ...]:
    """``sparse_adam(catch_up=True)``'s leaf rule on the CPU (``tx.update``), and with ``decay``
    ``sparse_adamw(catch_up=True)``'s: ``(m, v, last_step, decay_mark, keys, updates, flags)``, the moments and
    records in place, ``p`` read only.

    Each touched row is replayed and stepped as :func:`catch_up_adam_apply` takes it (the same operands) in a
    scratch copy; its update, packed as :func:`sparse_adam_rows` packs its step rows, is the step (``scalars``'
    ``neg_lr`` times Adam's, with ``decay`` times ``u + wd p`` on the replayed row), or where the replay moved the
    row (with ``decay``: where it sat out a step), ``(replayed + step) - p`` (``replayed + step`` where ``p`` is
    infinite), as the XLA rules compute it.
    ``flags`` marks the keys of rows whose idle steps were not at hand: their updates NaN, their moments and
    records as they were, for the caller to take by the XLA rule."""
    attrs = dict(cap=cap, torch_eps=torch_eps, maximize=maximize, decay=decay, unique=unique, far_by_key=far_by_key)
    attrs.update(far_offset=far_offset, decay_from_marks=decay_from_marks)
    tables = (p, m, v, last_step, decay_mark)
    return _catch_up_adam(True, tables, keys, values, scalars, ops, count, done, far_steps, attrs)


def catch_up_adam_apply(
    p: jax.Array,
    m: jax.Array,
    v: jax.Array,
    last_step: jax.Array,
    decay_mark: jax.Array | None,
    keys: jax.Array,
    values: jax.Array,
    scalars: jax.Array,
    ops: CatchUpOperands,
    count: jax.Array,
    done: jax.Array,
    far_steps: jax.Array | None = None,
    *,
    cap: int,
    torch_eps: bool,
    maximize: bool,
    unique: int,
    decay: bool = False,
    far_by_key: bool = False,
    far_offset: int = 0,
    decay_from_marks: bool = False,
) -> tuple[Any, ...]:
    """``sparse_adam(catch_up=True)``'s fused step on the touched rows: ``(p, m, v, last_step, decay_mark,
    flags)``; with ``decay``, ``sparse_adamw(catch_up=True)``'s.

    A key's row, last moved at step ``last`` (its ``last_step``), is idle
    ``idle = done - last`` steps (0 where ``last == 0``, but with ``decay``);
    its moments decay by ``b1**idle`` and ``b2**idle`` from ``powers`` (the
    tables of :func:`._catch_up.power_table`, ``b1``'s then ``b2``'s). Idle
    ``1 <= idle <= cap`` steps, it takes the series' eight coefficients in
    ``window[idle - 1]`` (``(max(cap, 1), 8)``); idle longer, those in
    ``far[clip(last, 0, len(far) - 1)]`` (the long-idle table, by the row's
    last step), or with ``far_by_key`` in ``far[key]`` (one entry per key),
    or with ``far_steps`` (the state's :class:`._catch_up.IdleRecord`'s
    ``last_steps``, its coefficients in ``far``, taken as rows of eight
    whatever its leading dimensions, from row ``far_offset`` on: AdamW's
    variant) in ``far[far_offset + last mod len(far_steps)]`` where
    ``far_steps`` holds ``last`` there (a row whose entry does not is flagged);
    ``limits`` is ``(binv, ratio, long_neg_lr, has_corrections, new_log, old_log)``. Elements the series does
    not take replay their first ``min(idle, cap)`` idle steps one by one:
    ``-lr`` from ``neg_rates`` (the last ``cap`` steps, newest first) or
    ``long_neg_lr`` (rows idle longer; NaN for a schedule), bias corrections
    from ``corrections`` (``(n, 2)`` by the step's count, the last row for
    every later count). Rows that need steps not at hand are left as they
    are, and ``flags`` is 1 in each of their keys. The kernel records the
    rows it steps as the XLA rule does, in place: ``last_step`` (per row)
    ``max(last_step, count)``, and ``decay_mark`` (AdamW's per-row record, or
    ``None``) ``minimum(decay_mark, new_log)``; a flagged row's records are
    left to the caller, with the row.

    With ``decay``, ``scalars`` holds AdamW's weight decay after Adam's ten
    (before the clipping's two). A row's decay over its idle steps is
    ``through[idle - 1]`` within the window (``through[o]``, the product of
    ``gamma`` over the last ``o + 1`` steps), ``gamma**idle`` past it (a
    third table in ``powers``), which is also the weight of its long-idle
    terms (``far`` times it; the window's terms carry the decay of the steps
    after theirs, as :func:`._catch_up.replay` computes them); with
    ``decay_from_marks`` (a schedule, or a rate or decay not known when the
    step is traced: no table of gamma's powers), a long-idle row's is
    ``exp(old_log - decay_mark)``, from the decay's log before the step and
    the row's mark (C's ``exp``: within an ulp of XLA's, which the XLA path
    takes).
    The kernel takes idle steps one by one for rows idle within the window,
    and for rows idle longer where it has gamma's table (their first ``cap``
    steps, then ``gamma**(idle - cap)``); it flags the others that need them.
    """
    attrs = dict(cap=cap, torch_eps=torch_eps, maximize=maximize, decay=decay, unique=unique, far_by_key=far_by_key)
    attrs.update(far_offset=far_offset, decay_from_marks=decay_from_marks)
    tables = (p, m, v, last_step, decay_mark)
    return _catch_up_adam(False, tables, keys, values, scalars, ops, count, done, far_steps, attrs)


def _catch_up_adam(
    rows: bool,
    tables: tuple[Any, ...],
    keys: jax.Array,
    values: jax.Array,
    scalars: jax.Array,
    ops: CatchUpOperands,
    count: jax.Array,
    done: jax.Array,
    far_steps: jax.Array | None,
    flags: dict[str, bool | int],
) -> tuple[Any, ...]:
    """The catch-up Adam handler on ``tables = (p, m, v, last_step, decay_mark)``: the fused step (``rows``
    false: :func:`catch_up_adam_apply`'s results) or ``tx.update``'s rule (:func:`catch_up_adam_rows`'), with
    its attributes ``flags``."""
    p, m, v, last_step, decay_mark = tables
    attrs = _attrs(p.shape[0], **flags)

    key_shape = keys.shape  # the shape alone: fn, kept in the step's jaxpr, holds no tracer

    def fn(row_begin: jax.Array, *args: jax.Array):
        table = jax.ShapeDtypeStruct(args[0].shape, args[0].dtype)
        records = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in args[3:5])
        flags = jax.ShapeDtypeStruct(key_shape, jnp.int32)
        out: tuple[jax.ShapeDtypeStruct, ...]
        if rows:
            packed = (jax.ShapeDtypeStruct(key_shape, jnp.int32), jax.ShapeDtypeStruct(args[6].shape, args[6].dtype))
            out, aliases = (table, table, *records, *packed, flags), {1: 0, 2: 1, 3: 2, 4: 3}
        else:
            out, aliases = (table, table, table, *records, flags), {i: i for i in range(5)}
        name = "catch_up_adam_rows" if rows else "catch_up_adam_apply"
        return _ffi_call(PREFIX + name, out, input_output_aliases=aliases, vmap_method="sequential")(
            *args, row_begin, **attrs
        )

    # Without AdamW's decay mark, an empty one, replicated (z).
    mark = "n" if decay_mark is not None else "z"
    marks = decay_mark if decay_mark is not None else jnp.zeros((0,), jnp.float32)
    results = f"n w, n w, n, {mark}, k, k w, k" if rows else f"n w, n w, n w, n, {mark}, k"
    # Without the record's last steps, an empty one (g).
    far_steps = far_steps if far_steps is not None else jnp.zeros((0,), jnp.int32)
    far = "f j" if ops.far.ndim == 2 else "v f j"  # AdamW's record: (variants, steps, terms)
    rule = f"n w, n w, n w, n, {mark}, k, k w, s, a j, {far}, g, q x, h, l, r, t b, o -> {results}"
    operands = (_rows2d(p), _rows2d(m), _rows2d(v), last_step, marks, keys, _rows2d(values))
    counts = jnp.stack([jnp.asarray(count, jnp.int32), jnp.asarray(done, jnp.int32)])
    args = (*operands, scalars, ops.window, ops.far, far_steps, ops.powers, ops.through, *ops[4:], counts)
    out = _by_row_shards(fn, rule, summed=(5, 6) if rows else (5,))(*args)
    mark_out = out[3 if rows else 4] if decay_mark is not None else None
    if rows:
        step = out[5].reshape(values.shape)
        return out[0].reshape(m.shape), out[1].reshape(v.shape), out[2], mark_out, out[4], step, out[6]
    return out[0].reshape(p.shape), out[1].reshape(m.shape), out[2].reshape(v.shape), out[3], mark_out, out[5]


def catch_up_adam_steps(
    p: jax.Array,
    m: jax.Array,
    v: jax.Array,
    last: jax.Array,
    idle: jax.Array,
    limits: jax.Array,
    neg_rates: jax.Array,
    corrections: jax.Array,
    powers: jax.Array,
    *,
    cap: int,
    torch_eps: bool,
    decay: bool,
) -> tuple[jax.Array, jax.Array]:
    """Rows ``p`` (with their moments) after their first ``min(idle, cap)`` idle steps, one by one, as
    :func:`._catch_up._replay_steps` takes them: ``(p, flags)``. ``limits`` is ``(b1, b2, eps, long_neg_lr,
    has_corrections)``, and with ``decay`` (AdamW's) the weight decay after them; ``neg_rates`` and
    ``corrections`` as :func:`catch_up_adam_apply` takes them; ``powers``, ``(4, 256)``: with ``decay`` at a
    constant rate, ``gamma``'s :func:`._catch_up.power_table` (rows idle longer than the window decay by
    ``gamma ** (idle - cap)`` after their first ``cap`` steps), else ``(0, 256)``. Rows with ``idle == 0`` are
    left as they are; rows whose steps are not at hand too, flagged."""
    attrs = _attrs(p.shape[0], cap=cap, torch_eps=torch_eps, decay=decay)

    def fn(row_begin: jax.Array, p: jax.Array, m: jax.Array, v: jax.Array, *rest: jax.Array):
        rows = jax.ShapeDtypeStruct(p.shape, p.dtype)
        flags = jax.ShapeDtypeStruct(p.shape[:1], jnp.int32)
        return _ffi_call(
            PREFIX + "catch_up_adam_steps", (rows, flags), input_output_aliases={0: 0}, vmap_method="sequential"
        )(p, m, v, *rest, row_begin, **attrs)

    rule = "n w, n w, n w, n, n, l, r, t b, g c -> n w, n"
    new_p, flags = _by_row_shards(fn, rule)(
        _rows2d(p), _rows2d(m), _rows2d(v), last, idle, limits, neg_rates, corrections, powers
    )
    return new_p.reshape(p.shape), flags


def catch_up_adam_replay(
    p: jax.Array,
    m: jax.Array,
    v: jax.Array,
    last_step: jax.Array,
    decay_mark: jax.Array | None,
    hp: jax.Array,
    ops: CatchUpOperands,
    done: jax.Array,
    far_steps: jax.Array | None = None,
    *,
    cap: int,
    torch_eps: bool,
    decay: bool = False,
    far_offset: int = 0,
    decay_from_marks: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Every row of a table brought up to step ``done``, in place: ``(p, m, v, flags)``, as
    :func:`catch_up_adam_apply` replays a touched row before its step (the same ``ops``, ``far`` by the rows' last
    steps or the state's record, not by key), without the step. ``hp`` is ``(b1, b2, eps, weight_decay)`` (the
    decay read with ``decay`` only). ``last_step`` and ``decay_mark`` are read, not written. Rows whose idle steps
    or coefficients are not at hand are left as they are, flagged (per row)."""
    options = dict(cap=cap, torch_eps=torch_eps, decay=decay, far_offset=far_offset, decay_from_marks=decay_from_marks)
    attrs = _attrs(p.shape[0], **options)

    def fn(row_begin: jax.Array, *args: jax.Array):
        table = jax.ShapeDtypeStruct(args[0].shape, args[0].dtype)
        per_row = jax.ShapeDtypeStruct(args[0].shape[:1], jnp.int32)
        return _ffi_call(
            PREFIX + "catch_up_adam_replay",
            (table, table, table, per_row),
            input_output_aliases={0: 0, 1: 1, 2: 2},
            vmap_method="sequential",
        )(*args, row_begin, **attrs)

    mark = "n" if decay_mark is not None else "z"
    marks = decay_mark if decay_mark is not None else jnp.zeros((0,), jnp.float32)
    far_steps = far_steps if far_steps is not None else jnp.zeros((0,), jnp.int32)
    far = "f j" if ops.far.ndim == 2 else "v f j"
    rule = f"n w, n w, n w, n, {mark}, y, a j, {far}, g, q x, h, l, r, t b, o -> n w, n w, n w, n"
    counts = jnp.stack([jnp.asarray(done, jnp.int32)] * 2)
    args = (_rows2d(p), _rows2d(m), _rows2d(v), last_step, marks, hp, ops.window, ops.far, far_steps, ops.powers)
    new_p, new_m, new_v, flags = _by_row_shards(fn, rule)(*args, ops.through, *ops[4:], counts)
    return new_p.reshape(p.shape), new_m.reshape(m.shape), new_v.reshape(v.shape), flags


def _write_rows(target: str, table: jax.Array, keys: jax.Array, values: jax.Array, **extra: int) -> jax.Array:
    """A kernel that writes ``values[i]`` into row ``keys[i]`` of ``table``, in place, on each row shard."""
    attrs = _attrs(table.shape[0], **extra)

    def fn(row_begin: jax.Array, table: jax.Array, keys: jax.Array, values: jax.Array):
        return (
            _ffi_call(
                PREFIX + target,
                jax.ShapeDtypeStruct(table.shape, table.dtype),
                input_output_aliases={0: 0},
                vmap_method="sequential",
            )(table, keys, values, row_begin, **attrs),
        )

    (out,) = _by_row_shards(fn, "n w, k, k w -> n w")(_rows2d(table), keys, _rows2d(values))
    return out.reshape(table.shape)


def scatter_add(table: jax.Array, keys: jax.Array, values: jax.Array, unique: int = 0) -> jax.Array:
    """``table`` with ``values[i]`` added to row ``keys[i]`` in entry order, in place; padding dropped.
    ``unique`` (:func:`._kernel_path.unique_flag`): 2 where the library made the keys distinct, 1 where the user
    promised it (checked: keys that repeat are added as without it), 0 otherwise; distinct keys are split over
    the threads by position, where repeating ones are split by key."""
    return _write_rows("scatter_add", table, keys, values, unique=unique)


def add_rows_half(table: jax.Array, keys: jax.Array, values: jax.Array) -> jax.Array:
    """A bfloat16 or float16 ``table`` with float32 ``values[i]`` added to row ``keys[i]``, in place: each element
    ``(p + u).astype(table.dtype)`` (rounded once, to nearest even); the keys distinct (the library's), padding
    dropped."""
    return _write_rows("add_rows_half", table, keys, values)


def add_rows_half_stochastic(table: jax.Array, keys: jax.Array, values: jax.Array, seeds: jax.Array) -> jax.Array:
    """:func:`add_rows_half` with each sum rounded stochastically, as ``apply_updates_stochastic`` rounds it: each
    row's draws from its id and the leaf's two ``seeds`` (``_stochastic_rounding._draws``), a third word (where
    given) added to the ids (the draws' row offset of a table's block inside ``shard_map``)."""
    attrs = _attrs(table.shape[0])

    def fn(row_begin: jax.Array, table: jax.Array, keys: jax.Array, values: jax.Array, seeds: jax.Array):
        return (
            _ffi_call(
                PREFIX + "add_rows_half_stochastic",
                jax.ShapeDtypeStruct(table.shape, table.dtype),
                input_output_aliases={0: 0},
                vmap_method="sequential",
            )(table, keys, values, seeds, row_begin, **attrs),
        )

    (out,) = _by_row_shards(fn, "n w, k, k w, s -> n w")(_rows2d(table), keys, _rows2d(values), _seeds_operand(seeds))
    return out.reshape(table.shape)


def set_rows(table: jax.Array, keys: jax.Array, values: jax.Array) -> jax.Array:
    """``table.at[keys].set(values, mode="drop")`` in place, for a table of a 2-byte dtype: a negative key counts
    from the end, a key out of range after that is dropped, a repeated key keeps its last row."""
    return _write_rows("set_rows", table, keys, values)


def gather(table: jax.Array, keys: jax.Array) -> jax.Array:
    """``table[keys]`` as ``table.at[keys].get(mode="fill", fill_value=0)`` reads it: a negative key counts from
    the end, a key out of range after that reads zeros. Any dtype; a row-sharded table gathers on each shard."""
    k = keys.shape[0]
    attrs = _attrs(table.shape[0])

    def fn(row_begin: jax.Array, table: jax.Array, keys: jax.Array):
        return (
            _ffi_call(
                PREFIX + "gather", jax.ShapeDtypeStruct((k, table.shape[1]), table.dtype), vmap_method="sequential"
            )(table, keys, row_begin, **attrs),
        )

    (rows,) = _by_row_shards(fn, "n w, k -> k w", summed=(0,))(_rows2d(table), keys)
    return rows.reshape((k, *table.shape[1:]))


def distinct(keys: jax.Array, num_rows: int) -> tuple[jax.Array, jax.Array]:
    """Each distinct key in ``[0, num_rows)`` once, in order of first occurrence, then ``num_rows``; and each
    entry's slot (``k - 1`` for a padding entry)."""
    out = (jax.ShapeDtypeStruct(keys.shape, jnp.int32), jax.ShapeDtypeStruct(keys.shape, jnp.int32))
    packed, inverse = _ffi_call(PREFIX + "distinct", out, vmap_method="sequential")(keys, num_rows=np.int64(num_rows))
    return packed, inverse


def coalesce(keys: jax.Array, values: jax.Array, num_rows: int) -> tuple[jax.Array, jax.Array]:
    """Each distinct key in ``[0, num_rows)`` once, first, its entries' values summed in entry order; then the
    padding key ``num_rows`` with zero rows: ``(keys, values)`` of the input's shapes."""
    out = (jax.ShapeDtypeStruct(keys.shape, jnp.int32), jax.ShapeDtypeStruct(values.shape, values.dtype))
    new_keys, new_values = _ffi_call(PREFIX + "coalesce", out, vmap_method="sequential")(
        keys, _rows2d(values), **_attrs(num_rows)
    )
    return new_keys, new_values.reshape(values.shape)


def coalesce_squares(keys: jax.Array, values: jax.Array, num_rows: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`coalesce`, and the sum of the squares of its values (summed in double, rounded once to float32)."""
    out = (
        jax.ShapeDtypeStruct(keys.shape, jnp.int32),
        jax.ShapeDtypeStruct(values.shape, values.dtype),
        jax.ShapeDtypeStruct((), jnp.float32),
    )
    new_keys, new_values, squares = _ffi_call(PREFIX + "coalesce_squares", out, vmap_method="sequential")(
        keys, _rows2d(values), **_attrs(num_rows)
    )
    return new_keys, new_values.reshape(values.shape), squares


def all_finite(x: jax.Array) -> jax.Array:
    """Whether every element of the float32 array ``x`` is finite (no infinity, no NaN), a bool scalar."""
    out = jax.ShapeDtypeStruct((), jnp.int32)
    flag = _ffi_call(PREFIX + "all_finite", out, vmap_method="sequential")(x, threads=np.int64(threads()))
    return flag != 0


def sum_squares(keys: jax.Array, values: jax.Array, num_rows: int, *, unique: int = 0) -> jax.Array:
    """:func:`coalesce_squares`' sum of squares alone, bitwise, without writing the summed values; with ``unique``
    (:func:`._kernel_path.unique_flag`), each in-range entry taken as its own row, without coalescing (a user's
    promise not checked: the XLA path's norm of such a leaf takes its entries as they are)."""
    out = jax.ShapeDtypeStruct((), jnp.float32)
    return _ffi_call(PREFIX + "sum_squares", out, vmap_method="sequential")(
        keys, _rows2d(values), **_attrs(num_rows, unique=unique)
    )


def rowwise_adagrad_rows(
    acc: jax.Array,
    keys: jax.Array,
    values: jax.Array,
    scalars: jax.Array,
    p: jax.Array | None = None,
    *,
    unique: int,
    decoupled: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The row-wise Adagrad leaf rule on the CPU: ``(acc, keys, step)``, the accumulators updated in place.

    ``acc`` holds one accumulator per row; ``p``, the parameters, is given for
    weight decay only (read, not written): L2 (in the gradient), or with ``decoupled`` each step row plus
    ``weight_decay * p`` (``sparse_aware(add_decayed_weights)`` after the rule). The keys and step rows come back
    packed as in :func:`sparse_adam_rows`, the steps times ``scalars``' ``neg_lr`` (1, or the learning rate's
    ``-lr``: :func:`._learning_rate.with_learning_rate`).
    """
    decays = p is not None
    attrs = _attrs(acc.shape[0], decay=2 if decoupled else int(decays), unique=unique)
    shape = values.shape

    def fn(row_begin: jax.Array, *args: jax.Array):
        # With decay the parameters come first (their sharding decides the row blocks); the handler takes them last.
        p, (acc, keys, values, scalars) = (args[:1], args[1:]) if decays else ((), args)
        results = (
            jax.ShapeDtypeStruct(acc.shape, acc.dtype),
            jax.ShapeDtypeStruct(keys.shape, jnp.int32),
            jax.ShapeDtypeStruct(values.shape, values.dtype),
        )
        return _ffi_call(
            PREFIX + "rowwise_adagrad_rows", results, input_output_aliases={0: 0}, vmap_method="sequential"
        )(acc, keys, values, scalars, row_begin, *p, **attrs)

    args: tuple[jax.Array, ...] = (acc, keys, _rows2d(values), scalars)
    rule = "n, k, k w, s -> n, k, k w"
    if p is not None:
        args, rule = (_rows2d(p), *args), "n w, " + rule
    acc2, keys, step = _by_row_shards(fn, rule, summed=(2,))(*args)
    return acc2, keys, step.reshape(shape)


def rowwise_adagrad_apply(
    p: jax.Array,
    acc: jax.Array,
    keys: jax.Array,
    values: jax.Array,
    scalars: jax.Array,
    seeds: jax.Array | None = None,
    *,
    decay: int,
    unique: int,
) -> tuple[jax.Array, jax.Array]:
    """The row-wise Adagrad leaf rule and ``p += neg_lr * step`` in one pass over each touched row: ``(p, acc)``.

    ``decay``: 0 none, 1 L2 (folded into the gradient), 2 decoupled (added to the step). ``p`` float32, bfloat16
    or float16; a 16-bit ``p`` is rounded to nearest, or stochastically with ``seeds`` (two uint32, those of
    :func:`._stochastic_rounding.leaf_seeds`, and optionally a third, the row id the draws give the table's row 0:
    its block's first row inside ``shard_map``).
    """
    attrs = _attrs(p.shape[0], decay=decay, unique=unique, rounding=seeds is not None)

    def fn(row_begin: jax.Array, p: jax.Array, acc: jax.Array, *rest: jax.Array):
        return _ffi_call(
            PREFIX + "rowwise_adagrad_apply",
            (jax.ShapeDtypeStruct(p.shape, p.dtype), jax.ShapeDtypeStruct(acc.shape, acc.dtype)),
            input_output_aliases={0: 0, 1: 1},
            vmap_method="sequential",
        )(p, acc, *rest, row_begin, **attrs)

    rule = "n w, n, k, k w, s, t -> n w, n"
    new_p, new_acc = _by_row_shards(fn, rule)(_rows2d(p), acc, keys, _rows2d(values), scalars, _seeds_operand(seeds))
    return new_p.reshape(p.shape), new_acc


def _seeds_operand(seeds: jax.Array | None) -> jax.Array:
    """The apply kernels' ``seeds`` operand: the leaf's two seeds, then the draws' row offset (0 if not given)."""
    if seeds is None:
        return jnp.zeros((3,), jnp.uint32)
    return seeds if seeds.shape == (3,) else jnp.concatenate([seeds, jnp.zeros((1,), jnp.uint32)])


def rowwise_adam_rows(
    mu: jax.Array,
    nu: jax.Array,
    keys: jax.Array,
    values: jax.Array,
    scalars: jax.Array,
    per_row: tuple[jax.Array, ...] | None = None,
    *,
    unique: int,
) -> tuple[jax.Array, ...]:
    """The row-wise Adam leaf rule on the CPU: ``(mu, nu, keys, step[, row_count])``, the state updated in place.

    ``per_row``: with per-row bias correction, the row counts, and either the corrections (``(k, 2)``:
    ``1 - b1^c``, ``1 - b2^c`` for each key's row at its new count) or nothing more, the kernel then computing
    them itself in float32 (once per row, with the C library's ``powf``, which is what XLA:CPU calls for them).
    The keys and step rows come back packed as in :func:`sparse_adam_rows`, the steps times ``scalars``'
    ``neg_lr`` (1, or the learning rate's ``-lr``: :func:`._learning_rate.with_learning_rate`).
    """
    attrs = _attrs(mu.shape[0], unique=unique)
    shape = values.shape
    extra = () if per_row is None else per_row

    def fn(row_begin: jax.Array, mu: jax.Array, nu: jax.Array, keys: jax.Array, values: jax.Array, scalars, *rest):
        results = [
            jax.ShapeDtypeStruct(mu.shape, mu.dtype),
            jax.ShapeDtypeStruct(nu.shape, nu.dtype),
            jax.ShapeDtypeStruct(keys.shape, jnp.int32),
            jax.ShapeDtypeStruct(values.shape, values.dtype),
        ]
        aliases = {0: 0, 1: 1}
        if rest:
            results.append(jax.ShapeDtypeStruct(rest[0].shape, rest[0].dtype))
            aliases[6] = 4
        return _ffi_call(
            PREFIX + "rowwise_adam_rows", tuple(results), input_output_aliases=aliases, vmap_method="sequential"
        )(mu, nu, keys, values, scalars, row_begin, *rest, **attrs)

    rule = "n w, n, k, k w, s" + ("", ", n", ", n, k c")[len(extra)] + " -> n w, n, k, k w"
    rule += ", n" if extra else ""
    out = _by_row_shards(fn, rule, summed=(3,))(_rows2d(mu), nu, keys, _rows2d(values), scalars, *extra)
    m, v, keys, step, *count = out
    return (m.reshape(mu.shape), v, keys, step.reshape(shape), *count)


def rowwise_adam_apply(
    p: jax.Array,
    mu: jax.Array,
    nu: jax.Array,
    keys: jax.Array,
    values: jax.Array,
    scalars: jax.Array,
    per_row: tuple[jax.Array, ...] | None = None,
    seeds: jax.Array | None = None,
    *,
    unique: int,
) -> tuple[jax.Array, ...]:
    """The row-wise Adam leaf rule and ``p += neg_lr * step`` in one pass over each touched row:
    ``(p, mu, nu[, row_count])``; ``per_row`` as in :func:`rowwise_adam_rows`, ``p`` and ``seeds`` as in
    :func:`rowwise_adagrad_apply`."""
    attrs = _attrs(p.shape[0], unique=unique, rounding=seeds is not None)
    extra = () if per_row is None else per_row

    def fn(row_begin: jax.Array, p: jax.Array, mu: jax.Array, nu: jax.Array, *rest: jax.Array):
        results = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (p, mu, nu)]
        aliases = {0: 0, 1: 1, 2: 2}
        if len(rest) > 4:  # keys, values, scalars, seeds, then the row counts
            results.append(jax.ShapeDtypeStruct(rest[4].shape, rest[4].dtype))
            aliases[8] = 3
        return _ffi_call(
            PREFIX + "rowwise_adam_apply", tuple(results), input_output_aliases=aliases, vmap_method="sequential"
        )(p, mu, nu, *rest[:4], row_begin, *rest[4:], **attrs)

    rule = "n w, n w, n, k, k w, s, t" + ("", ", n", ", n, k c")[len(extra)] + " -> n w, n w, n"
    rule += ", n" if extra else ""
    new_p, m, v, *count = _by_row_shards(fn, rule)(
        _rows2d(p), _rows2d(mu), nu, keys, _rows2d(values), scalars, _seeds_operand(seeds), *extra
    )
    return (new_p.reshape(p.shape), m.reshape(mu.shape), v, *count)


def elementwise_rows(
    target: str,
    tables: tuple[jax.Array, ...],
    keys: jax.Array,
    values: jax.Array,
    scalars: jax.Array,
    reads: tuple[jax.Array, ...] = (),
    *,
    unique: int,
    **flags: int,
) -> tuple[jax.Array, ...]:
    """An element-wise rule's leaf rule on the CPU (``target``: ``"adagrad"``, ``"momentum"`` or ``"ftrl"``):
    ``(*tables, keys, step)``, the state tables (each of the parameter's shape) updated in place.

    ``reads`` (the parameters, for FTRL) are read, not written; ``flags`` are the handler's own attributes. The
    keys and step rows come back packed as in :func:`sparse_adam_rows`; Adagrad's and momentum's steps times
    ``scalars``' ``neg_lr`` (1, or the learning rate's ``-lr``: :func:`._learning_rate.with_learning_rate`).
    """
    attrs = _attrs(tables[0].shape[0], **flags, unique=unique)
    shape, n = values.shape, len(tables)

    def fn(row_begin: jax.Array, *args: jax.Array):
        keys, values = args[-3], args[-2]
        results = (
            *(jax.ShapeDtypeStruct(t.shape, t.dtype) for t in args[:n]),
            jax.ShapeDtypeStruct(keys.shape, jnp.int32),
            jax.ShapeDtypeStruct(values.shape, values.dtype),
        )
        return _ffi_call(
            PREFIX + target + "_rows", results, input_output_aliases={i: i for i in range(n)}, vmap_method="sequential"
        )(*args, row_begin, **attrs)

    rows = ", ".join(["n w"] * n)
    rule = ", ".join(["n w"] * (n + len(reads))) + ", k, k w, s -> " + rows + ", k, k w"
    operands = (*(_rows2d(t) for t in (*tables, *reads)), keys, _rows2d(values), scalars)
    *new, out_keys, step = _by_row_shards(fn, rule, summed=(n + 1,))(*operands)
    return (*(x.reshape(t.shape) for x, t in zip(new, tables, strict=True)), out_keys, step.reshape(shape))


def elementwise_apply(
    target: str,
    p: jax.Array,
    tables: tuple[jax.Array, ...],
    keys: jax.Array,
    values: jax.Array,
    scalars: jax.Array,
    *,
    unique: int,
    **flags: int,
) -> tuple[jax.Array, ...]:
    """An element-wise rule and the parameters' update in one pass over each touched row: ``(p, *tables)``.

    ``target`` as in :func:`elementwise_rows`; ``scalars`` the rule's, then the clipping's (:class:`._fusion.Clipped`).
    """
    attrs = _attrs(p.shape[0], **flags, unique=unique)
    n = len(tables) + 1

    def fn(row_begin: jax.Array, *args: jax.Array):
        results = tuple(jax.ShapeDtypeStruct(t.shape, t.dtype) for t in args[:n])
        return _ffi_call(
            PREFIX + target + "_apply", results, input_output_aliases={i: i for i in range(n)}, vmap_method="sequential"
        )(*args, row_begin, **attrs)

    rule = ", ".join(["n w"] * n) + ", k, k w, s -> " + ", ".join(["n w"] * n)
    operands = (*(_rows2d(t) for t in (p, *tables)), keys, _rows2d(values), scalars)
    out = _by_row_shards(fn, rule)(*operands)
    return tuple(x.reshape(t.shape) for x, t in zip(out, (p, *tables), strict=True))


def catch_up_momentum(
    p: jax.Array,
    trace: jax.Array,
    last_step: jax.Array,
    keys: jax.Array,
    values: jax.Array,
    scalars: jax.Array,
    window: jax.Array,
    powers: jax.Array,
    per_key: jax.Array | None,
    count: jax.Array,
    done: jax.Array,
    record: tuple[jax.Array, jax.Array] | None = None,
    *,
    cap: int,
    nesterov: bool,
    unique: int,
    rows: bool = False,
) -> tuple[jax.Array, ...]:
    """``sparse_sgd(..., momentum, catch_up=True)``'s fused step: the momentum step, each touched row first taking
    the steps it sat out in closed form: ``(p, trace, last_step, flags)``, each touched row's ``last_step``
    recorded in place as ``max(last_step, count)``. With ``rows``, the leaf rule for ``tx.update``
    (``catch_up_momentum_rows``): ``(trace, last_step, keys, step, flags)``, ``p`` read and not written, the keys
    and step rows packed as in :func:`sparse_adam_rows`, a row's step the XLA rule's update (the replayed row plus
    its step, less the stored row, where it sat out steps).

    The kernel reads each touched row's idle steps from its record, ``idle = done - last`` (0 where ``last ==
    0``), and its two coefficients as ``_sgd``'s ``idle_coefficients`` computes them per row: ``C`` (the sum over
    the idle steps of the learning rate times a power of the momentum) from ``window[min(idle, cap) - 1]``
    (``(max(cap, 1),)``; 0 for ``cap == 0``) and ``momentum**idle`` from ``powers`` (the momentum's
    :func:`._catch_up.power_table`), or both from ``per_key`` (``(k, 2)``) where given. With ``record`` (the
    state's :class:`._catch_up.IdleRecord`'s coefficients and last steps, under a schedule), a row idle longer
    than ``cap`` steps takes ``C`` from the record's entry ``last mod len(last_steps)`` (times the momentum with
    Nesterov) where it is for ``last``; a row whose entry is not is left as it is, its records too, its step
    rows (``rows``) NaN, and ``flags`` is 1 in each of its keys (0 elsewhere)."""
    attrs = _attrs(p.shape[0], cap=cap, per_key=per_key is not None, nesterov=nesterov, unique=unique)

    key_shape = keys.shape  # the shape alone: fn, kept in the step's jaxpr, holds no tracer

    def fn(row_begin: jax.Array, p: jax.Array, t: jax.Array, last: jax.Array, *rest: jax.Array):
        flags = jax.ShapeDtypeStruct(key_shape, jnp.int32)
        if rows:
            keys_in, values_in = rest[0], rest[1]
            out = (
                *(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (t, last)),
                jax.ShapeDtypeStruct(keys_in.shape, jnp.int32),
                jax.ShapeDtypeStruct(values_in.shape, values_in.dtype),
                flags,
            )
            aliases = {1: 0, 2: 1}
        else:
            out = (*(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (p, t, last)), flags)
            aliases = {0: 0, 1: 1, 2: 2}
        name = "catch_up_momentum_rows" if rows else "catch_up_momentum_apply"
        return _ffi_call(PREFIX + name, out, input_output_aliases=aliases, vmap_method="sequential")(
            p, t, last, *rest, row_begin, **attrs
        )

    # Without per-key coefficients, an empty (0, 2) (z c); without the record, empty ones (y j, g).
    by_key = "k" if per_key is not None else "z"
    per_key = per_key if per_key is not None else jnp.zeros((0, 2), jnp.float32)
    far, far_steps = record if record is not None else (jnp.zeros((0, 1), jnp.float32), jnp.zeros((0,), jnp.int32))
    counts = jnp.stack([jnp.asarray(count, jnp.int32), jnp.asarray(done, jnp.int32)])
    tables = (_rows2d(p), _rows2d(trace), last_step, keys, _rows2d(values))
    operands = (*tables, scalars, window, powers, per_key, far, far_steps, counts)  # far: (steps, terms)
    ins = f"n w, n w, n, k, k w, s, a, q, {by_key} c, y j, g, o"
    if rows:
        new_t, new_last, out_keys, step, flags = _by_row_shards(fn, ins + " -> n w, n, k, k w, k", summed=(3, 4))(
            *operands
        )
        return new_t.reshape(trace.shape), new_last, out_keys, step.reshape(values.shape), flags
    new_p, new_t, new_last, flags = _by_row_shards(fn, ins + " -> n w, n w, n, k", summed=(3,))(*operands)
    return new_p.reshape(p.shape), new_t.reshape(trace.shape), new_last, flags
