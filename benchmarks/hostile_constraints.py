"""What a hostile output constraint costs everyone else: a victim request's latency and a running
stream's longest stall while the server refuses (or compiles) each constraint.

Starts `pagellm serve` (the embedded default model unless flags say otherwise), measures a plain chat
request alone (median of ``--runs``), then for each hostile constraint: sends it while a stream of
200 tokens runs (the stream's longest gap between two chunks while the constraint is in flight),
then sends a variant of it (compiled afresh) with the victim request 50 ms behind (the victim's
latency over its latency alone).

    python benchmarks/hostile_constraints.py [--runs 3] [-- serve flags...]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_startup import free_port  # noqa: E402


def lark_chain(n: int) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "a"\n'


def gbnf_chain(n: int) -> str:
    return "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(n)) + f'r{n} ::= "a"\n'


def ref_chain(n: int) -> dict[str, Any]:
    defs: dict[str, Any] = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}},
                                      "required": ["x"]} for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def schema(s: dict[str, Any]) -> Callable[[int], dict[str, Any]]:
    return lambda salt: {"response_format": {"type": "json_schema", "json_schema": {
        "name": "s", "schema": {**s, "description": f"variant {salt}"}}}}


def grammar(text: str) -> Callable[[int], dict[str, Any]]:
    return lambda salt: {"structured_outputs": {"grammar": text + f"\n// variant {salt}\n"}}


def choice(options: list[str]) -> Callable[[int], dict[str, Any]]:
    return lambda salt: {"structured_outputs": {"choice": [*options, f"variant {salt}"]}}


MUTUAL_CYCLE = {"$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"allOf": [{"$ref": "#/$defs/A"}]}}, "$ref": "#/$defs/A"}
# Each takes a number that varies its text, so that every trial compiles it afresh (the server
# keeps what it compiled, and what it refused, by the constraint's text).
HOSTILE: dict[str, Callable[[int], dict[str, Any]]] = {
    "none (a plain request, for comparison)": lambda salt: {},
    "choice of 60,000 (589 KB)": choice([f"option {i:05d} here" for i in range(60_000)]),
    "choice of 500 KB": choice(["x" * 500_000]),
    "Lark literal of 500 KB": grammar('start: "' + "ab" * 250_000 + '"'),
    "Lark literal of 100 KB": grammar('start: "' + "ab" * 50_000 + '"'),
    "pattern ^a{1000000}$": schema({"type": "string", "pattern": "^a{1000000}$"}),
    "Lark chain of 3,500 rules": grammar(lark_chain(3500)),
    "GBNF chain of 4,900 rules": lambda salt: {"structured_outputs": {"grammar": gbnf_chain(4900) + "#" * salt}},
    "GBNF chain of 10,000 rules": grammar(gbnf_chain(10_000)),
    "$ref chain 1,000 deep": schema(ref_chain(1000)),
    "$ref self-cycle": schema({"$defs": {"A": {"$ref": "#/$defs/A"}}, "$ref": "#/$defs/A"}),
    "tool with a $ref cycle": lambda salt: {"tools": [{"type": "function", "function": {
        "name": f"f{salt}", "parameters": MUTUAL_CYCLE}}], "tool_choice": "required"},
}
VICTIM = {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 16, "temperature": 0}


async def timed_post(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> tuple[int, float]:
    t0 = time.perf_counter()
    r = await client.post(path, json=body, timeout=300)
    return r.status_code, time.perf_counter() - t0


async def stream_gaps(client: httpx.AsyncClient) -> list[tuple[float, float]]:
    """(arrival, gap) of each chunk of a long stream."""
    body = {"prompt": "Once upon a time", "max_tokens": 200, "stream": True, "ignore_eos": True}
    arrivals: list[float] = []
    async with client.stream("POST", "/v1/completions", json=body, timeout=300) as r:
        async for line in r.aiter_lines():
            if line.startswith("data:"):
                arrivals.append(time.perf_counter())
    return [(b, b - a) for a, b in zip(arrivals, arrivals[1:])]


async def one(client: httpx.AsyncClient, name: str, make: Callable[[int], dict[str, Any]], alone: float) -> str:
    """Two trials: the hostile request next to a running stream (the stream's longest gap while it is
    in flight), then next to the victim request (the victim's latency)."""
    def hostile_body(salt: int) -> dict[str, Any]:
        return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **make(salt)}

    stream = asyncio.create_task(stream_gaps(client))
    await asyncio.sleep(0.5)  # the stream is running
    t0 = time.perf_counter()
    status, took = await timed_post(client, "/v1/chat/completions", hostile_body(1))
    gaps = await stream
    stall = max((g for at, g in gaps if t0 <= at <= t0 + took + 0.05), default=0.0)
    hostile = asyncio.create_task(timed_post(client, "/v1/chat/completions", hostile_body(2)))
    await asyncio.sleep(0.05)
    _, victim = await timed_post(client, "/v1/chat/completions", VICTIM)
    await hostile
    return (f"| {name} | {status} | {took:.2f} s | {stall * 1000:.0f} ms | {victim:.2f} s | "
            f"{victim / alone:.2f} |")


async def main_async(url: str, runs: int) -> None:
    async with httpx.AsyncClient(base_url=url) as client:
        await timed_post(client, "/v1/chat/completions", VICTIM)  # warm
        alone = statistics.median([(await timed_post(client, "/v1/chat/completions", VICTIM))[1]
                                   for _ in range(runs)])
        print(f"victim alone: {alone:.3f} s (median of {runs})")
        print("| hostile constraint | status | hostile took | stream's longest stall | victim | victim / alone |")
        print("|---|---:|---:|---:|---:|---:|")
        for name, make in HOSTILE.items():
            print(await one(client, name, make, alone), flush=True)
        health = await client.get("/health")
        print(f"/health after all: {health.status_code}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("serve_flags", nargs="*")
    args = parser.parse_args()
    port = free_port()
    log = Path("/tmp") / f"pagellm-hostile-{port}.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "pagellm.entrypoints.cli", "serve", "--port", str(port),
                                 *args.serve_flags], stdout=out, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 300
        while time.time() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"the server exited with status {proc.returncode}; its log: {log}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        asyncio.run(main_async(url, args.runs))
        print(f"server still running: {proc.poll() is None}")
    finally:
        proc.terminate()
        proc.wait(timeout=60)


if __name__ == "__main__":
    main()
