"""The pooling server's Prometheus series: requests by route kind and outcome, inputs, prompt tokens,
request latency, and each step's batch (inputs and tokens); under pagellm's names, with vLLM's
``vllm:prompt_tokens_total``, ``vllm:request_success_total`` and ``vllm:e2e_request_latency_seconds``."""

from __future__ import annotations

import statistics
import time
from collections import deque
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# The dashboard's rates and latency percentiles are over the requests of the last WINDOW_S seconds.
WINDOW_S = 60.0
_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class PoolingMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r, label = self.registry, {"model_name": model_name}
        self.requests = Counter("pagellm_pooling_requests", "pooling requests by kind (embed, score, rerank, "
                                "classify, pooling) and outcome (ok, error)", ["model_name", "kind", "outcome"],
                                registry=r)
        self.inputs = Counter("pagellm_pooling_inputs", "inputs pooled (texts, pairs, token-id lists)",
                              ["model_name"], registry=r).labels(**label)
        self.tokens = Counter("pagellm_prompt_tokens", "prompt tokens pooled", ["model_name"],
                              registry=r).labels(**label)
        self.latency = Histogram("pagellm_pooling_request_latency_seconds", "a pooling request's time, body "
                                 "parsed to answer built", ["model_name", "kind"], buckets=_LATENCY_BUCKETS,
                                 registry=r)
        self.batch_tokens = Histogram("pagellm_pooling_batch_tokens", "tokens of each step's batch",
                                      ["model_name"], buckets=_TOKEN_BUCKETS, registry=r).labels(**label)
        self.batch_inputs = Histogram("pagellm_pooling_batch_inputs", "inputs of each step's batch",
                                      ["model_name"], buckets=_TOKEN_BUCKETS, registry=r).labels(**label)
        # vLLM's names, for dashboards that read them.
        self.vllm_tokens = Counter("vllm:prompt_tokens", "prompt tokens pooled", ["model_name", "engine"],
                                   registry=r).labels(model_name=model_name, engine="0")
        self.vllm_success = Counter("vllm:request_success", "requests answered", ["model_name", "engine",
                                    "finished_reason"], registry=r).labels(model_name=model_name, engine="0",
                                                                           finished_reason="stop")
        self.vllm_latency = Histogram("vllm:e2e_request_latency_seconds", "a request's time", ["model_name", "engine"],
                                      buckets=_LATENCY_BUCKETS, registry=r).labels(model_name=model_name, engine="0")
        self.model_name = model_name
        self.started = time.monotonic()
        self.totals = {"requests": 0, "errors": 0, "inputs": 0, "tokens": 0}
        self.by_kind: dict[str, int] = {}
        self._recent: deque[tuple[float, float, int, int]] = deque()  # (finished at, seconds, inputs, tokens)

    def on_request(self, kind: str, ok: bool, seconds: float, inputs: int, tokens: int) -> None:
        self.requests.labels(self.model_name, kind, "ok" if ok else "error").inc()
        self.totals["requests" if ok else "errors"] += 1
        self.by_kind[kind] = self.by_kind.get(kind, 0) + 1
        if ok:
            self.totals["inputs"] += inputs
            self.totals["tokens"] += tokens
            self._recent.append((time.monotonic(), seconds, inputs, tokens))
        self.latency.labels(self.model_name, kind).observe(seconds)
        if ok:
            self.inputs.inc(inputs)
            self.tokens.inc(tokens)
            self.vllm_tokens.inc(tokens)
            self.vllm_success.inc()
            self.vllm_latency.observe(seconds)

    def on_step(self, inputs: int, tokens: int) -> None:
        self.batch_inputs.observe(inputs)
        self.batch_tokens.observe(tokens)

    def stats(self) -> dict[str, Any]:
        """The dashboard's figures: totals, and over the last ``WINDOW_S`` seconds requests/s, inputs/s,
        tokens/s and the requests' latency percentiles (ms)."""
        now = time.monotonic()
        while self._recent and self._recent[0][0] < now - WINDOW_S:
            self._recent.popleft()
        span = max(min(WINDOW_S, now - self.started), 1e-9)
        latencies = sorted(r[1] for r in self._recent)

        def pct(q: float) -> float | None:
            return latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1e3 if latencies else None

        return {"model": self.model_name, "window_s": WINDOW_S, **{f"{k}_total": v for k, v in self.totals.items()},
                "requests_by_kind": dict(self.by_kind), "requests_per_s": len(latencies) / span,
                "inputs_per_s": sum(r[2] for r in self._recent) / span,
                "tokens_per_s": sum(r[3] for r in self._recent) / span,
                "latency_ms": {"p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99),
                               "mean": statistics.fmean(latencies) * 1e3 if latencies else None}}

    def render(self) -> bytes:
        return generate_latest(self.registry)
