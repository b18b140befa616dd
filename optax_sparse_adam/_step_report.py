"""Asking a compiled step what it costs, and why: :func:`step_report`.

A sparse step costs O(touched rows) only when XLA updates the tables in
place. Three things undo that without a word: a table passed to the step but
not donated (XLA must keep the caller's copy), a table-sized copy that XLA
inserts because it cannot order a read of the table before the write, and
the XLA path where the native kernels were expected. The compiled step says
all three (its arguments' donation, its memory analysis and its HLO);
:func:`step_report` reads them out.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from typing import Any

import jax

from optax_sparse_adam import _huge_pages
from optax_sparse_adam._kernel_path import kernel_path
from optax_sparse_adam._malloc import GLIBC_MMAP_LIMIT, malloc_tuned

__all__ = ["StepReport", "step_report"]

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4}
_BYTES |= {"s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_COPY = re.compile(r"%(\S+) = (\w+)\[([\d,]*)\]\S* copy\(")
_KERNEL_CALL = 'custom_call_target="optax_sparse_adam_v'
_KERNEL_NAME = re.compile(r'custom_call_target="optax_sparse_adam_v\d+_(\w+)"')


@dataclasses.dataclass(frozen=True)
class StepReport:
    """What a compiled step costs (see :func:`step_report`).

    Attributes:
      kernel_path: ``"native-cpu"`` or ``"xla"``, as :func:`kernel_path` said when the step was traced.
      kernel_calls: How many calls of the library's native kernels the compiled step holds: its call sites, a
        call inside a loop (``lax.scan``, ``vmap`` of a kernel that runs row block by block) counted once.
      argument_bytes: The bytes of the step's array arguments.
      temp_bytes: The bytes of temporaries XLA allocates for the step.
      threshold_bytes: What counts as table-sized below.
      not_donated: ``(path, bytes)`` of each table-sized argument the step does not donate.
      copies: ``(hlo name, bytes)`` of each table-sized copy in the compiled step.
      kernels: The library's native kernels the compiled step calls, by name (``"sparse_adam_apply"``: a fused
        step; ``"sparse_adam_rows"`` and ``"scatter_add"``: the two calls), each once, in the order they appear.
      platform: The platform the step was compiled for (``"cpu"``, ``"gpu"``, ``"tpu"``).
      small_pages: ``(path, bytes)`` of each table-sized argument on the CPU (of 32 MiB or more) that lies mostly on
        4 KiB pages where Linux offers 2 MiB ones (transparent huge pages ``madvise`` or ``always``): each row a
        step touches there costs a page walk too (:func:`advise_huge_pages`). Only arguments given as arrays are
        looked at.
    """

    kernel_path: str
    kernel_calls: int
    argument_bytes: int
    temp_bytes: int
    threshold_bytes: int
    not_donated: tuple[tuple[str, int], ...]
    copies: tuple[tuple[str, int], ...]
    kernels: tuple[str, ...] = ()
    platform: str = ""
    small_pages: tuple[tuple[str, int], ...] = ()

    @property
    def temporaries_mapped(self) -> bool:
        """Whether the step's temporaries are mapped afresh on every call (on the CPU, over glibc's 32 MiB mmap
        limit, unless :func:`tune_malloc` raised it above them; see there)."""
        return self.platform == "cpu" and self.temp_bytes > _mmap_limit()

    @property
    def fused(self) -> bool:
        """True where the optimizer's step runs fused, in one native pass per row over its parameters and state
        (for the tables the kernels cover: the printed report names the kernels of a table whose rows run the XLA
        path, applied apart, and of one that takes the two calls)."""
        return any(name.endswith("_apply") for name in self.kernels)

    @property
    def in_place(self) -> bool:
        """Whether the step updates its table-sized arguments in place (all donated, none copied, and no
        table-sized temporary built)."""
        return not self.not_donated and not self.copies and self.temp_bytes < self.threshold_bytes

    def __str__(self) -> str:
        lines = [
            f"kernel path: {self.kernel_path} ({self.kernel_calls} native kernel call site(s) in the compiled step"
            + (f": {', '.join(self.kernels)})" if self.kernels else ")"),
            f"arguments: {_mb(self.argument_bytes)}; temporaries: {_mb(self.temp_bytes)} "
            f"(table-sized: {_mb(self.threshold_bytes)} or more)",
        ]
        # A 16-bit table's rows computed apart: p + u added by add_rows_half*, or rows the XLA path computed written
        # back by set_rows (a helper, not an optimizer's rows kernel).
        apart = [name for name in self.kernels if name.startswith("add_rows_half") or name == "set_rows"]
        rows = [name for name in self.kernels if name.endswith("_rows") and name != "set_rows"]
        two_calls = (
            "the optimizer's rows, then a scatter into the parameters; osa.update_and_apply fuses "
            "them for the optimizers the kernels cover, also inside inject_hyperparams, stages before the "
            "optimizer and multi_transform, but not where a wrapper changes the updates or the state "
            "(optax.apply_if_finite: use osa.apply_if_finite, outermost; stages after the optimizer): see "
            "'One pass through optax wrappers' in docs/guides/optax_pipelines.md"
        )
        if self.fused:
            lines.append("fused: the optimizer's step is one native pass over each touched row")
            if apart:
                lines.append(
                    f"not every table: a table's update is applied apart ({', '.join(apart)}), its rows on the XLA "
                    "path (a 16-bit table or state, or an optimizer the kernels do not cover); see 'What the "
                    "kernels cover' in docs/guides/native_kernels.md"
                )
            if rows:
                lines.append(f"not every table: some take the two calls ({', '.join(rows)}): {two_calls}")
        elif rows:
            lines.append(f"two calls: {two_calls}")
        elif any(name.endswith("_replay") for name in self.kernels):
            lines.append("catch-up replay: rows brought up to date in one native pass (catch_up, caught-up lookups)")
        elif self.kernel_path == "native-cpu":
            lines.append(
                "no native kernel for the optimizer: its rows run the XLA path (an optimizer or dtype the kernels "
                "do not cover, a step inside shard_map, or one without sparse leaves); see 'What the kernels "
                "cover' in "
                "docs/guides/native_kernels.md"
            )
        for path, size in self.not_donated:
            lines.append(
                f"not donated: {path} ({_mb(size)}): XLA keeps the caller's copy and writes a new one every step; "
                "donate it (jax.jit(..., donate_argnums=...)) and use the returned value"
            )
        why = (
            "an argument that is not donated is copied before it is updated"
            if self.not_donated
            else "XLA could not order a read of the table before its update in place"
        )
        for name, size in self.copies:
            lines.append(
                f"table-sized copy: {name} ({_mb(size)}): {why}; see 'When a step is slow' in docs/which_path.md"
            )
        if self.temp_bytes >= self.threshold_bytes and not self.copies:
            lines.append(
                "table-sized temporaries: an array of a table's size is built every step (a dense gradient, or on "
                "the XLA path a 16-bit table converted to float32 around a scatter)"
            )
        if self.temporaries_mapped:
            lines.append(
                f"temporaries over glibc's {_mb(_mmap_limit())} mmap limit: XLA:CPU allocates them as one block a "
                "call, which glibc maps afresh (a page fault every 4 KiB, every step); osa.tune_malloc() keeps it "
                "in the heap (its threshold above them)"
            )
        for path, size in self.small_pages:
            lines.append(
                f"on 4 KiB pages: {path} ({_mb(size)}): each row a step touches costs a page walk as well; "
                "osa.advise_huge_pages moves it onto 2 MiB pages (see 'Tables on 4 KiB pages' in docs/which_path.md)"
            )
        if self.in_place:
            lines.append("in place: every table-sized argument is donated and none is copied")
        return "\n".join(lines)


def _mmap_limit() -> int:
    """The largest block glibc keeps in its heap: its own 32 MiB, or what :func:`tune_malloc` set."""
    tuned = malloc_tuned()
    return GLIBC_MMAP_LIMIT if tuned is None else tuned


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def step_report(step: Callable[..., Any], *args: Any, min_bytes: int | None = None, **kwargs: Any) -> StepReport:
    """Compiles ``step`` for these arguments and reports what it costs and why.

    Args:
      step: The step, as :func:`jax.jit` returns it (with its ``donate_argnums``);
        a plain function is jitted without donation.
      *args: Its arguments (arrays or ``jax.ShapeDtypeStruct``).
      min_bytes: What counts as table-sized; default: a quarter of the largest
        array argument's share on one device (the compiled program is one
        device's), and at least 1 MiB.
      **kwargs: Its keyword arguments.

    Returns:
      A :class:`StepReport`; ``print`` it for a summary with what to do.

    Examples:
      >>> import functools, jax, jax.numpy as jnp
      >>> import optax_sparse_adam as osa
      >>> tx = osa.sparse_adam(0.1)
      >>> def step(p, s, ids, g):
      ...     return osa.update_and_apply(tx, osa.IndexedRows(ids, g, 4096), s, p)
      >>> p = jnp.zeros((4096, 64), jnp.float32)
      >>> args = (p, tx.init(p), jnp.arange(8), jnp.ones((8, 64), jnp.float32))
      >>> osa.step_report(jax.jit(step, donate_argnums=(0, 1)), *args).in_place
      True
      >>> report = osa.step_report(jax.jit(step), *args)
      >>> report.in_place, [path for path, _ in report.not_donated]
      (False, ['args[0]', 'args[1][0].mu', 'args[1][0].nu'])
    """
    if not hasattr(step, "lower"):
        step = jax.jit(step)
    path = kernel_path()
    lowered = step.lower(*args, **kwargs)  # type: ignore[attr-defined]
    compiled = lowered.compile()
    infos = jax.tree_util.tree_leaves_with_path(lowered.args_info)
    # args_info leaves out static arguments: its positional indices are those of the others among args.
    static = {i % len(args) for i in getattr(getattr(step, "_jit_info", None), "static_argnums", ()) if args}
    dynamic = [i for i in range(len(args)) if i not in static]
    sizes = [(_arg_path(jax.tree_util.keystr(p), dynamic), _nbytes(info), bool(info.donated)) for p, info in infos]
    # The compiled program is one device's: a sharded argument's table-sized buffers are its block's size.
    leaves = jax.tree.leaves((args, kwargs))
    local = [_local_nbytes(x) for x in leaves] if len(leaves) == len(sizes) else [s for _, s, _ in sizes]
    largest = max(local, default=0)
    threshold = min_bytes if min_bytes is not None else max(2**20, largest // 4)
    not_donated = tuple(
        (p, size) for (p, size, donated), mine in zip(sizes, local, strict=True) if mine >= threshold and not donated
    )
    hlo = compiled.as_text()
    copies = []
    for match in _COPY.finditer(hlo):
        dims = [int(d) for d in match.group(3).split(",") if d]
        size = math.prod(dims) * _BYTES.get(match.group(2), 4)
        if size >= threshold:
            copies.append((f"{match.group(1)} {match.group(2)}{dims}", size))
    memory = compiled.memory_analysis()
    return StepReport(
        kernel_path=path,
        kernel_calls=hlo.count(_KERNEL_CALL),
        argument_bytes=sum(size for _, size, _ in sizes),
        temp_bytes=int(getattr(memory, "temp_size_in_bytes", 0)),
        threshold_bytes=threshold,
        not_donated=not_donated,
        copies=tuple(copies),
        kernels=tuple(dict.fromkeys(_KERNEL_NAME.findall(hlo))),
        platform=_platform(compiled),
        small_pages=_small_pages(args, kwargs, threshold),
    )


def _small_pages(args: Any, kwargs: Any, threshold: int) -> tuple[tuple[str, int], ...]:
    """The table-sized CPU arrays among the arguments that lie mostly on 4 KiB pages where huge ones are offered."""
    if not _huge_pages.offered():
        return ()
    least = max(threshold, _huge_pages.MIN_BYTES)
    spans, owners = [], []  # each buffer, and the argument it belongs to
    for path, x in jax.tree_util.tree_leaves_with_path((args, kwargs)):
        if isinstance(x, jax.Array) and not x.is_deleted():
            for _, start, size in _huge_pages.cpu_buffers(x):
                if size >= least:
                    spans.append((start, size))
                    owners.append(_arg_path(jax.tree_util.keystr(path)))
    sizes: dict[str, list[int]] = {}  # by argument: its bytes, and those on huge pages (smaps read once)
    for owner, (_, size), huge in zip(owners, spans, _huge_pages.huge_bytes(spans), strict=True):
        total = sizes.setdefault(owner, [0, 0])
        total[0], total[1] = total[0] + size, total[1] + huge
    return tuple((owner, size) for owner, (size, huge) in sizes.items() if 2 * huge < size)


def _platform(compiled: Any) -> str:
    """The platform of the devices a compiled step runs on (the default backend's where it does not say)."""
    try:
        devices = compiled.input_shardings[0][0].device_set if compiled.input_shardings[0] else ()
    except (AttributeError, IndexError, TypeError):
        devices = ()
    return next(iter(devices)).platform if devices else jax.default_backend()


def _itemsize(dtype: Any) -> int:
    """Bytes per element, of a PRNG key's dtype too (``jax.numpy.dtype`` does not take extended dtypes)."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return int(dtype.itemsize)
    return jax.numpy.dtype(dtype).itemsize


def _nbytes(info: Any) -> int:
    return math.prod(info.shape) * _itemsize(info.dtype)


def _local_nbytes(x: Any) -> int:
    """The bytes of one device's shard of an argument (all of it when it carries no sharding)."""
    shape = tuple(getattr(x, "shape", ()))
    sharding = getattr(x, "sharding", None)
    if sharding is not None and hasattr(sharding, "shard_shape"):
        shape = tuple(sharding.shard_shape(shape))
    return math.prod(shape) * _itemsize(getattr(x, "dtype", "float32"))


_POSITIONAL = re.compile(r"\[0\]\[(\d+)\]")


def _arg_path(keystr: str, dynamic: list[int] | None = None) -> str:
    """``args_info``'s path ``[0][1][0].mu`` as ``args[1][0].mu`` (its first index is args vs. kwargs); with
    ``dynamic`` (the indices among args of those args_info holds, the others static) by the index among args."""
    match = _POSITIONAL.match(keystr)
    if match is not None and dynamic is not None and int(match.group(1)) < len(dynamic):
        return f"args[{dynamic[int(match.group(1))]}]" + keystr[match.end() :]
    if keystr.startswith("[0]"):
        return "args" + keystr[3:]
    if keystr.startswith("[1]"):
        return "kwargs" + keystr[3:]
    return keystr
