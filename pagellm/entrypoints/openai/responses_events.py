"""A streamed response: the chat path's chat.completion.chunk events, read back, become the Responses
API's typed events, each with its ``sequence_number``::

    response.created, response.in_progress
    per output item: response.output_item.added
        reasoning:  response.reasoning_text.delta..., response.reasoning_text.done
        a message:  response.content_part.added, response.output_text.delta..., response.output_text.done,
                    response.content_part.done
        a call:     response.function_call_arguments.delta..., response.function_call_arguments.done
      response.output_item.done
    response.completed (or response.incomplete, response.failed)

Events are ``event: TYPE`` + ``data: JSON``; there is no ``[DONE]`` (OpenAI sends none on this route).
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import AsyncIterable, AsyncIterator, Callable
from typing import Any

from pagellm.entrypoints.openai.responses_protocol import (
    ResponseDraft,
    function_call_item,
    message_item,
    reasoning_item,
)

logger = logging.getLogger("pagellm.server")


async def chat_sse_payloads(chunks: AsyncIterable[Any]) -> AsyncIterator[dict[str, Any]]:
    """The JSON objects of a chat SSE stream (``data: {...}``), up to its ``[DONE]``."""
    try:
        async for raw in chunks:
            text = raw.decode() if isinstance(raw, bytes) else raw
            for line in text.splitlines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):].strip()
                if data == "[DONE]":
                    return
                yield json.loads(data)
    finally:
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            await aclose()  # the chat stream's own clean-up: its engine request is aborted if unfinished


class ResponseEvents:
    """The events of one streamed response; ``keep`` stores the final response object."""

    def __init__(self, draft: ResponseDraft, keep: Callable[[dict[str, Any]], None]) -> None:
        self.draft = draft
        self.keep = keep
        self.seq = itertools.count()
        self.output: list[dict[str, Any]] = []
        self.current: dict[str, Any] | None = None  # the open item: a message or a function call

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, **fields, "sequence_number": next(self.seq)}
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    # ------------------------------------------------------------ items
    def _open(self, item: dict[str, Any]) -> list[str]:
        self.current = item
        self.output.append(item)
        out = [self.event("response.output_item.added", output_index=len(self.output) - 1, item=item)]
        if item["type"] == "message":
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=len(self.output) - 1,
                                  content_index=0, part=item["content"][0]))
        return out

    def _close(self, status: str = "completed") -> list[str]:
        item = self.current
        if item is None:
            return []
        self.current = None
        item["status"] = status
        index = self.output.index(item)
        out = []
        if item["type"] == "reasoning":
            out.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                  content_index=0, text=item["content"][0]["text"]))
        elif item["type"] == "message":
            part = item["content"][0]
            out.append(self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                  content_index=0, text=part["text"], logprobs=part["logprobs"]))
            out.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                  content_index=0, part=part))
        else:
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  name=item["name"], arguments=item["arguments"]))
        out.append(self.event("response.output_item.done", output_index=index, item=item))
        return out

    def _text(self, delta: str, logprobs: list[dict[str, Any]]) -> list[str]:
        out = []
        if self.current is None or self.current["type"] != "message":
            out += self._close()
            out += self._open(message_item("", status="in_progress"))
        assert self.current is not None
        part = self.current["content"][0]
        part["text"] += delta
        part["logprobs"] += logprobs
        out.append(self.event("response.output_text.delta", item_id=self.current["id"],
                              output_index=len(self.output) - 1, content_index=0, delta=delta, logprobs=logprobs))
        return out

    def _thinking(self, delta: str) -> list[str]:
        out = []
        if self.current is None or self.current["type"] != "reasoning":
            out += self._close()
            out += self._open(reasoning_item("", status="in_progress"))
        assert self.current is not None
        self.current["content"][0]["text"] += delta
        out.append(self.event("response.reasoning_text.delta", item_id=self.current["id"],
                              output_index=len(self.output) - 1, content_index=0, delta=delta))
        return out

    def _call(self, call: dict[str, Any]) -> list[str]:
        out = []
        fn = call.get("function") or {}
        if call.get("id"):  # a new call: its id and name come first, then its arguments in fragments
            out += self._close()
            out += self._open(function_call_item(call["id"], fn.get("name", ""), "", status="in_progress"))
        fragment = fn.get("arguments")
        if fragment and self.current is not None and self.current["type"] == "function_call":
            self.current["arguments"] += fragment
            out.append(self.event("response.function_call_arguments.delta", item_id=self.current["id"],
                                  output_index=len(self.output) - 1, delta=fragment))
        return out

    # ------------------------------------------------------------ the stream
    async def run(self, chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
        draft = self.draft
        yield self.event("response.created", response=draft.body("in_progress", []))
        yield self.event("response.in_progress", response=draft.body("in_progress", []))
        finish: str | None = None
        usage: dict[str, int] | None = None
        error: str | None = None
        try:
            async for chunk in chunks:
                if "error" in chunk:  # the chat stream failed after it started
                    error = str((chunk["error"] or {}).get("message", "generation failed"))
                    break
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    logprobs = (choice.get("logprobs") or {}).get("content") or []
                    if delta.get("reasoning_content"):
                        for event in self._thinking(delta["reasoning_content"]):
                            yield event
                    if delta.get("content") or logprobs:
                        for event in self._text(delta.get("content") or "", logprobs):
                            yield event
                    for call in delta.get("tool_calls") or []:
                        for event in self._call(call):
                            yield event
                    finish = choice.get("finish_reason") or finish
        except Exception as e:  # a bug here: the client still gets a response that says so
            logger.exception("a Responses stream failed")
            error = f"internal error: {type(e).__name__}: {e}"
        if not self.output:  # nothing generated: still one (empty) message, as the API always has one
            for event in self._open(message_item("", status="in_progress")):
                yield event
        response = draft.final(self.output, finish, usage, error)  # sets every item's final status
        if self.current is not None:
            for event in self._close(self.current["status"]):
                yield event
        self.keep(response)
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
            response["status"], "response.failed")
        yield self.event(kind, response=response)

