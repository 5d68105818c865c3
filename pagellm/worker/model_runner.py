"""SchedulerOutput -> one flat batch -> model -> sampled tokens (and prompt logprobs)."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from pagellm.core.scheduler import ModelRunnerOutput, ScheduledSeq, SchedulerOutput
from pagellm.core.sequence import Sequence
from pagellm.kernels import native
from pagellm.model.attention import (AttentionMetadata, DecodeBatch, DecodeGroup, PrefillSpan, cascade_runs,
                                     choose_output_rows, decode_group)
from pagellm.worker.cache_engine import CacheEngine
from pagellm.worker.sampler import Sampler, top_logprobs


class ModelRunner:
    def __init__(
        self,
        model: Any,
        cache_engine: CacheEngine,
        sampler: Sampler,
        device: torch.device,
        sliding_window: Optional[int] = None,
    ) -> None:
        self.model = model
        self.cache_engine = cache_engine
        self.sampler = sampler
        self.device = device
        self.block_size = cache_engine.block_size
        _, self.num_kv_heads, _, self.head_dim = cache_engine.kv_caches[0][1].shape  # from the value pool
        self.num_heads = model.config.num_attention_heads
        self.sliding_window = sliding_window
        self.native_decode = native.supports(device, cache_engine.kv_caches[0][1].dtype)
        self.native_prefill = native.prefill_supported(cache_engine.kv_caches[0][0])
        # Decodes sharing their first blocks read them once (no sliding window: the shared blocks may
        # lie before it).
        self.cascade = native.cascade_supported(cache_engine.kv_caches[0][0]) and not sliding_window

    def _tensor(self, data: list[int]) -> torch.Tensor:
        return torch.tensor(data, dtype=torch.long, device=self.device)

    def _padded(self, tables: list[list[int]]) -> torch.Tensor:
        """Block tables as rows of one int64 tensor, padded with block 0 (read only up to each length).
        Filled row by row through numpy: ~2x faster than torch.tensor on nested lists, every step."""
        rows = np.zeros((len(tables), max(map(len, tables))), dtype=np.int64)
        for row, table in zip(rows, tables):
            row[: len(table)] = table
        return torch.from_numpy(rows).to(self.device)

    # A decode group is cut where a sequence's blocks fall below this share of the group's longest:
    # padding then wastes at most 1 - share of the gathered K/V.
    GROUP_SHARE = 0.75

    def _decode_groups(self, tables: list[list[int]], lens: list[int]) -> list[DecodeGroup]:
        """Split decodes (sorted longest first) into groups of similar length, each padded to its longest."""
        groups = []
        start = 0
        while start < len(tables):
            width = len(tables[start])
            end = start + 1
            while end < len(tables) and len(tables[end]) >= self.GROUP_SHARE * width:
                end += 1
            groups.append(decode_group(start, self._padded(tables[start:end]), self._tensor(lens[start:end]),
                                       self.block_size, self.num_kv_heads, self.head_dim, self.num_heads,
                                       self.sliding_window))
            start = end
        return groups

    def _decode_batch(self, tables: list[list[int]], lens: list[int]) -> DecodeBatch:
        """All decodes for the native kernel, tables padded with block 0 (read only up to each length);
        decodes sharing leading blocks (adjacent: see ``execute``) attend those once (cascade)."""
        padded = self._padded(tables)
        runs = cascade_runs(tables) if self.cascade else []
        return DecodeBatch(padded, self._tensor(lens),
                           native.scratch_for(self.num_heads, self.head_dim, self.block_size, padded.shape[1]),
                           torch.tensor(runs, dtype=torch.long) if runs else None)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self.sampler.forget(sched.finished_seq_ids)
        # Order matters: a block swapped out this step may be reused by a swap-in or a copy.
        self.cache_engine.swap_out(sched.blocks_to_swap_out)
        self.cache_engine.swap_in(sched.blocks_to_swap_in)
        self.cache_engine.copy_blocks(sched.blocks_to_copy)
        result = ModelRunnerOutput()
        if not sched.scheduled:
            return result
        bs = self.block_size
        # Decodes first. For the native kernel, those sharing their first block next to each other (a
        # cascade shares their leading blocks); else longest context first: groups of similar length
        # are contiguous runs.
        if self.cascade:
            items = sorted(sched.scheduled, key=lambda it: (it.num_new_tokens != 1, it.block_table[:1], -it.start))
        else:
            items = sorted(sched.scheduled, key=lambda it: (it.num_new_tokens != 1, -it.start))
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillSpan] = []
        sample_rows: list[int] = []  # flat index of each sampled sequence's last token
        sample_seqs: list[Sequence] = []
        lp_rows: list[int] = []  # flat indices whose logits score a prompt token
        lp_targets: list[int] = []
        lp_owner: list[tuple[ScheduledSeq, int]] = []
        for it in items:
            seq, start, n = it.seq, it.start, it.num_new_tokens
            q_start = len(input_ids)
            input_ids.extend(seq.token_slice(start, start + n))
            pos = range(start, start + n)
            positions.extend(pos)
            table = it.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in pos)
            if n == 1:
                decode_tables.append(table)
                decode_lens.append(start + 1)
            else:
                prefills.append(PrefillSpan(q_start, n, start + n, self._tensor(table)))
            if it.sample:
                # Forked children sample their own first token from the parent's logits.
                for s in (seq, *it.fork_children):
                    sample_rows.append(q_start + n - 1)
                    sample_seqs.append(s)
            if it.prompt_logprobs_range is not None:
                lo, hi = it.prompt_logprobs_range
                lp_rows.extend(q_start + p - start for p in range(lo, hi))
                lp_targets.extend(seq.prompt_token_ids[p + 1] for p in range(lo, hi))
                lp_owner.append((it, hi - lo))

        slot_mapping = self._tensor(slots)
        meta = AttentionMetadata(slot_mapping=slot_mapping, slot_blocks=slot_mapping // bs, slot_offsets=slot_mapping % bs,
                                 prefills=prefills, sliding_window=self.sliding_window,
                                 native_prefill=self.native_prefill)
        if decode_tables and self.native_decode:
            meta.native_decode = self._decode_batch(decode_tables, decode_lens)
        else:
            meta.decode_groups = self._decode_groups(decode_tables, decode_lens)

        # The LM head runs only on the rows that are sampled or scored, and the last layer (but for
        # its K/V) on the rows those need.
        rows = sample_rows + lp_rows
        if prefills:
            meta.output_rows = choose_output_rows(meta, len(input_ids), len(decode_tables), rows)
        hidden = self.model(self._tensor(input_ids), self._tensor(positions), self.cache_engine.kv_caches, meta)
        if meta.output_rows is not None:
            rows = meta.output_rows.positions(rows)
        # (A decode-only step samples every row once, in order: no gather.)
        logits = self.model.compute_logits(hidden if rows == list(range(hidden.shape[0])) else hidden[self._tensor(rows)])
        if sample_seqs:
            for s, res in zip(sample_seqs, self.sampler(logits[: len(sample_seqs)], sample_seqs)):
                result.samples[s.seq_id] = res
        if lp_rows:
            lp = torch.log_softmax(logits[len(sample_seqs):], dim=-1)
            num = max(it.seq.params.prompt_logprobs or 0 for it, _ in lp_owner)
            entries = top_logprobs(lp, num, self._tensor(lp_targets))
            offset = 0
            for it, count in lp_owner:
                n_i = it.seq.params.prompt_logprobs or 0
                chunk = entries[offset : offset + count]
                targets = lp_targets[offset : offset + count]
                result.prompt_logprobs[it.seq.seq_id] = [
                    {t: v for t, v in e.items() if v[1] <= n_i or t == tgt} for e, tgt in zip(chunk, targets)
                ]
                offset += count
        return result
