"""Faults on the real server, injected through $PAGELLM_TEST_FAULTS (pagellm/engine/faults.py): the
victim request fails, the others complete, no KV block leaks and /health stays ok; a fault the engine
cannot survive makes /health fail and the process exit non-zero, its traceback logged once."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import httpx
import openai
import pytest
from starlette.testclient import TestClient

from pagellm import EngineArgs, LLMEngine
from pagellm.engine.faults import ENV_VAR
from pagellm.entrypoints.openai.api_server import build_app
from tests.entrypoints.openai.server_utils import RemoteServer

MODEL = "tiny"
# One seat: a step's batch holds one request, so a failed step fails exactly the victim and the
# others wait their turn.
ARGS = ["--served-model-name", MODEL, "--max-model-len", "512", "--num-kv-blocks", "128", "--max-num-seqs", "1"]


def start(llama_path, faults: str) -> RemoteServer:
    old = os.environ.get(ENV_VAR)
    os.environ[ENV_VAR] = faults  # inherited by the server process only: set for its start
    try:
        return RemoteServer(llama_path, ARGS)
    finally:
        if old is None:
            del os.environ[ENV_VAR]
        else:
            os.environ[ENV_VAR] = old


@pytest.fixture(scope="module")
def server(llama_path):
    srv = start(llama_path, "admit:prompt_contains=ADMIT-POISON;step:prompt_contains=STEP-POISON,times=inf;"
                            "callback:times=1")
    yield srv
    assert srv.stop() == 0


def async_client(server: RemoteServer) -> openai.AsyncOpenAI:
    """A client for one asyncio.run (its connections belong to that event loop)."""
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def assert_healthy_and_idle(server: RemoteServer, timeout: float = 10) -> None:
    """/health ok, and /metrics back to no request and no KV block in use."""
    r = httpx.get(server.url + "/health", timeout=5)
    assert r.status_code == 200 and r.json() == {"status": "ok"}, r.text
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (server.metric("pagellm_num_requests_running") == 0 and server.metric("pagellm_num_requests_waiting") == 0
                and server.metric("pagellm_kv_cache_usage_perc") == 0):
            return
        time.sleep(0.05)
    raise AssertionError("KV blocks or requests left behind:\n" + httpx.get(server.url + "/metrics").text)


async def complete(client: openai.AsyncOpenAI, prompt: str, stream: bool = False) -> Any:
    """The completion's text and finish reason (streamed: gathered from the chunks)."""
    kw: dict[str, Any] = dict(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                              extra_body={"ignore_eos": True})
    if not stream:
        r = await client.completions.create(**kw)
        return r.choices[0].text, r.choices[0].finish_reason
    text, finish = "", None
    async for chunk in await client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            text += c.text
            finish = c.finish_reason or finish
    return text, finish


def test_a_request_that_fails_admission_fails_alone(server):
    async def main() -> list[Any]:
        aclient = async_client(server)
        return await asyncio.gather(complete(aclient, "Hello"), complete(aclient, "ADMIT-POISON now"),
                                    complete(aclient, "Bye", stream=True), complete(aclient, "Again"),
                                    return_exceptions=True)

    ok1, victim, ok2, ok3 = asyncio.run(main())
    assert isinstance(victim, openai.InternalServerError), victim
    assert "could not admit" in victim.message
    assert all(r[1] == "length" for r in (ok1, ok2, ok3)), (ok1, ok2, ok3)
    assert_healthy_and_idle(server)


def test_a_failed_step_fails_its_batch_only(server):
    async def main() -> list[Any]:
        aclient = async_client(server)
        return await asyncio.gather(complete(aclient, "Hello", stream=True),
                                    complete(aclient, "STEP-POISON", stream=True),
                                    complete(aclient, "Bye", stream=True), complete(aclient, "Again"),
                                    return_exceptions=True)

    ok1, victim, ok2, ok3 = asyncio.run(main())
    # Streamed: the 200 went out first, so the failure comes as an error event (openai raises it).
    assert isinstance(victim, openai.APIError), victim
    assert "engine step failed" in str(victim)
    assert all(r[1] == "length" for r in (ok1, ok2, ok3)), (ok1, ok2, ok3)
    assert_healthy_and_idle(server)  # the victim's blocks (taken for its prefill) came back
    assert "an engine step (1 request in its batch) failed; the engine goes on" in server.log()


def test_a_failing_metrics_callback_leaves_requests_and_metrics_going(server):
    asyncio.run(complete(async_client(server), "Hello"))
    assert "callback EngineMetrics.on_step failed; the engine goes on" in server.log()
    before = server.metric("pagellm_generation_tokens_total")
    asyncio.run(complete(async_client(server), "Hello"))
    assert server.metric("pagellm_generation_tokens_total") == before + 16  # on_step still runs
    assert_healthy_and_idle(server)


def wait_exit(srv: RemoteServer, timeout: float = 30) -> int:
    try:
        return srv.proc.wait(timeout=timeout)
    finally:
        srv.stop()


def test_a_fault_outside_any_request_exits_non_zero_with_one_traceback(llama_path):
    srv = start(llama_path, "loop:after=3")
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.APIError, match="the engine failed"):
            for _ in client.completions.create(model=MODEL, prompt="Hello", max_tokens=200, stream=True,
                                               extra_body={"ignore_eos": True}):
                pass
        try:  # answered until the process is gone: 503 and why
            r = httpx.get(srv.url + "/health", timeout=2)
            assert r.status_code == 503 and r.json()["status"] == "error", r.text
        except httpx.TransportError:
            pass
        assert wait_exit(srv) == 1
        log = srv.log()
        assert log.count("Traceback") == 1, log
        assert "the engine loop stopped" in log
    finally:
        srv.stop()


def test_repeated_step_failures_exit_non_zero(llama_path):
    srv = start(llama_path, "step:times=inf")
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        for i in range(3):
            with pytest.raises(openai.InternalServerError):
                client.completions.create(model=MODEL, prompt="Hello", max_tokens=4)
            if i < 2:  # a failure or two: the engine goes on
                assert httpx.get(srv.url + "/health", timeout=5).status_code == 200
        assert wait_exit(srv) == 1
        log = srv.log()
        assert log.count("Traceback") == 1 and "failed 3 times in a row" in log, log
    finally:
        srv.stop()


def test_health_says_why_once_the_engine_failed(llama_path, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "loop")
    engine = LLMEngine(EngineArgs(model=str(llama_path), max_model_len=256, num_kv_blocks=64, device="cpu"))
    with TestClient(build_app(engine, MODEL)) as http:
        assert http.get("/health").json() == {"status": "ok"}
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 4})
        assert r.status_code == 500 and "the engine failed" in r.json()["error"]["message"]
        r = http.get("/health")
        assert r.status_code == 503
        assert r.json() == {"status": "error", "message": "the engine failed: injected fault at 'loop' "
                                                          f"({ENV_VAR})"}
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 4})
        assert r.status_code == 503
