"""The real server on 127.0.0.1, driven with the official `openai` client (and raw HTTP for malformed input)."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import subprocess
import sys
import time

import httpx
import openai
import pytest

from pagellm.entrypoints.openai.chat_prompt import load_chat_template
from pagellm.entrypoints.openai.errors import APIError
from pagellm.entrypoints.openai.serving import ending_with_an_error_event, sse
from tests.entrypoints.openai.server_utils import RemoteServer

API_KEY = "test-key-123"
MODEL = "tiny"


@pytest.fixture(scope="module")
def server(llama_path):
    srv = RemoteServer(llama_path, [
        "--served-model-name", MODEL, "--max-model-len", "2048", "--num-kv-blocks", "512",
        "--max-request-body-size", "64KiB",
    ], api_key=API_KEY)
    yield srv
    assert srv.stop() == 0


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture
def aclient(server):
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def wait_idle(server: RemoteServer, timeout: float = 10) -> None:
    """Until /metrics shows no running or waiting request and the KV cache empty."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (server.metric("pagellm_num_requests_running") == 0
                and server.metric("pagellm_num_requests_waiting") == 0
                and server.metric("pagellm_kv_cache_usage_perc") == 0):
            return
        time.sleep(0.05)
    raise AssertionError("server did not go idle: " + httpx.get(server.url + "/metrics", headers=server.headers).text)


# ------------------------------------------------------------------- basics
def test_models_health_version(server, client):
    (model,) = client.models.list().data
    assert model.id == MODEL
    assert httpx.get(server.url + "/health").status_code == 200  # no key needed
    assert httpx.get(server.url + "/version", headers=server.headers).json()["version"]


def test_completion_n2_usage_and_seed(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, n=2,
                                  temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == 16 and r.usage.total_tokens == r.usage.prompt_tokens + 16
    assert all(c.finish_reason == "length" for c in r.choices)
    again = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, n=2,
                                      temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in r.choices]


def test_completion_batch_of_prompts_and_token_ids(client):
    tok_ids = client.post("/../tokenize", body={"prompt": "Hello"}, cast_to=object)["tokens"]
    r = client.completions.create(model=MODEL, prompt=["Hello", "Bye"], max_tokens=4, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert len(r.choices) == 2 and {c.index for c in r.choices} == {0, 1}
    by_ids = client.completions.create(model=MODEL, prompt=tok_ids, max_tokens=4, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == r.choices[0].text


def test_completion_logprobs_and_echo_with_prompt_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=5, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 5 and len(lp.token_logprobs) == 5 and all(x <= 0 for x in lp.token_logprobs)
    assert all(1 <= len(t) <= 3 for t in lp.top_logprobs)
    echo = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=0, echo=True, logprobs=1)
    c = echo.choices[0]
    assert c.text == "Hello world"
    n_prompt = echo.usage.prompt_tokens
    assert len(c.logprobs.tokens) == n_prompt and c.logprobs.token_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in c.logprobs.token_logprobs[1:])
    assert "".join(c.logprobs.tokens) == "Hello world" and echo.usage.completion_tokens == 0
    both = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=3, echo=True, logprobs=0,
                                     temperature=0, extra_body={"ignore_eos": True})
    assert both.choices[0].text.startswith("Hello world")
    assert len(both.choices[0].logprobs.tokens) == n_prompt + 3


def test_streamed_logprobs_equal_the_non_streamed_ones(client):
    kw = dict(model=MODEL, prompt="Hello world", max_tokens=6, temperature=0, logprobs=2, echo=True,
              extra_body={"ignore_eos": True})
    plain = client.completions.create(**kw).choices[0].logprobs
    tokens, lps, offsets = [], [], []
    for ch in client.completions.create(stream=True, **kw):
        if ch.choices and ch.choices[0].logprobs:
            tokens += ch.choices[0].logprobs.tokens
            lps += ch.choices[0].logprobs.token_logprobs
            offsets += ch.choices[0].logprobs.text_offset
    assert tokens == plain.tokens and offsets == plain.text_offset
    assert lps[0] is None and lps[1:] == pytest.approx(plain.token_logprobs[1:], abs=1e-5)


def test_stop_strings_streamed_and_not(client):
    base = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=30, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = base[10:13]
    cut = base[: base.index(stop)]
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=30, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=30, temperature=0,
                                            stop=[stop], stream=True, extra_body={"ignore_eos": True}))
    streamed = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert streamed == cut  # no part of the stop string ever leaked into the stream
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_stream_include_usage_and_n2_indices(client):
    chunks = list(client.completions.create(model=MODEL, prompt="Hi", max_tokens=5, n=2, stream=True, seed=1,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert all(ch.usage is None for ch in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert {ch.choices[0].index for ch in chunks[:-1]} == {0, 1}


def test_chat_basic_logprobs_and_stream(client):
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hello"}]}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=6, temperature=0,
                                       logprobs=True, top_logprobs=2, n=2, extra_body={"ignore_eos": True})
    assert len(r.choices) == 2 and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == r.choices[1].message.content  # greedy twins
    content = r.choices[0].logprobs.content
    assert len(content) == 6 and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content)
    stream = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == r.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 6 and chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens


def test_priority_and_extensions_are_accepted(client):
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, temperature=0.7,
                                  extra_body={"priority": -5, "top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1,
                                              "min_tokens": 4, "ignore_eos": False, "stop_token_ids": [3],
                                              "include_stop_str_in_output": False, "skip_special_tokens": True,
                                              "cache_salt": "tenant-a"},
                                  user="someone", presence_penalty=0.5, frequency_penalty=0.5,
                                  logit_bias={"5": 2.0})
    assert len(r.choices) == 1 and r.usage.completion_tokens == 4


def test_tokenize_detokenize(server):
    h = server.headers
    t = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world"}, headers=h).json()
    assert t["count"] == len(t["tokens"]) and t["max_model_len"] == 2048
    d = httpx.post(server.url + "/detokenize", json={"tokens": t["tokens"]}, headers=h).json()
    assert d["prompt"] == "Hello world"
    chat = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}, headers=h)
    assert chat.status_code == 200 and chat.json()["count"] > 2


# -------------------------------------------------------------- concurrency
def test_32_concurrent_streams_equal_their_non_streamed_twins(aclient, server):
    prompts = [f"Request number {i} says" for i in range(32)]

    async def one(prompt: str, stream: bool) -> str:
        kw = dict(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
        if not stream:
            return (await aclient.completions.create(**kw)).choices[0].text
        text = ""
        async for ch in await aclient.completions.create(stream=True, **kw):
            text += ch.choices[0].text if ch.choices else ""
        return text

    async def main() -> tuple[list[str], list[str]]:
        streamed = await asyncio.gather(*(one(p, True) for p in prompts))
        plain = await asyncio.gather(*(one(p, False) for p in prompts))
        return streamed, plain

    streamed, plain = asyncio.run(main())
    assert streamed == plain and all(streamed)
    wait_idle(server)


# -------------------------------------------------------------- disconnects
def _long_body(stream: bool) -> dict:
    return {"model": MODEL, "prompt": "Tell a long story", "max_tokens": 1500, "temperature": 0,
            "ignore_eos": True, "stream": stream}


def test_client_disconnect_mid_stream_aborts_the_request(server):
    aborted = server.metric("pagellm_request_success_total", 'finished_reason="abort"')
    body, headers = _long_body(True), server.headers
    with httpx.Client(timeout=30) as http, http.stream("POST", server.url + "/v1/completions", json=body,
                                                       headers=headers) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
        assert server.metric("pagellm_num_requests_running") == 1
    wait_idle(server)
    assert server.metric("pagellm_request_success_total", 'finished_reason="abort"') == aborted + 1


def test_client_disconnect_while_waiting_for_a_non_streamed_answer_aborts_it(server):
    aborted = server.metric("pagellm_request_success_total", 'finished_reason="abort"')
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=_long_body(False), headers=server.headers, timeout=0.8)
    wait_idle(server)
    assert server.metric("pagellm_request_success_total", 'finished_reason="abort"') == aborted + 1


def test_metrics_exposes_every_documented_series(server, client):
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=3)
    text = httpx.get(server.url + "/metrics", headers=server.headers).text
    for name in [
        "pagellm_num_requests_running", "pagellm_num_requests_waiting", "pagellm_num_requests_swapped",
        "pagellm_kv_cache_usage_perc", "pagellm_prefix_cache_queries_total", "pagellm_prefix_cache_hits_total",
        "pagellm_prompt_tokens_total", "pagellm_generation_tokens_total", "pagellm_request_success_total",
        "pagellm_num_preemptions_total", "pagellm_time_to_first_token_seconds_bucket",
        "pagellm_inter_token_latency_seconds_bucket", "pagellm_e2e_request_latency_seconds_bucket",
        "pagellm_request_queue_time_seconds_bucket", "pagellm_kv_cache_utilization", "pagellm_blocks_utilization",
        "pagellm_pending_requests", "pagellm_generation_throughput",
    ]:
        assert f'{name}{{model_name="{MODEL}"' in text or f"{name}{{" in text, name
    assert server.metric("pagellm_request_success_total", 'finished_reason="length"') >= 1
    assert server.metric("pagellm_generation_throughput") > 0
    # vLLM's names too (--metrics-prefix both, the default), with its labels.
    vllm_labels = f'{{engine="0",model_name="{MODEL}"}}'
    for name in ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:e2e_request_latency_seconds_count",
                 "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count"]:
        assert name + vllm_labels in text, name
    assert server.metric("vllm:request_success_total", 'finished_reason="length"') >= 1


# --------------------------------------------------------------- bad input
GOOD = {"model": MODEL, "prompt": "Hi", "max_tokens": 3}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
BAD_INPUTS = [
    # (name, path, raw body or dict, headers override, status, words the message must contain)
    ("malformed json", "/v1/completions", b'{"prompt": "Hi",', None, 400, "not valid JSON"),
    ("not an object", "/v1/completions", b'[1, 2]', None, 400, "JSON object"),
    ("empty body", "/v1/completions", b"", None, 400, "empty"),
    ("non utf-8", "/v1/completions", b'{"prompt": "\xff\xfe"}', None, 400, "UTF-8"),
    ("wrong type", "/v1/completions", {**GOOD, "max_tokens": "ten"}, None, 400, "max_tokens"),
    ("negative max_tokens", "/v1/completions", {**GOOD, "max_tokens": -1}, None, 400, "max_tokens must be >= 0"),
    ("n=0", "/v1/completions", {**GOOD, "n": 0}, None, 400, "n must be an integer >= 1"),
    ("top_p=2", "/v1/completions", {**GOOD, "top_p": 2}, None, 400, "top_p must be a number in (0, 1]"),
    ("temperature=-1", "/v1/completions", {**GOOD, "temperature": -1}, None, 400, "temperature"),
    ("missing prompt", "/v1/completions", {"model": MODEL}, None, 400, "'prompt' is required"),
    ("unknown model", "/v1/completions", {**GOOD, "model": "gpt-9"}, None, 404, "'gpt-9' does not exist"),
    ("prompt too long", "/v1/completions", {**GOOD, "prompt": [7] * 2095}, None, 400,
     "maximum context length is 2048"),
    ("prompt + max_tokens too long", "/v1/completions", {**GOOD, "prompt": [7] * 1995, "max_tokens": 100},
     None, 400, "1995 tokens and max_tokens is 100"),
    ("token id out of range", "/v1/completions", {**GOOD, "prompt": [1, 99999]}, None, 400, "token ids must be"),
    ("suffix", "/v1/completions", {**GOOD, "suffix": "x"}, None, 400, "suffix is not supported"),
    ("tool without function", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "tools": [{"type": "function"}]}, None, 400,
     "tools.0.function"),
    ("json schema without schema", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "response_format": {"type": "json_schema"}},
     None, 400, "needs a 'json_schema' object"),
    ("image part", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, None, 400, "'image_url' is not supported"),
    ("bad role", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "Hi"}]},
     None, 400, "messages.0.role"),
    ("no messages", "/v1/chat/completions", {"model": MODEL, "messages": []}, None, 400, "messages"),
    ("missing key", "/v1/completions", GOOD, {}, 401, "missing API key"),
    ("wrong key", "/v1/completions", GOOD, {"Authorization": "Bearer nope"}, 401, "invalid API key"),
    ("oversized body", "/v1/completions", {**GOOD, "prompt": "x" * 70_000}, None, 413, "larger than the limit"),
    ("seed out of range", "/v1/completions", {**GOOD, "seed": 2**64, "temperature": 1.0}, None, 400,
     "seed must be an integer in [-2**63, 2**64 - 1]"),
    ("every token banned", "/v1/completions", {**GOOD, "min_tokens": 2, "stop_token_ids": list(range(512))}, None,
     400, "cover every token of the vocabulary"),
    ("best_of streamed", "/v1/completions", {**GOOD, "best_of": 3, "stream": True}, None, 400,
     "best_of (3) > n (1) cannot be streamed"),
    ("logit_bias other digits", "/v1/completions", {**GOOD, "logit_bias": {"\u0663": 100}}, None, 400,
     "logit_bias keys must be token ids"),
    ("logit_bias negative", "/v1/completions", {**GOOD, "logit_bias": {"-1": 1}}, None, 400,
     "logit_bias keys must be token ids"),
    ("logit_bias out of vocab", "/v1/completions", {**GOOD, "logit_bias": {"99999999": 1}}, None, 400,
     "outside this model's vocabulary"),
    ("ttft_slo NaN", "/v1/completions", b'{"prompt": "Hi", "max_tokens": 3, "ttft_slo": NaN}', None, 400,
     "ttft_slo must be a positive, finite number"),
    ("prompt of mixed types", "/v1/completions", {**GOOD, "prompt": [1, "a"]}, None, 400,
     "'prompt': expected a string, a list of strings, a list of integers or a list of lists of integers"),
    ("more prompts than the queue", "/v1/completions", {**GOOD, "prompt": ["x"] * 1025}, None, 400,
     "1025 prompts in one request, but the server queues at most 1024"),
    ("echo of a prompt too long to score", "/v1/completions",
     {**GOOD, "prompt": [7] * 2048, "max_tokens": 0, "echo": True}, None, 400,
     "to score a prompt with echo it must be shorter"),
    ("top_logprobs 21", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                                 "logprobs": True, "top_logprobs": 21}, None, 400,
     "top_logprobs is 21, more than this server allows (--max-logprobs 20)"),
    ("max_completion_tokens 0", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 0}, None, 400,
     "max_completion_tokens must be an integer >= 1, got 0"),
    ("text part without text", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text"}]}]}, None, 400,
     "a text part needs a 'text' string"),
    ("unknown route", "/v1/nothing", GOOD, None, 404, "no such route"),
    # Fields OpenAI or vLLM define that would change the output: refused by name.
    ("beam search streamed", "/v1/completions", {**GOOD, "use_beam_search": True, "stream": True}, None, 400,
     "use_beam_search cannot be streamed"),
    ("guided json not a schema", "/v1/completions", {**GOOD, "guided_json": [1]}, None, 400,
     "structured_outputs.json must be a JSON schema"),
    ("structural tag", "/v1/completions", {**GOOD, "structural_tag": "{}"}, None, 400,
     "'structural_tag' is not supported"),
    ("prompt logprobs streamed", "/v1/completions", {**GOOD, "prompt_logprobs": 1, "stream": True}, None, 400,
     "prompt_logprobs are not available with stream=true"),
    ("chat echo", "/v1/chat/completions", {**CHAT, "echo": True}, None, 400, "'echo' is not supported"),
    ("per-request chat template", "/v1/chat/completions", {**CHAT, "chat_template": "{{ 'x' }}"}, None, 400,
     "'chat_template' is not supported"),
    ("truncate_prompt_tokens 0", "/v1/completions", {**GOOD, "truncate_prompt_tokens": 0}, None, 400,
     "truncate_prompt_tokens"),
    ("too many stop strings", "/v1/completions", {**GOOD, "stop": [f"s{i}" for i in range(65)]}, None, 400,
     "stop must have at most 64 strings, got 65"),
]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_gets_the_right_status_and_a_clear_message(server, case):
    _, path, body, headers, status, words = case
    h = server.headers if headers is None else headers
    if isinstance(body, bytes):
        r = httpx.post(server.url + path, content=body, headers={**h, "Content-Type": "application/json"})
    else:
        r = httpx.post(server.url + path, json=body, headers=h)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"], err
    assert set(err) == {"message", "type", "param", "code"}
    # The server answers a normal request right after, and nothing leaked.
    ok = httpx.post(server.url + "/v1/completions", json=GOOD, headers=server.headers)
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 1
    wait_idle(server)


def test_errors_name_the_field_the_client_sent(server):
    cases = [
        ("/v1/completions", {**GOOD, "prompt": [1, "a"]}, "prompt"),
        ("/v1/completions", {**GOOD, "stop": [None]}, "stop"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": 5}]},
         "messages.0.content"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "word " * 3000}]},
         "messages"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "logprobs": True,
                                  "top_logprobs": -1}, "top_logprobs"),
    ]
    for path, body, param in cases:
        r = httpx.post(server.url + path, json=body, headers=server.headers)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    wait_idle(server)


def test_a_client_gone_mid_body_is_not_logged_as_a_server_error(server):
    import socket

    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
    ok = httpx.post(server.url + "/v1/completions", json=GOOD, headers=server.headers)
    assert ok.status_code == 200
    time.sleep(0.2)
    assert "Exception in ASGI application" not in server.log()


def test_official_client_raises_typed_errors(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, top_p=2)
    assert e.value.body["param"] == "top_p"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="Hi", max_tokens=3)
    bad_key = openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()


# ------------------------------------------------------- overload, SIGTERM
def test_full_queue_gets_503_then_sigterm_finishes_cleanly(llama_path):
    srv = RemoteServer(llama_path, ["--max-model-len", "2048", "--num-kv-blocks", "256", "--max-num-seqs", "1",
                                    "--max-waiting-requests", "1", "--shutdown-timeout", "3"])
    try:
        body = {"prompt": "Go", "max_tokens": 2000, "temperature": 0, "ignore_eos": True, "stream": True}
        http = httpx.Client(timeout=30)
        first = http.stream("POST", srv.url + "/v1/completions", json=body)
        r1 = first.__enter__()
        lines1 = r1.iter_lines()  # kept: a dropped line iterator would close the connection
        next(lines1)  # running now
        second = http.stream("POST", srv.url + "/v1/completions", json=body)
        r2 = second.__enter__()
        assert r2.status_code == 200  # waits: max_num_seqs=1
        third = httpx.post(srv.url + "/v1/completions", json=body, timeout=30)
        assert third.status_code == 503 and third.headers["Retry-After"] == "1"
        assert "waiting queue is full" in third.json()["error"]["message"]
        # SIGTERM with two requests in flight: exit code 0 after the grace period, nothing left running.
        t0 = time.time()
        rc = srv.stop()
        assert rc == 0 and srv.proc.poll() == 0
        # It waited out the 3 s grace period for the running request, then aborted the rest.
        assert 2.5 < time.time() - t0 < 20
        rests = []
        for lines, ctx in ((lines1, first), (r2.iter_lines(), second)):
            try:
                rests.append(list(lines))
            except httpx.HTTPError:
                rests.append([])
            ctx.__exit__(None, None, None)
        # The queued one needed the first's 2000 tokens and then its own: aborted at the end of the grace
        # period, it ends with finish_reason "abort" and [DONE] (test_shutdown.py), not a cut connection.
        assert rests[1][-2:] == ["data: [DONE]", ""] and '"finish_reason": "abort"' in rests[1][-4]
        http.close()
        assert "engine stopped" in srv.log()
    finally:
        srv.stop()


def test_json_chunks_parse(server):
    """Every SSE line is `data: <json>` or the final `data: [DONE]`."""
    with httpx.stream("POST", server.url + "/v1/chat/completions", headers=server.headers, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True,
    }) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        assert json.loads(line[len("data: "):])["object"] == "chat.completion.chunk"


# ------------------------------------------------------- --chat-template
ALTERNATING = ("{% for m in messages %}{% if loop.index0 and m['role'] == messages[loop.index0 - 1]['role'] %}"
               "{{ raise_exception('roles must alternate between user and assistant') }}{% endif %}"
               "{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}{% if add_generation_prompt %}"
               "assistant: {% endif %}")


def test_chat_template_flag_and_its_refusals(llama_path, tmp_path):
    template_file = tmp_path / "alternating.jinja"
    template_file.write_text(ALTERNATING)
    srv = RemoteServer(llama_path, ["--max-model-len", "256", "--num-kv-blocks", "64",
                                    "--chat-template", str(template_file)])
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        model = client.models.list().data[0].id
        ok = client.chat.completions.create(model=model, max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
        assert ok.choices[0].finish_reason == "length"
        # The template (not the tokenizer's own) made the prompt.
        ids = httpx.post(srv.url + "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
        assert httpx.post(srv.url + "/detokenize", json={"tokens": ids["tokens"]}).json()["prompt"].endswith(
            "user: Hi\nassistant: ")
        twice = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=model, max_tokens=2, messages=twice)
        assert "roles must alternate between user and assistant" in e.value.body["message"]
        assert e.value.body["param"] == "messages"
        r = httpx.post(srv.url + "/tokenize", json={"messages": twice})
        assert r.status_code == 400 and "roles must alternate" in r.json()["error"]["message"]
        assert client.completions.create(model=model, prompt="Hi", max_tokens=2).choices[0].text is not None
    finally:
        assert srv.stop() == 0
    bad = subprocess.run([sys.executable, "-m", "pagellm.entrypoints.cli", "serve", str(llama_path),
                          "--chat-template", str(tmp_path / "missing.jinja")], capture_output=True, text=True)
    assert bad.returncode == 2 and "is neither a file nor a Jinja template" in bad.stderr
    bad = subprocess.run([sys.executable, "-m", "pagellm.entrypoints.cli", "serve", str(llama_path),
                          "--chat-template", "{% for %}"], capture_output=True, text=True)
    assert bad.returncode == 2 and "does not parse as Jinja" in bad.stderr
    # What transformers' renderer takes (loop controls, generation blocks) passes the check.
    assert load_chat_template("{% for m in messages %}{% break %}{% endfor %}{% generation %}x{% endgeneration %}")


# ------------------------------------------------ failures after the 200
def test_a_stream_that_fails_after_its_headers_ends_with_an_error_event():
    async def chunks(error: Exception):
        yield sse({"choices": [{"index": 0, "text": "a"}]})
        raise error

    async def collect(error: Exception) -> list[str]:
        return [c async for c in ending_with_an_error_event(chunks(error))]

    lines = asyncio.run(collect(APIError(500, "generation failed: engine step failed: boom")))
    assert len(lines) == 3 and lines[-1] == "data: [DONE]\n\n"
    err = json.loads(lines[1][len("data: "):])["error"]
    assert err["message"] == "generation failed: engine step failed: boom" and err["type"] == "internal_server_error"
    lines = asyncio.run(collect(KeyError("index")))  # a bug: still an event the client can read
    assert "internal error: KeyError" in json.loads(lines[1][len("data: "):])["error"]["message"]


def test_dict_keys_spelled_like_types_are_no_union_members(server):
    # (Unknown fields, "str" among them, are ignored here; --strict-requests: test_request_tolerance.py.)
    r = httpx.post(server.url + "/v1/completions", json={**GOOD, "logit_bias": {"int": "x"}}, headers=server.headers)
    assert r.status_code == 400 and "a valid number" in r.json()["error"]["message"], r.text


# ------------------------------------------- stream_options, fields that change nothing
def test_continuous_usage_stats_put_usage_on_every_chunk(client):
    """vLLM's stream_options.continuous_usage_stats (guidellm sends it): each chunk carries the usage so far."""
    opts = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(client.completions.create(model=MODEL, prompt="Hello", max_tokens=6, temperature=0, stream=True,
                                            stream_options=opts, extra_body={"ignore_eos": True}))
    *body, last = chunks
    assert body and all(ch.choices and ch.usage is not None for ch in body)
    done = [ch.usage.completion_tokens for ch in body]
    assert done == sorted(done) and done[-1] == 6 and done[0] >= 1
    assert all(ch.usage.total_tokens == ch.usage.prompt_tokens + ch.usage.completion_tokens for ch in body)
    assert last.choices == [] and last.usage.completion_tokens == 6
    assert last.usage.prompt_tokens == body[0].usage.prompt_tokens > 0

    chat = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=5, temperature=0, stream=True, stream_options=opts,
                                               extra_body={"ignore_eos": True}))
    *body, last = chat
    assert all(ch.usage is not None for ch in body)
    assert body[0].choices[0].delta.role == "assistant" and body[0].usage.completion_tokens == 0
    assert body[-1].choices[0].finish_reason == "length" and body[-1].usage.completion_tokens == 5
    assert last.choices == [] and last.usage.completion_tokens == 5
    assert last.usage.prompt_tokens == body[0].usage.prompt_tokens == body[0].usage.total_tokens

    # As in vLLM, continuous usage needs include_usage.
    plain = list(client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, stream=True,
                                           stream_options={"continuous_usage_stats": True}))
    assert all(ch.usage is None for ch in plain)


def test_fields_that_do_not_change_the_output_are_accepted_and_ignored(server, client):
    ignored = {"user": "u-1", "store": False, "metadata": {"team": "a"}, "service_tier": "auto",
               "prompt_cache_key": "k", "safety_identifier": "s", "length_penalty": 1.0}
    kw = dict(model=MODEL, prompt="Once upon", max_tokens=6, temperature=0, stream=True)
    text = "".join(ch.choices[0].text for ch in client.completions.create(**kw) if ch.choices)
    same = client.completions.create(**kw, stream_options={"include_usage": True, "include_obfuscation": True},
                                     extra_body={**ignored, "spaces_between_special_tokens": True,
                                                 "add_special_tokens": True, "use_beam_search": False})
    assert "".join(ch.choices[0].text for ch in same if ch.choices) == text
    msgs = [{"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0)
    again = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=6, temperature=0, parallel_tool_calls=False, tool_choice="none",
        extra_body={**ignored, "include_reasoning": True, "echo": False, "add_special_tokens": False,
                    "chat_template_kwargs": {}, "documents": []})
    assert again.choices[0].message.content == chat.choices[0].message.content


def test_ignored_fields_are_logged_once_each(caplog):
    from pagellm.entrypoints.openai import protocol

    protocol._logged_ignored.difference_update({"store", "stream_options.include_obfuscation"})
    body = '{"prompt": "Hi", "store": true, "stream_options": {"include_obfuscation": false}}'
    with caplog.at_level(logging.DEBUG, logger="pagellm.server"):
        for _ in range(3):
            protocol.CompletionRequest.model_validate_json(body)
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert sum("'store'" in line for line in lines) == 1
    assert sum("'stream_options.include_obfuscation'" in line for line in lines) == 1


def test_truncate_prompt_tokens_keeps_the_last_tokens(client):
    ids = client.post("/../tokenize", body={"prompt": "one two three four five six seven eight"},
                      cast_to=object)["tokens"]
    assert len(ids) > 6
    cut = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0,
                                    extra_body={"truncate_prompt_tokens": 4, "ignore_eos": True})
    tail = client.completions.create(model=MODEL, prompt=ids[-4:], max_tokens=5, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert cut.usage.prompt_tokens == 4 and cut.choices[0].text == tail.choices[0].text
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi there"}],
                                          max_tokens=2, extra_body={"truncate_prompt_tokens": 3})
    assert chat.usage.prompt_tokens == 3


def _raw_exchange(port: int, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send ``request`` on a fresh connection; (status, headers, body) of the answer read to the close."""
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body


def test_requests_that_are_not_valid_http_get_openai_json_errors(server):
    status, headers, body = _raw_exchange(server.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                                       b"Content-Length: ten\r\n\r\n{}")
    assert status == 400 and headers["content-type"] == "application/json", body
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and "Content-Length" in error["message"]
    # Headers of 200 KB: a 431 the client reads whole (no reset of a socket with unread bytes).
    status, headers, body = _raw_exchange(server.port, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: "
                                                       + b"a" * 200_000 + b"\r\n\r\n")
    assert status == 431 and headers["content-type"] == "application/json", body
    assert "headers are larger than" in json.loads(body)["error"]["message"]
    assert httpx.get(server.url + "/health").status_code == 200


@pytest.mark.parametrize("body, param, words", [
    ({"logit_bias": {"7" * 5000: 1}}, "logit_bias", ["token ids in the model's vocabulary", "5000 digits"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "object", "properties": {"s": {"type": "string", "maxLength": 2**70}}}}}},
     None, ["properties.s.maxLength", "beyond the limit of 4294967295"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "integer", "minimum": -(2**70)}}}}, None, ["'minimum'", "limit of -9223372036854775808"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": False}}},
     "response_format.json_schema.schema", ["JSON schema false, which no value matches"]),
    ({"structured_outputs": {"json": False}}, "structured_outputs", ["JSON schema false"]),
])
def test_out_of_range_keys_and_schemas_are_clear_400s(server, body, param, words):
    r = httpx.post(server.url + "/v1/chat/completions", headers=server.headers, timeout=30,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert all(w in error["message"] for w in words), error
    assert "sys.set_int_max_str_digits" not in error["message"] and "serializable" not in error["message"]
    if param is not None:
        assert error["param"] == param


def test_the_json_schema_true_means_any_json_value(client):
    for extra in ({"response_format": {"type": "json_schema", "json_schema": {"name": "any", "schema": True}}},
                  {"structured_outputs": {"json": True}}):
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=40, temperature=0, extra_body=extra)
        if r.choices[0].finish_reason == "stop":
            json.loads(r.choices[0].message.content or "")


def test_openapi_declares_the_bodies_and_content_types(server):
    r = httpx.get(server.url + "/openapi.json", headers=server.headers)
    assert r.status_code == 200
    doc = r.json()
    schemas = doc["components"]["schemas"]
    for path, model in (("/v1/chat/completions", "ChatCompletionRequest"), ("/v1/completions", "CompletionRequest"),
                        ("/tokenize", "TokenizeRequest"), ("/detokenize", "DetokenizeRequest")):
        body = doc["paths"][path]["post"]["requestBody"]
        assert body["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{model}"}
        assert model in schemas
    assert "messages" in schemas["ChatCompletionRequest"]["properties"]
    refs = set(re.findall(r'"\$ref": "#/components/schemas/([^"]+)"', json.dumps(doc)))
    assert refs <= set(schemas), refs - set(schemas)  # every reference resolves
    for path in ("/v1/chat/completions", "/v1/completions"):
        assert set(doc["paths"][path]["post"]["responses"]["200"]["content"]) >= {"application/json",
                                                                                  "text/event-stream"}
    assert set(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert set(doc["paths"]["/dashboard"]["get"]["responses"]["200"]["content"]) == {"text/html"}
    ids = [op["operationId"] for item in doc["paths"].values() for op in item.values()]
    assert len(ids) == len(set(ids))
    assert "Duplicate Operation ID" not in server.log()
    # FastAPI's /docs and /redoc load scripts from a CDN: off unless --enable-fastapi-docs.
    for page in ("/docs", "/redoc"):
        assert httpx.get(server.url + page, headers=server.headers).status_code == 404
    # and the bodies are still parsed by the server itself, with OpenAI-shaped errors
    bad = httpx.post(server.url + "/v1/completions", headers=server.headers, content=b"{")
    assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]
