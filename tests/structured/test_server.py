"""Structured outputs and tool calls through the real server and the official `openai` client, on a
random-weight model: every answer must validate, whatever the weights."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pytest

from tests.entrypoints.openai.server_utils import RemoteServer
from tests.structured.schemas import CHOICES, REGEXES, SCHEMAS

API_KEY = "so-key"
MODEL = "tiny"
USER = [{"role": "user", "content": "Answer please."}]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                                    "unit": {"enum": ["c", "f"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "unit"]}}}
LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "Find a record.",
    "parameters": {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[a-f0-9]{4}$"}},
                   "required": ["id"]}}}
TOOLS = [WEATHER, LOOKUP]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def server(llama_path):
    srv = RemoteServer(llama_path, ["--served-model-name", MODEL, "--max-model-len", "1024", "--num-kv-blocks", "512",
                                    "--enable-auto-tool-choice", "--tool-call-parser", "hermes"], api_key=API_KEY)
    yield srv
    assert srv.stop() == 0


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture
def aclient(server):
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def test_json_schema_response_format_validates_for_every_schema(aclient):
    async def ask(i: int, name: str) -> tuple[str, str, str | None]:
        r = await aclient.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=300, temperature=1.0, seed=i,
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": SCHEMAS[name],
                                                                    "strict": True}})
        return name, r.choices[0].message.content or "", r.choices[0].finish_reason

    async def all_of_them() -> list[tuple[str, str, str | None]]:
        return await asyncio.gather(*(ask(i, n) for i, n in enumerate(SCHEMAS)))

    results = asyncio.run(all_of_them())
    for name, text, finish in results:
        assert finish == "stop", (name, text)
        jsonschema.validate(json.loads(text), SCHEMAS[name])
    assert len(results) == 20


def test_json_object_and_completions_structured_outputs(client):
    r = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=400, temperature=0.7, seed=3,
                                       response_format={"type": "json_object"})
    text = r.choices[0].message.content or ""
    assert r.choices[0].finish_reason == "stop", text  # the document wraps up before max_tokens
    assert isinstance(json.loads(text), dict)
    for i, regex in enumerate(REGEXES):
        c = client.completions.create(model=MODEL, prompt="Say:", max_tokens=40, seed=i, temperature=1.0,
                                      extra_body={"structured_outputs": {"regex": regex}})
        assert re.fullmatch(regex, c.choices[0].text), (regex, c.choices[0].text)
    for choice in CHOICES:
        c = client.completions.create(model=MODEL, prompt="Pick:", max_tokens=10, n=3, seed=1, temperature=1.0,
                                      extra_body={"structured_outputs": {"choice": choice}})
        assert all(ch.text in choice for ch in c.choices)
    c = client.completions.create(model=MODEL, prompt="JSON:", max_tokens=200, temperature=0,
                                  extra_body={"guided_json": SCHEMAS["nested"]})
    jsonschema.validate(json.loads(c.choices[0].text), SCHEMAS["nested"])
    r = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=20, temperature=0,
                                       extra_body={"structured_outputs": {"grammar": 'root ::= "A" | "B"'}})
    assert r.choices[0].message.content in ("A", "B")


def test_streamed_json_adds_up_to_the_same_answer(client):
    kwargs = dict(model=MODEL, messages=USER, max_tokens=300, temperature=1.0, seed=11,
                  response_format={"type": "json_schema", "json_schema": {"name": "p",
                                                                          "schema": SCHEMAS["array of objects"]}})
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs)
             if c.choices]
    assert "".join(parts) == whole
    jsonschema.validate(json.loads(whole or ""), SCHEMAS["array of objects"])


@pytest.mark.parametrize("body, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "strnig"}}}}}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type must be"),
    ({"response_format": {"type": "json_schema"}}, "needs a 'json_schema' object"),
    ({"structured_outputs": {"regex": "(a"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one of"),
    ({"structured_outputs": {"jsn": {}}}, "unknown field(s) ['jsn']"),
    ({"structured_outputs": {"grammar": "start: ("}}, "grammar"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "one output constraint"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "constrains the output itself"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "nope"}}}}}], "tool_choice": "required"}, "tools"),
])
def test_invalid_constraints_are_400s_that_name_the_problem(server, client, body, message):
    r = httpx.post(server.url + "/v1/chat/completions", headers=server.headers, timeout=30,
                   json={"model": MODEL, "messages": USER, "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]
    # and the server goes on serving
    ok = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=3)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_tool_choice_required_returns_calls_that_validate(client):
    for seed in range(4):
        r = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required",
                                           max_tokens=300, temperature=1.0, seed=seed)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


# Two tools whose parameters, as pydantic writes them, define the same name differently.
MOVE = {"type": "function", "function": {"name": "move", "parameters": {
    "$defs": {"Loc": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}},
    "type": "object", "properties": {"to": {"$ref": "#/$defs/Loc"}}, "required": ["to"]}}}
PLOT = {"type": "function", "function": {"name": "plot", "parameters": {
    "$defs": {"Loc": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                                       "y": {"type": "integer", "minimum": 0, "maximum": 9}},
                      "required": ["x", "y"]}},
    "type": "object", "properties": {"at": {"$ref": "#/$defs/Loc"}, "path": {"type": "array", "maxItems": 3,
                                                                              "items": {"$ref": "#/$defs/Loc"}}},
    "required": ["at"]}}}
DEF_PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in (MOVE, PLOT)}


def test_tool_choice_required_with_local_defs_in_each_tool(client):
    names: set[str] = set()
    for seed in range(24):
        if names == {"move", "plot"}:
            break
        r = client.chat.completions.create(model=MODEL, messages=USER, tools=[MOVE, PLOT], tool_choice="required",
                                           max_tokens=300, temperature=1.0, seed=seed)
        assert r.choices[0].finish_reason == "tool_calls"
        for call in r.choices[0].message.tool_calls:
            names.add(call.function.name)
            jsonschema.validate(json.loads(call.function.arguments), DEF_PARAMS[call.function.name])
    assert names == {"move", "plot"}  # each tool's own "Loc" held for its calls


def test_named_tool_and_parallel_tool_calls_false(client):
    r = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, max_tokens=200, temperature=1.0,
                                       tool_choice={"type": "function", "function": {"name": "lookup"}})
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "lookup"
    jsonschema.validate(json.loads(call.function.arguments), PARAMS["lookup"])
    for seed in range(3):
        r = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=200, temperature=1.0, seed=seed)
        assert len(r.choices[0].message.tool_calls) == 1


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_tool_calls_reassemble_to_the_non_streamed_ones(client, tool_choice):
    kwargs = dict(model=MODEL, messages=USER, tools=TOOLS, tool_choice=tool_choice, max_tokens=300,
                  temperature=1.0, seed=5)
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        for tc in delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id:
                entry["id"] = tc.id
            if tc.function and tc.function.name:
                entry["name"] = tc.function.name
            if tc.function and tc.function.arguments:
                entry["arguments"] += tc.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    assert finish == whole.finish_reason == "tool_calls"
    expected = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert [(calls[k]["name"], calls[k]["arguments"]) for k in sorted(calls)] == expected
    assert all(calls[k]["id"] for k in calls)


def test_history_with_tool_calls_and_tool_messages(client):
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"},
    ]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")  # auto: the model answered in text
    assert r.choices[0].message.tool_calls is None
    r = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="required",
                                       max_tokens=300, temperature=1.0, seed=2)
    assert r.choices[0].message.tool_calls


def test_openai_parse_helpers(client):
    from typing import Literal

    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: Literal["Paris", "Rome"]
        rank: int = Field(ge=1, le=9)

    r = client.chat.completions.parse(model=MODEL, messages=USER, response_format=City, max_tokens=100,
                                      temperature=1.0, seed=1)
    assert isinstance(r.choices[0].message.parsed, City)
    tool = openai.pydantic_function_tool(City)
    r = client.chat.completions.parse(model=MODEL, messages=USER, tools=[tool], tool_choice="required",
                                      max_tokens=100, temperature=1.0, seed=1)
    (call,) = r.choices[0].message.tool_calls[:1]
    assert isinstance(call.function.parsed_arguments, City)
