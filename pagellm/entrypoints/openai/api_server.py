"""`pagellm serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn)."""

from __future__ import annotations

import argparse
import contextlib
import hmac
import logging
import math
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Optional, TypeVar

import jinja2
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import pagellm
from pagellm.config import EngineArgs, parse_memory
from pagellm.engine.async_engine import AsyncLLMEngine
from pagellm.engine.llm_engine import LLMEngine
from pagellm.engine.metrics import EngineMetrics
from pagellm.entrypoints.openai.errors import APIError, error_body, error_response, from_validation_error
from pagellm.entrypoints.openai.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
)
from pagellm.entrypoints.openai.serving import OpenAIServing

logger = logging.getLogger("pagellm.server")

M = TypeVar("M", bound=BaseModel)
DEFAULT_MAX_BODY = "1MiB"


class BodyTooLarge(Exception):
    pass


class GuardMiddleware:
    """API key check (constant-time) on every route but /health, and a request-body size limit.

    Plain ASGI rather than a BaseHTTPMiddleware, so handlers still see client disconnects.
    """

    def __init__(self, app: ASGIApp, api_key: Optional[str], max_body_bytes: int) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if self.api_key is not None and scope["path"] != "/health":
            auth = headers.get(b"authorization", b"")
            token = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(token, self.api_key):
                message = ("missing API key: send 'Authorization: Bearer <key>'" if not auth
                           else "invalid API key")
                await JSONResponse(error_body(401, message), status_code=401,
                                   headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await self._too_large(scope, receive, send)
            return
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise BodyTooLarge()
            return message

        await self.app(scope, limited_receive, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = error_body(413, f"the request body is larger than the limit of {self.max_body_bytes} bytes; "
                               "send less, or start the server with a larger --max-request-body-size")
        await JSONResponse(body, status_code=413)(scope, receive, send)


async def parse_body(request: Request, model: type[M]) -> M:
    try:
        raw = await request.body()
    except BodyTooLarge:
        raise APIError(413, "the request body is larger than the server's limit; send less") from None
    except ClientDisconnect:  # gone before the body was whole: nobody to answer, nothing to log
        raise APIError(400, "the client disconnected before sending the whole body") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the body is not valid UTF-8 (byte {e.start}): send UTF-8 encoded JSON") from e
    if not text.strip():
        raise APIError(400, "the body is empty: send a JSON object")
    try:
        return model.model_validate_json(text)
    except ValidationError as e:
        raise from_validation_error(e) from e


def build_app(engine: LLMEngine, model_name: str, api_key: Optional[str] = None,
              max_waiting_requests: Optional[int] = None, max_body_bytes: int = 2**20,
              chat_template: Optional[str] = None) -> FastAPI:
    async_engine = AsyncLLMEngine(engine, max_waiting_requests=max_waiting_requests)
    metrics = EngineMetrics(engine, model_name)
    async_engine.step_callbacks.append(metrics.on_step)
    async_engine.abort_callbacks.append(metrics.on_abort)
    serving = OpenAIServing(async_engine, model_name, chat_template)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        logger.info("serving %s (max_model_len=%d)", model_name, engine.max_model_len)
        try:
            yield
        finally:
            in_flight = async_engine.num_in_flight()
            await async_engine.stop()
            serving.close()
            logger.info("engine stopped; aborted %d request(s) still in flight", in_flight)

    app = FastAPI(title="pagellm", version=pagellm.__version__, lifespan=lifespan)
    app.state.async_engine = async_engine
    app.state.metrics = metrics

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = {404: "no such route", 405: "method not allowed on this route"}.get(exc.status_code, str(exc.detail))
        return JSONResponse(error_body(exc.status_code, message), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
        # A bug, not bad input: still OpenAI's shape, so clients can read it (the traceback is logged).
        return error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}"))

    @app.exception_handler(BodyTooLarge)
    async def _too_large(_: Request, exc: BodyTooLarge) -> JSONResponse:
        return error_response(APIError(413, "the request body is larger than the server's limit; send less"))

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if async_engine.is_running else 503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": pagellm.__version__}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": int(time.time()), "owned_by": "pagellm",
            "root": str(engine.model_path), "max_model_len": engine.max_model_len,
        }]}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(pending=len(async_engine._pending_adds)),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await serving.completions(await parse_body(request, CompletionRequest), request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        return await serving.chat(await parse_body(request, ChatCompletionRequest), request)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await parse_body(request, TokenizeRequest)
        serving.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of 'prompt' or 'messages'", param="prompt")
        if body.messages is not None:
            ids = await serving.off_loop(serving.chat_prompt_ids, body.messages, body.add_generation_prompt)
        else:
            ids = await serving.off_loop(lambda: engine.tokenizer.encode(
                body.prompt, add_special_tokens=body.add_special_tokens))
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        body = await parse_body(request, DetokenizeRequest)
        serving.check_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < engine.vocab_size]
        if bad:
            raise APIError(400, f"token ids must be in [0, {engine.vocab_size}); got {bad[:5]}", param="tokens")
        return {"prompt": engine.tokenizer.decode(body.tokens)}

    app.add_middleware(GuardMiddleware, api_key=api_key, max_body_bytes=max_body_bytes)
    return app


# ----------------------------------------------------------------------- CLI
def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve the OpenAI-compatible API")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="model folder (same as --model); none: the embedded default")
    EngineArgs.add_cli_args(p)
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=os.environ.get("PAGELLM_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $PAGELLM_API_KEY)")
    s.add_argument("--served-model-name", default=None, help="the model's name in the API")
    s.add_argument("--chat-template", default=None,
                   help="a Jinja chat template, or the path of a file holding one, used instead of the "
                        "tokenizer's own")
    s.add_argument("--max-waiting-requests", type=int, default=1024,
                   help="beyond this many queued requests, answer 503 with Retry-After")
    s.add_argument("--max-request-body-size", default=DEFAULT_MAX_BODY, help="largest request body (413 above)")
    s.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds running requests get to finish after SIGTERM before they are aborted")
    p.set_defaults(func=run_server)


def load_chat_template(value: Optional[str]) -> Optional[str]:
    """``--chat-template``: a file's contents, or the template itself (vLLM's rule: text with a Jinja
    block or variable is a template; anything else must be a file)."""
    if value is None:
        return None
    if "{%" in value or "{{" in value:
        template = value
    else:
        path = Path(value).expanduser()
        if not path.is_file():
            raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template "
                             "(one with {{ ... }} or {% ... %})")
        template = path.read_text()
    # Compiled the way transformers renders it (its sandbox and extensions: break/continue, generation).
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template does not parse as Jinja (line {e.lineno}): {e.message}") from e
    return template


def run_server(args: argparse.Namespace) -> int:
    import uvicorn

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}; give one")
        args.model = args.model_tag
    if args.max_waiting_requests is not None and args.max_waiting_requests < 1:
        raise ValueError(f"--max-waiting-requests must be >= 1, got {args.max_waiting_requests}")
    if not 0 <= args.shutdown_timeout < math.inf:
        raise ValueError(f"--shutdown-timeout must be a finite number of seconds >= 0, got {args.shutdown_timeout}")
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in [1, 65535], got {args.port}")
    max_body = parse_memory(args.max_request_body_size)
    chat_template = load_chat_template(args.chat_template)
    engine = LLMEngine(EngineArgs.from_cli_args(args))
    if args.model is None:
        logger.info("no model given: serving the embedded default %s", engine.model_path.name)
    name = args.served_model_name or (args.model if args.model is not None else engine.model_path.name)
    app = build_app(engine, name, api_key=args.api_key, max_waiting_requests=args.max_waiting_requests,
                    max_body_bytes=max_body, chat_template=chat_template)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                            timeout_graceful_shutdown=args.shutdown_timeout, access_log=False)
    server = uvicorn.Server(config)
    # uvicorn re-raises the signal that stopped it once shutdown is done, which would make the exit
    # status 128+N; with these no-op handlers restored under it, a graceful SIGTERM exits 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    logger.info("listening on http://%s:%d (model %r)", args.host, args.port, name)
    server.run()
    return 0

