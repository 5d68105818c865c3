"""Wrapping up a constrained JSON document: when its token budget runs low, or when the model has
fallen into a loop, its mask is narrowed to the tokens that end the document soonest.

A grammar only says which tokens may come next; it cannot make a model stop. Small models, greedy
ones most of all, repeat an array item, a digit or a phrase until ``max_tokens`` cuts the document in
the middle, and a cut document does not parse. Wrapping up keeps the grammar's verdict (every token
is still one it allows) and, among those, prefers in order: the end of the sequence; tokens made only
of ``"``, ``]`` and ``}`` that begin with the quote (closing a string, and what encloses it; at a
value, the quote starts the shortest string); tokens made only of ``]`` and ``}`` (closing arrays and
objects: inside a string they are text, hence after the quote); then tokens made only of those and
the separators ``,`` and ``:`` (a number ends, a required key follows). Only JSON constraints wrap
up: a regex or a grammar has no such closers.

The decision is a function of the sequence's tokens alone, so it is the same after a preemption by
recompute or a swap, and the same for every run with the same seed.
"""

from __future__ import annotations

from typing import Any

import torch

# A tail of at least this many tokens that repeats with a period of at most MAX_LOOP_PERIOD tokens
# (four times over for the longer periods) is a loop, not content (32 zeros in a row would be too).
MIN_LOOP_TOKENS = 64
MAX_LOOP_PERIOD = 24
# Wrapping up starts when the tokens left are within SLACK of what closing the document takes from
# where it is (found by following the wrap-up's own preferences on a copy of the grammar state); that
# path is only looked for once at most LOOKAHEAD tokens are left, and again only as the tokens left
# come within RECHECK of the last length found.
LOOKAHEAD = 64
SLACK = 4
RECHECK = 8

# The constraints that wrap up: JSON documents (a regex or a grammar has no such closers).
WRAP_UP_KINDS = ("json", "json_object")

CLOSERS = frozenset('"]}')
SEPARATORS = CLOSERS | frozenset(",:")


def is_looping(tokens: list[int]) -> bool:
    """Whether the tail of ``tokens`` repeats one short run of tokens over and over."""
    n = len(tokens)
    for period in range(1, MAX_LOOP_PERIOD + 1):
        span = max(MIN_LOOP_TOKENS, 4 * period)
        if span > n:
            break
        tail = tokens[n - span:]
        if tail[period:] == tail[:-period]:
            return True
    return False


def tokens_left(num_output_tokens: int, max_tokens: int | None, num_tokens: int, max_model_len: int) -> int:
    """How many more tokens the sequence may sample, by ``max_tokens`` and by ``max_model_len``."""
    left = max_model_len - num_tokens
    return left if max_tokens is None else min(left, max_tokens - num_output_tokens)


def _bitmask_of(token_ids: list[int], vocab_size: int) -> torch.Tensor:
    ids = torch.tensor([t for t in token_ids if 0 <= t < vocab_size], dtype=torch.long)
    bits = torch.zeros((vocab_size + 31) // 32 * 32, dtype=torch.bool)
    bits[ids] = True
    weights = torch.tensor([1 << b for b in range(31)] + [-(1 << 31)], dtype=torch.int64)
    words = (bits.view(-1, 32).to(torch.int64) * weights).sum(dim=1)
    return words.to(torch.int32)


class WrapUpMasks:
    """The vocabulary's token classes, in order of preference, as bitmasks (built on first use)."""

    def __init__(self, ll_tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        quoting: list[int] = []
        closing: list[int] = []
        separating: list[int] = []
        for token in range(min(vocab_size, ll_tokenizer.vocab_size)):
            if ll_tokenizer.is_special_token(token):
                continue
            text = ll_tokenizer.decode_bytes([token]).decode("utf-8", errors="replace").strip(" ")
            if not text:
                continue
            chars = set(text)
            if chars <= CLOSERS:
                (quoting if text[0] == '"' else closing).append(token)
            if chars <= SEPARATORS:
                separating.append(token)
        self.end = _bitmask_of(eos_token_ids, vocab_size)
        self.levels = [_bitmask_of(ids, vocab_size) for ids in (quoting, closing, separating) if ids]

    def tokens_to_close(self, matcher: Any, limit: int) -> int:
        """How many tokens (the final end of sequence included) the wrap-up would take to end the
        document from ``matcher``'s state, following its preferences and, where they leave a choice,
        the first allowed token; ``limit`` if it takes that many or more."""
        m = matcher.deep_copy()
        words = self.end.numel()
        for n in range(limit):
            if m.is_stopped() or m.is_accepting() or m.is_error():
                return n + 1
            row = torch.frombuffer(bytearray(m.compute_bitmask()), dtype=torch.int32)[:words].clone()
            self.narrow(row, may_end=False)
            set_words = row.nonzero()
            if set_words.numel() == 0:
                return limit
            w = int(set_words[0])
            bits = int(row[w]) & 0xFFFFFFFF
            m.consume_token(32 * w + (bits & -bits).bit_length() - 1)  # the lowest allowed token id
        return limit

    def narrow(self, bitmask_row: torch.Tensor, may_end: bool = True) -> None:
        """Keep, of the tokens ``bitmask_row`` allows, the most preferred class that has any (in place):
        the end of the sequence first where ``may_end`` (not while ``min_tokens`` holds it back)."""
        for level in ([self.end] if may_end else []) + self.levels:
            narrowed = bitmask_row & level
            if bool(narrowed.any()):
                bitmask_row.copy_(narrowed)
                return
