"""Tensor parallelism: the model split over two processes (gloo) gives the tokens of one process,
for every family, under chunked prefill, prefix caching and preemption; a worker that dies stops
the engine with a clear error instead of a hang."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.distributed.sharding import check_shardable, sharded_config
from pagellm.distributed.tensor_parallel import WorkerDiedError
from pagellm.model.default_model import build_checkpoint
from tests.helpers import assert_all_blocks_free, random_prompts

S, F = "sliding_attention", "full_attention"
_factors = torch.Generator().manual_seed(4)
LONGROPE = dict(rope_type="longrope", short_factor=(1 + torch.rand(6, generator=_factors)).tolist(),
                long_factor=(1 + 4 * torch.rand(6, generator=_factors)).tolist())

# One shape per family, each with heads (and intermediate sizes) that two ranks split; the KV heads
# split (2 over 2) or are replicated (1 over 2).
FAMILIES: dict[str, tuple[str, dict]] = {
    "llama-gqa": ("llama", dict(num_key_value_heads=2, initializer_range=0.2)),
    "qwen2-kv1-replicated": ("qwen2", dict(num_key_value_heads=1, tie_word_embeddings=True, initializer_range=0.2)),
    "qwen3": ("qwen3", dict(num_key_value_heads=2, head_dim=32, initializer_range=0.2)),
    "gemma2": ("gemma2", dict(num_key_value_heads=2, head_dim=32, num_hidden_layers=4, sliding_window=8,
                              query_pre_attn_scalar=32, attn_logit_softcapping=3.0, initializer_range=0.2)),
    "gemma3": ("gemma3_text", dict(num_key_value_heads=1, head_dim=32, num_hidden_layers=4, sliding_window=8,
                                   layer_types=[S, F, S, F], query_pre_attn_scalar=32, initializer_range=0.2)),
    "phi3-longrope": ("phi3", dict(num_key_value_heads=2, partial_rotary_factor=0.75, max_position_embeddings=256,
                                   original_max_position_embeddings=32, rope_scaling=LONGROPE,
                                   initializer_range=0.2)),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=96,
                                num_key_value_heads=2, initializer_range=0.2)),
    "qwen3-moe": ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                    num_hidden_layers=3, mlp_only_layers=[1], num_key_value_heads=2, head_dim=32,
                                    attention_bias=True, initializer_range=0.2)),
}

NEW_TOKENS = 16
# A small pool, a small step budget and prefix caching: the batch is chunked, shares a prefix and
# is preempted (swapped) on the way.
TIGHT = dict(dtype="float32", max_model_len=160, block_size=4, num_kv_blocks=48, max_num_batched_tokens=32,
             max_num_seqs=16, swap_space=0.05, enable_prefix_caching=True)


def family_batch(seed: int) -> list[list[int]]:
    prompts = random_prompts([1, 3, 17, 40, 90], vocab=500, seed=seed)
    shared = random_prompts([24], vocab=500, seed=seed + 1)[0]
    return prompts + [shared + [5, 6], shared + [7, 8, 9]]


def run(path: Path, prompts: list[list[int]], **kwargs) -> tuple[list[list[int]], LLM]:
    """The batch's greedy tokens, then those of its last two prompts again (from the prefix cache)."""
    llm = LLM(str(path), **kwargs)
    tokens = []
    for batch in (prompts, prompts[-2:]):
        outs = llm.generate([{"prompt_token_ids": p} for p in batch],
                            SamplingParams(temperature=0, max_tokens=NEW_TOKENS), use_tqdm=False)
        tokens += [list(o.outputs[0].token_ids) for o in outs]
    return tokens, llm


def assert_two_ranks_give_the_tokens_of_one(path: Path, prefix_hits: bool = True) -> None:
    prompts = family_batch(seed=3)
    one, _ = run(path, prompts, **TIGHT)
    two, llm = run(path, prompts, tensor_parallel_size=2, **TIGHT)
    try:
        assert two == one
        stats = llm.llm_engine.scheduler.stats
        assert stats.num_partial_prefills > 0 and stats.num_preemptions > 0
        assert (llm.llm_engine.kv_cache_manager.prefix_cache_hits > 0) == prefix_hits
        assert_all_blocks_free(llm)
    finally:
        llm.llm_engine.shutdown()


# Each family takes two processes' start-up: `make test` runs two shapes (KV heads split and
# replicated), `make test-slow` every family.
QUICK = ("llama-gqa", "qwen2-kv1-replicated")


@pytest.mark.parametrize("family", [f if f in QUICK else pytest.param(f, marks=pytest.mark.slow)
                                    for f in sorted(FAMILIES)])
def test_two_ranks_give_the_tokens_of_one(tmp_path, family):
    model_type, shape = FAMILIES[family]
    # Longrope: the repeated prompts are short, their first run's blocks were computed again with the
    # long factors once it outgrew the original length, so they serve no short prompt (phi3.py).
    assert_two_ranks_give_the_tokens_of_one(build_checkpoint(tmp_path / family, model_type, seed=5, **shape),
                                            prefix_hits="longrope" not in family)


@pytest.mark.slow
def test_recompute_preemption_and_bfloat16_logprobs(tmp_path):
    path = build_checkpoint(tmp_path / "llama", "llama", seed=5, num_key_value_heads=2, initializer_range=0.2)
    prompts = family_batch(seed=4)
    args = TIGHT | dict(preemption_mode="recompute")
    one, _ = run(path, prompts, **args)
    two, llm = run(path, prompts, tensor_parallel_size=2, **args)
    llm.llm_engine.shutdown()
    assert two == one
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=0)
    got = {}
    for tp in (1, 2):
        llm = LLM(str(path), dtype="bfloat16", max_model_len=160, num_kv_blocks=64, tensor_parallel_size=tp)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], params, use_tqdm=False)
        got[tp] = [(list(o.outputs[0].token_ids), [next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs])
                   for o in outs]
        llm.llm_engine.shutdown()
    for (tokens1, lps1), (tokens2, lps2) in zip(got[1], got[2]):
        n = next((i for i, (a, b) in enumerate(zip(tokens1, tokens2)) if a != b), len(tokens1))
        diffs = [abs(a - b) for a, b in zip(lps1[:n], lps2[:n])]
        assert n > 0 and max(diffs) < 0.1, (tokens1, tokens2, diffs)


def test_sharded_config_and_refusals():
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
    local = sharded_config(config, 2)
    assert (local.num_attention_heads, local.num_key_value_heads, local.head_dim) == (2, 1, 16)
    assert sharded_config(LlamaConfig(num_attention_heads=4, num_key_value_heads=1), 4).num_key_value_heads == 1
    with pytest.raises(ValueError, match="must divide the model's 4 attention heads"):
        check_shardable(config, 3)
    with pytest.raises(ValueError, match="key/value heads must divide one another"):
        check_shardable(LlamaConfig(hidden_size=96, num_attention_heads=12, num_key_value_heads=3,
                                    intermediate_size=96), 4)


@pytest.mark.slow
def test_a_killed_worker_stops_the_engine_with_a_clear_error(tmp_path):
    path = build_checkpoint(tmp_path / "llama", "llama", seed=5, num_key_value_heads=2, initializer_range=0.2)
    llm = LLM(str(path), dtype="float32", max_model_len=128, num_kv_blocks=64, tensor_parallel_size=2)
    try:
        driver = llm.llm_engine.tensor_parallel
        assert driver is not None
        assert llm.generate("hello", SamplingParams(max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids
        (worker,) = driver.procs
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(timeout=10)
        t0 = time.monotonic()
        with pytest.raises(WorkerDiedError, match=r"worker rank 1 \(pid \d+\) exited with code -9"):
            llm.generate("hello again", SamplingParams(max_tokens=4), use_tqdm=False)
        assert time.monotonic() - t0 < 30
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.slow
def test_a_worker_that_cannot_start_fails_the_start_at_once(tmp_path, monkeypatch):
    # A worker that dies before it joins (here: it cannot even read its settings) is noticed while
    # rank 0 waits for it, not when the rendezvous times out.
    import pagellm.distributed.tensor_parallel as tp

    def broken(args, first_rank, count, worker_module):
        import subprocess
        import sys
        return [subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"]) for _ in range(count)]

    monkeypatch.setattr(tp, "spawn_local_workers", broken)
    path = build_checkpoint(tmp_path / "llama", "llama", seed=5, num_key_value_heads=2)
    t0 = time.monotonic()
    with pytest.raises(WorkerDiedError, match="exited with code 3"):
        LLM(str(path), max_model_len=64, num_kv_blocks=16, tensor_parallel_size=2)
    assert time.monotonic() - t0 < 30
    monkeypatch.undo()  # and the process can start another one
    llm = LLM(str(path), max_model_len=64, num_kv_blocks=16, tensor_parallel_size=2)
    assert llm.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
    llm.llm_engine.shutdown()


@pytest.mark.slow
def test_rank_0_failing_after_the_workers_started_stops_them(tmp_path):
    path = build_checkpoint(tmp_path / "llama", "llama", seed=5, num_key_value_heads=2)
    with pytest.raises(ValueError, match="raise --kv-cache-memory"):  # a KV cache too small for max_model_len
        LLM(str(path), max_model_len=64, num_kv_blocks=2, tensor_parallel_size=2)
    llm = LLM(str(path), max_model_len=64, num_kv_blocks=16, tensor_parallel_size=2)  # nothing left behind
    llm.llm_engine.shutdown()


@pytest.mark.slow
def test_a_collected_or_closed_llm_frees_its_workers_for_the_next(tmp_path):
    """vLLM's way between engines: ``del llm; gc.collect()``, or a ``with`` block."""
    import gc

    path = build_checkpoint(tmp_path / "m", "llama", num_key_value_heads=2)
    params = SamplingParams(temperature=0, max_tokens=4)
    llm = LLM(str(path), max_model_len=64, num_kv_blocks=16, tensor_parallel_size=2)
    first = llm.generate("Hello", params, use_tqdm=False)[0].outputs[0].token_ids
    workers = list(llm.llm_engine.tensor_parallel.procs)
    del llm
    gc.collect()
    assert all(p.poll() is not None for p in workers)  # stopped, not left running
    with LLM(str(path), max_model_len=64, num_kv_blocks=16, tensor_parallel_size=2) as llm:
        assert llm.generate("Hello", params, use_tqdm=False)[0].outputs[0].token_ids == first
        workers = list(llm.llm_engine.tensor_parallel.procs)
    assert all(p.poll() is not None for p in workers)
    again = LLM(str(path), max_model_len=64, num_kv_blocks=16, tensor_parallel_size=2)
    assert again.generate("Hello", params, use_tqdm=False)[0].outputs[0].token_ids == first
    again.shutdown()
