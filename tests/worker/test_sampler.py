"""Sampling: seeds independent of the batch, filters, penalties, logprobs, statistics."""

from __future__ import annotations

import math

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.worker.request_state import SeqState
from pagellm.worker.sampler import Sampler
from tests.helpers import assert_all_blocks_free


@pytest.fixture(scope="module")
def llm(llama_path):
    return LLM(str(llama_path), max_model_len=128, num_kv_blocks=128, block_size=16)


def seqs_for(params_list):
    """The runner's state of one sequence per params (prompt [5, 6, 7], nothing generated yet)."""
    return [SeqState(i, [5, 6, 7], [], p, p.seed, []) for i, p in enumerate(params_list)]


def test_fixed_seed_reproduces_whatever_the_batch_companions(llm):
    p = SamplingParams(temperature=1.0, max_tokens=24, seed=1234, ignore_eos=True)
    (alone,) = llm.generate(["Once upon a time"], p, use_tqdm=False)
    companions = ["The quick brown fox", "Once upon a time", "Numbers: 1 2 3", "Hello"]
    params = [SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True), p,
              SamplingParams(temperature=1.0, seed=7, max_tokens=10, ignore_eos=True), SamplingParams(max_tokens=5)]
    outs = llm.generate(companions, params, use_tqdm=False)
    assert outs[1].outputs[0].token_ids == alone.outputs[0].token_ids
    other_seed = llm.generate(["Once upon a time"], p.clone(seed=99), use_tqdm=False)[0]
    assert other_seed.outputs[0].token_ids != alone.outputs[0].token_ids
    assert_all_blocks_free(llm)


def test_top_k_1_equals_greedy(llm):
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    top1 = SamplingParams(temperature=1.5, top_k=1, max_tokens=20, ignore_eos=True)
    prompts = ["The capital of France is", "Hello, world"]
    a = llm.generate(prompts, greedy, use_tqdm=False)
    b = llm.generate(prompts, top1, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_n_children_get_distinct_reproducible_seeds(llm):
    p = SamplingParams(n=3, temperature=1.0, max_tokens=16, seed=5, ignore_eos=True)
    (a,) = llm.generate(["Hello"], p, use_tqdm=False)
    (b,) = llm.generate(["Hello"], p, use_tqdm=False)
    ids = [c.token_ids for c in a.outputs]
    assert ids == [c.token_ids for c in b.outputs]
    assert len({tuple(t) for t in ids}) == 3
    assert [c.index for c in a.outputs] == [0, 1, 2]
    assert_all_blocks_free(llm)


def test_best_of_returns_the_n_most_likely(llm):
    p = SamplingParams(n=2, best_of=4, temperature=1.0, max_tokens=8, seed=3, ignore_eos=True)
    (out,) = llm.generate(["Hello"], p, use_tqdm=False)
    assert len(out.outputs) == 2
    all4 = llm.generate(["Hello"], p.clone(n=4, best_of=None, logprobs=0), use_tqdm=False)[0]  # scored: reported
    best = sorted((c.cumulative_logprob for c in all4.outputs), reverse=True)[:2]
    assert [c.cumulative_logprob for c in out.outputs] == pytest.approx(best)


def test_logprobs_hold_top_n_plus_chosen_and_sum_to_cumulative(llm):
    p = SamplingParams(temperature=1.0, seed=0, max_tokens=12, logprobs=3, ignore_eos=True)
    (out,) = llm.generate(["Hello"], p, use_tqdm=False)
    c = out.outputs[0]
    assert len(c.logprobs) == 12
    total = 0.0
    for tok, entry in zip(c.token_ids, c.logprobs):
        assert tok in entry and 3 <= len(entry) <= 4
        ranks = sorted(lp.rank for t, lp in entry.items() if t != tok or lp.rank <= 3)
        assert ranks[:3] == [1, 2, 3]
        assert all(lp.logprob <= 0 for lp in entry.values())
        assert entry[tok].decoded_token == llm.get_tokenizer().decode([tok])
        total += entry[tok].logprob
    assert c.cumulative_logprob == pytest.approx(total, abs=1e-4)


def test_sampling_follows_the_distribution():
    sampler = Sampler([], torch.device("cpu"), seed=0)
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    rows = 4000
    seqs = seqs_for([SamplingParams(temperature=1.0)] * rows)
    tokens = [r.token_id for r in sampler(logits.repeat(rows, 1), seqs)]
    freq = torch.bincount(torch.tensor(tokens), minlength=4).float() / rows
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.03)


def test_top_p_and_min_p_remove_the_tail():
    sampler = Sampler([], torch.device("cpu"), seed=0)
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])).repeat(500, 1)
    top_p = [r.token_id for r in sampler(logits, seqs_for([SamplingParams(top_p=0.7)] * 500))]
    assert set(top_p) == {0, 1}  # 0.5 < 0.7, 0.5 + 0.3 >= 0.7: the nucleus is {0, 1}
    min_p = [r.token_id for r in sampler(logits, seqs_for([SamplingParams(min_p=0.4)] * 500))]
    assert set(min_p) == {0, 1}  # 0.15 < 0.4 * 0.5
    top_k = [r.token_id for r in sampler(logits, seqs_for([SamplingParams(top_k=3)] * 500))]
    assert set(top_k) == {0, 1, 2}


def test_penalties_push_down_repeated_tokens():
    sampler = Sampler([], torch.device("cpu"), seed=0)
    (seq,) = seqs_for([SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)])
    seq.output_token_ids = [1, 1, 8]
    logits = torch.full((1, 10), 1.0)
    logits[0, 5] = -1.0  # a prompt token with a negative logit gets multiplied
    out = sampler._process(logits.clone(), [seq])[0]
    assert out[1].item() == pytest.approx(1.0 / 2 - 0.5 - 0.5)
    assert out[8].item() == pytest.approx(1.0 / 2 - 0.5 - 0.25)
    assert out[5].item() == pytest.approx(-2.0)
    assert out[0].item() == pytest.approx(1.0)


def test_greedy_logprob_of_chosen_token_is_the_max(llm):
    (out,) = llm.generate(["Hi"], SamplingParams(temperature=0, max_tokens=5, logprobs=1), use_tqdm=False)
    for tok, entry in zip(out.outputs[0].token_ids, out.outputs[0].logprobs):
        assert entry[tok].rank == 1
        assert math.isfinite(entry[tok].logprob)


def test_a_row_with_every_token_banned_samples_inside_the_vocabulary():
    # min_tokens bans the stop ids; here they cover the whole (tiny) vocabulary. The engine refuses
    # such a request up front; the sampler must still never emit an id the embedding cannot look up.
    sampler = Sampler([], torch.device("cpu"), seed=0)
    banned_all = SamplingParams(temperature=1.0, min_tokens=3, stop_token_ids=[0, 1, 2, 3])
    ok = SamplingParams(temperature=1.0, seed=1)
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])).repeat(2, 1)
    for _ in range(50):
        tokens = [r.token_id for r in sampler(logits, seqs_for([banned_all, ok]))]
        assert all(0 <= t < 4 for t in tokens)
