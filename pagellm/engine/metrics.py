"""Engine stats and request lifecycles -> Prometheus collectors (``prometheus_client``)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pagellm.core.sequence import Request
from pagellm.engine.llm_engine import LLMEngine
from pagellm.outputs import RequestMetrics, RequestOutput

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
THROUGHPUT_WINDOW_S = 10.0


class EngineMetrics:
    """Owns a registry (one per server, so tests can run several) and updates it after every step."""

    def __init__(self, engine: LLMEngine, model_name: str, clock: Callable[[], float] = time.time) -> None:
        self.engine = engine
        self.clock = clock  # the engine's request times are time.time()
        self.registry = CollectorRegistry()
        r, label = self.registry, ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, label, registry=r)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, label + list(extra), registry=r)

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, label, buckets=_LATENCY_BUCKETS, registry=r)

        self.running = gauge("pagellm_num_requests_running", "Requests with a sequence running on the engine")
        self.waiting = gauge("pagellm_num_requests_waiting", "Requests waiting to be scheduled (new or preempted)")
        self.swapped = gauge("pagellm_num_requests_swapped", "Requests swapped out to the CPU pool")
        self.kv_usage = gauge("pagellm_kv_cache_usage_perc", "KV cache blocks in use, 0 to 1")
        self.kv_util = gauge("pagellm_kv_cache_utilization",
                             "KV slots holding a token's K/V (shared slots once) / all slots")
        self.blocks_util = gauge("pagellm_blocks_utilization", "KV blocks in use / all blocks")
        self.pending = gauge("pagellm_pending_requests", "Requests accepted but not scheduled even once yet")
        self.throughput = gauge(
            "pagellm_generation_throughput", f"Generated tokens per second over the last {THROUGHPUT_WINDOW_S:.0f} s"
        )
        self.sla = gauge("pagellm_sla_attainment",
                         "Share of finished requests with latency targets that met them (sla policy)")
        self.pc_queries = counter("pagellm_prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.pc_hits = counter("pagellm_prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.prompt_tokens = counter("pagellm_prompt_tokens",
                                     "Prompt tokens, counted when a request's prefill completes")
        self.generation_tokens = counter("pagellm_generation_tokens", "Generated tokens (every sample's)")
        self.success = counter("pagellm_request_success", "Finished requests, one per returned sample (n > 1)",
                               ("finished_reason",))
        self.preemptions = counter("pagellm_num_preemptions", "Preemptions")
        # Speculative decoding, as vLLM names it (acceptance length: 1 + accepted tokens / drafts).
        self.spec_drafts = counter("pagellm_spec_decode_num_drafts", "Sequence-steps that carried draft tokens")
        self.spec_draft_tokens = counter("pagellm_spec_decode_num_draft_tokens", "Draft tokens proposed")
        self.spec_accepted = counter("pagellm_spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self.ttft = hist("pagellm_time_to_first_token_seconds", "Time to first token")
        self.itl = hist("pagellm_inter_token_latency_seconds", "Time between two tokens of a sequence")
        self.e2e = hist("pagellm_e2e_request_latency_seconds", "Arrival to finish")
        self.queue_time = hist("pagellm_request_queue_time_seconds", "Arrival to first scheduled")
        self.model_name = model_name
        # Create every series up front so that /metrics lists them before the first request.
        for metric in (self.pc_queries, self.pc_hits, self.prompt_tokens, self.generation_tokens, self.preemptions,
                       self.spec_drafts, self.spec_draft_tokens, self.spec_accepted, self.ttft, self.itl, self.e2e,
                       self.queue_time):
            self._labelled(metric)
        for reason in ("stop", "length", "abort", "error"):
            self._labelled(self.success, finished_reason=reason)
        # Per request id: each sequence's (tokens seen, time of its last token), for inter-token latency.
        self._seq_tokens: dict[str, dict[int, tuple[int, float]]] = {}
        self._window: deque[tuple[float, int]] = deque()
        # The counters that follow the engine's cumulative totals (EngineStats fields), each from the
        # totals at start: start-up work (preloaded prefixes) is not traffic.
        self._from_totals = {"num_generated_tokens": self.generation_tokens, "num_prompt_tokens": self.prompt_tokens,
                             "num_preemptions": self.preemptions, "prefix_cache_queries": self.pc_queries,
                             "prefix_cache_hits": self.pc_hits, "spec_decode_num_drafts": self.spec_drafts,
                             "spec_decode_num_draft_tokens": self.spec_draft_tokens,
                             "spec_decode_num_accepted_tokens": self.spec_accepted}
        stats = engine.get_stats()
        self._counted = {field: getattr(stats, field) for field in self._from_totals}
        self._never_scheduled = 0
        self._refresh()

    def _labelled(self, metric, **extra: str):  # type: ignore[no-untyped-def]
        """``metric``'s child for this server's model (and ``extra`` labels)."""
        return metric.labels(model_name=self.model_name, **extra)

    # The engine's state is read only in on_step, which the serving loop calls between two steps
    # (never while a step mutates the queues): after each step, and with no outputs when it goes idle.
    # render() reads none of it.
    def on_step(self, outputs: list[RequestOutput]) -> None:
        now = self.clock()
        for out in outputs:
            seqs = self._seq_tokens.setdefault(out.request_id, {})
            for c in out.outputs:
                seen, last = seqs.get(c.index, (0, 0.0))
                if len(c.token_ids) > seen:
                    if seen:
                        self._labelled(self.itl).observe(now - last)
                    seqs[c.index] = (len(c.token_ids), now)
            if out.finished:
                self._seq_tokens.pop(out.request_id, None)
                for c in out.outputs:  # one per returned sample, as vLLM counts n > 1 (child requests)
                    self._labelled(self.success, finished_reason=c.finish_reason or "abort").inc()
                self._observe_latencies(out.metrics)
        self._refresh(now)

    def on_abort(self, request: Request) -> None:
        """A request aborted (its gauges follow at the next on_step: aborts come in bursts)."""
        self._seq_tokens.pop(request.request_id, None)
        # Each sample it would have returned: those that had finished keep their reason.
        for seq in request.seqs[: request.sampling_params.n]:
            reason = seq.status.finish_reason if seq.status.is_finished else None
            self._labelled(self.success, finished_reason=reason or "abort").inc()
        self._observe_latencies(request.metrics, finished_time=self.clock())

    def _observe_latencies(self, m: RequestMetrics | None, finished_time: float | None = None) -> None:
        if m is None:
            return
        if m.first_token_time is not None:
            self._labelled(self.ttft).observe(m.first_token_time - m.arrival_time)
        if m.first_scheduled_time is not None:
            self._labelled(self.queue_time).observe(m.first_scheduled_time - m.arrival_time)
        end = m.finished_time if m.finished_time is not None else finished_time
        if end is not None:
            self._labelled(self.e2e).observe(end - m.arrival_time)

    def _refresh(self, now: float | None = None) -> None:
        """Gauges and counters from the engine's stats (between steps only)."""
        now = now if now is not None else self.clock()
        self._trim_window(now)
        stats = self.engine.get_stats()
        self._labelled(self.running).set(stats.num_running)
        self._labelled(self.waiting).set(stats.num_waiting)
        self._labelled(self.swapped).set(stats.num_swapped)
        self._labelled(self.kv_usage).set(stats.kv_cache_usage)
        self._labelled(self.blocks_util).set(stats.kv_cache_usage)
        self._labelled(self.kv_util).set(stats.kv_cache_utilization)
        self._never_scheduled = stats.num_never_scheduled
        if stats.sla_attainment is not None:
            self._labelled(self.sla).set(stats.sla_attainment)
        for field, counter in self._from_totals.items():
            total = getattr(stats, field)
            if total > self._counted[field]:
                self._labelled(counter).inc(total - self._counted[field])
                if counter is self.generation_tokens:
                    self._window.append((now, total - self._counted[field]))
                self._counted[field] = total

    def _trim_window(self, now: float) -> None:
        while self._window and self._window[0][0] < now - THROUGHPUT_WINDOW_S:
            self._window.popleft()

    def render(self, pending: int = 0) -> bytes:
        """The exposition; ``pending``: requests accepted but not yet handed to the engine."""
        self._trim_window(self.clock())  # here too: an idle server's throughput falls to 0
        self._labelled(self.throughput).set(sum(n for _, n in self._window) / THROUGHPUT_WINDOW_S)
        self._labelled(self.pending).set(self._never_scheduled + pending)
        return generate_latest(self.registry)
