"""The Responses API (``/v1/responses``) on the real server, driven with the official `openai` client."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from pydantic import BaseModel

from tests.entrypoints.openai.server_utils import RemoteServer

API_KEY = "test-key-123"
MODEL = "tiny"
STORE_SIZE = 4
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False}, "strict": True}
ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
                 "required": ["answer"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(llama_path):
    # No tool flags: tool_choice "auto" reads the format the template speaks (none here: the generic one).
    srv = RemoteServer(llama_path, ["--served-model-name", MODEL, "--max-model-len", "1024", "--num-kv-blocks", "256",
                                    "--responses-store-max-responses", str(STORE_SIZE)], api_key=API_KEY)
    yield srv
    assert srv.stop() == 0


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def prompt_tokens(server: RemoteServer, messages: list[dict]) -> int:
    r = httpx.post(server.url + "/tokenize", json={"model": MODEL, "messages": messages}, headers=server.headers)
    return r.json()["count"]


def test_a_string_input_answers_as_chat_does(server, client):
    r = client.responses.create(model=MODEL, input="Hello there", instructions="Be brief.", max_output_tokens=5,
                                temperature=0)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    (item,) = r.output
    assert item.type == "message" and item.id.startswith("msg_") and item.role == "assistant"
    assert item.content[0].type == "output_text" and r.output_text == item.content[0].text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0)
    assert r.output_text == chat.choices[0].message.content  # the same prompt, on the same path
    assert r.usage.input_tokens == chat.usage.prompt_tokens == prompt_tokens(server, messages)
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    if chat.choices[0].finish_reason == "length":
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        assert item.status == "incomplete"
    else:
        assert r.status == "completed" and r.incomplete_details is None
    assert r.instructions == "Be brief." and r.max_output_tokens == 5 and r.temperature == 0


def test_a_stream_sends_the_typed_events_in_order(client):
    events = list(client.responses.create(model=MODEL, input=[{"role": "user", "content": "Hi"}],
                                          max_output_tokens=6, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]  # 6 tokens of a random model: cut by max_output_tokens
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert deltas and "".join(deltas) == events[-4].text
    final = events[-1].response
    assert final.id == events[0].response.id and final.output_text == events[-4].text
    assert final.incomplete_details.reason == "max_output_tokens" and final.usage.output_tokens == 6
    assert final.output[0].id == events[2].item.id
    stored = client.responses.retrieve(final.id)  # a streamed response is stored too, once it ends
    assert stored.status == "incomplete" and stored.output_text == final.output_text


def test_logprobs_when_include_asks_for_them(client):
    asked = {"include": ["message.output_text.logprobs"], "top_logprobs": 2}
    r = client.responses.create(model=MODEL, input="Hi", max_output_tokens=3, temperature=0, **asked)
    logprobs = r.output[0].content[0].logprobs
    assert len(logprobs) == r.usage.output_tokens == 3
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in logprobs)
    assert "".join(lp.token for lp in logprobs) == r.output_text
    events = list(client.responses.create(model=MODEL, input="Hi", max_output_tokens=3, temperature=0, stream=True,
                                          **asked))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [lp.token for lp in streamed] == [lp.token for lp in logprobs]
    assert not client.responses.create(model=MODEL, input="Hi", max_output_tokens=3).output[0].content[0].logprobs


def aborted(server: RemoteServer) -> float:
    return server.metric("pagellm_request_success_total", 'finished_reason="abort"')


def test_a_client_that_goes_away_has_its_request_aborted(server):
    before = aborted(server)
    body = {"model": MODEL, "input": "Tell a long story", "max_output_tokens": 900, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.Client(timeout=30) as http, http.stream("POST", server.url + "/v1/responses", json=body,
                                                       headers=server.headers) as r:
        lines = r.iter_lines()
        assert any("response.output_text.delta" in next(lines) for _ in range(20))
    deadline = time.time() + 10
    while aborted(server) < before + 1 and time.time() < deadline:
        time.sleep(0.1)
    assert aborted(server) == before + 1
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/responses", json={**body, "stream": False}, headers=server.headers, timeout=0.8)
    deadline = time.time() + 10
    while aborted(server) < before + 2 and time.time() < deadline:
        time.sleep(0.1)
    assert aborted(server) == before + 2


class Answer(BaseModel):
    answer: str


def test_text_format_json_schema_produces_valid_json(client):
    r = client.responses.create(model=MODEL, input="Is the sky blue?", temperature=0, max_output_tokens=40,
                                text={"format": {"type": "json_schema", "name": "answer", "schema": ANSWER_SCHEMA,
                                                 "strict": True}})
    assert r.status == "completed"
    assert json.loads(r.output_text)["answer"] in ("yes", "no")
    with client.responses.stream(model=MODEL, input="Is grass green?", temperature=0, max_output_tokens=40,
                                 text_format=Answer) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[-1] == "response.completed"
    assert isinstance(final.output_parsed, Answer)
    json_object = client.responses.create(model=MODEL, input="JSON please", max_output_tokens=40, temperature=0,
                                          text={"format": {"type": "json_object"}})
    if json_object.status == "completed":
        assert isinstance(json.loads(json_object.output_text), dict)


def test_a_function_tool_round_trip(server, client):
    user = {"role": "user", "content": "What is the weather in Paris?"}
    r = client.responses.create(model=MODEL, input=[user], tools=[WEATHER], tool_choice="required", temperature=0)
    (call,) = r.output
    assert call.type == "function_call" and call.id.startswith("fc_") and call.call_id.startswith("call_")
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str)
    assert r.status == "completed" and r.tools[0].name == "get_weather"
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}
    reasoning = {"type": "reasoning", "id": "rs_1", "summary": []}  # a reasoning model's: left out of the prompt
    follow = client.responses.create(model=MODEL, input=[user, reasoning, *[o.model_dump() for o in r.output], result],
                                     tools=[WEATHER], tool_choice="none", max_output_tokens=4, temperature=0)
    assert follow.output[0].type == "message"
    history = [user, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "name": call.name, "content": "sunny, 21 C"}]
    assert follow.usage.input_tokens == prompt_tokens(server, history)
    # The same through previous_response_id: only the tool's output is new.
    chained = client.responses.create(model=MODEL, previous_response_id=r.id, input=[result], tools=[WEATHER],
                                      tool_choice="none", max_output_tokens=4, temperature=0)
    assert chained.usage.input_tokens == follow.usage.input_tokens and chained.output_text == follow.output_text


def test_a_streamed_function_call(client):
    events = list(client.responses.create(model=MODEL, input="Weather in Oslo?", tools=[WEATHER], temperature=0,
                                          tool_choice={"type": "function", "name": "get_weather"}, stream=True))
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    added = next(e for e in events if e.type == "response.output_item.added").item
    assert added.type == "function_call" and added.name == "get_weather" and added.call_id.startswith("call_")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == done.arguments
    assert isinstance(json.loads(done.arguments)["city"], str)
    assert events[-1].response.output[0].arguments == done.arguments
    with client.responses.stream(model=MODEL, input="Weather in Oslo?", tools=[WEATHER], temperature=0,
                                 tool_choice={"type": "function", "name": "get_weather"}) as stream:
        final = stream.get_final_response()  # the client's own accumulation of the events
    (call,) = final.output
    assert call.type == "function_call" and call.arguments == done.arguments and call.call_id.startswith("call_")


def test_auto_tool_choice_answers_as_chat_does_plain_and_streamed(client):
    """Whatever the model chooses under "auto" (text, or a call in the generic format), the response
    carries what chat's answer to the same request does."""
    question = "What is the weather in Paris?"
    chat_tool = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                          tools=[chat_tool], max_tokens=40, temperature=0).choices[0].message
    expected = [("function_call", c.function.name, c.function.arguments) for c in chat.tool_calls or []]
    if chat.content or not expected:
        expected.insert(0, ("message", chat.content or "", None))

    def seen(output) -> list[tuple]:
        return [(o.type, o.content[0].text, None) if o.type == "message" else (o.type, o.name, o.arguments)
                for o in output]

    r = client.responses.create(model=MODEL, input=question, tools=[WEATHER], max_output_tokens=40, temperature=0)
    assert r.tool_choice == "auto" and seen(r.output) == expected
    events = list(client.responses.create(model=MODEL, input=question, tools=[WEATHER], max_output_tokens=40,
                                          temperature=0, stream=True))
    assert seen(events[-1].response.output) == expected
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert seen(done) == expected


def test_previous_response_id_continues_the_conversation(server, client):
    first = client.responses.create(model=MODEL, input="My name is Ann.", instructions="Be kind.",
                                    max_output_tokens=3, temperature=0)
    second = client.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=3, temperature=0)
    assert second.previous_response_id == first.id
    # The first turn and its answer, without its instructions (the API does not carry them over).
    history = [{"role": "user", "content": "My name is Ann."}, {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "What is my name?"}]
    assert second.usage.input_tokens == prompt_tokens(server, history)
    items = client.responses.input_items.list(second.id)
    assert [i.content[0].text for i in items.data] == ["What is my name?"]


def test_retrieve_delete_and_a_store_that_forgets(client):
    r = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, metadata={"k": "v"})
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.metadata == {"k": "v"}
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError, match="was deleted"):
        client.responses.retrieve(r.id)
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError, match="no response with id"):
        client.responses.retrieve(unstored.id)
    ids = [client.responses.create(model=MODEL, input="Hi", max_output_tokens=1).id for _ in range(STORE_SIZE + 1)]
    with pytest.raises(openai.NotFoundError, match="evicted") as e:
        client.responses.retrieve(ids[0])
    assert "--responses-store-max-responses" in str(e.value)
    with pytest.raises(openai.BadRequestError, match="evicted") as e:
        client.responses.create(model=MODEL, input="Hi", previous_response_id=ids[0])
    assert e.value.body["param"] == "previous_response_id"
    assert client.responses.retrieve(ids[-1]).id == ids[-1]


@pytest.mark.parametrize(("extra", "param", "words"), [
    ({"background": True}, "background", "background responses are not supported"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type", "runs function tools"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type", "item_reference"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0",
     "input_image"),
    ({"max_output_tokens": 0}, "max_output_tokens", ">= 1"),
    ({"input": ["Hi"]}, "input.0", "must be an object"),
    ({"text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "nope"}}}}, "text.format", ""),
    ({"tool_choice": {"type": "function", "name": "missing"}, "tools": [WEATHER]}, "tool_choice", "missing"),
])
def test_what_is_refused_says_why(server, extra, param, words):
    body = {"model": MODEL, "input": "Hi", **extra}
    r = httpx.post(server.url + "/v1/responses", json=body, headers=server.headers)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_unknown_fields_are_ignored_and_background_false_accepted(server):
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 1, "background": False, "some_new_field": 1,
            "store": False, "include": ["reasoning.encrypted_content"], "reasoning": {"effort": None}}
    r = httpx.post(server.url + "/v1/responses", json=body, headers=server.headers)
    assert r.status_code == 200, r.text
    assert r.json()["store"] is False
    assert "some_new_field" in server.log()


def test_openapi_declares_the_responses_routes(server):
    doc = httpx.get(server.url + "/openapi.json", headers=server.headers).json()
    body = doc["paths"]["/v1/responses"]["post"]["requestBody"]
    assert body["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ResponsesRequest"}
    assert "input" in doc["components"]["schemas"]["ResponsesRequest"]["properties"]
    assert set(doc["paths"]["/v1/responses/{response_id}"]) == {"get", "delete"}
    ids = [op["operationId"] for item in doc["paths"].values() for op in item.values()]
    assert len(ids) == len(set(ids))
