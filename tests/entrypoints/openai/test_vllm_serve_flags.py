"""`pagellm serve` with the vLLM flags scripts pass without thinking (a YAML --config among them), and the
answer to a route this server does not have; the real server on 127.0.0.1, the openai client and httpx."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import openai
import pytest

from pagellm.entrypoints.openai.launch import free_port
from tests.entrypoints.openai.server_utils import RemoteServer

NAME = "cfg-name"
ROLE = "navigator"
ROOT = "/llm"
# Flags of vLLM that change nothing here: each logs one line naming it.
NO_OPS = ["--disable-frontend-multiprocessing", "--distributed-executor-backend mp", "--download-dir /nowhere",
          "--tokenizer-mode slow", "--revision main", "--max-seq-len-to-capture 8192",
          "--max-parallel-loading-workers 2", '--compilation-config {"level": 3}', "--optimization-level 3",
          "--async-scheduling"]


@pytest.fixture(scope="module")
def server(llama_path, tmp_path_factory):
    config = tmp_path_factory.mktemp("config") / "serve.yaml"
    # Both spellings of a key; a flag the command line gives again (--max-log-len) is the command line's.
    config.write_text(f"served-model-name: {NAME}\nresponse_role: {ROLE}\nmax-logprobs: 3\n"
                      "enable-log-requests: true\nmax-log-len: 1000\nport: 1\nmetrics-prefix: vllm\n")
    srv = RemoteServer(llama_path, [
        "--config", str(config), "--max-log-len", "5", "--root-path", ROOT,
        "--hf-overrides", '{"max_position_embeddings": 200}',
        "--override-generation-config", '{"temperature": 0.0, "max_new_tokens": 5}',
        "--uvicorn-log-level", "info", "--disable-uvicorn-access-log",
        "--disable-frontend-multiprocessing", "--distributed-executor-backend", "mp", "--download-dir", "/nowhere",
        "--tokenizer-mode", "slow", "--revision", "main", "--max-seq-len-to-capture", "8192",
        "--max-parallel-loading-workers", "2", "--compilation-config", '{"level": 3}', "-O3", "--async-scheduling",
        "--enable-fastapi-docs",
    ])
    yield srv
    assert srv.stop() == 0


def client(server: RemoteServer, prefix: str = "") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}{prefix}/v1", api_key="none", max_retries=0)


def test_the_config_file_sets_flags_and_the_command_line_wins(server):
    models = client(server).models.list().data
    assert [m.id for m in models] == [NAME]  # served-model-name from the file
    assert f":{server.port}" in server.url  # the file's port: 1 lost to the command line's --port


def test_metrics_prefix_vllm_serves_vllms_names_alone(server):
    client(server).completions.create(model=NAME, prompt="Hi", max_tokens=2)
    text = httpx.get(server.url + "/metrics").text
    assert f'vllm:request_success_total{{engine="0",finished_reason="length",model_name="{NAME}"}} 1.0' in text
    assert "vllm:num_requests_waiting{" in text and "vllm:e2e_request_latency_seconds_bucket{" in text
    assert "pagellm_" not in text


def test_hf_overrides_change_the_models_config(server):
    (model,) = client(server).models.list().data
    assert model.model_extra["max_model_len"] == 200  # the model's own is 2048
    assert "hf_overrides: max_position_embeddings = 200 (the model's: 2048)" in server.log()


def test_override_generation_config_sets_the_sampling_defaults(server):
    c = client(server)
    outs = [c.completions.create(model=NAME, prompt="The capital of France is", extra_body={"ignore_eos": True})
            for _ in range(2)]
    assert all(o.usage.completion_tokens == 5 for o in outs)  # max_new_tokens
    assert outs[0].choices[0].text == outs[1].choices[0].text  # temperature 0: greedy


def test_max_logprobs_caps_what_a_request_may_ask(server):
    c = client(server)
    ok = c.completions.create(model=NAME, prompt="Hello", max_tokens=2, logprobs=3)
    assert len(ok.choices[0].logprobs.top_logprobs[0]) >= 3
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=NAME, prompt="Hello", max_tokens=2, logprobs=4)
    assert "logprobs is 4, more than this server allows (--max-logprobs 3)" in e.value.body["message"]
    assert e.value.body["param"] == "logprobs"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                  logprobs=True, top_logprobs=4)
    assert "--max-logprobs 3" in e.value.body["message"] and e.value.body["param"] == "top_logprobs"


def test_response_role_is_the_role_of_chat_replies(server):
    messages = [{"role": "user", "content": "Hi"}]
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": NAME, "messages": messages, "max_tokens": 2})
    assert r.json()["choices"][0]["message"]["role"] == ROLE
    stream = client(server).chat.completions.create(model=NAME, messages=messages, max_tokens=2, stream=True)
    assert next(iter(stream)).choices[0].delta.role == ROLE
    # Without a generation prompt the reply continues the last message, in its role (as vLLM).
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"model": NAME, "messages": messages, "max_tokens": 2, "add_generation_prompt": False})
    assert r.json()["choices"][0]["message"]["role"] == "user"


def test_root_path_serves_with_and_without_the_prefix(server):
    for prefix in ("", ROOT):
        out = client(server, prefix).completions.create(model=NAME, prompt="Hello", max_tokens=1)
        assert out.usage.completion_tokens == 1
    schema = httpx.get(server.url + "/openapi.json").json()
    assert {"url": ROOT} in schema["servers"]
    for page in ("/docs", "/redoc"):  # --enable-fastapi-docs (off by default)
        assert httpx.get(server.url + page).status_code == 200
    assert httpx.get(server.url + ROOT + "/health").status_code == 200


def test_enable_log_requests_logs_each_request_up_to_max_log_len(server):
    client(server).completions.create(model=NAME, prompt="Paged attention saves memory because blocks are shared",
                                      max_tokens=1)
    lines = [line for line in server.log().splitlines() if "Received request cmpl-" in line]
    assert lines and "prompt: 'Paged'," in lines[-1] and "params: SamplingParams(" in lines[-1]
    assert "prompt_token_ids: [" in lines[-1] and "'...']" in lines[-1]  # the ids cut at 5 too


def test_flags_without_effect_log_one_line_each(server):
    log = server.log()
    for flag in NO_OPS:
        assert log.count(f"{flag} has no effect: ") == 1, (flag, log)


def test_disable_uvicorn_access_log(server):
    httpx.get(server.url + "/v1/models")
    time.sleep(0.2)
    assert '"GET /v1/models HTTP/1.1" 200' not in server.log()


def test_length_errors_count_in_good_grammar(server):
    messages = [{"role": "user", "content": "word " * 150}]
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": NAME, "messages": messages, "max_tokens": 100})
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and "maximum context length is 200 tokens, but the messages have " in message


def test_plural_counts():
    from pagellm.text import plural

    assert [plural(n, "byte") for n in (0, 1, 2)] == ["0 bytes", "1 byte", "2 bytes"]
    assert plural(1, "run") == "1 run" and plural(3, "priority", "priorities") == "3 priorities"


# ------------------------------------------------------------------ unknown routes
def test_a_vllm_route_pagellm_does_not_serve_says_so(server):
    r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/a"})
    message = r.json()["error"]["message"]
    assert "no such route: POST /v1/load_lora_adapter is LoRA adapter loading at run time, served with " \
           "--enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" in message
    r = httpx.post(server.url + "/sleep", json={})
    message = r.json()["error"]["message"]
    assert "which pagellm does not serve yet" in message
    assert "POST /v1/completions" in message and "POST /v1/chat/completions" in message
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    for path, api in [("/v1/audio/transcriptions", "audio APIs"), ("/invocations", "SageMaker"),
                      (ROOT + "/v1/load_lora_adapter", "LoRA")]:
        r = httpx.post(server.url + path, json={})
        assert r.status_code == 404 and api in r.json()["error"]["message"], (path, r.text)


def test_the_pooling_routes_name_runner_pooling(server):
    with pytest.raises(openai.BadRequestError, match="--runner pooling"):
        client(server).embeddings.create(model=NAME, input="Hello")
    for path in ("/v1/rerank", "/score", "/pooling", "/classify", ROOT + "/v1/embeddings"):
        r = httpx.post(server.url + path, json={})
        assert r.status_code == 400 and "--runner pooling" in r.json()["error"]["message"], (path, r.text)


def test_an_unknown_route_lists_the_routes_served(server):
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    message = err["message"]
    assert message.startswith("no such route: GET /v1/nothing. This server's routes: ")
    for route in ("GET /v1/models", "POST /v1/completions", "POST /v1/messages", "POST /tokenize",
                  "POST /detokenize", "GET /health", "GET /metrics", "GET /dashboard", "GET /v1/kv_cache/state"):
        assert route in message, route
    near = httpx.post(server.url + "/v1/completion", json={}).json()["error"]["message"]
    assert "did you mean /v1/completions?" in near


# ------------------------------------------------------------------ refusals, before the model loads
def _serve(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagellm.entrypoints.cli", "serve", *flags],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("yaml_text, words", [
    ("max-model-len: [1, 2\n", "is not valid YAML at line 2"),
    ("- port\n", "must hold a mapping of flag names to values"),
    ("max-num-seq: 4\n", "'max-num-seq' is not a flag of pagellm serve: did you mean max-num-seqs?"),
    ("port: eighty\n", "argument --port: invalid int value: 'eighty'"),
    ("enforce-eager: maybe\n", "'enforce-eager' is a switch: give true or false"),
    ("dtype: int4\n", "argument --dtype: invalid choice: 'int4'"),
    ("config: other.yaml\n", "'config' cannot be set in a config file"),
])
def test_a_bad_config_file_is_named_with_what_is_wrong(tmp_path, yaml_text, words):
    config = tmp_path / "bad.yaml"
    config.write_text(yaml_text)
    r = _serve("--config", str(config))
    assert r.returncode == 2 and f"--config '{config}'" in r.stderr and words in r.stderr, r.stderr
    assert r.stderr.startswith("usage: pagellm serve")


@pytest.mark.parametrize("flags, words", [
    (["--max-logprobs", "-2"], "max_logprobs (--max-logprobs) must be an integer >= 0 (or -1: no limit)"),
    (["--hf-overrides", "{max_position_embeddings: 1}"], "hf_overrides (--hf-overrides) is not valid JSON"),
    (["--hf-overrides", "[1]"], "hf_overrides (--hf-overrides) must be a JSON object"),
    (["--override-generation-config", '{"temprature": 0.5}'],
     "override_generation_config (--override-generation-config) has keys pagellm does not use: temprature"),
    (["--compilation-config", "7"], "compilation_config (--compilation-config) as a level must be 0, 1, 2 or 3"),
    (["-O5"], "--optimization-level/-O: invalid choice: 5"),
    (["--distributed-executor-backend", "spark"], "invalid choice: 'spark'"),
    (["--ssl-keyfile", "key.pem"], "HTTPS needs both --ssl-keyfile and --ssl-certfile"),
    (["--root-path", "llm"], "--root-path must be a path starting with '/'"),
    (["--enable-log-requests", "--disable-log-requests"], "contradict each other"),
    (["--enable-fastapi-docs", "--disable-fastapi-docs"], "--disable-fastapi-docs contradict each other"),
    (["--max-logprob", "3", "--frobnicate"], "unrecognized arguments: --frobnicate"),
])
def test_bad_vllm_flag_values_are_named(llama_path, flags, words):
    r = _serve(str(llama_path), "--port", str(free_port()), *flags)
    assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_override_generation_config_json_reaches_the_engine_as_a_dict(llama_path):
    from pagellm.config import EngineArgs
    from pagellm.entrypoints.cli import build_parser

    argv = ["serve", str(llama_path), "--override-generation-config", json.dumps({"top_k": 5}),
            "--hf-overrides", '{"rope_theta": 20000.0}', "-O", "2"]
    ea = EngineArgs.from_cli_args(build_parser(argv).parse_args(argv))
    assert ea.override_generation_config == {"top_k": 5} and ea.hf_overrides == {"rope_theta": 20000.0}
    assert ea.optimization_level == 2
