"""Batch invariance (``--batch-invariant``, on by default): a seeded request's tokens do not depend on
what else is in the batch, on the prefix cache, on how its prompt is chunked or on preemption."""

from __future__ import annotations

import random

import pytest

from pagellm import LLM, SamplingParams
from pagellm.kernels import native
from pagellm.model.default_model import DEFAULT_MODEL_INSTALL, embedded_gguf_path
from pagellm.model.quant_linear import QuantLinear
from tests.helpers import assert_all_blocks_free, random_prompts

VOCAB = 500
TARGETS = random_prompts([9, 40, 75], vocab=VOCAB, seed=3)
_rng = random.Random(4)
OTHERS = random_prompts([_rng.randrange(5, 90) for _ in range(61)], vocab=VOCAB, seed=5)
TARGET_SEEDS = [11, 12, 13]

needs_kernels = pytest.mark.skipif(native.load() is None, reason="native kernels unavailable")
# dense: the float32 checkpoint's own weights; q4_0: quantized at load, on the quantized kernels,
# where decodes take int8 inputs and prompts float ones.
MODELS = ["dense", pytest.param("q4_0", marks=needs_kernels)]


def _llm(path, quantization: str, max_model_len: int = 256, **kwargs) -> LLM:
    return LLM(str(path), dtype="float32", max_model_len=max_model_len, block_size=4,
               quantization=None if quantization == "dense" else quantization, **kwargs)


def _tokens(llm: LLM, prompts: list[list[int]], seeds: list[int]) -> list[list[int]]:
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=24, ignore_eos=True) for s in seeds]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module", params=MODELS)
def model(request, llama_path):
    """(quantization, each target's tokens alone: a fresh engine, its prompt in one chunk)."""
    alone = []
    for prompt, seed in zip(TARGETS, TARGET_SEEDS):
        llm = _llm(llama_path, request.param, num_kv_blocks=256, enable_prefix_caching=False)
        alone += _tokens(llm, [prompt], [seed])
    if request.param != "dense":
        assert any(isinstance(m, QuantLinear) for m in llm.llm_engine.model.modules())
    return request.param, alone


def test_the_same_after_its_prompt_is_cached(llama_path, model):
    quantization, alone = model
    llm = _llm(llama_path, quantization, num_kv_blocks=256, max_num_batched_tokens=16,
               max_num_seqs=16)  # chunked prompts too
    assert _tokens(llm, TARGETS, TARGET_SEEDS) == alone
    manager = llm.llm_engine.kv_cache_manager
    hits_before = manager.prefix_cache_hits
    again = [_tokens(llm, [p], [s])[0] for p, s in zip(TARGETS, TARGET_SEEDS)]
    assert again == alone
    assert manager.prefix_cache_hits > hits_before
    assert_all_blocks_free(llm)


def test_the_same_in_a_batch_of_64_with_chunked_prompts(llama_path, model):
    quantization, alone = model
    llm = _llm(llama_path, quantization, num_kv_blocks=2048, max_num_batched_tokens=64, max_num_seqs=64,
               enable_prefix_caching=False)
    got = _tokens(llm, TARGETS + OTHERS, TARGET_SEEDS + list(range(100, 161)))
    assert got[:3] == alone
    assert llm.llm_engine.scheduler.stats.num_partial_prefills > 0  # prompts split over steps, mixed with decodes
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_the_same_when_preempted(llama_path, model, mode):
    quantization, alone = model
    llm = _llm(llama_path, quantization, max_model_len=128, num_kv_blocks=40, preemption_mode=mode, swap_space=0.05,
               max_num_batched_tokens=64, max_num_seqs=64, enable_prefix_caching=False)
    got = _tokens(llm, TARGETS + OTHERS[:8], TARGET_SEEDS + list(range(100, 108)))
    stats = llm.llm_engine.scheduler.stats
    assert (stats.num_swap_outs if mode == "swap" else stats.num_recomputes) > 0
    assert got[:3] == alone
    assert_all_blocks_free(llm)



@needs_kernels
@pytest.mark.skipif(embedded_gguf_path() is None,
                    reason=f"the embedded model is not installed ({DEFAULT_MODEL_INSTALL})")
def test_a_prompt_all_cached_but_its_last_token_has_the_same_logprobs():
    # The token the cache leaves to compute is attended as in its prompt's own chunk the first time (a
    # one-token prefill on the native prefill kernel, not a decode): the real model's logprobs equal to
    # the bit, not only its tokens (block_size 16: 33 and 161 leave one token, 48 whole blocks).
    llm = LLM(str(embedded_gguf_path()), dtype="float32", max_model_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=5, ignore_eos=True)
    for length in (33, 48, 161):
        prompt = random_prompts([length], vocab=20000, seed=length)[0]

        def run(prompt: list[int] = prompt) -> list[dict[int, float]]:
            out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
            return [{t: lp.logprob for t, lp in step.items()} for step in out.logprobs]

        first = run()
        hits_before = llm.llm_engine.kv_cache_manager.prefix_cache_hits
        assert run() == first, f"a {length}-token prompt"
        assert llm.llm_engine.kv_cache_manager.prefix_cache_hits > hits_before
    assert_all_blocks_free(llm)
