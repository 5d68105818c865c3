"""Speculative decoding with a draft model (vLLM's ``speculative_config={"model": DRAFT, ...}``).

``DraftModelRunner`` is the model runner of an engine whose drafts come from a smaller model with the
same tokenizer, run in the same process. The draft has its own KV pools (``CacheEngine``) with as many
blocks as the target's, and uses the target's block tables: a token's draft K/V sits in the draft's
pools at the slot of its K/V in the target's. So the draft needs no block bookkeeping of its own: block
moves (copy-on-write, swaps) are applied to both, prefix-cache hits and forks hold the draft's K/V too,
and a preempted sequence recomputed from its first token is recomputed in both.

Invariant, between steps: for every position the target has computed of a sequence, the draft's pools
hold the draft's K/V of the same token, except at most the one position ``behind`` records (the last
draft of a step that accepted every draft: the draft never read it), which the next step computes
first. Each step, before the target's forward pass:

1. one draft forward pass over the step's tokens without their drafts (prefill chunks, decodes: every
   token the target computes, so the invariant holds), plus each ``behind`` position; its logits at
   each speculating sequence's last token give the first draft;
2. ``k - 1`` more passes of one row per speculating sequence (its latest draft), batched across
   sequences, each giving the next draft.

Greedy sequences take the draft's argmax; sampled ones draw from the draft's distribution q under their
own sampling settings, and the verification (``Sampler.verify``) accepts a draft d with probability
min(1, p(d) / q(d)) and else samples from max(p - q, 0): the tokens are distributed as without drafts.
The draft's K/V of rejected drafts lies past the computed tokens, as the target's does, and is written
again by the next tokens: no rollback is needed. Exactness never depends on the draft's K/V: a wrong
one only lowers acceptance.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from pagellm.core.runner_output import ModelRunnerOutput
from pagellm.core.sched_output import ScheduledSeq, SchedulerOutput
from pagellm.model.attention import AttentionMetadata
from pagellm.model.attention.metadata import long_tensor
from pagellm.worker.cache_engine import CacheEngine
from pagellm.worker.model_runner import ModelRunner, SamplingMetadata, StepBatch
from pagellm.worker.request_state import SeqState
from pagellm.worker.sampler import Sampler

logger = logging.getLogger(__name__)


class DraftModelRunner(ModelRunner):
    """A ``ModelRunner`` (of the target model) whose speculating decodes get their drafts from a draft
    model in the step (``ScheduledSeq.draft_token_ids`` come as ``DRAFT_BY_MODEL`` slots)."""

    def __init__(self, model: Any, cache_engine: CacheEngine, sampler: Sampler, device: torch.device,
                 draft_model: Any, draft_cache_engine: CacheEngine, **kwargs: Any) -> None:
        super().__init__(model, cache_engine, sampler, device, speculative=True, **kwargs)
        # The draft's own runner reads the target's sequence states (tokens, block tables).
        self.draft = ModelRunner(draft_model, draft_cache_engine, sampler, device,
                                 sliding_window=kwargs.get("sliding_window"), speculative=True)
        self.draft.requests = self.requests
        self.vocab_size = model.config.vocab_size  # (the target's logits' width: q must have it too)
        # seq_id -> the position whose draft K/V is missing (see the module's docstring).
        self.behind: dict[int, int] = {}

    def take_in(self, scheduler_output: SchedulerOutput) -> None:
        super().take_in(scheduler_output)
        for seq_id in scheduler_output.finished_seq_ids:
            self.behind.pop(seq_id, None)

    def move_blocks(self, scheduler_output: SchedulerOutput) -> list[tuple[int, int]]:
        failures = super().move_blocks(scheduler_output)
        engine = self.draft.cache_engine
        for group, (out, into, copies) in enumerate(scheduler_output.block_moves):
            engine.swap_out(out, group)
            engine.swap_in(into, group)
            engine.copy_blocks(copies, group)
        return failures

    # ---------------------------------------------------------------- drafting
    def with_drafts(self, scheduled: list[ScheduledSeq]) -> list[ScheduledSeq]:
        """The step's entries, each speculating one's drafts proposed by the draft model (and their
        distributions kept in ``draft_probs`` for the verification); computes the draft's K/V of every
        token of the step."""
        self.draft_probs = {}
        wanted = {it.seq_id: len(it.draft_token_ids) for it in scheduled if it.draft_token_ids}
        items = []
        for it in scheduled:
            begin = min(self.behind.pop(it.seq_id, it.start), it.start)
            end = it.start + it.num_new_tokens - len(it.draft_token_ids)
            if begin == it.start - 1 and end == it.start + 1:
                # Two decode rows, as the target computed them (a draft after the position behind):
                # the draft's K/V is then the target's own where the draft is the target.
                last = self.requests[it.seq_id].token_slice(it.start, end)
                items.append(ScheduledSeq(it.seq_id, begin, 2, False, draft_token_ids=last))
            else:
                items.append(ScheduledSeq(it.seq_id, begin, end - begin, it.seq_id in wanted))
        batch = self.draft.prepare(items)
        if not wanted:  # (the draft's K/V only)
            self.draft.model(batch.input_ids, batch.positions, self.draft.cache_engine.kv_caches, batch.attn)
            return scheduled
        # Each speculating sequence's last row: the sampled rows, then the two-row decodes (model_runner's order).
        sampling = batch.sampling
        row_of = {s.seq_id: i for i, s in enumerate(sampling.seqs)}
        at = len(sampling.rows) + len(sampling.lp_rows)
        for state, spec_rows, _ in sampling.spec:
            at += len(spec_rows)
            row_of[state.seq_id] = at - 1
        seqs = [self.requests[seq_id] for seq_id in wanted]
        logits = self.draft.run_model(batch)[long_tensor([row_of[s.seq_id] for s in seqs], self.device)]
        tokens, probs = self.sampler.propose(self._fit(logits), seqs)
        drafts: dict[int, list[int]] = {s.seq_id: [t] for s, t in zip(seqs, tokens)}
        q_rows: dict[int, list[torch.Tensor]] = {s.seq_id: [] if probs is None else [probs[i]]
                                                 for i, s in enumerate(seqs)}
        starts = {it.seq_id: it.start for it in scheduled}
        for i in range(1, max(wanted.values())):
            # Longest first, as the backends lay decodes out.
            rows = sorted((s for s in seqs if wanted[s.seq_id] > i), key=lambda s: -starts[s.seq_id])
            logits = self.draft.run_model(self._decode_batch(
                [(s, drafts[s.seq_id][-1], starts[s.seq_id] + i) for s in rows]))
            tokens, probs = self.sampler.propose(self._fit(logits), rows)
            for j, (s, t) in enumerate(zip(rows, tokens)):
                drafts[s.seq_id].append(t)
                if probs is not None:
                    q_rows[s.seq_id].append(probs[j])
        for seq_id, rows_q in q_rows.items():
            if rows_q and not self.requests[seq_id].params.is_greedy:
                self.draft_probs[seq_id] = torch.stack(rows_q)
        return [dataclasses.replace(it, draft_token_ids=drafts[it.seq_id]) if it.seq_id in wanted else it
                for it in scheduled]

    def kept(self, scheduled: list[ScheduledSeq], result: ModelRunnerOutput) -> None:
        """After the verification: a sequence that kept every draft has its last draft's draft K/V to compute
        (the draft proposed it but never read it)."""
        for it in scheduled:
            k = len(it.draft_token_ids)
            if k and len(result.extra_samples.get(it.seq_id, ())) == k:
                self.behind[it.seq_id] = it.start + k

    def _fit(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's logits over the target's vocabulary (ids past the draft's own: never proposed)."""
        width = logits.shape[1]
        if width > self.vocab_size:
            return logits[:, : self.vocab_size]
        if width < self.vocab_size:
            return torch.nn.functional.pad(logits, (0, self.vocab_size - width), value=float("-inf"))
        return logits

    def _decode_batch(self, rows: list[tuple[SeqState, int, int]]) -> StepBatch:
        """One draft pass of one-token rows: (sequence, its latest draft, that draft's position)."""
        bs, device = self.block_size, self.device
        tables = [state.block_tables[0] for state, _, _ in rows]
        positions = [pos for _, _, pos in rows]
        slots = long_tensor([t[p // bs] * bs + p % bs for t, p in zip(tables, positions)], device)
        attn = AttentionMetadata(slot_mapping=slots, slot_blocks=slots // bs, slot_offsets=slots % bs,
                                 sliding_window=self.draft.sliding_window)
        lens = [p + 1 for p in positions]
        attn.decode = self.draft.attn_backend.prepare_decode(tables, lens, [])
        attn.decode_seq_lens = lens
        return StepBatch(long_tensor([t for _, t, _ in rows], device), long_tensor(positions, device), attn,
                         SamplingMetadata(), None)


def check_draft_vocabulary(target_tokenizer: Any, draft_tokenizer: Any, draft_path: str) -> None:
    """ValueError unless the draft's tokenizer maps every token to the target's id for it (the drafts
    are token ids the target verifies)."""
    target, draft = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    differ = [tok for tok, i in draft.items() if target.get(tok, i) != i]
    missing = len(set(target) ^ set(draft))
    if differ or missing:
        example = f" (e.g. {differ[0]!r}: {draft[differ[0]]} in the draft, {target[differ[0]]} in the target)" \
            if differ else ""
        raise ValueError(
            f"speculative_config: the draft model {draft_path} does not share the target's tokenizer: "
            f"{len(differ)} token(s) have other ids{example} and {missing} are in one vocabulary only; use a "
            "draft of the same model family (the same tokenizer), or the ngram method")

