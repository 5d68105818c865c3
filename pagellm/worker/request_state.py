"""The model runner's own state per sequence, kept up to date from each step's ``SchedulerOutput``.

The scheduler sends a sequence whole once (``NewSeqData``) and then only what changed
(``CachedSeqData``); this is where the runner keeps the result: the sequence's tokens (what a
prefill and a decode compute, the targets of prompt logprobs, what penalties and grammars read),
its sampling parameters and seed, and its block table in each KV cache group. Finished and
preempted sequences are dropped.
Every tensor-parallel rank keeps the same state from the same messages (without the sampling
parameters: only rank 0 samples).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from pagellm.core.sched_output import ForkedSeq, NewSeqData, SchedulerOutput, apply_table_edit
from pagellm.core.token_lists import TokenLists
from pagellm.sampling_params import SamplingParams


@dataclass(eq=False)
class SeqState(TokenLists):
    """One sequence as the runner knows it (the worker's counterpart of core's ``Sequence``)."""

    seq_id: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams | None  # None on a tensor-parallel worker
    seed: int | None
    block_tables: list[list[int]]  # [group][i]: block ids
    lora_id: int = 0  # the LoRA adapter's lora_int_id (0: the base model)

    @classmethod
    def from_new(cls, new: NewSeqData) -> SeqState:
        lora = new.lora_request
        return cls(new.seq_id, new.prompt_token_ids, list(new.output_token_ids), new.sampling_params, new.seed,
                   [list(t) for t in new.block_tables], lora.lora_int_id if lora is not None else 0)

    def fork(self, child: ForkedSeq) -> SeqState:
        """An ``n > 1`` child's state as it forks: this sequence's tokens and parameters, its own seed;
        its block tables come with its first step."""
        return SeqState(child.seq_id, self.prompt_token_ids, list(self.output_token_ids), self.sampling_params,
                        child.seed, [[] for _ in self.block_tables], self.lora_id)

    @property
    def params(self) -> SamplingParams:
        if self.sampling_params is None:
            raise RuntimeError(f"seq {self.seq_id}: a tensor-parallel worker holds no sampling parameters")
        return self.sampling_params

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)



class RequestStates:
    """Every sequence the runner holds, by id."""

    def __init__(self) -> None:
        self._seqs: dict[int, SeqState] = {}

    def __getitem__(self, seq_id: int) -> SeqState:
        return self._seqs[seq_id]

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def __iter__(self) -> Iterator[SeqState]:
        return iter(self._seqs.values())

    def apply(self, out: SchedulerOutput) -> None:
        """Take in a step's news, before anything of it is computed: drop the finished and preempted
        sequences, add the new ones (replacing any stale state under their id), apply each cached one's
        changes, and start each forked child from its parent."""
        seqs = self._seqs
        for seq_id in out.finished_seq_ids:
            seqs.pop(seq_id, None)
        for seq_id in out.preempted_seq_ids:
            seqs.pop(seq_id, None)
        for new in out.new_seqs:
            seqs[new.seq_id] = SeqState.from_new(new)
        for cached in out.cached_seqs:
            state = seqs[cached.seq_id]
            if cached.new_token_ids:
                state.output_token_ids.extend(cached.new_token_ids)
            for table, edit in zip(state.block_tables, cached.block_edits):
                if edit is not None:
                    apply_table_edit(table, edit)
        for item in out.scheduled:
            if item.fork_children:
                parent = seqs[item.seq_id]
                for child in item.fork_children:
                    seqs[child.seq_id] = parent.fork(child)
