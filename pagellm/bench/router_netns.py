"""`pagellm bench router --setup netns_*`: the two replicas as two hosts. Each runs in a Linux network
namespace of its own, joined to this one by a veth pair (a /30 each), on one core; vllm-router runs
here and reaches them over those links, as it would reach replicas on other machines. Needs root and
`ip` (iproute2); the namespaces are removed afterwards."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import IO, Any

from pagellm.bench import BenchError
from pagellm.bench.servers import free_port

REPLICA_PORT = 8000


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise BenchError(f"`ip {' '.join(args)}` failed: {r.stderr.strip()}")


def make_hosts(n: int, tag: str) -> list[tuple[str, str]]:
    """``n`` namespaces, each joined to this one by a veth pair: (namespace, its address)."""
    if shutil.which("ip") is None or os.geteuid() != 0:
        raise BenchError("the netns setups need root and `ip` (iproute2): run as root, or leave them out")
    hosts = []
    for i in range(n):
        ns, here, there = f"pgl{tag}h{i}", f"pgl{tag}a{i}", f"pgl{tag}b{i}"
        near, far = f"10.231.{i}.1", f"10.231.{i}.2"
        _ip("netns", "add", ns)
        _ip("link", "add", here, "type", "veth", "peer", "name", there)
        _ip("link", "set", there, "netns", ns)
        _ip("addr", "add", f"{near}/30", "dev", here)
        _ip("link", "set", here, "up")
        _ip("netns", "exec", ns, "ip", "addr", "add", f"{far}/30", "dev", there)
        _ip("netns", "exec", ns, "ip", "link", "set", there, "up")
        _ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
        hosts.append((ns, far))
    return hosts


def remove_hosts(hosts: Sequence[tuple[str, str]]) -> None:
    for ns, _ in hosts:  # the veth pair goes with its namespace
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _pin(core: int) -> Callable[[], None]:
    def pin() -> None:
        os.sched_setaffinity(0, {core})
    return pin


def launch_netns(policy: str, model: str, blocks: int, port: int, out: IO[bytes],
                 serve_cmd: Callable[..., list[str]]) -> tuple[subprocess.Popen, list[str], list[subprocess.Popen],
                                                              Callable[[], None]]:
    """Two replicas in two namespaces, one core each, and the router here on ``port``."""
    hosts = make_hosts(2, str(os.getpid() % 10000))
    cores = sorted(os.sched_getaffinity(0))
    procs: list[subprocess.Popen] = []
    urls = []
    try:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        for i, (ns, addr) in enumerate(hosts):
            cmd = serve_cmd(model, REPLICA_PORT, blocks, ["--host", addr])
            procs.append(subprocess.Popen(["ip", "netns", "exec", ns, *cmd], stdout=out, stderr=subprocess.STDOUT,
                                          env=env, preexec_fn=_pin(cores[i % len(cores)])))
            urls.append(f"http://{addr}:{REPLICA_PORT}")
        router = subprocess.Popen([sys.executable, "-m", "vllm_router.launch_router", "--host", "127.0.0.1",
                                   "--port", str(port), "--worker-urls", *urls, "--policy", policy,
                                   "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                                   "--log-level", "warning"], stdout=out, stderr=subprocess.STDOUT)
    except BaseException:
        for p in procs:
            p.kill()
        remove_hosts(hosts)
        raise
    procs.insert(0, router)

    def cleanup(*_: Any) -> None:
        remove_hosts(hosts)
    return router, urls, procs, cleanup
