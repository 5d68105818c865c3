"""Process-wide settings that make PyTorch fast on CPU."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import mmap
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


_HUGE_PAGE = 2 << 20


def _fresh_mapping(shape: tuple[int, ...], dtype: torch.dtype, huge_pages: bool) -> torch.Tensor | None:
    """A tensor over a fresh anonymous mapping (Linux, at least two huge pages' worth), whose pages the
    kernel hands out zeroed on first touch; None where no such mapping can be had."""
    size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if not sys.platform.startswith("linux") or size < 2 * _HUGE_PAGE:
        return None
    try:
        memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
            memory.madvise(mmap.MADV_HUGEPAGE)
        return torch.frombuffer(memory, dtype=dtype).view(shape)  # the tensor keeps the mapping alive
    except (OSError, ValueError) as e:  # THP compiled out, mapping refused
        logger.debug("no fresh mapping for a %d-byte pool: %s", size, e)
        return None


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor in a fresh anonymous mapping that asks Linux for transparent huge pages.

    Decode attention reads the KV pools in 16 KiB blocks scattered over hundreds of MiB: with 4 KiB
    pages nearly every block costs TLB misses, with 2 MiB pages few do. A fresh mapping (not heap
    memory that may already sit on small pages) with ``MADV_HUGEPAGE`` gets huge pages as it is first
    written. The kernel hands out an anonymous mapping's pages zeroed on first touch, so the tensor is
    not written here: a pool costs no time and no resident memory at start-up, only as its blocks are
    first used (so the first requests take those page faults, and a pool larger than the machine's
    memory fails when it fills, not at start-up). Where no such mapping can be had (not Linux, small
    tensors) the tensor is the same, from ``torch.zeros``.
    """
    mapped = _fresh_mapping(shape, dtype, huge_pages=True)
    return mapped if mapped is not None else torch.zeros(shape, dtype=dtype)


def empty_mapping(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor whose pages are taken from the system only as they are written (a
    fresh anonymous mapping where it is large, else ``torch.empty``): a swap pool that is never used
    costs no memory."""
    mapped = _fresh_mapping(shape, dtype, huge_pages=False)
    return mapped if mapped is not None else torch.empty(shape, dtype=dtype)


def available_host_memory() -> int:
    """Bytes of host memory available to new allocations (Linux's MemAvailable; else the free pages)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
