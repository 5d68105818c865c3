"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``) on the chat
path: the body becomes a chat completion request (``anthropic_protocol.to_chat_request``), which
runs as chat requests do (chat template, tool choice, tool-call parser); its output is answered as
an Anthropic message, or streamed as Anthropic's events. Errors on these routes take Anthropic's shape.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse

from pagellm.entrypoints.openai.anthropic_protocol import (
    CountTokensRequest,
    MessagesRequest,
    anthropic_error_body,
    to_chat_request,
)
from pagellm.entrypoints.openai.errors import APIError
from pagellm.entrypoints.openai.serving import ChoiceState
from pagellm.entrypoints.openai.serving_chat import ChatStart, OpenAIServingChat
from pagellm.entrypoints.openai.tool_parsers.detect import GENERIC
from pagellm.outputs import CompletionOutput

logger = logging.getLogger("pagellm.server")

ParseBody = Callable[[HTTPRequest, Any], Awaitable[Any]]


def event(payload: dict[str, Any]) -> str:
    """One server-sent event as Anthropic sends them: its type on the ``event:`` line too."""
    return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


def tool_use_id(call_id: str | None = None) -> str:
    return "toolu_" + (call_id.removeprefix("call_") if call_id else uuid.uuid4().hex[:24])


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as ``input`` (an object; the parsers and constraints give JSON objects)."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def stop_reason(c: CompletionOutput, called: bool, stop_sequences: list[str] | None) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` for a finished output."""
    if c.finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(c.stop_reason, str) and c.stop_reason in (stop_sequences or ()):
        return "stop_sequence", c.stop_reason
    return "end_turn", None


class BlockStream:
    """Chat deltas (``ToolCallStream``'s) -> Anthropic's content block events, one block open at a time."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # "thinking", "text" or "tool_use"

    def _start(self, block: dict[str, Any]) -> list[str]:
        events = self.close()
        self.index += 1
        self.open = block["type"]
        return [*events, event({"type": "content_block_start", "index": self.index, "content_block": block})]

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [event({"type": "content_block_stop", "index": self.index})]

    def convert(self, delta: dict[str, Any]) -> list[str]:
        events: list[str] = []
        if delta.get("reasoning_content"):
            if self.open != "thinking":
                events += self._start({"type": "thinking", "thinking": "", "signature": ""})
            events.append(event({"type": "content_block_delta", "index": self.index,
                                 "delta": {"type": "thinking_delta", "thinking": delta["reasoning_content"]}}))
        if "content" in delta:
            if self.open != "text":
                events += self._start({"type": "text", "text": ""})
            if delta["content"]:
                events.append(event({"type": "content_block_delta", "index": self.index,
                                     "delta": {"type": "text_delta", "text": delta["content"]}}))
        for call in delta.get("tool_calls", ()):
            fn = call.get("function", {})
            if "id" in call:
                events += self._start({"type": "tool_use", "id": tool_use_id(call["id"]), "name": fn.get("name"),
                                       "input": {}})
            if fn.get("arguments"):
                events.append(event({"type": "content_block_delta", "index": self.index,
                                     "delta": {"type": "input_json_delta", "partial_json": fn["arguments"]}}))
        return events


class ServingMessages:
    """The Messages routes over the server's chat handler."""

    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def create(self, req: MessagesRequest, http: HTTPRequest) -> Any:
        started = await self.chat.start_chat(to_chat_request(req), id_prefix="msg")
        job = started.job
        message_id = "msg_" + uuid.uuid4().hex
        if req.stream:
            return StreamingResponse(self._events(started, req, message_id), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        finals = await self.chat._collect(job, http)
        if finals is None:
            return JSONResponse({}, status_code=499)
        c = finals[0].outputs[0]
        message, called = started.reader().message(c.text, "assistant")
        content: list[dict[str, Any]] = []
        if message.get("reasoning_content"):
            content.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
        if called:
            if message["content"]:
                content.append({"type": "text", "text": message["content"]})
            content += [{"type": "tool_use", "id": tool_use_id(call["id"]), "name": call["function"]["name"],
                         "input": tool_input(call["function"]["arguments"])} for call in message["tool_calls"]]
        else:
            content.append({"type": "text", "text": message["content"]})
        reason, sequence = stop_reason(c, called, req.stop_sequences)
        return {"id": message_id, "type": "message", "role": "assistant", "model": self.chat.model_name,
                "content": content, "stop_reason": reason, "stop_sequence": sequence,
                "usage": {"input_tokens": len(job.prompt_ids[0]), "output_tokens": len(c.token_ids)}}

    async def _events(self, started: ChatStart, req: MessagesRequest, message_id: str) -> AsyncIterator[str]:
        """Anthropic's event sequence: message_start, per block content_block_start / _delta / _stop,
        message_delta (stop reason, output tokens), message_stop; a failure ends it with an error event."""
        job = started.job
        try:
            yield event({"type": "message_start", "message": {
                "id": message_id, "type": "message", "role": "assistant", "model": self.chat.model_name,
                "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": len(job.prompt_ids[0]), "output_tokens": 0}}})
            blocks, calls, state = BlockStream(), started.reader(), ChoiceState()
            final: CompletionOutput | None = None
            async for _, out in self.chat._merged(job):
                c = out.outputs[0]
                if final is not None:
                    continue
                finished = c.finish_reason is not None
                for delta in calls.deltas(self.chat._visible_text(c, job.params, state), finished):
                    for e in blocks.convert(delta):
                        yield e
                if finished:
                    final = c
            if final is None:  # the stream ended without a final output (aborted)
                return
            if blocks.index < 0:  # nothing generated: one empty text block, as the unstreamed answer has
                for e in blocks.convert({"content": ""}):
                    yield e
            for e in blocks.close():
                yield e
            reason, sequence = stop_reason(final, calls.called, req.stop_sequences)
            yield event({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                         "usage": {"output_tokens": len(final.token_ids)}})
            yield event({"type": "message_stop"})
        except Exception as e:
            err = e if isinstance(e, APIError) else APIError(500, f"internal error: {type(e).__name__}: {e}")
            if not isinstance(e, APIError):
                logger.exception("a Messages stream failed")
            yield event(anthropic_error_body(err.status, err.message))

    async def count_tokens(self, req: CountTokensRequest) -> dict[str, int]:
        chat = to_chat_request(req)
        self.chat.check_model(chat.model)
        tools = ([t.model_dump(exclude_none=True) for t in chat.tools]
                 if chat.tools and chat.tool_choice != "none" else None)
        generic_tools = tools is not None and self.chat.tool_format() == GENERIC
        ids = await self.chat.off_loop(self.chat.chat_prompt_ids, chat.messages, None, tools, generic_tools)
        return {"input_tokens": len(ids)}


def anthropic_error(err: APIError) -> JSONResponse:
    return JSONResponse(anthropic_error_body(err.status, err.message), status_code=err.status, headers=err.headers)


def add_messages_routes(app: FastAPI, chat: OpenAIServingChat, parse_body: ParseBody,
                        json_body: Callable[[Any], dict[str, Any]], streams: dict[int | str, dict[str, Any]]) -> None:
    """``POST /v1/messages`` and ``/v1/messages/count_tokens`` on ``app``; ``parse_body``, ``json_body``
    and ``streams``: the server's body parser and OpenAPI pieces (passed in: the server imports this)."""
    serving = ServingMessages(chat)

    async def answer(work: Callable[[], Awaitable[Any]]) -> Any:
        try:
            return await work()
        except APIError as e:
            return anthropic_error(e)
        except Exception as e:  # a bug, not bad input: still Anthropic's shape (the traceback is logged)
            logger.exception("a Messages request failed")
            return anthropic_error(APIError(500, f"internal error: {type(e).__name__}: {e}"))

    @app.post("/v1/messages", openapi_extra=json_body(MessagesRequest), responses=streams)
    async def messages(request: HTTPRequest) -> Any:
        async def work() -> Any:
            return await serving.create(await parse_body(request, MessagesRequest), request)
        return await answer(work)

    @app.post("/v1/messages/count_tokens", openapi_extra=json_body(CountTokensRequest))
    async def count_tokens(request: HTTPRequest) -> Any:
        async def work() -> Any:
            return await serving.count_tokens(await parse_body(request, CountTokensRequest))
        return await answer(work)
