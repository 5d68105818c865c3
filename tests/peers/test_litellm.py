"""LiteLLM's `completion` against the real server, plain and streamed, through both of its routes to an
OpenAI-compatible server: `openai/` (any compatible server) and `hosted_vllm/` (vLLM's)."""

from __future__ import annotations

import pytest

from tests.peers.conftest import API_KEY, MESSAGES, MODEL

pytestmark = pytest.mark.peers

PROVIDERS = ["openai", "hosted_vllm"]


@pytest.mark.parametrize("provider", PROVIDERS)
def test_completion_answers_what_the_openai_client_gets(server, reference_chat, provider):
    import litellm

    r = litellm.completion(model=f"{provider}/{MODEL}", api_base=server.url + "/v1", api_key=API_KEY,
                           messages=MESSAGES, max_tokens=8, temperature=0, num_retries=0)
    ref = reference_chat.choices[0]
    assert r.choices[0].message.content == ref.message.content and ref.message.content
    assert r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == reference_chat.usage.prompt_tokens
    assert r.usage.completion_tokens == reference_chat.usage.completion_tokens


@pytest.mark.parametrize("provider", PROVIDERS)
def test_streamed_completion_adds_up_to_the_same_answer(server, reference_chat, provider):
    import litellm

    stream = litellm.completion(model=f"{provider}/{MODEL}", api_base=server.url + "/v1", api_key=API_KEY,
                                messages=MESSAGES, max_tokens=8, temperature=0, num_retries=0, stream=True,
                                stream_options={"include_usage": True})
    chunks = list(stream)
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(pieces) > 1  # token by token, not one block
    ref = reference_chat.choices[0]
    assert "".join(pieces) == ref.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        ref.finish_reason]
    whole = litellm.stream_chunk_builder(chunks, messages=MESSAGES)
    assert whole.choices[0].message.content == ref.message.content
    assert whole.usage.completion_tokens == reference_chat.usage.completion_tokens
    assert whole.usage.prompt_tokens == reference_chat.usage.prompt_tokens
