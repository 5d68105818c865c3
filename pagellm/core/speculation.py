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

from dataclasses import dataclass
from typing import Any

METHODS = ("ngram",)
# How far back the proposer looks for an earlier occurrence, in tokens (the search is linear in it).
LOOKBACK = 8192
# Acceptance below which a sequence stops proposing for a while (accepted / proposed, over its drafts).
MIN_ACCEPTANCE = 0.25
# Drafts a sequence proposes before its acceptance is judged, and steps it pauses when judged low.
JUDGE_AFTER, PAUSE_STEPS = 16, 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's ``speculative_config`` keys that apply: ``method`` (``ngram``), ``num_speculative_tokens``,
    ``prompt_lookup_max`` / ``prompt_lookup_min`` (the n-gram lengths tried, longest first), and
    ``disable_by_batch_size`` (no drafts in a step with more running sequences than this: a step that
    many rows wide is bound by compute, where verifying drafts costs what they save)."""

    num_speculative_tokens: int
    method: str = "ngram"
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 5
    disable_by_batch_size: int | None = None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> SpeculativeConfig:
        """The configuration of a ``speculative_config`` mapping; ValueError naming what is wrong."""
        where = "speculative_config (--speculative-config)"
        data = dict(raw)
        if "model" in data and data.get("method") in (None, "draft_model"):
            raise ValueError(f"{where}: speculation with a draft model is not supported yet; use "
                             """{"method": "ngram", "num_speculative_tokens": 4}""")
        method = data.pop("method", None) or ("ngram" if "prompt_lookup_max" in data or "prompt_lookup_min" in data
                                              else None)
        if method not in METHODS:
            raise ValueError(f"{where}: method must be one of {', '.join(METHODS)}, got {method!r}")
        known = {"num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; the n-gram method takes "
                             f"{', '.join(sorted(known))}")
        k = data.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 32:
            raise ValueError(f"{where}: num_speculative_tokens must be an integer from 1 to 32, got {k!r}")
        lo, hi = data.get("prompt_lookup_min"), data.get("prompt_lookup_max")
        # As vLLM: one given sets the other; neither, both 5.
        lo, hi = (lo if lo is not None else hi if hi is not None else 5), (hi if hi is not None else lo or 5)
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 64:
                raise ValueError(f"{where}: {name} must be an integer from 1 to 64, got {value!r}")
        if lo > hi:
            raise ValueError(f"{where}: prompt_lookup_min ({lo}) is above prompt_lookup_max ({hi})")
        batch = data.get("disable_by_batch_size")
        if batch is not None and (not isinstance(batch, int) or isinstance(batch, bool) or batch < 1):
            raise ValueError(f"{where}: disable_by_batch_size must be a positive integer, got {batch!r}")
        return cls(k, method, hi, lo, batch)


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
