"""What the scheduler hands the model runner each step (as vLLM's ``v1/core/sched/output.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagellm.core.sequence import Sequence

# One KV cache group's block moves of a step: (swap out, swap in, copy), each a list of (src, dst).
BlockMoves = tuple[list[tuple[int, int]], list[tuple[int, int]], list[tuple[int, int]]]


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
    prompt_logprobs_range: tuple[int, int] | None = None
    # n > 1: children that fork from this sequence once its prompt is done; each samples its
    # own first token from the same logits.
    fork_children: list[Sequence] = field(default_factory=list)
    # Models with several KV cache groups (Gemma: sliding and full-attention layers): the block tables
    # of groups 1, 2, ... (``block_table`` is group 0's); empty with one group.
    group_block_tables: tuple[list[int], ...] = ()
    # Speculative decoding: draft tokens computed after the sequence's last token in this step
    # (positions start + 1, ...); num_new_tokens counts them. The worker keeps those its sampling agrees with.
    draft_token_ids: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted: list[Sequence] = field(default_factory=list)
    # Sequences finished since the last step: the worker drops their per-sequence state.
    finished_seq_ids: list[int] = field(default_factory=list)
    # Block moves the worker runs before the forward pass, in this order:
    # device -> CPU (swap out), CPU -> device (swap in), device -> device (copy-on-write).
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # Several KV cache groups: the moves above are group 0's; these, groups 1, 2, ...'s, each
    # (swap out, swap in, copy) in its own pools' block ids. Empty with one group.
    group_block_moves: list[BlockMoves] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        """Nothing to compute and no block to move."""
        return not (self.scheduled or self.blocks_to_swap_out or self.blocks_to_swap_in or self.blocks_to_copy
                    or any(any(moves) for moves in self.group_block_moves))
