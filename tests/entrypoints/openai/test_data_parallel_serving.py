"""`pagellm serve --data-parallel-size 2` for real: two replicas behind vllm-router (a peer: `make
test-peers`), driven with the `openai` client through the router."""

from __future__ import annotations

import asyncio
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


def load(url: str) -> int:
    return httpx.get(url + "/get_load", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10).json()["load"]


def test_a_dead_replica_loses_only_its_requests(server):
    """SIGKILL to a replica mid-run: the requests it held fail, the other's finish, and later requests
    are all served by the replica left."""
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    (pid, url), (_, other) = replicas(server)

    async def one(i: int) -> bool:
        try:
            # Prompts that differ from their first letter: cache_aware spreads them over both replicas.
            prompt = f"{'ABCDEFGH'[i]} request {i} " * (1 + i)
            await client.completions.create(model="tiny", prompt=prompt, max_tokens=600,
                                            extra_body={"ignore_eos": True})
            return True
        except openai.APIError:
            return False

    async def run() -> tuple[int, list[bool]]:
        tasks = [asyncio.create_task(one(i)) for i in range(8)]
        deadline = time.time() + 30
        while load(url) + load(other) < 8 and time.time() < deadline:  # every request at a replica
            await asyncio.sleep(0.05)
        held = load(url)
        os.kill(pid, signal.SIGKILL)
        return held, list(await asyncio.gather(*tasks))

    held, ok = asyncio.run(run())
    assert 0 < held < 8, held  # cache_aware spread the distinct prompts over both
    assert ok.count(False) <= held and ok.count(True) >= 8 - held, (held, ok)
    deadline = time.time() + 10
    while "replica 0 (pid" not in server.log() and time.time() < deadline:
        time.sleep(0.1)
    assert f"replica 0 (pid {pid}, {url}) exited" in server.log()
    sync = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    for i in range(4):  # the long prefix included: its replica may be the one gone
        out = sync.completions.create(model="tiny", prompt=PREFIX + f"After {i}", max_tokens=2)
        assert len(out.choices) == 1
