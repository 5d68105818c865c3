"""`pagellm bench router`: a shared-prefix workload through `pagellm serve --data-parallel-size 2` behind
vllm-router, one run per router policy, against one replica on all the cores.

The workload: ``--num-prefixes`` long system prompts (8), ``--num-prompts`` requests (200) each on one
of them chosen at random, with a short question of its own, sent ``--max-concurrency`` at a time. Each
setup is started fresh per repeat; the prefix-cache hit rate is every replica's
``pagellm_prefix_cache_hits_total / pagellm_prefix_cache_queries_total`` over the run, read from their
``/metrics``; throughput is requests and output tokens per second of wall time.

Each replica gets ``--replica-kv-blocks`` KV blocks (default: its half of the prefixes and two more); the
single replica gets as many as the replicas together, so both setups have the same KV memory. With
``--netns``, the two replicas also run as two hosts: each in a Linux network namespace of its own joined
to this one by a veth pair, the router here (root only; `pagellm/bench/router_netns.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from pagellm.bench import BenchError
from pagellm.bench.report import write_json
from pagellm.bench.servers import free_port, wait_healthy
from pagellm.bench.workloads import MODEL_PRESETS, bench_model_path

SETUPS = ("cache_aware", "round_robin", "single", "netns_cache_aware", "netns_round_robin")
_WORDS = [
    "harbour", "tide", "vessel", "cargo", "manifest", "berth", "pilot", "anchor", "crane", "customs",
    "ledger", "permit", "clearance", "draft", "ballast", "quay", "tugboat", "dredge", "beacon", "channel",
    "buoy", "mooring", "hawser", "winch", "freight", "tonnage", "inspector", "warehouse", "container",
    "schedule", "weather", "storm", "signal", "radio", "captain", "crew", "bosun", "galley", "hold", "deck",
]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("router", help="replicas behind vllm-router on a shared-prefix workload: cache_aware "
                                      "against round_robin against one replica on all the cores")
    p.add_argument("--model", default=None,
                   help="the model folder or GGUF file every replica serves (default: the random-weight "
                        "--model-preset with a byte-level BPE tokenizer)")
    p.add_argument("--model-preset", default="w1-llama", choices=list(MODEL_PRESETS),
                   help="the random-weight model shape when no --model is given")
    p.add_argument("--dtype", default="float32", help="the replicas' --dtype")
    p.add_argument("--setup", action="append", choices=SETUPS, default=None,
                   help="setups to run, repeatable (default: cache_aware, round_robin, single); netns_*: the "
                        "replicas in two network namespaces as two hosts (root)")
    p.add_argument("--num-prompts", type=int, default=200, help="requests per run")
    p.add_argument("--num-prefixes", type=int, default=8, help="distinct long system prompts")
    p.add_argument("--prefix-words", type=int, default=300, help="words per system prompt")
    p.add_argument("--output-len", type=int, default=8, help="tokens generated per request")
    p.add_argument("--max-concurrency", type=int, default=8, help="requests in flight at once")
    p.add_argument("--replica-kv-blocks", type=int, default=None,
                   help="KV blocks of each of the two replicas (default: its half of the prefixes and two more); "
                        "the single replica gets twice as many")
    p.add_argument("--repeats", type=int, default=3, help="runs of each setup; the median is reported")
    p.add_argument("--seed", type=int, default=0, help="seed of the shared prompts and their order")
    p.add_argument("--output-json", default=None, help="write every run's figures here")
    p.set_defaults(func=run)


@dataclass
class RunResult:
    setup: str
    hit_rate: float
    requests_per_s: float
    output_tokens_per_s: float
    seconds: float
    per_replica_requests: list[int]
    failed: int


def prefixes(n: int, words: int, seed: int) -> list[str]:
    """``n`` distinct system prompts of ``words`` words, the same for a given seed."""
    rng = random.Random(seed)
    return [f"System prompt {i}. You answer for the harbour office handbook, volume {i}. "
            + " ".join(rng.choice(_WORDS) for _ in range(words)) for i in range(n)]


def workload(num_prompts: int, system: Sequence[str], seed: int) -> list[str]:
    """``num_prompts`` prompts, each a random one of the system prompts and its own question."""
    rng = random.Random(seed + 1)
    return [f"{rng.choice(system)}\nQuestion {i}: which {rng.choice(_WORDS)} holds the {rng.choice(_WORDS)}?\n"
            for i in range(num_prompts)]


def metric(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.MULTILINE))


def scrape(urls: Sequence[str]) -> list[tuple[float, float, float]]:
    """(prefix-cache hits, queries, finished requests) of each replica."""
    out = []
    for url in urls:
        text = httpx.get(url + "/metrics", timeout=30).text
        out.append((metric(text, "pagellm_prefix_cache_hits_total"), metric(text, "pagellm_prefix_cache_queries_total"),
                    metric(text, "pagellm_request_success_total")))
    return out


async def send_all(url: str, model: str, prompts: Sequence[str], output_len: int, concurrency: int) -> tuple[int, int]:
    """(output tokens, failed requests) of sending every prompt, ``concurrency`` at a time."""
    gate = asyncio.Semaphore(concurrency)
    tokens = failed = 0
    async with httpx.AsyncClient(timeout=600) as client:
        async def one(prompt: str) -> None:
            nonlocal tokens, failed
            async with gate:
                body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
                        "ignore_eos": True}
                try:
                    r = await client.post(url + "/v1/completions", json=body)
                    r.raise_for_status()
                    tokens += r.json()["usage"]["completion_tokens"]
                except (httpx.HTTPError, KeyError, ValueError):
                    failed += 1
        await asyncio.gather(*(one(p) for p in prompts))
    return tokens, failed


MAX_MODEL_LEN = 2048
DTYPE = ["float32"]  # the run's --dtype (set by run)


@dataclass
class Launched:
    url: str
    replicas: list[str]
    procs: list[subprocess.Popen]
    cleanup: Any = None


def serve_cmd(model: str, port: int, blocks: int, extra: Sequence[str] = ()) -> list[str]:
    return [sys.executable, "-m", "pagellm.entrypoints.cli", "serve", model, "--port", str(port), "--served-model-name",
            "bench", "--num-kv-blocks", str(blocks), "--max-model-len", str(MAX_MODEL_LEN), "--disable-log-stats",
            "--dtype", DTYPE[0], *extra]


def launch(setup: str, model: str, blocks: int, log: Path) -> Launched:
    """Start ``setup`` and wait until it answers; the router's URL and each replica's."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    out = open(log, "ab")  # noqa: SIM115 (the server's log while it runs)
    if setup.startswith("netns_"):
        from pagellm.bench.router_netns import launch_netns

        router, replicas, procs, cleanup = launch_netns(setup.removeprefix("netns_"), model, blocks, port, out,
                                                        serve_cmd)
        wait_healthy(url, router, timeout=600)
        return Launched(url, replicas, procs, cleanup)
    if setup == "single":
        proc = subprocess.Popen(serve_cmd(model, port, 2 * blocks), stdout=out, stderr=subprocess.STDOUT)
        wait_healthy(url, proc, timeout=600)
        return Launched(url, [url], [proc])
    proc = subprocess.Popen(serve_cmd(model, port, blocks, ["-dp", "2", "--router-policy", setup]), stdout=out,
                            stderr=subprocess.STDOUT)
    wait_healthy(url, proc, timeout=600)
    replicas = [f"http://127.0.0.1:{p}" for p in re.findall(r"replica \d+: pid \d+, 127\.0\.0\.1:(\d+)",
                                                           log.read_text(errors="replace"))[-2:]]
    return Launched(url, replicas, [proc])


def stop(launched: Launched) -> None:
    for proc in launched.procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in launched.procs:
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if launched.cleanup is not None:
        launched.cleanup()


def run_once(setup: str, args: argparse.Namespace, model: str, prompts: list[str], blocks: int,
             log: Path) -> RunResult:
    launched = launch(setup, model, blocks, log)
    try:
        before = scrape(launched.replicas)
        start = time.perf_counter()
        tokens, failed = asyncio.run(send_all(launched.url, "bench", prompts, args.output_len, args.max_concurrency))
        seconds = time.perf_counter() - start
        after = scrape(launched.replicas)
    finally:
        stop(launched)
    hits = sum(a[0] - b[0] for a, b in zip(after, before))
    queries = sum(a[1] - b[1] for a, b in zip(after, before))
    return RunResult(setup, hits / queries if queries else 0.0, (len(prompts) - failed) / seconds, tokens / seconds,
                     seconds, [int(a[2] - b[2]) for a, b in zip(after, before)], failed)


def run(args: argparse.Namespace) -> int:
    if importlib_missing("vllm_router"):
        raise BenchError("pagellm bench router needs vLLM's router: pip install 'pagellm[router]'")
    if min(args.num_prompts, args.num_prefixes, args.prefix_words, args.output_len, args.max_concurrency,
           args.repeats) < 1:
        raise ValueError("--num-prompts, --num-prefixes, --prefix-words, --output-len, --max-concurrency and "
                         "--repeats must each be >= 1")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    DTYPE[0] = args.dtype
    if args.model is None:
        args.model = str(bench_model_path(args.model_preset, args.dtype, bpe=True))
    system = prefixes(args.num_prefixes, args.prefix_words, args.seed)
    prompts = workload(args.num_prompts, system, args.seed)
    from transformers import AutoTokenizer

    model_dir = Path(args.model) if Path(args.model).is_dir() else Path(args.model).parent
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    longest = max(len(tokenizer(p).input_ids) for p in prompts) + args.output_len
    if longest > MAX_MODEL_LEN:
        raise ValueError(f"a prompt and its output take {longest} tokens, over the replicas' max_model_len "
                         f"{MAX_MODEL_LEN}: lower --prefix-words")
    prefix_blocks = max(len(tokenizer(p).input_ids) for p in system) // 16 + 1
    # Each replica holds a little over its half of the prefixes: the regime where routing decides what is
    # cached (one replica holding every prefix would hit under any policy).
    blocks = args.replica_kv_blocks or max(prefix_blocks * (args.num_prefixes // 2 + 1) + args.max_concurrency * 4,
                                           longest // 16 + 2)
    setups = args.setup or ["cache_aware", "round_robin", "single"]
    log = Path(tempfile.gettempdir()) / f"pagellm-bench-router-{os.getpid()}.log"
    print(f"model {args.model}; {args.num_prompts} requests over {args.num_prefixes} system prompts of "
          f"{args.prefix_words} words ({prefix_blocks} blocks), {args.output_len} output tokens, "
          f"concurrency {args.max_concurrency}; "
          f"{blocks} KV blocks per replica ({2 * blocks} for the single one); servers' log: {log}", flush=True)
    results: list[RunResult] = []
    for repeat in range(args.repeats):
        for setup in setups:
            r = run_once(setup, args, args.model, prompts, blocks, log)
            results.append(r)
            print(f"[{repeat + 1}/{args.repeats}] {setup:18s} hit rate {r.hit_rate:6.1%}  "
                  f"{r.requests_per_s:6.2f} req/s  "
                  f"{r.output_tokens_per_s:7.1f} output tok/s  {r.seconds:6.1f} s  per replica "
                  f"{r.per_replica_requests}  failed {r.failed}", flush=True)
    print("\n| setup | prefix-cache hit rate | requests/s | output tokens/s |\n| --- | --- | --- | --- |")
    for setup in setups:
        mine = [r for r in results if r.setup == setup]
        print(f"| {setup} | {statistics.median(r.hit_rate for r in mine):.1%} | "
              f"{statistics.median(r.requests_per_s for r in mine):.2f} | "
              f"{statistics.median(r.output_tokens_per_s for r in mine):.1f} |")
    if args.output_json:
        write_json(Path(args.output_json), {"args": {k: v for k, v in vars(args).items() if k != "func"},
                                            "runs": [vars(r) for r in results]})
    return 0


def importlib_missing(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is None
