"""What a step's attention reads besides the pools: slots, the decodes' tables, the prefills' spans.

The model runner fills ``AttentionMetadata`` once per step (the decodes' part through the backend's
``prepare_decode``, since each backend wants its own); every layer reads the same one.
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch


def long_tensor(data: list[int], device: torch.device) -> torch.Tensor:
    """``data`` as an int64 tensor on ``device``."""
    return torch.tensor(data, dtype=torch.long, device=device)


def padded_tables(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    """Block tables as rows of one int64 tensor, padded with block 0 (read only up to each length).
    Filled row by row through numpy: ~2x faster than torch.tensor on nested lists, every step."""
    rows = np.zeros((len(tables), max(map(len, tables))), dtype=np.int64)
    for row, table in zip(rows, tables):
        row[: len(table)] = table
    return torch.from_numpy(rows).to(device)


@dataclass
class PrefillSpan:
    """One sequence's run of new tokens ``[q_start, q_start + q_len)`` in the flat batch."""

    q_start: int
    q_len: int
    context_len: int  # tokens cached before this chunk + q_len
    block_table: torch.Tensor  # [num_blocks_of_seq] int64
    # The whole sequence's tokens known when the step was scheduled (a chunked prompt's full length);
    # None: context_len. Longrope picks its factors by it.
    seq_len: int | None = None


class DecodeMetadata:
    """The decodes of a step (rows ``[0, num)`` of the flat batch) as one backend lays them out for its
    ``decode``; built once per step by ``AttentionBackend.prepare_decode``, shared by every layer."""

    @property
    def num(self) -> int:
        raise NotImplementedError


@dataclass
class DecodeBatch(DecodeMetadata):
    """Every decode of the step (``[0, num)`` of the flat batch) for the native kernel, which reads
    each sequence's own blocks (native_backend.py)."""

    tables: torch.Tensor  # [num, max_blocks] int64 block ids, padded with any valid id
    lens: torch.Tensor  # [num] int64 context lengths
    scratch: torch.Tensor  # the kernel's working memory, shared by every layer
    # [runs, 3] int64 (begin, end, shared): runs of decodes whose first blocks are the same, read once
    # for the run (cascade attention, see native.paged_decode_attention); None: no such runs
    cascade: torch.Tensor | None = None

    @property
    def num(self) -> int:
        return self.lens.shape[0]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: where each new token's K/V goes
    slot_blocks: torch.Tensor  # [num_tokens] int64: slot_mapping // block_size
    slot_offsets: torch.Tensor  # [num_tokens] int64: slot_mapping % block_size
    decode: DecodeMetadata | None = None  # the backend's own; None: no decodes this step
    prefills: list[PrefillSpan] = field(default_factory=list)
    sliding_window: int | None = None
    # The rows whose final hidden states the step uses; None: every row (see OutputRows).
    output_rows: OutputRows | None = None
    # The whole sequence's length for each one-token row (a decode, or a prompt's one-token chunk);
    # None: position + 1. Longrope picks its factors by it.
    decode_seq_lens: list[int] | None = None
    # Models with several KV cache groups (Gemma's sliding and full-attention layers, each kind with
    # its own pool and block tables): every group's metadata, this one first (group 0); the others
    # have their own slots, decode tables and prefill spans. None: one group.
    group_metas: list[AttentionMetadata] | None = None
    # [num_tokens] bool: the rows that are prompt tokens (quantized layers take their inputs by it:
    # model/quant_linear.py); None: none is.
    prompt_rows: torch.Tensor | None = None

    @property
    def num_decodes(self) -> int:
        return 0 if self.decode is None else self.decode.num

    def prompt_row_masks(self) -> tuple[torch.Tensor, ...]:
        """``prompt_rows`` for every row, then for the last layer's kept rows; () where no row is a
        prompt token."""
        if self.prompt_rows is None:
            return ()
        if self.output_rows is None:
            return (self.prompt_rows,)
        return self.prompt_rows, self.prompt_rows[self.output_rows.rows]

    def for_group(self, group: int) -> AttentionMetadata:
        """The metadata of the layers of KV cache group ``group`` (this one where there is one group)."""
        return self if self.group_metas is None else self.group_metas[group]


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
    index: torch.Tensor  # [num_kept] int64: the same, on the batch's device
    meta: AttentionMetadata  # the kept rows' own: decodes unchanged, each prefill cut to its kept suffix

    def for_group(self, group: int) -> OutputRows:
        """The same rows, with the metadata of KV cache group ``group``."""
        own = self.meta.for_group(group)
        return self if own is self.meta else OutputRows(self.rows, self.index, own)

    def positions(self, flat_rows: list[int]) -> list[int]:
        """Where each of ``flat_rows`` (kept rows, repeats allowed) lies among the kept rows."""
        at = {r: i for i, r in enumerate(self.rows)}
        return [at[r] for r in flat_rows]


def choose_output_rows(meta: AttentionMetadata, num_tokens: int, num_decodes: int,
                       needed: list[int]) -> OutputRows | None:
    """The rows the last layer must compute so that ``needed`` (flat-batch rows, any order, repeats
    allowed) get their final hidden states: the ``num_decodes`` one-token rows, which the batch puts
    first (all kept: nearly all are sampled), and, of each prefill, the rows from its first needed
    one to its end (a suffix keeps the span a causal run of queries). None where that is every row."""
    wanted = sorted(set(needed))
    kept = list(range(num_decodes))
    cuts = []  # (prefill index, its first kept row's place among the kept rows, its first kept row)
    for i, span in enumerate(meta.prefills):
        end = span.q_start + span.q_len
        at = bisect.bisect_left(wanted, span.q_start)
        if at == len(wanted) or wanted[at] >= end:
            continue  # a chunk that samples nothing: only its K/V is needed
        first = wanted[at]
        cuts.append((i, len(kept), first))
        kept.extend(range(first, end))
    if len(kept) == num_tokens:
        return None
    index = torch.tensor(kept, dtype=torch.long, device=meta.slot_mapping.device)

    def cut(m: AttentionMetadata) -> AttentionMetadata:
        spans = []
        for i, q_start, first in cuts:
            span = m.prefills[i]
            spans.append(PrefillSpan(q_start, span.q_start + span.q_len - first, span.context_len, span.block_table,
                                     span.seq_len))
        # (The kept rows' K/V is already stored: their slots are kept only so that the metadata
        # describes its own rows.)
        return dataclasses.replace(m, slot_mapping=m.slot_mapping[index], slot_blocks=m.slot_blocks[index],
                                   slot_offsets=m.slot_offsets[index], prefills=spans, output_rows=None,
                                   group_metas=None)

    own = cut(meta)
    if meta.group_metas is not None:
        own.group_metas = [own, *(cut(m) for m in meta.group_metas[1:])]
    return OutputRows(kept, index, own)


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
