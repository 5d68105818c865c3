"""Incremental detokenisation and stop strings.

Decoding token by token is wrong for tokenizers whose pieces merge (leading
spaces, multi-byte characters split across tokens), and decoding everything
each step is quadratic. We decode a short window instead: the text of
``ids[prefix:]`` minus the text of ``ids[prefix:read]`` is what the newest
tokens add, released only once it is no longer an incomplete UTF-8 character.
"""

from __future__ import annotations

from typing import Any

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

    def _release(self) -> str | None:
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


def stop_string_table(stop: str) -> list[int]:
    """KMP failure table of ``stop``: entry ``i`` is the length of the longest proper prefix of
    ``stop[: i + 1]`` that is also a suffix of it."""
    table = [0] * len(stop)
    first = stop[0]
    k = 0
    i = 1
    while i < len(stop):
        if k == 0:
            # Entries stay 0 until the first character comes back: jump to its next occurrence.
            i = stop.find(first, i)
            if i == -1:
                break
        c = stop[i]
        while k and stop[k] != c:
            k = table[k - 1]
        if stop[k] == c:
            k += 1
        table[i] = k
        i += 1
    return table


class StopStringMatcher:
    """Stop-string search over a text that only grows, fed the new characters each time.

    Per stop string it keeps the KMP state: the length of the longest prefix of the stop string
    that the text ends with. A new character costs amortised O(1) per stop string, so the work per
    step is proportional to the new text, not to the whole text nor to the stop strings' lengths.
    The state is also the hold-back of a stream (``hold``).
    """

    def __init__(self, stops: list[str], tables: dict[str, list[int]] | None = None, start: int = 0) -> None:
        """``start``: where in the text the first character fed is (the index base of matches)."""
        self.stops = stops
        # Failure tables, built when first needed; a dict shared by every matcher of a request.
        self.tables: dict[str, list[int]] = {} if tables is None else tables
        self.states = [0] * len(stops)
        self.length = start  # the text's length so far

    def _table(self, stop: str) -> list[int]:
        table = self.tables.get(stop)
        if table is None:
            table = self.tables[stop] = stop_string_table(stop)
        return table

    def feed(self, new_text: str) -> tuple[str, int] | None:
        """Append ``new_text``; return the stop string it completed that starts earliest (the first
        listed on a tie), with its start index in the whole text, or None."""
        best: tuple[str, int] | None = None
        end = len(new_text)
        for j, stop in enumerate(self.stops):
            k = self.states[j]
            first = stop[0]
            table: list[int] | None = None
            hit = -1
            pos = 0
            while pos < end:
                if k == 0:
                    # Nothing matched: only the stop string's first character can start a match.
                    pos = new_text.find(first, pos)
                    if pos == -1:
                        break
                c = new_text[pos]
                if stop[k] != c:
                    if table is None:
                        table = self._table(stop)
                    while k and stop[k] != c:
                        k = table[k - 1]
                if stop[k] == c:
                    k += 1
                    if k == len(stop):
                        if hit < 0:
                            hit = self.length + pos + 1 - k
                        if table is None:
                            table = self._table(stop)
                        k = table[k - 1]
                pos += 1
            self.states[j] = k
            if hit >= 0 and (best is None or hit < best[1]):
                best = (stop, hit)
        self.length += end
        return best

    @property
    def hold(self) -> int:
        """How many trailing characters of the text could still grow into a stop string: a stream
        holds these back, so that a stop string never leaks out half-sent."""
        return max(self.states, default=0)


def find_stop_string(text: str, new_chars: int, stops: list[str]) -> tuple[str, int] | None:
    """The earliest stop string that the last ``new_chars`` characters completed, with its index.

    One-shot form; a text that grows step by step is better served by a ``StopStringMatcher``.
    """
    if not stops or new_chars <= 0:
        return None
    # A match that ends in the new text starts at most len(stop) - 1 characters before it.
    start = max(0, len(text) - new_chars - max(len(s) for s in stops) + 1)
    matcher = StopStringMatcher(stops, start=start)
    matcher.feed(text[start : len(text) - new_chars])  # matches wholly in the old text do not count
    return matcher.feed(text[len(text) - new_chars :])


def stop_prefix_len(text: str, stops: list[str]) -> int:
    """How many trailing characters of ``text`` could still grow into a stop string (the one-shot
    form of ``StopStringMatcher.hold``)."""
    if not stops:
        return 0
    # The held-back tail is shorter than the longest stop string.
    matcher = StopStringMatcher(stops)
    matcher.feed(text[max(0, len(text) - max(len(s) for s in stops) + 1) :])
    return matcher.hold
