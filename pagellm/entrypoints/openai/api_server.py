"""`pagellm serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn)."""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import contextlib
import hmac
import logging
import math
import re
import signal
import socket
import time
import warnings
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pydantic_core
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ValidationError
from starlette._utils import get_route_path
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import pagellm
from pagellm.config import EngineArgs, parse_memory
from pagellm.engine.async_engine import AsyncLLMEngine
from pagellm.engine.llm_engine import LLMEngine
from pagellm.engine.metrics import EngineMetrics
from pagellm.engine.phases import log_ready
from pagellm.engine.stats_logger import StatsLogger
from pagellm.entrypoints.openai.anthropic_protocol import (
    CountTokensRequest,
    MessagesRequest,
    anthropic_error_body,
    is_anthropic_path,
)
from pagellm.entrypoints.openai.chat_prompt import load_chat_template, template_options
from pagellm.entrypoints.openai.errors import APIError, error_body, error_response, from_validation_error
from pagellm.entrypoints.openai.http_protocol import with_head_timeout
from pagellm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from pagellm.entrypoints.openai.responses_protocol import ResponsesRequest
from pagellm.entrypoints.openai.responses_store import ResponsesStore
from pagellm.entrypoints.openai.routes import no_such_route, served_routes
from pagellm.entrypoints.openai.serving import ChatOptions, RequestLogging
from pagellm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagellm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagellm.entrypoints.openai.serving_dashboard import BROWSER_PATHS, Dashboard, add_dashboard_routes
from pagellm.entrypoints.openai.serving_lora import adapter_cards, add_lora_routes, register_lora_modules
from pagellm.entrypoints.openai.serving_messages import add_messages_routes
from pagellm.entrypoints.openai.serving_pooling import add_pooling_refusals, pooling_task, run_pooling_server
from pagellm.entrypoints.openai.serving_responses import OpenAIServingResponses, add_responses_routes
from pagellm.entrypoints.openai.tolerance import log_dropped, relax
from pagellm.entrypoints.openai.worker_routes import KEYLESS_ROUTES, add_worker_routes
from pagellm.text import plural

logger = logging.getLogger("pagellm.server")

M = TypeVar("M", bound=BaseModel)


class BodyTooLarge(Exception):
    pass


class BodyReadTimeout(Exception):
    pass


class GuardMiddleware:
    """API key check (constant-time) on every route but /health and /get_load, a request-body size limit, and a
    deadline for the body (a client trickling it in holds a connection, not the server).

    The key comes as ``Authorization: Bearer KEY`` or, as Anthropic's clients send it, ``x-api-key: KEY``;
    on the Messages routes the errors take Anthropic's shape.

    Under ``browser_paths`` (the dashboard) the key may also come as the password of HTTP Basic
    credentials, which a browser asks its user for and then sends with every request of the page.

    Plain ASGI rather than a BaseHTTPMiddleware, so handlers still see client disconnects.
    """

    def __init__(self, app: ASGIApp, api_keys: Sequence[str] = (), max_body_bytes: int = 2**20,
                 body_read_timeout: float = math.inf, browser_paths: Sequence[str] = ()) -> None:
        self.app = app
        self.api_keys = [key.encode() for key in api_keys]
        self.max_body_bytes = max_body_bytes
        self.body_read_timeout = body_read_timeout
        self.browser_paths = tuple(browser_paths)

    def _in_browser_path(self, path: str) -> bool:
        return any(path == p or path.startswith(p + "/") for p in self.browser_paths)

    @staticmethod
    def _basic_password(auth: bytes) -> bytes:
        try:
            decoded = base64.b64decode(auth[6:].strip(), validate=True)
        except (binascii.Error, ValueError):
            return b""
        return decoded.partition(b":")[2]  # any user name: the password is the key

    def _authorized(self, auth: bytes, browser: bool = False, x_api_key: bytes = b"") -> bool:
        if x_api_key and not auth:
            token = x_api_key.strip()
        elif auth[:7].lower() == b"bearer ":
            token = auth[7:].strip()
        elif browser and auth[:6].lower() == b"basic ":
            token = self._basic_password(auth)
        else:
            token = b""
        # Every key is compared (no early exit), so the time taken does not tell which one nearly matched.
        matches = [hmac.compare_digest(token, key) for key in self.api_keys]
        return any(matches)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        path = get_route_path(scope)  # without --root-path
        if self.api_keys and path not in KEYLESS_ROUTES:
            auth = headers.get(b"authorization", b"")
            x_api_key = headers.get(b"x-api-key", b"")
            browser = self._in_browser_path(path)
            if not self._authorized(auth, browser, x_api_key):
                message = ("missing API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')"
                           if not auth and not x_api_key else "invalid API key")
                # A browser shows its password prompt on a Basic challenge (the key as the password).
                challenge = 'Basic realm="pagellm", charset="UTF-8"' if browser else "Bearer"
                await JSONResponse(self._error_body(path, 401, message), status_code=401,
                                   headers={"WWW-Authenticate": challenge})(scope, receive, send)
                return
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await self._too_large(scope, receive, send, path)
            return
        seen = 0
        deadline = time.monotonic() + self.body_read_timeout
        body_done = False

        async def limited_receive() -> Message:
            nonlocal seen, body_done
            if body_done:  # after the body, receive() only waits for a disconnect: no deadline
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                raise BodyReadTimeout() from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise BodyTooLarge()
                body_done = not message.get("more_body", False)
            return message

        await self.app(scope, limited_receive, send)

    @staticmethod
    def _error_body(path: str, status: int, message: str) -> dict[str, Any]:
        return anthropic_error_body(status, message) if is_anthropic_path(path) else error_body(status, message)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send, path: str) -> None:
        body = self._error_body(path, 413, f"the request body is larger than the limit of "
                                           f"{plural(self.max_body_bytes, 'byte')}; send less, or start the server "
                                           "with a larger --max-request-body-size")
        await JSONResponse(body, status_code=413)(scope, receive, send)


async def parse_body(request: Request, model: type[M], strict: bool = False) -> M:
    """The body as ``model``, read as vLLM reads it (``tolerance.relax``: null is unset, unknown fields
    dropped with a warning); ``strict`` (``--strict-requests``): unknown fields are a 400."""
    try:
        raw = await request.body()
    except BodyTooLarge:
        raise APIError(413, "the request body is larger than the server's limit; send less") from None
    except BodyReadTimeout:
        raise APIError(408, "the request body did not arrive within the server's --body-read-timeout; "
                            "send it at once") from None
    except ClientDisconnect:  # gone before the body was whole: nobody to answer, nothing to log
        raise APIError(400, "the client disconnected before sending the whole body") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the body is not valid UTF-8 (byte {e.start}): send UTF-8 encoded JSON") from e
    if not text.strip():
        raise APIError(400, "the body is empty: send a JSON object")
    try:
        data = pydantic_core.from_json(text)
    except ValueError as e:
        raise APIError(400, f"the body is not valid JSON: {e}; send a JSON object") from e
    dropped = relax(model, data, strict)
    try:
        parsed = model.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from e
    log_dropped(get_route_path(request.scope), dropped)  # once the body is valid: one warning per request
    return parsed


# The OpenAPI document. Handlers parse their bodies themselves (``parse_body``: OpenAI-shaped errors),
# so FastAPI does not see the models: each POST route declares its body, and the models' schemas are
# added to the document's components.
STREAMS: dict[int | str, dict[str, Any]] = {200: {
    "description": "the answer as JSON, or with \"stream\": true server-sent events ending in data: [DONE]",
    "content": {"text/event-stream": {"schema": {"type": "string"}}}}}


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` of a route whose JSON body is ``model``."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def add_body_schemas(app: FastAPI, models: Sequence[type[BaseModel]]) -> None:
    """``app``'s OpenAPI document with the schemas of ``models``, and an operation id of its own for
    each method of a route that takes several (GET and HEAD), where FastAPI gives them one."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Duplicate Operation ID")
            doc = generate()
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for model in models:
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
        ops = [(method, op) for item in doc.get("paths", {}).values() for method, op in item.items()
               if isinstance(op, dict) and "operationId" in op]
        ids = Counter(op["operationId"] for _, op in ops)
        for method, op in ops:
            if ids[op["operationId"]] > 1:
                op["operationId"] = re.sub(r"_(get|head)$", "", op["operationId"]) + f"_{method}"
        return doc

    app.openapi = openapi  # type: ignore[method-assign]


class OpenAIServing(OpenAIServingCompletion, OpenAIServingChat):
    """Both handlers over one engine, one tokenizing thread and one set of model names."""


@dataclass
class CORSSettings:
    """``--allowed-origins`` and its companions; CORS is off without origins."""

    allowed_origins: list[str] | None = None
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False


def build_app(engine: LLMEngine, model_name: str, api_key: str | Sequence[str] | None = None,
              max_waiting_requests: int | None = None, max_body_bytes: int = 2**20, aliases: Sequence[str] = (),
              body_read_timeout: float = math.inf, cors: CORSSettings | None = None,
              enable_dashboard: bool = True, request_logging: RequestLogging | None = None, root_path: str = "",
              enable_docs: bool = False, strict_requests: bool = False, metrics_prefix: str = "both",
              chat_options: ChatOptions | None = None, responses_store: ResponsesStore | None = None) -> FastAPI:
    """The app; ``model_name`` is the name responses report, ``aliases`` the other names requests may
    use, ``api_key`` one key or several (each accepted); ``enable_dashboard``: serve /dashboard and
    /v1/kv_cache/state; ``request_logging``: log each request (``--enable-log-requests``);
    ``root_path``: the prefix a proxy serves the app under; ``enable_docs``: serve /docs and /redoc
    (their pages load scripts from a CDN); ``strict_requests``: a 400 for fields no model declares,
    rather than a warning (``--strict-requests``); ``metrics_prefix``: the names /metrics exposes
    (vllm, pagellm or both); ``chat_options``: how chat requests are read and answered (the chat template,
    tool and reasoning parsers); ``responses_store``: where the Responses API keeps responses."""
    async_engine = AsyncLLMEngine(engine, max_waiting_requests=max_waiting_requests)
    engine.structured_output.warm_up()
    metrics = EngineMetrics(engine, model_name, prefix=metrics_prefix)
    async_engine.step_callbacks.append(metrics.on_step)
    if not engine.args.disable_log_stats:
        async_engine.step_callbacks.append(StatsLogger(engine).on_step)
    async_engine.abort_callbacks.append(metrics.on_abort)
    serving = OpenAIServing(async_engine, model_name, tuple(aliases), request_logging, chat_options)
    dashboard = Dashboard(async_engine, model_name) if enable_dashboard else None
    if dashboard is not None:
        async_engine.step_callbacks.append(dashboard.on_step)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        logger.info("serving %s (max_model_len=%d)", model_name, engine.max_model_len)
        log_ready("the server")
        try:
            yield
        finally:
            in_flight = async_engine.num_in_flight()
            await async_engine.stop()
            serving.close()
            logger.info("engine stopped; aborted %s still in flight", plural(in_flight, "request"))

    app = FastAPI(title="pagellm", version=pagellm.__version__, lifespan=lifespan,
                  docs_url="/docs" if enable_docs else None, redoc_url="/redoc" if enable_docs else None)
    # As vLLM: requests may come with the prefix or without it (a proxy that strips it), and the
    # OpenAPI schema names it. (Set here: FastAPI's constructor argument is deprecated.)
    app.root_path = root_path
    app.state.async_engine = async_engine
    app.state.metrics = metrics

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = no_such_route(request.method, get_route_path(request.scope), served_routes(app.routes))
        else:
            message = {405: "method not allowed on this route"}.get(exc.status_code, str(exc.detail))
        # The exception's headers too: a 405 names the methods the route allows (Allow), as HTTP asks.
        return JSONResponse(error_body(exc.status_code, message), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
        # A bug, not bad input: still OpenAI's shape, so clients can read it (the traceback is logged).
        return error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}"))

    @app.exception_handler(BodyTooLarge)
    async def _too_large(_: Request, exc: BodyTooLarge) -> JSONResponse:
        return error_response(APIError(413, "the request body is larger than the server's limit; send less"))

    @app.exception_handler(BodyReadTimeout)
    async def _slow_body(_: Request, exc: BodyReadTimeout) -> JSONResponse:
        return error_response(APIError(408, "the request body did not arrive within the server's "
                                            "--body-read-timeout; send it at once"))

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> JSONResponse:
        # 503 once the engine failed for good (the process is exiting) or is shutting down.
        problem = async_engine.health()
        if problem is None:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "error", "message": problem}, status_code=503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": pagellm.__version__}

    def model_card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "pagellm",
                "root": str(engine.model_path), "parent": None, "max_model_len": engine.max_model_len}

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [*map(model_card, serving.model_names),
                                           *adapter_cards(engine, model_name, model_card)]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict[str, Any]:
        serving.check_model(model)
        return next((c for c in adapter_cards(engine, model_name, model_card) if c["id"] == model), model_card(model))

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus() -> Response:
        return Response(metrics.render(pending=len(async_engine._pending_adds)),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions", openapi_extra=json_body(CompletionRequest), responses=STREAMS)
    async def completions(request: Request) -> Any:
        return await serving.completions(await parse_body(request, CompletionRequest, strict_requests), request)

    @app.post("/v1/chat/completions", openapi_extra=json_body(ChatCompletionRequest), responses=STREAMS)
    async def chat(request: Request) -> Any:
        return await serving.chat(await parse_body(request, ChatCompletionRequest, strict_requests), request)

    @app.post("/tokenize", openapi_extra=json_body(TokenizeRequest))
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await parse_body(request, TokenizeRequest, strict_requests)
        serving.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of 'prompt' or 'messages'", param="prompt")
        if body.messages is not None:
            options = template_options(body.add_generation_prompt, body.continue_final_message, body.documents,
                                       body.chat_template_kwargs, body.messages)
            ids = await serving.off_loop(serving.chat_prompt_ids, body.messages, options)
        else:
            ids = await serving.off_loop(lambda: engine.tokenizer.encode(
                body.prompt, add_special_tokens=body.add_special_tokens))
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}

    @app.post("/detokenize", openapi_extra=json_body(DetokenizeRequest))
    async def detokenize(request: Request) -> dict[str, Any]:
        body = await parse_body(request, DetokenizeRequest, strict_requests)
        serving.check_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < engine.vocab_size]
        if bad:
            raise APIError(400, f"token ids must be in [0, {engine.vocab_size}); got {bad[:5]}", param="tokens")
        return {"prompt": engine.tokenizer.decode(body.tokens)}

    add_messages_routes(app, serving, parse_body, json_body, STREAMS)
    add_worker_routes(app, async_engine, model_name)  # what vllm-router reads: /get_load, /flush_cache ...
    add_lora_routes(app, engine, lambda request, model: parse_body(request, model, strict_requests))
    add_pooling_refusals(app)  # /v1/embeddings, /score, /rerank ...: a 400 naming --runner pooling
    if responses_store is None:
        responses_store = ResponsesStore(1024, 256 * 2**20)
    responses = OpenAIServingResponses(serving, responses_store)
    add_responses_routes(app, responses, lambda request, model: parse_body(request, model, strict_requests),
                         json_body(ResponsesRequest), STREAMS)
    if dashboard is not None:
        add_dashboard_routes(app, dashboard)
    add_body_schemas(app, (CompletionRequest, ChatCompletionRequest, ResponsesRequest, TokenizeRequest,
                           DetokenizeRequest, MessagesRequest, CountTokensRequest))

    keys = [api_key] if isinstance(api_key, str) else list(api_key or ())
    app.add_middleware(GuardMiddleware, api_keys=keys, max_body_bytes=max_body_bytes,
                       body_read_timeout=body_read_timeout,
                       browser_paths=BROWSER_PATHS if dashboard is not None else ())
    if cors is not None and cors.allowed_origins:
        # Outside the key check: a browser's preflight carries no Authorization header.
        app.add_middleware(CORSMiddleware, allow_origins=cors.allowed_origins, allow_methods=cors.allowed_methods,
                           allow_headers=cors.allowed_headers, allow_credentials=cors.allow_credentials)
    return app


# ----------------------------------------------------------------------- CLI
def run_server(args: argparse.Namespace, sock: socket.socket) -> int:
    """Serve on ``sock`` (bound by ``cli_args.bind_socket`` before anything heavy was imported), with the
    flags ``cli_args`` parsed and checked (``args.api_key`` resolved: the flag's keys or the environment's)."""
    import uvicorn

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}; give one")
        args.model = args.model_tag
    if args.max_waiting_requests is not None and args.max_waiting_requests < 1:
        raise ValueError(f"--max-waiting-requests must be >= 1, got {args.max_waiting_requests}")
    if not 0 <= args.shutdown_timeout < math.inf:
        raise ValueError(f"--shutdown-timeout must be a finite number of seconds >= 0, got {args.shutdown_timeout}")
    for flag in ("timeout_keep_alive", "body_read_timeout"):
        if not 0 < getattr(args, flag) < math.inf:
            raise ValueError(f"--{flag.replace('_', '-')} must be a positive, finite number of seconds, "
                             f"got {getattr(args, flag)}")
    max_body = parse_memory(args.max_request_body_size)
    responses_store = ResponsesStore(args.responses_store_max_responses, parse_memory(args.responses_store_max_bytes))
    chat_template = load_chat_template(args.chat_template)
    engine_args = EngineArgs.from_cli_args(args)
    if engine_args.node_rank > 0:  # another host's model shards: node 0 serves HTTP
        sock.close()
        from pagellm.engine.tp_worker import run_worker_node

        return run_worker_node(engine_args)
    if pooling_task(engine_args) is not None:  # an encoder: the pooling server (serving_pooling.py)
        return run_pooling_server(args, engine_args, sock, parse_body, GuardMiddleware, max_body)
    engine = LLMEngine(engine_args)
    if args.model is None:
        logger.info("no model given: serving the embedded default %s", engine.model_path.name)
    names = engine_args.served_model_names or [args.model if args.model is not None else engine.model_path.name]
    name = names[0]
    register_lora_modules(engine, getattr(args, "lora_modules", None), names)
    api_keys = args.api_key
    cors = CORSSettings(args.allowed_origins, args.allowed_methods, args.allowed_headers, args.allow_credentials)
    app = build_app(engine, name, api_key=api_keys, max_waiting_requests=args.max_waiting_requests,
                    max_body_bytes=max_body, aliases=names[1:], body_read_timeout=args.body_read_timeout,
                    cors=cors, enable_dashboard=not args.disable_dashboard,
                    request_logging=RequestLogging(args.max_log_len) if args.enable_log_requests else None,
                    root_path=args.root_path or "", enable_docs=args.enable_fastapi_docs,
                    strict_requests=args.strict_requests, metrics_prefix=args.metrics_prefix,
                    chat_options=ChatOptions.from_args(args, chat_template), responses_store=responses_store)
    config = uvicorn.Config(app, log_level=args.uvicorn_log_level, timeout_graceful_shutdown=args.shutdown_timeout,
                            access_log=not args.disable_uvicorn_access_log, timeout_keep_alive=args.timeout_keep_alive,
                            http=with_head_timeout(args.body_read_timeout), ssl_keyfile=args.ssl_keyfile,
                            ssl_certfile=args.ssl_certfile, ssl_ca_certs=args.ssl_ca_certs,
                            ssl_cert_reqs=args.ssl_cert_reqs)
    # SIGTERM: requests still running when --shutdown-timeout expires are aborted through the engine
    # (clients get finish_reason "abort" and [DONE]); an engine that failed for good exits 1.
    from pagellm.entrypoints.openai.shutdown import EngineServer

    server = EngineServer(config, app.state.async_engine)
    # uvicorn re-raises the signal that stopped it once shutdown is done, which would make the exit
    # status 128+N; with these no-op handlers restored under it, a graceful SIGTERM exits 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    base = f"{'https' if args.ssl_certfile else 'http'}://{args.host}:{args.port}{args.root_path or ''}"
    logger.info("listening on %s (model %r)", base, name)
    if not args.disable_dashboard:
        logger.info("KV cache dashboard: %s/dashboard", base)
    server.run(sockets=[sock])
    return server.exit_code
