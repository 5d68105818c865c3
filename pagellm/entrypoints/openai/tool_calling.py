"""Tool calling for chat: ``tool_choice`` -> how the output is produced and read, and the stream of
OpenAI's ``tool_calls`` deltas.

``required`` and a named function constrain decoding with a JSON schema built from the tools, so the
arguments always parse and match the function's ``parameters``: ``required`` generates a JSON array of
``{"name": ..., "parameters": {...}}`` (as vLLM does), a named function its arguments object alone.
``auto`` lets the model write freely and reads its calls with the ``--tool-call-parser`` (by default
the format the chat template speaks; for a template without tools, pagellm's generic format, whose
grammar holds the answer to text or calls: generic_tools.py).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagellm.entrypoints.openai.errors import APIError
from pagellm.entrypoints.openai.tool_parsers import ParsedOutput, PartialCall, ToolParser
from pagellm.entrypoints.openai.tool_parsers.base import scan_call_array, skip_ws
from pagellm.sampling_params import StructuredOutputsParams

ANY_OBJECT: dict[str, Any] = {"type": "object"}


def tool_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def parameters_of(tool: dict[str, Any]) -> dict[str, Any]:
    params = tool["function"].get("parameters")
    return params if isinstance(params, dict) and params else ANY_OBJECT


# Keywords whose values are data, not schemas: a "$ref" key inside them is no reference.
_DATA_KEYWORDS = ("const", "enum", "default", "examples")


def _has_local_ref(schema: Any) -> bool:
    if isinstance(schema, list):
        return any(_has_local_ref(s) for s in schema)
    if not isinstance(schema, dict):
        return False
    ref = schema.get("$ref")
    return (isinstance(ref, str) and ref.startswith("#")) or any(
        _has_local_ref(v) for k, v in schema.items() if k not in _DATA_KEYWORDS)


def _rebase_refs(schema: Any, base: str) -> Any:
    """``schema`` with its local ``$ref``s ("#", "#/$defs/Loc", ...) made relative to the JSON pointer
    ``base`` of the document it is moved into ("#/$defs/Loc" -> base + "/$defs/Loc")."""
    if isinstance(schema, list):
        return [_rebase_refs(s, base) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for k, v in schema.items():
        if k == "$ref" and isinstance(v, str) and (v == "#" or v.startswith("#/")):
            out[k] = "#" + base + v[1:]
        else:
            out[k] = v if k in _DATA_KEYWORDS else _rebase_refs(v, base)
    return out


def call_schema(tools: list[dict[str, Any]], arguments_key: str) -> dict[str, Any]:
    """One call of one of ``tools``: ``{"name": ..., arguments_key: {...}}``, its arguments matching the
    tool's ``parameters``.

    A tool's ``parameters`` that refer to their own definitions (``$ref: "#/$defs/Loc"``, as pydantic
    writes them) would resolve against the combined schema's root: such a tool's whole schema moves
    into the root's ``$defs`` under a name of its own (``tool_0``, ...) with its references rebased
    ("#/$defs/tool_0/$defs/Loc"), so tools that define the same names each keep their own."""
    defs: dict[str, Any] = {}
    items = []
    for i, t in enumerate(tools):
        params = parameters_of(t)
        if _has_local_ref(params):
            key = f"tool_{i}"
            defs[key] = _rebase_refs(params, f"/$defs/{key}")
            params = {"$ref": f"#/$defs/{key}"}
        items.append({"type": "object",
                      "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                     arguments_key: params},
                      "required": ["name", arguments_key], "additionalProperties": False})
    schema: dict[str, Any] = items[0] if len(items) == 1 else {"anyOf": items}
    if defs:
        schema = {**schema, "$defs": defs}
    return schema


def required_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """A JSON array of one or more calls (one at most without ``parallel``), each of a given tool, as
    ``{"name": ..., "parameters": {...}}`` (as vLLM does)."""
    call = call_schema(tools, "parameters")
    defs = call.pop("$defs", None)
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": call}
    if defs:
        schema["$defs"] = defs
    if not parallel:
        schema["maxItems"] = 1
    return schema


@dataclass
class ToolMode:
    """How one chat request's output becomes content and tool calls."""

    kind: str  # "none" (plain text), "auto" (a parser reads it), "required" or "named" (constrained)
    parser: ToolParser | None = None
    function: str | None = None  # the named function
    constraint: StructuredOutputsParams | None = None

    @property
    def keeps_special_tokens(self) -> bool:
        return self.kind == "auto" and self.parser is not None and self.parser.keeps_special_tokens

    def parse(self, text: str, final: bool) -> ParsedOutput:
        if self.kind == "auto":
            assert self.parser is not None
            return self.parser.parse(text, final)
        if self.kind == "named":
            return ParsedOutput("", [PartialCall(self.function, text, final)])
        if self.kind == "required":
            j = skip_ws(text, 0)
            if j >= len(text):
                return ParsedOutput()
            if text[j] != "[":
                return ParsedOutput(text if final else "")
            calls, end, malformed = scan_call_array(text, j)
            out = ParsedOutput("", calls)
            if final and (malformed or end is None or not out.tools_called):
                return ParsedOutput(text)
            return out
        return ParsedOutput(text)


def tool_mode(tools: list[dict[str, Any]] | None, tool_choice: Any, parallel: bool | None,
              parser_factory: Callable[[], ToolParser]) -> ToolMode:
    """The request's ``ToolMode``; APIError 400 on a choice that does not fit its tools or the server."""
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if isinstance(tool_choice, str):
        if tool_choice == "none":
            return ToolMode("none")
        if tool_choice not in ("auto", "required"):
            raise APIError(400, f"tool_choice must be 'none', 'auto', 'required' or "
                                f"{{'type': 'function', 'function': {{'name': ...}}}}, got {tool_choice!r}",
                           param="tool_choice")
        if not tools:
            raise APIError(400, f"tool_choice {tool_choice!r} needs tools", param="tool_choice")
        if tool_choice == "required":
            return ToolMode("required", constraint=StructuredOutputsParams(
                json=required_schema(tools, parallel is not False)))
        return ToolMode("auto", parser=parser_factory())
    name = None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" \
            and isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
    if not isinstance(name, str):
        raise APIError(400, "a named tool_choice is {'type': 'function', 'function': {'name': 'NAME'}}",
                       param="tool_choice")
    tool = next((t for t in tools or [] if t["function"]["name"] == name), None)
    if tool is None:
        raise APIError(400, f"tool_choice names the function {name!r}, which is not among the tools",
                       param="tool_choice")
    return ToolMode("named", function=name, constraint=StructuredOutputsParams(json=parameters_of(tool)))


def message_tool_calls(parsed: ParsedOutput) -> list[dict[str, Any]]:
    return [{"id": tool_call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in parsed.calls]


@dataclass
class ToolCallStream:
    """What one streamed choice has sent: its content, and per call the header and argument text."""

    mode: ToolMode
    content_sent: int = 0
    ids: list[str] = field(default_factory=list)
    args_sent: list[int] = field(default_factory=list)

    def deltas(self, text: str, final: bool) -> list[dict[str, Any]]:
        """The chat deltas that bring the client from what it has to ``text`` parsed."""
        parsed = self.mode.parse(text, final)
        out: list[dict[str, Any]] = []
        if len(parsed.content) > self.content_sent and not (final and self.ids):
            out.append({"content": parsed.content[self.content_sent:]})
            self.content_sent = len(parsed.content)
        for k, call in enumerate(parsed.calls):
            if call.name is None:
                break  # a call's arguments follow its name
            if k == len(self.ids):
                self.ids.append(tool_call_id())
                self.args_sent.append(0)
                out.append({"tool_calls": [{"index": k, "id": self.ids[k], "type": "function",
                                            "function": {"name": call.name, "arguments": ""}}]})
            fragment = call.arguments[self.args_sent[k]:]
            if fragment:
                self.args_sent[k] = len(call.arguments)
                out.append({"tool_calls": [{"index": k, "function": {"arguments": fragment}}]})
        return out

    @property
    def called(self) -> bool:
        return bool(self.ids)
