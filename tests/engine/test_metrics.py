"""Prometheus metrics against ground truth from a real engine (one step at a time, a fake clock)."""

from __future__ import annotations

import pytest

from pagellm import EngineArgs, LLMEngine, SamplingParams
from pagellm.core.sequence import SequenceStatus
from pagellm.engine.metrics import THROUGHPUT_WINDOW_S, EngineMetrics
from tests.helpers import random_prompts


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def engine(llama_path):
    return LLMEngine(EngineArgs(model=str(llama_path), max_model_len=128, num_kv_blocks=64, block_size=8))


def run(engine: LLMEngine, metrics: EngineMetrics, clock: Clock) -> None:
    while engine.has_unfinished_requests():
        outs = engine.step()
        clock.now += 0.01
        metrics.on_step(outs)


def value(metrics: EngineMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, {"model_name": "m", **labels}) or 0.0


def test_n_samples_each_count_their_tokens_gaps_and_finish(engine):
    clock = Clock()
    metrics = EngineMetrics(engine, "m", clock=clock)
    (prompt,) = random_prompts([20], vocab=500, seed=1)
    engine.add_request("a", prompt, SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=7, ignore_eos=True))
    run(engine, metrics, clock)
    assert value(metrics, "pagellm_generation_tokens_total") == 21
    assert value(metrics, "pagellm_inter_token_latency_seconds_count") == 3 * 6  # per sequence, not per request
    assert value(metrics, "pagellm_request_success_total", finished_reason="length") == 3
    assert value(metrics, "pagellm_prompt_tokens_total") == 20  # once per request
    assert value(metrics, "pagellm_time_to_first_token_seconds_count") == 1


def test_best_of_counts_every_generated_sample(engine):
    metrics = EngineMetrics(engine, "m", clock=Clock())
    engine.add_request("a", [5, 6, 7], SamplingParams(n=1, best_of=3, temperature=1.0, seed=2, max_tokens=7,
                                                      ignore_eos=True))
    run(engine, metrics, metrics.clock)
    assert value(metrics, "pagellm_generation_tokens_total") == 21  # what the engine computed
    assert value(metrics, "pagellm_request_success_total", finished_reason="length") == 1  # what it returned


def test_throughput_falls_to_zero_once_idle(engine):
    clock = Clock()
    metrics = EngineMetrics(engine, "m", clock=clock)
    engine.add_request("a", [5, 6, 7], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    run(engine, metrics, clock)
    metrics.render()
    assert value(metrics, "pagellm_generation_throughput") == pytest.approx(10 / THROUGHPUT_WINDOW_S)
    clock.now += THROUGHPUT_WINDOW_S + 1
    metrics.render()
    assert value(metrics, "pagellm_generation_throughput") == 0.0


def test_queues_count_requests_and_utilization_counts_shared_slots_once(engine):
    metrics = EngineMetrics(engine, "m", clock=Clock())
    (prompt,) = random_prompts([60], vocab=500, seed=3)
    engine.add_request("forks", prompt, SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=20, ignore_eos=True))
    engine.add_request("later", [5, 6, 7], SamplingParams(max_tokens=5))
    metrics.on_step(engine.step())
    metrics.on_step(engine.step())
    metrics.render()
    assert value(metrics, "pagellm_num_requests_running") == 2  # not 5 sequences
    assert 0 < value(metrics, "pagellm_kv_cache_utilization") <= value(metrics, "pagellm_kv_cache_usage_perc") <= 1
    engine.abort_request(["forks", "later"])


def test_an_abort_records_its_latencies_and_a_never_prefilled_prompt_is_not_counted(engine):
    clock = Clock()
    metrics = EngineMetrics(engine, "m", clock=clock)
    engine.add_request("started", [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    for _ in range(3):
        metrics.on_step(engine.step())
    request = engine.requests["started"]
    engine.abort_request("started")
    metrics.on_abort(request)
    waiting = engine.add_request("never", list(range(5, 45)), SamplingParams(max_tokens=5))
    engine.abort_request("never")
    metrics.on_abort(waiting)
    metrics.render()
    assert value(metrics, "pagellm_request_success_total", finished_reason="abort") == 2
    assert value(metrics, "pagellm_time_to_first_token_seconds_count") == 1  # the one that had a token
    assert value(metrics, "pagellm_e2e_request_latency_seconds_count") == 2
    assert value(metrics, "pagellm_prompt_tokens_total") == 4  # "never" was never prefilled
    assert value(metrics, "pagellm_num_requests_waiting") == 0 and value(metrics, "pagellm_pending_requests") == 0


def test_an_abort_keeps_the_reasons_of_samples_that_had_finished(engine):
    metrics = EngineMetrics(engine, "m", clock=Clock())
    request = engine.add_request("a", [5, 6, 7], SamplingParams(n=2, temperature=1.0, seed=4, max_tokens=30,
                                                                ignore_eos=True))
    for _ in range(3):
        metrics.on_step(engine.step())
    engine.scheduler.finish_seq(request.seqs[1], SequenceStatus.FINISHED_STOPPED)  # as a stop token would
    engine.abort_request("a")
    metrics.on_abort(request)
    assert value(metrics, "pagellm_request_success_total", finished_reason="abort") == 1
    assert value(metrics, "pagellm_request_success_total", finished_reason="stop") == 1


def test_start_up_work_is_not_counted_as_traffic(llama_path):
    engine = LLMEngine(EngineArgs(model=str(llama_path), max_model_len=128, num_kv_blocks=64, block_size=8,
                                  preload_prompts=["a system prompt that is long enough to fill blocks " * 3]))
    metrics = EngineMetrics(engine, "m", clock=Clock())
    assert engine.get_stats().num_prompt_tokens > 0  # the preload ran through the engine
    assert value(metrics, "pagellm_prompt_tokens_total") == 0
    assert value(metrics, "pagellm_prefix_cache_queries_total") == 0
