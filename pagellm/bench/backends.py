"""The same workload on each backend: pagellm, transformers three ways and llama.cpp (the peers; llama.cpp's
runner is in llama_cpp.py)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pagellm.bench.kv_strip import KVStripRecorder
from pagellm.bench.report import progress
from pagellm.bench.step_log import StepLog, StepRecord
from pagellm.bench.workloads import Workload

logger = logging.getLogger(__name__)

HF_BACKENDS = ("hf", "hf-batched", "hf-cb")  # transformers: a Hugging Face folder
BACKENDS = ("pagellm", *HF_BACKENDS, "llama.cpp")  # llama.cpp: a GGUF file
HF_BATCH_SIZES = (8, 16, 32, 64)


@dataclass
class BackendResult:
    backend: str
    elapsed_s: float
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    detail: dict[str, Any] = field(default_factory=dict)
    skipped: str | None = None  # why the backend did not run
    steps: list[StepRecord] = field(default_factory=list, repr=False)  # pagellm's steps (StepLog)
    kv_strip: KVStripRecorder | None = field(default=None, repr=False)  # pagellm's block grid over time

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed_s if self.elapsed_s else 0.0

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s if self.elapsed_s else 0.0

    @property
    def total_tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.elapsed_s if self.elapsed_s else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend, "elapsed_s": self.elapsed_s, "num_requests": self.num_requests,
            "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens,
            "requests_per_s": self.requests_per_s, "output_tokens_per_s": self.output_tokens_per_s,
            "total_tokens_per_s": self.total_tokens_per_s, "detail": self.detail, "skipped": self.skipped,
        }


def run_pagellm(model: Path, workload: Workload, dtype: str, engine_kwargs: dict[str, Any],
                label: str = "pagellm", kv_strip: bool = False, constrain: bool = True,
                loras: list[Any] | None = None) -> tuple[BackendResult, Any]:
    """Run on pagellm; returns the result and the LLM (its step log feeds the roofline). ``kv_strip``:
    also record the block grid over the run (``BackendResult.kv_strip``); ``constrain``: apply the
    workload's JSON schema to the requests it marks (json-schema); ``loras``: each request's LoRARequest
    (None: the base model), cycled over the requests."""
    from pagellm import LLM, SamplingParams, StructuredOutputsParams

    longest = max(len(p) for p in workload.prompts) + max(workload.output_lens)
    kwargs = {"max_model_len": longest, "dtype": dtype, **engine_kwargs}
    llm = LLM(str(model), **kwargs)
    params = [SamplingParams(n=workload.n, temperature=1.0 if workload.n > 1 else 0.0, seed=i, max_tokens=o,
                             ignore_eos=True) for i, o in enumerate(workload.output_lens)]
    if constrain and "schema" in workload.meta:
        so = StructuredOutputsParams(json=workload.meta["schema"])
        params = [p.clone(structured_outputs=so) if marked else p
                  for p, marked in zip(params, workload.meta["constrained"])]
    lora = [loras[i % len(loras)] for i in range(len(workload.prompts))] if loras else None
    llm.generate(workload.prompts[:2], [p.clone(max_tokens=4) for p in params[:2]], use_tqdm=False,  # warm-up
                 lora_request=lora[:2] if lora else None)
    llm.reset_prefix_cache()
    log = StepLog.install(llm.llm_engine)
    strip = KVStripRecorder.install(llm.llm_engine) if kv_strip else None
    t0 = time.perf_counter()
    outs = llm.generate(workload.prompts, params, use_tqdm=lambda **kw: progress(label, kw["total"]),
                        lora_request=lora)
    elapsed = time.perf_counter() - t0
    got = sum(len(c.token_ids) for o in outs for c in o.outputs)
    assert got == workload.output_tokens, f"pagellm produced {got} tokens, expected {workload.output_tokens}"
    ttfts: list[float] = []
    for o in outs:  # every request finished with tokens (ignore_eos): each has its first-token time
        assert o.metrics is not None and o.metrics.time_to_first_token is not None
        ttfts.append(o.metrics.time_to_first_token)
    stats = llm.kv_cache_stats()
    detail = {
        "ttft_mean_s": sum(ttfts) / len(ttfts),
        # Per request, in workload order: tokens after the first over the time they took.
        "decode_tok_s": [decode_rate(o) for o in outs],
        "steps": len(log.records),
        "preemptions": llm.llm_engine.scheduler.stats.num_preemptions,
        "prefix_cache_hit_rate": stats.prefix_cache_hit_rate,
        "peak_kv_blocks": stats.peak_in_use_blocks,
    }
    log.uninstall()
    if strip is not None:
        strip.uninstall()
    return BackendResult("pagellm", elapsed, workload.num_requests, workload.prompt_tokens, got, detail,
                         steps=log.records, kv_strip=strip), llm


def decode_rate(out: Any) -> float:
    m = out.metrics
    tokens = max(len(c.token_ids) for c in out.outputs) - 1
    span = (m.finished_time or 0.0) - (m.first_token_time or 0.0)
    return tokens / span if tokens > 0 and span > 0 else float("nan")


def _hf_model(model: Path, dtype: str) -> Any:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=getattr(torch, dtype)).eval()
    hf.generation_config.eos_token_id = None  # like ignore_eos: every request yields exactly its length
    hf.generation_config.pad_token_id = 0
    return hf


def run_hf(model: Path, workload: Workload, dtype: str) -> BackendResult:
    """transformers ``generate``, one request at a time."""
    hf = _hf_model(model, dtype)
    produced = 0
    with torch.inference_mode():
        hf.generate(torch.tensor([workload.prompts[0][:8]]), max_new_tokens=2, do_sample=False)  # warm-up
        with progress("hf", workload.num_requests) as bar:
            t0 = time.perf_counter()
            for prompt, out_len in zip(workload.prompts, workload.output_lens):
                ids = torch.tensor([prompt])
                out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=out_len,
                                  min_new_tokens=out_len, do_sample=workload.n > 1, num_return_sequences=workload.n)
                produced += (out.shape[1] - len(prompt)) * out.shape[0]
                bar.update(1)
            elapsed = time.perf_counter() - t0
    return BackendResult("hf", elapsed, workload.num_requests, workload.prompt_tokens, produced)


def run_hf_batched(model: Path, workload: Workload, dtype: str,
                   batch_sizes: tuple[int, ...] = HF_BATCH_SIZES) -> BackendResult:
    """transformers ``generate`` in static, left-padded batches; the best of ``batch_sizes``.

    A batch runs until its longest request is done; only the tokens each request asked
    for count as output (the rest is the waste static batching pays).
    """
    hf = _hf_model(model, dtype)
    per_size: dict[int, float] = {}
    sizes = [bs for i, bs in enumerate(batch_sizes) if i == 0 or bs <= workload.num_requests]
    with torch.inference_mode(), progress("hf-batched", workload.num_requests * len(sizes)) as bar:
        for bs in sizes:
            t0 = time.perf_counter()
            for start in range(0, workload.num_requests, bs):
                prompts = workload.prompts[start:start + bs]
                longest = max(len(p) for p in prompts)
                ids = torch.zeros((len(prompts), longest), dtype=torch.long)
                mask = torch.zeros_like(ids)
                for i, p in enumerate(prompts):
                    ids[i, longest - len(p):] = torch.tensor(p)
                    mask[i, longest - len(p):] = 1
                new = max(workload.output_lens[start:start + bs])
                hf.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                            do_sample=workload.n > 1, num_return_sequences=workload.n)
                bar.update(len(prompts))
            per_size[bs] = time.perf_counter() - t0
    best = min(per_size, key=lambda b: per_size[b])
    return BackendResult("hf-batched", per_size[best], workload.num_requests, workload.prompt_tokens,
                         workload.output_tokens, detail={"best_batch_size": best,
                                                         "elapsed_by_batch_size": per_size})


def run_hf_cb(model: Path, workload: Workload, dtype: str) -> BackendResult:
    """transformers' own continuous batching (``generate_batch``'s manager), where installed."""
    import transformers

    hf = _hf_model(model, dtype)
    if not hasattr(hf, "continuous_batching_context_manager"):
        return BackendResult("hf-cb", 0.0, workload.num_requests, workload.prompt_tokens, 0,
                             skipped=f"transformers {transformers.__version__} has no continuous batching")
    from transformers import GenerationConfig

    gen = GenerationConfig(do_sample=workload.n > 1, eos_token_id=None, pad_token_id=0,
                           max_new_tokens=max(workload.output_lens), num_return_sequences=workload.n)
    try:
        with torch.inference_mode(), hf.continuous_batching_context_manager(
            generation_config=gen, block=True, timeout=5
        ) as manager:
            t0 = time.perf_counter()
            for i, (prompt, out_len) in enumerate(zip(workload.prompts, workload.output_lens)):
                manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=out_len)
            produced, done = 0, 0
            bar = progress("hf-cb", workload.num_requests * workload.n, unit="seq")
            while done < workload.num_requests * workload.n:
                result = manager.get_result(timeout=5)
                if result is None:
                    if not manager.is_running():
                        raise RuntimeError("transformers' continuous batching thread stopped")
                    continue
                if result.is_finished():
                    done += 1
                    produced += len(result.generated_tokens)
                    bar.update(1)
            elapsed = time.perf_counter() - t0
            bar.close()
    except Exception as e:  # a peer failing must not sink the whole benchmark
        logger.warning("hf-cb failed: %s", e)
        return BackendResult("hf-cb", 0.0, workload.num_requests, workload.prompt_tokens, 0,
                             skipped=f"transformers continuous batching failed: {e}")
    return BackendResult("hf-cb", elapsed, workload.num_requests, workload.prompt_tokens, produced,
                         detail={"transformers": transformers.__version__})


def run_pagellm_one_by_one(model: Path, workload: Workload, dtype: str, engine_kwargs: dict[str, Any],
                           label: str = "pagellm") -> dict[str, Any]:
    """Greedy requests on pagellm one at a time, as a user waiting for each answer sends them (TTFT
    without queueing); then the engine stops (``LLM.shutdown``: the KV tier on disk, if any, gets the
    cached blocks). Returns the load and run times, each request's TTFT and tokens, and the tier's
    counters."""
    from pagellm import LLM, SamplingParams

    t0 = time.perf_counter()
    longest = max(len(p) for p in workload.prompts) + max(workload.output_lens)
    llm = LLM(str(model), max_model_len=longest, dtype=dtype, **engine_kwargs)
    # Warm-up on a prompt shorter than a block: nothing of it is cached, in memory or on disk.
    llm.generate([workload.prompts[0][:4]], SamplingParams(max_tokens=2), use_tqdm=False)
    load_s = time.perf_counter() - t0
    ttfts: list[float] = []
    tokens: list[list[int]] = []
    t0 = time.perf_counter()
    with progress(label, workload.num_requests) as bar:
        for prompt, out_len in zip(workload.prompts, workload.output_lens):
            out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=out_len), use_tqdm=False)[0]
            assert out.metrics is not None and out.metrics.time_to_first_token is not None
            ttfts.append(out.metrics.time_to_first_token)
            tokens.append(list(out.outputs[0].token_ids))
            bar.update(1)
    elapsed = time.perf_counter() - t0
    engine = llm.llm_engine
    disk, store = engine.kv_cache_manager.disk, engine.model_runner.disk_store
    tier = {} if disk is None or store is None else {
        "disk_hit_blocks": disk.hit_blocks, "bytes_read": store.bytes_read, "failed_reads": disk.failed_reads}
    hit_rate = llm.kv_cache_stats().prefix_cache_hit_rate
    t0 = time.perf_counter()
    llm.shutdown()
    shutdown_s = time.perf_counter() - t0
    if store is not None:
        tier["bytes_written"] = store.bytes_written
    return {"load_s": load_s, "elapsed_s": elapsed, "shutdown_s": shutdown_s, "ttft_s": ttfts, "tokens": tokens,
            "prefix_cache_hit_rate": hit_rate, **tier}
