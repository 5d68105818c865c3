"""`pagellm serve` with vLLM's flags: several API keys and model names, models.retrieve, HEAD and 405s,
CORS, slow clients, and a port that is already taken."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from tests.entrypoints.openai.server_utils import RemoteServer

KEYS = ("first-key", "second-key")
ORIGIN = "http://ui.example"


@pytest.fixture(scope="module")
def server(llama_path):
    srv = RemoteServer(llama_path, [
        "--served-model-name", "main-name", "alias-name", "--max-model-len", "256",
        "--api-key", *KEYS, "--allowed-origins", f'["{ORIGIN}"]', "--body-read-timeout", "1",
        "--timeout-keep-alive", "1",
        # vLLM's flags that scripts pass without thinking
        "--gpu-memory-utilization", "0.01", "--enforce-eager", "--trust-remote-code", "--tensor-parallel-size", "1",
        "--kv-cache-dtype", "auto", "--disable-log-stats", "--disable-log-requests", "--uvicorn-log-level", "info",
        "--swap-space", "1", "--seed", "0",
    ])
    yield srv
    assert srv.stop() == 0


def client(server: RemoteServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def test_every_api_key_is_accepted_and_no_other(server):
    for key in KEYS:
        assert client(server, key).models.list().data[0].id == "main-name"
    with pytest.raises(openai.AuthenticationError):
        client(server, "third-key").models.list()


def test_served_model_names_are_all_listed_and_accepted(server):
    c = client(server, KEYS[0])
    assert [m.id for m in c.models.list().data] == ["main-name", "alias-name"]
    out = c.completions.create(model="alias-name", prompt="Hello", max_tokens=2)
    assert out.model == "main-name" and out.usage.completion_tokens == 2
    with pytest.raises(openai.NotFoundError, match="main-name"):
        c.completions.create(model="other", prompt="Hello", max_tokens=2)


def test_models_retrieve_head_and_405_allow(server):
    c = client(server, KEYS[1])
    model = c.models.retrieve("alias-name")
    assert model.id == "alias-name" and model.owned_by == "pagellm"
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("missing")
    auth = {"Authorization": f"Bearer {KEYS[0]}"}
    head = httpx.head(server.url + "/v1/models", headers=auth)
    assert head.status_code == 200 and head.content == b""
    assert httpx.head(server.url + "/health").status_code == 200
    wrong = httpx.delete(server.url + "/v1/completions", headers=auth)
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    assert wrong.json()["error"]["message"] == "method not allowed on this route"


def test_uvicorn_access_log_is_on_as_in_vllm(server):
    # --uvicorn-log-level info shows uvicorn's access lines unless --disable-uvicorn-access-log.
    httpx.get(server.url + "/health")
    time.sleep(0.2)
    assert '"GET /health HTTP/1.1" 200' in server.log()


def test_health_answers_json(server):
    r = httpx.get(server.url + "/health")
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")


def test_cors_only_for_the_allowed_origins(server):
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    ok = httpx.options(server.url + "/v1/completions", headers=preflight)
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(server.url + "/v1/completions", headers={**preflight, "Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in other.headers


def test_cors_is_off_by_default(llama_path):
    srv = RemoteServer(llama_path, ["--max-model-len", "128", "--num-kv-blocks", "16"])
    try:
        r = httpx.get(srv.url + "/v1/models", headers={"Origin": ORIGIN})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
        preflight = httpx.options(srv.url + "/v1/models", headers={"Origin": ORIGIN,
                                                                   "Access-Control-Request-Method": "GET"})
        assert "access-control-allow-origin" not in preflight.headers
    finally:
        assert srv.stop() == 0


def _connect(server: RemoteServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10)


def _read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_a_client_trickling_its_headers_is_disconnected(server):
    with _connect(server) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # the head never ends
        t0 = time.monotonic()
        assert _read_all(sock) == b""  # closed by the server (--body-read-timeout 1)
        assert time.monotonic() - t0 < 8


def test_a_client_trickling_its_body_gets_a_408(server):
    with _connect(server) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + KEYS[0].encode() + b"\r\nContent-Length: 100\r\n\r\n{\"prompt\":")
        t0 = time.monotonic()
        answer = _read_all(sock)
        assert answer.startswith(b"HTTP/1.1 408") and b"--body-read-timeout" in answer
        assert time.monotonic() - t0 < 8
    # Requests that send their body at once are unaffected.
    assert client(server, KEYS[0]).completions.create(model="main-name", prompt="Hi", max_tokens=1).choices


def test_vllm_api_key_env_is_used_when_pagellm_has_none(llama_path, monkeypatch):
    monkeypatch.delenv("PAGELLM_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm-env")
    srv = RemoteServer(llama_path, ["--max-model-len", "128", "--num-kv-blocks", "16"])
    try:
        assert client(srv, "from-vllm-env").models.list().data
        with pytest.raises(openai.AuthenticationError):
            client(srv, "wrong").models.list()
    finally:
        assert srv.stop() == 0


def test_a_port_in_use_is_reported_before_the_model_loads(llama_path):
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    port = holder.getsockname()[1]
    try:
        r = subprocess.run([sys.executable, "-m", "pagellm.entrypoints.cli", "serve", str(llama_path),
                            "--port", str(port)], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PAGELLM_API_KEY": ""})
    finally:
        holder.close()
    assert r.returncode == 2
    assert f"port {port} on 127.0.0.1 is already in use" in r.stderr and "--port" in r.stderr
    assert "KV cache" not in r.stderr  # refused before the engine was built


@pytest.mark.parametrize("flags,message", [
    (["--tensor-parallel-size", "3"], "tensor_parallel_size 3 must divide the model's 4 attention heads"),
    (["--calculate-kv-scales"], "scales an fp8 KV cache: give --kv-cache-dtype fp8"),
    (["--gpu-memory-utilization", "1.5"], "must be a number in (0, 1]"),
    (["--timeout-keep-alive", "0"], "--timeout-keep-alive must be a positive"),
    (["--allowed-origins", "[1]"], "must be a JSON list of strings"),
])
def test_vllm_values_pagellm_cannot_honour_are_named(llama_path, flags, message):
    r = subprocess.run([sys.executable, "-m", "pagellm.entrypoints.cli", "serve", str(llama_path), *flags],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and message in r.stderr, r.stderr
