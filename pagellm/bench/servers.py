"""Starting the servers `pagellm bench serve` loads as child processes: a free port and a readiness wait.

The bench's own, below the entrypoints: ``pagellm.entrypoints.cli`` imports the bench commands, so the
bench imports nothing of ``pagellm.entrypoints`` (the server it launches is a command line, not an import).
"""

from __future__ import annotations

import socket
import subprocess
import time

import httpx


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 180.0) -> None:
    """Wait until ``url``/health answers 200 (a server still loading its model answers 503 or not at all);
    RuntimeError if the process dies or time runs out."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode} during start-up")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.terminate()
    raise RuntimeError(f"the server at {url} did not become healthy within {timeout:.0f} s")
