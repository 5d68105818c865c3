"""Which tool-call format a chat template speaks, the typed values of Qwen3-Coder's calls, and the
generic format for templates without tools: its prompt, its history and its grammar."""

from __future__ import annotations

import json

import pytest

from pagellm.entrypoints.openai import generic_tools
from pagellm.entrypoints.openai.tool_parsers import get_tool_parser
from pagellm.entrypoints.openai.tool_parsers.detect import parser_for_template
from pagellm.model.default_model import CHAT_TEMPLATE

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                    "zip": {"type": "string"}},
                   "required": ["city"]}}}


@pytest.mark.parametrize(("template", "parser"), [
    (None, "generic"),
    (CHAT_TEMPLATE, "generic"),  # the embedded default renders no tools
    ("{% if tools %}{{ tools | tojson }}<tool_call>{% endif %}", "hermes"),
    ("{% for tool in tools %}<function=x><parameter=y>{% endfor %}<tool_call>", "qwen3_coder"),
    ("{% if tools %}[AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]", "mistral"),
    ("{% if tools %}[func_name1(params_name1=params_value1)]{% endif %}", "pythonic"),
    ("{% if tools %}<|python_tag|>{% endif %}", "llama3_json"),
    ("{% if tools %}{{ tools }} in some format of its own{% endif %}", "generic"),
])
def test_the_template_names_its_format(template, parser):
    assert parser_for_template(template) == parser


def test_qwen3_coder_values_take_the_schemas_types():
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n<parameter=days>\n3\n"
            "</parameter>\n<parameter=zip>\n01234\n</parameter>\n<parameter=extra>\n[1, 2]\n</parameter>\n"
            "</function>\n</tool_call>")
    (call,) = get_tool_parser("qwen3_coder", [WEATHER]).parse(text, final=True).calls
    # A string stays a string even where it looks like a number; what the schema lacks is read as JSON.
    assert json.loads(call.arguments) == {"city": "42", "days": 3, "zip": "01234", "extra": [1, 2]}


def test_pythonic_calls_between_llama4_tags_and_text_that_only_looks_like_a_list():
    parser = get_tool_parser("pythonic")
    (call,) = parser.parse('<|python_start|>[get_weather(city="Paris", days=2)]<|python_end|>', final=True).calls
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris", "days": 2})
    assert parser.parse("[1, 2, 3] are numbers", final=True).content == "[1, 2, 3] are numbers"
    assert parser.parse("[get_weather(", final=False).content == ""  # held back while it may be a call


def test_the_generic_history_writes_calls_and_results_as_text():
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
        {"role": "tool", "tool_call_id": "a", "content": "sunny"},
        {"role": "tool", "tool_call_id": "b", "content": "rain"},
    ]
    system, user, assistant, results = generic_tools.conversation(history, [WEATHER])
    assert system["role"] == "system" and system["content"].startswith("Be brief.\n\n")
    assert '"name": "get_weather"' in system["content"] and "<tool_call>" in system["content"]
    assert user == history[1]
    assert assistant == {"role": "assistant", "content":
                         '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
                         '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'}
    assert results == {"role": "user",
                       "content": "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response>"}
    # Without a system message, one is added; the caller's list is left as it was.
    first, *_ = generic_tools.conversation(history[1:2], [WEATHER])
    assert first["role"] == "system" and history[0]["content"] == "Be brief."


def test_the_generic_grammar_allows_text_or_calls_of_the_given_tools():
    from llguidance import LLMatcher

    one = generic_tools.constraint([WEATHER], parallel=False).grammar
    assert one is not None and "call (" not in one and '"enum": ["get_weather"]' in one
    many = generic_tools.constraint([WEATHER], parallel=True).grammar
    assert many is not None and "call (/\\s*/ call)*" in many
    for grammar in (one, many):
        assert LLMatcher.validate_grammar(LLMatcher.grammar_from_lark(grammar)) == ""
