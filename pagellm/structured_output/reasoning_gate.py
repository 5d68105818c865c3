"""Where a reasoning model's thinking ends, and the budget that ends it.

A request served with a reasoning parser carries the tokens that close its reasoning
(``SamplingParams.reasoning_end_token_ids``, e.g. ``</think>``). Its constraint (structured outputs, a
forced tool call) holds only the tokens after them, as vLLM does: the model thinks freely first. With
``thinking_token_budget`` the thinking is cut short: once that many tokens were generated without the
end, the next tokens are forced to be the end marker's, one by one.
"""

from __future__ import annotations

from collections.abc import Iterable

from pagellm.sampling_params import SamplingParams
from pagellm.structured_output.seq_view import ConstrainedSeq


def gated(params: SamplingParams) -> bool:
    """Whether the request's masks depend on its reasoning: a constraint after it, or a budget on it."""
    return bool(params.reasoning_end_token_ids) and (
        params.structured_outputs is not None or params.thinking_token_budget is not None)


def find_end(tokens: list[int], marker: list[int], start: int) -> int | None:
    """The index just past the first ``marker`` in ``tokens`` that ends at or after ``start``."""
    n = len(marker)
    for i in range(max(0, start - n + 1), len(tokens) - n + 1):
        if tokens[i:i + n] == marker:
            return i + n
    return None


class ReasoningGate:
    """Each gated sequence's end of reasoning, found once and kept until it finishes."""

    def __init__(self) -> None:
        self._ends: dict[int, int] = {}  # seq_id -> index just past the end marker in its output
        self._scanned: dict[int, int] = {}  # seq_id -> output tokens searched without finding it

    def end_of(self, seq: ConstrainedSeq) -> int | None:
        """Where ``seq``'s output leaves reasoning (0 for a request without a reasoning marker); None
        while it is still thinking."""
        marker = seq.params.reasoning_end_token_ids
        if not marker:
            return 0
        tokens = seq.output_token_ids
        end = self._ends.get(seq.seq_id)
        if end is not None and end <= len(tokens):
            return end
        scanned = min(self._scanned.get(seq.seq_id, 0), len(tokens))  # (fewer tokens: a rollback)
        end = find_end(tokens, marker, scanned)
        if end is None:
            self._scanned[seq.seq_id] = len(tokens)
            self._ends.pop(seq.seq_id, None)
            return None
        self._ends[seq.seq_id] = end
        return end

    @staticmethod
    def forced_token(seq: ConstrainedSeq) -> int | None:
        """The marker's next token when ``seq`` spent its thinking budget without ending (None: free)."""
        budget = seq.params.thinking_token_budget
        marker = seq.params.reasoning_end_token_ids
        tokens = seq.output_token_ids
        if budget is None or not marker or len(tokens) < budget:
            return None
        # The part of the marker already written at the end of the output (the forcing so far).
        done = next((k for k in range(min(len(marker) - 1, len(tokens)), 0, -1) if tokens[-k:] == marker[:k]), 0)
        return marker[done]

    def forget(self, seq_ids: Iterable[int]) -> None:
        for seq_id in seq_ids:
            self._ends.pop(seq_id, None)
            self._scanned.pop(seq_id, None)
