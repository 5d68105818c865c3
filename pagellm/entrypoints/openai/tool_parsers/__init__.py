"""Tool-call parsers, one module per model family's format, chosen with ``--tool-call-parser``."""

from __future__ import annotations

from pagellm.entrypoints.openai.tool_parsers.base import ParsedOutput, PartialCall, ToolParser
from pagellm.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from pagellm.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from pagellm.entrypoints.openai.tool_parsers.mistral import MistralToolParser

# --tool-call-parser name -> parser (vLLM's names; qwen is Qwen 2.5's, the Hermes format).
TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "qwen": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
}


def get_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of {sorted(TOOL_PARSERS)}") from None


__all__ = ["TOOL_PARSERS", "ParsedOutput", "PartialCall", "ToolParser", "get_tool_parser"]
