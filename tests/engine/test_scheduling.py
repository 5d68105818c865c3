"""Scheduler features on the real engine: chunked prefill, swap and recompute give identical tokens."""

from __future__ import annotations

import logging

import pytest

from pagellm import LLM, EngineArgs, LLMEngine, SamplingParams
from tests.helpers import assert_all_blocks_free, random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts([20, 90, 9, 50, 120, 12], vocab=500, seed=13)


@pytest.fixture(scope="module")
def expected(llama_path, prompts):
    free = LLM(str(llama_path), max_model_len=256, num_kv_blocks=512, block_size=4,
               enable_chunked_prefill=False, enable_prefix_caching=False)
    outs = free.generate(prompts, GREEDY, use_tqdm=False)
    stats = free.llm_engine.scheduler.stats
    assert stats.num_preemptions == 0 and stats.num_partial_prefills == 0
    return [o.outputs[0].token_ids for o in outs]


def test_chunked_prefill_gives_the_same_tokens(llama_path, prompts, expected):
    llm = LLM(str(llama_path), max_model_len=256, num_kv_blocks=512, block_size=4, max_num_batched_tokens=32,
              max_num_seqs=32, enable_prefix_caching=False)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
    assert llm.llm_engine.scheduler.stats.num_partial_prefills > 0
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_by_swap_or_recompute_gives_the_same_tokens(llama_path, prompts, expected, mode, caplog):
    # 45 blocks of 4 = 180 slots: the six requests need ~460 at peak.
    llm = LLM(str(llama_path), max_model_len=180, num_kv_blocks=45, block_size=4, preemption_mode=mode,
              swap_space=0.05, max_num_batched_tokens=64, max_num_seqs=64)
    with caplog.at_level(logging.INFO, logger="pagellm.core.scheduler"):
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = llm.llm_engine.scheduler.stats
    if mode == "swap":
        assert stats.num_swap_outs > 0 and stats.num_recomputes == 0
    else:
        assert stats.num_recomputes > 0 and stats.num_swap_outs == 0
    assert sum(o.metrics.num_preemptions for o in outs) == stats.num_preemptions
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("preempt ")]
    assert len(lines) == stats.num_preemptions
    assert f"mode={mode}" in lines[0] and "kv_usage_before=" in lines[0] and "request_id=" in lines[0]
    assert_all_blocks_free(llm)
    cpu = llm.llm_engine.kv_cache_manager.groups[0].cpu_pool
    assert cpu.num_free_blocks == cpu.num_blocks


def test_long_prompt_prefills_in_chunks_while_running_requests_decode_every_step(checkpoints):
    engine = LLMEngine(EngineArgs(model=str(checkpoints["llama-long"]), max_model_len=4200, num_kv_blocks=400,
                                  max_num_batched_tokens=512))
    p = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    for i, prompt in enumerate(random_prompts([10] * 8, vocab=500, seed=1)):
        engine.add_request(f"run{i}", prompt, p)
    engine.step()  # the 8 are running
    (long,) = random_prompts([4000], vocab=500, seed=2)
    request = engine.add_request("long", long, SamplingParams(max_tokens=1))
    steps = 0
    while not request.seqs[0].output_token_ids:
        outs = engine.step()
        steps += 1
        got = {o.request_id for o in outs}
        assert {f"run{i}" for i in range(8)} <= got  # each running request got a token this step
    assert steps == -(-4000 // (512 - 8))  # 504-token chunks beside the 8 decodes
    assert engine.scheduler.stats.num_partial_prefills >= steps - 1
    engine.abort_request([f"run{i}" for i in range(8)])
    assert engine.kv_cache_manager.num_free_blocks == 400


def test_priority_policy_serves_the_urgent_request_first(llama_path):
    llm = LLM(str(llama_path), max_model_len=128, num_kv_blocks=64, scheduling_policy="priority", max_num_seqs=1)
    prompts = ["first", "second", "third"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False, priority=[5, 5, 0])
    # One seat: "third" (priority 0) is served before "second", although it arrived later.
    assert outs[2].metrics.first_token_time < outs[1].metrics.first_token_time
    with pytest.raises(ValueError, match="2 priorities for 3 prompts"):
        llm.generate(prompts, use_tqdm=False, priority=[1, 2])


def test_scheduler_flags_are_validated(llama_path):
    with pytest.raises(ValueError, match="scheduling_policy .* must be fcfs, priority or sla"):
        EngineArgs(scheduling_policy="lifo")
    with pytest.raises(ValueError, match="preemption_mode 'swap' needs a swap pool"):
        EngineArgs(preemption_mode="swap", swap_space=0)
    with pytest.raises(ValueError, match="default_ttft_slo .* positive, finite number of seconds"):
        EngineArgs(default_ttft_slo=-1)
    engine = LLMEngine(EngineArgs(model=str(llama_path), max_model_len=64, num_kv_blocks=16))
    with pytest.raises(ValueError, match="ttft_slo must be a positive, finite number"):
        engine.add_request("x", "hi", ttft_slo=0)


def steps_to_finish(engine: LLMEngine, limit: int = 400) -> dict[str, int]:
    """Step until every request is done (invariants checked each step); the step each finished at."""
    finished = {}
    for step in range(1, limit):
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = step
        engine.kv_cache_manager.assert_consistent()
        if not engine.has_unfinished_requests():
            break
    return finished


def test_an_urgent_request_displacing_a_swapped_one_gets_in_at_once(llama_path):
    # Priority with swap (the default auto mode): the victim swapped out for the urgent request used
    # to be swapped straight back in, every step, and neither ever finished.
    engine = LLMEngine(EngineArgs(model=str(llama_path), max_model_len=64, num_kv_blocks=16, block_size=4,
                                  scheduling_policy="priority"))
    low, high = random_prompts([40, 30], vocab=500, seed=1)
    engine.add_request("low", low, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), priority=10)
    engine.step()
    engine.add_request("high", high, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), priority=0)
    finished_at = steps_to_finish(engine)
    assert set(finished_at) == {"low", "high"} and finished_at["high"] < finished_at["low"]
    assert engine.scheduler.stats.num_swap_outs >= 1
    assert engine.kv_cache_manager.num_free_blocks == 16


def test_max_num_seqs_counts_the_samples_not_forked_yet(llama_path):
    engine = LLMEngine(EngineArgs(model=str(llama_path), max_model_len=128, num_kv_blocks=200, block_size=4,
                                  max_num_seqs=4, max_num_batched_tokens=32, prefill_chunk_size=16))
    long, *shorts = random_prompts([60, 5, 5, 5], vocab=500, seed=2)
    engine.add_request("A", long, SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=8, ignore_eos=True))
    for i, p in enumerate(shorts):
        engine.add_request(f"s{i}", p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, len(engine.scheduler.running))
    assert peak == 4  # A's three samples and one short request at a time, never more


def test_forked_samples_decode_every_step_beside_a_chunking_prompt(llama_path):
    engine = LLMEngine(EngineArgs(model=str(llama_path), max_model_len=512, num_kv_blocks=400, block_size=4,
                                  max_num_batched_tokens=32, max_num_seqs=32))
    p, long = random_prompts([10, 300], vocab=500, seed=3)
    request = engine.add_request("P", p, SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=20, ignore_eos=True))
    engine.add_request("L", long, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    for step in range(1, 9):
        engine.step()
        # Both samples gain a token every step while L's 300-token prompt takes the rest of the budget.
        assert [s.num_output_tokens for s in request.seqs] == [step, step]
    engine.abort_request(["P", "L"])


def test_chunk_size_without_chunked_prefill_and_an_empty_cache_salt_are_refused(llama_path):
    with pytest.raises(ValueError, match="prefill_chunk_size .* needs chunked prefill"):
        EngineArgs(enable_chunked_prefill=False, prefill_chunk_size=8)
    engine = LLMEngine(EngineArgs(model=str(llama_path), max_model_len=64, num_kv_blocks=16))
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        engine.add_request("x", [5, 6, 7], SamplingParams(max_tokens=2), cache_salt="")


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("mode", ["recompute", "auto"])
def test_a_prefill_chunk_short_of_blocks_preempts_the_least_urgent_even_if_already_scheduled(llama_path, policy,
                                                                                            mode):
    # Decodes are scheduled before prefill chunks; the victim must still be the least urgent running
    # sequence (here L0/L1, later and less important), not the chunking prompt itself.
    engine = LLMEngine(EngineArgs(model=str(llama_path), max_model_len=128, num_kv_blocks=36, block_size=4,
                                  max_num_batched_tokens=48, max_num_seqs=8, prefill_chunk_size=16,
                                  scheduling_policy=policy, preemption_mode=mode, enable_prefix_caching=False))
    urgent, *later = random_prompts([112, 14, 14], vocab=500, seed=7)
    engine.add_request("U", urgent, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), priority=0,
                       arrival_time=1.0)
    for i, p in enumerate(later):
        engine.add_request(f"L{i}", p, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True), priority=10,
                           arrival_time=2.0 + i)
    requests = dict(engine.requests)
    finished = steps_to_finish(engine)
    assert requests["U"].metrics.num_preemptions == 0
    assert finished["U"] < min(finished["L0"], finished["L1"])
    assert engine.kv_cache_manager.num_free_blocks == 36


def test_a_budget_below_max_num_seqs_is_refused(llama_path):
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(32\) is smaller than max_num_seqs \(256\)"):
        LLMEngine(EngineArgs(model=str(llama_path), max_model_len=64, num_kv_blocks=16, max_num_batched_tokens=32))
