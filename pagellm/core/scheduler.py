"""Continuous batching: every step hands out a token budget, running sequences first.

There is no prefill or decode phase: a sequence has ``num_computed_tokens`` and the
scheduler gives it ``num_tokens - num_computed_tokens`` more (capped by the budget and
``prefill_chunk_size`` when chunked prefill is on). Each step:

1. (``priority`` policy) if the most urgent waiting request does not fit, strictly less
   urgent running ones are preempted to make room;
2. running sequences get their tokens, decodes before prefill chunks; when blocks run out,
   the least urgent running sequence (the latest arrival under ``fcfs``) is preempted, and
   if it was scheduled earlier in the step its tokens go back to the budget;
3. swapped-out sequences come back before new requests (under ``priority``, before less
   urgent ones): the next one's swap-in is issued a step ahead of its scheduling, so its
   blocks are in place when it runs;
4. waiting sequences are admitted in policy order while budget, seats and blocks last.

Preemption swaps the sequence's blocks to the CPU pool (``swap``, or ``auto`` while the
pool has room) or frees them to be recomputed later (``recompute``); either way the
sequence keeps the tokens it generated.

The KV cache manager answers for every KV cache group at once (``kv_cache_manager.py``; Gemma's
sliding and full-attention layers are two): a sequence gets its blocks, is admitted or swapped in
only when every group has room, and the runner is told every group's block table (``runner_view.py``).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.lora_limit import adapter_ids, lora_fits
from pagellm.core.policy import SchedulingPolicy, make_policy, met_slos
from pagellm.core.prefix_hits import prefix_hit, starts_disk_read
from pagellm.core.runner_output import ModelRunnerOutput, SampleResult
from pagellm.core.runner_view import RunnerView
from pagellm.core.sched_output import SchedulerOutput
from pagellm.core.sequence import Request, Sequence, SequenceStatus
from pagellm.core.speculation import SpeculativeConfig, Speculator

logger = logging.getLogger(__name__)


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    # Largest prefill chunk of one prompt in one step; None: the whole budget.
    prefill_chunk_size: int | None = None
    scheduling_policy: str = "fcfs"
    preemption_mode: str = "auto"  # swap, recompute, or auto (swap while the CPU pool has room)
    default_ttft_slo: float | None = None
    default_tpot_slo: float | None = None
    # A sequence that grows past this length is computed again from its first token (the long factors
    # of a longrope model, as transformers' generate does); None: never.
    recompute_past_length: int | None = None
    # Speculative decoding (n-gram drafts); None: off.
    speculative: SpeculativeConfig | None = None
    # Most distinct LoRA adapters among the running sequences (--max-loras); None: LoRA off.
    max_loras: int | None = None


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    num_swap_outs: int = 0
    num_recomputes: int = 0
    num_steps: int = 0
    # Prefill chunks that stopped short of the prompt's end (chunked prefill at work).
    num_partial_prefills: int = 0
    # SLA attainment: finished (not aborted) requests that had targets, and those that met them.
    sla_finished: int = 0
    sla_met: int = 0
    # Tokens sampled (every sequence's, best_of's discarded samples too), and prompt tokens of
    # requests whose prefill completed (counted at their first token, once per request).
    num_generated_tokens: int = 0
    num_prompt_tokens: int = 0
    # Speculative decoding: sequence-steps that carried drafts, drafts proposed, drafts accepted.
    num_spec_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def sla_attainment(self) -> float | None:
        return self.sla_met / self.sla_finished if self.sla_finished else None


class Scheduler:
    """Decides each step's batch: owns the waiting, running and swapped queues and the token budget,
    and through ``KVCacheManager`` every block the sequences hold.

    Invariants: a sequence is in at most one queue (``held`` during step isolation counts as one); a
    running sequence holds blocks for every token it has computed; a waiting one holds none; a
    swapped one holds CPU blocks only; a step never schedules more than ``max_num_batched_tokens``
    tokens or ``max_num_seqs`` sequences; ``update`` is the only place computed tokens advance.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        eos_token_ids: Iterable[int] = (),
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.eos_token_ids = frozenset(eos_token_ids)
        self.clock = clock
        self.policy: SchedulingPolicy = make_policy(config.scheduling_policy, config.default_ttft_slo)
        # Waiting and swapped queues, kept sorted by the policy's key (most urgent first).
        self.waiting: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.running: list[Sequence] = []
        # Sequences held out of scheduling, in their state, while others run alone (step_isolation.py).
        self.held: list[Sequence] = []
        self.stats = SchedulerStats()
        # Every sequence of the requests added, by id, until the schedule after it finished.
        self.seqs_by_id: dict[int, Sequence] = {}
        self._finished_seq_ids: list[int] = []
        # What the model runner holds of each sequence: a step's output says only what changed.
        self.runner_view = RunnerView(kv_cache_manager)
        self._speculator = Speculator(config.speculative, config.max_model_len) if config.speculative else None

    # ----------------------------------------------------------------- queues
    def add_request(self, request: Request) -> None:
        # Only the first sequence runs the prompt; its n - 1 siblings fork from it afterwards.
        request.seqs[0].status = SequenceStatus.WAITING
        self.seqs_by_id.update((s.seq_id, s) for s in request.seqs)
        self._enqueue(self.waiting, request.seqs[0])

    def _enqueue(self, queue: list[Sequence], seq: Sequence) -> None:
        bisect.insort(queue, seq, key=self.policy.key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self.held)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # --------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        out = SchedulerOutput(finished_seq_ids=self._finished_seq_ids)
        self._finished_seq_ids = []
        for seq_id in out.finished_seq_ids:
            self.seqs_by_id.pop(seq_id, None)
        budget = cfg.max_num_batched_tokens
        chunk_cap = cfg.prefill_chunk_size or budget
        if self.kv_cache_manager.loads_in_flight:  # the step that read them raised: recompute instead
            self.kv_cache_manager.finish_disk_loads(None)

        # 1. Make room for an urgent waiting request by preempting less urgent running ones.
        if self.policy.preempts_for_urgent and self.waiting and not self._swapped_first():
            self._preempt_for_urgent(out, budget, chunk_cap)

        # 2. Running sequences first, in admission order, decodes before prefill chunks: a long
        #    prompt's chunk must not take the budget of a sequence behind it that needs one token
        #    (forked children and swapped-in sequences join the end of the list).
        self.running.sort(key=lambda s: s.num_uncomputed_tokens > 1)
        grew_short = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_uncomputed_tokens, budget, chunk_cap)
            drafts = self._drafts(seq, budget) if num_new == 1 else []
            if drafts and not self.kv_cache_manager.allocate_slots(seq, 1 + len(drafts)):
                drafts = []  # no block to spare for them: a plain decode
            elif drafts:
                num_new = 1 + len(drafts)
            while not drafts and not self.kv_cache_manager.allocate_slots(seq, num_new):
                # The least urgent running sequence (seq itself included) makes room, even one already
                # scheduled this step: its entry is withdrawn and its budget returned (as in vLLM).
                victim = max(self.running, key=self.policy.key)
                at = self.running.index(victim)
                self.running.pop(at)
                if at < i:
                    i -= 1
                    budget += self._withdraw(victim, out)
                self._preempt(victim, out)
                grew_short = True
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # it preempted itself; running[i] is now the next one
            self._scheduled(seq, num_new, out, drafts)
            budget -= num_new
            i += 1

        # 3. Swapped sequences come back before less urgent waiting ones; 4. then waiting ones, in
        #    policy order. Neither in a step that was short of blocks: there is no room to spare.
        if not grew_short:
            if self._swapped_first():
                self._swap_in_next()
            else:
                budget = self._admit_waiting(out, budget, chunk_cap)

        out.num_batched_tokens = cfg.max_num_batched_tokens - budget
        out.block_moves = self.kv_cache_manager.take_block_moves()
        out.disk_moves = self.kv_cache_manager.take_disk_moves()
        self.stats.num_steps += 1
        return out

    def _withdraw(self, seq: Sequence, out: SchedulerOutput) -> int:
        """Take ``seq``'s entry out of this step's schedule; returns the tokens it had."""
        entry = out.withdraw(seq.seq_id)
        if not entry.sample:
            self.stats.num_partial_prefills -= 1
        return entry.num_new_tokens

    def _swapped_first(self) -> bool:
        """Whether the swapped sequences come back before the waiting ones. They do (they have
        streamed tokens already), except under a policy that preempts for urgency, where a more
        urgent waiting request goes first: the sequence it just displaced must not come straight
        back in its place."""
        if not self.swapped:
            return False
        if not self.policy.preempts_for_urgent or not self.waiting:
            return True
        return self.policy.key(self.swapped[0]) <= self.policy.key(self.waiting[0])

    @staticmethod
    def _seats(seq: Sequence) -> int:
        """Running slots ``seq`` takes: itself, and as a first sequence its siblings not forked yet."""
        return 1 + (len(seq.request.pending_children) if seq.index == 0 else 0)

    def _seats_taken(self) -> int:
        return sum(self._seats(s) for s in self.running)

    def _admit_waiting(self, out: SchedulerOutput, budget: int, chunk_cap: int) -> int:
        cfg = self.config
        taken = self._seats_taken()
        loras = adapter_ids(self.running)
        at = 0  # (past the sequences whose adapter cannot join this step's)
        while at < len(self.waiting) and budget > 0:
            seq = self.waiting[at]
            if not lora_fits(seq, loras, cfg.max_loras):
                at += 1
                continue
            seats = self._seats(seq)
            if taken + seats > cfg.max_num_seqs:
                break
            hits = prefix_hit(self.kv_cache_manager, seq)
            if starts_disk_read(self.kv_cache_manager, seq, hits, self._decode_reserve()):
                break  # admitted once its blocks are read, next step
            hit_tokens = hits.num_blocks * self.kv_cache_manager.block_size
            num_new = seq.num_tokens - seq.num_computed_tokens - hit_tokens
            if num_new > budget and not cfg.enable_chunked_prefill:
                break
            num_new = min(num_new, budget, chunk_cap)
            if not self.kv_cache_manager.allocate_slots(seq, num_new, hits):
                # Blocks read from disk for sequences behind it must not keep it waiting; nor its own, when
                # nothing running will free blocks (it reads them again later).
                if self.kv_cache_manager.release_staged(keep=seq):
                    continue
                if not self.running and self.kv_cache_manager.release_staged():
                    continue
                break
            self.waiting.pop(at)
            loras |= adapter_ids([seq])
            if not seq.was_admitted:
                seq.was_admitted = True
                seq.num_cached_tokens = hit_tokens
                self.kv_cache_manager.count_prefix_query(seq, hit_tokens)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            taken += seats
            times = seq.request.metrics
            if times.first_scheduled_time is None:
                times.first_scheduled_time = self.clock()
            self._scheduled(seq, num_new, out)
            budget -= num_new
        return budget

    def _preempt_for_urgent(self, out: SchedulerOutput, budget: int, chunk_cap: int) -> None:
        head = self.waiting[0]
        key = self.policy.key
        seats = self._seats(head)
        hits = prefix_hit(self.kv_cache_manager, head)
        num_new = min(head.num_tokens - head.num_computed_tokens - hits.num_blocks * self.kv_cache_manager.block_size,
                      budget, chunk_cap)

        def fits() -> bool:
            return (self._seats_taken() + seats <= self.config.max_num_seqs
                    and self.kv_cache_manager.can_admit(head, num_new, hits, self._decode_reserve()))

        while not fits() and self.running:
            victim = max(self.running, key=key)
            if key(victim) <= key(head):
                break  # never preempt for an equally or less urgent request
            self.running.remove(victim)
            self._preempt(victim, out)

    def _decode_reserve(self) -> int:
        """Blocks the running sequences may need this step (one each at a block boundary)."""
        bs = self.kv_cache_manager.block_size
        return sum(1 for s in self.running if s.num_computed_tokens % bs == 0)

    def _swap_in_next(self) -> None:
        """Bring the most urgent swapped sequence back if it fits, leaving room for the running ones."""
        seq = self.swapped[0]
        if (self._seats_taken() + self._seats(seq) > self.config.max_num_seqs
                or not lora_fits(seq, adapter_ids(self.running), self.config.max_loras)):
            return
        if not self.kv_cache_manager.swap_in(seq, reserve=self._decode_reserve()):
            return
        self.swapped.pop(0)
        seq.status = SequenceStatus.RUNNING
        # Scheduled from the next step on; the worker copies its blocks back in this one.
        self.running.append(seq)

    def _drafts(self, seq: Sequence, budget: int) -> list[int]:
        """The draft tokens ``seq`` carries into this decode step ([] where it speculates not)."""
        # (A longrope model recomputes a sequence the step its length crosses the switch: one token a step.)
        if self._speculator is None or self.config.recompute_past_length is not None:
            return []
        return self._speculator.propose(seq, budget, len(self.running), self.stats.num_steps)

    def _scheduled(self, seq: Sequence, num_new: int, out: SchedulerOutput, drafts: list[int] | None = None) -> None:
        if not self.runner_view.schedule(seq, num_new, drafts or [], out).sample:
            self.stats.num_partial_prefills += 1

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Swap ``seq`` out to the CPU pool, or free its blocks for a later recompute."""
        usage_before = self.kv_cache_manager.usage
        mode = self.config.preemption_mode
        swap = mode != "recompute" and self.kv_cache_manager.can_swap_out(seq)
        if swap:
            moved = self.kv_cache_manager.swap_out(seq)
            seq.status = SequenceStatus.SWAPPED
            self._enqueue(self.swapped, seq)
            self.stats.num_swap_outs += 1
            detail = f"mode=swap blocks_moved={moved}"
        else:
            if mode == "swap":
                logger.warning("swap pool full: preempting seq %d by recompute instead", seq.seq_id)
            freed = self.kv_cache_manager.free(seq)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
            self._enqueue(self.waiting, seq)
            self.stats.num_recomputes += 1
            detail = f"mode=recompute blocks_freed={freed} tokens_to_recompute={seq.num_tokens}"
        seq.request.metrics.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.runner_view.forget(seq.seq_id)
        out.preempted_seq_ids.append(seq.seq_id)
        logger.info(
            "preempt request_id=%s seq_id=%d %s kv_usage_before=%.3f kv_usage_after=%.3f",
            seq.request.request_id, seq.seq_id, detail, usage_before, self.kv_cache_manager.usage,
        )

    # ----------------------------------------------------------------- update
    def update(self, out: SchedulerOutput, result: ModelRunnerOutput) -> list[Sequence]:
        """Apply a step's results: advance computed tokens, append samples, stop checks.

        Returns the sequences that got a new token (finished ones included).
        """
        self.kv_cache_manager.finish_disk_loads(result.disk_load_failures)
        touched: list[Sequence] = []
        now = None
        seqs = self.seqs_by_id
        for seq_id, why in result.constraint_errors.items():  # read by the stop check
            seqs[seq_id].constraint_error = why
        for item in out.scheduled:
            seq = seqs[item.seq_id]
            if seq.status is not SequenceStatus.RUNNING:
                continue
            drafts = len(item.draft_token_ids)
            seq.num_computed_tokens += item.num_new_tokens - drafts  # (accepted drafts: below)
            self.kv_cache_manager.cache_full_blocks(seq)
            self.kv_cache_manager.free_out_of_window(seq)
            if item.prompt_logprobs_range is not None:  # the runner scored them; the engine keeps them
                seq.request.num_scored_prompt_tokens = item.prompt_logprobs_range[1]
            if not item.sample:
                continue
            children = [seqs[c.seq_id] for c in item.fork_children] if item.fork_children else []
            for child in children:  # before the parent may finish and free its blocks
                self._fork(seq, child)
            for s in (seq, *children):
                sample = result.samples[s.seq_id]
                self._append(s, sample)
                times = s.request.metrics
                if times.first_token_time is None:
                    now = now or self.clock()
                    times.first_token_time = now
                    self.stats.num_prompt_tokens += len(s.request.prompt_token_ids)
                touched.append(s)
                if drafts:
                    self._append_accepted(s, drafts, result.extra_samples.get(s.seq_id, []))
                self._recompute_if_past_switch(s)
        return touched

    def _append(self, seq: Sequence, sample: SampleResult) -> None:
        seq.output_token_ids.append(sample.token_id)
        self.stats.num_generated_tokens += 1
        if sample.logprob is not None:
            seq.cumulative_logprob += sample.logprob
        if sample.top_logprobs is not None:
            seq.output_logprobs.append(sample.top_logprobs)
        self._check_stop(seq, sample.token_id)

    def _append_accepted(self, seq: Sequence, drafts: int, extra: list[SampleResult]) -> None:
        """The tokens a speculative step kept after its first: each accepted draft's K/V is computed."""
        accepted = len(extra)  # (the first token kept was a draft where more followed it)
        for sample in extra:
            if seq.status is not SequenceStatus.RUNNING:
                break  # stopped inside the step: the rest is dropped
            self._append(seq, sample)
        seq.num_computed_tokens += accepted
        self.kv_cache_manager.cache_full_blocks(seq)
        self.stats.num_spec_drafts += 1
        self.stats.num_draft_tokens += drafts
        self.stats.num_accepted_tokens += accepted
        if self._speculator is not None:
            self._speculator.record(seq, drafts, accepted, self.stats.num_steps)

    def _recompute_if_past_switch(self, seq: Sequence) -> None:
        """Send ``seq`` back to be computed from its first token when this token took it past
        ``recompute_past_length`` (its earlier tokens were computed on the other side of it)."""
        switch = self.config.recompute_past_length
        if switch is None or seq.status is not SequenceStatus.RUNNING or seq.num_tokens != switch + 1 \
                or seq.num_computed_tokens > switch:
            return
        self.running.remove(seq)
        freed = self.kv_cache_manager.free(seq)
        seq.block_keys.clear()  # the prefix keys change side with the sequence
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self._enqueue(self.waiting, seq)
        logger.info("seq %d passed %d tokens, where the model's rotary factors change: computed again from its "
                    "first token (%d blocks freed)", seq.seq_id, switch, freed)

    def _fork(self, parent: Sequence, child: Sequence) -> None:
        request = parent.request
        request.pending_children.remove(child)
        self.kv_cache_manager.fork(parent, child)
        child.was_admitted = True
        child.num_cached_tokens = parent.num_cached_tokens
        child.status = SequenceStatus.RUNNING
        self.running.append(child)

    def _check_stop(self, seq: Sequence, token_id: int) -> None:
        params = seq.params
        if seq.constraint_error is not None:
            self.finish_seq(seq, SequenceStatus.FINISHED_ERROR)
            return
        if seq.num_output_tokens >= params.min_tokens:
            if params.stop_token_ids and token_id in params.stop_token_ids:
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
        elif seq in self.held:
            self.held.remove(seq)
        elif seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = status
        self.kv_cache_manager.free(seq)
        if self._speculator is not None:
            self._speculator.forget(seq)
        self.runner_view.forget(seq.seq_id)
        self._finished_seq_ids.append(seq.seq_id)
        request = seq.request
        if request.is_finished and request.metrics.finished_time is None:
            request.metrics.finished_time = self.clock()
            if status is not SequenceStatus.FINISHED_ABORTED:
                met = met_slos(request, self.config.default_ttft_slo, self.config.default_tpot_slo)
                if met is not None:
                    self.stats.sla_finished += 1
                    self.stats.sla_met += int(met)

    def abort_request(self, request: Request) -> None:
        for seq in request.seqs:
            self.finish_seq(seq, SequenceStatus.FINISHED_ABORTED)
