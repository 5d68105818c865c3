"""A chat stream read back as the Responses API's typed events, without a server: text then calls,
a stream cut by its limit, and one that fails half-way."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from pagellm.entrypoints.openai.responses_events import ResponseEvents, chat_sse_payloads
from pagellm.entrypoints.openai.responses_protocol import ResponseDraft, ResponsesRequest
from pagellm.entrypoints.openai.serving import sse

USAGE = {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None, usage: dict | None = None) -> str:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
    return sse({"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": choices, "usage": usage})


async def source(chunks: list[str]) -> AsyncIterator[str]:
    for c in chunks:
        yield c


def run(chunks: list[str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The events sent, and what was stored."""
    kept: list[dict[str, Any]] = []
    draft = ResponseDraft(ResponsesRequest(input="Hi"), [], "m", {})
    events = ResponseEvents(draft, kept.append)

    async def collect() -> list[str]:
        return [e async for e in events.run(chat_sse_payloads(source(chunks)))]

    out = []
    for text in asyncio.run(collect()):
        head, data = text.strip().split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert head == f"event: {payload['type']}"
        out.append(payload)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out, kept


def test_text_then_two_calls():
    call = {"index": 0, "id": "call_a", "type": "function", "function": {"name": "f", "arguments": ""}}
    events, kept = run([
        chunk({"role": "assistant", "content": ""}), chunk({"content": "Let me "}), chunk({"content": "see."}),
        chunk({"tool_calls": [call]}), chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"x":'}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": " 1}"}}]}),
        chunk({"tool_calls": [{**call, "index": 1, "id": "call_b", "function": {"name": "g", "arguments": "{}"}}]}),
        chunk({}, finish="tool_calls"), chunk(usage=USAGE), "data: [DONE]\n\n",
    ])
    kinds = [e["type"] for e in events]
    assert kinds == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["message", "function_call", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "Let me see."
    assert final["output"][1]["arguments"] == '{"x": 1}' and final["output"][1]["call_id"] == "call_a"
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.done"] == [0, 1, 2]
    assert final["usage"] == {"input_tokens": 7, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 5,
                              "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 12}
    assert final["status"] == "completed" and all(i["status"] == "completed" for i in final["output"])
    assert kept == [final]


def test_a_stream_cut_by_its_limit_is_incomplete():
    events, _ = run([chunk({"content": "abc"}), chunk({}, finish="length"), chunk(usage=USAGE), "data: [DONE]\n\n"])
    final = events[-1]
    assert final["type"] == "response.incomplete"
    assert final["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["response"]["output"][0]["status"] == "incomplete"
    assert events[-2]["type"] == "response.output_item.done" and events[-2]["item"]["status"] == "incomplete"


def test_a_stream_that_fails_half_way_ends_failed_and_an_empty_one_has_a_message():
    error = sse({"error": {"message": "generation failed: boom", "type": "internal_server_error"}})
    events, kept = run([chunk({"content": "ab"}), error, "data: [DONE]\n\n"])
    final = events[-1]
    assert final["type"] == "response.failed" and final["response"]["status"] == "failed"
    assert final["response"]["error"] == {"code": "server_error", "message": "generation failed: boom"}
    assert final["response"]["output"][0]["content"][0]["text"] == "ab" and kept
    events, _ = run([chunk({}, finish="stop"), chunk(usage=USAGE), "data: [DONE]\n\n"])
    assert [e["type"] for e in events][2:] == [
        "response.output_item.added", "response.content_part.added", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]


def test_thinking_then_an_answer():
    events, _ = run([chunk({"reasoning_content": "Hmm, ", "reasoning": "Hmm, "}),
                     chunk({"reasoning_content": "two.", "reasoning": "two."}), chunk({"content": "2"}),
                     chunk({}, finish="stop"), chunk(usage=USAGE), "data: [DONE]\n\n"])
    kinds = [e["type"] for e in events]
    assert kinds[2:] == [
        "response.output_item.added", "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"]
    reasoning, message = events[-1]["response"]["output"]
    assert reasoning["type"] == "reasoning" and reasoning["id"].startswith("rs_") and reasoning["summary"] == []
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Hmm, two."}]
    assert message["content"][0]["text"] == "2"
