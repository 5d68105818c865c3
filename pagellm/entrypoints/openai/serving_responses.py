"""``/v1/responses``: OpenAI's Responses API on the chat path.

A request becomes a chat request (``responses_protocol``), which ``OpenAIServingChat.chat`` runs as
any other (template, structured outputs, tool calls); its chat.completion, or its stream of
chat.completion.chunk events, becomes a response object or the Responses API's typed events
(``responses_events``). Responses are kept in ``ResponsesStore`` for ``GET``, ``DELETE`` and
``previous_response_id``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from pagellm.entrypoints.openai.errors import APIError, from_validation_error
from pagellm.entrypoints.openai.responses_events import ResponseEvents, chat_sse_payloads
from pagellm.entrypoints.openai.responses_protocol import (
    ResponseDraft,
    ResponsesRequest,
    chat_request,
    flat_tools,
    function_call_item,
    in_responses_terms,
    input_items,
    message_item,
    new_id,
    reasoning_item,
)
from pagellm.entrypoints.openai.responses_store import ResponsesStore, StoredResponse
from pagellm.entrypoints.openai.serving_chat import OpenAIServingChat


def output_items(choice: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat choice's message as output items: its thinking (with a reasoning parser), its text (if
    any, or if there is nothing else: a response has an item), then one ``function_call`` per call."""
    message = choice["message"]
    calls = message.get("tool_calls") or []
    items = [reasoning_item(message["reasoning_content"])] if message.get("reasoning_content") else []
    if message.get("content") or not (calls or items):
        logprobs = (choice.get("logprobs") or {}).get("content")
        items.append(message_item(message.get("content") or "", logprobs))
    items += [function_call_item(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls]
    return items


def stored_input_items(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as ``input_items`` lists them: each with an id, messages' text as content parts."""
    out = []
    for item in items:
        item = dict(item)
        if item.get("type", "message") == "message" and "role" in item:
            item["type"] = "message"
            if isinstance(item.get("content"), str):
                kind = "output_text" if item["role"] == "assistant" else "input_text"
                item["content"] = [{"type": kind, "text": item["content"]}]
            item.setdefault("status", "completed")
        item.setdefault("id", new_id({"message": "msg", "function_call": "fc"}.get(item.get("type", ""), "item")))
        out.append(item)
    return out


class OpenAIServingResponses:
    """The Responses API over the chat handler ``chat`` and the ``store``."""

    def __init__(self, chat: OpenAIServingChat, store: ResponsesStore) -> None:
        self.chat = chat
        self.store = store

    async def create(self, req: ResponsesRequest, http: HTTPRequest) -> Any:
        req.check()
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            previous = self.store.get(req.previous_response_id)
            if previous is None:
                raise APIError(400, self.store.missing(req.previous_response_id), param="previous_response_id",
                               code="previous_response_not_found")
            history = previous.context
        tools = flat_tools(req.tools)
        try:
            chat_req = chat_request(req, history, tools)
            result = await self.chat.chat(chat_req, http)
        except ValidationError as e:
            raise in_responses_terms(from_validation_error(e)) from e
        except APIError as e:
            raise in_responses_terms(e) from e
        draft = ResponseDraft(req, tools, self.chat.model_name, self.chat.defaults)

        def keep(response: dict[str, Any]) -> None:
            if req.store is not False:
                items = input_items(req.input)
                self.store.put(draft.id, StoredResponse(response, stored_input_items(items),
                                                        [*history, *items, *response["output"]]))

        if req.stream:
            assert isinstance(result, StreamingResponse)
            events = ResponseEvents(draft, keep)
            return StreamingResponse(events.run(chat_sse_payloads(result.body_iterator)),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        if not isinstance(result, dict):  # the client went away (a 499 nobody reads)
            return result
        (choice,) = result["choices"]
        response = draft.final(output_items(choice), choice["finish_reason"], result["usage"])
        keep(response)
        return response

    def retrieve(self, response_id: str) -> dict[str, Any]:
        entry = self.store.get(response_id)
        if entry is None:
            raise APIError(404, self.store.missing(response_id), param="response_id", code="response_not_found")
        return entry.response

    def delete(self, response_id: str) -> dict[str, Any]:
        if not self.store.delete(response_id):
            raise APIError(404, self.store.missing(response_id), param="response_id", code="response_not_found")
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    def list_input_items(self, response_id: str, order: str = "desc", limit: int = 20,
                         after: str | None = None) -> dict[str, Any]:
        """``GET /v1/responses/{id}/input_items``: the response's input items, a page at a time."""
        entry = self.store.get(response_id)
        if entry is None:
            raise APIError(404, self.store.missing(response_id), param="response_id", code="response_not_found")
        if order not in ("asc", "desc"):
            raise APIError(400, f"order must be 'asc' or 'desc', got {order!r}", param="order")
        if not 1 <= limit <= 100:
            raise APIError(400, f"limit must be between 1 and 100, got {limit}", param="limit")
        items = entry.input_items if order == "asc" else entry.input_items[::-1]
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise APIError(400, f"after names no input item of this response: {after!r}", param="after")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


def add_responses_routes(app: FastAPI, responses: OpenAIServingResponses,
                         parse_body: Callable[[HTTPRequest, type[ResponsesRequest]], Awaitable[ResponsesRequest]],
                         openapi_extra: dict[str, Any] | None = None, stream_responses: dict | None = None) -> None:
    """``POST /v1/responses``, ``GET``/``DELETE /v1/responses/{id}``, its ``input_items`` and
    ``cancel`` (which only background responses could use)."""

    @app.post("/v1/responses", openapi_extra=openapi_extra, responses=stream_responses)
    async def create_response(request: HTTPRequest) -> Any:
        return await responses.create(await parse_body(request, ResponsesRequest), request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> dict[str, Any]:
        return responses.retrieve(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict[str, Any]:
        return responses.delete(response_id)

    @app.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(response_id: str, order: str = "desc", limit: int = 20,
                                   after: str | None = None) -> dict[str, Any]:
        return responses.list_input_items(response_id, order, limit, after)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str) -> JSONResponse:
        responses.retrieve(response_id)  # a 404 first, for an id that is not stored
        raise APIError(400, "only background responses can be cancelled, and this server runs none "
                            "(background: true is refused)", param="response_id")

