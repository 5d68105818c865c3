"""LangChain's `ChatOpenAI` (langchain-openai) against the real server: invoke and stream."""

from __future__ import annotations

import pytest

from tests.peers.conftest import API_KEY, MESSAGES, MODEL

pytestmark = pytest.mark.peers


@pytest.fixture
def chat(server):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=MODEL, base_url=server.url + "/v1", api_key=API_KEY, temperature=0, max_tokens=8,
                      max_retries=0, stream_usage=True)


def test_invoke_answers_what_the_openai_client_gets(chat, reference_chat):
    msg = chat.invoke([("system", MESSAGES[0]["content"]), ("human", MESSAGES[1]["content"])])
    ref = reference_chat.choices[0]
    assert msg.content == ref.message.content and msg.content
    assert msg.response_metadata["finish_reason"] == ref.finish_reason
    assert msg.response_metadata["model_name"] == MODEL
    assert msg.usage_metadata["input_tokens"] == reference_chat.usage.prompt_tokens
    assert msg.usage_metadata["output_tokens"] == reference_chat.usage.completion_tokens


def test_stream_adds_up_to_the_invoked_answer(chat, reference_chat):
    chunks = list(chat.stream([("system", MESSAGES[0]["content"]), ("human", MESSAGES[1]["content"])]))
    assert sum(1 for c in chunks if c.content) > 1  # token by token, not one block
    total = chunks[0]
    for c in chunks[1:]:
        total = total + c
    assert total.content == reference_chat.choices[0].message.content
    assert total.response_metadata["finish_reason"] == reference_chat.choices[0].finish_reason
    assert total.usage_metadata["input_tokens"] == reference_chat.usage.prompt_tokens
    assert total.usage_metadata["output_tokens"] == reference_chat.usage.completion_tokens
