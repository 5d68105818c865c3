"""Mistral: ``[TOOL_CALLS]`` then a JSON array of ``{"name": ..., "arguments": {...}}`` (v3 tokenizers),
or ``[TOOL_CALLS]name[ARGS]{...}`` per call (v11 and later). ``[TOOL_CALLS]`` is a special token."""

from __future__ import annotations

from pagellm.entrypoints.openai.tool_parsers.base import (
    ParsedOutput,
    PartialCall,
    ToolParser,
    held_back,
    scan_call_array,
    scan_value,
    skip_ws,
)

BOT, ARGS = "[TOOL_CALLS]", "[ARGS]"


class MistralToolParser(ToolParser):
    name = "mistral"
    keeps_special_tokens = True

    def parse(self, text: str, final: bool) -> ParsedOutput:
        first = text.find(BOT)
        if first < 0:
            return ParsedOutput(text if final else text[: len(text) - held_back(text, BOT)])
        out = ParsedOutput(text[:first])
        j = skip_ws(text, first + len(BOT))
        if j < len(text) and text[j] == "[":
            calls, _, malformed = scan_call_array(text, j)
            out.calls = calls
            if malformed and final:
                return ParsedOutput(text)
        else:
            self._parse_v11(text, first, out)
        if final and not out.tools_called:
            return ParsedOutput(text)
        return out

    @staticmethod
    def _parse_v11(text: str, start: int, out: ParsedOutput) -> None:
        pos = start
        while pos >= 0:
            head = pos + len(BOT)
            args_at = text.find(ARGS, head)
            if args_at < 0:
                return
            call = PartialCall(name=text[head:args_at].strip())
            out.calls.append(call)
            j = skip_ws(text, args_at + len(ARGS))
            end = scan_value(text, j)
            call.arguments = text[j:end] if end is not None else text[j:]
            if end is None:
                return
            call.complete = True
            pos = text.find(BOT, end)
