"""Paged attention in PyTorch: write K/V into slots, attend over block tables.

A step's flat batch holds the decode tokens first (one per sequence), then each
prefill (or prefill chunk) as a run of tokens. Decodes come in groups of similar
context length (so that padding to the longest wastes little), each group attended
to in one batched call; each prefill attends over its new tokens plus the context
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
class DecodeGroup:
    """Decodes ``[start, start + num)`` of the flat batch, padded to a common context length.

    ``rows`` index the pool viewed as (token-head rows, head_dim) so that one ``index_select``
    yields keys (or values) as (num, num_kv_heads, ctx, head_dim); computed once per step and
    shared by every layer.
    """

    start: int
    num: int
    ctx: int
    rows: torch.Tensor  # (num * num_kv_heads * ctx,) int64
    mask: torch.Tensor  # (num, ctx) bool: True where a key may be attended
    # The rows again, once per query head (grouped-query heads share their KV head's rows), and
    # where each (sequence, query head) bag of ``ctx`` rows starts: for the embedding_bag below.
    value_rows: torch.Tensor  # (num * num_heads * ctx,) int64
    offsets: torch.Tensor  # (num * num_heads,) int64


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (num_tokens,) int64: where each new token's K/V goes
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillSpan] = field(default_factory=list)
    sliding_window: Optional[int] = None


def gather_rows(tables: torch.Tensor, block_size: int, num_kv_heads: int) -> torch.Tensor:
    """Row ids, in (seq, head, token) order, of the pool viewed as (blocks * block_size * heads, head_dim).

    ``tables``: (num_seqs, max_blocks) block ids. Selecting these rows writes K/V head-major,
    the layout the attention matmuls want, with no second copy to transpose it.
    """
    n = tables.shape[0]
    dev = tables.device
    token = (tables.unsqueeze(-1) * block_size + torch.arange(block_size, device=dev)).view(n, 1, -1)
    return (token * num_kv_heads + torch.arange(num_kv_heads, device=dev).view(1, -1, 1)).view(-1)


def decode_group(start: int, tables: torch.Tensor, context_lens: torch.Tensor, block_size: int, num_kv_heads: int,
                 num_heads: int, sliding_window: Optional[int]) -> DecodeGroup:
    num, max_blocks = tables.shape
    ctx = max_blocks * block_size
    dev = tables.device
    key_pos = torch.arange(ctx, device=dev).unsqueeze(0)
    lens = context_lens.unsqueeze(1)
    mask = key_pos < lens
    if sliding_window is not None:
        mask &= key_pos > lens - 1 - sliding_window
    rows = gather_rows(tables, block_size, num_kv_heads)
    group = num_heads // num_kv_heads
    value_rows = rows.view(num, num_kv_heads, 1, ctx).expand(num, num_kv_heads, group, ctx).reshape(-1)
    offsets = torch.arange(0, num * num_heads * ctx, ctx, device=dev)
    return DecodeGroup(start, num, ctx, rows, mask, value_rows, offsets)


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store each token's K/V at its slot. k, v: (num_tokens, num_kv_heads, head_dim)."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` tokens of a sequence: (num_kv_heads, length, head_dim)."""
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    rows = gather_rows(block_table.view(1, -1), block_size, num_kv_heads)
    out = cache.view(-1, head_dim).index_select(0, rows)
    return out.view(num_kv_heads, -1, head_dim)[:, :length]


def decode_attention(
    q: torch.Tensor, keys: torch.Tensor, v_rows: torch.Tensor, g: DecodeGroup, scale: float
) -> torch.Tensor:
    """One query token per sequence over its padded context, grouped-query aware.

    q: (num, num_heads, head_dim); keys: (num, num_kv_heads, ctx, head_dim), gathered;
    v_rows: the value pool as (rows, head_dim). Returns (num, num_heads, head_dim).

    Scores are one batched matmul with a float32 softmax (as transformers' eager attention);
    the weighted sum of values is an ``embedding_bag``, which reads each value row straight
    from the pool: no gathered copy of V. On CPU both are several times faster than SDPA
    with a padding mask for one query per sequence.
    """
    n, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[1]
    group = num_heads // num_kv_heads
    qg = q.view(n, num_kv_heads, group, head_dim).to(keys.dtype)  # (n, kv_heads, group, head_dim)
    scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * scale  # (n, kv_heads, group, ctx)
    scores.masked_fill_(~g.mask[:, None, None, :], float("-inf"))
    probs = scores.softmax(dim=-1).to(v_rows.dtype)
    out = F.embedding_bag(g.value_rows, v_rows, g.offsets, mode="sum", per_sample_weights=probs.reshape(-1))
    return out.view(n, num_heads, head_dim)


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

    num_kv_heads, head_dim = k_cache.shape[2:]
    k_rows, v_rows = k_cache.view(-1, head_dim), v_cache.view(-1, head_dim)
    for g in meta.decode_groups:
        # One index_select (not advanced indexing, which copies element-wise): head-major keys.
        keys = k_rows.index_select(0, g.rows).view(g.num, num_kv_heads, g.ctx, head_dim)
        sl = slice(g.start, g.start + g.num)
        out[sl] = decode_attention(q[sl], keys, v_rows, g, scale).to(q.dtype)

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
