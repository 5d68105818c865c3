"""The built-in load client of `pagellm bench serve`: streamed completions at a Poisson rate, each
request's TTFT and latency, and their summary."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from pagellm.bench import BenchError
from pagellm.bench.workloads import Workload


@dataclass
class RequestTrace:
    ok: bool
    prompt_tokens: int
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int,
                      headers: dict[str, str], sampling: dict[str, Any], prompt_tokens: int) -> RequestTrace:
    """One streamed completion; ``sampling``: the body's sampling fields (temperature, ignore_eos)."""
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens, **sampling,
                            "stream": True, "stream_options": {"include_usage": True}}
    trace = RequestTrace(ok=False, prompt_tokens=prompt_tokens)
    t0 = time.perf_counter()
    last = t0
    try:
        async with client.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                trace.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return trace
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                # A token arrived when a choice carries text (some servers end with an empty one).
                if any(c.get("text") for c in chunk.get("choices") or []):
                    if trace.ttft == 0.0:
                        trace.ttft = now - t0
                    else:
                        trace.itl.append(now - last)
                    last = now
                if chunk.get("usage"):
                    trace.output_tokens = chunk["usage"]["completion_tokens"]
                    # What the server tokenised (text prompts need not round-trip to the workload's ids).
                    trace.prompt_tokens = chunk["usage"].get("prompt_tokens", trace.prompt_tokens)
        trace.latency = time.perf_counter() - t0
        trace.ok = True
    except httpx.HTTPError as e:
        trace.error = str(e)
    except (json.JSONDecodeError, AttributeError, KeyError, TypeError) as e:  # not OpenAI's stream format
        trace.error = f"the server's stream is not OpenAI's format: {type(e).__name__}: {e}"
    return trace


async def run_load(base_url: str, model: str, workload: Workload, prompts: list[str], rate: float,
                   max_concurrency: int | None, headers: dict[str, str], sampling: dict[str, Any],
                   seed: int) -> tuple[list[RequestTrace], float]:
    rng = random.Random(seed)
    sem = asyncio.Semaphore(max_concurrency or len(workload.prompts))
    url = base_url.rstrip("/") + "/v1/completions"
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        async def limited(prompt: str, out: int, num_prompt_tokens: int) -> RequestTrace:
            async with sem:
                return await one_request(client, url, model, prompt, out, headers, sampling, num_prompt_tokens)

        tasks = []
        t0 = time.perf_counter()
        for prompt, ids, out in zip(prompts, workload.prompts, workload.output_lens):
            tasks.append(asyncio.create_task(limited(prompt, out, len(ids))))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        traces = await asyncio.gather(*tasks)
        return list(traces), time.perf_counter() - t0


def summarize(traces: list[RequestTrace], duration: float, goodput: dict[str, float]) -> dict[str, Any]:
    ok = [t for t in traces if t.ok]

    def stats(values: list[float]) -> dict[str, float]:
        if not values:
            return {"mean_ms": 0.0, "median_ms": 0.0, "p99_ms": 0.0}
        vs = sorted(values)
        return {"mean_ms": 1000 * statistics.mean(vs), "median_ms": 1000 * statistics.median(vs),
                "p99_ms": 1000 * vs[min(len(vs) - 1, int(0.99 * len(vs)))]}

    good = [t for t in ok if t.ttft * 1000 <= goodput.get("ttft", float("inf"))
            and (t.tpot is None or t.tpot * 1000 <= goodput.get("tpot", float("inf")))
            and t.latency * 1000 <= goodput.get("e2el", float("inf"))]
    out_tokens = sum(t.output_tokens for t in ok)
    return {
        "completed": len(ok), "failed": len(traces) - len(ok), "duration_s": duration,
        "request_throughput": len(ok) / duration, "output_token_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + sum(t.prompt_tokens for t in ok)) / duration,
        "goodput_requests_per_s": len(good) / duration if goodput else None,
        "ttft": stats([t.ttft for t in ok]), "tpot": stats([t.tpot for t in ok if t.tpot is not None]),
        "itl": stats([x for t in ok for x in t.itl]), "e2el": stats([t.latency for t in ok]),
        "errors": sorted({t.error for t in traces if t.error})[:5],
    }


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    if items is not None and not items:
        raise ValueError("--goodput needs at least one KEY:MS, e.g. --goodput ttft:500 tpot:50")
    out = {}
    for item in items or []:
        key, _, value = item.partition(":")
        if key not in ("ttft", "tpot", "e2el") or not value:
            raise ValueError(f"--goodput takes ttft:MS, tpot:MS or e2el:MS, got {item!r}")
        try:
            ms = float(value)
        except ValueError:
            ms = math.nan
        if not 0 < ms < math.inf:
            raise ValueError(f"--goodput {key}: the limit must be a positive number of milliseconds, got {value!r}")
        out[key] = ms
    return out



def warm_up_server(label: str, base_url: str, served: str, warm_up: tuple[Workload, str], args: argparse.Namespace,
             sampling: dict[str, Any], headers: dict[str, str], log_path: Path | None) -> None:
    """One short request, unmeasured: servers that warm up on their first request (transformers'
    continuous batching does, for seconds) would otherwise charge it to the first measurement."""
    warm, warm_prompt = warm_up
    (trace,), _ = asyncio.run(run_load(base_url, served, warm, [warm_prompt], float("inf"), None, headers,
                                       sampling, args.seed))
    if not trace.ok:
        where = f" (its output is in {log_path})" if log_path else ""
        raise BenchError(f"the {label} server at {base_url} failed the warm-up request: {trace.error}{where}")
