"""The Responses API with ``--reasoning-parser``: the thinking is a ``reasoning`` item before the answer,
streamed as ``response.reasoning_text`` events. The tiny model's template opens the thinking in the
prompt (as test_reasoning.py's), so what it generates is thinking until the limit."""

from __future__ import annotations

import openai
import pytest

from tests.entrypoints.openai.server_utils import RemoteServer
from tests.entrypoints.openai.test_reasoning import ASK, MODEL, TEMPLATE


@pytest.fixture(scope="module")
def server(llama_path):
    srv = RemoteServer(llama_path, ["--served-model-name", MODEL, "--max-model-len", "512", "--num-kv-blocks", "64",
                                    "--reasoning-parser", "qwen3", "--chat-template", TEMPLATE])
    yield srv
    assert srv.stop() == 0


def test_the_thinking_is_a_reasoning_item_plain_and_streamed(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    chat = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, temperature=0)
    thinking = chat.choices[0].message.model_extra["reasoning_content"]
    assert thinking
    r = client.responses.create(model=MODEL, input=ASK, max_output_tokens=8, temperature=0,
                                reasoning={"effort": "low"})
    (item,) = r.output  # all thinking, cut by the limit: no message
    assert item.type == "reasoning" and item.id.startswith("rs_") and item.content[0].text == thinking
    assert r.status == "incomplete" and r.reasoning.effort == "low" and r.output_text == ""
    events = list(client.responses.create(model=MODEL, input=ASK, max_output_tokens=8, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[2] == "response.output_item.added" and events[2].item.type == "reasoning"
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    done = next(e for e in events if e.type == "response.reasoning_text.done")
    assert "".join(deltas) == done.text == thinking
    assert kinds[-1] == "response.incomplete" and events[-1].response.output[0].content[0].text == thinking
    # Sent back, a reasoning item is the next assistant message's reasoning_content.
    back = client.responses.create(model=MODEL, input=[*ASK, item.model_dump(), {"role": "assistant", "content": "4"},
                                                       {"role": "user", "content": "And 3 + 3?"}], max_output_tokens=2)
    assert back.usage.input_tokens > r.usage.input_tokens
