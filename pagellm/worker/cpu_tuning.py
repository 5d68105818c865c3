"""Process-wide settings that make PyTorch fast on CPU."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_done = False


def keep_freed_memory() -> bool:
    """Make glibc keep freed memory for reuse instead of returning it to the kernel.

    Every step allocates large temporaries (gathered K/V, activations). By default glibc
    serves each from a fresh mmap and unmaps it on free, so the next step page-faults
    (and zeroes) all of it again: that alone made decode attention several times slower.
    Raising the mmap and trim thresholds keeps the pages mapped, the way tcmalloc or
    jemalloc would. Returns whether the setting took effect (glibc on Linux only).
    """
    global _done
    if _done:
        return True
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 1 << 31))
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    _done = ok
    logger.debug("glibc malloc keeps freed memory: %s", ok)
    return ok
