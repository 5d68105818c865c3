"""vLLM's engine arguments through ``LLM(...)``: max_logprobs, hf_overrides and override_generation_config act
as in vLLM; the rest are accepted, logged once as having no effect; bad values are named."""

from __future__ import annotations

import logging

import pytest

from pagellm import LLM, EngineArgs, SamplingParams


def test_hf_overrides_set_the_models_config(llama_path):
    llm = LLM(str(llama_path), hf_overrides={"max_position_embeddings": 96}, num_kv_blocks=16)
    assert llm.llm_engine.max_model_len == 96 and llm.llm_engine.model_config.max_position_embeddings == 96
    with pytest.raises(ValueError, match="max_model_len=128 is larger than the model's max_position_embeddings=96"):
        LLM(str(llama_path), hf_overrides={"max_position_embeddings": 96}, max_model_len=128)


def test_max_logprobs_caps_and_lifts_the_logprobs_a_request_may_ask(llama_path):
    llm = LLM(str(llama_path), max_model_len=64, num_kv_blocks=16, max_logprobs=2)
    out = llm.generate("Hello", SamplingParams(max_tokens=2, logprobs=2), use_tqdm=False)
    assert len(out[0].outputs[0].logprobs[0]) >= 2
    with pytest.raises(ValueError, match=r"logprobs=3 is more than this engine allows \(max_logprobs 2\)"):
        llm.generate("Hello", SamplingParams(max_tokens=2, logprobs=3), use_tqdm=False)
    # Above vLLM's default of 20 once the engine allows it; never past the vocabulary.
    wide = LLM(str(llama_path), max_model_len=64, num_kv_blocks=16, max_logprobs=-1)
    out = wide.generate("Hello", SamplingParams(max_tokens=1, logprobs=30), use_tqdm=False)
    assert len(out[0].outputs[0].logprobs[0]) >= 30
    with pytest.raises(ValueError, match="more than the model's vocabulary of 512 tokens"):
        wide.generate("Hello", SamplingParams(max_tokens=1, logprobs=600), use_tqdm=False)


def test_override_generation_config_sets_the_defaults(llama_path):
    llm = LLM(str(llama_path), max_model_len=64, num_kv_blocks=16,
              override_generation_config={"temperature": 0.7, "max_new_tokens": 3, "top_k": 5})
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.max_tokens, params.top_k) == (0.7, 3, 5)
    out = llm.generate("Hello", SamplingParams(**{**llm.llm_engine.default_sampling_fields, "ignore_eos": True}),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    # With --generation-config vllm the overrides stand alone.
    alone = LLM(str(llama_path), max_model_len=64, num_kv_blocks=16, generation_config="vllm",
                override_generation_config={"top_p": 0.5})
    assert alone.llm_engine.default_sampling_fields == {"top_p": 0.5}


def test_engine_args_without_effect_are_logged_once_each(llama_path, caplog):
    kwargs = dict(max_model_len=64, num_kv_blocks=16, tokenizer_mode="mistral", revision="v1", download_dir="/d",
                  distributed_executor_backend="ray", max_seq_len_to_capture=4096, max_parallel_loading_workers=4,
                  compilation_config=3, optimization_level=0, async_scheduling=True)
    with caplog.at_level(logging.INFO, logger="pagellm.engine"):
        LLM(str(llama_path), **kwargs)
        LLM(str(llama_path), **kwargs)
    lines = [r.getMessage() for r in caplog.records if "has no effect" in r.getMessage()]
    for flag in ("--tokenizer-mode mistral", "--revision v1", "--download-dir /d", "--distributed-executor-backend ray",
                 "--max-seq-len-to-capture 4096", "--max-parallel-loading-workers 4", "--compilation-config 3",
                 "--optimization-level 0", "--async-scheduling"):
        assert sum(line.startswith(flag + " has no effect: ") for line in lines) == 1, (flag, lines)


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_logprobs=-2), r"max_logprobs \(--max-logprobs\) must be an integer >= 0 \(or -1: no limit\)"),
    (dict(max_logprobs=True), r"max_logprobs \(--max-logprobs\) must be an integer"),
    (dict(hf_overrides="{bad json"), r"hf_overrides \(--hf-overrides\) is not valid JSON"),
    (dict(hf_overrides=[1]), r"hf_overrides \(--hf-overrides\) must be a JSON object"),
    (dict(override_generation_config={"temp": 1}), "has keys pagellm does not use: temp; it takes "
                                                   "generation_config.json's temperature, top_p"),
    (dict(compilation_config="fast"), r"compilation_config \(--compilation-config\) is not valid JSON"),
    (dict(compilation_config=4), "as a level must be 0, 1, 2 or 3"),
    (dict(optimization_level=9), r"optimization_level \(--optimization-level\) \(-O\) must be 0, 1, 2 or 3"),
    (dict(tokenizer_mode="fast"), "must be one of auto, hf, slow, mistral, custom"),
    (dict(distributed_executor_backend="spark"), "must be one of mp, uni, ray, external_launcher"),
    (dict(max_parallel_loading_workers=0), "must be a positive integer"),
    (dict(download_dir=""), r"download_dir \(--download-dir\) must be a non-empty string"),
])
def test_bad_values_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs.from_kwargs(**kwargs)


def test_bad_override_values_name_the_flag(llama_path):
    with pytest.raises(ValueError, match="--override-generation-config has sampling values pagellm cannot use "
                                         r"\(top_p must be a number in \(0, 1\]"):
        LLM(str(llama_path), max_model_len=64, num_kv_blocks=16, override_generation_config={"top_p": 7})


def test_chat_outputs_hold_the_rendered_prompt(llama_path):
    llm = LLM(str(llama_path), max_model_len=128, num_kv_blocks=16)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    out = llm.chat(messages, SamplingParams(max_tokens=2), use_tqdm=False)
    rendered = llm.get_tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert out[0].prompt == rendered
    assert out[0].prompt.endswith("<|assistant|>\n") and "<|user|>\nHello there" in out[0].prompt
