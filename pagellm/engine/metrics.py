"""Engine stats and request lifecycles -> Prometheus collectors (``prometheus_client``)."""

from __future__ import annotations

import time
from collections import deque
from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pagellm.core.sequence import Request
from pagellm.engine.llm_engine import LLMEngine
from pagellm.outputs import RequestOutput

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
THROUGHPUT_WINDOW_S = 10.0


class EngineMetrics:
    """Owns a registry (one per server, so tests can run several) and updates it after every step."""

    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        self.engine = engine
        self.registry = CollectorRegistry()
        r, label = self.registry, ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, label, registry=r)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, label + list(extra), registry=r)

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, label, buckets=_LATENCY_BUCKETS, registry=r)

        self.running = gauge("pagellm_num_requests_running", "Requests with a sequence running on the engine")
        self.waiting = gauge("pagellm_num_requests_waiting", "Sequences waiting to be scheduled")
        self.swapped = gauge("pagellm_num_requests_swapped", "Sequences swapped out to the CPU pool")
        self.kv_usage = gauge("pagellm_kv_cache_usage_perc", "KV cache blocks in use, 0 to 1")
        self.kv_util = gauge("pagellm_kv_cache_utilization", "KV slots holding tokens / all slots")
        self.blocks_util = gauge("pagellm_blocks_utilization", "KV blocks in use / all blocks")
        self.pending = gauge("pagellm_pending_requests", "Requests accepted but not yet scheduled")
        self.throughput = gauge(
            "pagellm_generation_throughput", f"Generated tokens per second over the last {THROUGHPUT_WINDOW_S:.0f} s"
        )
        self.sla = gauge("pagellm_sla_attainment",
                         "Share of finished requests with latency targets that met them (sla policy)")
        self.pc_queries = counter("pagellm_prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.pc_hits = counter("pagellm_prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.prompt_tokens = counter("pagellm_prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("pagellm_generation_tokens", "Generated tokens")
        self.success = counter("pagellm_request_success", "Finished requests", ("finished_reason",))
        self.preemptions = counter("pagellm_num_preemptions", "Preemptions")
        self.ttft = hist("pagellm_time_to_first_token_seconds", "Time to first token")
        self.itl = hist("pagellm_inter_token_latency_seconds", "Time between two tokens of a sequence")
        self.e2e = hist("pagellm_e2e_request_latency_seconds", "Arrival to finish")
        self.queue_time = hist("pagellm_request_queue_time_seconds", "Arrival to first scheduled")
        self.model_name = model_name
        # Create every series up front so that /metrics lists them before the first request.
        for metric in (self.pc_queries, self.pc_hits, self.prompt_tokens, self.generation_tokens, self.preemptions,
                       self.ttft, self.itl, self.e2e, self.queue_time):
            self._l(metric)
        for reason in ("stop", "length", "abort"):
            self._l(self.success, finished_reason=reason)
        self._tokens_seen: dict[str, int] = {}
        self._last_token_time: dict[str, float] = {}
        self._window: deque[tuple[float, int]] = deque()
        self._last_preemptions = 0
        self._last_pc = (0, 0)
        self.update_gauges(pending=0)

    def _l(self, metric, **extra: str):  # type: ignore[no-untyped-def]
        return metric.labels(model_name=self.model_name, **extra)

    def on_step(self, outputs: list[RequestOutput], pending: int = 0) -> None:
        now = time.time()
        new_tokens = 0
        for out in outputs:
            total = sum(len(c.token_ids) for c in out.outputs)
            seen = self._tokens_seen.get(out.request_id, 0)
            if total > seen:
                new_tokens += total - seen
                self._tokens_seen[out.request_id] = total
                last = self._last_token_time.get(out.request_id)
                if last is not None:
                    self._l(self.itl).observe(now - last)
                self._last_token_time[out.request_id] = now
            if out.finished:
                self._finish(out)
        if new_tokens:
            self._l(self.generation_tokens).inc(new_tokens)
            self._window.append((now, new_tokens))
        while self._window and self._window[0][0] < now - THROUGHPUT_WINDOW_S:
            self._window.popleft()
        self.update_gauges(pending)

    def _finish(self, out: RequestOutput) -> None:
        self._tokens_seen.pop(out.request_id, None)
        self._last_token_time.pop(out.request_id, None)
        reason = out.outputs[0].finish_reason or "abort"
        self._l(self.success, finished_reason=reason).inc()
        self._l(self.prompt_tokens).inc(len(out.prompt_token_ids))
        m = out.metrics
        if m is not None:
            if m.first_token_time is not None:
                self._l(self.ttft).observe(m.first_token_time - m.arrival_time)
            if m.finished_time is not None:
                self._l(self.e2e).observe(m.finished_time - m.arrival_time)
            if m.first_scheduled_time is not None:
                self._l(self.queue_time).observe(m.first_scheduled_time - m.arrival_time)

    def on_abort(self, request: Request) -> None:
        self._tokens_seen.pop(request.request_id, None)
        self._last_token_time.pop(request.request_id, None)
        self._l(self.success, finished_reason="abort").inc()
        self._l(self.prompt_tokens).inc(len(request.prompt_token_ids))

    def update_gauges(self, pending: int) -> None:
        stats = self.engine.get_stats()
        running_requests = {s.request.request_id for s in self.engine.scheduler.running}
        self._l(self.running).set(len(running_requests))
        self._l(self.waiting).set(stats.num_waiting)
        self._l(self.swapped).set(stats.num_swapped)
        self._l(self.kv_usage).set(stats.kv_cache_usage)
        self._l(self.blocks_util).set(stats.kv_cache_usage)
        self._l(self.kv_util).set(stats.kv_cache_utilization)
        self._l(self.pending).set(stats.num_waiting + pending)
        if stats.sla_attainment is not None:
            self._l(self.sla).set(stats.sla_attainment)
        tokens = sum(n for _, n in self._window)
        self._l(self.throughput).set(tokens / THROUGHPUT_WINDOW_S)
        if stats.num_preemptions > self._last_preemptions:
            self._l(self.preemptions).inc(stats.num_preemptions - self._last_preemptions)
            self._last_preemptions = stats.num_preemptions
        q, h = stats.prefix_cache_queries, stats.prefix_cache_hits
        if q > self._last_pc[0]:
            self._l(self.pc_queries).inc(q - self._last_pc[0])
        if h > self._last_pc[1]:
            self._l(self.pc_hits).inc(h - self._last_pc[1])
        self._last_pc = (q, h)

    def render(self, pending: Optional[int] = None) -> bytes:
        if pending is not None:
            self.update_gauges(pending)
        return generate_latest(self.registry)
