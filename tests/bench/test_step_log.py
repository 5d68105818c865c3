"""The benchmarks' step log: the batch shape and KV figures of every step, installed as a step observer."""

from __future__ import annotations

import pytest

from pagellm import LLM, SamplingParams
from pagellm.bench.step_log import StepLog
from tests.helpers import random_prompts


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_step_log_counts_a_shared_prefix_once_in_the_distinct_kv(llama_path, prefix_caching):
    """The benchmarks' roofline charges the K/V a step reads: a prefix shared by several decodes once."""
    llm = LLM(str(llama_path), max_model_len=256, num_kv_blocks=128, block_size=16,
              enable_prefix_caching=prefix_caching)
    prefix = random_prompts([64], vocab=500, seed=9)[0]  # four full blocks
    prompts = [prefix + tail for tail in random_prompts([5, 9, 12], vocab=500, seed=10)]
    llm.generate(prompts[:1], SamplingParams(max_tokens=1), use_tqdm=False)  # caches the prefix
    log = StepLog.install(llm.llm_engine)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    decodes = [s for s in log.records if s.num_prefill_tokens == 0 and s.num_decode_seqs == 3]
    assert decodes
    for s in decodes:
        # With the cache the three tables share the prefix's four blocks: two of the three reads repeat.
        shared = 2 * 64 if prefix_caching else 0
        assert s.distinct_context_tokens == s.context_tokens - shared


def test_step_log_takes_the_kv_stats_where_blocks_in_use_reach_a_new_high(llama_path):
    """The memory report reads fragmentation and sequences at the peak step: they are taken there
    (and at every earlier new high), and the peak's figures are those of the cache after that step."""
    llm = LLM(str(llama_path), max_model_len=256, num_kv_blocks=128, block_size=16)
    step_log = StepLog.install(llm.llm_engine)
    prompts = random_prompts([20, 40, 33], vocab=500, seed=4)
    llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (5, 30, 12)],
                 use_tqdm=False)
    log = step_log.records
    high = -1
    for record in log:
        assert (record.kv_fragmentation is not None) == (record.kv_blocks_in_use > high)
        high = max(high, record.kv_blocks_in_use)
    peak = max(log, key=lambda s: s.kv_blocks_in_use)
    assert peak.kv_sequences == 3
    # First reached by the prefill step: the prompts' 20 + 40 + 33 tokens in 2 + 3 + 3 blocks of 16.
    assert peak.kv_fragmentation == 1 - (20 + 40 + 33) / (8 * 16)
    assert any(r.kv_fragmentation is None for r in log)  # the shrinking tail is not measured
    # A new log starts its highs again; the old one, uninstalled, records nothing more.
    step_log.uninstall()
    fresh = StepLog.install(llm.llm_engine)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert fresh.records[0].kv_fragmentation is not None and fresh.records[0].kv_sequences == 1
    assert len(log) == len(step_log.records) and llm.llm_engine.step_observers == [fresh]
