"""The flags of ``pagellm serve`` (vLLM's names), kept apart from the server so that building the
parser imports neither torch nor FastAPI."""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import socket
from typing import Any

from pagellm.config import EngineArgs

logger = logging.getLogger("pagellm.server")

DEFAULT_MAX_BODY = "1MiB"
# --tool-call-parser's choices (tool_parsers.TOOL_PARSERS, named here so that --help imports nothing).
TOOL_CALL_PARSERS = ("auto", "generic", "hermes", "qwen", "qwen3_coder", "llama3_json", "mistral", "pythonic")
# --reasoning-parser's choices (reasoning_parsers.REASONING_PARSERS).
REASONING_PARSERS = ("qwen3", "deepseek_r1", "think")
# --metrics-prefix's choices (engine/metric_families.METRICS_PREFIXES; named here for the same reason).
METRICS_PREFIXES = ("vllm", "pagellm", "both")
# --router-policy's choices (data_parallel.ROUTER_POLICIES; vllm-router's --policy).
ROUTER_POLICIES = ("cache_aware", "consistent_hash", "power_of_two", "round_robin", "random")
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
                   help="a GGUF file or a Hugging Face model folder (same as --model); none: the embedded default, "
                        "SmolLM2-135M-Instruct's Q4_1 GGUF (`pagellm default-model` prints its path)")
    EngineArgs.add_cli_args(p)
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to bind")
    s.add_argument("--port", type=int, default=8000, help="port to bind; checked before the model loads")
    s.add_argument("--api-key", nargs="+", action="extend", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every route but /health and /get_load; several "
                        "keys are each accepted (default: $PAGELLM_API_KEY, else $VLLM_API_KEY, else no key)")
    s.add_argument("--chat-template", default=None,
                   help="a Jinja chat template, or the path of a file holding one, used instead of the "
                        "tokenizer's own (default: the tokenizer's)")
    s.add_argument("--chat-template-content-format", default="auto", choices=("auto", "string", "openai"),
                   help="how the chat template reads a message's content: string (text parts joined by newlines), "
                        "openai (a list of {'type': 'text', 'text': ...} parts), or auto: openai where the template "
                        "loops over a message's content, else string (as vLLM)")
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted as vLLM's; tool_choice 'auto' (the default when tools are given) works without it")
    s.add_argument("--tool-call-parser", default="auto", choices=TOOL_CALL_PARSERS,
                   help="the model's tool-call format: auto (the one its chat template speaks; generic where the "
                        "template renders no tools: the tools go into the system prompt and a grammar holds the "
                        "answer to text or <tool_call> JSON calls), hermes (and qwen: <tool_call> JSON), "
                        "qwen3_coder (XML), llama3_json, mistral, pythonic (Llama 3.2 and 4)")
    s.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                   help="split a reasoning model's thinking (<think>...</think>) from its answer into "
                        "reasoning_content; structured outputs and tool calls then hold only the answer")
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
    s.add_argument("--metrics-prefix", default="both", choices=METRICS_PREFIXES,
                   help="the names GET /metrics exposes: vLLM's (vllm:num_requests_running, ..., with its labels "
                        "model_name and engine and its buckets, for vLLM's Grafana dashboard, KEDA scalers and "
                        "the Gateway API inference extension), pagellm's own (pagellm_...), or both")
    s.add_argument("--disable-dashboard", action="store_true",
                   help="do not serve the live KV cache dashboard (GET /dashboard) nor its state "
                        "(GET /v1/kv_cache/state)")
    s.add_argument("--enable-fastapi-docs", action="store_true",
                   help="serve FastAPI's interactive API pages /docs (Swagger UI) and /redoc; off by "
                        "default because they load their scripts from a CDN (jsdelivr). /openapi.json is "
                        "always served")
    s.add_argument("--disable-log-requests", action="store_true",
                   help="do not log requests (the default; vLLM's older flag)")
    s.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction, default=False,
                   help="log each request as it arrives: its id, prompt (up to --max-log-len), token ids and sampling "
                        "parameters")
    s.add_argument("--max-log-len", type=int, default=None,
                   help="with --enable-log-requests: the most prompt characters and token ids logged per request "
                        "(default: all)")
    s.add_argument("--disable-uvicorn-access-log", action="store_true",
                   help="no access log line per HTTP request (uvicorn logs them at info: --uvicorn-log-level info)")
    s.add_argument("--response-role", default="assistant",
                   help="the role of chat responses' messages (with add_generation_prompt false: the last message's)")
    s.add_argument("--strict-requests", action="store_true",
                   help="answer 400 to a request with a field no OpenAI or vLLM body defines (default: such fields "
                        "are ignored, with one warning per request naming them, as vLLM does)")
    s.add_argument("--root-path", default=None,
                   help="the path prefix a proxy serves this server under, e.g. /llm (FastAPI's root_path: requests "
                        "come with or without it; the OpenAPI schema names it) (default: none)")
    s.add_argument("--responses-store-max-responses", type=int, default=1024,
                   help="the Responses API's store (store: true, for GET /v1/responses/{id} and previous_response_id) "
                        "keeps at most this many responses in memory, the least recently used going first")
    s.add_argument("--responses-store-max-bytes", default="256MiB",
                   help="and at most this much of their JSON text in all")
    d = p.add_argument_group("data parallelism (replicas behind vLLM's router, vllm-router)")
    d.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="replica servers to run, each on its share of the cores (CPU affinity and OMP_NUM_THREADS) "
                        "and an internal port, behind vllm-router on --host/--port; every other flag applies to "
                        "each replica (--kv-cache-memory is per replica). Needs: pip install vllm-router")
    d.add_argument("--router-policy", default="cache_aware", choices=ROUTER_POLICIES,
                   help="with --data-parallel-size > 1: how the router picks a replica: cache_aware (the one whose "
                        "cached prefixes match the prompt most, unless the loads are too uneven), consistent_hash, "
                        "power_of_two (the less loaded of two, by GET /get_load), round_robin, random")
    s.add_argument("--lora-modules", nargs="+", action="extend", default=None, metavar="NAME=PATH",
                   help="LoRA adapters served beside the model (with --enable-lora): each name=path (a PEFT folder "
                        "or hub id) or vLLM's JSON {\"name\": ..., \"path\": ...}; a request picks one by its model "
                        "field. VLLM_ALLOW_RUNTIME_LORA_UPDATING=True also serves /v1/load_lora_adapter and "
                        "/v1/unload_lora_adapter")
    t = p.add_argument_group("HTTPS (vLLM's flags, through uvicorn)")
    t.add_argument("--ssl-keyfile", default=None, help="serve HTTPS: the private key (PEM), with --ssl-certfile")
    t.add_argument("--ssl-certfile", default=None, help="serve HTTPS: the certificate chain (PEM), with --ssl-keyfile")
    t.add_argument("--ssl-ca-certs", default=None, help="CA certificates (PEM) that client certificates are checked "
                                                        "against (with --ssl-cert-reqs)")
    t.add_argument("--ssl-cert-reqs", type=int, default=0, choices=(0, 1, 2),
                   help="client certificates: 0 not asked for, 1 checked if sent, 2 required (Python's ssl.CERT_*)")
    v = p.add_argument_group("vLLM's server flags that change nothing here (each logs why once)")
    v.add_argument("--disable-frontend-multiprocessing", action="store_true",
                   help="the HTTP server and the engine always share one process here")
    v.add_argument("--disable-fastapi-docs", action="store_true",
                   help="the /docs and /redoc pages are off unless --enable-fastapi-docs asks for them")
    p.add_argument("--config", default=None, metavar="YAML",
                   help="a YAML file of flags, as vLLM's: keys are flag names without the leading dashes "
                        "(port: 8000, max-model-len or max_model_len: 4096, enforce-eager: true); flags on the "
                        "command line win over the file's (default: none)")
    p.set_defaults(func=_run)
    return p


# vLLM's server flags that change nothing here: attribute -> why (logged once when given).
IGNORED_SERVER_FLAGS = {
    "disable_frontend_multiprocessing": "the HTTP server and the engine share one process in pagellm",
    "disable_fastapi_docs": "/docs and /redoc are off by default in pagellm (--enable-fastapi-docs serves them)",
}


def log_ignored_server_flags(args: argparse.Namespace) -> None:
    """One line for each of vLLM's server flags given that changes nothing here."""
    for attr, why in IGNORED_SERVER_FLAGS.items():
        if getattr(args, attr, False):
            logger.info("--%s has no effect: %s", attr.replace("_", "-"), why)


def check_server_flags(args: argparse.Namespace) -> None:
    """ValueError naming the flag for a server setting that cannot work, before anything loads."""
    if args.enable_fastapi_docs and args.disable_fastapi_docs:
        raise ValueError("--enable-fastapi-docs and --disable-fastapi-docs contradict each other: give one")
    if args.enable_log_requests and args.disable_log_requests:
        raise ValueError("--enable-log-requests and --disable-log-requests contradict each other: give one")
    if args.max_log_len is not None and args.max_log_len < 0:
        raise ValueError(f"--max-log-len must be an integer >= 0, got {args.max_log_len}")
    if not args.response_role.strip():
        raise ValueError("--response-role must be a role name such as assistant, got an empty string")
    root = args.root_path
    if root is not None and (not root.startswith("/") or (root.endswith("/") and root != "/")):
        raise ValueError(f"--root-path must be a path starting with '/' and not ending with one, like /llm; "
                         f"got {root!r}")
    check_ssl_files(args.ssl_keyfile, args.ssl_certfile, args.ssl_ca_certs, args.ssl_cert_reqs)


def check_ssl_files(keyfile: str | None, certfile: str | None, ca_certs: str | None, cert_reqs: int) -> None:
    """The HTTPS flags: both files or neither, readable, a key that matches its certificate."""
    import ssl

    if (keyfile is None) != (certfile is None):
        raise ValueError("HTTPS needs both --ssl-keyfile and --ssl-certfile (the private key and its certificate); "
                         f"only {'--ssl-keyfile' if keyfile else '--ssl-certfile'} was given")
    if keyfile is None:
        if ca_certs is not None or cert_reqs:
            raise ValueError("--ssl-ca-certs and --ssl-cert-reqs check client certificates over HTTPS: give "
                             "--ssl-keyfile and --ssl-certfile too")
        return
    for flag, path in (("--ssl-keyfile", keyfile), ("--ssl-certfile", certfile), ("--ssl-ca-certs", ca_certs)):
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"{flag} {path!r} is not a file")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(certfile, keyfile)  # type: ignore[arg-type]
    except ssl.SSLError as e:
        raise ValueError(f"--ssl-certfile {certfile!r} and --ssl-keyfile {keyfile!r} do not load as a PEM "
                         f"certificate and its private key ({e.reason or e})") from None
    if ca_certs is not None:
        try:
            context.load_verify_locations(ca_certs)
        except ssl.SSLError as e:
            raise ValueError(f"--ssl-ca-certs {ca_certs!r} does not load as PEM CA certificates ({e.reason or e})"
                             ) from None
    if cert_reqs and ca_certs is None:
        raise ValueError("--ssl-cert-reqs 1 or 2 checks client certificates against --ssl-ca-certs: give it too")


def _run(args: argparse.Namespace) -> Any:
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in [1, 65535], got {args.port}")
    check_server_flags(args)
    if args.data_parallel_size != 1:
        return _run_data_parallel(args)
    # The port is taken before anything loads (the server stack, torch, the model): a port in use is
    # reported at once, not after a long load.
    sock = bind_socket(args.host, args.port)
    log_ignored_server_flags(args)
    if args.api_key is None:
        args.api_key = api_keys_from_env()
    # The server stack (FastAPI, torch) once the flags are checked: `serve --help` imports neither.
    from pagellm.entrypoints.openai.api_server import run_server

    return run_server(args, sock)


def _run_data_parallel(args: argparse.Namespace) -> Any:
    if args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
    if args.ssl_certfile:
        raise ValueError("--data-parallel-size > 1 with --ssl-*: the router in front serves plain HTTP here; "
                         "terminate TLS in front of it")
    bind_socket(args.host, args.port).close()  # a port in use is reported before the replicas load
    if args.api_key is None:
        args.api_key = api_keys_from_env()
    from pagellm.entrypoints.openai.data_parallel import run_data_parallel

    return run_data_parallel(args)


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

