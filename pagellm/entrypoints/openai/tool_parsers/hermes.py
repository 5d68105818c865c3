"""Hermes / Qwen 2.5: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call,
after any content."""

from __future__ import annotations

from pagellm.entrypoints.openai.tool_parsers.base import (
    ParsedOutput,
    PartialCall,
    ToolParser,
    scan_call_object,
    skip_ws,
    tagged_calls,
)

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        return tagged_calls(text, final, START, _read_call)


def _read_call(text: str, i: int) -> tuple[PartialCall | None, int | None]:
    j = skip_ws(text, i)
    if j >= len(text) or text[j] != "{":
        return None, None
    scan = scan_call_object(text, j)
    if scan.malformed or scan.end is None:
        return scan.call, None
    close = text.find(END, scan.end)
    return scan.call, close if close >= 0 else scan.end
