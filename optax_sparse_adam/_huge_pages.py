"""Tables on 2 MiB pages: :func:`advise_huge_pages`.

A sparse step reads and writes rows scattered over tables of hundreds of
megabytes. On 4 KiB pages nearly every row it touches is a miss in the CPU's
address-translation cache (the TLB covers a few megabytes), and the page
walk that follows reads the page tables from memory too: a second trip to
memory for each row. On 2 MiB pages the same TLB covers gigabytes. Linux
backs private memory with such pages (transparent huge pages) where the
program asks for them (``madvise``), or for all memory where the system is
set so; XLA:CPU does not ask, and most distributions are set to ``madvise``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import pathlib
import sys
from typing import Any

import jax

__all__ = ["HugePages", "advise_huge_pages"]

_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25  # Linux 6.1 and later: collapse now, rather than leave it to khugepaged
_THP = pathlib.Path("/sys/kernel/mm/transparent_hugepage")
MIN_BYTES = 2**25  # smaller buffers span too few huge pages to matter: the TLB's 4 KiB entries cover megabytes


@dataclasses.dataclass(frozen=True)
class HugePages:
    """What :func:`advise_huge_pages` did.

    Attributes:
      mode: The system's transparent huge page setting (``"always"``, ``"madvise"`` or ``"never"``), or ``""``
        where there is none (not Linux, or a kernel without them).
      leaves: ``(path, bytes, huge_bytes)`` of each array buffer advised: its size, and how much of it lies on huge
        pages afterwards.
      page_bytes: The huge page size (2 MiB on x86-64), or 0 where there are none.
    """

    mode: str
    leaves: tuple[tuple[str, int, int], ...]
    page_bytes: int = 0

    @property
    def bytes(self) -> int:
        """The bytes of the buffers advised."""
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

    For each array of at least ``min_bytes`` (its buffer on each CPU device it
    is on), asks the kernel to back the buffer with transparent huge pages
    (``madvise(MADV_HUGEPAGE)``) and to move it onto them now
    (``MADV_COLLAPSE``, Linux 6.1 and later; older kernels move it in the
    background, over minutes). The values do not change. A sparse step on a
    table of 10**6 rows then finds its rows without a page walk each (see
    "Tables on 4 KiB pages" in docs/which_path.md for what it gains, measured).

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
      >>> import jax.numpy as jnp
      >>> import optax_sparse_adam as osa
      >>> table = jnp.zeros((10**6, 64), jnp.float32)
      >>> report = osa.advise_huge_pages({"table": table})
      >>> report.bytes
      256000000
    """
    mode = transparent_huge_pages()
    page = page_bytes() if mode else 0
    buffers = [
        ((jax.tree_util.keystr(path) + " " + where).strip(), start, size)
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
        if isinstance(leaf, jax.Array) and leaf.nbytes >= min_bytes
        for where, start, size in cpu_buffers(leaf)
    ]
    if mode in ("", "never") or page == 0:
        return HugePages(mode, tuple((name, size, 0) for name, _, size in buffers), page)
    huge = advise_spans([(start, size) for _, start, size in buffers], page)
    return HugePages(mode, tuple((name, size, h) for (name, _, size), h in zip(buffers, huge, strict=True)), page)


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


def advise_spans(spans: list[tuple[int, int]], page: int) -> list[int]:
    """:func:`advise_huge_pages` of memory given as ``(address, bytes)`` (a PyTorch tensor's ``data_ptr()`` and
    size, for the benchmarks): each span's whole huge pages advised and collapsed; the bytes of each on huge pages
    afterwards."""
    madvise = _madvise()
    for start, size in spans:
        lo, hi = -(-start // page) * page, (start + size) // page * page
        if madvise is not None and hi > lo:
            madvise(lo, hi - lo, _MADV_HUGEPAGE)
            for at in range(lo, hi, page):  # one page at a time: a page that fails leaves the others to go on
                madvise(at, page, _MADV_COLLAPSE)
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


def page_bytes() -> int:
    try:
        return int((_THP / "hpage_pmd_size").read_text())
    except (OSError, ValueError):
        return 2**21


def _madvise() -> Any:
    """The C library's ``madvise``, or ``None``."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes, madvise.restype = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int
    return madvise


def huge_bytes(spans: list[tuple[int, int]]) -> list[int]:
    """For each ``(start, size)``, the bytes of huge pages (``AnonHugePages``) of the mappings it overlaps, counted
    up to the overlap: ``/proc/self/smaps`` says how much of each mapping lies on huge pages, not where."""
    out = [0] * len(spans)
    try:
        lines = pathlib.Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return out
    begin = end = 0
    for line in lines:
        head = line.split(None, 1)[0] if line else ""
        if "-" in head and ":" not in head:
            begin, end = (int(x, 16) for x in head.split("-"))
        elif head == "AnonHugePages:":
            huge = int(line.split()[1]) * 1024
            for i, (start, size) in enumerate(spans):
                overlap = min(end, start + size) - max(begin, start)
                if huge and overlap > 0:
                    out[i] += min(huge, overlap)
    return out
