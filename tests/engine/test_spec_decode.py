"""Speculative decoding end to end: the tokens of greedy requests are those of decoding one token at a
time, with every other feature on (prefix caching, chunked prefill, preemption, n > 1, logprobs,
structured outputs), and sampled tokens keep their distribution (rejection sampling)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.model.default_model import DEFAULT_MODEL_INSTALL, embedded_gguf_path
from pagellm.sampling_params import StructuredOutputsParams
from pagellm.worker.request_state import SeqState
from pagellm.worker.sampler import Sampler
from tests.helpers import assert_all_blocks_free

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def looping_prompts(count: int, vocab: int) -> list[list[int]]:
    """Prompts that repeat a phrase: the n-gram proposer finds drafts in them from the first step."""
    g = torch.Generator().manual_seed(11)
    out = []
    for i in range(count):
        phrase = torch.randint(3, vocab, (5 + i % 3,), generator=g).tolist()
        out.append(phrase * 4 + phrase[:2])
    return out


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs], outs


@pytest.fixture(scope="module")
def engines(llama_path):
    kwargs = dict(max_model_len=256, num_kv_blocks=96, block_size=8, seed=0)
    return LLM(str(llama_path), **kwargs), LLM(str(llama_path), speculative_config=NGRAM, **kwargs)


def test_greedy_tokens_and_logprobs_are_those_of_decoding_one_at_a_time(engines):
    plain, spec = engines
    vocab = plain.llm_engine.vocab_size
    prompts = looping_prompts(6, vocab)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)
    want, want_outs = run(plain, prompts, params)
    got, got_outs = run(spec, prompts, params)
    assert got == want
    stats = spec.llm_engine.get_stats()
    assert stats.spec_decode_num_draft_tokens > 0 and stats.spec_decode_num_accepted_tokens > 0
    for a, b in zip(want_outs, got_outs):
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.keys() == y.keys()
            assert all(math.isclose(x[t].logprob, y[t].logprob, abs_tol=1e-4) for t in x)
    assert_all_blocks_free(spec)


def test_a_cached_prefix_and_a_second_sample_change_nothing(engines):
    plain, spec = engines
    prompts = looping_prompts(3, plain.llm_engine.vocab_size)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    first, _ = run(spec, prompts, greedy)
    again, _ = run(spec, prompts, greedy)  # (the prompts' blocks now come from the prefix cache)
    assert first == again == run(plain, prompts, greedy)[0]
    sampled = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=24, ignore_eos=True)
    a, _ = run(spec, prompts, sampled)
    b, _ = run(spec, prompts, sampled)
    assert a == b and all(len(set(map(tuple, pair))) == 2 for pair in a)
    assert_all_blocks_free(spec)


@pytest.mark.slow
def test_chunked_prefill_and_preemption_with_drafts_give_the_plain_tokens(llama_path):
    # A pool too small for every sequence at once: sequences are preempted and come back.
    kwargs = dict(max_model_len=256, num_kv_blocks=40, block_size=8, prefill_chunk_size=16, seed=0)
    prompts = looping_prompts(8, LLM(str(llama_path), max_model_len=64).llm_engine.vocab_size)
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    plain = LLM(str(llama_path), **kwargs)
    want, _ = run(plain, prompts, greedy)
    spec = LLM(str(llama_path), speculative_config=NGRAM, **kwargs)
    got, _ = run(spec, prompts, greedy)
    assert got == want
    assert spec.llm_engine.scheduler.stats.num_preemptions > 0
    assert spec.llm_engine.get_stats().spec_decode_num_accepted_tokens > 0
    assert_all_blocks_free(spec)


def test_stop_tokens_and_max_tokens_cut_inside_a_speculative_step(engines):
    plain, spec = engines
    prompts = looping_prompts(4, plain.llm_engine.vocab_size)
    want, _ = run(plain, prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    # Stop at the 7th token of each answer (a token the drafts will have proposed past), and at max_tokens.
    for prompt, tokens in zip(prompts, want):
        stop = tokens[0][6]
        cut = tokens[0][: tokens[0].index(stop) + 1]
        got, outs = run(spec, [prompt], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop]))
        assert got[0][0] == cut and outs[0].outputs[0].finish_reason == "stop"
        got, outs = run(spec, [prompt], SamplingParams(temperature=0, max_tokens=9, ignore_eos=True))
        assert got[0][0] == tokens[0][:9] and outs[0].outputs[0].finish_reason == "length"
    assert_all_blocks_free(spec)


def test_constrained_and_penalised_requests_decode_beside_speculating_ones(engines):
    plain, spec = engines
    prompts = looping_prompts(3, plain.llm_engine.vocab_size)
    choice = SamplingParams(temperature=0, max_tokens=8,
                            structured_outputs=StructuredOutputsParams(choice=["alpha", "beta"]))
    penalised = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.3)
    free = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    params = [choice, penalised, free]
    want, want_outs = run(plain, prompts, params)
    got, got_outs = run(spec, prompts, params)
    assert got == want
    assert got_outs[0].outputs[0].text in ("alpha", "beta")
    assert_all_blocks_free(spec)


def test_sampled_tokens_keep_their_distribution():
    # Three rows of fixed distributions over 6 tokens, drafts (2, 4): each kept position is distributed as
    # its row's p, whatever the drafts (chi-squared test over many draws; the bound fails by chance with
    # probability < 1e-4).
    logits = torch.log(torch.tensor([[0.05, 0.10, 0.40, 0.15, 0.20, 0.10],
                                     [0.30, 0.05, 0.05, 0.10, 0.30, 0.20],
                                     [0.10, 0.10, 0.10, 0.10, 0.10, 0.50]]))
    sampler = Sampler([], torch.device("cpu"), seed=0)
    seq = SeqState(0, [1, 2], [], SamplingParams(temperature=1.0), None, [])
    draws = 4000
    first = torch.zeros(6)
    second_after_accept = torch.zeros(6)
    for _ in range(draws):
        kept = [r.token_id for r in sampler.verify(logits, seq, [2, 4])]
        first[kept[0]] += 1
        if kept[0] == 2:  # the first draft was accepted: the second position was sampled from row 1
            second_after_accept[kept[1]] += 1
    for counts, p in ((first, logits[0].exp()), (second_after_accept, logits[1].exp())):
        n = counts.sum()
        chi2 = float(((counts - n * p) ** 2 / (n * p)).sum())
        assert chi2 < 25.7, (counts / n, p)  # 5 degrees of freedom, p = 1e-4


def test_the_flag_takes_json_and_a_wrong_one_is_named(llama_path):
    from pagellm.config import EngineArgs

    args = EngineArgs(model=str(llama_path), speculative_config=json.dumps(NGRAM))
    assert args.speculative_config == NGRAM
    with pytest.raises(ValueError, match="speculative_config.*num_speculative_tokens must be an integer"):
        EngineArgs(model=str(llama_path), speculative_config='{"method": "ngram"}')


@pytest.mark.slow
@pytest.mark.skipif(embedded_gguf_path() is None,
                    reason=f"the embedded model is not installed: {DEFAULT_MODEL_INSTALL}")
def test_the_real_model_rewrites_a_passage_with_the_same_tokens():
    passage = ("The museum opens at nine in the morning and closes at six in the evening. Tickets cost twelve "
               "euros for adults and six euros for children under twelve. The cafe on the second floor serves "
               "coffee, tea and light lunches until five.")
    messages = [{"role": "user", "content": f"Copy this text, changing 'museum' to 'gallery':\n\n{passage}"}]
    greedy = SamplingParams(temperature=0, max_tokens=80)
    path = str(embedded_gguf_path())
    want = LLM(path, max_model_len=1024).chat(messages, greedy, use_tqdm=False)[0].outputs[0]
    spec = LLM(path, max_model_len=1024, speculative_config=NGRAM)
    got = spec.chat(messages, greedy, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids
    stats = spec.llm_engine.get_stats()
    assert stats.spec_decode_num_accepted_tokens > 0.3 * stats.spec_decode_num_draft_tokens
