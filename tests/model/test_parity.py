"""Greedy tokens identical to transformers, prompt logprobs within 1e-4, across block sizes."""

from __future__ import annotations

import pytest

from pagellm import LLM, SamplingParams
from pagellm.kernels import native
from tests.conftest import CHECKPOINTS
from tests.helpers import assert_all_blocks_free, hf_greedy, hf_prompt_logprobs, random_prompts
from tests.model.family_parity import assert_bfloat16_logprobs_close

PARITY_CHECKPOINTS = [name for name in CHECKPOINTS if name != "llama-long"]
NEW_TOKENS = 32
# Different lengths around block boundaries (1, 16 and 128 are the block sizes tested).
PROMPT_LENGTHS = [1, 3, 15, 16, 17, 40, 127, 130]
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def references(checkpoints):
    refs = {}
    for name in PARITY_CHECKPOINTS:
        path = checkpoints[name]
        prompts = random_prompts(PROMPT_LENGTHS, vocab=500, seed=len(name))
        refs[name] = (prompts, [hf_greedy(path, p, NEW_TOKENS) for p in prompts])
    return refs


@pytest.mark.parametrize("name", PARITY_CHECKPOINTS)
@pytest.mark.parametrize("block_size", [1, 16, 128])
def test_greedy_matches_transformers(checkpoints, references, name, block_size):
    prompts, expected = references[name]
    llm = LLM(str(checkpoints[name]), block_size=block_size, max_model_len=256, num_kv_blocks=4096 // block_size)
    # All 8 prompts in one generate call (mixed prefill and decode in the same steps) ...
    batch = llm.generate(prompts, GREEDY, use_tqdm=False)
    for out, want in zip(batch, expected):
        assert out.outputs[0].token_ids == want
    # ... and each prompt alone.
    for prompt, want in zip(prompts, expected):
        (out,) = llm.generate([prompt], GREEDY, use_tqdm=False)
        assert out.outputs[0].token_ids == want
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("name", PARITY_CHECKPOINTS)
def test_chunked_prefill_matches_transformers(checkpoints, references, name):
    prompts, expected = references[name]
    llm = LLM(str(checkpoints[name]), max_model_len=256, num_kv_blocks=256, max_num_batched_tokens=24, max_num_seqs=24)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("name", PARITY_CHECKPOINTS)
def test_prompt_logprobs_match_transformers(checkpoints, name):
    path = checkpoints[name]
    prompts = random_prompts([2, 37, 100], vocab=500, seed=7)
    # A small budget splits the prompts into chunks: logprobs must still line up.
    llm = LLM(str(path), max_model_len=256, num_kv_blocks=64, max_num_batched_tokens=32, max_num_seqs=32)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        lps = out.prompt_logprobs
        assert lps is not None and len(lps) == len(prompt) and lps[0] is None
        ours = [lps[i][tok].logprob for i, tok in enumerate(prompt) if i > 0]
        want = hf_prompt_logprobs(path, prompt).tolist()
        assert max(abs(a - b) for a, b in zip(ours, want)) < 1e-4
        # Each entry holds the actual token plus the top 2.
        assert all(len(e) in (2, 3) for e in lps[1:])
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("name", ["llama", "qwen2", "llama-hd64"])
def test_bfloat16_logprobs_close_to_transformers(checkpoints, name):
    """The bfloat16 path (packed linears on CPU, paged decode) scores tokens as transformers does in
    bfloat16: prompt logprobs from prefill, and each generated token's logprob from decode, against
    transformers scoring the same whole sequence."""
    # bfloat16 rounding alone moves these logprobs by up to ~0.15 (transformers in bfloat16 vs float32
    # on the same checkpoints); we stay within that of transformers in bfloat16.
    assert_bfloat16_logprobs_close(checkpoints[name], max_tokens=24, max_diff=0.15, mean_diff=0.03)


@pytest.mark.skipif(not native.linear_supported(),
                    reason="batch invariance is promised by the native bfloat16 linear (AVX512-BF16 without AMX)")
@pytest.mark.parametrize("name", ["qwen2", "llama-hd64"])
def test_bfloat16_outputs_do_not_depend_on_the_batch(checkpoints, name):
    """In bfloat16 a request gets the same tokens and the same logprobs, to the bit, alone or next to
    others (every kernel adds a row's terms in an order fixed by that row alone)."""
    path = checkpoints[name]
    prompts = random_prompts([5, 40, 90, 17, 130], vocab=500, seed=12)
    llm = LLM(str(path), dtype="bfloat16", max_model_len=256, num_kv_blocks=96, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    batch = llm.generate(prompts, params, use_tqdm=False)
    for prompt, together in zip(prompts, batch):
        (alone,) = llm.generate([prompt], params, use_tqdm=False)
        assert alone.outputs[0].token_ids == together.outputs[0].token_ids
        assert alone.outputs[0].logprobs == together.outputs[0].logprobs
        assert alone.prompt_logprobs == together.prompt_logprobs
    assert_all_blocks_free(llm)
