"""What the scheduler hands the model runner each step: plain data, as vLLM's ``v1/core/sched/output.py``.

The runner keeps its own state per sequence (``worker/request_state.py``), built from these messages:
a sequence it does not hold comes in full once (``NewSeqData``: its prompt, the tokens generated so
far, its sampling parameters and its block table in each KV cache group); after that, a step carries
only what changed in it (``CachedSeqData``: the tokens appended since, e.g. the one sampled last step,
and each group's block table edit). Whatever is per group is a list indexed by group, one entry for a
model with one group. ``ScheduledSeq`` says what the step computes of each sequence; finished and preempted ids tell
the runner what to drop (a preempted sequence comes back as new). No core ``Sequence`` crosses here:
the tensor-parallel workers receive the same data (``distributed/step_message.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (a light module: no torch either way)
    from pagellm.lora.request import LoRARequest
    from pagellm.sampling_params import SamplingParams

# One KV cache group's block moves of a step, in the order the worker runs them: (swap out: device ->
# CPU, swap in: CPU -> device, copy-on-write: device -> device), each a list of (src, dst) block ids.
BlockMoves = tuple[list[tuple[int, int]], list[tuple[int, int]], list[tuple[int, int]]]

# A draft slot of a step whose draft model proposes (``speculative_config``'s ``model``): the runner's draft
# model fills it with its token before the step's forward pass (``worker/draft_model.py``).
DRAFT_BY_MODEL = -1

# The block id of a table entry whose block fell out of the attention window (kv_cache_manager's
# OUT_OF_WINDOW): the kernels may read it but never use it.
OUT_OF_WINDOW_ID = 0


@dataclass
class DiskMoves:
    """One KV cache group's traffic with the KV tier on disk in a step (core/disk_index.py), by block hash."""

    # (block id, block hash): a cached block about to be reused; the worker copies it out before any
    # other move or the forward pass writes it, and a background thread writes its file.
    saves: list[tuple[int, int]] = field(default_factory=list)
    # (block hash, block id): read the block's file into the block, after the other moves and before
    # the forward pass (a failed read is reported back, ``ModelRunnerOutput.disk_load_failures``).
    loads: list[tuple[int, int]] = field(default_factory=list)
    # Block hashes whose files the tier evicts (deleted in order with the writes).
    deletes: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.saves or self.loads or self.deletes)


@dataclass
class TableEdit:
    """How one block table changed since the runner last saw it: entries ``[dead_from, dead_to)`` became
    the out-of-window stand-in, then the table was cut to its first ``keep`` entries and ``block_ids``
    appended (a new block; the block the next token goes into, copied on write; or, with ``keep`` 0,
    a table the KV cache manager replaced)."""

    keep: int
    block_ids: list[int]
    dead_from: int = 0
    dead_to: int = 0


def apply_table_edit(table: list[int], edit: TableEdit) -> None:
    """Bring ``table`` (block ids) up to date with ``edit``, in place."""
    for i in range(edit.dead_from, min(edit.dead_to, edit.keep)):
        table[i] = OUT_OF_WINDOW_ID
    del table[edit.keep:]
    table.extend(edit.block_ids)


@dataclass
class NewSeqData:
    """A sequence the runner does not hold (first scheduled, or back after a preemption): all it reads."""

    seq_id: int
    prompt_token_ids: list[int]
    # Tokens generated so far (none for a fresh sequence; a preempted one keeps its own).
    output_token_ids: list[int]
    # None in a tensor-parallel worker's copy of the step: it never samples.
    sampling_params: SamplingParams | None
    seed: int | None
    block_tables: list[list[int]]  # [group][i]: block ids
    # The LoRA adapter the sequence runs with (None: the base model).
    lora_request: LoRARequest | None = None


@dataclass
class CachedSeqData:
    """What changed in a sequence the runner holds since it was last told (sent only where something did)."""

    seq_id: int
    # Tokens appended to the sequence since: the one sampled last step, the drafts it kept.
    new_token_ids: list[int] = field(default_factory=list)
    # Each group's block table edit (None: unchanged); empty when no table changed.
    block_edits: list[TableEdit | None] = field(default_factory=list)


@dataclass
class ForkedSeq:
    """An ``n > 1`` child that forks from its parent once the prompt is done: it starts as a copy of the
    parent's state (tokens, sampling parameters) with its own seed, and its block tables come with its
    first step."""

    seq_id: int
    seed: int | None  # None in a tensor-parallel worker's copy


@dataclass
class ScheduledSeq:
    """One sequence's share of a step: tokens ``[start, start + num_new_tokens)``."""

    seq_id: int
    start: int
    num_new_tokens: int
    # True when this step reaches the sequence's last token, so it yields a new token.
    sample: bool
    # Prompt positions in this chunk whose next-token logprob is wanted: [from, to).
    prompt_logprobs_range: tuple[int, int] | None = None
    # n > 1: children that fork from this sequence once its prompt is done; each samples its
    # own first token from the same logits.
    fork_children: list[ForkedSeq] = field(default_factory=list)
    # Speculative decoding: draft tokens computed after the sequence's last token in this step
    # (positions start + 1, ...); num_new_tokens counts them. The worker keeps those its sampling agrees with.
    # With a draft model, ``DRAFT_BY_MODEL`` each: the runner's draft model proposes them in the step.
    draft_token_ids: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    # What the runner learns this step, applied before it computes anything (``RequestStates.apply``).
    new_seqs: list[NewSeqData] = field(default_factory=list)
    cached_seqs: list[CachedSeqData] = field(default_factory=list)
    num_batched_tokens: int = 0
    # Preempted this step: the runner drops their state (they come back as new).
    preempted_seq_ids: list[int] = field(default_factory=list)
    # Sequences finished since the last step: the worker drops their per-sequence state.
    finished_seq_ids: list[int] = field(default_factory=list)
    # Each KV cache group's block moves, run before the forward pass (in its own pools' block ids).
    block_moves: list[BlockMoves] = field(default_factory=list)
    # Each KV cache group's saves to, loads from and deletes in the KV tier on disk (empty without one).
    disk_moves: list[DiskMoves] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        """Nothing to compute and no block to move."""
        return not (self.scheduled or self.moves_blocks)

    @property
    def moves_blocks(self) -> bool:
        return any(any(moves) for moves in self.block_moves) or any(self.disk_moves)

    @property
    def swaps_in(self) -> bool:
        """Whether a sequence's blocks come back from the swap pool this step."""
        return any(into for _, into, _ in self.block_moves)

    def withdraw(self, seq_id: int) -> ScheduledSeq:
        """Take a sequence's entry, and what it told the runner, out of this step (it is preempted next)."""
        entry = next(e for e in self.scheduled if e.seq_id == seq_id)
        self.scheduled.remove(entry)
        self.new_seqs = [d for d in self.new_seqs if d.seq_id != seq_id]
        self.cached_seqs = [d for d in self.cached_seqs if d.seq_id != seq_id]
        return entry
