"""Continuous batching: every step hands out a token budget, running sequences first.

There is no prefill or decode phase: a sequence has ``num_computed_tokens`` and the
scheduler gives it ``num_tokens - num_computed_tokens`` more (capped by the budget
when chunked prefill is on). When blocks run out, the most recently admitted
running sequence is preempted by recompute: its blocks are freed and it goes back
to the front of the waiting queue, keeping the tokens it generated.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Optional

from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.sequence import Request, Sequence, SequenceStatus

logger = logging.getLogger(__name__)

# {token_id: (logprob, rank)}; rank 1 is the most likely token.
TokenLogprobs = dict[int, tuple[float, int]]


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    # Largest prefill chunk of one prompt in one step; None: the whole budget.
    prefill_chunk_size: Optional[int] = None


@dataclass
class ScheduledSeq:
    """One sequence's share of a step: tokens ``[start, start + num_new_tokens)``."""

    seq: Sequence
    start: int
    num_new_tokens: int
    block_table: list[int]
    # True when this step reaches the sequence's last token, so it yields a new token.
    sample: bool
    # Prompt positions in this chunk whose next-token logprob is wanted: [from, to).
    prompt_logprobs_range: Optional[tuple[int, int]] = None
    # n > 1: children that fork from this sequence once its prompt is done; each samples its
    # own first token from the same logits.
    fork_children: list[Sequence] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted: list[Sequence] = field(default_factory=list)
    # Sequences finished since the last step: the worker drops their per-sequence state.
    finished_seq_ids: list[int] = field(default_factory=list)
    # Copy-on-write block copies (src, dst) the worker runs before the forward pass.
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SampleResult:
    token_id: int
    logprob: float
    top_logprobs: Optional[TokenLogprobs] = None


@dataclass
class ModelRunnerOutput:
    samples: dict[int, SampleResult] = field(default_factory=dict)
    # seq_id -> logprobs of the prompt tokens at the positions asked for in this step.
    prompt_logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    num_steps: int = 0


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache: KVCacheManager,
        eos_token_ids: Iterable[int] = (),
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.eos_token_ids = frozenset(eos_token_ids)
        self.clock = clock
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.stats = SchedulerStats()
        self._finished_seq_ids: list[int] = []

    # ----------------------------------------------------------------- queues
    def add_request(self, request: Request) -> None:
        # Only the first sequence runs the prompt; its n - 1 siblings fork from it afterwards.
        request.seqs[0].status = SequenceStatus.WAITING
        self.waiting.append(request.seqs[0])

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # --------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        out = SchedulerOutput(finished_seq_ids=self._finished_seq_ids)
        self._finished_seq_ids = []
        budget = cfg.max_num_batched_tokens
        chunk_cap = cfg.prefill_chunk_size or budget

        # 1. Running sequences first, in admission order.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_uncomputed_tokens, budget, chunk_cap)
            while not self.kv_cache.allocate_slots(seq, num_new):
                victim = self.running.pop()  # the most recently admitted
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break  # it preempted itself: nothing after it remains either
            out.scheduled.append(self._scheduled(seq, num_new))
            budget -= num_new
            i += 1

        # 2. Then waiting ones, FCFS; not in a step that had to preempt (no room to spare).
        while not out.preempted and self.waiting and budget > 0:
            seq = self.waiting[0]
            # A first admission brings its unforked siblings along: they need seats too.
            seats = 1 + (len(seq.request.pending_children) if seq.index == 0 else 0)
            if len(self.running) + seats > cfg.max_num_seqs:
                break
            hits = self.kv_cache.find_cached_prefix(seq) if self._may_use_prefix_cache(seq) else []
            hit_tokens = len(hits) * self.kv_cache.block_size
            num_new = seq.num_tokens - seq.num_computed_tokens - hit_tokens
            if num_new > budget and not cfg.enable_chunked_prefill:
                break
            num_new = min(num_new, budget, chunk_cap)
            if not self.kv_cache.allocate_slots(seq, num_new, hits):
                break
            self.waiting.popleft()
            if not seq.was_admitted:
                seq.was_admitted = True
                seq.num_cached_tokens = hit_tokens
                self.kv_cache.count_prefix_query(seq, hit_tokens)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            times = seq.request.metrics
            if times.first_scheduled_time is None:
                times.first_scheduled_time = self.clock()
            out.scheduled.append(self._scheduled(seq, num_new))
            budget -= num_new

        out.num_batched_tokens = cfg.max_num_batched_tokens - budget
        out.blocks_to_copy = self.kv_cache.take_pending_copies()
        self.stats.num_steps += 1
        return out

    @staticmethod
    def _may_use_prefix_cache(seq: Sequence) -> bool:
        # Prompt logprobs need every prompt position computed: no skipping them via the cache.
        request = seq.request
        return not (request.wants_prompt_logprobs and len(request.prompt_logprobs) < seq.num_prompt_tokens)

    def _scheduled(self, seq: Sequence, num_new: int) -> ScheduledSeq:
        start = seq.num_computed_tokens
        end = start + num_new
        lp_range = None
        request = seq.request
        # Prompt logprobs come from the first sequence, once: a recompute skips them.
        if request.wants_prompt_logprobs and seq.index == 0:
            # Position p's logits score prompt token p + 1; already done: len - 1 of them.
            lo = max(start, len(request.prompt_logprobs) - 1 if request.prompt_logprobs else 0)
            hi = min(end, seq.num_prompt_tokens - 1)
            if hi > lo:
                lp_range = (lo, hi)
        sample = end == seq.num_tokens
        return ScheduledSeq(
            seq=seq,
            start=start,
            num_new_tokens=num_new,
            block_table=self.kv_cache.block_table(seq),
            sample=sample,
            prompt_logprobs_range=lp_range,
            fork_children=list(request.pending_children) if sample and seq.index == 0 else [],
        )

    def _preempt(self, seq: Sequence) -> None:
        usage_before = self.kv_cache.usage
        freed = self.kv_cache.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        seq.request.metrics.num_preemptions += 1
        self.stats.num_preemptions += 1
        logger.info(
            "preempt request_id=%s seq_id=%d mode=recompute blocks_freed=%d tokens_to_recompute=%d "
            "kv_usage_before=%.3f kv_usage_after=%.3f",
            seq.request.request_id, seq.seq_id, freed, seq.num_tokens, usage_before, self.kv_cache.usage,
        )

    # ----------------------------------------------------------------- update
    def update(self, out: SchedulerOutput, result: ModelRunnerOutput) -> list[Sequence]:
        """Apply a step's results: advance computed tokens, append samples, stop checks.

        Returns the sequences that got a new token (finished ones included).
        """
        touched: list[Sequence] = []
        now = None
        for item in out.scheduled:
            seq = item.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue
            seq.num_computed_tokens += item.num_new_tokens
            self.kv_cache.cache_full_blocks(seq)
            plps = result.prompt_logprobs.get(seq.seq_id)
            if plps:
                if not seq.request.prompt_logprobs:
                    seq.request.prompt_logprobs.append(None)  # the first token has no logprob
                seq.request.prompt_logprobs.extend(plps)
            if not item.sample:
                continue
            for child in item.fork_children:  # before the parent may finish and free its blocks
                self._fork(seq, child)
            for s in (seq, *item.fork_children):
                sample = result.samples[s.seq_id]
                s.output_token_ids.append(sample.token_id)
                s.cumulative_logprob += sample.logprob
                if sample.top_logprobs is not None:
                    s.output_logprobs.append(sample.top_logprobs)
                times = s.request.metrics
                if times.first_token_time is None:
                    now = now or self.clock()
                    times.first_token_time = now
                self._check_stop(s, sample.token_id)
                touched.append(s)
        return touched

    def _fork(self, parent: Sequence, child: Sequence) -> None:
        request = parent.request
        request.pending_children.remove(child)
        self.kv_cache.fork(parent, child)
        child.was_admitted = True
        child.num_cached_tokens = parent.num_cached_tokens
        child.status = SequenceStatus.RUNNING
        self.running.append(child)

    def _check_stop(self, seq: Sequence, token_id: int) -> None:
        params = seq.params
        if seq.num_output_tokens >= params.min_tokens:
            if token_id in params.stop_token_ids:
                seq.stop_reason = token_id
                self.finish_seq(seq, SequenceStatus.FINISHED_STOPPED)
                return
            if not params.ignore_eos and token_id in self.eos_token_ids:
                self.finish_seq(seq, SequenceStatus.FINISHED_STOPPED)
                return
        if (params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens) or (
            seq.num_tokens >= self.config.max_model_len
        ):
            self.finish_seq(seq, SequenceStatus.FINISHED_LENGTH)

    # ----------------------------------------------------------- finish/abort
    def finish_seq(self, seq: Sequence, status: SequenceStatus) -> None:
        """End ``seq`` in any state and return its blocks at once."""
        if seq.is_finished:
            return
        if seq in seq.request.pending_children:
            seq.request.pending_children.remove(seq)
        elif seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass  # not yet added
        seq.status = status
        self.kv_cache.free(seq)
        self._finished_seq_ids.append(seq.seq_id)
        request = seq.request
        if request.is_finished and request.metrics.finished_time is None:
            request.metrics.finished_time = self.clock()

    def abort_request(self, request: Request) -> None:
        for seq in request.seqs:
            self.finish_seq(seq, SequenceStatus.FINISHED_ABORTED)
