"""Process settings for CPU speed: the KV pools on transparent huge pages."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagellm.worker.cache_engine import CacheEngine
from pagellm.worker.cpu_tuning import zeros_on_huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _huge_kib_at(address: int) -> int:
    """AnonHugePages (KiB) of the mapping that holds ``address`` in this process."""
    current = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            current = lo <= address < hi
        elif current and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def test_zeros_on_huge_pages_is_a_zeroed_tensor():
    for shape in [(3, 5), (1024, 1024, 4)]:  # below and above the size where advice is given
        t = zeros_on_huge_pages(shape, torch.bfloat16)
        assert t.shape == shape and t.dtype == torch.bfloat16 and not t.any()


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages here")
def test_kv_pools_sit_on_huge_pages_once_written():
    engine = CacheEngine(num_layers=1, num_blocks=512, block_size=16, num_kv_heads=8, head_dim=64,
                         dtype=torch.bfloat16, device=torch.device("cpu"))  # 8 MiB per pool
    for pool in engine.kv_caches[0]:
        assert not pool.any()  # zeros before any block is written
        pool.fill_(1)  # pages are taken as blocks are written: huge ones
        assert _huge_kib_at(pool.data_ptr()) >= 4096  # at least two of its 2 MiB pages are huge
