"""The Dockerfile's instructions, read without Docker; and, run as a script, the image's command in this
Python environment: no Docker engine runs on the project's machines, so `.ci/check-plain-install`
starts what the image's ENTRYPOINT and CMD start, with its ENV, in a fresh venv installed as the image
is, and checks it with the image's own HEALTHCHECK command.

    python tests/deploy/dockerfile.py ROOT [DEPLOYMENT]

ROOT: the checkout holding the Dockerfile; DEPLOYMENT: a Deployment manifest whose container args to
append to the ENTRYPOINT instead of the CMD, as Kubernetes does. It runs in the plain install's venv:
the standard library and PyYAML (a dependency of transformers) only.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order: continuation lines joined, comments and blank lines dropped."""
    result: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1].strip() + " "
            continue
        line = pending + line
        pending = ""
        word, _, rest = line.partition(" ")
        result.append((word.upper(), rest.strip()))
    return result


def exec_form(arguments: str) -> list[str]:
    """The JSON array of an exec-form ENTRYPOINT / CMD (shell form is refused: signals would go to a shell)."""
    value = json.loads(arguments)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"not an exec-form JSON array: {arguments}")
    return value


def last(path: Path, name: str) -> str:
    values = [rest for word, rest in instructions(path) if word == name]
    if not values:
        raise ValueError(f"{path} has no {name}")
    return values[-1]


def command(path: Path, args: list[str] | None = None) -> list[str]:
    """What the container runs: ENTRYPOINT followed by ``args`` (a Deployment's ``args``, the words after
    the image name in ``docker run``), else by CMD where there is one."""
    if args is None:
        has_cmd = any(word == "CMD" for word, _ in instructions(path))
        args = exec_form(last(path, "CMD")) if has_cmd else []
    return exec_form(last(path, "ENTRYPOINT")) + args


def environment(path: Path) -> dict[str, str]:
    """The ENV instructions' variables (KEY=VALUE form)."""
    env: dict[str, str] = {}
    for word, rest in instructions(path):
        if word == "ENV":
            for pair in shlex.split(rest):
                key, _, value = pair.partition("=")
                env[key] = value
    return env


def healthcheck(path: Path) -> tuple[dict[str, str], list[str]]:
    """The HEALTHCHECK's options (``--interval`` -> ``30s``) and its exec-form command."""
    rest = last(path, "HEALTHCHECK")
    options: dict[str, str] = {}
    while rest.startswith("--"):
        option, _, rest = rest.partition(" ")
        key, _, value = option.partition("=")
        options[key] = value
        rest = rest.lstrip()
    word, _, arguments = rest.partition(" ")
    if word.upper() != "CMD":
        raise ValueError(f"HEALTHCHECK without an exec-form CMD: {rest}")
    return options, exec_form(arguments)


def with_port(argv: list[str], old: int, new: int) -> list[str]:
    """``argv`` with port ``old`` replaced by ``new``, as a flag value or inside a URL."""
    return [str(new) if a == str(old) else a.replace(f":{old}/", f":{new}/") for a in argv]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deployment_args(manifest: Path) -> list[str]:
    """The first container's args of the Deployment in ``manifest``."""
    import yaml

    deployment = next(d for d in yaml.safe_load_all(manifest.read_text()) if d and d.get("kind") == "Deployment")
    return [str(a) for a in deployment["spec"]["template"]["spec"]["containers"][0].get("args", [])]


def run_image_command(root: Path, args: list[str] | None = None, timeout: float = 600.0) -> None:
    """Start the image's command (its ENTRYPOINT, then ``args`` or its CMD; on a free port instead of
    the image's; with the image's ENV but for $PAGELLM_CACHE_DIR and $HF_HOME, which stay the caller's),
    wait until the image's HEALTHCHECK command passes, send a completion with the API key from
    $PAGELLM_API_KEY, as the Deployment does, check that one without it is refused, then SIGTERM it and
    expect exit status 0."""
    dockerfile = root / "Dockerfile"
    argv = command(dockerfile, args)
    port = int(argv[argv.index("--port") + 1])
    new_port = _free_port()
    argv = with_port(argv, port, new_port)
    _, probe = healthcheck(dockerfile)
    probe = with_port(probe, port, new_port)
    key = "plain-install-check-key"
    env = {**os.environ, **{k: v for k, v in environment(dockerfile).items()
                            if k not in ("PAGELLM_CACHE_DIR", "HF_HOME")}, "PAGELLM_API_KEY": key}
    # The venv's commands first, as they are on the image's PATH.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    print("image command:", shlex.join(argv), flush=True)
    server = subprocess.Popen(argv, env=env)
    try:
        deadline = time.monotonic() + timeout
        while subprocess.run(probe, env=env, capture_output=True).returncode != 0:
            if server.poll() is not None:
                raise SystemExit(f"the image's command exited with {server.returncode} before its health check passed")
            if time.monotonic() > deadline:
                raise SystemExit(f"the image's HEALTHCHECK did not pass within {timeout:.0f} s")
            time.sleep(1)
        body = json.dumps({"prompt": "Hello", "max_tokens": 4}).encode()
        url = f"http://127.0.0.1:{new_port}/v1/completions"
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
        answer = json.load(urllib.request.urlopen(urllib.request.Request(url, body, headers), timeout=60))
        assert answer["usage"]["completion_tokens"] == 4, answer
        try:
            urllib.request.urlopen(urllib.request.Request(url, body, {"Content-Type": "application/json"}), timeout=60)
            raise SystemExit("a request without the API key was answered")
        except urllib.error.HTTPError as e:
            assert e.code == 401, e.code
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=60)
        if code != 0:
            raise SystemExit(f"the image's command exited with {code} after SIGTERM")
    finally:
        if server.poll() is None:
            server.kill()
    print("image command: healthy under its HEALTHCHECK, answered with the API key, exited 0 on SIGTERM")


if __name__ == "__main__":
    run_image_command(Path(sys.argv[1]), deployment_args(Path(sys.argv[2])) if len(sys.argv) > 2 else None)
