"""Which output tokens a choice's text is made of, so that chat ``logprobs.content`` describes
``content`` and nothing more: not the end-of-turn (or stop) token a sequence ends on, which adds no
text, nor the tokens of a stop string cut from the text, nor, in a stream, the tokens of text still
held back (it may yet become a stop string)."""

from __future__ import annotations

import bisect
from typing import Any

from pagellm.engine.detokenizer import IncrementalDetokenizer
from pagellm.outputs import CompletionOutput
from pagellm.sampling_params import SamplingParams


class TokenStarts:
    """Where each output token's text starts, decoded as the engine decodes it (incrementally, after
    the prompt's last tokens), so that the offsets match the choice's text."""

    def __init__(self, tokenizer: Any, prompt_ids: list[int], skip_special_tokens: bool) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
        self.starts: list[int] = []
        self._length = 0

    def feed(self, token_ids: list[int]) -> None:
        """Catch up with ``token_ids`` (all the output so far)."""
        for t in token_ids[len(self.starts):]:
            self.starts.append(self._length)
            # A token ending inside a character adds "" now: it starts where the character does.
            self._length += len(self._detok.add(t))


def ended_by_token(c: CompletionOutput, params: SamplingParams) -> bool:
    """The last token is an EOS or stop token the text leaves out (as the engine's output processor)."""
    return (c.finish_reason in ("stop", "error") and not isinstance(c.stop_reason, str)
            and not params.include_stop_str_in_output)


def content_token_count(c: CompletionOutput, params: SamplingParams, text_length: int,
                        starts: TokenStarts | None) -> int:
    """How many of ``c``'s first tokens make its first ``text_length`` characters (all the text once
    finished, what a stream has sent so far before). ``starts`` is needed only where stop strings
    may cut the text: while ``c`` runs with stop strings, and when one ended it."""
    n = len(c.token_ids) - (1 if ended_by_token(c, params) else 0)
    finished_otherwise = c.finish_reason is not None and not isinstance(c.stop_reason, str)
    if starts is None or finished_otherwise:
        return max(n, 0)
    starts.feed(c.token_ids)
    # Tokens that start inside the text: the one a stop string begins in is kept for its first part.
    return min(n, bisect.bisect_left(starts.starts, text_length))
