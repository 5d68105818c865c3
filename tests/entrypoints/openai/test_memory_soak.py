"""A long storm of mixed requests, a third of them dropped by their clients mid-way, leaves the server's
resident memory flat (the full-size run on the default model: benchmarks/serve_memory_soak.py)."""

from __future__ import annotations

import asyncio

import pytest

from benchmarks.serve_memory_soak import Workload, growth, storm
from pagellm.model.default_model import build_checkpoint
from tests.entrypoints.openai.server_utils import RemoteServer

REQUESTS, EVERY, CONCURRENCY = 5000, 500, 16


@pytest.mark.slow
def test_resident_memory_stays_flat_under_a_storm_with_disconnects(tmp_path):
    # A tiny model with a wide KV cache (eight layers of four 64-wide KV heads: a quarter of a MiB per block
    # of 16 tokens) and a pool far larger than the storm ever holds at once: the steps are quick, and a
    # server that took new parts of its pool as the prefix cache filled would show it within the storm.
    model = build_checkpoint(tmp_path / "wide-kv", "llama", hidden_size=256, intermediate_size=256,
                             num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=4,
                             initializer_range=0.2)
    srv = RemoteServer(model, ["--max-model-len", "512", "--kv-cache-memory", "1GiB", "--dtype", "float32"])
    try:
        work = Workload(disconnect=0.3, max_prompt_words=80, max_tokens=12, drop_after=0.05)
        samples, tally = asyncio.run(storm(srv.url, srv.proc.pid, REQUESTS, EVERY, CONCURRENCY, work))
        aborted = srv.metric("pagellm_request_success_total", 'finished_reason="abort"')
    finally:
        assert srv.stop() == 0
    assert not tally.errors, tally.errors
    assert sum(tally.outcomes.values()) == REQUESTS
    # The clients dropped about a third of the requests, and the server saw them go while it worked on them.
    assert 0.2 * REQUESTS < tally.outcomes["dropped"] < 0.4 * REQUESTS, tally.outcomes
    assert aborted > 0.15 * REQUESTS, aborted
    table = ", ".join(f"{n}: {rss:.0f} MiB" for n, rss in samples)
    assert growth(samples) <= 0.10, f"resident memory after each {EVERY} requests: {table}"
