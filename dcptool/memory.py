"""The process's allocator: keep freed blocks for reuse instead of handing them back to the OS (CLI runs)."""

from __future__ import annotations

import ctypes

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest allowed: blocks up to this size come from the heap and are reused
TRIM_THRESHOLD = 1 << 30  # free heap kept before it is trimmed


def keep_freed_memory() -> bool:
    """Make glibc keep freed blocks of up to 32 MB for reuse. True if set (glibc), False elsewhere.

    Replay's passes allocate and free many temporaries of 1-30 MB. By default glibc maps each of them
    afresh (its mmap threshold adapts only to blocks freed once, and only up to the trim) and unmaps it on
    free, so every pass pays a page fault per 4 KB on first touch: on a 2-core VM that doubled the CPU
    scan (0.25 s -> 0.13 s for 28.7M rows with this set; docs/performance.md). Process-wide, so only the
    command line (and the benchmarks that time it) call it, never the library on an engine's behalf."""
    try:  # (the process's own symbols, libc's among them: find_library would cost 30 ms of a CLI start)
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError, TypeError):  # no mallopt (macOS; Windows): the default allocator
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
