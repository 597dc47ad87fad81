"""Host (CPU) memory reuse: freed tensor memory stays in the process for the next step.

glibc's malloc serves large blocks (above a threshold that adapts up to 32 MiB) with fresh
mmap'd pages and returns freed heap tops to the OS, so a CPU training step that frees and
reallocates the same activations pays a page fault per 4 KiB page every step (measured on the
CPU benchmark: ~56,000 faults and ~0.25 s of a 3.4 s step). ``keep_freed_memory`` pins the
threshold at its maximum and stops trimming, as a caching allocator (the CUDA one, or
tcmalloc/jemalloc preloaded) would: the process keeps its peak heap, and steps after the first
fault almost no pages. A no-op where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's cap on 64-bit (4 * 1024 * 1024 * sizeof(long))
_TOP_PAD = 256 << 20


@functools.cache
def keep_freed_memory() -> bool:
    """Set glibc malloc to reuse freed memory in-process (once per process); True if applied."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)
    ok &= mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)
    ok &= mallopt(_M_TOP_PAD, _TOP_PAD)
    return bool(ok)
