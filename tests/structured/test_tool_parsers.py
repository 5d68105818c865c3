"""Tool-call parsers: the final parse, and streams that add up to it whatever the chunking."""

from __future__ import annotations

import json

import pytest

from pagellm.entrypoints.openai.tool_calling import ToolCallStream, ToolMode
from pagellm.entrypoints.openai.tool_parsers import get_tool_parser

ARGS = '{"city": "Paris", "when": {"day": 2, "note": "a } in \\" text"}}'
CASES = {
    "hermes": (f'Let me check.<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n</tool_call>'
               '<tool_call>{"name": "lookup", "arguments": {}}</tool_call>', "Let me check."),
    "qwen": (f'<tool_call>{{"name": "get_weather", "arguments": {ARGS}}}</tool_call>\n'
             '<tool_call>{"name": "lookup", "arguments": {}}</tool_call>', ""),
    "llama3_json": (f'<|python_tag|>{{"name": "get_weather", "parameters": {ARGS}}}; '
                    '{"name": "lookup", "parameters": {}}', ""),
    "mistral": (f'Sure [TOOL_CALLS] [{{"name": "get_weather", "arguments": {ARGS}}}, '
                '{"name": "lookup", "arguments": {}}]', "Sure "),
    "qwen3_coder": ('Let me check.<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n'
                    f'<parameter=when>\n{json.dumps(json.loads(ARGS)["when"])}\n</parameter>\n</function>\n'
                    '</tool_call>\n<tool_call>\n<function=lookup>\n</function>\n</tool_call>', "Let me check."),
    "pythonic": ('[get_weather(city="Paris", when={"day": 2, "note": "a } in \\" text"}), lookup()]', ""),
}


@pytest.mark.parametrize("name", list(CASES))
def test_final_parse(name):
    text, content = CASES[name]
    parsed = get_tool_parser(name).parse(text, final=True)
    assert parsed.tools_called
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("get_weather", json.loads(ARGS)), ("lookup", {})]


def test_mistral_v11_format():
    parsed = get_tool_parser("mistral").parse(f'[TOOL_CALLS]get_weather[ARGS]{ARGS}[TOOL_CALLS]lookup[ARGS]{{}}',
                                              final=True)
    assert [(c.name, c.arguments) for c in parsed.calls] == [("get_weather", ARGS), ("lookup", "{}")]


@pytest.mark.parametrize("name", list(CASES))
def test_plain_text_and_malformed_calls_are_content(name):
    parser = get_tool_parser(name)
    assert parser.parse("Just words.", final=True).content == "Just words."
    assert not parser.parse("Just words.", final=True).calls
    broken = CASES[name][0][:40]
    parsed = parser.parse(broken, final=True)
    assert not parsed.tools_called and parsed.content == broken


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("step", [1, 3, 7])
def test_streams_add_up_to_the_final_parse(name, step):
    text, content = CASES[name]
    stream = ToolCallStream(ToolMode("auto", parser=get_tool_parser(name)))
    deltas = []
    for end in range(step, len(text) + step, step):
        deltas += stream.deltas(text[:end], final=end >= len(text))
    got_content = "".join(d.get("content", "") for d in deltas)
    calls: dict[int, dict] = {}
    for d in deltas:
        for tc in d.get("tool_calls", []):
            entry = calls.setdefault(tc["index"], {"name": None, "arguments": ""})
            entry["name"] = tc["function"].get("name") or entry["name"]
            entry["arguments"] += tc["function"].get("arguments", "")
    final = get_tool_parser(name).parse(text, final=True)
    assert got_content == content
    assert [(calls[k]["name"], calls[k]["arguments"]) for k in sorted(calls)] == [
        (c.name, c.arguments) for c in final.calls]


def test_hermes_holds_back_a_partial_tag():
    parser = get_tool_parser("hermes")
    assert parser.parse("Hello <tool_", final=False).content == "Hello "
    assert parser.parse("Hello <tool_", final=True).content == "Hello <tool_"


def test_unknown_parser():
    with pytest.raises(ValueError, match="unknown tool call parser 'nope'"):
        get_tool_parser("nope")
