"""Paged attention: write K/V into slots, attend over block tables (native CPU kernels, or PyTorch).

Cache layout (per layer): values ``[num_blocks, num_kv_heads, block_size, head_dim]``; keys are stored
transposed, ``[num_blocks, num_kv_heads, head_dim, block_size]`` (as vLLM's paged-attention kernels
store them). One (block, KV head)'s values, like its keys, are one contiguous run that attention reads
from start to end (with token-major values, all heads of a token side by side, decode read a head's
rows 128 bytes at a time across the block: 11-15% slower on W1's shapes). In the key layout one
(block, head) is a ``head_dim x block_size`` matrix, so a query's scores for the block are a weighted
sum of its ``head_dim`` rows with the query as weights: an ``embedding_bag`` that reads the keys
straight from the pool (the PyTorch path; the native kernel uses the same layout as 16-wide vector
rows). Values are likewise summed straight from the pool with
the attention probabilities as weights. Decode therefore never copies K or V.

A step's flat batch holds the decode tokens first (one per sequence), then each
prefill (or prefill chunk) as a run of tokens. On CPU, new tokens' K/V are written and decodes
attended by the native kernels (``pagellm/kernels/cpu_kernels.c``: one pass over each sequence's
own blocks, with the CPU's bfloat16 dot products where it has them; about three times as fast as
the two ``embedding_bag`` calls). Elsewhere, or where they cannot be built,
decodes come in groups of similar context length (so that padding to the longest wastes
little), each group attended to in one batched call. Each prefill attends over its new
tokens plus the context already cached for it: on CPU through the native prefill kernel where
it fits the shape (block_size 16, head_dim 64 or 128), else PyTorch's flash kernel.
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from pagellm.kernels import native


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

    The row ids are computed once per step and shared by every layer (all layers have the same
    block tables). Grouped-query heads share their KV head's rows.
    """

    start: int
    num: int
    ctx: int  # padded context: max_blocks * block_size
    hidden: torch.Tensor  # (num, ctx) bool: True where a key may NOT be attended (padding, window)
    tables: torch.Tensor  # (num, max_blocks) int64 block ids, padded
    # Keys viewed as (num_blocks * num_kv_heads * head_dim, block_size) rows: one bag of head_dim
    # rows per (sequence, query head, block). None below BAG_MIN_BLOCK_SIZE (keys are gathered).
    key_rows: Optional[torch.Tensor]  # (num * num_heads * max_blocks, head_dim) int64
    # Values viewed as (num_blocks * num_kv_heads * block_size, head_dim) rows, row (block, kv_head, t):
    # one bag of ctx rows per (sequence, query head).
    value_rows: torch.Tensor  # (num * num_heads, ctx) int64


@dataclass
class DecodeBatch:
    """Every decode of the step (``[0, num)`` of the flat batch) for the native CPU kernel, which reads
    each sequence's own blocks: no groups, no padding, no row ids."""

    tables: torch.Tensor  # (num, max_blocks) int64 block ids, padded with any valid id
    lens: torch.Tensor  # (num,) int64 context lengths
    scratch: torch.Tensor  # the kernel's working memory, shared by every layer
    # (runs, 3) int64 (begin, end, shared): runs of decodes whose first blocks are the same, read once
    # for the run (cascade attention, see native.paged_decode_attention); None: no such runs
    cascade: Optional[torch.Tensor] = None

    @property
    def num(self) -> int:
        return self.lens.shape[0]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (num_tokens,) int64: where each new token's K/V goes
    slot_blocks: torch.Tensor  # (num_tokens,) int64: slot_mapping // block_size
    slot_offsets: torch.Tensor  # (num_tokens,) int64: slot_mapping % block_size
    decode_groups: list[DecodeGroup] = field(default_factory=list)  # the PyTorch decode path
    native_decode: Optional[DecodeBatch] = None  # or the native kernel (CPU, float32/bfloat16)
    native_prefill: bool = False  # prefills on the native kernel (CPU, block_size 16, head_dim 64/128)
    prefills: list[PrefillSpan] = field(default_factory=list)
    sliding_window: Optional[int] = None
    # The rows whose final hidden states the step uses; None: every row (see OutputRows).
    output_rows: Optional[OutputRows] = None


@dataclass
class OutputRows:
    """The rows of a step's flat batch whose final hidden states are used (the sampled tokens, the
    prompt tokens scored for prompt logprobs), for the last layer. Its input norm and K/V projection
    run on every row, since every new token's K/V is stored; its attention, output projection and
    MLP only on these rows. Prompt tokens that are neither sampled nor scored (all but the last of a
    prompt, a whole chunk of a longer one) skip that work, about 9% of a prefill's matmuls on an
    8-layer model. With the native CPU kernels each kept row gets the same bits it gets in the full
    batch (each computes a row on its own); where attention is PyTorch's (other shapes, other
    devices) a cut chunk is attended with a mask instead of the causal kernel: the same values to
    rounding."""

    rows: list[int]  # the kept rows of the flat batch, ascending
    index: torch.Tensor  # the same, as an int64 tensor on the batch's device
    meta: AttentionMetadata  # the kept rows' own: decodes unchanged, each prefill cut to its kept suffix

    def positions(self, flat_rows: list[int]) -> list[int]:
        """Where each of ``flat_rows`` (kept rows, repeats allowed) lies among the kept rows."""
        at = {r: i for i, r in enumerate(self.rows)}
        return [at[r] for r in flat_rows]


def choose_output_rows(meta: AttentionMetadata, num_tokens: int, num_decodes: int,
                       needed: list[int]) -> Optional[OutputRows]:
    """The rows the last layer must compute so that ``needed`` (flat-batch rows, any order, repeats
    allowed) get their final hidden states: the ``num_decodes`` one-token rows, which the batch puts
    first (all kept: nearly all are sampled), and, of each prefill, the rows from its first needed
    one to its end (a suffix keeps the span a causal run of queries). None where that is every row."""
    wanted = sorted(set(needed))
    kept = list(range(num_decodes))
    spans = []
    for span in meta.prefills:
        end = span.q_start + span.q_len
        at = bisect.bisect_left(wanted, span.q_start)
        if at == len(wanted) or wanted[at] >= end:
            continue  # a chunk that samples nothing: only its K/V is needed
        first = wanted[at]
        spans.append(PrefillSpan(len(kept), end - first, span.context_len, span.block_table))
        kept.extend(range(first, end))
    if len(kept) == num_tokens:
        return None
    index = torch.tensor(kept, dtype=torch.long, device=meta.slot_mapping.device)
    # (The kept rows' K/V is already stored: their slots are kept only so that the metadata
    # describes its own rows.)
    own = dataclasses.replace(meta, slot_mapping=meta.slot_mapping[index], slot_blocks=meta.slot_blocks[index],
                              slot_offsets=meta.slot_offsets[index], prefills=spans, output_rows=None)
    return OutputRows(kept, index, own)


# Below this block size, scoring keys in place costs more index memory than the keys themselves
# (head_dim / block_size row ids per key and head), so small blocks gather their keys instead.
BAG_MIN_BLOCK_SIZE = 8


def cascade_runs(tables: list[list[int]]) -> list[tuple[int, int, int]]:
    """Runs of consecutive decodes whose block tables start with the same blocks (a cached prompt
    prefix, forked samples), as ``(begin, end, shared)``: decodes ``begin..end-1`` (two or more) hold
    the same first ``shared`` (>= 1) blocks. Decodes sharing a prefix must be adjacent (sorted by their
    first block) to be found."""
    runs = []
    begin = 0
    while begin < len(tables):
        end = begin + 1
        while end < len(tables) and tables[end][:1] == tables[begin][:1]:
            end += 1
        if end - begin >= 2:
            run = tables[begin:end]
            # The blocks every table of the run starts with: those its lexicographic least and
            # greatest share.
            low, high = min(run), max(run)
            shared = next((i for i, (a, b) in enumerate(zip(low, high)) if a != b), min(len(low), len(high)))
            if shared:
                runs.append((begin, end, shared))
        begin = end
    return runs


def decode_group(start: int, tables: torch.Tensor, context_lens: torch.Tensor, block_size: int, num_kv_heads: int,
                 head_dim: int, num_heads: int, sliding_window: Optional[int]) -> DecodeGroup:
    """``tables``: (num, max_blocks) block ids, padded with any valid id; ``context_lens``: (num,)."""
    num, max_blocks = tables.shape
    ctx = max_blocks * block_size
    dev = tables.device
    key_pos = torch.arange(ctx, device=dev).unsqueeze(0)
    lens = context_lens.unsqueeze(1)
    mask = key_pos < lens
    if sliding_window is not None:
        mask &= key_pos > lens - 1 - sliding_window
    # The KV head each query head reads.
    kv_head = torch.arange(num_heads, device=dev) // (num_heads // num_kv_heads)  # (num_heads,)
    blocks, heads = tables.view(num, 1, max_blocks, 1), kv_head.view(1, num_heads, 1, 1)
    key_rows = None
    if block_size >= BAG_MIN_BLOCK_SIZE:
        key_rows = ((blocks * num_kv_heads + heads) * head_dim + torch.arange(head_dim, device=dev)).view(-1, head_dim)
    # Row (block, kv_head, t) of the value pool seen as (-1, head_dim).
    value_rows = (blocks * num_kv_heads + heads) * block_size + torch.arange(block_size, device=dev)
    return DecodeGroup(start, num, ctx, ~mask, tables, key_rows, value_rows.reshape(-1, ctx))


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
) -> None:
    """Store each token's K/V at its slot. k, v: (num_tokens, num_kv_heads, head_dim)."""
    if native.write_kv(k, v, k_cache, v_cache, meta.slot_mapping):
        return
    # Both pools seen token-major, (num_blocks, block_size, kv_heads, head_dim): views.
    v_cache.transpose(1, 2).index_put_((meta.slot_blocks, meta.slot_offsets), v.to(v_cache.dtype))
    k_cache.permute(0, 3, 1, 2).index_put_((meta.slot_blocks, meta.slot_offsets), k.to(k_cache.dtype))


def _gather_keys(k_cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` keys of a sequence: (num_kv_heads, length, head_dim)."""
    num_blocks, num_kv_heads, head_dim, block_size = k_cache.shape
    blocks = k_cache.index_select(0, block_table)  # (blocks, kv_heads, head_dim, block_size)
    return blocks.permute(1, 0, 3, 2).reshape(num_kv_heads, -1, head_dim)[:, :length]


def _gather_values(v_cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` values of a sequence: (num_kv_heads, length, head_dim)."""
    num_blocks, num_kv_heads, block_size, head_dim = v_cache.shape
    blocks = v_cache.index_select(0, block_table)  # (blocks, kv_heads, block_size, head_dim)
    return blocks.transpose(0, 1).reshape(num_kv_heads, -1, head_dim)[:, :length]


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: DecodeGroup, scale: float
) -> torch.Tensor:
    """One query token per sequence over its padded context, grouped-query aware.

    q: (num, num_heads, head_dim); returns (num, num_heads, head_dim). Both sums read the pools in
    place (``embedding_bag`` gathers and reduces in one pass); scores are softmaxed in float32, as in
    transformers' eager attention. On CPU this is several times faster than gathering K/V for a
    batched matmul or SDPA with a padding mask.
    """
    n, num_heads, head_dim = q.shape
    _, num_kv_heads, _, block_size = k_cache.shape
    max_blocks = g.ctx // block_size
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
        scores = torch.matmul(qg, keys)  # (n, kv_heads, group, ctx): query heads in order
    scores = scores.view(n, num_heads, g.ctx).float()
    scores.masked_fill_(g.hidden.unsqueeze(1), float("-inf"))
    probs = scores.softmax(dim=-1).to(v_cache.dtype)
    out = F.embedding_bag(g.value_rows, v_cache.view(-1, head_dim), mode="sum", per_sample_weights=probs.view(-1, g.ctx))
    return out.view(n, num_heads, head_dim)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    store: bool = True,
) -> torch.Tensor:
    """q: (num_tokens, num_heads, head_dim); k, v: (num_tokens, num_kv_heads, head_dim).

    Returns (num_tokens, num_heads, head_dim). ``store=False``: the new tokens' K/V are already in
    the pools (the last layer stores every row's, then attends for the kept rows only).
    """
    if store:
        write_kv(k, v, k_cache, v_cache, meta)
    out = torch.empty_like(q)
    gqa = q.shape[1] != k.shape[1]
    window = meta.sliding_window

    if meta.native_decode is not None:
        d = meta.native_decode
        rows = out[: d.num]  # written in place where the cache has the queries' dtype
        got = native.paged_decode_attention(q[: d.num], k_cache, v_cache, d.tables, d.lens, d.scratch, scale,
                                            window, out=rows if rows.dtype == k_cache.dtype else None,
                                            cascade=d.cascade)
        if got is not rows:
            rows.copy_(got)
    for g in meta.decode_groups:
        sl = slice(g.start, g.start + g.num)
        out[sl] = decode_attention(q[sl], k_cache, v_cache, g, scale).to(q.dtype)

    for span in meta.prefills:
        sl = slice(span.q_start, span.q_start + span.q_len)
        cached = span.context_len - span.q_len
        if meta.native_prefill:
            rows = out[sl]  # written in place where the cache has the queries' dtype
            got = native.paged_prefill_attention(q[sl], k_cache, v_cache, span.block_table, cached, scale, window,
                                                 out=rows if rows.dtype == k_cache.dtype else None)
            if got is not rows:
                rows.copy_(got)
            continue
        if cached == 0 and k_cache.dtype == k.dtype:
            keys, values = k[sl].transpose(0, 1), v[sl].transpose(0, 1)  # fresh K/V: no gather
        else:
            keys = _gather_keys(k_cache, span.block_table, span.context_len)
            values = _gather_values(v_cache, span.block_table, span.context_len)
        # 4-D (batch of one): PyTorch's CPU flash-attention kernel only takes 4-D inputs; 3-D ones
        # fall back to the unfused math path, twice as slow.
        query = q[sl].transpose(0, 1).to(keys.dtype).unsqueeze(0)  # (1, num_heads, q_len, head_dim)
        keys, values = keys.unsqueeze(0), values.unsqueeze(0)
        if cached == 0 and window is None:
            o = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            q_pos = torch.arange(cached, span.context_len, device=q.device).unsqueeze(1)
            k_pos = torch.arange(span.context_len, device=q.device).unsqueeze(0)
            mask = k_pos <= q_pos
            if window is not None:
                mask &= k_pos > q_pos - window
            o = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[sl] = o[0].transpose(0, 1).to(q.dtype)
    return out
