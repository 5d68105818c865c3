"""Embedding throughput: pagellm (offline LLM.embed, and the server's /v1/embeddings at concurrency 1, 8
and 64, one document per request) against sentence-transformers' encode at its best batch size, on
paragraphs of the standard library's docstrings (mixed lengths), all-MiniLM-L6-v2 by default. Prints a
table of documents per second (median of ``--runs``) and the p50 latency of one short query.

    python benchmarks/embed_throughput.py [--model FOLDER] [--docs 2000] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect
import os
import socket
import statistics
import subprocess
import sys
import time

import httpx

MODULES = ["json", "os", "collections", "asyncio", "http.server", "inspect", "random", "pathlib", "re", "typing",
           "argparse", "logging", "subprocess", "email", "unittest", "urllib.request", "functools", "itertools"]


def corpus(n: int) -> list[str]:
    docs: list[str] = []
    for name in MODULES:
        for _, obj in inspect.getmembers(importlib.import_module(name)):
            doc = inspect.getdoc(obj)
            if doc:
                docs.extend(p.strip() for p in doc.split("\n\n") if len(p.strip()) > 20)
    docs = list(dict.fromkeys(docs))
    return (docs * (n // max(len(docs), 1) + 1))[:n]


def timed(fn) -> float:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def serve_load(url: str, docs: list[str], concurrency: int) -> float:
    queue = list(reversed(docs))
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        async def worker() -> None:
            while queue:
                r = await http.post("/v1/embeddings", json={"input": queue.pop(), "truncate_prompt_tokens": -1})
                r.raise_for_status()
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - start


def sentence_transformers_rows(model: str, docs: list[str], batch_sizes: list[int],
                               runs: int) -> list[tuple[str, float]]:
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(model, device="cpu")
    rows = []
    for bs in batch_sizes:
        st.encode(docs[:bs], batch_size=bs)
        seconds = statistics.median(timed(lambda bs=bs: st.encode(docs, batch_size=bs)) for _ in range(runs))
        rows.append((f"sentence-transformers encode, batch {bs}", len(docs) / seconds))
    return rows


def pagellm_offline(model: str, docs: list[str], runs: int) -> tuple[float, list[float]]:
    """LLM.embed's documents per second, and the sorted latencies of one short query."""
    from pagellm import LLM

    llm = LLM(model, runner="pooling")
    llm.embed(docs[:64], use_tqdm=False, truncate_prompt_tokens=-1)
    seconds = statistics.median(
        timed(lambda: llm.embed(docs, use_tqdm=False, truncate_prompt_tokens=-1)) for _ in range(runs))
    query = ["how do I parse a JSON document?"]
    latencies = sorted(timed(lambda: llm.embed(query, use_tqdm=False)) for _ in range(50))
    llm.shutdown()
    return len(docs) / seconds, latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a sentence-transformers folder (default: all-MiniLM-L6-v2)")
    parser.add_argument("--docs", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--batch-sizes", default="16,32,64,128", help="sentence-transformers' batch sizes to try")
    parser.add_argument("--concurrency", default="1,8,64")
    args = parser.parse_args()
    from pagellm.model.default_model import minilm_path

    model = args.model or str(minilm_path())
    docs = corpus(args.docs)
    print(f"{len(docs)} documents, {model}")
    rows = sentence_transformers_rows(model, docs, [int(b) for b in args.batch_sizes.split(",")], args.runs)
    st_best = max(rate for _, rate in rows)
    rate, latencies = pagellm_offline(model, docs, args.runs)
    rows.append(("pagellm LLM.embed", rate))
    query = ["how do I parse a JSON document?"]
    port = free_port()
    env = dict(os.environ)
    proc = subprocess.Popen([sys.executable, "-m", "pagellm.entrypoints.cli", "serve", model, "--port", str(port),
                             "--disable-uvicorn-access-log"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        asyncio.run(serve_load(url, docs[:64], 8))
        for c in [int(c) for c in args.concurrency.split(",")]:
            seconds = statistics.median(asyncio.run(serve_load(url, docs, c)) for _ in range(args.runs))
            rows.append((f"pagellm server, concurrency {c}", len(docs) / seconds))
        server_lat = []
        with httpx.Client(base_url=url) as http:
            for _ in range(50):
                start = time.perf_counter()
                http.post("/v1/embeddings", json={"input": query[0]}).raise_for_status()
                server_lat.append(time.perf_counter() - start)
    finally:
        proc.terminate()
        proc.wait(30)
    print("\n| run | docs/s | vs sentence-transformers' best |\n| --- | ---: | ---: |")
    for name, rate in rows:
        print(f"| {name} | {rate:.1f} | {rate / st_best:.2f}x |")
    print(f"\none short query, p50: LLM.embed {latencies[len(latencies) // 2] * 1000:.2f} ms, "
          f"server {statistics.median(server_lat) * 1000:.2f} ms")


if __name__ == "__main__":
    main()
