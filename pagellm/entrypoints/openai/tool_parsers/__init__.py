"""Tool-call parsers, one module per model family's format, chosen with ``--tool-call-parser`` (``auto``,
the default: the one the chat template speaks, ``detect.py``)."""

from __future__ import annotations

from typing import Any

from pagellm.entrypoints.openai.tool_parsers.base import ParsedOutput, PartialCall, ToolParser
from pagellm.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from pagellm.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from pagellm.entrypoints.openai.tool_parsers.mistral import MistralToolParser
from pagellm.entrypoints.openai.tool_parsers.pythonic import PythonicToolParser
from pagellm.entrypoints.openai.tool_parsers.qwen3_coder import Qwen3CoderToolParser

# --tool-call-parser name -> parser (vLLM's names; qwen is Qwen 2.5's, the Hermes format; generic is
# pagellm's format for templates without tools, whose calls are Hermes blocks).
TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "qwen": HermesToolParser,
    "generic": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
    "pythonic": PythonicToolParser,
}


def get_tool_parser(name: str, tools: list[dict[str, Any]] | None = None) -> ToolParser:
    """The parser ``name`` for a request with these ``tools``."""
    try:
        return TOOL_PARSERS[name](tools)
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of {sorted(TOOL_PARSERS)}") from None


__all__ = ["TOOL_PARSERS", "ParsedOutput", "PartialCall", "ToolParser", "get_tool_parser"]
