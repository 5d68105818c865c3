"""Speculative decoding's configuration and its n-gram proposer (vLLM's ``speculative_config``); with a
draft model, how many drafts each sequence takes into a step (the runner's draft model proposes them).

A decoding sequence may carry up to ``num_speculative_tokens`` draft tokens into a step: the model
computes its last token and the drafts together (one row each, as decodes at consecutive positions),
the worker keeps the drafts its own sampling agrees with (``worker/spec_verify.py``) and one token
more, and the slots of the rejected drafts are simply written again later. The n-gram method (prompt
lookup) proposes the tokens that followed the latest earlier occurrence of the sequence's last few
tokens: free to compute, and right often where the answer quotes its input (edits, summaries, code).
Plain Python: the scheduler proposes, and core imports no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagellm.core.sched_output import DRAFT_BY_MODEL
from pagellm.speculative_config import SpeculativeConfig

if TYPE_CHECKING:
    from pagellm.core.sequence import Sequence

__all__ = ["SpeculationState", "SpeculativeConfig", "Speculator", "propose_ngram"]
# How far back the proposer looks for an earlier occurrence, in tokens (the search is linear in it).
LOOKBACK = 8192
# Acceptance below which a sequence stops proposing for a while (accepted / proposed, over its drafts).
MIN_ACCEPTANCE = 0.25
# Drafts a sequence proposes before its acceptance is judged, and steps it pauses when judged low.
JUDGE_AFTER, PAUSE_STEPS = 16, 16
# Running sequences above which no draft is proposed when ``disable_by_batch_size`` is unset: a decode
# step that wide is bound by the multiplies, where verifying drafts costs what they save.
BATCH_LIMIT = 8


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


class Speculator:
    """The scheduler's drafts: which sequences propose in a step, how many tokens, and their acceptance."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.states: dict[int, SpeculationState] = {}

    def propose(self, seq: Sequence, budget: int, num_running: int, step: int) -> list[int]:
        """The drafts of ``seq``'s decode in a step of ``num_running`` sequences with ``budget`` tokens left."""
        spec = self.config
        if not may_speculate(seq) or num_running > (spec.disable_by_batch_size or BATCH_LIMIT):
            return []
        state = self.states.setdefault(seq.seq_id, SpeculationState())
        if state.paused_until > step:
            return []
        room = min(spec.num_speculative_tokens, budget - 1, self.max_model_len - seq.num_tokens - 1)
        if seq.params.max_tokens is not None:  # (the step keeps at most drafts + 1 tokens)
            room = min(room, seq.params.max_tokens - seq.num_output_tokens - 1)
        if room <= 0:
            return []
        if spec.uses_draft_model:  # (the runner's draft model proposes them in the step)
            return [DRAFT_BY_MODEL] * room
        return propose_ngram(seq.prompt_token_ids + seq.output_token_ids, room, spec.prompt_lookup_min,
                             spec.prompt_lookup_max)

    def record(self, seq: Sequence, proposed: int, accepted: int, step: int) -> None:
        state = self.states.get(seq.seq_id)
        if state is not None:
            state.record(proposed, accepted, step)

    def forget(self, seq: Sequence) -> None:
        self.states.pop(seq.seq_id, None)


def may_speculate(seq: Sequence) -> bool:
    """Whether ``seq``'s sampling lets drafts be checked row by row: nothing that depends on the tokens
    before each row (penalties, min_tokens' bans, a grammar) and no logit bias."""
    p = seq.params
    return (p.structured_outputs is None and not p.logit_bias and p.repetition_penalty == 1.0
            and not p.presence_penalty and not p.frequency_penalty and seq.num_output_tokens >= p.min_tokens)
