"""One engine step as the tensor-parallel workers receive it: two int64 tensors, not Python objects.

The driver (rank 0) broadcasts a header, then a payload. The header is
``[command, num_items, payload_len, num_swap_out, num_swap_in, num_copy, num_extra_groups]``; the
payload holds each scheduled sequence's chunk as ``[start, num_new, seq_len, sample, lp_from, lp_to,
num_children, table_len, *block_table, *token_ids]`` (``lp_from = -1``: no prompt logprobs) followed,
for each KV cache group after the first (Gemma's sliding layers), by ``[table_len, *block_table]``;
then the block moves as flat (src, dst) pairs, and each further group's as ``[num_swap_out,
num_swap_in, num_copy, *pairs]``. A worker turns it back into ``ScheduledSeq`` entries over stand-in
sequences that hold just the tokens of the chunk: what the model runner's ``prepare`` reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagellm.core.sched_output import ScheduledSeq, SchedulerOutput

STEP, STOP = 1, 0
HEADER_LEN = 7


class _ZeroTokens:
    """Prompt token ids a worker never reads (they are the targets of logprobs rank 0 computes)."""

    def __getitem__(self, index: int) -> int:
        return 0


@dataclass
class ChunkTokens:
    """Stand-in for a ``Sequence`` on a worker: the tokens of one scheduled chunk and the length."""

    start: int
    tokens: list[int]
    num_tokens: int
    seq_id: int = -1
    prompt_token_ids: _ZeroTokens = field(default_factory=_ZeroTokens)

    def token_slice(self, start: int, end: int) -> list[int]:
        return self.tokens[start - self.start : end - self.start]


def encode_step(out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor]:
    """(header, payload) of a step for the workers."""
    payload: list[int] = []
    num_extra = len(out.scheduled[0].group_block_tables) if out.scheduled else len(out.group_block_moves)
    for it in out.scheduled:
        lp = it.prompt_logprobs_range or (-1, -1)
        payload += [it.start, it.num_new_tokens, it.seq.num_tokens, int(it.sample), lp[0], lp[1],
                    len(it.fork_children), len(it.block_table)]
        payload += it.block_table
        payload += it.seq.token_slice(it.start, it.start + it.num_new_tokens)
        for table in it.group_block_tables:
            payload.append(len(table))
            payload += table
    moves = (out.blocks_to_swap_out, out.blocks_to_swap_in, out.blocks_to_copy)
    for pairs in moves:
        for src, dst in pairs:
            payload += [src, dst]
    group_moves = out.group_block_moves or [([], [], [])] * num_extra
    for group in group_moves:
        payload += [len(p) for p in group]
        for pairs in group:
            for src, dst in pairs:
                payload += [src, dst]
    header = [STEP, len(out.scheduled), len(payload), *(len(p) for p in moves), num_extra]
    return torch.tensor(header, dtype=torch.int64), torch.tensor(payload, dtype=torch.int64)


def stop_header() -> torch.Tensor:
    return torch.tensor([STOP] + [0] * (HEADER_LEN - 1), dtype=torch.int64)


def decode_step(header: torch.Tensor, payload: torch.Tensor) -> SchedulerOutput:
    """The worker's view of the step ``encode_step`` made."""
    _, num_items, _, n_out, n_in, n_copy, num_extra = header.tolist()
    values = payload.tolist()
    at = 0
    out = SchedulerOutput()
    for _ in range(num_items):
        start, num_new, seq_len, sample, lp_from, lp_to, num_children, table_len = values[at : at + 8]
        at += 8
        table = values[at : at + table_len]
        at += table_len
        tokens = values[at : at + num_new]
        at += num_new
        group_tables = []
        for _ in range(num_extra):
            n = values[at]
            group_tables.append(values[at + 1 : at + 1 + n])
            at += 1 + n
        seq = ChunkTokens(start, tokens, seq_len)
        out.scheduled.append(ScheduledSeq(
            seq, start, num_new, table, bool(sample),  # type: ignore[arg-type]
            prompt_logprobs_range=None if lp_from < 0 else (lp_from, lp_to),
            fork_children=[seq] * num_children,  # type: ignore[list-item]
            group_block_tables=tuple(group_tables),
        ))

    def pairs(n: int) -> list[tuple[int, int]]:
        nonlocal at
        got = [(values[at + 2 * i], values[at + 2 * i + 1]) for i in range(n)]
        at += 2 * n
        return got

    out.blocks_to_swap_out, out.blocks_to_swap_in, out.blocks_to_copy = pairs(n_out), pairs(n_in), pairs(n_copy)
    for _ in range(num_extra):
        g_out, g_in, g_copy = values[at : at + 3]
        at += 3
        out.group_block_moves.append((pairs(g_out), pairs(g_in), pairs(g_copy)))
    return out
