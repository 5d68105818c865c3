"""Hermes / Qwen 2.5: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call,
after any content."""

from __future__ import annotations

from pagellm.entrypoints.openai.tool_parsers.base import (
    ParsedOutput,
    ToolParser,
    held_back,
    scan_call_object,
    skip_ws,
)

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        first = text.find(START)
        if first < 0:
            return ParsedOutput(text if final else text[: len(text) - held_back(text, START)])
        out = ParsedOutput(text[:first])
        pos = first
        while pos >= 0:
            j = skip_ws(text, pos + len(START))
            if j >= len(text):
                break
            if text[j] != "{":
                return ParsedOutput(text) if final else out
            scan = scan_call_object(text, j)
            out.calls.append(scan.call)
            if scan.malformed or scan.end is None:
                break
            close = text.find(END, scan.end)
            pos = text.find(START, close if close >= 0 else scan.end)
        if final and not out.tools_called:
            return ParsedOutput(text)
        return out
