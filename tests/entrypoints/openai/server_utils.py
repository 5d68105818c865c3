"""Start the real `pagellm serve` as a subprocess on 127.0.0.1 and wait until it answers."""

from __future__ import annotations

import os
import re
import signal
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pagellm.entrypoints.openai.launch import free_port, wait_healthy
from pagellm.model.default_model import DEFAULT_MODEL_INSTALL, embedded_gguf_path


class RemoteServer:
    """``verify``: an HTTPS server's certificate file (the server then runs with --ssl-* flags in ``args``)."""

    def __init__(self, model: Path, args: list[str], api_key: str | None = None, timeout: float = 120,
                 verify: str | None = None) -> None:
        self.port = free_port()
        self.api_key = api_key
        self.url = f"{'https' if verify else 'http'}://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "pagellm.entrypoints.cli", "serve", str(model), "--port", str(self.port), *args]
        if api_key:
            cmd += ["--api-key", api_key]
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"pagellm-server-{self.port}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (open while the server runs; closed by stop())
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(self.url, self.proc, timeout, verify=ssl.create_default_context(cafile=verify) if verify
                         else True)
        except RuntimeError as e:
            self.stop()
            raise RuntimeError(f"{e}:\n{self.log()}") from e

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def metric(self, name: str, labels: str = "") -> float:
        text = httpx.get(self.url + "/metrics", headers=self.headers, timeout=5).text
        pattern = rf"^{re.escape(name)}\{{[^}}]*{re.escape(labels)}[^}}]*\}} (\S+)$"
        values = [float(m.group(1)) for m in re.finditer(pattern, text, re.MULTILINE)]
        return sum(values)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


# The embedded SmolLM2-135M-Instruct served as a user starts it, with no tool flags (its template
# renders no tools: the generic format), for the structured-output and tool tests of the real model.
SMOLLM2_NAME = "smollm2"
needs_smollm2 = pytest.mark.skipif(embedded_gguf_path() is None,
                                   reason=f"the embedded model wheel is missing: {DEFAULT_MODEL_INSTALL}")


def smollm2_tool_server() -> Iterator[RemoteServer]:
    """A module fixture's body: the server, stopped cleanly after the module."""
    path = embedded_gguf_path()
    assert path is not None
    srv = RemoteServer(path, ["--served-model-name", SMOLLM2_NAME, "--max-model-len", "2048"])
    yield srv
    assert srv.stop() == 0
