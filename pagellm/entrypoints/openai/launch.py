"""Start-up helpers for running `pagellm serve` as a child process (benchmarks, tests)."""

from __future__ import annotations

import socket
import ssl
import subprocess
import time

import httpx


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 180.0,
                 verify: bool | ssl.SSLContext = True) -> None:
    """Wait until ``url``/health answers 200; RuntimeError if the process dies or time runs out.
    ``verify``: httpx's (for an HTTPS server, a context trusting its certificate)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode} during start-up")
        try:
            if httpx.get(url + "/health", timeout=1, verify=verify).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.terminate()
    raise RuntimeError(f"the server at {url} did not become healthy within {timeout:.0f} s")
