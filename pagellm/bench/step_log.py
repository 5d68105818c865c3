"""A per-step record of the engine's batches, for benchmarks: installed on an engine as a step
observer (``StepLog.install(engine)``), it costs the engine nothing where it is not installed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class StepRecord:
    """One engine step: its model time and the shape of its batch."""

    seconds: float
    num_decode_seqs: int  # sequences that computed exactly one token
    num_prefill_tokens: int  # tokens of prompts (or recomputes) computed
    context_tokens: int  # K/V entries the decodes attended over
    # The distinct ones: a block shared by several decodes (a common prefix) counted once. Its K/V is
    # read from memory once a step at least; the other sequences may find it in the cache.
    distinct_context_tokens: int = 0
    kv_blocks_in_use: int = 0
    # Where the blocks in use reach a new high (the first step at the memory report's peak is one):
    # allocated but unused slots / allocated slots, and the sequences holding blocks, after the step.
    # None elsewhere: a pass over every sequence at every benchmarked step would weigh on its time.
    kv_fragmentation: float | None = None
    kv_sequences: int | None = None


class StepLog:
    """The engine's steps as ``records``, one ``StepRecord`` per step that ran the model."""

    def __init__(self) -> None:
        self.records: list[StepRecord] = []
        self._high = -1  # the most blocks in use after a step so far
        self._engine: Any = None

    @classmethod
    def install(cls, engine: Any) -> StepLog:
        log = cls()
        log._engine = engine
        engine.step_observers.append(log)
        return log

    def uninstall(self) -> None:
        if self._engine is not None:
            self._engine.step_observers.remove(self)
            self._engine = None

    def executed(self, engine: Any, scheduler_output: Any, seconds: float) -> None:
        """After the model ran ``scheduler_output`` (before the scheduler's update): the batch's shape."""
        decodes = [it for it in scheduler_output.scheduled if it.num_new_tokens == 1]
        context = sum(it.start + 1 for it in decodes)
        states = engine.model_runner.requests  # (the block tables as the runner ran them)
        # The first KV cache group's tables (every layer's but for Gemma's sliding ones).
        tables = [states[it.seq_id].block_tables[0] for it in decodes]
        # Shared blocks are whole blocks (only full blocks are cached and shared; a forked sequence
        # copies its last block before writing to it). Tables that share a block share their first
        # one too (cached prefixes chain from the first block, forks start as their parent): with
        # every first block distinct, nothing repeats.
        repeats = 0
        if len({table[0] for table in tables if table}) < len(decodes):
            repeats = sum(len(table) for table in tables) - len({b for table in tables for b in table})
        self.records.append(StepRecord(
            seconds=seconds,
            num_decode_seqs=len(decodes),
            num_prefill_tokens=sum(it.num_new_tokens for it in scheduler_output.scheduled) - len(decodes),
            context_tokens=context,
            distinct_context_tokens=max(0, context - repeats * engine.block_size),
        ))

    def updated(self, engine: Any) -> None:
        """After the scheduler's update: the KV blocks in use (and, at a new high, fragmentation)."""
        record = self.records[-1]
        manager = engine.kv_cache_manager
        record.kv_blocks_in_use = manager.num_used_blocks
        if record.kv_blocks_in_use > self._high:
            self._high = record.kv_blocks_in_use
            record.kv_fragmentation = engine.kv_cache_stats().internal_fragmentation
            record.kv_sequences = manager.num_sequences_with_blocks
