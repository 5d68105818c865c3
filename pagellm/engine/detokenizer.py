"""Incremental detokenisation and stop strings.

Decoding token by token is wrong for tokenizers whose pieces merge (leading
spaces, multi-byte characters split across tokens), and decoding everything
each step is quadratic. We decode a short window instead: the text of
``ids[prefix:]`` minus the text of ``ids[prefix:read]`` is what the newest
tokens add, released only once it is no longer an incomplete UTF-8 character.
"""

from __future__ import annotations

from typing import Any, Optional

# Prompt tokens kept as left context so the first output token decodes with the right spacing.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._context = len(self.ids)
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _release(self) -> Optional[str]:
        """The text the tokens after ``read_offset`` add, moving the window past them; None (window
        unchanged) while that text is empty or ends inside a character."""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset :])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return full_text[len(prefix_text) :]
        return None

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes (possibly empty)."""
        self.ids.append(token_id)
        return self._release() or ""

    def add_tokens(self, token_ids: list[int]) -> str:
        """Append several tokens; return the text they complete, as ``add`` one at a time would, but
        with two decodes in all (for requests whose text is read only at the end)."""
        start = len(self.ids)
        self.ids.extend(token_ids)
        if len(token_ids) <= 1:
            return self._release() or ""
        text = self._release()
        if text is not None:
            return text
        # They end inside a character (or add nothing): token by token, which releases what is complete.
        del self.ids[start:]
        return "".join(self.add(t) for t in token_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens appended so far (the prompt context not counted)."""
        return len(self.ids) - self._context

    def flush(self) -> str:
        """At the end: the text still held back (an incomplete character decodes as U+FFFD)."""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full_text[len(prefix_text) :]


def find_stop_string(text: str, new_chars: int, stops: list[str]) -> Optional[tuple[str, int]]:
    """The earliest stop string that the last ``new_chars`` characters completed, with its index."""
    best: Optional[tuple[str, int]] = None
    for stop in stops:
        # Only matches that end inside the new text can be new.
        start = max(0, len(text) - new_chars - len(stop) + 1)
        idx = text.find(stop, start)
        if idx != -1 and (best is None or idx < best[1]):
            best = (stop, idx)
    return best


def stop_prefix_len(text: str, stops: list[str]) -> int:
    """How many trailing characters of ``text`` could still grow into a stop string.

    A stream holds these back so that a stop string never leaks out half-sent.
    """
    hold = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), hold, -1):
            if text.endswith(stop[:k]):
                hold = k
                break
    return hold
