"""Process-wide settings that make PyTorch fast on CPU."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

import torch

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


_MADV_HUGEPAGE = 14  # linux/mman.h
_HUGE_PAGE = 2 << 20


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor whose memory asks Linux for transparent huge pages (``MADV_HUGEPAGE``).

    Decode attention reads the KV pools in 16 KiB blocks scattered over hundreds of MiB: with 4 KiB
    pages nearly every block costs TLB misses, with 2 MiB pages few do (10-15% faster attention
    here). The advice is given before the memory is first touched, so the zeroing faults in huge
    pages; where it is refused (THP off, not Linux) the tensor is the same, on small pages.
    """
    t = torch.empty(shape, dtype=dtype)
    if sys.platform.startswith("linux") and t.numel() * t.element_size() >= 2 * _HUGE_PAGE:
        start = t.data_ptr()
        end = start + t.numel() * t.element_size()
        lo = -(-start // _HUGE_PAGE) * _HUGE_PAGE  # madvise wants page-aligned ranges: the whole 2 MiB pages inside
        hi = end // _HUGE_PAGE * _HUGE_PAGE
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            if libc.madvise(lo, hi - lo, _MADV_HUGEPAGE) != 0:
                logger.debug("madvise(MADV_HUGEPAGE) refused: errno %d", ctypes.get_errno())
        except (OSError, AttributeError):
            pass
    return t.zero_()
