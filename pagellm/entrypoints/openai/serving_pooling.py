"""The pooling server (``--runner pooling``): ``/v1/embeddings``, ``/score`` and ``/v1/score``, ``/rerank``,
``/v1/rerank`` and ``/v2/rerank``, ``/classify``, ``/pooling``; and, on a generative server, the 400 that
names ``--runner pooling`` for each of these routes (``add_pooling_refusals``)."""

from __future__ import annotations

import argparse
import base64
import contextlib
import logging
import math
import signal
import socket
import struct
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel
from starlette._utils import get_route_path
from starlette.exceptions import HTTPException as StarletteHTTPException

import pagellm
from pagellm.config import EngineArgs
from pagellm.engine.async_pooling import AsyncPoolingEngine, EngineUnavailable
from pagellm.engine.phases import log_ready
from pagellm.engine.pooling_engine import InputTooLongError, PoolingEngine, PoolingPrompt
from pagellm.engine.pooling_metrics import PoolingMetrics
from pagellm.engine.runner_choice import pooling_task
from pagellm.entrypoints.openai.errors import APIError, error_body, error_response
from pagellm.entrypoints.openai.http_protocol import with_head_timeout
from pagellm.entrypoints.openai.pooling_dashboard import add_pooling_dashboard
from pagellm.entrypoints.openai.pooling_protocol import (
    ClassifyRequest,
    EmbeddingRequest,
    RerankDocument,
    RerankRequest,
    ScoreRequest,
)
from pagellm.entrypoints.openai.routes import no_such_route, served_routes
from pagellm.outputs import PoolingRequestOutput

logger = logging.getLogger("pagellm.server")

M = TypeVar("M", bound=BaseModel)
ParseBody = Callable[[Request, type[M]], Awaitable[M]]

POOLING_ROUTES = ("/v1/embeddings", "/pooling", "/classify", "/score", "/v1/score", "/rerank", "/v1/rerank",
                  "/v2/rerank")
GENERATIVE_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses")


def add_pooling_refusals(app: FastAPI) -> None:
    """On a generative server: each pooling route answers a 400 naming ``--runner pooling``."""
    async def refuse(request: Request) -> JSONResponse:
        message = (f"{get_route_path(request.scope)} needs a pooling model (an embedding model or a "
                   "cross-encoder such as all-MiniLM-L6-v2 or bge-reranker), served with --runner pooling; "
                   "this server generates text")
        return error_response(APIError(400, message, code="wrong_runner"))

    for path in POOLING_ROUTES:
        app.add_api_route(path, refuse, methods=["POST"], include_in_schema=False)


def _matryoshka(config: Any) -> list[int] | None:
    """The dimensions a Matryoshka model may be cut to (config.json's ``matryoshka_dimensions``; any with
    ``is_matryoshka``), or None for a model whose embeddings must not be cut."""
    dims = getattr(config, "matryoshka_dimensions", None)
    if dims:
        return [int(d) for d in dims]
    return [] if getattr(config, "is_matryoshka", False) else None


def _base64(values: list[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")


def _cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm else 0.0


class ServingPooling:
    def __init__(self, engine: AsyncPoolingEngine, model_names: Sequence[str]) -> None:
        self.engine = engine
        self.model_names = tuple(model_names)
        self.metrics = PoolingMetrics(self.model_names[0])
        engine.step_callbacks.append(self.metrics.on_step)
        self.matryoshka = _matryoshka(engine.engine.model_config)

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise APIError(404, f"the model '{model}' does not exist; this server serves "
                                f"{', '.join(repr(n) for n in self.model_names)}", param="model",
                           code="model_not_found")

    async def _pool(self, prompts: Sequence[PoolingPrompt], task: str, truncate: int | None,
                    param: str) -> list[PoolingRequestOutput]:
        if not prompts:
            raise APIError(400, f"'{param}' is empty: give at least one input", param=param)
        try:
            inputs = await self.engine.tokenize(prompts, truncate)
            return await self.engine.run(inputs, task)
        except EngineUnavailable as e:
            raise APIError(503, str(e)) from e
        except (InputTooLongError, ValueError) as e:
            raise APIError(400, str(e), param=param) from e

    @staticmethod
    def _inputs(value: Any) -> list[PoolingPrompt]:
        if isinstance(value, str):
            return [value]
        if value and all(isinstance(v, int) for v in value):
            return [list(value)]
        return list(value)

    @staticmethod
    def _usage(outs: Sequence[PoolingRequestOutput]) -> dict[str, int]:
        n = sum(len(o.prompt_token_ids) for o in outs)
        return {"prompt_tokens": n, "total_tokens": n}

    def _envelope(self, prefix: str, **body: Any) -> dict[str, Any]:
        return {"id": f"{prefix}-{uuid.uuid4().hex}", "created": int(time.time()), "model": self.model_name, **body}

    async def embeddings(self, body: EmbeddingRequest) -> dict[str, Any]:
        self.check_model(body.model)
        hidden = self.engine.engine.hidden_size
        if body.dimensions is not None and body.dimensions != hidden:
            if self.matryoshka is None:
                raise APIError(400, f"this model does not support matryoshka representation: its embeddings have "
                                    f"{hidden} dimensions and cutting them would give poor results; leave "
                                    "'dimensions' unset", param="dimensions")
            if body.dimensions > hidden or (self.matryoshka and body.dimensions not in self.matryoshka):
                raise APIError(400, f"dimensions={body.dimensions} is not one this model was trained for "
                                    f"({self.matryoshka or f'at most {hidden}'})", param="dimensions")
        outs = await self._pool(self._inputs(body.input), "embed", body.truncate_prompt_tokens, "input")
        data = []
        for i, out in enumerate(outs):
            values = out.outputs.data
            if body.dimensions is not None and body.dimensions < len(values):
                values = values[:body.dimensions]
                if self.engine.engine.pooling.normalize:
                    norm = math.sqrt(sum(v * v for v in values)) or 1.0
                    values = [v / norm for v in values]
            embedding: Any = _base64(values) if body.encoding_format == "base64" else values
            data.append({"index": i, "object": "embedding", "embedding": embedding})
        return self._envelope("embd", object="list", data=data, usage=self._usage(outs))

    async def classify(self, body: ClassifyRequest) -> dict[str, Any]:
        self.check_model(body.model)
        outs = await self._pool(self._inputs(body.input), "classify", body.truncate_prompt_tokens, "input")
        labels = getattr(self.engine.engine.model_config, "id2label", None) or {}
        data = []
        for i, out in enumerate(outs):
            probs = out.outputs.data
            best = max(range(len(probs)), key=probs.__getitem__)
            data.append({"index": i, "label": labels.get(best, str(best)), "probs": probs, "num_classes": len(probs)})
        return self._envelope("classify", object="list", data=data, usage=self._usage(outs))

    async def pooling(self, body: EmbeddingRequest) -> dict[str, Any]:
        self.check_model(body.model)
        task = "embed" if self.engine.engine.task == "embed" else "classify"
        outs = await self._pool(self._inputs(body.input), task, body.truncate_prompt_tokens, "input")
        data = [{"index": i, "object": "pooling", "data": o.outputs.data} for i, o in enumerate(outs)]
        return self._envelope("pool", object="list", data=data, usage=self._usage(outs))

    async def scores(self, query_docs: list[tuple[str, str]], truncate: int | None,
                     param: str) -> tuple[list[float], list[PoolingRequestOutput]]:
        """Each pair's score: a cross-encoder's output, or the cosine of an embedding model's embeddings."""
        if self.engine.engine.task == "classify":
            outs = await self._pool(list(query_docs), "score", truncate, param)
            return [o.outputs.data[0] for o in outs], outs
        texts = list(dict.fromkeys([q for q, _ in query_docs] + [d for _, d in query_docs]))
        outs = await self._pool(texts, "embed", truncate, param)
        by_text = {t: o.outputs.data for t, o in zip(texts, outs)}
        return [_cosine(by_text[q], by_text[d]) for q, d in query_docs], outs

    async def score(self, body: ScoreRequest) -> dict[str, Any]:
        self.check_model(body.model)
        first = body.text_1 if body.text_1 is not None else body.queries
        second = body.text_2 if body.text_2 is not None else body.documents
        if first is None or second is None:
            raise APIError(400, "give text_1 and text_2 (or queries and documents)", param="text_1")
        one = [first] if isinstance(first, str) else list(first)
        two = [second] if isinstance(second, str) else list(second)
        if len(one) == 1:
            pairs = [(one[0], d) for d in two]
        elif len(one) == len(two):
            pairs = list(zip(one, two))
        else:
            raise APIError(400, f"text_1 has {len(one)} texts and text_2 {len(two)}: give one text_1, or as many "
                                "as text_2", param="text_1")
        values, outs = await self.scores(pairs, body.truncate_prompt_tokens, "text_2")
        data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(values)]
        return self._envelope("score", object="list", data=data, usage=self._usage(outs))

    async def rerank(self, body: RerankRequest) -> dict[str, Any]:
        self.check_model(body.model)
        docs = [d.text if isinstance(d, RerankDocument) else d for d in body.documents]
        if body.max_tokens_per_doc is not None:  # Cohere's: each document cut to its first N tokens
            tokenizer, n = self.engine.engine.tokenizer, body.max_tokens_per_doc
            docs = [tokenizer.decode(tokenizer(d, add_special_tokens=False)["input_ids"][:n]) for d in docs]
        if not docs:
            return self._envelope("rerank", results=[], usage={"prompt_tokens": 0, "total_tokens": 0})
        truncate = body.truncate_prompt_tokens
        values, outs = await self.scores([(body.query, d) for d in docs], truncate, "documents")
        order = sorted(range(len(docs)), key=lambda i: -values[i])
        if body.top_n is not None and body.top_n > 0:
            order = order[:body.top_n]
        results = []
        for i in order:
            result: dict[str, Any] = {"index": i, "relevance_score": values[i]}
            if body.return_documents:
                result["document"] = {"text": docs[i]}
            results.append(result)
        return self._envelope("rerank", results=results, usage=self._usage(outs))


def add_pooling_routes(app: FastAPI, serving: ServingPooling, parse_body: ParseBody) -> None:
    """The pooling routes on ``app``; ``parse_body``: the server's body parser (vLLM's tolerance)."""
    def route(path: str, model: type[BaseModel], handler: Callable[[Any], Awaitable[dict[str, Any]]]) -> None:
        kind = handler.__name__.removesuffix("s")  # embedding, score, rerank, classify, pooling

        async def endpoint(request: Request) -> dict[str, Any]:
            body = await parse_body(request, model)
            start = time.monotonic()
            try:
                answer = await handler(body)
            except BaseException:
                serving.metrics.on_request(kind, False, time.monotonic() - start, 0, 0)
                raise
            usage = answer.get("usage", {})
            serving.metrics.on_request(kind, True, time.monotonic() - start,
                                       len(answer.get("data", answer.get("results", []))),
                                       int(usage.get("prompt_tokens", usage.get("total_tokens", 0))))
            return answer
        app.add_api_route(path, endpoint, methods=["POST"], name=path)

    route("/v1/embeddings", EmbeddingRequest, serving.embeddings)
    route("/pooling", EmbeddingRequest, serving.pooling)
    route("/classify", ClassifyRequest, serving.classify)
    for path in ("/score", "/v1/score"):
        route(path, ScoreRequest, serving.score)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        route(path, RerankRequest, serving.rerank)


def generative_refusal(path: str, task: str) -> JSONResponse:
    """The 400 of a generative route on the pooling server (answered where the route is not found, so
    that the routes it lists are only those it serves)."""
    message = (f"{path} generates text, but this server runs a pooling model ({task}: --runner pooling); serve "
               "a generative model with --runner generate for it. This server answers " + ", ".join(POOLING_ROUTES))
    return error_response(APIError(400, message, code="wrong_runner"))


def build_pooling_app(engine: PoolingEngine, model_names: Sequence[str], parse_body: ParseBody,
                      add_guards: Callable[[FastAPI], None], max_waiting_requests: int | None = None,
                      root_path: str = "") -> FastAPI:
    """The pooling server's app; ``add_guards`` adds the server's middleware (API keys, body limits)."""
    async_engine = AsyncPoolingEngine(engine, max_waiting_requests)
    serving = ServingPooling(async_engine, model_names)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        logger.info("serving %s with the pooling runner (%s, max_model_len=%d)", serving.model_name, engine.task,
                    engine.max_model_len)
        log_ready("the server")
        try:
            yield
        finally:
            await async_engine.stop()

    app = FastAPI(title="pagellm", version=pagellm.__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.root_path = root_path
    app.state.async_engine = async_engine

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        path = get_route_path(request.scope)
        if exc.status_code in (404, 405) and path in GENERATIVE_ROUTES:
            return generative_refusal(path, engine.task)
        message = (no_such_route(request.method, path, served_routes(app.routes))
                   if exc.status_code == 404 else str(exc.detail))
        return JSONResponse(error_body(exc.status_code, message), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
        return error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}"))

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> JSONResponse:
        if async_engine.fatal_error is not None:
            return JSONResponse(error_body(503, f"the engine failed: {async_engine.fatal_error}"), status_code=503)
        return JSONResponse({})

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": pagellm.__version__}

    def card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": 0, "owned_by": "pagellm", "root": str(engine.model_path),
                "max_model_len": engine.max_model_len}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card(n) for n in serving.model_names]}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus() -> Response:
        return Response(serving.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    add_pooling_routes(app, serving, parse_body)
    add_pooling_dashboard(app, serving.metrics)
    add_guards(app)
    return app


def run_pooling_server(args: argparse.Namespace, engine_args: EngineArgs, sock: socket.socket,
                       parse_body: Callable[..., Awaitable[Any]], guard: Any, max_body: int) -> int:
    """``pagellm serve`` for a pooling model (``run_server`` calls it once the flags are checked);
    ``parse_body``, ``guard`` (the middleware: API keys, body limits) and ``max_body``: the server's."""
    import uvicorn

    from pagellm.entrypoints.openai.shutdown import EngineServer

    task = pooling_task(engine_args)
    engine = PoolingEngine(engine_args, task or "embed")
    names = engine_args.served_model_names or [args.model]
    keys = [args.api_key] if isinstance(args.api_key, str) else list(args.api_key or ())

    def add_guards(app: FastAPI) -> None:
        app.add_middleware(guard, api_keys=keys, max_body_bytes=max_body, body_read_timeout=args.body_read_timeout)

    def parse(request: Request, model: type[M]) -> Awaitable[M]:
        return parse_body(request, model, args.strict_requests)

    app = build_pooling_app(engine, names, parse, add_guards, args.max_waiting_requests, args.root_path or "")
    if args.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=args.allowed_origins, allow_methods=args.allowed_methods,
                           allow_headers=args.allowed_headers, allow_credentials=args.allow_credentials)
    config = uvicorn.Config(app, log_level=args.uvicorn_log_level, timeout_graceful_shutdown=args.shutdown_timeout,
                            access_log=not args.disable_uvicorn_access_log, timeout_keep_alive=args.timeout_keep_alive,
                            http=with_head_timeout(args.body_read_timeout), ssl_keyfile=args.ssl_keyfile,
                            ssl_certfile=args.ssl_certfile, ssl_ca_certs=args.ssl_ca_certs,
                            ssl_cert_reqs=args.ssl_cert_reqs)
    server = EngineServer(config, app.state.async_engine)
    for sig in (signal.SIGTERM, signal.SIGINT):  # a graceful SIGTERM exits 0 (as run_server)
        signal.signal(sig, lambda *_: None)
    base = f"{'https' if args.ssl_certfile else 'http'}://{args.host}:{args.port}{args.root_path or ''}"
    logger.info("listening on %s (model %r, --runner pooling)", base, names[0])
    server.run(sockets=[sock])
    return server.exit_code
