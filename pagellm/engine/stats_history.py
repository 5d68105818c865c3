"""The last minutes of the engine's counters, one point per interval: the dashboard's small charts.

Rates are per interval (the prefix cache's hit rate over the interval's lookups, preemptions in it,
tokens generated per second in it), so that a chart shows what changed when, not a lifetime average.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol


class CounterSource(Protocol):
    """What a point is made of: ``EngineStats`` has these fields."""

    num_used_blocks: int
    num_blocks: int
    num_running: int
    num_waiting: int
    num_swapped: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_generated_tokens: int


@dataclass
class HistoryPoint:
    t: float  # time.time() of the sample
    kv_usage: float
    prefix_cache_hit_rate: float | None  # None: no prompt was looked up in the interval
    preemptions: int  # in the interval
    throughput: float  # generated tokens per second over the interval
    running: int
    waiting: int
    swapped: int


class StatsHistory:
    """Samples at most once per ``interval`` seconds and keeps ``span`` seconds of points."""

    def __init__(self, interval: float = 1.0, span: float = 300.0, clock: Callable[[], float] = time.time) -> None:
        self.interval = interval
        self.span = span
        self.clock = clock
        self.points: deque[HistoryPoint] = deque(maxlen=max(1, int(span / interval) + 1))
        self._last: tuple[float, CounterSource] | None = None

    def due(self, now: float | None = None) -> bool:
        now = self.clock() if now is None else now
        return self._last is None or now - self._last[0] >= self.interval

    def sample(self, stats: CounterSource, now: float | None = None) -> HistoryPoint | None:
        """Add a point from ``stats`` (the counters are cumulative); the first sample only sets the base."""
        now = self.clock() if now is None else now
        last = self._last
        self._last = (now, stats)
        if last is None:
            return None
        t0, before = last
        dt = max(now - t0, 1e-9)
        queries = stats.prefix_cache_queries - before.prefix_cache_queries
        point = HistoryPoint(
            t=now,
            kv_usage=stats.num_used_blocks / stats.num_blocks,
            prefix_cache_hit_rate=(stats.prefix_cache_hits - before.prefix_cache_hits) / queries if queries else None,
            preemptions=stats.num_preemptions - before.num_preemptions,
            throughput=(stats.num_generated_tokens - before.num_generated_tokens) / dt,
            running=stats.num_running,
            waiting=stats.num_waiting,
            swapped=stats.num_swapped,
        )
        self.points.append(point)
        while self.points and self.points[0].t < now - self.span:
            self.points.popleft()
        return point

    def as_dict(self) -> dict[str, Any]:
        """Column-wise (one list per field), the compact form for JSON."""
        fields = list(HistoryPoint.__dataclass_fields__)
        columns: dict[str, list[Any]] = {f: [] for f in fields}
        for point in self.points:
            for f in fields:
                columns[f].append(getattr(point, f))
        return {"interval": self.interval, "span": self.span, **columns}
