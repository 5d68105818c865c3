"""Pythonic calls (Llama 3.2 and 4): the output is a Python list of calls with keyword arguments,
``[get_weather(city="Paris"), get_time()]``, optionally between Llama 4's ``<|python_start|>`` and
``<|python_end|>``.

The list is read with Python's own parser once it closes; until then an output that starts like one
is held back, so content never shows a call's text. Arguments must be literals (strings, numbers,
booleans, None, lists and dicts of them); they become a JSON object.
"""

from __future__ import annotations

import ast
import json
import re

from pagellm.entrypoints.openai.tool_parsers.base import ParsedOutput, PartialCall, ToolParser, skip_ws

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
# How a list of calls begins: "[", a name, "(" (with what may still be missing at the end of a stream).
_OPENING = re.compile(r"\[\s*([A-Za-z_][\w.]*(\s*\(.*)?)?\Z", re.DOTALL)


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        body = text.strip()
        if body.startswith(PYTHON_START):
            body = body[len(PYTHON_START):].removesuffix(PYTHON_END).strip()
        elif not final and PYTHON_START.startswith(body) and body:
            return ParsedOutput()
        j = skip_ws(body, 0)
        if j >= len(body) or body[j] != "[":
            return ParsedOutput(text)
        calls = _calls(body)
        if calls is not None:
            return ParsedOutput("", calls)
        if final or not _OPENING.match(body):
            return ParsedOutput(text)
        return ParsedOutput()  # a list of calls still being written


def _calls(body: str) -> list[PartialCall] | None:
    """The calls of ``body`` if it is one complete Python list of calls with literal arguments."""
    try:
        tree = ast.parse(body, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for element in tree.elts:
        if not isinstance(element, ast.Call) or element.args or not isinstance(element.func, ast.Name | ast.Attribute):
            return None
        try:
            arguments = {k.arg: ast.literal_eval(k.value) for k in element.keywords if k.arg is not None}
        except ValueError:
            return None
        calls.append(PartialCall(ast.unparse(element.func), json.dumps(arguments), complete=True))
    return calls
