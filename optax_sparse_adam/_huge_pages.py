"""Tables on 2 MiB pages: :func:`advise_huge_pages`.

A sparse step reads and writes rows scattered over tables of hundreds of
megabytes. On 4 KiB pages nearly every row it touches is a miss in the CPU's
address-translation cache (the TLB covers a few megabytes), and the page
walk that follows reads the page tables from memory too: a second trip to
memory for each row. On 2 MiB pages the same TLB covers gigabytes. Linux
backs private memory with such pages (transparent huge pages) where the
program asks for them (``madvise``), or for all memory where the system is
set so; XLA:CPU does not ask, and many systems are set to ``madvise`` (the
benchmarks' machine is).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import errno
import functools
import pathlib
import sys
from typing import Any

import jax

__all__ = [
    "MIN_BYTES",
    "HugePages",
    "advise_huge_pages",
    "advise_spans",
    "cpu_buffers",
    "huge_bytes",
    "offered",
    "page_bytes",
    "transparent_huge_pages",
]

_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25  # Linux 6.1 and later: collapse now, rather than leave it to khugepaged
_TRIES = 3
_THP = pathlib.Path("/sys/kernel/mm/transparent_hugepage")
MIN_BYTES = 2**25  # smaller buffers span too few huge pages to matter: the TLB's 4 KiB entries cover megabytes


@dataclasses.dataclass(frozen=True)
class HugePages:
    """What :func:`advise_huge_pages` did.

    Attributes:
      mode: The system's transparent huge page setting (``"always"``, ``"madvise"`` or ``"never"``), or ``""``
        where there is none (not Linux, or a kernel without them).
      leaves: ``(path, bytes, huge_bytes)`` of each CPU buffer of ``min_bytes`` or more in the tree (advised where the
        system has huge pages on; each buffer once): its size, and how much of it lies on huge pages afterwards.
      page_bytes: The huge page size (2 MiB on x86-64), or 0 where there are none.
    """

    mode: str
    leaves: tuple[tuple[str, int, int], ...]
    page_bytes: int = 0

    @property
    def bytes(self) -> int:
        """The bytes of the buffers listed."""
        return sum(n for _, n, _ in self.leaves)

    @property
    def huge_bytes(self) -> int:
        """The bytes of them on huge pages."""
        return sum(h for _, _, h in self.leaves)

    def __str__(self) -> str:
        if not self.mode:
            return "no transparent huge pages here (Linux only): nothing advised"
        if self.mode == "never":
            return "transparent huge pages are off (/sys/kernel/mm/transparent_hugepage/enabled: never)"
        lines = [f"{_mib(self.huge_bytes)} of {_mib(self.bytes)} on {_mib(self.page_bytes)} pages"]
        lines += [f"  {path}: {_mib(huge)} of {_mib(n)}" for path, n, huge in self.leaves]
        return "\n".join(lines)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def advise_huge_pages(tree: Any, *, min_bytes: int = MIN_BYTES) -> HugePages:
    """Puts the CPU buffers of ``tree``'s large arrays on 2 MiB pages, where Linux allows it.

    For each buffer of ``min_bytes`` or more of the tree's arrays (an array's
    buffer on each CPU device it is on), asks the kernel to back the buffer
    with transparent huge pages (``madvise(MADV_HUGEPAGE)``) and to move it
    onto them now (``MADV_COLLAPSE``, Linux 6.1 and later; older kernels move
    it in the background at khugepaged's pace, by default some 1.6 MiB a
    second: minutes for a table of hundreds of megabytes). The values do not
    change. A sparse step on a table of 10**6 rows then finds its rows
    without a page walk each (see "Tables on 4 KiB pages" in
    docs/which_path.md for what it gains, measured).

    Call it on the tables and the optimizer state once they are made (or
    restored), before training. The advice stays with the buffer: a jitted
    step that donates them updates them in place, in the same buffers, step
    after step; a step that does not donate them writes new buffers, which
    it does not reach (and costs a table copy a step anyway:
    :func:`step_report`). The process can instead ask for huge pages for all
    its large allocations at start-up, with the environment variable
    ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` (glibc 2.35 and later), set
    before Python starts. Arrays on other devices (GPUs, TPUs), and numbers
    that are not arrays, are left alone.

    Args:
      tree: A pytree of arrays (parameters, optimizer state, or both).
      min_bytes: The smallest buffer advised. Smaller ones span too few huge
        pages to matter.

    Returns:
      A :class:`HugePages`: the system's setting, and for each buffer advised,
      how much of it lies on huge pages afterwards (read from
      ``/proc/self/smaps``).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import optax_sparse_adam as osa
      >>> table = jax.device_put(jnp.zeros((10**6, 64), jnp.float32), jax.devices("cpu")[0])
      >>> report = osa.advise_huge_pages({"table": table})
      >>> report.bytes
      256000000
    """
    if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
        raise ValueError(f"advise_huge_pages: min_bytes must be a non-negative int, got {min_bytes!r}")
    mode = transparent_huge_pages()
    buffers: dict[int, tuple[str, int]] = {}  # by address: an array in the tree twice (tied weights) is one buffer
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if not isinstance(leaf, jax.Array):
            continue
        if isinstance(leaf, jax.core.Tracer):
            raise ValueError(
                f"advise_huge_pages: {jax.tree_util.keystr(path) or 'the array'} is traced: call it on the arrays "
                "themselves, outside jit (once, before the training loop)"
            )
        if leaf.is_deleted():
            raise ValueError(
                f"advise_huge_pages: {jax.tree_util.keystr(path) or 'the array'} was deleted (donated to a step?): "
                "pass the arrays the step returned"
            )
        for where, start, size in cpu_buffers(leaf):
            if size >= min_bytes:
                buffers.setdefault(start, ((jax.tree_util.keystr(path) + " " + where).strip(), size))
    spans = [(start, size) for start, (_, size) in buffers.items()]
    huge = advise_spans(spans)
    names = [name for name, _ in buffers.values()]
    leaves = tuple((name, size, h) for name, (_, size), h in zip(names, spans, huge, strict=True))
    return HugePages(mode, leaves, page_bytes() if mode else 0)


def cpu_buffers(x: jax.Array) -> list[tuple[str, int, int]]:
    """``(where, address, bytes)`` of each of ``x``'s buffers on this process's CPU devices, once the computations
    writing them are done (``where``: ``"on <device>"`` for an array on several devices, else ``""``)."""
    shards = x.addressable_shards
    out = []
    for shard in shards:
        if shard.device.platform == "cpu":
            buffer = shard.data.block_until_ready()
            where = f"on {shard.device}" if len(shards) > 1 else ""
            out.append((where, buffer.unsafe_buffer_pointer(), buffer.nbytes))
    return out


def advise_spans(spans: list[tuple[int, int]]) -> list[int]:
    """:func:`advise_huge_pages` of memory given as ``(address, bytes)`` (a PyTorch tensor's ``data_ptr()`` and
    size, for the benchmarks): where the system has huge pages on, each span's whole huge pages advised and
    collapsed; the bytes of each on huge pages afterwards (:func:`huge_bytes`)."""
    madvise = _madvise() if offered() else None
    page = page_bytes()
    for start, size in spans:
        lo, hi = -(-start // page) * page, (start + size) // page * page
        if madvise is not None and hi > lo:
            madvise(lo, hi - lo, _MADV_HUGEPAGE)
            for at in range(lo, hi, page):  # one page at a time: a page that fails leaves the others to go on
                for _ in range(_TRIES):  # EAGAIN: a transient failure (a page locked, or on its way to the LRU)
                    if madvise(at, page, _MADV_COLLAPSE) == 0 or ctypes.get_errno() != errno.EAGAIN:
                        break
    return huge_bytes(spans)


def transparent_huge_pages() -> str:
    """The system's transparent huge page setting: the bracketed word of ``enabled``, or ``""``."""
    if not sys.platform.startswith("linux"):
        return ""
    try:
        text = (_THP / "enabled").read_text()
    except OSError:
        return ""
    return text[text.find("[") + 1 : text.find("]")] if "[" in text else ""


def offered() -> bool:
    """Whether the system backs memory with huge pages, everywhere (``always``) or where asked (``madvise``)."""
    return transparent_huge_pages() in ("always", "madvise")


def page_bytes() -> int:
    """The huge page size (``hpage_pmd_size``): 2 MiB on x86-64, and where the system does not say."""
    try:
        return int((_THP / "hpage_pmd_size").read_text())
    except (OSError, ValueError):
        return 2**21


@functools.cache
def _madvise() -> Any:
    """The C library's ``madvise``, or ``None``."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes, madvise.restype = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int
    return madvise


def huge_bytes(spans: list[tuple[int, int]], smaps: str | None = None) -> list[int]:
    """For each ``(start, size)``, the bytes of huge pages (``AnonHugePages`` in ``/proc/self/smaps``, or in
    ``smaps``) of the mappings it overlaps. smaps says how much of a mapping lies on huge pages, not where: a
    mapping's huge pages go to the spans in it in address order, each up to its overlap with the mapping, so that
    no more are counted than there are (on ``madvise`` systems the advice splits the mappings at each span's
    whole pages, and each span's count is its own; on ``always`` systems adjacent buffers may share one)."""
    out = [0] * len(spans)
    if smaps is None:
        try:
            smaps = pathlib.Path("/proc/self/smaps").read_text()
        except OSError:
            return out
    order = sorted(range(len(spans)), key=lambda i: spans[i][0])
    begin = end = 0
    for line in smaps.splitlines():
        head = line.split(None, 1)[0] if line else ""
        if "-" in head and ":" not in head:
            begin, end = (int(x, 16) for x in head.split("-"))
        elif head == "AnonHugePages:":
            left = int(line.split()[1]) * 1024
            for i in order:
                start, size = spans[i]
                overlap = min(end, start + size) - max(begin, start)
                if left and overlap > 0:
                    out[i] += min(left, overlap)
                    left -= min(left, overlap)
    return out
