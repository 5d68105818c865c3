"""``pagellm run-batch``: a file of OpenAI batch requests answered offline by the server's own handlers.

Each line goes through what ``pagellm serve`` does with a request (the same body parsing, checks and
handlers, on an ``AsyncLLMEngine``), so a line gets the response, or the error, the server would give.
Up to ``--max-concurrent-requests`` lines are in the engine at once; each result is written (and
flushed) as soon as its request finishes, so a long file's results can be read while it runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO, cast

from fastapi import Request as HTTPRequest
from pydantic import BaseModel, ValidationError
from tqdm.auto import tqdm

from pagellm.config import EngineArgs
from pagellm.engine.async_engine import AsyncLLMEngine
from pagellm.engine.llm_engine import LLMEngine
from pagellm.entrypoints.openai.api_server import OpenAIServing
from pagellm.entrypoints.openai.chat_prompt import load_chat_template
from pagellm.entrypoints.openai.errors import APIError, error_body, from_validation_error
from pagellm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagellm.entrypoints.openai.serving import ChatOptions
from pagellm.entrypoints.openai.tolerance import log_dropped, relax
from pagellm.text import plural

logger = logging.getLogger("pagellm.batch")

# url -> (the body's model, the handler's name on OpenAIServing).
ROUTES: dict[str, tuple[type[BaseModel], str]] = {
    "/v1/completions": (CompletionRequest, "completions"),
    "/v1/chat/completions": (ChatCompletionRequest, "chat"),
}
# Routes of OpenAI's batch API that this server does not serve.
NOT_SERVED = ("/v1/embeddings", "/v1/responses", "/v1/moderations")


class NoClient:
    """What the handlers see of the HTTP client: a batch line's never disconnects."""

    async def is_disconnected(self) -> bool:
        return False


@dataclass
class BatchCounts:
    succeeded: int = 0
    failed: int = 0


def result_line(custom_id: str | None, status: int, body: dict[str, Any]) -> dict[str, Any]:
    """One output line: OpenAI's batch output object; ``error`` holds the error of a failed request."""
    error = body.get("error") if status != 200 else None
    request_id = body.get("id") if status == 200 else None
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": status, "request_id": request_id or f"batch-{uuid.uuid4().hex}",
                         "body": body},
            "error": error}


def error_line(custom_id: str | None, err: APIError) -> dict[str, Any]:
    return result_line(custom_id, err.status, error_body(err.status, err.message, err.param, err.code))


def parse_line(text: str) -> dict[str, Any]:
    """One input line as a JSON object (an APIError when it is not one)."""
    try:
        line = json.loads(text)
    except json.JSONDecodeError as e:
        raise APIError(400, f"the line is not valid JSON ({e.msg} at column {e.colno})") from e
    if not isinstance(line, dict):
        raise APIError(400, f"the line must be a JSON object, got {type(line).__name__}")
    return line


def check_request(line: dict[str, Any]) -> tuple[type[BaseModel], str, dict[str, Any]]:
    """(the body's model, the handler's name, the body) of a batch request; an APIError naming the field
    when the line is not one this server runs."""
    if not isinstance(line.get("custom_id"), str):
        raise APIError(400, "the line needs a custom_id string (it names the request's result)", param="custom_id")
    method, url, body = line.get("method"), line.get("url"), line.get("body")
    if method != "POST":
        raise APIError(400, f"method must be 'POST', got {method!r}", param="method")
    if url in NOT_SERVED:
        raise APIError(400, f"{url} is not supported by this server; a batch runs /v1/completions and "
                            "/v1/chat/completions", param="url")
    if url not in ROUTES:
        raise APIError(400, f"url must be /v1/completions or /v1/chat/completions, got {url!r}", param="url")
    if not isinstance(body, dict):
        raise APIError(400, "body must be a JSON object: the request's body, as sent to the server", param="body")
    if body.get("stream"):
        raise APIError(400, "stream is not supported in a batch: each result is written whole; drop stream",
                       param="stream")
    model, handler = ROUTES[url]
    return model, handler, body


async def answer(serving: OpenAIServing, text: str, strict: bool = False) -> dict[str, Any]:
    """The output line of one input line; ``strict`` (``--strict-requests``): unknown body fields are a 400."""
    custom_id = None
    try:
        line = parse_line(text)
        custom_id = line["custom_id"] if isinstance(line.get("custom_id"), str) else None
        model, handler, body = check_request(line)
        # As the server reads a body (api_server.parse_body): relaxed as vLLM's are, then validated.
        dropped = relax(model, body, strict)
        try:
            request = model.model_validate(body)
        except ValidationError as e:
            raise from_validation_error(e) from e
        log_dropped(line["url"], dropped)
        response = await getattr(serving, handler)(request, cast(HTTPRequest, NoClient()))
        if not isinstance(response, dict):
            raise APIError(500, f"internal error: the handler answered {type(response).__name__}, not a JSON body")
        return result_line(custom_id, 200, response)
    except APIError as e:
        return error_line(custom_id, e)
    except Exception as e:  # a bug: this line fails, the batch goes on (the traceback is logged)
        logger.exception("request %s failed", custom_id)
        return error_line(custom_id, APIError(500, f"internal error: {type(e).__name__}: {e}"))


def count_requests(source: Path) -> int:
    with source.open(encoding="utf-8", errors="replace") as f:
        return sum(1 for line in f if line.strip())


async def run_batch(serving: OpenAIServing, source: Path, out: TextIO, concurrency: int,
                    progress: bool = True, strict: bool = False) -> BatchCounts:
    """Answer every line of ``source`` (up to ``concurrency`` at once), writing each result to ``out``
    as it finishes, with a progress bar."""
    counts = BatchCounts()
    slots = asyncio.Semaphore(concurrency)
    tasks: set[asyncio.Task] = set()
    bar = tqdm(total=count_requests(source), desc="Running batch", unit="req", disable=not progress,
               dynamic_ncols=True)

    async def one(text: str) -> None:
        try:
            result = await answer(serving, text, strict)
        finally:
            slots.release()
        out.write(json.dumps(result, ensure_ascii=False) + "\n")
        out.flush()
        if result["error"] is None:
            counts.succeeded += 1
        else:
            counts.failed += 1
        bar.update(1)

    try:
        with source.open(encoding="utf-8", errors="replace") as f:
            for raw in f:
                text = raw.strip()
                if not text:
                    continue
                await slots.acquire()
                task = asyncio.create_task(one(text))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        bar.close()
    return counts


def run_batch_command(args: argparse.Namespace) -> int:
    """``pagellm run-batch``: load the engine, answer the file, exit 0 (failed lines are in the output)."""
    chat_template = load_chat_template(args.chat_template)
    engine_args = EngineArgs.from_cli_args(args)
    engine = LLMEngine(engine_args)
    names = engine_args.served_model_names or [args.model if args.model is not None else engine.model_path.name]
    concurrency = args.max_concurrent_requests or 2 * engine_args.max_num_seqs

    async def main() -> BatchCounts:
        async_engine = AsyncLLMEngine(engine)
        warm_up = engine.structured_output.warm_up()
        serving = OpenAIServing(async_engine, names[0], tuple(names[1:]),
                                chat=ChatOptions.from_args(args, chat_template))
        async_engine.start()
        try:
            with open(args.output_file, "w", encoding="utf-8") as out:
                return await run_batch(serving, Path(args.input_file), out, concurrency,
                                       strict=args.strict_requests)
        finally:
            # A short batch can end before the grammar engine's warm-up on the compile thread does: the
            # process must not exit under it (native code running while the interpreter shuts down).
            with contextlib.suppress(Exception):
                await asyncio.wrap_future(warm_up)
            await async_engine.stop()
            serving.close()

    counts = asyncio.run(main())
    total = counts.succeeded + counts.failed
    logger.info("%s done: %d succeeded, %d failed; results in %s", plural(total, "request"), counts.succeeded,
                counts.failed, args.output_file)
    return 0
