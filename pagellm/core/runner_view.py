"""What the model runner holds of each sequence, as core last told it: so that each step's
``SchedulerOutput`` carries only what changed (vLLM's scheduler keeps the same account of its workers).

A sequence the runner does not hold goes out whole (``NewSeqData``): the first time it is scheduled,
and again after a preemption or a reset (the runner dropped it, or a failed step may have left it out
of step). After that, a step sends a ``CachedSeqData`` only where something changed: the tokens
appended since (the one sampled last step, the drafts kept) and each block table's edit. While the KV
cache manager keeps a table (the same list), it changes in three ways: blocks appended, the block
the next token goes into copied on write, leading blocks falling out of the window; blocks before the
first uncomputed token are full and never written again, so a step compares the table from there only.
A table the manager replaced (swap-in, recompute, a fork's first) goes whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagellm.core.block_pool import KVBlock
from pagellm.core.kv_cache_manager import OUT_OF_WINDOW, KVCacheManager
from pagellm.core.kv_group_manager import KVGroupManager
from pagellm.core.sched_output import (
    CachedSeqData,
    ForkedSeq,
    NewSeqData,
    ScheduledSeq,
    SchedulerOutput,
    TableEdit,
    apply_table_edit,
)
from pagellm.core.sequence import Sequence


def _leading_stand_ins(table: list[KVBlock]) -> int:
    return next((i for i, b in enumerate(table) if b is not OUT_OF_WINDOW), len(table))


@dataclass(eq=False)
class _SentTable:
    """One block table as the runner holds it."""

    windowed: bool  # the group frees what leaves a window (only then are there stand-ins to find)
    source: list[KVBlock] | None = None  # the manager's table it copies (None: none sent yet)
    ids: list[int] = field(default_factory=list)  # the runner's copy
    frozen: int = 0  # entries before this one are full blocks: they can only fall out of the window
    dead: int = 0  # leading out-of-window entries the runner knows

    def copy(self, table: list[KVBlock], frozen: int) -> list[int]:
        """Take ``table`` whole; returns its block ids (a new list, the caller's to keep)."""
        self.source, self.ids = table, [b.block_id for b in table]
        self.dead, self.frozen = _leading_stand_ins(table), min(frozen, len(table))
        return list(self.ids)

    def edit(self, table: list[KVBlock], frozen: int) -> TableEdit | None:
        """What to send for ``table`` now (None: the runner's copy is up to date); ``frozen``: the
        step's first uncomputed block."""
        if table is not self.source:
            return TableEdit(0, self.copy(table, frozen))
        ids, n = self.ids, len(table)
        i, m = self.frozen, len(ids)
        while i < n and i < m and table[i].block_id == ids[i]:
            i += 1
        dead = self.dead
        while self.windowed and dead < n and table[dead] is OUT_OF_WINDOW:
            dead += 1
        self.frozen = frozen if frozen < n else n
        if i == n == m and dead == self.dead:
            return None
        change = TableEdit(i, [b.block_id for b in table[i:]], self.dead, dead)
        apply_table_edit(ids, change)
        self.dead = dead
        return change


@dataclass(eq=False)
class _SentSeq:
    num_tokens: int  # the sequence's tokens the runner holds
    tables: list[_SentTable]  # per KV cache group


class RunnerView:
    """Builds each step's plain data for the runner (``schedule``) from what it was told before."""

    def __init__(self, kv_cache_manager: KVCacheManager) -> None:
        self.groups: tuple[KVGroupManager, ...] = kv_cache_manager.groups
        self.windowed = [g.sliding_window is not None for g in self.groups]
        self.block_size = kv_cache_manager.block_size
        self._sent: dict[int, _SentSeq] = {}

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._sent

    def forget(self, seq_id: int) -> None:
        """The runner drops (or may have lost) ``seq_id``'s state: it is sent whole if it comes back."""
        self._sent.pop(seq_id, None)

    def schedule(self, seq: Sequence, num_new: int, drafts: list[int], out: SchedulerOutput) -> ScheduledSeq:
        """Add ``seq``'s share of the step to ``out`` (its tokens from ``num_computed_tokens`` on, drafts
        included in ``num_new``), with what the runner must learn of it first; returns the entry."""
        start = seq.num_computed_tokens
        end = start + num_new - len(drafts)
        lp_range = None
        request = seq.request
        # Prompt logprobs come from the first sequence, once: a recompute skips them.
        if request.wants_prompt_logprobs and seq.index == 0:
            # Position p's logits score prompt token p + 1; positions below the watermark are done.
            lo = max(start, request.num_scored_prompt_tokens)
            hi = min(end, seq.num_prompt_tokens - 1)
            if hi > lo:
                lp_range = (lo, hi)
        num_tokens = seq.num_tokens
        sample = end == num_tokens
        forks = request.pending_children if sample and seq.index == 0 else None
        entry = ScheduledSeq(seq.seq_id, start, num_new, sample, lp_range,
                             [ForkedSeq(c.seq_id, c.seed) for c in forks] if forks else [], drafts)
        self._send(seq, start, num_tokens, out)
        for child in forks or ():  # the runner copies the parent's state; the tables come next step
            self._sent[child.seq_id] = _SentSeq(child.num_tokens, [_SentTable(w) for w in self.windowed])
        out.scheduled.append(entry)
        return entry

    def _send(self, seq: Sequence, start: int, num_tokens: int, out: SchedulerOutput) -> None:
        seq_id = seq.seq_id
        frozen = start // self.block_size
        sent = self._sent.get(seq_id)
        if sent is None:
            views = [_SentTable(w) for w in self.windowed]
            ids = [view.copy(g.block_tables[seq_id], frozen) for view, g in zip(views, self.groups)]
            self._sent[seq_id] = _SentSeq(num_tokens, views)
            out.new_seqs.append(NewSeqData(seq_id, seq.prompt_token_ids, list(seq.output_token_ids), seq.params,
                                           seq.seed, ids, seq.request.lora_request))
            return
        tokens = seq.token_slice(sent.num_tokens, num_tokens) if num_tokens > sent.num_tokens else []
        sent.num_tokens = num_tokens
        edits: list[TableEdit | None] = [view.edit(g.block_tables[seq_id], frozen)
                                         for view, g in zip(sent.tables, self.groups)]
        if not any(e is not None for e in edits):
            edits = []
        if tokens or edits:
            out.cached_seqs.append(CachedSeqData(seq_id, tokens, edits))
