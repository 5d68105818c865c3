"""The Responses API's in-memory store (an LRU by count and bytes) and its translation of input items
into chat messages, without a server."""

from __future__ import annotations

import pytest

from pagellm.entrypoints.openai.errors import APIError
from pagellm.entrypoints.openai.responses_protocol import chat_messages
from pagellm.entrypoints.openai.responses_store import ResponsesStore, StoredResponse


def entry(text: str = "x") -> StoredResponse:
    return StoredResponse({"id": "r", "output": [text]}, [], [])


def test_the_least_recently_used_goes_first_and_the_404_says_so():
    store = ResponsesStore(max_responses=2, max_bytes=10**6)
    store.put("a", entry())
    store.put("b", entry())
    assert store.get("a") is not None  # a is now the most recently used
    store.put("c", entry())
    assert store.get("b") is None and store.get("a") is not None and len(store) == 2
    assert "evicted" in store.missing("b") and "--responses-store-max-responses" in store.missing("b")
    assert store.delete("a") and not store.delete("a")
    assert "was deleted" in store.missing("a")
    assert "no response with id 'zz'" in store.missing("zz")


def test_the_bytes_bound_evicts_too_and_a_response_over_it_is_not_stored():
    one = entry("y" * 100)
    store = ResponsesStore(max_responses=100, max_bytes=int(one.size * 2.5))
    for name in "abc":
        assert store.put(name, entry("y" * 100))
    assert store.get("a") is None and store.get("c") is not None
    assert store.bytes == 2 * one.size <= store.max_bytes
    assert not store.put("huge", entry("z" * 10_000))
    assert "too large" in store.missing("huge") and store.bytes == 2 * one.size
    store.put("c", entry())  # replacing an entry frees its bytes
    assert store.bytes == one.size + entry().size


def test_forgotten_ids_are_bounded():
    store = ResponsesStore(max_responses=1, max_bytes=10**6)
    for i in range(200):
        store.put(str(i), entry())
    assert "evicted" in store.missing("198") and "no response" in store.missing("0")


def test_items_become_chat_messages():
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                                       {"type": "input_text", "text": "in Oslo?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Look."}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "weather", "arguments": "{}"},
        {"type": "function_call", "id": "fc_2", "call_id": "call_2", "name": "time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "noon"}]},
    ]
    messages = chat_messages(items)
    assert [m["role"] for m in messages] == ["developer", "user", "assistant", "tool", "tool"]
    assert messages[1]["content"] == "Weather in Oslo?"
    assert messages[2]["reasoning_content"] == "Look."
    assert messages[2]["content"] == "Let me look." and [c["id"] for c in messages[2]["tool_calls"]] == [
        "call_1", "call_2"]
    assert messages[3] == {"role": "tool", "tool_call_id": "call_1", "content": "sunny", "name": "weather"}
    assert messages[4]["content"] == "noon"


@pytest.mark.parametrize(("item", "param"), [
    ({"role": "robot", "content": "hi"}, "input.0.role"),
    ({"type": "function_call", "name": "f", "arguments": "{}"}, "input.0.call_id"),
    ({"type": "function_call_output", "call_id": "c", "output": 3}, "input.0.output"),
    ({"type": "web_search_call", "id": "ws_1"}, "input.0.type"),
    ("just text", "input.0"),
])
def test_a_bad_item_is_a_400_naming_it(item, param):
    with pytest.raises(APIError) as e:
        chat_messages([item])
    assert e.value.status == 400 and e.value.param == param
