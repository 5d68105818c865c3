"""EngineArgs and memory sizes."""

from __future__ import annotations

import pytest

from pagellm.config import EngineArgs, parse_memory


@pytest.mark.parametrize(
    "text, expected",
    [("2GiB", 2 * 2**30), ("512MiB", 512 * 2**20), ("1.5GB", 1_500_000_000), ("1e9", 10**9), (4096, 4096),
     ("8 kib", 8192)],
)
def test_parse_memory(text, expected):
    assert parse_memory(text) == expected


@pytest.mark.parametrize("bad", ["lots", "2 GiBs", "-1GiB", 0, True])
def test_parse_memory_rejects_nonsense(bad):
    with pytest.raises(ValueError, match="memory size"):
        parse_memory(bad)


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("max_num_seqs", 0, "max_num_seqs"),
        ("max_model_len", -5, "max_model_len"),
        ("num_kv_blocks", 1.5, "num_kv_blocks"),
        ("kv_cache_memory", "huge", r"kv_cache_memory \(--kv-cache-memory\): memory size"),
        ("dtype", "fp8", "dtype"),
        ("load_format", "pt", "load_format"),
        ("seed", "x", r"seed \(--seed\) must be an integer in \[-2\*\*63, 2\*\*64 - 1\]"),
        ("seed", 2**70, r"seed \(--seed\) must be an integer in"),
        ("enable_prefix_caching", "no", r"enable_prefix_caching \(--enable-prefix-caching\) must be True or False"),
        ("block_size", True, "block_size"),
        ("swap_space", float("inf"), "swap_space .* finite"),
    ],
)
def test_engine_args_validation_names_the_flag(field, value, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(**{field: value})


# ----------------------------------------------------------------- vLLM's arguments
def test_vllm_arguments_that_scripts_pass_are_accepted(llama_path, caplog):
    from pagellm import LLM, SamplingParams

    with caplog.at_level("INFO"):
        llm = LLM(str(llama_path), max_model_len=64, gpu_memory_utilization=0.01, enforce_eager=True,
                  trust_remote_code=True, tensor_parallel_size=1, kv_cache_dtype="auto", seed=1, swap_space=0.5,
                  served_model_name=["a", "b"], disable_log_stats=True, tokenizer_mode="auto", revision=None,
                  distributed_executor_backend=None, max_seq_len_to_capture=8192)
    assert "trust_remote_code has no effect" in caplog.text
    assert "--gpu-memory-utilization 0.01" in caplog.text
    assert llm.llm_engine.args.served_model_names == ["a", "b"]
    out = llm.generate("Hello", SamplingParams(max_tokens=2, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 2


def test_gpu_memory_utilization_sizes_the_kv_cache_from_available_memory(llama_path):
    from pagellm import LLM
    from pagellm.worker.cpu_tuning import available_host_memory

    small = LLM(str(llama_path), max_model_len=64, gpu_memory_utilization=0.004)
    blocks = small.kv_cache_stats().total_blocks
    cache = small.llm_engine.cache_engine
    block_bytes = sum(k.nbytes + v.nbytes for k, v in cache.kv_caches) / cache.num_blocks
    expected = available_host_memory() * 0.004 / block_bytes
    assert 0.8 < blocks / expected < 1.25  # other processes' memory moves a little in between
    large = LLM(str(llama_path), max_model_len=64, gpu_memory_utilization=0.008).kv_cache_stats().total_blocks
    assert 1.6 < large / blocks < 2.5


@pytest.mark.parametrize("kwargs, match", [
    (dict(tensor_parallel_size=0), r"tensor_parallel_size \(--tensor-parallel-size\) must be a positive integer"),
    (dict(tensor_parallel_size=3, nnodes=2), "tensor_parallel_size 3 must be a multiple of nnodes 2"),
    (dict(tensor_parallel_size=2, nnodes=2, node_rank=2), r"node_rank \(--node-rank\) must be in \[0, nnodes=2\)"),
    (dict(tensor_parallel_size=2, nnodes=2), "--nnodes > 1 needs --master-port"),
    (dict(pipeline_parallel_size=2), r"pipeline_parallel_size \(--pipeline-parallel-size\) must be 1"),
    (dict(kv_cache_dtype="fp4"), r"kv_cache_dtype \(--kv-cache-dtype\) must be one of auto, fp8"),
    (dict(calculate_kv_scales=True), "calculate_kv_scales .* scales an fp8 KV cache"),
    (dict(quantization="awq"), "must be one of gguf, none, int8, q4_0, got 'awq'"),
    (dict(gpu_memory_utilization=0), r"must be a number in \(0, 1\]"),
    (dict(served_model_name=[]), "served_model_name"),
    (dict(tokenizer_mode="sentencepiece"), r"tokenizer_mode \(--tokenizer-mode\) must be one of auto, hf, slow"),
    (dict(revision=""), r"revision \(--revision\) must be a non-empty string"),
    (dict(tokenizer_revision=""), r"tokenizer_revision \(--tokenizer-revision\) must be a non-empty string"),
    (dict(enable_lora=True, tensor_parallel_size=2, nnodes=2, master_port=29500),
     "--enable-lora with --nnodes > 1 is not supported"),
    (dict(max_lora_rank=0), r"max_lora_rank \(--max-lora-rank\) must be a positive integer"),
    (dict(max_loras=4, max_cpu_loras=2), r"max_cpu_loras \(2\) must be at least max_loras \(4\)"),
])
def test_vllm_values_pagellm_cannot_honour_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs.from_kwargs(**kwargs)


def test_a_name_neither_engine_knows_is_still_unknown():
    with pytest.raises(TypeError, match="unknown engine argument.*gpu_memory_utilisation"):
        EngineArgs.from_kwargs(gpu_memory_utilisation=0.5)
