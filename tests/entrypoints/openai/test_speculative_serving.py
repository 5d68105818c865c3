"""The server with --speculative-config: the openai client gets the tokens of plain decoding, and
/metrics counts the drafts as vLLM names them."""

from __future__ import annotations

import json

import openai
import pytest

from pagellm import LLM, SamplingParams
from tests.engine.test_spec_decode import NGRAM, looping_prompts
from tests.entrypoints.openai.server_utils import RemoteServer


@pytest.fixture(scope="module")
def server(llama_path):
    srv = RemoteServer(llama_path, ["--max-model-len", "256", "--num-kv-blocks", "64", "--block-size", "8",
                                    "--speculative-config", json.dumps(NGRAM)])
    yield srv
    srv.stop()


def test_completions_are_plain_decodings_tokens_and_drafts_are_counted(server, llama_path):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    model = client.models.list().data[0].id
    prompt = looping_prompts(1, LLM(str(llama_path), max_model_len=64).llm_engine.vocab_size)[0]
    out = client.completions.create(model=model, prompt=prompt, max_tokens=32, temperature=0,
                                    extra_body={"ignore_eos": True})
    want = LLM(str(llama_path), max_model_len=256).generate(
        [{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
        use_tqdm=False)[0].outputs[0].text
    assert out.choices[0].text == want and out.usage.completion_tokens == 32
    drafts = server.metric("pagellm_spec_decode_num_draft_tokens_total")
    assert drafts >= server.metric("pagellm_spec_decode_num_drafts_total") > 0
    assert 0 <= server.metric("pagellm_spec_decode_num_accepted_tokens_total") <= drafts


def test_a_wrong_configuration_stops_the_server_with_the_reason(llama_path):
    with pytest.raises(RuntimeError, match="num_speculative_tokens must be an integer from 1 to 32"):
        RemoteServer(llama_path, ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'],
                     timeout=60)


def test_a_draft_model_serves_the_plain_tokens_and_its_drafts_are_counted(llama_path):
    draft = {"model": str(llama_path), "num_speculative_tokens": 3}  # (the target as its own draft: all kept)
    srv = RemoteServer(llama_path, ["--max-model-len", "256", "--num-kv-blocks", "64", "--block-size", "8",
                                    "--speculative-config", json.dumps(draft)])
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none")
        prompt = looping_prompts(2, LLM(str(llama_path), max_model_len=64).llm_engine.vocab_size)[1]
        out = client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=24,
                                        temperature=0, extra_body={"ignore_eos": True})
        want = LLM(str(llama_path), max_model_len=256).generate(
            [{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
            use_tqdm=False)[0].outputs[0].text
        assert out.choices[0].text == want
        drafts = srv.metric("pagellm_spec_decode_num_draft_tokens_total")
        assert drafts > 0 and srv.metric("pagellm_spec_decode_num_accepted_tokens_total") >= 0.9 * drafts
    finally:
        srv.stop()
