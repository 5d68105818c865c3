"""Speculative decoding with a draft model: the tokens of greedy requests are those of decoding one token at
a time, whatever the draft (the target itself, which agrees on every draft, or a smaller random model,
which agrees on almost none), with prefix caching, chunked prefill, preemption, n > 1, stop tokens and
logprobs; sampled tokens keep their distribution (rejection sampling against the draft's q); and a draft
with another tokenizer is refused by name."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.config import EngineArgs
from pagellm.model.default_model import build_checkpoint, build_tokenizer
from pagellm.worker.request_state import SeqState
from pagellm.worker.sampler import Sampler
from tests.engine.test_spec_decode import looping_prompts, run
from tests.helpers import assert_all_blocks_free, random_prompts

KWARGS = dict(max_model_len=256, num_kv_blocks=96, block_size=8, seed=0)


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A smaller random Llama with the same tokenizer: one layer, a narrower width."""
    return build_checkpoint(tmp_path_factory.mktemp("draft") / "small", "llama", seed=1, initializer_range=0.2,
                            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                            num_key_value_heads=2)


def spec(model: Path, draft: Path, k: int = 4, **kwargs) -> dict:
    return {"model": str(draft), "num_speculative_tokens": k, **kwargs}


@pytest.fixture(scope="module")
def engines(llama_path, small_draft):
    return (LLM(str(llama_path), **KWARGS),
            LLM(str(llama_path), speculative_config=spec(llama_path, llama_path), **KWARGS),
            LLM(str(llama_path), speculative_config=spec(llama_path, small_draft, method="draft_model"), **KWARGS))


def test_the_target_as_its_own_draft_keeps_every_draft_and_the_plain_tokens(engines):
    plain, itself, _ = engines
    prompts = random_prompts([5, 17, 30, 9], plain.llm_engine.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2)
    want, want_outs = run(plain, prompts, params)
    got, got_outs = run(itself, prompts, params)
    assert got == want
    stats = itself.llm_engine.get_stats()
    assert stats.spec_decode_num_draft_tokens > 50
    assert stats.spec_decode_num_accepted_tokens >= 0.95 * stats.spec_decode_num_draft_tokens
    for a, b in zip(want_outs, got_outs):
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.keys() == y.keys()
            assert all(math.isclose(x[t].logprob, y[t].logprob, abs_tol=1e-4) for t in x)
    assert_all_blocks_free(itself)


def test_a_smaller_draft_changes_no_token_cached_forked_or_stopped(engines):
    plain, _, small = engines
    prompts = looping_prompts(3, plain.llm_engine.vocab_size)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want, _ = run(plain, prompts, greedy)
    first, _ = run(small, prompts, greedy)
    again, _ = run(small, prompts, greedy)  # (the prompts' blocks, the draft's K/V too, from the prefix cache)
    assert first == again == want
    assert small.llm_engine.get_stats().spec_decode_num_draft_tokens > 0
    # A stop token inside a step's drafts, and n > 1 with seeds: reproducible, each sample its own.
    stop = want[0][0][6]
    got, outs = run(small, prompts[:1], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop]))
    assert got[0][0] == want[0][0][: want[0][0].index(stop) + 1] and outs[0].outputs[0].finish_reason == "stop"
    sampled = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=24, ignore_eos=True)
    a, _ = run(small, prompts, sampled)
    b, _ = run(small, prompts, sampled)
    assert a == b and all(len(set(map(tuple, pair))) == 2 for pair in a)
    assert_all_blocks_free(small)


@pytest.mark.slow
def test_chunked_prefill_and_preemption_with_a_draft_model_give_the_plain_tokens(llama_path, small_draft):
    # A pool too small for every sequence at once: sequences are preempted (swapped and recomputed) and
    # come back, the draft's K/V with them.
    kwargs = dict(max_model_len=256, num_kv_blocks=40, block_size=8, prefill_chunk_size=16, seed=0)
    prompts = looping_prompts(8, LLM(str(llama_path), max_model_len=64).llm_engine.vocab_size)
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    want, _ = run(LLM(str(llama_path), **kwargs), prompts, greedy)
    for draft, mode in ((llama_path, "swap"), (llama_path, "recompute"), (small_draft, "auto")):
        llm = LLM(str(llama_path), speculative_config=spec(llama_path, draft), preemption_mode=mode, **kwargs)
        got, _ = run(llm, prompts, greedy)
        assert got == want
        stats = llm.llm_engine.scheduler.stats
        assert (stats.num_swap_outs if mode == "swap" else stats.num_preemptions) > 0
        assert mode != "recompute" or stats.num_recomputes > 0
        if draft == llama_path:  # (the target as its own draft keeps nearly every draft, through preemptions too)
            assert stats.num_accepted_tokens >= 0.9 * stats.num_draft_tokens > 0
        assert_all_blocks_free(llm)


def test_rejection_against_the_drafts_distribution_keeps_the_targets():
    # Rows of fixed target distributions p and draft distributions q over 5 tokens; each draft is drawn from
    # its row's q. Every kept position must be distributed as its row's p (chi-squared test over many draws;
    # the bound fails by chance with probability < 1e-4).
    p = torch.tensor([[0.05, 0.10, 0.40, 0.25, 0.20], [0.30, 0.05, 0.05, 0.30, 0.30], [0.2] * 5])
    q = torch.tensor([[0.30, 0.30, 0.10, 0.20, 0.10], [0.10, 0.50, 0.10, 0.20, 0.10]])
    sampler = Sampler([], torch.device("cpu"), seed=0)
    seq = SeqState(0, [1, 2], [], SamplingParams(temperature=1.0), None, [])
    g = torch.Generator().manual_seed(1)
    first, second = torch.zeros(5), torch.zeros(5)
    draws = torch.stack([torch.multinomial(q[i], 2500, replacement=True, generator=g) for i in range(2)], 1)
    for drafts in draws.tolist():
        kept = [r.token_id for r in sampler.verify(p.log(), seq, drafts, q)]
        first[kept[0]] += 1
        if len(kept) > 1 and kept[0] == drafts[0]:  # the first draft was accepted: row 1 gave the second
            second[kept[1]] += 1
    for counts, want in ((first, p[0]), (second, p[1])):
        n = counts.sum()
        chi2 = float(((counts - n * want) ** 2 / (n * want)).sum())
        assert chi2 < 23.5, (counts / n, want)  # 4 degrees of freedom, p = 1e-4


@pytest.mark.slow
def test_sampled_tokens_are_distributed_as_without_drafts(llama_path, small_draft):
    # Two-sample chi-squared test on the third token (drawn in a speculative step) of many seeded requests.
    prompt = random_prompts([6], 100, seed=5)[0]
    params = [SamplingParams(temperature=1.5, seed=i, max_tokens=3, ignore_eos=True) for i in range(1500)]
    kwargs = dict(max_model_len=64, block_size=8, seed=0, max_num_seqs=256)
    draft = spec(llama_path, small_draft, disable_by_batch_size=256)
    counts = []
    for sc in (None, draft):
        llm = LLM(str(llama_path), speculative_config=sc, **kwargs)
        outs, _ = run(llm, [prompt] * len(params), params)
        counts.append([o[0][2] for o in outs])
    assert llm.llm_engine.get_stats().spec_decode_num_draft_tokens > 500
    tokens = sorted(set(counts[0]) | set(counts[1]))
    a = torch.tensor([counts[0].count(t) for t in tokens], dtype=torch.float64)
    b = torch.tensor([counts[1].count(t) for t in tokens], dtype=torch.float64)
    frequent = (a + b) >= 20  # (rare tokens pooled into one category)
    a = torch.cat([a[frequent], a[~frequent].sum().unsqueeze(0)])
    b = torch.cat([b[frequent], b[~frequent].sum().unsqueeze(0)])
    total = a + b
    keep = total > 0
    expected_a, expected_b = total[keep] * a.sum() / total.sum(), total[keep] * b.sum() / total.sum()
    chi2 = float(((a[keep] - expected_a) ** 2 / expected_a + (b[keep] - expected_b) ** 2 / expected_b).sum())
    dof = int(keep.sum()) - 1
    # The chi-squared bound at p = 1e-4 for dof degrees of freedom (Wilson-Hilferty).
    z = 3.719
    assert chi2 < dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3, (chi2, dof)


def test_a_draft_with_another_tokenizer_or_no_model_is_refused(llama_path, tmp_path):
    other = build_checkpoint(tmp_path / "other", "llama", seed=2, hidden_size=32, num_hidden_layers=1)
    build_tokenizer(other, vocab_size=300)  # (its own vocabulary, over the one it was saved with)
    with pytest.raises(ValueError, match="does not share the target's tokenizer"):
        LLM(str(llama_path), speculative_config=spec(llama_path, other), **KWARGS)
    with pytest.raises(ValueError, match="the draft model .*cannot be read"):
        LLM(str(llama_path), speculative_config=spec(llama_path, tmp_path / "missing"), **KWARGS)
    with pytest.raises(ValueError, match='draft_model method needs "model"'):
        EngineArgs(model=str(llama_path), speculative_config='{"method": "draft_model", "num_speculative_tokens": 2}')
    with pytest.raises(ValueError, match="unknown key.*prompt_lookup_max"):
        EngineArgs(model=str(llama_path), speculative_config=json.dumps(
            {"model": str(llama_path), "num_speculative_tokens": 2, "prompt_lookup_max": 3}))


def test_constrained_penalised_and_beam_searched_requests_decode_beside_drafting_ones(engines):
    from pagellm import BeamSearchParams
    from pagellm.sampling_params import StructuredOutputsParams

    plain, itself, _ = engines
    prompts = looping_prompts(3, plain.llm_engine.vocab_size)
    params = [SamplingParams(temperature=0, max_tokens=8,
                             structured_outputs=StructuredOutputsParams(choice=["alpha", "beta"])),
              SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.3),
              SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)]
    want, want_outs = run(plain, prompts, params)
    got, got_outs = run(itself, prompts, params)
    assert got == want and got_outs[0].outputs[0].text in ("alpha", "beta")
    beams = BeamSearchParams(beam_width=2, max_tokens=6, ignore_eos=True)
    as_beams = [{"prompt_token_ids": p} for p in prompts[:2]]
    assert [[s.tokens for s in o.sequences] for o in itself.beam_search(as_beams, beams)] == \
        [[s.tokens for s in o.sequences] for o in plain.beam_search(as_beams, beams)]
    assert_all_blocks_free(itself)
