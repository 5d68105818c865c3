"""Whether `pagellm serve` keeps a flat resident memory under long storms of requests that clients drop.

Starts the server (the embedded default model unless a model path or serve flags are given) on
127.0.0.1 and sends it ``--requests`` mixed requests, ``--concurrency`` at a time: chat and text
completions, streamed and not, prompts of varied lengths, varied ``max_tokens``, some with ``n`` > 1,
and ``--disconnect`` of them dropped mid-way by closing the connection (a streamed one after its first
chunks, another within ``--drop-after`` seconds; these ask for the most tokens, ignoring EOS, so that the
server is still working on them). The requests go in rounds of ``--every``; after each round the
server is left to finish what it was running and its resident memory (VmRSS) is read. Prints one line
per round and the growth from the first round to the last, and exits with status 1 where that growth
exceeds ``--max-growth``.

    python benchmarks/serve_memory_soak.py [--requests 5000] [--every 500] [--concurrency 16]
        [--disconnect 0.3] [--model PATH] [-- serve flags...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from pagellm.entrypoints.openai.launch import free_port, wait_healthy

# Prompts are a question on one of these, after a run of filler words whose length varies per request.
TOPICS = ["the history of Rome", "how rainbows form", "a recipe for bread", "the rules of chess",
          "why the sky is blue", "the water cycle", "how a bicycle works", "the planets of the solar system"]
FILLER_TEXT = ("Please read the following notes carefully before answering the question at the end of them "
               "and keep the answer short and plain")


@dataclass
class Workload:
    """The mix of requests. ``max_prompt_words``/``max_tokens``: the upper ends of the uniform draws."""

    disconnect: float = 0.3
    max_prompt_words: int = 200
    max_tokens: int = 32
    multi_sample: float = 0.2
    # A dropped request that is not streamed is dropped after a wait drawn up to this (seconds).
    drop_after: float = 0.3
    seed: int = 0


@dataclass
class Tally:
    """What became of the requests sent: outcome -> count, and the first few unexpected answers."""

    outcomes: Counter = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)

    def unexpected(self, what: str) -> None:
        self.outcomes["error"] += 1
        if len(self.errors) < 5:
            self.errors.append(what)


def resident_mib(pid: int) -> float:
    """The process's resident memory (VmRSS) in MiB."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


def _request(i: int, model: str, work: Workload) -> tuple[str, dict, bool, bool]:
    """Request ``i`` of the storm: (path, body, streamed, dropped by the client)."""
    rng = random.Random(work.seed * 1_000_003 + i)
    words = rng.randint(0, work.max_prompt_words)
    filler_words = FILLER_TEXT.split()
    filler = " ".join(filler_words[k % len(filler_words)] for k in range(words))
    question = f"{filler}\nTell me about {rng.choice(TOPICS)}."
    stream = rng.random() < 0.5
    body: dict = {"model": model, "max_tokens": rng.randint(1, work.max_tokens),
                  "temperature": rng.choice([0.0, 0.7, 1.0]), "stream": stream}
    if rng.random() < work.multi_sample:
        body["n"] = rng.randint(2, 3)
    if rng.random() < 0.5:
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": question}]
    else:
        path = "/v1/completions"
        body["prompt"] = question
    drop = rng.random() < work.disconnect
    if drop:  # long enough that the client leaves while the server still works on it
        body.update(max_tokens=work.max_tokens, ignore_eos=True)
    return path, body, stream, drop


async def _one(client: httpx.AsyncClient, i: int, model: str, work: Workload, tally: Tally) -> None:
    path, body, stream, drop = _request(i, model, work)
    rng = random.Random(~i)
    try:
        if stream:
            async with client.stream("POST", path, json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    tally.unexpected(f"{path} -> {response.status_code}: {response.text[:200]}")
                    return
                keep = rng.randint(1, 3) if drop else None
                chunks = 0
                async for line in response.aiter_lines():
                    if line.startswith("data:"):
                        chunks += 1
                        if keep is not None and chunks >= keep:
                            break  # leaving the block closes the connection with the body unread
                tally.outcomes["dropped" if keep is not None and chunks >= keep else "streamed"] += 1
        else:
            try:  # a dropped request's wait runs out while the server works on it (or the answer comes first)
                response = await asyncio.wait_for(client.post(path, json=body),
                                                  rng.uniform(0, work.drop_after) if drop else None)
            except TimeoutError:
                tally.outcomes["dropped"] += 1
                return
            if response.status_code != 200:
                tally.unexpected(f"{path} -> {response.status_code}: {response.text[:200]}")
            else:
                tally.outcomes["answered"] += 1
    except httpx.HTTPError as e:
        tally.unexpected(f"{path}: {type(e).__name__}: {e}")


async def _wait_idle(client: httpx.AsyncClient, timeout: float = 60.0) -> None:
    """Until the server runs and holds no request (those the clients dropped are aborted)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = (await client.get("/metrics")).text
        busy = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(("pagellm_num_requests_running", "pagellm_num_requests_waiting")))
        if busy == 0:
            return
        await asyncio.sleep(0.1)


async def storm(url: str, pid: int, requests: int, every: int, concurrency: int, work: Workload,
                report: Callable[[int, float], None] | None = None) -> tuple[list[tuple[int, float]], Tally]:
    """Send ``requests`` mixed requests in rounds of ``every`` to the server at ``url`` (process ``pid``).

    Returns (requests sent so far, the server's RSS in MiB once idle) after each round, and the tally.
    ``report`` is called with each such pair as it is read.
    """
    samples: list[tuple[int, float]] = []
    tally = Tally()
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        sent = 0
        while sent < requests:
            end = min(requests, sent + every)
            queue = iter(range(sent, end))  # shared: each client takes the next request when it is free

            async def worker(ids: Iterator[int]) -> None:
                for i in ids:
                    await _one(client, i, model, work, tally)

            await asyncio.gather(*(worker(queue) for _ in range(concurrency)))
            sent = end
            await _wait_idle(client)
            await asyncio.sleep(0.5)
            samples.append((sent, resident_mib(pid)))
            if report is not None:
                report(*samples[-1])
    return samples, tally


def growth(samples: list[tuple[int, float]]) -> float:
    """The last sample's RSS over the first's, minus one."""
    return samples[-1][1] / samples[0][1] - 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--every", type=int, default=500, help="requests per round (RSS read after each)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--disconnect", type=float, default=0.3, help="share of requests the client drops")
    parser.add_argument("--max-prompt-words", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--drop-after", type=float, default=0.3,
                        help="a dropped request that is not streamed is dropped within this many seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-growth", type=float, default=0.10)
    parser.add_argument("--model", help="a model for `pagellm serve` (default: the embedded one)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds to wait for the server to start")
    parser.add_argument("serve_flags", nargs="*", help="flags for `pagellm serve` (after --)")
    args = parser.parse_args()
    pagellm = shutil.which("pagellm") or str(Path(sys.executable).with_name("pagellm"))
    port = free_port()
    log = Path(tempfile.mkdtemp(prefix="serve-memory-soak-")) / "server.log"
    cmd = [pagellm, "serve", *([args.model] if args.model else []), "--host", "127.0.0.1", "--port", str(port),
           *args.serve_flags]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_healthy(url, proc, args.timeout)
        except RuntimeError as e:
            raise SystemExit(f"{e}; the server's log: {log}") from None
        print(f"server pid {proc.pid}, idle RSS {resident_mib(proc.pid):.0f} MiB; log {log}", flush=True)
        print(f"{'requests':>8}  {'RSS MiB':>8}  {'vs first':>8}  {'elapsed s':>9}", flush=True)
        t0 = time.perf_counter()
        first: list[float] = []

        def report(sent: int, rss: float) -> None:
            first.append(rss)
            print(f"{sent:>8}  {rss:>8.0f}  {rss / first[0] - 1:>+8.1%}  {time.perf_counter() - t0:>9.0f}", flush=True)

        work = Workload(disconnect=args.disconnect, max_prompt_words=args.max_prompt_words,
                        max_tokens=args.max_tokens, drop_after=args.drop_after, seed=args.seed)
        samples, tally = asyncio.run(storm(url, proc.pid, args.requests, args.every, args.concurrency, work, report))
    finally:
        proc.terminate()
        proc.wait()
    print(f"outcomes: {json.dumps(dict(sorted(tally.outcomes.items())))}")
    for error in tally.errors:
        print(f"  unexpected: {error}")
    change = growth(samples)
    print(f"RSS growth from request {samples[0][0]} to {samples[-1][0]}: {change:+.1%} "
          f"({samples[0][1]:.0f} -> {samples[-1][1]:.0f} MiB; limit {args.max_growth:+.0%})")
    if change > args.max_growth or tally.errors:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
