"""The dashboard's chart history: one point per interval, rates over the interval, a bounded span."""

from __future__ import annotations

from types import SimpleNamespace

from pagellm.engine.stats_history import StatsHistory


def counters(used=0, preemptions=0, queries=0, hits=0, generated=0, running=0):
    return SimpleNamespace(num_used_blocks=used, num_blocks=100, num_running=running, num_waiting=0, num_swapped=0,
                           num_preemptions=preemptions, prefix_cache_queries=queries, prefix_cache_hits=hits,
                           num_generated_tokens=generated)


def test_points_are_rates_over_each_interval():
    h = StatsHistory(interval=1.0, span=10.0, clock=lambda: 0.0)
    assert h.due(0.0) and h.sample(counters(), 0.0) is None  # the first sample sets the base
    assert not h.due(0.5) and h.due(1.0)
    p = h.sample(counters(used=25, preemptions=2, queries=100, hits=75, generated=40, running=3), 2.0)
    assert p is not None
    assert (p.kv_usage, p.preemptions, p.prefix_cache_hit_rate, p.throughput, p.running) == (0.25, 2, 0.75, 20.0, 3)
    p = h.sample(counters(used=25, preemptions=2, queries=100, hits=75, generated=40), 3.0)
    assert p is not None and p.prefix_cache_hit_rate is None and p.preemptions == 0 and p.throughput == 0.0
    columns = h.as_dict()
    assert columns["t"] == [2.0, 3.0] and columns["kv_usage"] == [0.25, 0.25] and columns["span"] == 10.0


def test_points_older_than_the_span_are_dropped():
    h = StatsHistory(interval=1.0, span=5.0)
    for t in range(20):
        h.sample(counters(generated=t), float(t))
    assert h.as_dict()["t"] == [14.0, 15.0, 16.0, 17.0, 18.0, 19.0]
