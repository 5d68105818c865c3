"""Tool calls for a model whose chat template knows no tools: pagellm's generic format.

Agent frameworks send ``tools`` with ``tool_choice: "auto"`` whatever the model. A template that never
renders ``tools`` (the embedded default's, and most base models') would drop them, and the model
would never call one. So, as llama.cpp's server does with a format of its own, the tools are described
in the system prompt and the output is held by a grammar to one of two shapes:

- an answer in text (which cannot begin with ``<``, the start of a call), or
- one call, or with ``parallel_tool_calls`` several, each
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` with arguments matching the tool's
  ``parameters``; the Hermes parser reads them.

The conversation's earlier calls and results are written in the same words, since such a template
cannot render ``tool_calls`` or the ``tool`` role either: an assistant's calls become its text, a tool's
result a user message in ``<tool_response>`` tags (consecutive results in one message).
"""

from __future__ import annotations

import json
from typing import Any

from pagellm.entrypoints.openai.tool_calling import call_schema
from pagellm.sampling_params import StructuredOutputsParams
from pagellm.structured_output.backend_guidance import JSON_OPTIONS

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
RESPONSE_START, RESPONSE_END = "<tool_response>", "</tool_response>"


def system_prompt(tools: list[dict[str, Any]]) -> str:
    """What the model is told of the tools and how to call them (an example call of the first tool:
    small models follow an example better than a description)."""
    described = "\n".join(json.dumps({k: v for k, v in t["function"].items() if k in ("name", "description",
                                                                                    "parameters")})
                          for t in tools)
    first = tools[0]["function"]
    params = (first.get("parameters") or {}).get("properties") or {}
    example = json.dumps({"name": first["name"], "arguments": {k: "..." for k in list(params)[:2]}})
    return ("You have access to these tools:\n"
            f"{described}\n\n"
            "When the user's request needs a tool, do not answer yourself: reply with only the call, "
            f"for example {CALL_START}{example}{CALL_END}, and the tool's result comes back to you between "
            f"{RESPONSE_START} and {RESPONSE_END}. Otherwise, answer the user in plain text.")


def conversation(messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                 as_parts: bool = False) -> list[dict[str, Any]]:
    """``messages`` (as chat templates read them) in the generic format, the tools' description in the
    system prompt; ``as_parts``: each content as OpenAI's list of text parts (a template that reads
    them so), else as text."""
    prompt = system_prompt(tools)
    out: list[dict[str, Any]] = []
    if messages and messages[0]["role"] == "system":
        out.append({"role": "system", "content": f"{text_of(messages[0]['content'])}\n\n{prompt}".lstrip()})
        messages = messages[1:]
    else:
        out.append({"role": "system", "content": prompt})
    for m in messages:
        if m["role"] == "tool":
            result = f"{RESPONSE_START}\n{text_of(m['content'])}\n{RESPONSE_END}"
            if out[-1].get("tool_result"):
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result, "tool_result": True})
            continue
        entry = {k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id", "name")}
        entry["content"] = text_of(m["content"])
        if m.get("tool_calls"):
            calls = "".join(f"{CALL_START}{json.dumps(_call(c))}{CALL_END}" for c in m["tool_calls"])
            entry["content"] = f"{entry['content']}\n{calls}" if entry["content"] else calls
        out.append(entry)
    for m in out:
        m.pop("tool_result", None)
        if as_parts:
            m["content"] = [{"type": "text", "text": m["content"]}]
    return out


def text_of(content: Any) -> str:
    """A message's content as text (OpenAI's list of parts joined, as vLLM joins them)."""
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


def _call(call: dict[str, Any]) -> dict[str, Any]:
    """A history call (its arguments already an object: serving_chat.history_tool_calls) as written."""
    fn = call["function"]
    return {"name": fn["name"], "arguments": fn.get("arguments", {})}


def constraint(tools: list[dict[str, Any]], parallel: bool) -> StructuredOutputsParams:
    """The grammar of the generic format's answers: text, or calls of the given tools."""
    # Laid out as json.dumps lays it out, as every JSON constraint is (no padding with whitespace).
    schema = json.dumps({**call_schema(tools, "arguments"), "x-guidance": JSON_OPTIONS})
    call = f'"{CALL_START}" %json {schema} "{CALL_END}"'
    calls = 'call (/\\s*/ call)*' if parallel else "call"
    grammar = (f"start: text | calls\n"
               f"text: /[^<][\\s\\S]*/\n"
               f"calls: {calls}\n"
               f"call: {call}\n")
    return StructuredOutputsParams(grammar=grammar)
