"""SchedulerOutput -> one flat batch -> model -> sampled tokens (and prompt logprobs).

A step reads top to bottom in ``execute``: take in the step's news about each sequence (the
runner's own ``RequestStates``: tokens, sampling parameters, block tables), move blocks, ``prepare``
the batch (``prepare_decode``, ``prepare_prefill``, ``prepare_sample``, ``prepare_logits_rows``),
``run_model``, ``sample``. The attention backend is chosen once, here, and handed to the model.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from pagellm.core.runner_output import ModelRunnerOutput, TokenLogprobs
from pagellm.core.sched_output import ScheduledSeq, SchedulerOutput
from pagellm.lora.manager import LoRAManager
from pagellm.lora.punica import LoRAStep
from pagellm.model.attention import (
    AttentionConfig,
    AttentionMetadata,
    DecodeMetadata,
    PrefillSpan,
    cascade_runs,
    choose_output_rows,
    select_attention_backend,
)
from pagellm.model.attention.metadata import long_tensor
from pagellm.model.llama import Attention
from pagellm.model.quant_linear import step_prompt_rows
from pagellm.structured_output import GrammarMask, StructuredOutputManager
from pagellm.worker.cache_engine import CacheEngine
from pagellm.worker.kv_disk_store import KVDiskStore
from pagellm.worker.request_state import RequestStates, SeqState
from pagellm.worker.sampler import Sampler, top_logprobs

logger = logging.getLogger(__name__)

# A scheduled chunk with the runner's state of its sequence.
Chunk = tuple[ScheduledSeq, SeqState]


@dataclass
class SamplingMetadata:
    """Which rows of the flat batch the LM head reads: the sampled ones, then those scoring a prompt token."""

    seqs: list[SeqState] = field(default_factory=list)  # [num_samples] sequences that sample a token
    rows: list[int] = field(default_factory=list)  # [num_samples] flat row of each one's last token
    lp_rows: list[int] = field(default_factory=list)  # [num_scored] flat rows whose logits score a prompt token
    lp_targets: list[int] = field(default_factory=list)  # [num_scored] the prompt token each scores
    # Each scoring sequence's share of lp_rows, in order: (the sequence, number of rows).
    lp_owners: list[tuple[SeqState, int]] = field(default_factory=list)
    # Speculative decoding: (sequence, flat rows of its last token and drafts, the drafts), read after
    # the rows above.
    spec: list[tuple[SeqState, list[int], list[int]]] = field(default_factory=list)

    @property
    def spec_rows(self) -> list[int]:
        return [row for _, rows, _ in self.spec for row in rows]


@dataclass
class StepBatch:
    """One step's flat batch: every scheduled token of every sequence, the decodes' (one each) first,
    then each prefill's run."""

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    attn: AttentionMetadata  # slot_mapping [num_tokens], the decodes' tables and lengths, prefill spans
    sampling: SamplingMetadata
    # [num_samples + num_scored] int64: the model's output rows the LM head reads, in SamplingMetadata's
    # order; None: every output row, in order (a decode-only step: no gather)
    logits_rows: torch.Tensor | None
    lora: LoRAStep | None = None  # each row's LoRA adapter; None: every row is the base model's


class ModelRunner:
    """Runs one scheduled step on the model: owns the model, the KV pools (``CacheEngine``), the
    ``Sampler`` and its own state of each sequence (``requests``), and turns a ``SchedulerOutput`` into a
    ``ModelRunnerOutput`` (one sample per sampled sequence, prompt logprobs where asked).

    Its block tables are copies the scheduler's messages keep up to date; block moves (swap,
    copy-on-write) are applied before the forward pass; a step's result depends only on its schedule,
    the sequences' tokens and the pools.
    """

    def __init__(
        self,
        model: Any,
        cache_engine: CacheEngine,
        sampler: Sampler,
        device: torch.device,
        sliding_window: int | None = None,
        structured_output: StructuredOutputManager | None = None,
        calculate_kv_scales: bool | None = None,
        speculative: bool = False,
    ) -> None:
        """``speculative``: steps may carry draft tokens (``ScheduledSeq.draft_token_ids``); decodes then
        never share the reading of common leading blocks (cascade), so that a row's result is the same
        whether it is verified with drafts or decoded alone."""
        self.model = model
        self.structured_output = structured_output  # None: no request may be constrained
        self.cache_engine = cache_engine
        self.sampler = sampler
        self.device = device
        self.block_size = cache_engine.block_size
        self.sliding_window = sliding_window
        # KV cache groups (Gemma: sliding and full-attention layers, each kind with its own pools and
        # block tables); 1 for every other model.
        self.num_groups = cache_engine.num_groups
        # Each group's window (None: full attention), as its layers attend.
        self.group_windows: dict[int, int | None] = {}
        if self.num_groups > 1:
            for layer in model.layers:
                self.group_windows[getattr(layer, "kv_group", 0)] = layer.self_attn.window
        v_cache = cache_engine.kv_caches[0][1]
        _, num_kv_heads, _, head_dim = v_cache.shape
        # Soft-capped attention scores (Gemma2) rule out backends without them.
        self.attn_backend = select_attention_backend(AttentionConfig(
            device, v_cache.dtype, model.config.num_attention_heads, num_kv_heads, head_dim, self.block_size,
            sliding_window, logit_softcap=getattr(model, "attn_logit_softcap", None)))
        self.cascade = self.attn_backend.cascade and not speculative
        self.requests = RequestStates()
        # A draft model's distributions of this step's drafts, by sequence (worker/draft_model.py).
        self.draft_probs: dict[int, torch.Tensor] = {}
        # The KV tier on disk (engine/kv_offload.py), where one is configured.
        self.disk_store: KVDiskStore | None = None
        # LoRA adapters (--enable-lora; worker/lora_targets.py), where enabled.
        self.lora: LoRAManager | None = None
        model.set_attention_backend(self.attn_backend)
        logger.info("attention: %s", self.attn_backend.describe())
        if v_cache.element_size() == 1:  # --kv-cache-dtype fp8: each layer scales what it stores
            fp8_max = torch.finfo(v_cache.dtype).max
            for module in model.modules():
                if isinstance(module, Attention):
                    # Unscaled (1.0), a layer's K and V values far below fp8's range round away.
                    module.set_fp8_kv_cache(fp8_max, calculate_kv_scales is not False)

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.take_in(scheduler_output)
        disk_failures = self.move_blocks(scheduler_output)
        if not scheduler_output.scheduled:
            return ModelRunnerOutput(disk_load_failures=disk_failures)
        scheduled = self.with_drafts(scheduler_output.scheduled)
        batch = self.prepare(scheduled)
        # Constrained sequences' token masks are filled on another thread while the model runs.
        so = self.structured_output
        pending = so.start_mask(batch.sampling.seqs) if so is not None else None
        logits = self.run_model(batch)
        result = self.sample(batch.sampling, logits, pending.result() if pending is not None else None)
        result.disk_load_failures = disk_failures
        self.kept(scheduled, result)
        return result

    def with_drafts(self, scheduled: list[ScheduledSeq]) -> list[ScheduledSeq]:
        """The step's entries with their drafts as the forward pass reads them (a draft model's runner
        proposes them here: worker/draft_model.py)."""
        return scheduled

    def kept(self, scheduled: list[ScheduledSeq], result: ModelRunnerOutput) -> None:
        """Told the tokens each sequence kept (a draft model's runner follows its drafts' acceptance)."""

    @torch.inference_mode()
    def forward_only(self, scheduler_output: SchedulerOutput) -> None:
        """A tensor-parallel worker's share of a step: the block moves and the forward pass (its K/V
        and the all-reduces); rank 0 computes the logits and samples."""
        self.take_in(scheduler_output)
        self.move_blocks(scheduler_output)
        if scheduler_output.scheduled:
            batch = self.prepare(scheduler_output.scheduled)
            self.forward(batch)

    def take_in(self, scheduler_output: SchedulerOutput) -> None:
        """The step's news about each sequence, into the runner's state; finished sequences' seeded
        generators and grammars go with them (a preempted one keeps both: it comes back)."""
        self.requests.apply(scheduler_output)
        if self.lora is not None:
            for new in scheduler_output.new_seqs:
                if new.lora_request is not None:
                    self.lora.register(new.lora_request)
        finished = scheduler_output.finished_seq_ids
        if finished:
            self.sampler.forget(finished)
            if self.structured_output is not None:
                self.structured_output.forget(finished)

    def move_blocks(self, scheduler_output: SchedulerOutput) -> list[tuple[int, int]]:
        """The step's block moves; returns (group, block id) of the reads from disk that failed."""
        # Order matters: a cached block evicted this step is saved to disk before anything writes it; a
        # block swapped out this step may be reused by a swap-in or a copy; reads from disk go last.
        disk_moves, store = scheduler_output.disk_moves, self.disk_store
        if disk_moves and store is not None:
            store.apply(disk_moves, "before")
        for group, (out, into, copies) in enumerate(scheduler_output.block_moves):
            self.cache_engine.swap_out(out, group)
            self.cache_engine.swap_in(into, group)
            self.cache_engine.copy_blocks(copies, group)
        if disk_moves and store is not None:
            return store.apply(disk_moves, "after")
        return [(g, block_id) for g, moves in enumerate(disk_moves) for _, block_id in moves.loads]  # (no store)

    # ---------------------------------------------------------------- prepare
    def prepare(self, scheduled: list[ScheduledSeq]) -> StepBatch:
        """The step's scheduled tokens as one flat batch, with what attention and sampling read (each
        sequence's tokens and tables from ``requests``, which took in the step's news first)."""
        items = self.batch_order([(it, self.requests[it.seq_id]) for it in scheduled])
        decodes = [c for c in items if is_decode(c)]  # (first: see batch_order)
        num_decodes = sum(it.num_new_tokens for it, _ in decodes)  # rows: one per token, drafts included
        input_ids, positions, slots = self.prepare_tokens(items)
        slot_mapping = long_tensor(slots, self.device)
        attn = AttentionMetadata(slot_mapping=slot_mapping, slot_blocks=slot_mapping // self.block_size,
                                 slot_offsets=slot_mapping % self.block_size, sliding_window=self.sliding_window)
        if num_decodes:
            attn.decode = self.prepare_decode(decodes)
            attn.decode_seq_lens = [it.start + 1 + i for it, _ in decodes for i in range(it.num_new_tokens)]
        attn.prefills = self.prepare_prefill(items[len(decodes):], num_decodes)
        attn.prompt_rows = prompt_rows(items)
        if self.num_groups > 1:  # (no drafts with several groups: one row per decode)
            attn.group_metas = [attn, *(self.prepare_group(items, len(decodes), positions, attn, g)
                                        for g in range(1, self.num_groups))]
        sampling = self.prepare_sample(items)
        logits_rows = self.prepare_logits_rows(attn, len(input_ids), sampling)
        lora = None
        if self.lora is not None:
            lora = self.lora.begin_step([state.lora_id for _, state in items], [it.num_new_tokens for it, _ in items],
                                        attn.output_rows.index if attn.output_rows is not None else None)
        return StepBatch(long_tensor(input_ids, self.device), long_tensor(positions, self.device), attn, sampling,
                         logits_rows, lora)

    def batch_order(self, items: list[Chunk]) -> list[Chunk]:
        """Decodes first. Where the backend reads shared leading blocks once (cascade), those sharing
        their first block next to each other; else longest context first: decodes of similar length
        are contiguous runs."""
        if self.cascade:
            return sorted(items, key=lambda c: (not is_decode(c), c[1].block_tables[0][:1], -c[0].start))
        return sorted(items, key=lambda c: (not is_decode(c), -c[0].start))

    def prepare_tokens(self, items: list[Chunk]) -> tuple[list[int], list[int], list[int]]:
        """Every new token of the step, in batch order: its id, position and slot."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for it, state in items:
            start, n, table = it.start, it.num_new_tokens, state.block_tables[0]
            drafts = it.draft_token_ids
            input_ids.extend(state.token_slice(start, start + n - len(drafts)))
            input_ids.extend(drafts)
            pos = range(start, start + n)
            positions.extend(pos)
            slots.extend(table[p // bs] * bs + p % bs for p in pos)
        return input_ids, positions, slots

    def prepare_decode(self, decodes: list[Chunk]) -> DecodeMetadata:
        """The decodes (the first rows, one per token: a sequence's drafts are decodes at the positions
        after its last token, attending to the K/V written before them in the step) as the backend
        attends them, runs of them sharing their first blocks found where it reads those once."""
        tables = [state.block_tables[0] for it, state in decodes for _ in range(it.num_new_tokens)]
        lens = [it.start + 1 + i for it, _ in decodes for i in range(it.num_new_tokens)]
        runs = cascade_runs(tables) if self.cascade else []
        return self.attn_backend.prepare_decode(tables, lens, runs)

    def prepare_prefill(self, prefills: list[Chunk], first_row: int) -> list[PrefillSpan]:
        """Each prefill (chunk) as its run of rows from ``first_row`` on, with its context and blocks."""
        spans = []
        q_start = first_row
        for it, state in prefills:
            n = it.num_new_tokens
            spans.append(PrefillSpan(q_start, n, it.start + n, long_tensor(state.block_tables[0], self.device),
                                     state.num_tokens))
            q_start += n
        return spans

    def prepare_group(self, items: list[Chunk], num_decodes: int, positions: list[int],
                      attn: AttentionMetadata, group: int) -> AttentionMetadata:
        """The metadata of KV cache group ``group`` (1 and up): the step's rows in the group's own blocks.

        A sliding group's tables are cut to the blocks its window reaches from each chunk's first query
        (the earlier ones, out-of-window stand-ins or blocks about to be freed, would only be masked), and
        its context lengths counted from there: attention depends on the keys' order, not their absolute
        positions (the rotation is applied before they are stored). Its decodes read no shared runs."""
        bs = self.block_size
        window = self.group_windows.get(group)
        tables = [state.block_tables[group] for _, state in items]
        slots: list[int] = []
        at = 0
        skipped = []  # leading blocks of each table no query of the step reads
        for (it, _), table in zip(items, tables):
            slots.extend(table[p // bs] * bs + p % bs for p in positions[at : at + it.num_new_tokens])
            at += it.num_new_tokens
            skipped.append(0 if window is None else max(0, it.start - window) // bs)
        slot_mapping = long_tensor(slots, self.device)
        meta = AttentionMetadata(slot_mapping=slot_mapping, slot_blocks=slot_mapping // bs,
                                 slot_offsets=slot_mapping % bs, sliding_window=self.sliding_window,
                                 decode_seq_lens=attn.decode_seq_lens)
        if num_decodes:
            meta.decode = self.attn_backend.prepare_decode(
                [table[k:] for table, k in zip(tables[:num_decodes], skipped)],
                [it.start + 1 - k * bs for (it, _), k in zip(items[:num_decodes], skipped)], [])
        meta.prefills = [
            PrefillSpan(span.q_start, span.q_len, span.context_len - k * bs, long_tensor(table[k:], self.device),
                        span.seq_len)
            for span, table, k in zip(attn.prefills, tables[num_decodes:], skipped[num_decodes:])
        ]
        return meta

    def prepare_sample(self, items: list[Chunk]) -> SamplingMetadata:
        """The rows each sampling sequence reads (its chunk's last), and those scoring prompt tokens."""
        sampling = SamplingMetadata()
        q_start = 0
        for it, state in items:
            start, n = it.start, it.num_new_tokens
            if it.draft_token_ids:
                sampling.spec.append((state, list(range(q_start, q_start + n)), it.draft_token_ids))
            elif it.sample:
                sampling.rows.append(q_start + n - 1)
                sampling.seqs.append(state)
                for child in it.fork_children:  # each samples its own first token from the parent's logits
                    sampling.rows.append(q_start + n - 1)
                    sampling.seqs.append(self.requests[child.seq_id])
            if it.prompt_logprobs_range is not None:
                lo, hi = it.prompt_logprobs_range
                sampling.lp_rows.extend(q_start + p - start for p in range(lo, hi))
                sampling.lp_targets.extend(state.prompt_token_ids[p + 1] for p in range(lo, hi))
                sampling.lp_owners.append((state, hi - lo))
            q_start += n
        return sampling

    def prepare_logits_rows(self, attn: AttentionMetadata, num_tokens: int,
                            sampling: SamplingMetadata) -> torch.Tensor | None:
        """The LM head runs only on the rows that are sampled or scored, and the last layer (but for its
        K/V) on the rows those need (``attn.output_rows``, set here)."""
        rows = sampling.rows + sampling.lp_rows + sampling.spec_rows
        num_out = num_tokens
        if attn.prefills:
            attn.output_rows = choose_output_rows(attn, num_tokens, attn.num_decodes, rows)
        if attn.output_rows is not None:
            rows = attn.output_rows.positions(rows)
            num_out = len(attn.output_rows.rows)
        return None if rows == list(range(num_out)) else long_tensor(rows, self.device)

    # ---------------------------------------------------------------- run and sample
    def run_model(self, batch: StepBatch) -> torch.Tensor:
        """[num_samples + num_scored, vocab] float32 logits."""
        hidden = self.forward(batch)
        prompt = batch.attn.prompt_rows
        if batch.attn.output_rows is not None and prompt is not None:
            prompt = prompt[batch.attn.output_rows.rows]
        if batch.logits_rows is not None:
            hidden = hidden[batch.logits_rows]
            prompt = None if prompt is None else prompt[batch.logits_rows]
        with step_prompt_rows(() if prompt is None else (prompt,)):
            return self.model.compute_logits(hidden, decode_step=prompt is None)

    def forward(self, batch: StepBatch) -> torch.Tensor:
        """The model's forward pass over the batch, each row with its LoRA adapter where it has one."""
        if batch.lora is None:
            return self.model(batch.input_ids, batch.positions, self.cache_engine.kv_caches, batch.attn)
        assert self.lora is not None
        self.lora.current, self.model.lora_active = batch.lora, True
        try:
            return self.model(batch.input_ids, batch.positions, self.cache_engine.kv_caches, batch.attn)
        finally:
            self.lora.current, self.model.lora_active = None, False

    def sample(self, sampling: SamplingMetadata, logits: torch.Tensor,
               grammar: GrammarMask | None = None) -> ModelRunnerOutput:
        result = ModelRunnerOutput()
        if grammar is not None and grammar.errors:
            result.constraint_errors = dict(grammar.errors)
        num = len(sampling.seqs)
        if num:
            for s, res in zip(sampling.seqs, self.sampler(logits[:num], sampling.seqs, grammar)):
                result.samples[s.seq_id] = res
        num_scored = len(sampling.lp_rows)
        if num_scored:
            result.prompt_logprobs = self.prompt_logprobs(sampling, logits[num : num + num_scored])
        at = num + num_scored
        for seq, rows, drafts in sampling.spec:
            kept = self.sampler.verify(logits[at : at + len(rows)], seq, drafts, self.draft_probs.get(seq.seq_id))
            result.samples[seq.seq_id] = kept[0]
            result.extra_samples[seq.seq_id] = kept[1:]
            at += len(rows)
        return result

    def prompt_logprobs(self, sampling: SamplingMetadata, logits: torch.Tensor) -> dict[int, list[TokenLogprobs]]:
        """seq_id -> the logprobs of its scored prompt tokens (each sequence's own top-k, and the token)."""
        lp = torch.log_softmax(logits, dim=-1)
        num = max(state.params.prompt_logprobs or 0 for state, _ in sampling.lp_owners)
        entries = top_logprobs(lp, num, long_tensor(sampling.lp_targets, self.device))
        out = {}
        offset = 0
        for state, count in sampling.lp_owners:
            n_i = state.params.prompt_logprobs or 0
            chunk = entries[offset : offset + count]
            targets = sampling.lp_targets[offset : offset + count]
            out[state.seq_id] = [{t: v for t, v in e.items() if v[1] <= n_i or t == tgt}
                                  for e, tgt in zip(chunk, targets)]
            offset += count
        return out


def prompt_rows(items: list[Chunk]) -> torch.Tensor | None:
    """[num_tokens] bool, in batch order: which rows are prompt tokens (None: none is, as in a step of
    decodes). A one-token row can be the prompt's last token (the rest was cached), and a prefill
    chunk can hold generated tokens (recomputed after a preemption)."""
    if all(it.start >= len(state.prompt_token_ids) for it, state in items):
        return None
    flags: list[bool] = []
    for it, state in items:
        prompt_len = len(state.prompt_token_ids)
        flags.extend(p < prompt_len for p in range(it.start, it.start + it.num_new_tokens))
    return torch.tensor(flags, dtype=torch.bool)


def is_decode(chunk: Chunk) -> bool:
    """Whether the chunk is a decode: its sequence's last generated token, with its drafts where it
    speculates. A prompt's last token left alone by a prefix-cache hit is a one-token prefill: its
    attention is then the prefill kernel's, as when the token shared a chunk with the rest of its
    prompt, so the answer does not depend on what the cache held (--batch-invariant)."""
    it, state = chunk
    return bool(it.draft_token_ids) or (it.num_new_tokens == 1 and it.start >= len(state.prompt_token_ids))
