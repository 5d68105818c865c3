"""A sequence's tokens as its prompt list and its output list, read the same way by the scheduler's
``Sequence`` and the model runner's ``SeqState``."""

from __future__ import annotations


class TokenLists:
    """Token counts and slices over ``prompt_token_ids`` + ``output_token_ids`` (set by the subclass)."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens ``[start, end)`` of prompt and outputs, copying only what the range covers."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:  # a decode: no copy of the whole prompt
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]
