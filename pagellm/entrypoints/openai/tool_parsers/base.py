"""What every tool-call parser returns, and the incremental JSON scanning they share.

A parser reads the whole text generated so far and says what of it is content and which tool calls
it holds, each call's arguments as the raw JSON text written so far. Reading the same text again with
more appended only ever extends that view, so a stream sends differences and the non-streamed answer
(the same parse of the final text) is what a streamed one reassembles to.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

WHITESPACE = " \t\n\r"


@dataclass
class PartialCall:
    """One tool call as far as it is written: ``name`` once its string is complete, ``arguments`` the
    JSON text of the arguments so far, ``complete`` once the whole call is."""

    name: str | None = None
    arguments: str = ""
    complete: bool = False


@dataclass
class ParsedOutput:
    content: str = ""
    calls: list[PartialCall] = field(default_factory=list)

    @property
    def tools_called(self) -> bool:
        return bool(self.calls) and all(c.complete and c.name is not None for c in self.calls)


class ToolParser:
    """A model family's tool-call format. ``parse(text, final)``: ``final`` once generation ended (no
    text held back as a possible start of a call; malformed calls become content)."""

    name = "base"
    # Whether the format's markers are special tokens, which detokenizing must then keep.
    keeps_special_tokens = False

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        # The request's tools (OpenAI's shape), for formats whose values are typed by the schema.
        self.tools = tools or []

    def parse(self, text: str, final: bool) -> ParsedOutput:
        raise NotImplementedError


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i


def scan_string(text: str, i: int) -> int | None:
    """End (exclusive) of the JSON string starting at ``text[i] == '"'``; None if it is not closed yet."""
    j = i + 1
    while j < len(text):
        ch = text[j]
        if ch == "\\":
            j += 2
            continue
        if ch == '"':
            return j + 1
        j += 1
    return None


def scan_value(text: str, i: int) -> int | None:
    """End (exclusive) of the JSON value starting at ``text[i]``; None if the text ends inside it (a
    number at the very end may still grow)."""
    if i >= len(text):
        return None
    ch = text[i]
    if ch == '"':
        return scan_string(text, i)
    if ch in "{[":
        depth = 0
        j = i
        while j < len(text):
            c = text[j]
            if c == '"':
                end = scan_string(text, j)
                if end is None:
                    return None
                j = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(text) and text[j] not in ",}] \t\n\r":
        j += 1
    return j if j < len(text) else None


@dataclass
class ObjectScan:
    call: PartialCall
    end: int | None  # end (exclusive) of the object; None while it is open
    malformed: bool = False


ARGUMENT_KEYS = ("arguments", "parameters")


def scan_call_object(text: str, i: int) -> ObjectScan:
    """A ``{"name": ..., "arguments"|"parameters": {...}}`` object starting at ``text[i] == '{'``."""
    call = PartialCall()
    args_string = False  # arguments written as a JSON string holding JSON (some models do)
    j = i + 1
    while True:
        j = skip_ws(text, j)
        if j >= len(text):
            return ObjectScan(call, None)
        ch = text[j]
        if ch == "}":
            call.complete = call.name is not None
            if args_string:
                call.arguments = _unquote(call.arguments)
            return ObjectScan(call, j + 1, malformed=call.name is None)
        if ch == ",":
            j += 1
            continue
        if ch != '"':
            return ObjectScan(call, None, malformed=True)
        kend = scan_string(text, j)
        if kend is None:
            return ObjectScan(call, None)
        key = _unquote(text[j:kend])
        j = skip_ws(text, kend)
        if j >= len(text):
            return ObjectScan(call, None)
        if text[j] != ":":
            return ObjectScan(call, None, malformed=True)
        j = skip_ws(text, j + 1)
        if j >= len(text):
            return ObjectScan(call, None)
        vend = scan_value(text, j)
        if key == "name":
            if vend is not None and text[j] == '"':
                call.name = _unquote(text[j:vend])
        elif key in ARGUMENT_KEYS:
            args_string = text[j] == '"'
            # A string's partial text is not JSON of the arguments: it is sent once complete.
            call.arguments = text[j:vend] if vend is not None else ("" if args_string else text[j:])
        if vend is None:
            return ObjectScan(call, None)
        j = vend


def _unquote(s: str) -> str:
    try:
        v = json.loads(s)
    except json.JSONDecodeError:
        return s
    return v if isinstance(v, str) else s


def scan_call_array(text: str, i: int) -> tuple[list[PartialCall], int | None, bool]:
    """A JSON array of call objects starting at ``text[i] == '['``: (calls, end or None, malformed)."""
    calls: list[PartialCall] = []
    j = i + 1
    while True:
        j = skip_ws(text, j)
        if j >= len(text):
            return calls, None, False
        ch = text[j]
        if ch == "]":
            return calls, j + 1, False
        if ch == ",":
            j += 1
            continue
        if ch != "{":
            return calls, None, True
        scan = scan_call_object(text, j)
        calls.append(scan.call)
        if scan.malformed:
            return calls, None, True
        if scan.end is None:
            return calls, None, False
        j = scan.end


def held_back(text: str, marker: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``marker`` (it may become one)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def tagged_calls(text: str, final: bool, start: str,
                 read_call: Callable[[str, int], tuple[PartialCall | None, int | None]]) -> ParsedOutput:
    """Content, then calls each in a block opening with ``start``: ``read_call(text, i)`` reads the
    block whose body starts at ``i`` into (its call, or None where it holds none (yet); where to look
    for the next block, or None while this one is open). A final text without complete calls is all
    content."""
    first = text.find(start)
    if first < 0:
        return ParsedOutput(text if final else text[: len(text) - held_back(text, start)])
    out = ParsedOutput(text[:first])
    pos = first
    while pos >= 0:
        call, after = read_call(text, pos + len(start))
        if call is None:
            break
        out.calls.append(call)
        if after is None:
            break
        pos = text.find(start, after)
    if final and not out.tools_called:
        return ParsedOutput(text)
    return out
