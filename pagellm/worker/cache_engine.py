"""The KV tensors: one K and one V pool per layer, indexed by block id."""

from __future__ import annotations

import torch


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V of every layer for ``block_size`` tokens."""
    element = torch.tensor([], dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element


class CacheEngine:
    """Owns ``kv_caches[layer] = (k, v)``, each ``(num_blocks, block_size, num_kv_heads, head_dim)``."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # Zeroed, not empty: padded decode gathers read unused slots, and NaN garbage
        # there would leak through the masked softmax (0 * NaN = NaN).
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)
        ]
