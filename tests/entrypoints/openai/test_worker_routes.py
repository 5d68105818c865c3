"""The routes a router reads from a worker (vllm-router's: /get_load, /get_server_info, /get_model_info,
/health_generate, /flush_cache; vLLM's /load and /reset_prefix_cache), on the real server."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.entrypoints.openai.server_utils import RemoteServer

API_KEY = "worker-key"


@pytest.fixture(scope="module")
def server(llama_path):
    # --strict-requests: the fields a router adds must pass even where unknown fields are refused.
    srv = RemoteServer(llama_path, ["--served-model-name", "tiny", "--max-model-len", "512", "--num-kv-blocks", "128",
                                    "--strict-requests"], api_key=API_KEY)
    yield srv
    assert srv.stop() == 0


def get(server: RemoteServer, path: str) -> httpx.Response:
    return httpx.get(server.url + path, headers=server.headers, timeout=30)


def test_load_and_info(server):
    assert get(server, "/get_load").json() == {"load": 0, "num_reqs": 0, "num_waiting_reqs": 0,
                                                "num_running_reqs": 0}
    assert get(server, "/load").json() == {"server_load": 0}
    info = get(server, "/get_server_info").json()
    assert info["block_size"] == 16 and info["max_model_len"] == 512 and info["served_model_name"] == "tiny"
    assert get(server, "/get_model_info").json()["is_generation"] is True
    # Behind the API key, but for /get_load, which vllm-router polls without it (as /health).
    assert httpx.get(server.url + "/get_server_info").status_code == 401
    assert httpx.get(server.url + "/get_load").json()["load"] == 0


def test_health_generate(server):
    r = get(server, "/health_generate")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_flush_cache_forgets_prefixes(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    prompt = list(range(5, 5 + 64))  # four full blocks

    def hits_after_request() -> float:
        before = server.metric("pagellm_prefix_cache_hits_total")
        client.completions.create(model="tiny", prompt=prompt, max_tokens=1)
        return server.metric("pagellm_prefix_cache_hits_total") - before

    hits_after_request()
    assert hits_after_request() >= 48
    for path in ("/flush_cache", "/reset_prefix_cache"):
        r = httpx.post(server.url + path, headers=server.headers, timeout=30)
        assert r.status_code == 200, r.text
        assert hits_after_request() == 0


def test_router_fields_accepted_at_their_defaults(server):
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 2, "no_stop_trim": False,
            "return_hidden_states": False}
    r = httpx.post(server.url + "/v1/completions", headers=server.headers, json=body, timeout=30)
    assert r.status_code == 200, r.text
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "separate_reasoning": True, "stream_reasoning": True, "no_stop_trim": False}
    r = httpx.post(server.url + "/v1/chat/completions", headers=server.headers, json=chat, timeout=30)
    assert r.status_code == 200, r.text
    # Another value would change the output: refused under --strict-requests, as any unknown field.
    r = httpx.post(server.url + "/v1/completions", headers=server.headers, json={**body, "no_stop_trim": True},
                   timeout=30)
    assert r.status_code == 400 and "no_stop_trim" in r.text
    assert "does not know" not in server.log()
