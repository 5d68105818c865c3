"""Reasoning parsers (``--reasoning-parser``): which part of a reasoning model's output is its thinking.

A reasoning model writes its thinking between ``<think>`` and ``</think>``, then its answer. The chat
template may open the thinking in the prompt (DeepSeek-R1's, and Qwen3's newer thinking models': the
output then starts inside it), or close it there (Qwen3 with ``enable_thinking: false``: no thinking
at all). The server reads the rendered prompt to tell (``PromptThinking``), and the parser splits the
output text: the thinking goes to ``reasoning_content`` (and vLLM's newer ``reasoning``), the rest is
the answer that content, tool calls and constraints are about.

Reading the same text again with more appended only ever extends both parts (a possible start of a
tag is held back until it is one or is not), so a stream sends differences and the non-streamed
answer (the same split of the final text) is what a streamed one reassembles to.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pagellm.entrypoints.openai.tool_parsers.base import held_back

START, END = "<think>", "</think>"


class PromptThinking(enum.Enum):
    """What the rendered prompt already did to the thinking."""

    NONE = "none"  # nothing: the model opens it itself, or answers directly
    OPENED = "opened"  # the prompt ends inside it
    CLOSED = "closed"  # the prompt ends after it: there is none to parse

    @classmethod
    def of(cls, prompt: str) -> PromptThinking:
        tail = prompt.rstrip()
        if tail.endswith(END):
            return cls.CLOSED
        return cls.OPENED if tail.endswith(START) else cls.NONE


@dataclass
class ReasoningSplit:
    reasoning: str = ""
    content: str = ""
    ended: bool = False  # the thinking is over (or there was none): content follows


class ReasoningParser:
    """``<think>``/``</think>`` reasoning (vLLM's ``qwen3``, and the generic ``think``): an output that
    does not open with ``<think>`` is all answer, unless the prompt opened the thinking."""

    name = "think"
    # Whether an output is thinking from its first token whatever the prompt (DeepSeek-R1's).
    always_opened = False

    def split(self, text: str, final: bool, prompt: PromptThinking = PromptThinking.NONE) -> ReasoningSplit:
        if prompt is PromptThinking.CLOSED:
            return ReasoningSplit(content=text, ended=True)
        stripped = text.lstrip()
        opened = prompt is PromptThinking.OPENED or self.always_opened
        if stripped.startswith(START):
            body, opened = stripped[len(START):], True
        elif not final and stripped and START.startswith(stripped):
            return ReasoningSplit()  # maybe the start of "<think>"
        else:
            body = text
        if not opened:
            return ReasoningSplit(content=text, ended=True)
        end = body.find(END)
        if end >= 0:
            return ReasoningSplit(body[:end], body[end + len(END):].lstrip(), ended=True)
        if final:
            return ReasoningSplit(body)  # cut off while thinking: no answer
        return ReasoningSplit(body[: len(body) - held_back(body, END)])


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1: everything before ``</think>`` is thinking, whether or not ``<think>`` was written."""

    name = "deepseek_r1"
    always_opened = True


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (ReasoningParser, Qwen3ReasoningParser, DeepSeekR1ReasoningParser)}


def get_reasoning_parser(name: str) -> ReasoningParser:
    try:
        return REASONING_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {sorted(REASONING_PARSERS)}") from None

