"""Speculative decoding's configuration and its n-gram proposer (vLLM's ``speculative_config``).

A decoding sequence may carry up to ``num_speculative_tokens`` draft tokens into a step: the model
computes its last token and the drafts together (one row each, as decodes at consecutive positions),
the worker keeps the drafts its own sampling agrees with (``worker/spec_verify.py``) and one token
more, and the slots of the rejected drafts are simply written again later. The n-gram method (prompt
lookup) proposes the tokens that followed the latest earlier occurrence of the sequence's last few
tokens: free to compute, and right often where the answer quotes its input (edits, summaries, code).
Plain Python: the scheduler proposes, and core imports no torch.
"""

from __future__ import annotations

from pagellm.speculative_config import SpeculativeConfig

__all__ = ["SpeculationState", "SpeculativeConfig", "propose_ngram"]
# How far back the proposer looks for an earlier occurrence, in tokens (the search is linear in it).
LOOKBACK = 8192
# Acceptance below which a sequence stops proposing for a while (accepted / proposed, over its drafts).
MIN_ACCEPTANCE = 0.25
# Drafts a sequence proposes before its acceptance is judged, and steps it pauses when judged low.
JUDGE_AFTER, PAUSE_STEPS = 16, 16


def propose_ngram(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix of ``tokens``
    (``n_max`` down to ``n_min`` tokens long) that occurred before; [] where none did."""
    size = len(tokens)
    if size < n_min + 1:
        return []
    first = max(0, size - LOOKBACK)
    last = tokens[-1]
    best_at, best_n = -1, 0
    # Each earlier position i holding the last token ends a candidate: how far back does it match?
    for i in range(size - 2, first - 1, -1):
        if tokens[i] != last:
            continue
        n = 1
        while n < n_max and i - n >= first and tokens[i - n] == tokens[size - 1 - n]:
            n += 1
        if n > best_n:
            best_at, best_n = i, n
            if n == n_max:
                break
    if best_n < n_min:
        return []
    return tokens[best_at + 1: best_at + 1 + k]


class SpeculationState:
    """Per sequence: its drafts' acceptance so far, and a pause where it ran low (proposals that are
    mostly rejected cost a step wider than a plain decode for nothing)."""

    def __init__(self) -> None:
        self.proposed = 0
        self.accepted = 0
        self.paused_until = 0

    def record(self, proposed: int, accepted: int, step: int) -> None:
        self.proposed += proposed
        self.accepted += accepted
        if self.proposed >= JUDGE_AFTER:  # judged over each run of drafts: a sequence's text changes
            if self.accepted < MIN_ACCEPTANCE * self.proposed:
                self.paused_until = step + PAUSE_STEPS
            self.proposed = self.accepted = 0
