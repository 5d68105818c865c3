"""The parity checks every model family passes against transformers on a tiny random checkpoint.

A family's test module builds its checkpoints (``build_checkpoint(folder, model_type, ...)``) and
calls these: greedy tokens identical in float32 at several prompt lengths and block sizes 1 and 16,
with chunked prefill and under forced preemption, and bfloat16 logprobs close.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pagellm import LLM, SamplingParams
from tests.helpers import assert_all_blocks_free, hf_greedy, hf_prompt_logprobs, random_prompts

# Lengths around block boundaries and past small sliding windows.
PROMPT_LENGTHS = [1, 3, 16, 17, 40, 100]
NEW_TOKENS = 24


def greedy(max_tokens: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def family_prompts(vocab: int = 500, seed: int = 0) -> list[list[int]]:
    return random_prompts(PROMPT_LENGTHS, vocab=vocab, seed=seed)


def transformers_greedy(path: Path, prompts: list[list[int]], new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    return [hf_greedy(path, p, new_tokens) for p in prompts]


def assert_greedy_matches(path: Path, prompts: list[list[int]], expected: list[list[int]], alone: int = 0,
                          **llm_args) -> LLM:
    """All prompts in one batch (then the first ``alone`` of them each alone): the tokens transformers
    chose; every block freed after."""
    llm = LLM(str(path), **({"max_model_len": 256, "num_kv_blocks": 1024} | llm_args))
    new_tokens = len(expected[0])
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(new_tokens), use_tqdm=False)]
    assert got == expected
    for prompt, want in zip(prompts[:alone], expected[:alone]):
        (single,) = llm.generate([prompt], greedy(new_tokens), use_tqdm=False)
        assert single.outputs[0].token_ids == want
    assert_all_blocks_free(llm)
    return llm


def assert_family_matches_transformers(path: Path, prompts: list[list[int]], expected: list[list[int]],
                                       preemption_mode: str = "recompute", num_kv_blocks: int = 48,
                                       block_size: int = 4) -> None:
    """transformers' greedy tokens with block size 1 (batched and alone), block size 16 with chunked
    prefill, and under preemption (recompute re-runs the family's prefill over what it had made;
    swap only moves blocks, which the scheduling tests cover once for every family)."""
    assert_greedy_matches(path, prompts, expected, alone=2, block_size=1, num_kv_blocks=4096)
    llm = assert_greedy_matches(path, prompts, expected, block_size=16, num_kv_blocks=256,
                                max_num_batched_tokens=24, max_num_seqs=24)
    assert llm.llm_engine.scheduler.stats.num_partial_prefills > 0
    # 48 blocks of 4 = 192 slots, well under what the batch needs at its peak.
    llm = assert_greedy_matches(path, prompts, expected, max_model_len=160, num_kv_blocks=num_kv_blocks,
                                block_size=block_size,
                                preemption_mode=preemption_mode, swap_space=0.05, max_num_batched_tokens=64,
                                max_num_seqs=64)
    stats = llm.llm_engine.scheduler.stats
    assert (stats.num_swap_outs if preemption_mode == "swap" else stats.num_recomputes) > 0


def assert_bfloat16_logprobs_close(path: Path, lengths: tuple[int, ...] = (5, 40, 90), outliers: int = 0,
                                   max_tokens: int = 16, max_diff: float = 0.2, mean_diff: float = 0.04) -> None:
    """Prompt logprobs (prefill) and generated tokens' logprobs (decode) in bfloat16 within bfloat16's
    rounding of transformers' own bfloat16 scores of the same sequence. ``outliers``: how many
    positions of each sequence may pass the largest difference (mixtures of experts: a token whose
    k-th and next router scores are within one bfloat16 step switches experts on any rounding
    difference before it); the mean bound still counts every position."""
    prompts = random_prompts(list(lengths), vocab=500, seed=11)
    llm = LLM(str(path), dtype="bfloat16", max_model_len=256, num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        completion = out.outputs[0]
        ours = [out.prompt_logprobs[i][t].logprob for i, t in enumerate(prompt) if i > 0]
        ours += [lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)]
        want = hf_prompt_logprobs(path, prompt + completion.token_ids, torch.bfloat16).tolist()
        diffs = [abs(a - b) for a, b in zip(ours, want)]
        # bfloat16 rounding alone moves these logprobs by up to ~0.15 (transformers in bfloat16 vs
        # float32 on the same checkpoints).
        assert sorted(diffs)[-1 - outliers] < max_diff and sum(diffs) / len(diffs) < mean_diff
    assert_all_blocks_free(llm)
