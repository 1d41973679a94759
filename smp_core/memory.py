"""Keep freed memory in the process for reuse: a CPU allocator setting that speeds up long runs.

Every SMP step allocates and frees the same few megabytes of activations and patches (about 25 MB
per LeNet-5 step with S = 100). With glibc's default, adaptive thresholds, whether the freed top
of the heap is returned to the operating system after a step depends on the order of earlier
frees; when it is, the next step faults every page back in, and one step of LeNet-5 takes about
1.3 to 1.5 times as long (``benchmarks/bench_recursion.py`` prints both). :func:`retain_freed_memory`
fixes the two thresholds with ``mallopt``: blocks up to 32 MB come from the heap, and up to 256 MB
of freed heap stays mapped for the next step. The process keeps its peak memory instead of
handing it back between steps; nothing else changes.

It is an explicit opt-in: nothing in ``smp_core`` calls it (importing or running the library
changes no process-wide setting); the book's LeNet-5 runs do. ``SMP_RETAIN_FREED_MEMORY=0`` turns
the call into a no-op. On systems without glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import os

_M_TRIM_THRESHOLD = -1  # glibc <malloc.h>
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's largest allowed value on 64-bit systems
TRIM_THRESHOLD = 256 * 1024 * 1024

_applied: bool | None = None


def retain_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds once per process; ``True`` when they are in force.

    Both are set together: fixing either one turns off glibc's adaptive adjustment of the other.
    """
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if os.environ.get("SMP_RETAIN_FREED_MEMORY", "1") == "0":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (macOS, Windows, musl)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _applied = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _applied
