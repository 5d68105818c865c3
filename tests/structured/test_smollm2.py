"""Structured outputs and tool calls on the embedded SmolLM2-135M-Instruct through the real server and
the `openai` client: schemas as applications write them, every answer parsed and validated."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest

from tests.entrypoints.openai.server_utils import SMOLLM2_NAME as MODEL
from tests.entrypoints.openai.server_utils import needs_smollm2, smollm2_tool_server
from tests.structured.schemas import EVERYDAY_SCHEMAS

pytestmark = needs_smollm2
server = pytest.fixture(scope="module")(smollm2_tool_server)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


@pytest.mark.slow
def test_every_everyday_schema_validates_greedy(server):
    # Greedy decoding is where a small model loops (a digit, an array item, a phrase): the documents
    # must still end, parse and validate.
    aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)

    async def ask(name: str) -> tuple[str, str, str | None]:
        schema, request = EVERYDAY_SCHEMAS[name]
        r = await aclient.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": request}], max_tokens=128, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": name.replace(" ", "_"), "schema": schema,
                                                                    "strict": True}})
        return name, r.choices[0].message.content or "", r.choices[0].finish_reason

    async def all_of_them() -> list[tuple[str, str, str | None]]:
        return await asyncio.gather(*(ask(n) for n in EVERYDAY_SCHEMAS))

    results = asyncio.run(all_of_them())
    assert len(results) == 20
    for name, text, finish in results:
        assert finish == "stop", (name, text)
        jsonschema.validate(json.loads(text), EVERYDAY_SCHEMAS[name][0])
    by_name = dict((n, t) for n, t, _ in results)
    assert json.loads(by_name["city"])["city"] == "Paris"  # a real model: content, not noise


@pytest.mark.slow
def test_regex_and_choice(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Give a US phone number."}],
                                       max_tokens=20, temperature=0,
                                       extra_body={"structured_outputs": {"regex": r"\(\d{3}\) \d{3}-\d{4}"}})
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", r.choices[0].message.content or "")
    r = client.chat.completions.create(model=MODEL, max_tokens=10, temperature=0,
                                       messages=[{"role": "user", "content": "Is 'I hate rain' positive or negative?"}],
                                       extra_body={"structured_outputs": {"choice": ["positive", "negative"]}})
    assert r.choices[0].message.content in ("positive", "negative")


@pytest.mark.slow
def test_required_tool_call_validates_and_streams_the_same(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                  tools=[WEATHER], tool_choice="required", max_tokens=100, temperature=0)
    r = client.chat.completions.create(**kwargs)
    assert r.choices[0].finish_reason == "tool_calls"
    calls = r.choices[0].message.tool_calls or []
    assert calls and all(c.function.name == "get_weather" for c in calls)
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), WEATHER["function"]["parameters"])
    args: dict[int, str] = {}
    names: dict[int, str] = {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            names[d.index] = names.get(d.index, "") + (d.function.name or "")
            args[d.index] = args.get(d.index, "") + (d.function.arguments or "")
    assert [names[i] for i in sorted(names)] == [c.function.name for c in calls]
    assert [json.loads(args[i]) for i in sorted(args)] == [json.loads(c.function.arguments) for c in calls]
