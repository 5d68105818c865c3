"""Token bitmasks (one bit per vocabulary entry, 32 to an int32 word, as llguidance and xgrammar
write them) and their application to a batch's logits."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

_BITS = torch.arange(32, dtype=torch.int32)


@dataclass
class GrammarMask:
    """The tokens each constrained row of a step may sample: ``bitmask[i]`` is for logits row ``rows[i]``."""

    rows: list[int]
    bitmask: torch.Tensor  # (len(rows), ceil(vocab / 32)) int32
    # seq_id -> why its grammar dead-ended (its row allows only the end of sequence).
    errors: dict[int, str] = field(default_factory=dict)


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """An all-allowed bitmask of ``rows`` rows."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def set_only(bitmask_row: torch.Tensor, token_ids: list[int]) -> None:
    """Allow exactly ``token_ids`` in one bitmask row."""
    bitmask_row.zero_()
    for t in token_ids:
        word, bit = divmod(t, 32)
        if word < bitmask_row.numel():
            # Bit 31 as a signed int32: Python's 1 << 31 does not fit.
            bitmask_row[word] |= torch.tensor(1 << bit if bit < 31 else -(1 << 31), dtype=torch.int32)


def allowed(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(rows, vocab_size) bool: which tokens each row allows."""
    bits = (bitmask.unsqueeze(-1) >> _BITS) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask(logits: torch.Tensor, mask: GrammarMask, unprocessed: torch.Tensor | None = None) -> None:
    """Set the disallowed tokens of each constrained row of ``logits`` to -inf, in place.

    A row left with no finite logit (other processors banned every token the grammar allows, e.g.
    ``min_tokens`` holding back the EOS that must end a finished document) takes its ``unprocessed``
    logits under the grammar's mask instead: the grammar wins.
    """
    rows = torch.tensor(mask.rows, dtype=torch.long, device=logits.device)
    ok = allowed(mask.bitmask, logits.shape[1]).to(logits.device)
    sub = logits.index_select(0, rows).masked_fill_(~ok, float("-inf"))
    if unprocessed is not None:
        empty = ~torch.isfinite(sub).any(dim=1)
        if bool(empty.any()):
            raw = unprocessed.index_select(0, rows).masked_fill_(~ok, float("-inf"))
            sub = torch.where(empty.unsqueeze(1), raw, sub)
    logits.index_copy_(0, rows, sub)
