"""``tool_choice: "auto"`` on a server started with no tool flags, through the `openai` SDK: the tiny
model's chat template renders no tools, so the generic format describes them in the system prompt and
its grammar holds the answer to text or calls of the given tools."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from tests.entrypoints.openai.server_utils import RemoteServer

MODEL = "tiny"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(llama_path):
    srv = RemoteServer(llama_path, ["--served-model-name", MODEL, "--max-model-len", "1024", "--num-kv-blocks", "256"])
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none")


@pytest.fixture(scope="module")
def call_bias(llama_path):
    """A logit bias that makes the tiny model start with ``<``: the grammar then allows only a call (one:
    the bias would otherwise start call after call)."""
    (first, *_) = AutoTokenizer.from_pretrained(str(llama_path)).encode("<tool_call>", add_special_tokens=False)
    return {"logit_bias": {str(first): 100}, "parallel_tool_calls": False}


def test_the_tools_reach_the_prompt_and_a_text_answer_never_starts_a_call(client):
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, temperature=0)
    for seed in range(3):
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=40,
                                           temperature=1.0, seed=seed)
        # The tool's description went into the system prompt (the template renders no tools).
        assert r.usage.prompt_tokens > plain.usage.prompt_tokens + 20
        message = r.choices[0].message
        if message.tool_calls:  # whichever the model picked, it is well formed
            assert r.choices[0].finish_reason in ("tool_calls", "length")
        else:
            assert not (message.content or "").startswith("<")


def test_a_call_is_a_call_of_the_given_tool_with_valid_arguments(client, call_bias):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=120, temperature=0,
                                       extra_body=call_bias)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    # Streamed, the deltas add up to the same call.
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=120,
                                            temperature=0, extra_body=call_bias, stream=True)
    names, args, reasons = [], "", []
    for chunk in stream:
        for d in chunk.choices[0].delta.tool_calls or []:
            names += [d.function.name] if d.function.name else []
            args += d.function.arguments or ""
        reasons += [chunk.choices[0].finish_reason] if chunk.choices[0].finish_reason else []
    assert names == ["get_weather"] and args == call.function.arguments and reasons == ["tool_calls"]


def test_a_replayed_call_and_its_result_are_rendered_and_answered(client, call_bias):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=120, temperature=0,
                                       extra_body=call_bias)
    message = r.choices[0].message
    history = [*ASK, message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "21 degrees and sunny"}]
    after = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], max_tokens=8,
                                           temperature=0)
    assert after.usage.prompt_tokens > r.usage.prompt_tokens  # the call and its result are in the prompt
    assert after.choices[0].finish_reason in ("stop", "length", "tool_calls")
