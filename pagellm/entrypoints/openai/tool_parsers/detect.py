"""Which tool-call format a chat template speaks (``--tool-call-parser auto``, the default).

A template that renders ``tools`` teaches the model its family's format; its own text names that
format's markers. One that never reads ``tools`` (the embedded default's, and most base models') gets
pagellm's generic format (``entrypoints/openai/generic_tools.py``).
"""

from __future__ import annotations

import re

GENERIC = "generic"

# (a marker of the format in the template's text, the parser), the most specific first.
_MARKERS: tuple[tuple[str, str], ...] = (
    ("<parameter=", "qwen3_coder"),
    ("<tool_call>", "hermes"),
    ("[TOOL_CALLS]", "mistral"),
    ("<|python_start|>", "pythonic"),
    ("[func_name1(", "pythonic"),
    ("<|python_tag|>", "llama3_json"),
    ('"parameters": dictionary of argument name', "llama3_json"),
)
_READS_TOOLS = re.compile(r"\btools\b")


def parser_for_template(template: str | None) -> str:
    """The tool-call parser that fits ``template``: a family's, or ``generic`` where the template
    renders no tools or in a format pagellm does not know."""
    if not template or not _READS_TOOLS.search(template):
        return GENERIC
    return next((parser for marker, parser in _MARKERS if marker in template), GENERIC)
