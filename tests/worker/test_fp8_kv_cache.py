"""--kv-cache-dtype fp8: one byte per K/V element (twice the blocks of bfloat16, four times float32's),
per-layer scales, the same block moves (swap, copy-on-write, prefix caching) as any pool."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.model.default_model import DEFAULT_MODEL_INSTALL, build_checkpoint, embedded_gguf_path
from pagellm.model.llama import Attention
from tests.helpers import assert_all_blocks_free, random_prompts


@pytest.fixture(scope="module")
def plain_path(tmp_path_factory) -> Path:
    # The default init (0.02): activations of a trained model's size, within fp8's range.
    return build_checkpoint(tmp_path_factory.mktemp("fp8") / "llama", "llama", seed=3, num_key_value_heads=2)


def prompt_logprobs(llm: LLM, prompts: list[list[int]]) -> list[list[float]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0), use_tqdm=False)
    return [[d[t].logprob for d, t in zip(o.prompt_logprobs[1:], p[1:])] for o, p in zip(outs, prompts)]


def test_an_fp8_pool_holds_twice_the_blocks_of_bfloat16(plain_path):
    blocks = {}
    for dtype, kv in (("float32", "auto"), ("bfloat16", "auto"), ("float32", "fp8"), ("bfloat16", "fp8_e5m2")):
        llm = LLM(str(plain_path), dtype=dtype, kv_cache_dtype=kv, kv_cache_memory="8MiB", max_model_len=256)
        blocks[dtype, kv] = llm.llm_engine.kv_cache_manager.num_blocks
        k_pool = llm.llm_engine.cache_engine.kv_caches[0][0]
        assert k_pool.element_size() == (1 if kv != "auto" else getattr(torch, dtype).itemsize)
    assert blocks["float32", "fp8"] == blocks["bfloat16", "fp8_e5m2"] == 2 * blocks["bfloat16", "auto"]
    assert blocks["float32", "fp8"] == 4 * blocks["float32", "auto"]


@pytest.mark.parametrize("kv, calculate", [("fp8", None), ("fp8", False),
                                           pytest.param("fp8_e4m3", True, marks=pytest.mark.slow),
                                           pytest.param("fp8_e5m2", False, marks=pytest.mark.slow)])
def test_fp8_logprobs_stay_close(plain_path, kv, calculate):
    """Scaled by default (calculate None), unscaled with --no-calculate-kv-scales."""
    prompts = random_prompts([30, 90], vocab=500, seed=2)
    want = prompt_logprobs(LLM(str(plain_path), dtype="float32", max_model_len=256, num_kv_blocks=64), prompts)
    llm = LLM(str(plain_path), dtype="float32", max_model_len=256, num_kv_blocks=64, kv_cache_dtype=kv,
              calculate_kv_scales=calculate)
    got = prompt_logprobs(llm, prompts)
    diffs = [abs(a - b) for x, y in zip(want, got) for a, b in zip(x, y)]
    assert statistics.mean(diffs) < (0.02 if kv != "fp8_e5m2" else 0.04), statistics.mean(diffs)
    layers = [m for m in llm.llm_engine.model.modules() if isinstance(m, Attention)]
    scaled = [m.k_scale != 1.0 and m.v_scale != 1.0 for m in layers]
    assert all(scaled) if calculate is not False else not any(scaled)


@pytest.mark.parametrize("mode", ["swap", pytest.param("recompute", marks=pytest.mark.slow)])
def test_preemption_and_prefix_caching_keep_the_fp8_tokens(plain_path, mode):
    shared = random_prompts([20], vocab=500, seed=4)[0]
    prompts = [shared + p for p in random_prompts([3, 9, 30], vocab=500, seed=5)] + random_prompts([50], 500, 6)
    params = SamplingParams(temperature=0, max_tokens=24)
    roomy = LLM(str(plain_path), dtype="float32", kv_cache_dtype="fp8", max_model_len=160, num_kv_blocks=256,
                block_size=4, enable_prefix_caching=False)
    want = [o.outputs[0].token_ids for o in roomy.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                          use_tqdm=False)]
    tight = LLM(str(plain_path), dtype="float32", kv_cache_dtype="fp8", max_model_len=160, num_kv_blocks=40,
                block_size=4, preemption_mode=mode, swap_space=0.01, enable_prefix_caching=True)
    for _ in range(2):  # the second time from the prefix cache
        got = [o.outputs[0].token_ids for o in tight.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                             use_tqdm=False)]
        assert got == want
    assert tight.llm_engine.scheduler.stats.num_preemptions > 0
    assert tight.llm_engine.kv_cache_manager.prefix_cache_hits > 0
    assert_all_blocks_free(tight)


MISSING = f"the embedded model wheel is missing: {DEFAULT_MODEL_INSTALL}"


@pytest.mark.skipif(embedded_gguf_path() is None, reason=MISSING)
def test_smollm2_answers_the_same_with_an_fp8_cache_by_default():
    """The real model's K and V values are far below fp8's range in many layers: unscaled, they round
    away and the answer turns to noise; the scales computed by default keep it."""
    path = str(embedded_gguf_path())
    question = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(temperature=0, max_tokens=12)
    answers = {kv: LLM(path, max_model_len=512, kv_cache_memory="32MiB", kv_cache_dtype=kv)
               .chat(question, params, use_tqdm=False)[0].outputs[0].text for kv in ("auto", "fp8")}
    assert "Paris" in answers["auto"] and "Paris" in answers["fp8"], answers


@pytest.mark.slow
@pytest.mark.skipif(embedded_gguf_path() is None, reason=MISSING)
def test_smollm2_greedy_choices_agree_on_nine_tokens_in_ten():
    """Each position of a 300-token greedy answer scored with the same history: the fp8 cache picks
    the same next token at >= 90% of them."""
    path = str(embedded_gguf_path())
    base = LLM(path, dtype="float32", max_model_len=1024, kv_cache_memory="64MiB")
    out = base.chat([{"role": "user", "content": "Explain how a refrigerator works."}],
                    SamplingParams(temperature=0, max_tokens=300), use_tqdm=False)[0]
    seq, start = list(out.prompt_token_ids) + list(out.outputs[0].token_ids), len(out.prompt_token_ids)

    def choices(llm: LLM) -> list[int]:
        (r,) = llm.generate([{"prompt_token_ids": seq}], SamplingParams(max_tokens=1, prompt_logprobs=1),
                            use_tqdm=False)
        return [max(d.items(), key=lambda kv: kv[1].logprob)[0] for d in r.prompt_logprobs[start:]]

    want = choices(base)
    got = choices(LLM(path, dtype="float32", max_model_len=1024, kv_cache_memory="64MiB", kv_cache_dtype="fp8"))
    assert sum(a == b for a, b in zip(want, got)) >= 0.9 * len(want)
