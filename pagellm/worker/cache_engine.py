"""The KV tensors: one K and one V pool per layer, indexed by block id."""

from __future__ import annotations

import torch

from pagellm.worker.cpu_tuning import zeros_on_huge_pages

# --kv-cache-dtype: vLLM's names; "fp8" is e4m3 (more precision, range to 448), as on vLLM's GPUs.
FP8_KV_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pools' dtype for ``--kv-cache-dtype``: the model's for ``auto``, else a float8 format."""
    if name == "auto":
        return model_dtype
    if name not in FP8_KV_DTYPES:
        raise ValueError(f"kv_cache_dtype (--kv-cache-dtype) must be auto, {', '.join(FP8_KV_DTYPES)}; got {name!r}")
    return FP8_KV_DTYPES[name]


def _as_bytes(pool: torch.Tensor) -> torch.Tensor:
    """A one-byte pool seen as uint8 (block copies have no float8 kernels; bytes are bytes)."""
    return pool.view(torch.uint8) if pool.element_size() == 1 and pool.is_floating_point() else pool


def kv_shapes(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[tuple[int, ...], ...]:
    """Shapes of one layer's (K, V) pools: per block and KV head, keys transposed (head_dim x block_size)
    and values token by token (block_size x head_dim); see pagellm/model/attention/__init__.py."""
    return (num_blocks, num_kv_heads, head_dim, block_size), (num_blocks, num_kv_heads, block_size, head_dim)


class CacheEngine:
    """Owns ``kv_caches[layer] = (k, v)``: k ``(num_blocks, num_kv_heads, head_dim, block_size)``,
    v ``(num_blocks, num_kv_heads, block_size, head_dim)``. Both are indexed by block id first, so
    copies and swaps move whole blocks."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        num_cpu_blocks: int = 0,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        k_shape, v_shape = kv_shapes(num_blocks, block_size, num_kv_heads, head_dim)
        # Zeroed, not empty: padded decode positions read unused slots, and NaN garbage
        # there would leak through the masked softmax (0 * NaN = NaN).
        # On CPU, on huge pages: attention reads the blocks of a pool in random order.
        if device.type == "cpu":
            def zeros(shape: tuple[int, ...]) -> torch.Tensor:
                return zeros_on_huge_pages(shape, dtype)
        else:
            def zeros(shape: tuple[int, ...]) -> torch.Tensor:
                return torch.zeros(shape, dtype=dtype, device=device)
        self.kv_caches = [(zeros(k_shape), zeros(v_shape)) for _ in range(num_layers)]
        # The swap pool in host memory. Left uninitialised: a block is only read after a swap-out
        # wrote it. Pinned on CUDA so that copies can overlap compute.
        pin = device.type == "cuda"
        k_cpu, v_cpu = kv_shapes(num_cpu_blocks, block_size, num_kv_heads, head_dim)
        self.cpu_caches = [
            (torch.empty(k_cpu, dtype=dtype, pin_memory=pin), torch.empty(v_cpu, dtype=dtype, pin_memory=pin))
            for _ in range(num_layers)
        ] if num_cpu_blocks else []

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block ``dst`` becomes a copy of block ``src`` in every layer's K and V."""
        if not pairs:
            return
        device = self.kv_caches[0][0].device
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=device)
        for k, v in self.kv_caches:
            k, v = _as_bytes(k), _as_bytes(v)
            k.index_copy_(0, dst, k.index_select(0, src))
            v.index_copy_(0, dst, v.index_select(0, src))

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to CPU blocks: pairs of (device id, CPU id)."""
        self._move(pairs, self.kv_caches, self.cpu_caches)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy CPU blocks back to device blocks: pairs of (CPU id, device id)."""
        self._move(pairs, self.cpu_caches, self.kv_caches)

    @staticmethod
    def _move(pairs: list[tuple[int, int]], src_caches: list, dst_caches: list) -> None:
        if not pairs:
            return
        src_dev, dst_dev = src_caches[0][0].device, dst_caches[0][0].device
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=src_dev)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=dst_dev)
        for (sk, sv), (dk, dv) in zip(src_caches, dst_caches):
            sk, sv, dk, dv = _as_bytes(sk), _as_bytes(sv), _as_bytes(dk), _as_bytes(dv)
            dk.index_copy_(0, dst, sk.index_select(0, src).to(dst_dev, non_blocking=True))
            dv.index_copy_(0, dst, sv.index_select(0, src).to(dst_dev, non_blocking=True))
