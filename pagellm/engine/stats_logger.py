"""A periodic log line of the engine's load, as vLLM's server prints (off with --disable-log-stats)."""

from __future__ import annotations

import logging
import time
from typing import Any

from pagellm.engine.llm_engine import LLMEngine

logger = logging.getLogger("pagellm.stats")

LOG_INTERVAL_S = 10.0


class StatsLogger:
    """A step callback: at most every ``interval`` seconds while the engine works, one line with the
    prompt and generation throughput since the last line, the queues, KV usage and prefix-cache hits."""

    def __init__(self, engine: LLMEngine, interval: float = LOG_INTERVAL_S) -> None:
        self.engine = engine
        self.interval = interval
        self._last_time = time.monotonic()
        self._last: Any | None = None

    def on_step(self, outputs: list[Any]) -> None:
        now = time.monotonic()
        if now - self._last_time < self.interval:
            return
        stats = self.engine.get_stats()
        last = self._last
        seconds = now - self._last_time
        prompt = stats.num_prompt_tokens - (last.num_prompt_tokens if last else 0)
        generated = stats.num_generated_tokens - (last.num_generated_tokens if last else 0)
        queries = stats.prefix_cache_queries - (last.prefix_cache_queries if last else 0)
        hits = stats.prefix_cache_hits - (last.prefix_cache_hits if last else 0)
        self._last_time, self._last = now, stats
        if not (prompt or generated or stats.num_running or stats.num_waiting or stats.num_swapped):
            return  # idle since the last line: nothing worth a line
        logger.info(
            "prompt throughput %.1f tokens/s, generation throughput %.1f tokens/s; running %d, waiting %d, "
            "swapped %d requests; KV cache usage %.1f%%; prefix cache hit rate %.1f%%; preemptions %d",
            prompt / seconds, generated / seconds, stats.num_running, stats.num_waiting, stats.num_swapped,
            100 * stats.kv_cache_usage, 100 * hits / queries if queries else 0.0, stats.num_preemptions,
        )
