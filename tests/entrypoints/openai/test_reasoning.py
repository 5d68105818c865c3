"""``--reasoning-parser``: the thinking goes to ``reasoning_content`` (and ``reasoning``), streamed as
deltas of its own; ``include_reasoning: false`` drops it; a budget ends it; a constraint holds only the
answer. The tiny model's template opens the thinking in the prompt (as Qwen3's thinking models and
DeepSeek-R1's do), or closes it with ``enable_thinking: false``."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.entrypoints.openai.server_utils import RemoteServer

MODEL = "tiny"
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% if enable_thinking is defined and not enable_thinking %}"
            "<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}")
ASK = [{"role": "user", "content": "How much is 2 + 2?"}]
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
          "additionalProperties": False}
BUDGET = {"thinking_token_budget": 6}


@pytest.fixture(scope="module")
def server(llama_path):
    srv = RemoteServer(llama_path, ["--served-model-name", MODEL, "--max-model-len", "512", "--num-kv-blocks", "128",
                                    "--reasoning-parser", "qwen3", "--chat-template", TEMPLATE])
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none")


def test_the_budget_ends_the_thinking_and_the_schema_holds_the_answer(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=80, temperature=0, extra_body=BUDGET,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "a", "schema": SCHEMA}})
    message = r.choices[0].message
    thinking = message.model_extra["reasoning_content"]
    assert thinking and "</think>" not in thinking and message.model_extra["reasoning"] == thinking
    jsonschema.validate(json.loads(message.content), SCHEMA)
    assert r.choices[0].finish_reason == "stop"
    # Streamed: the thinking's deltas, then the answer's, adding up to the same message.
    stream = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=80, temperature=0, stream=True,
                                            extra_body=BUDGET, response_format={
                                                "type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}})
    kinds, streamed_thinking, streamed_content = [], "", ""
    for chunk in stream:
        delta = chunk.choices[0].delta
        if (delta.model_extra or {}).get("reasoning_content"):
            kinds.append("thinking")
            streamed_thinking += delta.model_extra["reasoning_content"]
        if delta.content:
            kinds.append("answer")
            streamed_content += delta.content
    assert (streamed_thinking, streamed_content) == (thinking, message.content)
    assert kinds == sorted(kinds, key=lambda k: k == "answer")  # never interleaved: thinking first


def test_include_reasoning_false_drops_the_thinking(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=30, temperature=0,
                                       extra_body={**BUDGET, "include_reasoning": False})
    message = r.choices[0].message
    assert message.model_extra["reasoning_content"] is None and "</think>" not in (message.content or "")


def test_a_template_that_closes_the_thinking_leaves_all_to_the_answer(client):
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, temperature=0, extra_body=off)
    message = r.choices[0].message
    assert message.model_extra["reasoning_content"] is None and message.content
    assert r.usage.completion_tokens == 8  # every generated token is the answer's


def test_a_budget_without_a_reasoning_parser_is_refused(llama_path):
    srv = RemoteServer(llama_path, ["--served-model-name", MODEL, "--max-model-len", "256", "--num-kv-blocks", "64"])
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none")
        with pytest.raises(openai.BadRequestError, match="--reasoning-parser"):
            c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, extra_body=BUDGET)
    finally:
        assert srv.stop() == 0


def test_anthropic_thinking_becomes_thinking_blocks(server, client):
    chat = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=20, temperature=0, extra_body=BUDGET)
    body = {"model": MODEL, "max_tokens": 20, "temperature": 0, "messages": ASK,
            "thinking": {"type": "enabled", "budget_tokens": BUDGET["thinking_token_budget"]}}
    m = httpx.post(server.url + "/v1/messages", json=body, timeout=60).json()
    assert [b["type"] for b in m["content"]] == ["thinking", "text"]
    assert m["content"][0]["thinking"] == chat.choices[0].message.model_extra["reasoning_content"]
    assert m["content"][1]["text"] == chat.choices[0].message.content
    # Streamed: a thinking block of thinking_delta events, then the text block.
    with httpx.stream("POST", server.url + "/v1/messages", json={**body, "stream": True}, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    thinking = "".join(e["delta"]["thinking"] for e in events
                       if e["type"] == "content_block_delta" and e["delta"]["type"] == "thinking_delta")
    assert starts == ["thinking", "text"] and thinking == m["content"][0]["thinking"]
    # Without `thinking`, the answer carries no thinking block (the model still thinks, within no budget).
    plain = httpx.post(server.url + "/v1/messages", json={**body, "thinking": None}, timeout=60).json()
    assert [b["type"] for b in plain["content"]] == ["text"]
