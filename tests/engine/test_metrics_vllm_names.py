"""vLLM's metric names, labels and buckets beside pagellm's (``--metrics-prefix``), on a real engine."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagellm import EngineArgs, LLMEngine, SamplingParams
from pagellm.engine.metric_families import (
    METRICS_PREFIXES,
    VLLM_REQUEST_LATENCY_BUCKETS,
    VLLM_TTFT_BUCKETS,
    buckets_1_2_5,
)
from pagellm.engine.metrics import EngineMetrics
from pagellm.entrypoints.openai import cli_args

VLLM = {"model_name": "m", "engine": "0"}


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def engine(llama_path):
    return LLMEngine(EngineArgs(model=str(llama_path), max_model_len=128, num_kv_blocks=64, block_size=8))


def serve_one(engine: LLMEngine, prefix: str) -> EngineMetrics:
    clock = Clock()
    metrics = EngineMetrics(engine, "m", clock=clock, prefix=prefix)
    engine.add_request("a", [5, 6, 7, 8, 9], SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=6,
                                                            ignore_eos=True))
    while engine.has_unfinished_requests():
        outs = engine.step()
        clock.now += 0.25
        metrics.on_step(outs)
    return metrics


def names(metrics: EngineMetrics) -> set[str]:
    return {f.name for f in text_string_to_metric_families(metrics.render().decode())}


def test_both_prefixes_count_the_same_traffic_under_vllm_labels(engine):
    metrics = serve_one(engine, "both")
    get = metrics.registry.get_sample_value
    assert get("vllm:generation_tokens_total", VLLM) == 12
    assert get("pagellm_generation_tokens_total", {"model_name": "m"}) == 12
    assert get("vllm:prompt_tokens_total", VLLM) == 5
    assert get("vllm:request_success_total", {**VLLM, "finished_reason": "length"}) == 2
    assert get("vllm:inter_token_latency_seconds_count", VLLM) == 2 * 5
    assert get("vllm:time_per_output_token_seconds_count", VLLM) == 2 * 5
    assert get("vllm:time_to_first_token_seconds_count", VLLM) == 1
    assert get("vllm:e2e_request_latency_seconds_count", VLLM) == 1
    assert get("vllm:request_generation_tokens_sum", VLLM) == 12
    assert get("vllm:request_prompt_tokens_sum", VLLM) == 5
    assert get("vllm:request_max_num_generation_tokens_sum", VLLM) == 6
    assert get("vllm:request_params_n_sum", VLLM) == 2
    assert get("vllm:request_params_max_tokens_sum", VLLM) == 6
    # The engine stamps a request's phases with its own clock: counts here, not values.
    for phase in ("queue", "prefill", "decode", "inference"):
        assert get(f"vllm:request_{phase}_time_seconds_count", VLLM) == 1, phase
    assert get("vllm:request_time_per_output_token_seconds_count", VLLM) == 1
    assert get("vllm:iteration_tokens_total_count", VLLM) >= 6
    assert get("vllm:num_requests_running", VLLM) == 0 and get("vllm:num_requests_waiting", VLLM) == 0
    assert get("vllm:kv_cache_usage_perc", VLLM) == get("vllm:gpu_cache_usage_perc", VLLM) == 0
    for name in ("prefix_cache_queries_total", "prefix_cache_hits_total", "num_preemptions_total"):
        assert get(f"vllm:{name}", VLLM) is not None, name
    (info,) = [s.labels for f in text_string_to_metric_families(metrics.render().decode())
               if f.name == "vllm:cache_config_info" for s in f.samples]
    assert info["block_size"] == "8" and info["num_gpu_blocks"] == "64" and info["engine"] == "0"


def test_token_count_buckets_are_vllms_1_2_5_up_to_max_model_len():
    assert buckets_1_2_5(128) == (1, 2, 5, 10, 20, 50, 100)
    assert len(VLLM_TTFT_BUCKETS) == 22 and len(VLLM_REQUEST_LATENCY_BUCKETS) == 21


def test_prefix_vllm_and_pagellm_expose_only_their_names(engine):
    vllm_only = names(serve_one(engine, "vllm"))
    assert "vllm:num_requests_running" in vllm_only and "vllm:e2e_request_latency_seconds" in vllm_only
    assert not [n for n in vllm_only if n.startswith("pagellm_")]
    metrics = serve_one(engine, "vllm")
    bounds = [s.labels["le"] for f in text_string_to_metric_families(metrics.render().decode())
              if f.name == "vllm:time_to_first_token_seconds" for s in f.samples if s.name.endswith("_bucket")]
    assert bounds == [str(float(b)) for b in VLLM_TTFT_BUCKETS] + ["+Inf"]
    pagellm_only = names(serve_one(engine, "pagellm"))
    assert "pagellm_num_requests_running" in pagellm_only
    assert not [n for n in pagellm_only if n.startswith("vllm:")]


def test_the_serve_flag_offers_the_prefixes_the_engine_knows():
    assert cli_args.METRICS_PREFIXES == METRICS_PREFIXES


def test_unknown_prefix_is_refused(engine):
    with pytest.raises(ValueError, match="--metrics-prefix"):
        EngineMetrics(engine, "m", prefix="sglang")
