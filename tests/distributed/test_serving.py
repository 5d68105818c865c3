"""The OpenAI server over tensor-parallel ranks: in one host (a killed worker takes the server down,
non-zero, instead of hanging it) and across two hosts, two Linux network namespaces joined by a veth
pair, one rank in each, talking TCP over the veth addresses."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import openai
import pytest

from pagellm import LLM, SamplingParams
from pagellm.entrypoints.openai.launch import free_port
from tests.entrypoints.openai.server_utils import RemoteServer

PROMPT = "The capital of France is"


def greedy_text(path: Path, n: int = 12) -> str:
    llm = LLM(str(path), dtype="float32", max_model_len=256, num_kv_blocks=64)
    return llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=n), use_tqdm=False)[0].outputs[0].text


@pytest.mark.slow
def test_server_over_two_ranks_answers_and_dies_loudly_with_a_worker(llama_path):
    want = greedy_text(llama_path)
    srv = RemoteServer(llama_path, ["--tensor-parallel-size", "2", "--dtype", "float32", "--max-model-len", "256",
                                    "--num-kv-blocks", "64"])
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        r = client.completions.create(model=str(llama_path), prompt=PROMPT, max_tokens=12, temperature=0)
        assert r.choices[0].text == want
        workers = subprocess.run(["pgrep", "-P", str(srv.proc.pid), "-f", "pagellm.engine.tp_worker"],
                                 capture_output=True, text=True).stdout.split()
        assert len(workers) == 1, workers
        os.kill(int(workers[0]), signal.SIGKILL)
        with pytest.raises(openai.APIError):
            client.completions.create(model=str(llama_path), prompt=PROMPT, max_tokens=4, timeout=60)
        assert srv.proc.wait(timeout=60) != 0
        assert "worker rank 1" in srv.log() and "exited with code -9" in srv.log()
    finally:
        srv.stop()


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture
def two_hosts():
    """Two network namespaces joined by a veth pair: (name, address, interface) of each."""
    if shutil.which("ip") is None or os.geteuid() != 0:
        pytest.skip("two hosts on one machine need `ip` and root (Linux network namespaces)")
    tag = uuid.uuid4().hex[:6]
    hosts = [(f"pgl-{tag}-a", "10.231.7.1", f"pga{tag}"), (f"pgl-{tag}-b", "10.231.7.2", f"pgb{tag}")]
    try:
        for ns, _, _ in hosts:
            _ip("netns", "add", ns)
        _ip("link", "add", hosts[0][2], "type", "veth", "peer", "name", hosts[1][2])
        for ns, addr, dev in hosts:
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
    except subprocess.CalledProcessError as e:
        for ns, _, _ in hosts:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        pytest.skip(f"cannot create network namespaces here: {e.stderr.decode().strip()}")
    yield hosts
    for ns, _, _ in hosts:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)  # takes its end of the veth along


@pytest.mark.slow
def test_two_hosts_one_rank_each(two_hosts, llama_path, tmp_path):
    (ns_a, addr_a, dev_a), (ns_b, _, dev_b) = two_hosts
    want = greedy_text(llama_path)
    master_port, http_port = str(free_port()), str(free_port())
    common = [sys.executable, "-m", "pagellm.entrypoints.cli", "serve", str(llama_path), "--tensor-parallel-size", "2",
              "--nnodes", "2", "--master-addr", addr_a, "--master-port", master_port, "--dtype", "float32",
              "--max-model-len", "256", "--num-kv-blocks", "64"]

    def start(ns: str, dev: str, extra: list[str], log: Path) -> subprocess.Popen:
        # gloo finds its own address on the named interface (by default it resolves the hostname).
        cmd = ["ip", "netns", "exec", ns, "env", f"GLOO_SOCKET_IFNAME={dev}", *common, *extra]
        return subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT)

    node0 = start(ns_a, dev_a, ["--node-rank", "0", "--port", http_port], tmp_path / "node0.log")
    node1 = start(ns_b, dev_b, ["--node-rank", "1", "--port", http_port], tmp_path / "node1.log")
    try:
        client = (f"import openai, time\n"
                  f"c = openai.OpenAI(base_url='http://127.0.0.1:{http_port}/v1', api_key='none', max_retries=0)\n"
                  f"for _ in range(600):\n"
                  f"    try:\n"
                  f"        r = c.completions.create(model={str(llama_path)!r}, prompt={PROMPT!r}, max_tokens=12, "
                  f"temperature=0)\n"
                  f"        break\n"
                  f"    except openai.APIConnectionError:\n"
                  f"        time.sleep(0.2)\n"
                  f"print(repr(r.choices[0].text))\n")
        out = subprocess.run(["ip", "netns", "exec", ns_a, sys.executable, "-c", client], capture_output=True,
                             text=True, timeout=180)
        logs = "".join((tmp_path / f"node{i}.log").read_text() for i in (0, 1))
        assert out.returncode == 0, out.stderr + logs
        assert out.stdout.strip() == repr(want)
        node0.send_signal(signal.SIGTERM)
        assert node0.wait(timeout=60) == 0
        assert node1.wait(timeout=60) == 0  # the driver's stop reached the other host
        assert "node 1 of 2" in (tmp_path / "node1.log").read_text()
    finally:
        for p in (node0, node1):
            if p.poll() is None:
                p.kill()
                p.wait()
