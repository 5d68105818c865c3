"""Anthropic's Messages API over plain HTTP (httpx) against the real server on a tiny random model:
the answer's shape, the event sequence of a stream, tools, count_tokens, x-api-key and Anthropic's
error shape. (tests/peers/test_anthropic.py runs the `anthropic` SDK itself.)"""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import pytest

from tests.entrypoints.openai.server_utils import RemoteServer

API_KEY = "messages-key"
MODEL = "tiny"
HEADERS = {"x-api-key": API_KEY, "anthropic-version": "2023-06-01"}
USER = [{"role": "user", "content": "The capital of France is"}]
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                                             "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                            "required": ["city", "days"]}}


@pytest.fixture(scope="module")
def server(llama_path):
    srv = RemoteServer(llama_path, ["--served-model-name", MODEL, "--max-model-len", "1024", "--num-kv-blocks", "256",
                                    "--enable-auto-tool-choice", "--tool-call-parser", "hermes"], api_key=API_KEY)
    yield srv
    assert srv.stop() == 0


def post(server: RemoteServer, body: dict[str, Any], path: str = "/v1/messages",
         headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=HEADERS if headers is None else headers, timeout=60)


def events(server: RemoteServer, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The stream's (event name, data) pairs; each event's name is its data's type."""
    out = []
    with httpx.stream("POST", server.url + "/v1/messages", json={**body, "stream": True}, headers=HEADERS,
                      timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for block in r.read().decode().split("\n\n"):
            if not block.strip():
                continue
            name, data = block.split("\n")
            assert name.startswith("event: ") and data.startswith("data: ")
            payload = json.loads(data[6:])
            assert payload["type"] == name[7:]
            out.append((name[7:], payload))
    return out


def test_a_message_answers_as_the_chat_route_does(server):
    body = {"model": MODEL, "max_tokens": 12, "temperature": 0, "system": "Answer in one word.", "messages": USER}
    r = post(server, body)
    assert r.status_code == 200, r.text
    m = r.json()
    assert m["type"] == "message" and m["role"] == "assistant" and m["model"] == MODEL and m["id"].startswith("msg_")
    assert [b["type"] for b in m["content"]] == ["text"]
    assert m["stop_reason"] in ("end_turn", "max_tokens") and m["stop_sequence"] is None
    chat = httpx.post(server.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"}, json={
        "model": MODEL, "max_tokens": 12, "temperature": 0,
        "messages": [{"role": "system", "content": "Answer in one word."}, *USER]}).json()
    assert m["content"][0]["text"] == chat["choices"][0]["message"]["content"]
    assert m["usage"] == {"input_tokens": chat["usage"]["prompt_tokens"],
                          "output_tokens": chat["usage"]["completion_tokens"]}
    counted = post(server, {"model": MODEL, "system": [{"type": "text", "text": "Answer in one word."}],
                            "messages": USER}, "/v1/messages/count_tokens")
    assert counted.json() == {"input_tokens": m["usage"]["input_tokens"]}


def test_a_stream_sends_anthropics_event_sequence(server):
    body = {"model": MODEL, "max_tokens": 10, "temperature": 0, "messages": USER}
    whole = post(server, body).json()
    seq = events(server, body)
    names = [name for name, _ in seq]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert names[1] == "content_block_start" and names[-3] == "content_block_stop"
    assert set(names[2:-3]) <= {"content_block_delta"}
    start = seq[0][1]["message"]
    assert start["content"] == [] and start["usage"]["input_tokens"] == whole["usage"]["input_tokens"]
    text = "".join(d["delta"]["text"] for n, d in seq if n == "content_block_delta")
    assert text == whole["content"][0]["text"]
    delta = seq[-2][1]
    assert delta["delta"]["stop_reason"] == whole["stop_reason"]
    assert delta["usage"]["output_tokens"] == whole["usage"]["output_tokens"]


def test_stop_sequences_end_the_answer_and_say_which(server):
    body = {"model": MODEL, "max_tokens": 16, "temperature": 0, "messages": USER}
    text = post(server, body).json()["content"][0]["text"]
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip(), text
    m = post(server, {**body, "stop_sequences": [stop]}).json()
    assert m["stop_reason"] == "stop_sequence" and m["stop_sequence"] == stop
    assert m["content"][0]["text"] == text[:text.index(stop)]


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_a_forced_tool_call_is_a_tool_use_block(server, choice):
    body = {"model": MODEL, "max_tokens": 60, "temperature": 0, "messages": USER, "tools": [WEATHER],
            "tool_choice": choice}
    m = post(server, body).json()
    assert m["stop_reason"] == "tool_use", m
    (call,) = [b for b in m["content"] if b["type"] == "tool_use"]
    assert call["name"] == "get_weather" and call["id"].startswith("toolu_")
    jsonschema.validate(call["input"], WEATHER["input_schema"])
    seq = events(server, body)
    starts = [d["content_block"] for n, d in seq if n == "content_block_start"]
    assert starts[-1]["type"] == "tool_use" and starts[-1]["name"] == "get_weather" and starts[-1]["input"] == {}
    partial = "".join(d["delta"]["partial_json"] for n, d in seq
                      if n == "content_block_delta" and d["delta"]["type"] == "input_json_delta")
    assert json.loads(partial) == call["input"]
    assert seq[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_a_tool_result_continues_the_conversation(server):
    history = [*USER, {"role": "assistant", "content": [
        {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris", "days": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": "Sunny"}]},
                                     {"type": "text", "text": "And so?"}]}]
    body = {"model": MODEL, "max_tokens": 5, "messages": history, "tools": [WEATHER], "tool_choice": {"type": "none"}}
    r = post(server, body)
    assert r.status_code == 200 and r.json()["content"][0]["type"] == "text", r.text
    counted = post(server, {k: body[k] for k in ("model", "messages")}, "/v1/messages/count_tokens").json()
    assert counted["input_tokens"] == r.json()["usage"]["input_tokens"]


def test_output_config_format_constrains_the_answer_and_other_fields_pass(server):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    body = {"model": MODEL, "max_tokens": 30, "messages": USER, "output_config": {"format": {
        "type": "json_schema", "schema": schema}, "effort": "low"}, "metadata": {"user_id": "u1"},
        "cache_control": {"type": "ephemeral"}, "service_tier": "auto", "speed": "standard"}
    r = post(server, body)
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["content"][0]["text"]), schema)


ERRORS = [
    # (body changes, status, error type, words of the message)
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, 400, "invalid_request_error", "thinking"),
    ({"model": "claude-nothing"}, 404, "not_found_error", "claude-nothing"),
    ({"max_tokens": None}, 400, "invalid_request_error", "max_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400, "invalid_request_error",
     "'image'"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "invalid_request_error",
     "web_search_20250305"),
    ({"max_tokens": 5000}, 400, "invalid_request_error", "max_tokens"),
    ({"output_config": {"format": {"type": "regex"}}}, 400, "invalid_request_error", "output_config.format"),
]


@pytest.mark.parametrize(("change", "status", "kind", "words"), ERRORS)
def test_errors_take_anthropics_shape(server, change, status, kind, words):
    body = {"model": MODEL, "max_tokens": 5, "messages": USER, **change}
    r = post(server, {k: v for k, v in body.items() if v is not None})
    assert r.status_code == status, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == kind and words in err["error"]["message"], err


def test_unknown_fields_are_ignored_as_on_every_route(server):
    # As vLLM: dropped with a warning naming them (--strict-requests makes them a 400).
    r = post(server, {"model": MODEL, "max_tokens": 2, "messages": USER, "unknown_field": 1})
    assert r.status_code == 200 and r.json()["type"] == "message", r.text


def test_a_body_over_the_limit_is_anthropics_413(server):
    r = post(server, {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "x" * (2 << 20)}]})
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large", r.text


def test_the_key_comes_as_x_api_key_or_bearer(server):
    body = {"model": MODEL, "max_tokens": 2, "messages": USER}
    assert post(server, body, headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
    for headers in ({}, {"x-api-key": "wrong"}):
        r = post(server, body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", r.text
        assert r.json()["type"] == "error"
    # The OpenAI routes take x-api-key too, and keep their own error shape.
    r = httpx.get(server.url + "/v1/models", headers={"x-api-key": API_KEY})
    assert r.status_code == 200
    assert "error" in httpx.get(server.url + "/v1/models", headers={"x-api-key": "wrong"}).json()
