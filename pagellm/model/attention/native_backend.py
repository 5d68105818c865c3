"""Paged attention on the native CPU kernels (``pagellm/kernels``), float32, bfloat16 or fp8 pools (fp8:
the kernels widen each element as they read it and round what they write; queries and outputs stay
in the model's dtype).

Decode reads each sequence's own blocks in one pass, with the CPU's bfloat16 dot products where it
has them (about three times as fast as the PyTorch backend's two ``embedding_bag`` calls): no
groups, no padding, no row ids. Decodes that share their first blocks (a cached prompt, forked
samples) read those once for the run (cascade) where the kernel does so: bfloat16 pools of
block_size 16 and head_dim 64 or 128 on the bfloat16 dot products, without a sliding window (the
shared blocks may lie before it). Prefill runs the native kernel where it was written for the shape
(block_size 16, head_dim 64 or 128), else PyTorch's flash kernel. With the native bfloat16 linears
the whole decode-only step can run in one call (``step_driver``: ``native_decode.py``). The
kernels have no attention logit soft-capping: models with it (Gemma2) take the PyTorch backend.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch

from pagellm.kernels import native
from pagellm.model.attention.backend import (
    META_WINDOW,
    AttentionBackend,
    AttentionConfig,
    KVCache,
    StepDriver,
    Window,
    resolve_window,
)
from pagellm.model.attention.metadata import AttentionMetadata, DecodeBatch, PrefillSpan, long_tensor, padded_tables
from pagellm.model.attention.native_decode import NativeDecoder
from pagellm.model.attention.torch_backend import sdpa_prefill


def native_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   span: PrefillSpan, window: int | None, scale: float, out: torch.Tensor) -> None:
    """One prefill on ``native.paged_prefill_attention`` (its K/V read from the pools)."""
    rows = out[span.q_start : span.q_start + span.q_len]  # written in place where the cache has the queries' dtype
    got = native.paged_prefill_attention(q[span.q_start : span.q_start + span.q_len], k_cache, v_cache,
                                         span.block_table, span.context_len - span.q_len, scale, window,
                                         out=rows if rows.dtype == native.compute_dtype(q, k_cache) else None)
    if got is not rows:
        rows.copy_(got)


def _key_pool_like(config: AttentionConfig) -> torch.Tensor:
    """An empty key pool of the configuration's dtype and per-block shape, for the kernels' shape checks."""
    return torch.empty((0, config.num_kv_heads, config.head_dim, config.block_size), dtype=config.dtype,
                       device=config.device)


class NativeAttentionBackend(AttentionBackend):
    name = "native"

    @classmethod
    def unsupported(cls, config: AttentionConfig) -> str | None:
        # (Device and dtype first: asking for the kernels compiles them.)
        if not native.supports(config.device, config.dtype):
            return (f"needs float32, bfloat16 or fp8 pools on the CPU and the native kernels (built on first use; "
                    f"PAGELLM_NATIVE_KERNELS=0 turns them off), got {config.dtype} on {config.device.type}")
        if config.logit_softcap is not None:
            return "the kernels have no attention logit soft-capping"
        return None

    def __init__(self, config: AttentionConfig) -> None:
        super().__init__(config)
        pool = _key_pool_like(config)
        self.native_prefill = native.prefill_supported(pool)
        self._prefill: Callable[..., None] = native_prefill if self.native_prefill else sdpa_prefill
        self.cascade = native.cascade_supported(pool) and not config.sliding_window

    def describe(self) -> str:
        prefill = "native" if self.native_prefill else "PyTorch scaled_dot_product_attention"
        return f"native CPU kernels (prefill: {prefill}; shared-prefix decode: {'on' if self.cascade else 'off'})"

    def prepare_decode(self, tables: list[list[int]], context_lens: list[int],
                       cascade: list[tuple[int, int, int]]) -> DecodeBatch:
        """Tables padded with block 0 (read only up to each length); ``cascade``: adjacent decodes
        sharing leading blocks, which attend those once."""
        c = self.config
        padded = padded_tables(tables, c.device)
        return DecodeBatch(padded, long_tensor(context_lens, c.device),
                           native.scratch_for(c.num_heads, c.head_dim, c.block_size, padded.shape[1]),
                           torch.tensor(cascade, dtype=torch.long) if cascade else None)

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        if not native.write_kv(k, v, k_cache, v_cache, meta.slot_mapping):
            raise ValueError(f"native write_kv does not take K/V {k.dtype} {tuple(k.shape)} (strides {k.stride()}) "
                             f"into {k_cache.dtype} pools {tuple(k_cache.shape)} / {tuple(v_cache.shape)} with "
                             f"{meta.slot_mapping.dtype} slots {tuple(meta.slot_mapping.shape)}")

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float, out: torch.Tensor, window: Window = META_WINDOW) -> None:
        d = cast(DecodeBatch, meta.decode)
        rows = out[: d.num]  # written in place where the cache has the queries' dtype
        # (With a window the kernel reads each sequence's own blocks, cascade runs or not: their shared
        # first blocks may lie before it.)
        got = native.paged_decode_attention(q[: d.num], k_cache, v_cache, d.tables, d.lens, d.scratch, scale,
                                            resolve_window(window, meta),
                                            out=rows if rows.dtype == native.compute_dtype(q, k_cache) else None,
                                            cascade=d.cascade)
        if got is not rows:
            rows.copy_(got)

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, span: PrefillSpan, window: int | None, scale: float,
                out: torch.Tensor) -> None:
        self._prefill(q, k, v, k_cache, v_cache, span, window, scale, out)

    def step_driver(self, model: Any, kv_caches: list[KVCache]) -> StepDriver | None:
        """Every layer of a decode-only step in one native call, where all its kernels are the native
        ones (bfloat16 weights packed for the native linears, bfloat16 pools)."""
        return NativeDecoder.create(model, kv_caches)
