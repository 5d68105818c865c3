"""One engine step as the tensor-parallel workers receive it: two int64 tensors, not Python objects.

The driver (rank 0) broadcasts a header ``[command, payload_len]``, then the payload: the step's
``SchedulerOutput`` (core/sched_output.py) field by field, each list preceded by its length:

- ``num_groups`` (KV cache groups), ``num_batched_tokens``;
- the finished and the preempted sequence ids;
- each new sequence: ``seq_id``, its prompt, its output tokens, its LoRA adapter (``lora_int_id``, 0:
  none; else its name's and its local path's UTF-8 bytes: each rank loads the adapter from the path
  and keeps its share), then each group's block table;
- each cached sequence's changes: ``seq_id``, its new tokens, whether a table changed, and if so
  each group's table edit (``-1``: none; else ``keep, dead_from, dead_to`` and the block ids appended);
- each scheduled chunk: ``seq_id, start, num_new_tokens, sample, lp_from, lp_to`` (``-1, -1``: no
  prompt logprobs), its forked children's ids, its draft tokens;
- each group's block moves as (src, dst) pairs: swap out, swap in and copy.

So a sequence's prompt travels once, when it is new, and a decode costs a few numbers. A worker
decodes the same plain data, but for what only rank 0 reads to sample: new sequences' sampling
parameters and seeds, and forked children's seeds, are None there.
"""

from __future__ import annotations

import torch

from pagellm.core.sched_output import CachedSeqData, ForkedSeq, NewSeqData, ScheduledSeq, SchedulerOutput, TableEdit
from pagellm.lora.request import LoRARequest

STEP, STOP = 1, 0
HEADER_LEN = 2
NONE = -1


def _put_list(payload: list[int], values: list[int]) -> None:
    payload.append(len(values))
    payload += values


def _put_edit(payload: list[int], edit: TableEdit | None) -> None:
    if edit is None:
        payload.append(NONE)
        return
    payload += [edit.keep, edit.dead_from, edit.dead_to, len(edit.block_ids)]
    payload += edit.block_ids


def _put_pairs(payload: list[int], pairs: list[tuple[int, int]]) -> None:
    payload.append(len(pairs))
    for src, dst in pairs:
        payload += [src, dst]


def _put_text(payload: list[int], text: str) -> None:
    _put_list(payload, list(text.encode()))


def _put_lora(payload: list[int], lora: LoRARequest | None) -> None:
    if lora is None:
        payload.append(0)
        return
    payload.append(lora.lora_int_id)
    _put_text(payload, lora.lora_name)
    _put_text(payload, lora.lora_path)


def encode_step(out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor]:
    """(header, payload) of a step for the workers. ``block_moves`` has an entry for each KV cache group
    (the scheduler fills it every step), and so do the tables and edits of every sequence."""
    payload: list[int] = [len(out.block_moves), out.num_batched_tokens]
    _put_list(payload, out.finished_seq_ids)
    _put_list(payload, out.preempted_seq_ids)
    payload.append(len(out.new_seqs))
    for new in out.new_seqs:
        payload.append(new.seq_id)
        _put_list(payload, new.prompt_token_ids)
        _put_list(payload, new.output_token_ids)
        _put_lora(payload, new.lora_request)
        for table in new.block_tables:
            _put_list(payload, table)
    payload.append(len(out.cached_seqs))
    for cached in out.cached_seqs:
        payload.append(cached.seq_id)
        _put_list(payload, cached.new_token_ids)
        payload.append(int(bool(cached.block_edits)))
        for edit in cached.block_edits:
            _put_edit(payload, edit)
    payload.append(len(out.scheduled))
    for it in out.scheduled:
        lp = it.prompt_logprobs_range or (NONE, NONE)
        payload += [it.seq_id, it.start, it.num_new_tokens, int(it.sample), lp[0], lp[1]]
        _put_list(payload, [child.seq_id for child in it.fork_children])
        _put_list(payload, it.draft_token_ids)
    for moves in out.block_moves:
        for pairs in moves:
            _put_pairs(payload, pairs)
    header = [STEP, len(payload)]
    return torch.tensor(header, dtype=torch.int64), torch.tensor(payload, dtype=torch.int64)


def stop_header() -> torch.Tensor:
    return torch.tensor([STOP] + [0] * (HEADER_LEN - 1), dtype=torch.int64)


class _Reader:
    """Reads a payload's integers in order."""

    def __init__(self, values: list[int]) -> None:
        self.values = values
        self.at = 0

    def one(self) -> int:
        self.at += 1
        return self.values[self.at - 1]

    def some(self, n: int) -> list[int]:
        self.at += n
        return self.values[self.at - n : self.at]

    def counted(self) -> list[int]:
        return self.some(self.one())

    def text(self) -> str:
        return bytes(self.counted()).decode()

    def lora(self) -> LoRARequest | None:
        adapter_id = self.one()
        if adapter_id == 0:
            return None
        name = self.text()
        return LoRARequest(name, adapter_id, self.text())

    def edit(self) -> TableEdit | None:
        keep = self.one()
        if keep == NONE:
            return None
        dead_from, dead_to, n = self.some(3)
        return TableEdit(keep, self.some(n), dead_from, dead_to)

    def pairs(self) -> list[tuple[int, int]]:
        flat = self.some(2 * self.one())
        return list(zip(flat[::2], flat[1::2]))


def decode_step(payload: torch.Tensor) -> SchedulerOutput:
    """The worker's view of the step ``encode_step`` made (its payload)."""
    r = _Reader(payload.tolist())
    num_groups = r.one()
    out = SchedulerOutput(num_batched_tokens=r.one(), finished_seq_ids=r.counted(), preempted_seq_ids=r.counted())
    for _ in range(r.one()):
        seq_id, prompt, output, lora = r.one(), r.counted(), r.counted(), r.lora()
        tables = [r.counted() for _ in range(num_groups)]
        out.new_seqs.append(NewSeqData(seq_id, prompt, output, None, None, tables, lora))
    for _ in range(r.one()):
        seq_id, tokens, edited = r.one(), r.counted(), r.one()
        edits = [r.edit() for _ in range(num_groups)] if edited else []
        out.cached_seqs.append(CachedSeqData(seq_id, tokens, edits))
    for _ in range(r.one()):
        seq_id, start, num_new, sample, lp_from, lp_to = r.some(6)
        children = [ForkedSeq(child, None) for child in r.counted()]
        out.scheduled.append(ScheduledSeq(seq_id, start, num_new, bool(sample),
                                          None if lp_from == NONE else (lp_from, lp_to), children, r.counted()))
    out.block_moves = [(r.pairs(), r.pairs(), r.pairs()) for _ in range(num_groups)]
    return out
