"""The flags of ``pagellm serve`` (vLLM's names), kept apart from the server so that building the
parser imports neither torch nor FastAPI."""

from __future__ import annotations

import argparse
import errno
import json
import os
import socket
from typing import Any

from pagellm.config import EngineArgs

DEFAULT_MAX_BODY = "1MiB"
# --tool-call-parser's choices (tool_parsers.TOOL_PARSERS, named here so that --help imports nothing).
TOOL_CALL_PARSERS = ("hermes", "qwen", "llama3_json", "mistral")
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def json_list(value: str) -> list[str]:
    """vLLM's list flags take JSON (``'["http://a.example"]'``); a bare value is a list of one."""
    text = value.strip()
    if text.startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not a JSON list: {e}") from None
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise argparse.ArgumentTypeError("must be a JSON list of strings")
        return items
    return [text]


def api_keys_from_env() -> list[str] | None:
    """``$PAGELLM_API_KEY``, else vLLM's ``$VLLM_API_KEY`` (None: no key required)."""
    key = os.environ.get("PAGELLM_API_KEY") or os.environ.get("VLLM_API_KEY")
    return [key] if key else None


def add_serve_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="serve the OpenAI-compatible API")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="model folder (same as --model); none: the embedded default")
    EngineArgs.add_cli_args(p)
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to bind")
    s.add_argument("--port", type=int, default=8000, help="port to bind; checked before the model loads")
    s.add_argument("--api-key", nargs="+", action="extend", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every route but /health; several keys are each "
                        "accepted (default: $PAGELLM_API_KEY, else $VLLM_API_KEY, else no key)")
    s.add_argument("--chat-template", default=None,
                   help="a Jinja chat template, or the path of a file holding one, used instead of the "
                        "tokenizer's own (default: the tokenizer's)")
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="let tool_choice 'auto' (the default when tools are given) read tool calls from the output "
                        "with --tool-call-parser; 'required' and named functions need neither flag")
    s.add_argument("--tool-call-parser", default=None, choices=TOOL_CALL_PARSERS,
                   help="the model's tool-call format: hermes (and qwen: <tool_call> JSON), llama3_json, mistral")
    s.add_argument("--max-waiting-requests", type=int, default=1024,
                   help="beyond this many queued requests, answer 503 with Retry-After")
    s.add_argument("--max-request-body-size", default=DEFAULT_MAX_BODY, help="largest request body (413 above)")
    s.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds running requests get to finish after SIGTERM before they are aborted")
    s.add_argument("--timeout-keep-alive", type=float, default=5.0,
                   help="seconds an idle keep-alive connection is held open (vLLM's flag)")
    s.add_argument("--body-read-timeout", type=float, default=30.0,
                   help="seconds a client may take to send a request's headers (else the connection is closed) "
                        "and then its body (else a 408)")
    s.add_argument("--allowed-origins", type=json_list, default=None,
                   help="CORS: origins allowed to call the API from a browser, a JSON list such as "
                        "'[\"https://app.example\"]' or '[\"*\"]' (default: none, CORS off)")
    s.add_argument("--allowed-methods", type=json_list, default=["*"],
                   help="CORS: methods allowed with --allowed-origins, a JSON list")
    s.add_argument("--allowed-headers", type=json_list, default=["*"],
                   help="CORS: headers allowed with --allowed-origins, a JSON list")
    s.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    s.add_argument("--uvicorn-log-level", default="warning", choices=UVICORN_LOG_LEVELS,
                   help="uvicorn's own log level")
    s.add_argument("--disable-dashboard", action="store_true",
                   help="do not serve the live KV cache dashboard (GET /dashboard) nor its state "
                        "(GET /v1/kv_cache/state)")
    s.add_argument("--disable-log-requests", action="store_true",
                   help="accepted for vLLM scripts: pagellm does not log request contents")
    p.set_defaults(func=_run)
    return p


def _run(args: argparse.Namespace) -> Any:
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in [1, 65535], got {args.port}")
    # The port is taken before anything loads (the server stack, torch, the model): a port in use is
    # reported at once, not after a long load.
    sock = bind_socket(args.host, args.port)
    from pagellm.entrypoints.openai.api_server import run_server

    return run_server(args, sock)


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening socket on (host, port); ValueError naming the port and the flag when it is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: restart over TIME_WAIT
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ValueError(f"port {port} on {host} is already in use: stop what holds it, or choose another "
                             "port with --port") from e
        raise ValueError(f"cannot listen on {host}:{port} ({e.strerror}): check --host and --port") from e
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock

