"""The `anthropic` SDK on the embedded SmolLM2-135M-Instruct (served with no tool flags): an answer, a
stream, a forced tool call whose input validates, and `tool_choice` auto."""

from __future__ import annotations

import jsonschema
import pytest

from tests.entrypoints.openai.server_utils import SMOLLM2_NAME as MODEL
from tests.entrypoints.openai.server_utils import needs_smollm2, smollm2_tool_server

pytestmark = [pytest.mark.peers, needs_smollm2]
server = pytest.fixture(scope="module")(smollm2_tool_server)

GREEDY = {"temperature": 0}  # this SDK's create() takes no temperature: an extra field
FLIGHTS = {"name": "search_flights", "description": "Search flights between two cities on a date.",
           "input_schema": {"type": "object", "properties": {
               "origin": {"type": "string"}, "destination": {"type": "string"},
               "date": {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"}},
               "required": ["origin", "destination", "date"]}}
ASK = [{"role": "user", "content": "Find me a flight from Paris to Rome on 2025-03-14."}]


@pytest.fixture
def client(server):
    import anthropic

    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)


def test_an_answer_and_its_stream(client):
    ask = dict(model=MODEL, max_tokens=24, system="You are a helpful assistant.", extra_body=GREEDY,
               messages=[{"role": "user", "content": "What is the capital of France?"}])
    m = client.messages.create(**ask)
    assert "Paris" in m.content[0].text
    with client.messages.stream(**ask) as stream:
        assert "".join(stream.text_stream) == m.content[0].text


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "search_flights"}])
def test_a_forced_call_validates(client, choice):
    m = client.messages.create(model=MODEL, max_tokens=120, messages=ASK, tools=[FLIGHTS], tool_choice=choice,
                               extra_body=GREEDY)
    assert m.stop_reason == "tool_use"
    (call,) = [b for b in m.content if b.type == "tool_use"]
    assert call.name == "search_flights"
    jsonschema.validate(call.input, FLIGHTS["input_schema"])


def test_auto_answers_with_text_or_a_call(client):
    m = client.messages.create(model=MODEL, max_tokens=120, messages=ASK, tools=[FLIGHTS], extra_body=GREEDY)
    kinds = {b.type for b in m.content}
    assert kinds <= {"text", "tool_use"} and m.stop_reason in ("end_turn", "tool_use", "max_tokens")
    for call in (b for b in m.content if b.type == "tool_use"):
        assert call.name == "search_flights" and isinstance(call.input, dict)
