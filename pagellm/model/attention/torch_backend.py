"""Paged attention in PyTorch: any device, any dtype, any shape.

Decodes come in groups of similar context length (so that padding to the longest wastes little),
each group attended to in one batched call that reads the pools in place through ``embedding_bag``.
Each prefill attends over its new tokens plus the context already cached for it through PyTorch's
flash kernel (``sdpa_prefill``, which the native backend also uses for shapes its kernel lacks), or,
with attention logit soft-capping (which that kernel cannot apply), through plain matmuls
(``eager_prefill``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import torch
import torch.nn.functional as F

from pagellm.model.attention.backend import META_WINDOW, AttentionBackend, AttentionConfig, Window, resolve_window
from pagellm.model.attention.metadata import AttentionMetadata, DecodeMetadata, PrefillSpan, long_tensor, padded_tables

# Below this block size, scoring keys in place costs more index memory than the keys themselves
# (head_dim / block_size row ids per key and head), so small blocks gather their keys instead.
BAG_MIN_BLOCK_SIZE = 8

# A decode group is cut where a sequence's blocks fall below this share of the group's longest:
# padding then wastes at most 1 - share of the gathered K/V.
GROUP_SHARE = 0.75

# Soft-capped prefill scores a run of this many queries at a time, so that its float32 scores
# (heads x queries x context) stay bounded for long prompts.
EAGER_QUERY_CHUNK = 256


@dataclass
class DecodeGroup:
    """Decodes ``[start, start + num)`` of the flat batch, padded to a common context length.

    The row ids are computed once per step and shared by every layer (all layers have the same
    block tables). Grouped-query heads share their KV head's rows.
    """

    start: int
    num: int
    ctx: int  # padded context: max_blocks * block_size
    hidden: torch.Tensor  # [num, ctx] bool: True where a key may NOT be attended (padding, ``window``)
    tables: torch.Tensor  # [num, max_blocks] int64 block ids, padded
    # Keys viewed as (num_blocks * num_kv_heads * head_dim, block_size) rows: one bag of head_dim
    # rows per (sequence, query head, block). None below BAG_MIN_BLOCK_SIZE (keys are gathered).
    key_rows: torch.Tensor | None  # [num * num_heads * max_blocks, head_dim] int64
    # Values viewed as (num_blocks * num_kv_heads * block_size, head_dim) rows, row (block, kv_head, t):
    # one bag of ctx rows per (sequence, query head).
    value_rows: torch.Tensor  # [num * num_heads, ctx] int64
    lens: torch.Tensor | None = None  # [num] int64 context lengths (for other windows' masks)
    window: int | None = None  # the window ``hidden`` hides keys before
    # Masks for the other windows layers ask for (Gemma: full-attention layers among sliding ones),
    # built on first use and shared by every layer of the step.
    other_hidden: dict[int | None, torch.Tensor] = field(default_factory=dict)

    def hidden_for(self, window: int | None) -> torch.Tensor:
        """[num, ctx] bool: True where a key may NOT be attended under ``window`` (None: full)."""
        if window == self.window:
            return self.hidden
        if window not in self.other_hidden:
            assert self.lens is not None, "decode_group sets the lengths"
            self.other_hidden[window] = hidden_keys(self.ctx, self.lens, window)
        return self.other_hidden[window]


@dataclass
class DecodeGroups(DecodeMetadata):
    """The step's decodes as groups of similar context length, in batch order."""

    groups: list[DecodeGroup]

    @property
    def num(self) -> int:
        return sum(g.num for g in self.groups)


def decode_group(start: int, tables: torch.Tensor, context_lens: torch.Tensor, block_size: int, num_kv_heads: int,
                 head_dim: int, num_heads: int, sliding_window: int | None) -> DecodeGroup:
    """``tables``: [num, max_blocks] block ids, padded with any valid id; ``context_lens``: [num]."""
    num, max_blocks = tables.shape
    ctx = max_blocks * block_size
    dev = tables.device
    # The KV head each query head reads.
    kv_head = torch.arange(num_heads, device=dev) // (num_heads // num_kv_heads)  # [num_heads]
    blocks, heads = tables.view(num, 1, max_blocks, 1), kv_head.view(1, num_heads, 1, 1)
    key_rows = None
    if block_size >= BAG_MIN_BLOCK_SIZE:
        key_rows = ((blocks * num_kv_heads + heads) * head_dim + torch.arange(head_dim, device=dev)).view(-1, head_dim)
    # Row (block, kv_head, t) of the value pool seen as (-1, head_dim).
    value_rows = (blocks * num_kv_heads + heads) * block_size + torch.arange(block_size, device=dev)
    return DecodeGroup(start, num, ctx, hidden_keys(ctx, context_lens, sliding_window), tables, key_rows,
                       value_rows.reshape(-1, ctx), context_lens, sliding_window)


def hidden_keys(ctx: int, context_lens: torch.Tensor, window: int | None) -> torch.Tensor:
    """[num, ctx] bool: True at the padded positions a decode may NOT attend (past its length, or
    before its last ``window`` tokens); ``context_lens``: [num]."""
    key_pos = torch.arange(ctx, device=context_lens.device).unsqueeze(0)
    lens = context_lens.unsqueeze(1)
    mask = key_pos < lens
    if window is not None:
        mask &= key_pos > lens - 1 - window
    return ~mask


def soft_cap(scores: torch.Tensor, cap: float | None) -> torch.Tensor:
    """tanh(scores / cap) * cap (logit soft-capping, in ``scores``' dtype); unchanged where ``cap``
    is None."""
    return scores if cap is None else torch.tanh(scores / cap) * cap


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: DecodeGroup, scale: float,
    hidden: torch.Tensor | None = None, softcap: float | None = None,
) -> torch.Tensor:
    """One query token per sequence over its padded context but the keys ``hidden`` hides (by default
    ``g.hidden``), grouped-query aware, scores soft-capped at ``softcap`` where it is set.

    q: [num, num_heads, head_dim]; returns [num, num_heads, head_dim]. Both sums read the pools in
    place (``embedding_bag`` gathers and reduces in one pass); scores are softmaxed in float32, as in
    transformers' eager attention. On CPU this is several times faster than gathering K/V for a
    batched matmul or SDPA with a padding mask.
    """
    n, num_heads, head_dim = q.shape
    _, num_kv_heads, _, block_size = k_cache.shape
    max_blocks = g.ctx // block_size
    if is_fp8(k_cache):
        return fp8_decode_attention(q, k_cache, v_cache, g, scale, hidden, softcap)
    if g.key_rows is not None:
        # Scores of one block = sum over d of q[d] * (row d of the block's transposed keys).
        weights = (q * scale).to(k_cache.dtype).unsqueeze(2).expand(n, num_heads, max_blocks, head_dim)
        scores = F.embedding_bag(g.key_rows, k_cache.view(-1, block_size), mode="sum",
                                 per_sample_weights=weights.reshape(-1, head_dim))
    else:
        # Small blocks: gather them whole, then one batched matmul per (sequence, KV head).
        keys = k_cache.index_select(0, g.tables.view(-1)).view(n, max_blocks, num_kv_heads, head_dim, block_size)
        keys = keys.permute(0, 2, 3, 1, 4).reshape(n, num_kv_heads, head_dim, g.ctx)
        qg = (q * scale).to(k_cache.dtype).view(n, num_kv_heads, num_heads // num_kv_heads, head_dim)
        scores = torch.matmul(qg, keys)  # [n, kv_heads, group, ctx]: query heads in order
    scores = soft_cap(scores.view(n, num_heads, g.ctx).float(), softcap)
    scores.masked_fill_((g.hidden if hidden is None else hidden).unsqueeze(1), float("-inf"))
    probs = scores.softmax(dim=-1).to(v_cache.dtype)
    out = F.embedding_bag(g.value_rows, v_cache.view(-1, head_dim), mode="sum",
                          per_sample_weights=probs.view(-1, g.ctx))
    return out.view(n, num_heads, head_dim)


def is_fp8(cache: torch.Tensor) -> bool:
    """Whether a pool holds one-byte floats (``--kv-cache-dtype fp8``): read by converting what is gathered."""
    return cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def to_fp8(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in an fp8 format, saturated at its largest finite value (a plain cast of e5m2 overflows to inf)."""
    limit = torch.finfo(dtype).max
    return x.clamp(-limit, limit).to(dtype)


def fp8_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: DecodeGroup, scale: float,
                         hidden: torch.Tensor | None, softcap: float | None) -> torch.Tensor:
    """``decode_attention`` over fp8 pools: each decode's blocks gathered (one byte per element read)
    and converted to the query's dtype, then two batched matmuls per (sequence, KV head)."""
    n, num_heads, head_dim = q.shape
    _, num_kv_heads, _, block_size = k_cache.shape
    max_blocks, group = g.ctx // block_size, num_heads // num_kv_heads
    blocks = g.tables.view(-1)
    keys = k_cache.index_select(0, blocks).to(q.dtype).view(n, max_blocks, num_kv_heads, head_dim, block_size)
    keys = keys.permute(0, 2, 3, 1, 4).reshape(n, num_kv_heads, head_dim, g.ctx)
    scores = torch.matmul((q * scale).view(n, num_kv_heads, group, head_dim), keys)  # [n, kv_heads, group, ctx]
    scores = soft_cap(scores.view(n, num_heads, g.ctx).float(), softcap)
    scores.masked_fill_((g.hidden if hidden is None else hidden).unsqueeze(1), float("-inf"))
    probs = scores.softmax(dim=-1).to(q.dtype).view(n, num_kv_heads, group, g.ctx)
    values = v_cache.index_select(0, blocks).to(q.dtype).view(n, max_blocks, num_kv_heads, block_size, head_dim)
    values = values.transpose(1, 2).reshape(n, num_kv_heads, g.ctx, head_dim)
    return torch.matmul(probs, values).view(n, num_heads, head_dim)


def _gather_keys(k_cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` keys of a sequence: [num_kv_heads, length, head_dim]."""
    num_blocks, num_kv_heads, head_dim, block_size = k_cache.shape
    blocks = k_cache.index_select(0, block_table)  # [blocks, kv_heads, head_dim, block_size]
    return blocks.permute(1, 0, 3, 2).reshape(num_kv_heads, -1, head_dim)[:, :length]


def _gather_values(v_cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` values of a sequence: [num_kv_heads, length, head_dim]."""
    num_blocks, num_kv_heads, block_size, head_dim = v_cache.shape
    blocks = v_cache.index_select(0, block_table)  # [blocks, kv_heads, block_size, head_dim]
    return blocks.transpose(0, 1).reshape(num_kv_heads, -1, head_dim)[:, :length]


def _prefill_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                span: PrefillSpan) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values a prefill attends over, [num_kv_heads, context_len, head_dim] each."""
    if span.context_len == span.q_len and k_cache.dtype == k.dtype:
        sl = slice(span.q_start, span.q_start + span.q_len)
        return k[sl].transpose(0, 1), v[sl].transpose(0, 1)  # fresh K/V: no gather
    keys = _gather_keys(k_cache, span.block_table, span.context_len)
    values = _gather_values(v_cache, span.block_table, span.context_len)
    if is_fp8(k_cache):  # (fresh K/V too: read back as stored, as later steps will read them)
        keys, values = keys.to(k.dtype), values.to(v.dtype)
    return keys, values


def _prefill_mask(q_first: int, q_end: int, ctx: int, window: int | None, device: torch.device) -> torch.Tensor:
    """[q_end - q_first, ctx] bool: True where the query at each position of ``[q_first, q_end)`` may
    attend the key at each position of ``[0, ctx)`` (causal, within ``window`` where set)."""
    q_pos = torch.arange(q_first, q_end, device=device).unsqueeze(1)
    k_pos = torch.arange(ctx, device=device).unsqueeze(0)
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask


def sdpa_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 span: PrefillSpan, window: int | None, scale: float, out: torch.Tensor) -> None:
    """One prefill through PyTorch's ``scaled_dot_product_attention`` (``AttentionBackend.prefill``)."""
    sl = slice(span.q_start, span.q_start + span.q_len)
    cached = span.context_len - span.q_len
    gqa = q.shape[1] != k.shape[1]
    keys, values = _prefill_kv(k, v, k_cache, v_cache, span)
    # 4-D (batch of one): PyTorch's CPU flash-attention kernel only takes 4-D inputs; 3-D ones
    # fall back to the unfused math path, twice as slow.
    query = q[sl].transpose(0, 1).to(keys.dtype).unsqueeze(0)  # [1, num_heads, q_len, head_dim]
    keys, values = keys.unsqueeze(0), values.unsqueeze(0)
    if cached == 0 and window is None:
        o = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        mask = _prefill_mask(cached, span.context_len, span.context_len, window, q.device)
        o = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa)
    out[sl] = o[0].transpose(0, 1).to(q.dtype)


def eager_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  span: PrefillSpan, window: int | None, scale: float, out: torch.Tensor,
                  softcap: float | None) -> None:
    """One prefill through matmuls and a float32 softmax (transformers' eager attention), the scores
    soft-capped at ``softcap``: ``scaled_dot_product_attention`` has no soft-capping."""
    cached = span.context_len - span.q_len
    keys, values = _prefill_kv(k, v, k_cache, v_cache, span)  # [kv_heads, ctx, head_dim]
    kv_heads, ctx, head_dim = keys.shape
    group = q.shape[1] // kv_heads  # query heads per KV head, adjacent
    keys_t = keys.transpose(1, 2).unsqueeze(1)  # [kv_heads, 1, head_dim, ctx]
    for first in range(0, span.q_len, EAGER_QUERY_CHUNK):
        n = min(EAGER_QUERY_CHUNK, span.q_len - first)
        rows = slice(span.q_start + first, span.q_start + first + n)
        query = q[rows].to(keys.dtype).view(n, kv_heads, group, head_dim).permute(1, 2, 0, 3)
        scores = torch.matmul(query, keys_t).float() * scale  # [kv_heads, group, n, ctx]
        scores = soft_cap(scores, softcap)
        allowed = _prefill_mask(cached + first, cached + first + n, ctx, window, q.device)
        scores.masked_fill_(~allowed, float("-inf"))
        probs = scores.softmax(dim=-1).to(values.dtype)
        o = torch.matmul(probs, values.unsqueeze(1))  # [kv_heads, group, n, head_dim]
        out[rows] = o.permute(2, 0, 1, 3).reshape(n, kv_heads * group, head_dim).to(q.dtype)


def torch_write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   meta: AttentionMetadata) -> None:
    """``AttentionBackend.write_kv`` with ``index_put_``."""
    # Both pools seen token-major, (num_blocks, block_size, kv_heads, head_dim): views.
    if is_fp8(k_cache):
        k, v = to_fp8(k, k_cache.dtype), to_fp8(v, v_cache.dtype)
    v_cache.transpose(1, 2).index_put_((meta.slot_blocks, meta.slot_offsets), v.to(v_cache.dtype))
    k_cache.permute(0, 3, 1, 2).index_put_((meta.slot_blocks, meta.slot_offsets), k.to(k_cache.dtype))


class TorchAttentionBackend(AttentionBackend):
    """PyTorch ops only: the backend of every configuration no other backend takes."""

    name = "torch"

    @classmethod
    def unsupported(cls, config: AttentionConfig) -> str | None:
        return None

    def describe(self) -> str:
        prefill = "matmul prefill (soft-capped scores)" if self.config.logit_softcap else \
            "scaled_dot_product_attention prefill"
        decode = "fp8 blocks gathered and converted" if self.config.dtype.itemsize == 1 else "embedding_bag"
        return f"PyTorch ({decode} decode in length groups, {prefill})"

    def prepare_decode(self, tables: list[list[int]], context_lens: list[int],
                       cascade: list[tuple[int, int, int]]) -> DecodeGroups:
        """Split the decodes (sorted longest first) into groups of similar length, each padded to its
        longest. (No cascade: each decode reads its own blocks.)"""
        c = self.config
        groups = []
        start = 0
        while start < len(tables):
            width = len(tables[start])
            end = start + 1
            while end < len(tables) and len(tables[end]) >= GROUP_SHARE * width:
                end += 1
            groups.append(decode_group(start, padded_tables(tables[start:end], c.device),
                                       long_tensor(context_lens[start:end], c.device), c.block_size,
                                       c.num_kv_heads, c.head_dim, c.num_heads, c.sliding_window))
            start = end
        return DecodeGroups(groups)

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        torch_write_kv(k, v, k_cache, v_cache, meta)

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float, out: torch.Tensor, window: Window = META_WINDOW) -> None:
        tokens = resolve_window(window, meta)
        for g in cast(DecodeGroups, meta.decode).groups:
            sl = slice(g.start, g.start + g.num)
            out[sl] = decode_attention(q[sl], k_cache, v_cache, g, scale, g.hidden_for(tokens),
                                       self.config.logit_softcap).to(q.dtype)

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, span: PrefillSpan, window: int | None, scale: float,
                out: torch.Tensor) -> None:
        if self.config.logit_softcap is None:
            sdpa_prefill(q, k, v, k_cache, v_cache, span, window, scale, out)
        else:
            eager_prefill(q, k, v, k_cache, v_cache, span, window, scale, out, self.config.logit_softcap)
