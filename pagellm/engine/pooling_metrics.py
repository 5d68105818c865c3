"""The pooling server's Prometheus series: requests by route kind and outcome, inputs, prompt tokens,
request latency, and each step's batch (inputs and tokens); under pagellm's names, with vLLM's
``vllm:prompt_tokens_total``, ``vllm:request_success_total`` and ``vllm:e2e_request_latency_seconds``."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
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

    def on_request(self, kind: str, ok: bool, seconds: float, inputs: int, tokens: int) -> None:
        self.requests.labels(self.model_name, kind, "ok" if ok else "error").inc()
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

    def render(self) -> bytes:
        return generate_latest(self.registry)
