"""Engine stats and request lifecycles -> Prometheus collectors (``prometheus_client``), under pagellm's
names and vLLM's (``metric_families``)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Gauge, generate_latest

from pagellm.core.lora_limit import adapter_names
from pagellm.core.sequence import Request
from pagellm.engine.llm_engine import LLMEngine
from pagellm.engine.metric_families import (
    VLLM_ENGINE,
    VLLM_ITERATION_TOKEN_BUCKETS,
    VLLM_N_BUCKETS,
    VLLM_REQUEST_LATENCY_BUCKETS,
    VLLM_TOKEN_LATENCY_BUCKETS,
    VLLM_TTFT_BUCKETS,
    Family,
    MetricFactory,
    buckets_1_2_5,
)
from pagellm.outputs import RequestMetrics, RequestOutput

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
THROUGHPUT_WINDOW_S = 10.0


class EngineMetrics:
    """Owns a registry (one per server, so tests can run several) and updates it after every step.

    ``prefix``: the names exposed (``metric_families.METRICS_PREFIXES``): pagellm's (``pagellm_``),
    vLLM's (``vllm:``, with its labels and buckets), or both."""

    def __init__(self, engine: LLMEngine, model_name: str, clock: Callable[[], float] = time.time,
                 prefix: str = "both") -> None:
        self.engine = engine
        self.clock = clock  # the engine's request times are time.time()
        self.registry = CollectorRegistry()
        f = MetricFactory(self.registry, model_name, prefix)
        tokens = buckets_1_2_5(engine.max_model_len)

        def hist(name: str, doc: str, vllm: str | tuple[str, ...] | None, vllm_buckets: tuple[float, ...]) -> Family:
            return f.histogram(name, doc, _LATENCY_BUCKETS, vllm, vllm_buckets)

        def count_hist(name: str, doc: str, buckets: tuple[float, ...] = tokens) -> Family:
            return f.histogram(f"pagellm_{name}", doc, buckets, name, buckets)

        self.running = f.gauge("pagellm_num_requests_running", "Requests with a sequence running on the engine",
                               "num_requests_running")
        self.waiting = f.gauge("pagellm_num_requests_waiting", "Requests waiting to be scheduled (new or preempted)",
                               "num_requests_waiting")
        self.swapped = f.gauge("pagellm_num_requests_swapped", "Requests swapped out to the CPU pool")
        # vllm:gpu_cache_usage_perc: vLLM's name before 0.9, still read by older dashboards and pickers.
        self.kv_usage = f.gauge("pagellm_kv_cache_usage_perc", "KV cache blocks in use, 0 to 1",
                                ("kv_cache_usage_perc", "gpu_cache_usage_perc"))
        self.kv_util = f.gauge("pagellm_kv_cache_utilization",
                               "KV slots holding a token's K/V (shared slots once) / all slots")
        self.blocks_util = f.gauge("pagellm_blocks_utilization", "KV blocks in use / all blocks")
        self.pending = f.gauge("pagellm_pending_requests", "Requests accepted but not scheduled even once yet")
        self.throughput = f.gauge("pagellm_generation_throughput",
                                  f"Generated tokens per second over the last {THROUGHPUT_WINDOW_S:.0f} s")
        self.sla = f.gauge("pagellm_sla_attainment",
                           "Share of finished requests with latency targets that met them (sla policy)")
        self.pc_queries = f.counter("pagellm_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                    vllm="prefix_cache_queries")
        self.pc_hits = f.counter("pagellm_prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                 vllm="prefix_cache_hits")
        self.prompt_tokens = f.counter("pagellm_prompt_tokens",
                                       "Prompt tokens, counted when a request's prefill completes",
                                       vllm="prompt_tokens")
        self.generation_tokens = f.counter("pagellm_generation_tokens", "Generated tokens (every sample's)",
                                           vllm="generation_tokens")
        self.success = f.counter("pagellm_request_success", "Finished requests, one per returned sample (n > 1)",
                                 ("finished_reason",), vllm="request_success")
        self.preemptions = f.counter("pagellm_num_preemptions", "Preemptions", vllm="num_preemptions")
        # Speculative decoding, as vLLM names it (acceptance length: 1 + accepted tokens / drafts).
        self.spec_drafts = f.counter("pagellm_spec_decode_num_drafts", "Sequence-steps that carried draft tokens",
                                     vllm="spec_decode_num_drafts")
        self.spec_draft_tokens = f.counter("pagellm_spec_decode_num_draft_tokens", "Draft tokens proposed",
                                           vllm="spec_decode_num_draft_tokens")
        self.spec_accepted = f.counter("pagellm_spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                       vllm="spec_decode_num_accepted_tokens")
        self.ttft = hist("pagellm_time_to_first_token_seconds", "Time to first token", "time_to_first_token_seconds",
                         VLLM_TTFT_BUCKETS)
        # vLLM 0.10 exposes the inter-token latency under its older name too (same observations).
        self.itl = hist("pagellm_inter_token_latency_seconds", "Time between two tokens of a sequence",
                        ("inter_token_latency_seconds", "time_per_output_token_seconds"), VLLM_TOKEN_LATENCY_BUCKETS)
        self.e2e = hist("pagellm_e2e_request_latency_seconds", "Arrival to finish", "e2e_request_latency_seconds",
                        VLLM_REQUEST_LATENCY_BUCKETS)
        self.queue_time = hist("pagellm_request_queue_time_seconds", "Arrival to first scheduled",
                               "request_queue_time_seconds", VLLM_REQUEST_LATENCY_BUCKETS)
        self.prefill_time = hist("pagellm_request_prefill_time_seconds", "First scheduled to first token",
                                 "request_prefill_time_seconds", VLLM_REQUEST_LATENCY_BUCKETS)
        self.decode_time = hist("pagellm_request_decode_time_seconds", "First token to finish",
                                "request_decode_time_seconds", VLLM_REQUEST_LATENCY_BUCKETS)
        self.inference_time = hist("pagellm_request_inference_time_seconds", "First scheduled to finish",
                                   "request_inference_time_seconds", VLLM_REQUEST_LATENCY_BUCKETS)
        self.tpot = hist("pagellm_request_time_per_output_token_seconds",
                         "A request's decode time per token after the first",
                         "request_time_per_output_token_seconds", VLLM_TOKEN_LATENCY_BUCKETS)
        self.req_prompt_tokens = count_hist("request_prompt_tokens", "Prompt tokens of each finished request")
        self.req_generation_tokens = count_hist("request_generation_tokens",
                                                "Generated tokens of each finished request (its returned samples')")
        self.req_max_generation = count_hist("request_max_num_generation_tokens",
                                             "Most tokens one returned sample of a finished request generated")
        self.req_max_tokens = count_hist("request_params_max_tokens", "max_tokens of each finished request")
        self.req_n = count_hist("request_params_n", "n of each finished request", VLLM_N_BUCKETS)
        self.iteration_tokens = count_hist("iteration_tokens_total", "Tokens (prompt and generated) per engine step",
                                           VLLM_ITERATION_TOKEN_BUCKETS)
        # The KV tier on disk (--kv-offload-dir): only where one is configured.
        self.disk_tier: dict[str, Family] = {}
        if engine.kv_cache_manager.disk is not None:
            self.disk_tier = {
                "kv_offload_hit_blocks": f.counter("pagellm_kv_offload_hit_blocks",
                                                   "KV blocks of prompts read back from the KV tier on disk"),
                "kv_offload_read_bytes": f.counter("pagellm_kv_offload_read_bytes",
                                                   "Bytes of KV blocks read from the KV tier on disk"),
                "kv_offload_written_bytes": f.counter("pagellm_kv_offload_written_bytes",
                                                      "Bytes of KV block files written to the KV tier on disk"),
                "kv_offload_evictions": f.counter("pagellm_kv_offload_evictions",
                                                  "KV block files the tier on disk deleted to stay within its size"),
                "kv_offload_failed_reads": f.counter("pagellm_kv_offload_failed_reads",
                                                     "Reads from the KV tier on disk that failed (a file gone, torn "
                                                     "or unreadable): the blocks were recomputed"),
            }
        if f.vllm:
            self._cache_config_info(engine)
        # vLLM's vllm:lora_requests_info: one series, labelled with the adapters running and waiting, set to
        # the time of the last step (readers take the newest); only where LoRA is enabled, as in vLLM.
        self.lora_info = Gauge("vllm:lora_requests_info", "Running stats on lora requests.",
                               ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                               registry=self.registry) if f.vllm and engine.lora is not None else None
        self.model_name = model_name
        # Create every series up front so that /metrics lists them before the first request.
        for metric in (self.pc_queries, self.pc_hits, self.prompt_tokens, self.generation_tokens, self.preemptions,
                       self.spec_drafts, self.spec_draft_tokens, self.spec_accepted, self.ttft, self.itl, self.e2e,
                       self.queue_time, self.prefill_time, self.decode_time, self.inference_time, self.tpot,
                       self.req_prompt_tokens, self.req_generation_tokens, self.req_max_generation,
                       self.req_max_tokens, self.req_n, self.iteration_tokens, *self.disk_tier.values()):
            metric.labels()
        for reason in ("stop", "length", "abort", "error"):
            self.success.labels(finished_reason=reason)
        # Per request id: each sequence's (tokens seen, time of its last token), for inter-token latency.
        self._seq_tokens: dict[str, dict[int, tuple[int, float]]] = {}
        # Per request id: its (n, max_tokens), read while the engine still holds the request.
        self._params: dict[str, tuple[int, int | None]] = {}
        self._window: deque[tuple[float, int]] = deque()
        # The counters that follow the engine's cumulative totals (EngineStats fields), each from the
        # totals at start: start-up work (preloaded prefixes) is not traffic.
        self._from_totals = {"num_generated_tokens": self.generation_tokens, "num_prompt_tokens": self.prompt_tokens,
                             "num_preemptions": self.preemptions, "prefix_cache_queries": self.pc_queries,
                             "prefix_cache_hits": self.pc_hits, "spec_decode_num_drafts": self.spec_drafts,
                             "spec_decode_num_draft_tokens": self.spec_draft_tokens,
                             "spec_decode_num_accepted_tokens": self.spec_accepted, **self.disk_tier}
        stats = engine.get_stats()
        self._counted = {field: getattr(stats, field) for field in self._from_totals}
        self._never_scheduled = 0
        self._refresh()

    def _cache_config_info(self, engine: LLMEngine) -> None:
        """vLLM's ``vllm:cache_config_info``: a gauge at 1 whose labels describe the KV cache."""
        cache = engine.cache_engine
        info = {"block_size": str(engine.block_size), "cache_dtype": engine.args.kv_cache_dtype,
                "enable_prefix_caching": str(engine.args.enable_prefix_caching),
                "num_gpu_blocks": str(cache.num_blocks), "num_cpu_blocks": str(cache.num_cpu_blocks),
                "engine": VLLM_ENGINE}
        Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", list(info),
              registry=self.registry).labels(**info).set(1)

    # The engine's state is read only in on_step, which the serving loop calls between two steps
    # (never while a step mutates the queues): after each step, and with no outputs when it goes idle.
    # render() reads none of it.
    def on_step(self, outputs: list[RequestOutput]) -> None:
        now = self.clock()
        for out in outputs:
            if out.request_id not in self._params:
                request = self.engine.requests.get(out.request_id)
                if request is not None:
                    params = request.sampling_params
                    self._params[out.request_id] = (params.n, params.max_tokens)
            seqs = self._seq_tokens.setdefault(out.request_id, {})
            for c in out.outputs:
                seen, last = seqs.get(c.index, (0, 0.0))
                if len(c.token_ids) > seen:
                    if seen:
                        self.itl.labels().observe(now - last)
                    seqs[c.index] = (len(c.token_ids), now)
            if out.finished:
                self._seq_tokens.pop(out.request_id, None)
                for c in out.outputs:  # one per returned sample, as vLLM counts n > 1 (child requests)
                    self.success.labels(finished_reason=c.finish_reason or "abort").inc()
                n, max_tokens = self._params.pop(out.request_id, (len(out.outputs), None))
                self._observe_request(out.metrics, len(out.prompt_token_ids),
                                      [len(c.token_ids) for c in out.outputs], n, max_tokens)
        self._refresh(now, stepped=bool(outputs))

    def on_abort(self, request: Request) -> None:
        """A request aborted (its gauges follow at the next on_step: aborts come in bursts)."""
        self._seq_tokens.pop(request.request_id, None)
        self._params.pop(request.request_id, None)
        params = request.sampling_params
        returned = request.seqs[: params.n]
        # Each sample it would have returned: those that had finished keep their reason.
        for seq in returned:
            reason = seq.status.finish_reason if seq.status.is_finished else None
            self.success.labels(finished_reason=reason or "abort").inc()
        self._observe_request(request.metrics, len(request.prompt_token_ids),
                              [seq.num_output_tokens for seq in returned], params.n, params.max_tokens,
                              finished_time=self.clock())

    def _observe_request(self, m: RequestMetrics | None, prompt_len: int, generated: list[int], n: int,
                         max_tokens: int | None, finished_time: float | None = None) -> None:
        """A finished request's histograms: its phases' times (vLLM's definitions) and token counts."""
        self.req_prompt_tokens.labels().observe(prompt_len)
        self.req_generation_tokens.labels().observe(sum(generated))
        self.req_max_generation.labels().observe(max(generated, default=0))
        self.req_n.labels().observe(n)
        if max_tokens:
            self.req_max_tokens.labels().observe(max_tokens)
        if m is None:
            return
        end = m.finished_time if m.finished_time is not None else finished_time
        if m.first_token_time is not None:
            self.ttft.labels().observe(m.first_token_time - m.arrival_time)
        if m.first_scheduled_time is not None:
            self.queue_time.labels().observe(m.first_scheduled_time - m.arrival_time)
            if m.first_token_time is not None:
                self.prefill_time.labels().observe(m.first_token_time - m.first_scheduled_time)
            if end is not None:
                self.inference_time.labels().observe(end - m.first_scheduled_time)
        if end is not None:
            self.e2e.labels().observe(end - m.arrival_time)
            if m.first_token_time is not None:
                decode = end - m.first_token_time
                self.decode_time.labels().observe(decode)
                most = max(generated, default=0)
                if most > 1:
                    self.tpot.labels().observe(decode / (most - 1))

    def _refresh(self, now: float | None = None, stepped: bool = False) -> None:
        """Gauges and counters from the engine's stats (between steps only); ``stepped``: after a step
        that produced outputs (its tokens go to the per-step histogram)."""
        now = now if now is not None else self.clock()
        self._trim_window(now)
        stats = self.engine.get_stats()
        self.running.labels().set(stats.num_running)
        self.waiting.labels().set(stats.num_waiting)
        self.swapped.labels().set(stats.num_swapped)
        if self.lora_info is not None:
            scheduler = self.engine.scheduler
            self.lora_info.clear()
            self.lora_info.labels(max_lora=str(self.engine.args.max_loras),
                                  waiting_lora_adapters=",".join(adapter_names(scheduler.waiting)),
                                  running_lora_adapters=",".join(adapter_names(scheduler.running))
                                  ).set_to_current_time()
        self.kv_usage.labels().set(stats.kv_cache_usage)
        self.blocks_util.labels().set(stats.kv_cache_usage)
        self.kv_util.labels().set(stats.kv_cache_utilization)
        self._never_scheduled = stats.num_never_scheduled
        if stats.sla_attainment is not None:
            self.sla.labels().set(stats.sla_attainment)
        step_tokens = 0
        for field, counter in self._from_totals.items():
            total = getattr(stats, field)
            if total > self._counted[field]:
                counter.labels().inc(total - self._counted[field])
                if counter is self.generation_tokens:
                    self._window.append((now, total - self._counted[field]))
                if counter is self.generation_tokens or counter is self.prompt_tokens:
                    step_tokens += total - self._counted[field]
                self._counted[field] = total
        if stepped and step_tokens:
            self.iteration_tokens.labels().observe(step_tokens)

    def _trim_window(self, now: float) -> None:
        while self._window and self._window[0][0] < now - THROUGHPUT_WINDOW_S:
            self._window.popleft()

    def render(self, pending: int = 0) -> bytes:
        """The exposition; ``pending``: requests accepted but not yet handed to the engine."""
        self._trim_window(self.clock())  # here too: an idle server's throughput falls to 0
        self.throughput.labels().set(sum(n for _, n in self._window) / THROUGHPUT_WINDOW_S)
        self.pending.labels().set(self._never_scheduled + pending)
        return generate_latest(self.registry)
