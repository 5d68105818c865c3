"""The KV tensors: one K and one V pool per layer, indexed by block id."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagellm.worker.cpu_tuning import empty_mapping, zeros_on_huge_pages

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
    copies and swaps move whole blocks.

    With KV cache groups (``layer_groups``: each layer's group; ``group_blocks``, ``group_cpu_blocks``:
    each group's pool sizes), a layer's pools have its group's number of blocks, block ids are the
    group's own, and every block move names its group. ``num_blocks`` stays what the memory settings
    gave in blocks of every layer (the groups' pools split that memory)."""

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
        layer_groups: Sequence[int] | None = None,
        group_blocks: Sequence[int] | None = None,
        group_cpu_blocks: Sequence[int] | None = None,
    ) -> None:
        self.num_blocks = num_blocks
        self.num_cpu_blocks = num_cpu_blocks  # (in blocks of every layer, as num_blocks)
        self.block_size = block_size
        groups = list(layer_groups) if layer_groups is not None else [0] * num_layers
        sizes = list(group_blocks) if group_blocks is not None else [num_blocks]
        cpu_sizes = list(group_cpu_blocks) if group_cpu_blocks is not None else [num_cpu_blocks]
        # Zeroed, not empty: padded decode positions read unused slots, and NaN garbage
        # there would leak through the masked softmax (0 * NaN = NaN).
        # On CPU, on huge pages (attention reads the blocks of a pool in random order), zeroed by the
        # kernel as each page is first touched: start-up touches none of the pool.
        if device.type == "cpu":
            def zeros(shape: tuple[int, ...]) -> torch.Tensor:
                return zeros_on_huge_pages(shape, dtype)
        else:
            def zeros(shape: tuple[int, ...]) -> torch.Tensor:
                return torch.zeros(shape, dtype=dtype, device=device)
        shapes = [kv_shapes(n, block_size, num_kv_heads, head_dim) for n in sizes]
        self.kv_caches = [(zeros(shapes[g][0]), zeros(shapes[g][1])) for g in groups]
        # The swap pool in host memory. Left uninitialised: a block is only read after a swap-out
        # wrote it. On CPU in fresh mappings, so that its pages are only taken when a swap-out first
        # writes them; pinned on CUDA so that copies can overlap compute.
        def swap_pool(shape: tuple[int, ...]) -> torch.Tensor:
            if device.type == "cuda":
                return torch.empty(shape, dtype=dtype, pin_memory=True)
            return empty_mapping(shape, dtype)

        cpu_shapes = [kv_shapes(n, block_size, num_kv_heads, head_dim) for n in cpu_sizes]
        self.cpu_caches = [(swap_pool(cpu_shapes[g][0]), swap_pool(cpu_shapes[g][1])) for g in groups] \
            if any(cpu_sizes) else []
        # Each group's layers' pools (with one group, the lists above themselves).
        if len(sizes) == 1:
            self.group_kv_caches, self.group_cpu_caches = [self.kv_caches], [self.cpu_caches]
        else:
            self.group_kv_caches = [[c for c, g in zip(self.kv_caches, groups) if g == i] for i in range(len(sizes))]
            self.group_cpu_caches = [[c for c, g in zip(self.cpu_caches, groups) if g == i]
                                     for i in range(len(sizes))]

    @property
    def num_groups(self) -> int:
        return len(self.group_kv_caches)

    def copy_blocks(self, pairs: list[tuple[int, int]], group: int = 0) -> None:
        """Copy-on-write: block ``dst`` becomes a copy of block ``src`` in every K and V pool of ``group``'s
        layers."""
        if not pairs:
            return
        caches = self.group_kv_caches[group]
        device = caches[0][0].device
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=device)
        for k, v in caches:
            k, v = _as_bytes(k), _as_bytes(v)
            k.index_copy_(0, dst, k.index_select(0, src))
            v.index_copy_(0, dst, v.index_select(0, src))

    def swap_out(self, pairs: list[tuple[int, int]], group: int = 0) -> None:
        """Copy device blocks to CPU blocks: pairs of (device id, CPU id)."""
        if pairs:
            self._move(pairs, self.group_kv_caches[group], self.group_cpu_caches[group])

    def swap_in(self, pairs: list[tuple[int, int]], group: int = 0) -> None:
        """Copy CPU blocks back to device blocks: pairs of (CPU id, device id)."""
        if pairs:
            self._move(pairs, self.group_cpu_caches[group], self.group_kv_caches[group])

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
