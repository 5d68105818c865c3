"""The `anthropic` SDK against the real server's Messages API: `messages.create`, `messages.stream`,
tools (a forced call and its result sent back), `count_tokens`, and its errors."""

from __future__ import annotations

import pytest

from tests.peers.conftest import API_KEY, MESSAGES, MODEL

pytestmark = pytest.mark.peers

SYSTEM = MESSAGES[0]["content"]
USER = MESSAGES[1:]
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                            "required": ["city"]}}


# This SDK's create() has no temperature (nor top_p, top_k): sent as extra fields, which the server reads.
GREEDY = {"temperature": 0}


@pytest.fixture
def client(server):
    import anthropic

    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0)


def test_create_answers_what_the_openai_client_gets(client, reference_chat):
    m = client.messages.create(model=MODEL, system=SYSTEM, messages=USER, max_tokens=8, extra_body=GREEDY)
    ref = reference_chat.choices[0]
    assert m.content[0].type == "text" and m.content[0].text == ref.message.content
    assert m.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[ref.finish_reason]
    assert m.usage.input_tokens == reference_chat.usage.prompt_tokens
    assert m.usage.output_tokens == reference_chat.usage.completion_tokens
    assert client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=USER).input_tokens == \
        reference_chat.usage.prompt_tokens


def test_stream_adds_up_to_the_same_message(client):
    whole = client.messages.create(model=MODEL, system=SYSTEM, messages=USER, max_tokens=8, extra_body=GREEDY)
    with client.messages.stream(model=MODEL, system=SYSTEM, messages=USER, max_tokens=8, extra_body=GREEDY) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) > 1 and "".join(pieces) == whole.content[0].text
    assert final.content[0].text == whole.content[0].text and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_a_forced_tool_call_and_its_result(client, choice):
    ask = dict(model=MODEL, messages=USER, max_tokens=120, extra_body=GREEDY, tools=[WEATHER], tool_choice=choice)
    m = client.messages.create(**ask)
    assert m.stop_reason == "tool_use"
    (call,) = [b for b in m.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.input["city"] in ("Paris", "Rome")
    with client.messages.stream(**ask) as stream:
        streamed = stream.get_final_message()
    (streamed_call,) = [b for b in streamed.content if b.type == "tool_use"]
    assert streamed_call.input == call.input and streamed.stop_reason == "tool_use"
    history = [*USER, {"role": "assistant", "content": m.content},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny"}]}]
    after = client.messages.create(model=MODEL, messages=history, max_tokens=4, tools=[WEATHER],
                                   tool_choice={"type": "none"})
    assert after.content[0].type == "text"


def test_output_config_format_gives_json_that_follows_the_schema(client):
    import json

    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "sunny": {"type": "boolean"}},
              "required": ["city", "sunny"]}
    m = client.messages.create(model=MODEL, messages=USER, max_tokens=40, extra_body=GREEDY,
                               output_config={"format": {"type": "json_schema", "schema": schema}})
    answer = json.loads(m.content[0].text)
    assert answer["city"] in ("Paris", "Rome") and isinstance(answer["sunny"], bool)


def test_errors_are_the_sdks_exceptions(client, server):
    import anthropic

    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, messages=USER, max_tokens=8,
                               thinking={"type": "enabled", "budget_tokens": 1024})
    assert e.value.body["error"]["type"] == "invalid_request_error" and "thinking" in e.value.message
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-not-here", messages=USER, max_tokens=8)
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, messages=USER, max_tokens=8)
