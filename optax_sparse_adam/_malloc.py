"""XLA:CPU's temporaries and the C library's allocator: :func:`tune_malloc`.

XLA:CPU allocates a compiled program's temporaries as one block each time
the program runs, and frees it when the run ends. glibc serves a block of
more than its mmap threshold (which it raises as such blocks are freed, but
never above 32 MiB on 64-bit systems) with a fresh ``mmap`` and returns it
with ``munmap``: every 4 KiB page of it then faults, and the kernel zeroes
it, on every run. A training step whose temporaries exceed 32 MiB (a DLRM
embedding step at width 64 builds about 40 MiB of batch-sized arrays) pays
that every step; :func:`tune_malloc` keeps the block in the heap.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import operator
import sys

__all__ = ["GLIBC_MMAP_LIMIT", "malloc_tuned", "tune_malloc"]

GLIBC_MMAP_LIMIT = 32 * 2**20  # glibc's dynamic mmap threshold never rises above this (64-bit)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8  # glibc's mallopt parameters (malloc.h)
_INT_MAX = 2**31 - 1
_tuned: int | None = None  # the mmap threshold tune_malloc set, if it did


def tune_malloc(threshold: int = 2**26) -> bool:
    """Keeps blocks of up to ``threshold`` bytes in glibc's heap, for reuse, rather than mapping each afresh.

    XLA:CPU allocates a compiled step's temporaries as one block on every
    call. glibc maps a block over its mmap threshold (never above 32 MiB by
    default) afresh and unmaps it when freed, so a step with more than 32 MiB
    of temporaries takes a page fault for every 4 KiB of them, on every call:
    10,000 faults and more than half of a DLRM embedding step at width 64 on
    the benchmarks' 2-core CPU (:func:`step_report` says when a step's
    temporaries are over the limit). This sets glibc's mmap threshold to
    ``threshold`` (64 MiB by default), its trim threshold to the largest it
    takes, and its number of arenas to one (``mallopt``), so that the block
    stays in the heap and is reused. It settles after a few calls: until
    the heap holds a free stretch that fits the block where a call asks for
    it, the call extends the heap and faults on the new pages (a program with
    one 55 MiB block of temporaries, called in a loop: 5 of its first 20
    calls faulted, none of the 40 after them, and the heap grew to about 8
    times the block before it settled).

    Call it first thing in a training script, before the first computation:
    XLA's threads then allocate from the one heap, which holds a block of any
    size. A thread that allocated before keeps its own heap, of 64 MiB, and a
    block too large for it is still mapped afresh.

    It is process-wide and lasts: from then on, a freed block under
    ``threshold`` stays with the process for the next allocation (up to
    ``threshold`` of free memory at the top of the heap, and whatever lies
    between blocks in use) rather than going back to the operating system,
    as it would under jemalloc or tcmalloc (which PyTorch and TensorFlow
    deployments often preload for the same reason); and the process's threads
    share one arena, so that many threads allocating small blocks at once
    wait on each other more. Blocks over ``threshold`` (tables and their
    moments, as a rule) are still mapped and unmapped. The process can so
    hold more memory at its peak: the DLRM benchmark at width 64, which keeps
    every contender's 1.4 GB tables alive at once (21 GB of the machine's 24
    without it), ran out of memory with a threshold of 256 MiB, which also
    kept its tables' 244 MiB initial parts in the heap. Raise ``threshold``
    only as far as a step's temporaries need (``StepReport.temp_bytes``).

    Args:
      threshold: The largest block kept in the heap, in bytes: from 32 MiB
        (below it, a fixed threshold is worse than glibc's own, which rises
        to 32 MiB as blocks are freed) to ``2**31 - 1``.

    Returns:
      ``True`` where glibc took the thresholds; ``False`` where the process's C
      library is not glibc (macOS, Windows, musl), which is left as it was.
    """
    global _tuned
    try:
        value = operator.index(threshold) if not isinstance(threshold, bool) else -1
    except TypeError:
        value = -1
    if not GLIBC_MMAP_LIMIT <= value <= _INT_MAX:
        # Below glibc's own limit a fixed threshold is worse than none: it stops glibc raising it as blocks are freed.
        raise ValueError(f"tune_malloc: threshold must be an int in [32 MiB, 2**31 - 1], got {threshold!r}")
    threshold = value
    mallopt = _glibc_mallopt()
    if mallopt is None:
        return False
    if not (mallopt(_M_MMAP_THRESHOLD, threshold) and mallopt(_M_TRIM_THRESHOLD, _INT_MAX)):
        return False
    mallopt(_M_ARENA_MAX, 1)
    _tuned = threshold
    return True


def malloc_tuned() -> int | None:
    """The mmap threshold :func:`tune_malloc` set in this process, or ``None`` if it has not."""
    return _tuned


def _glibc_mallopt() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """glibc's ``mallopt`` (``int mallopt(int, int)``), or ``None`` where the C library is another."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        if not hasattr(libc, "gnu_get_libc_version"):  # musl has a mallopt that does nothing
            return None
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt
