"""Paged attention in PyTorch: write K/V into slots, attend over block tables.

A step's flat batch holds the decode tokens first (one per sequence), then each
prefill (or prefill chunk) as a run of tokens. Decodes are attended to in one
padded, batched call; each prefill attends over its new tokens plus the context
already cached for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F


@dataclass
class PrefillSpan:
    """One sequence's run of new tokens ``[q_start, q_start + q_len)`` in the flat batch."""

    q_start: int
    q_len: int
    context_len: int  # tokens cached before this chunk + q_len
    block_table: torch.Tensor  # (num_blocks_of_seq,) int64


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (num_tokens,) int64: where each new token's K/V goes
    num_decode_tokens: int = 0
    decode_block_tables: Optional[torch.Tensor] = None  # (num_decodes, max_blocks) int64
    decode_context_lens: Optional[torch.Tensor] = None  # (num_decodes,) int64
    prefills: list[PrefillSpan] = field(default_factory=list)
    sliding_window: Optional[int] = None


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store each token's K/V at its slot. k, v: (num_tokens, num_kv_heads, head_dim)."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` tokens of a sequence: (num_kv_heads, length, head_dim)."""
    block_size, num_kv_heads, head_dim = cache.shape[1:]
    tokens = cache[block_table].reshape(-1, num_kv_heads, head_dim)[:length]
    return tokens.transpose(0, 1)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: (num_tokens, num_heads, head_dim); k, v: (num_tokens, num_kv_heads, head_dim).

    Returns (num_tokens, num_heads, head_dim).
    """
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    out = torch.empty_like(q)
    gqa = q.shape[1] != k.shape[1]
    window = meta.sliding_window

    nd = meta.num_decode_tokens
    if nd:
        assert meta.decode_block_tables is not None and meta.decode_context_lens is not None
        block_size, num_kv_heads, head_dim = k_cache.shape[1:]
        tables = meta.decode_block_tables
        max_len = tables.shape[1] * block_size
        # (num_decodes, num_kv_heads, max_len, head_dim)
        keys = k_cache[tables].reshape(nd, max_len, num_kv_heads, head_dim).transpose(1, 2)
        values = v_cache[tables].reshape(nd, max_len, num_kv_heads, head_dim).transpose(1, 2)
        key_pos = torch.arange(max_len, device=q.device)
        lens = meta.decode_context_lens.unsqueeze(1)
        mask = key_pos.unsqueeze(0) < lens  # (num_decodes, max_len)
        if window is not None:
            mask &= key_pos.unsqueeze(0) > lens - 1 - window
        o = F.scaled_dot_product_attention(
            q[:nd].unsqueeze(2).to(keys.dtype),  # (num_decodes, num_heads, 1, head_dim)
            keys,
            values,
            attn_mask=mask[:, None, None, :],
            scale=scale,
            enable_gqa=gqa,
        )
        out[:nd] = o.squeeze(2).to(q.dtype)

    for span in meta.prefills:
        sl = slice(span.q_start, span.q_start + span.q_len)
        cached = span.context_len - span.q_len
        if cached == 0 and k_cache.dtype == k.dtype:
            keys, values = k[sl].transpose(0, 1), v[sl].transpose(0, 1)  # fresh K/V: no gather
        else:
            keys = _gather(k_cache, span.block_table, span.context_len)
            values = _gather(v_cache, span.block_table, span.context_len)
        query = q[sl].transpose(0, 1).to(keys.dtype)  # (num_heads, q_len, head_dim)
        if cached == 0 and window is None:
            o = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            q_pos = torch.arange(cached, span.context_len, device=q.device).unsqueeze(1)
            k_pos = torch.arange(span.context_len, device=q.device).unsqueeze(0)
            mask = k_pos <= q_pos
            if window is not None:
                mask &= k_pos > q_pos - window
            o = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[sl] = o.transpose(0, 1).to(q.dtype)
    return out
