"""`pagellm serve --data-parallel-size 2` for real: two replicas behind vllm-router (a peer: `make
test-peers`), driven with the `openai` client through the router."""

from __future__ import annotations

import os
import re
import signal
import time

import httpx
import openai
import pytest

from tests.entrypoints.openai.server_utils import RemoteServer

pytest.importorskip("vllm_router", reason="vllm-router is not installed: pip install 'pagellm[router]'")
pytestmark = pytest.mark.peers

API_KEY = "dp-key"
PREFIX = "You are a careful assistant for the handbook of the harbour office. " * 12


@pytest.fixture(scope="module")
def server(llama_path):
    srv = RemoteServer(llama_path, ["-dp", "2", "--router-policy", "cache_aware", "--served-model-name", "tiny",
                                    "--max-model-len", "1024", "--num-kv-blocks", "256"], api_key=API_KEY,
                       timeout=300)
    yield srv
    pids = [pid for pid, _ in replicas(srv)]
    assert srv.stop() == 0
    time.sleep(0.5)
    for pid in pids:  # the replicas stop with the router
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def replicas(srv: RemoteServer) -> list[tuple[int, str]]:
    """(pid, url) of each replica, from the launcher's log."""
    return [(int(pid), f"http://127.0.0.1:{port}")
            for pid, port in re.findall(r"replica \d+: pid (\d+), 127\.0\.0\.1:(\d+)", srv.log())]


def finished(url: str) -> float:
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10).text
    return sum(float(v) for v in re.findall(r"^pagellm_request_success_total\{[^}]*\} (\S+)$", text, re.MULTILINE))


def test_same_prefix_same_replica(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    (_, a), (_, b) = replicas(server)
    before = [finished(a), finished(b)]
    for i in range(6):
        out = client.completions.create(model="tiny", prompt=PREFIX + f"Question {i}: where?", max_tokens=3)
        assert out.choices[0].finish_reason == "length"
    served = [finished(a) - before[0], finished(b) - before[1]]
    assert sorted(served) == [0, 6], served
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert chat.choices[0].message.content is not None


def test_a_dead_replica_leaves_the_other_serving(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    (pid, url), _ = replicas(server)
    os.kill(pid, signal.SIGKILL)
    deadline = time.time() + 10
    while "replica 0 (pid" not in server.log() and time.time() < deadline:
        time.sleep(0.1)
    assert f"replica 0 (pid {pid}, {url}) exited" in server.log()
    for i in range(4):  # the same prefix included: it went to either replica
        out = client.completions.create(model="tiny", prompt=PREFIX + f"After {i}", max_tokens=2)
        assert len(out.choices) == 1
