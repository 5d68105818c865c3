"""Llama 3.x JSON tool calls: the whole output is ``{"name": ..., "parameters": {...}}`` (after an
optional ``<|python_tag|>``), several separated by ``;``."""

from __future__ import annotations

from pagellm.entrypoints.openai.tool_parsers.base import ParsedOutput, ToolParser, scan_call_object, skip_ws

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        j = skip_ws(text, 0)
        if text.startswith(PYTHON_TAG, j):
            j = skip_ws(text, j + len(PYTHON_TAG))
        elif j < len(text) and PYTHON_TAG.startswith(text[j:]) and not final:
            return ParsedOutput()
        if j >= len(text):
            return ParsedOutput(text if final else "")
        if text[j] != "{":
            return ParsedOutput(text)
        out = ParsedOutput()
        while True:
            scan = scan_call_object(text, j)
            out.calls.append(scan.call)
            if scan.malformed or scan.end is None:
                break
            j = skip_ws(text, scan.end)
            if j < len(text) and text[j] == ";":
                j = skip_ws(text, j + 1)
            if j >= len(text) or text[j] != "{":
                break
        if final and not out.tools_called:
            return ParsedOutput(text)
        return out
