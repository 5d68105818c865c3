"""Qwen3-Coder: XML-like calls, one ``<tool_call>`` block per call::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A parameter's value is text; it becomes JSON by the type the tool's schema gives it (a string stays a
string, a number or an object is read as JSON), or, for a parameter the schema does not know, as JSON
where it parses. The arguments grow one complete parameter at a time, so a stream never sends a value
that a later token could still change.
"""

from __future__ import annotations

import json
from typing import Any

from pagellm.entrypoints.openai.tool_parsers.base import ParsedOutput, PartialCall, ToolParser, tagged_calls

START, END = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        return tagged_calls(text, final, START, self._call)

    def _call(self, text: str, i: int) -> tuple[PartialCall | None, int | None]:
        """The call whose block starts at ``i`` and where its block ends (None: still open)."""
        f = text.find(FUNCTION, i)
        if f < 0 or text[i:f].strip():
            return None, None
        close = text.find(">", f)
        if close < 0:
            return None, None
        call = PartialCall(name=text[f + len(FUNCTION):close].strip())
        types = self._types(call.name)
        pairs: list[str] = []
        j = close + 1
        while True:
            p = text.find(PARAMETER, j)
            stop = text.find(FUNCTION_END, j)
            if p < 0 or (0 <= stop < p):
                break
            key_end = text.find(">", p)
            value_end = text.find(PARAMETER_END, key_end + 1) if key_end >= 0 else -1
            if value_end < 0:
                break
            key = text[p + len(PARAMETER):key_end].strip()
            value = _strip_newline(text[key_end + 1:value_end])
            pairs.append(f"{json.dumps(key)}: {json.dumps(_typed(value, types.get(key)))}")
            j = value_end + len(PARAMETER_END)
        stop = text.find(FUNCTION_END, j)
        if stop < 0:
            call.arguments = "{" + ", ".join(pairs) if pairs else ""
            return call, None
        call.arguments = "{" + ", ".join(pairs) + "}"
        call.complete = True
        block_end = text.find(END, stop)
        return call, (block_end + len(END)) if block_end >= 0 else stop + len(FUNCTION_END)

    def _types(self, name: str | None) -> dict[str, Any]:
        """Each parameter's JSON schema ``type`` for the tool ``name``."""
        for tool in self.tools:
            function = tool.get("function", {})
            if function.get("name") == name:
                props = (function.get("parameters") or {}).get("properties") or {}
                return {k: v.get("type") for k, v in props.items() if isinstance(v, dict)}
        return {}


def _strip_newline(value: str) -> str:
    """The value without the one newline the format puts on each side of it."""
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def _typed(value: str, kind: Any) -> Any:
    """``value`` as the schema's type asks (JSON where it parses, for a type the schema does not give)."""
    if kind == "string" or (isinstance(kind, list) and "string" in kind):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value
