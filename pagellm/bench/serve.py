"""`pagellm bench serve`: an online load generator for any OpenAI-compatible completions endpoint.

Poisson arrivals at ``--request-rate`` (or all at once with ``inf``), at most
``--max-concurrency`` in flight; reports TTFT, TPOT ((latency - TTFT) / (tokens - 1)),
inter-token latency and end-to-end latency (mean, median, p99), throughput and goodput.

``--server pagellm --server transformers`` launches each server in turn on the same model and
sends both the same requests (prompts as text: the benchmark tokenizer round-trips exactly). Each
rate draws its own requests (seed, seed + 1, ...) so that no prefix cache sees a prompt twice.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import logging
import math
import random
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import httpx

from pagellm.bench import BenchError
from pagellm.bench.report import append_markdown_row, line_plot, write_json
from pagellm.bench.servers import free_port, wait_healthy
from pagellm.bench.throughput import add_common_args, build_workload, prepare
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


def _flag_value(convert: Callable[[str], Any], ok: Callable[[Any], bool], what: str) -> Callable[[str], Any]:
    """An argparse ``type``: ``convert(text)`` where ``ok``, else a usage error saying it is not ``what``."""
    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text} is not {what}") from None
        if not ok(value):  # NaN fails every comparison
            raise argparse.ArgumentTypeError(f"{text} is not {what}")
        return value
    return parse


_temperature = _flag_value(float, lambda v: 0.0 <= v <= 2.0, "a temperature in [0, 2]")  # the OpenAI API's range
_rate = _flag_value(float, lambda v: v > 0, "a request rate: give requests/s > 0, or inf")
_at_least_one = _flag_value(int, lambda v: v >= 1, "an integer >= 1")


# Engine flags of the pagellm server bench serve launches. Their parser default is None, so that
# giving one (even at its usual value) with --base-url, whose server keeps its own settings, or with
# only --server transformers, which has no such settings, is refused rather than ignored.
_PAGELLM_FLAGS = ("block_size", "kv_cache_memory", "max_num_seqs", "max_num_batched_tokens")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="online latency and throughput against an OpenAI-compatible server")
    add_common_args(p)
    p.add_argument("--server", action="append", choices=list(SERVERS), default=None,
                   help="server to launch on the model; repeatable, each gets the same requests "
                        "(default: pagellm; transformers = `transformers serve --continuous-batching`)")
    p.add_argument("--base-url", default=None,
                   help="load an already running server instead of launching one (default: launch --server)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name the server expects (default: the one its /v1/models lists)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY' to a --base-url server")
    p.add_argument("--request-rate", type=_rate, nargs="+", default=[float("inf")],
                   help="requests/s (Poisson); several values run one after the other; inf: all at once")
    p.add_argument("--max-concurrency", type=_at_least_one, default=None,
                   help="most requests in flight at once (default: no limit)")
    p.add_argument("--goodput", nargs="*", default=None, metavar="KEY:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 (default: none, goodput = throughput)")
    p.add_argument("--no-ignore-eos", action="store_true", help="for servers without vLLM's ignore_eos extension")
    p.add_argument("--temperature", type=_temperature, default=0.0,
                   help="sampling temperature of every request (default 0: greedy, as vllm bench serve)")
    p.add_argument("--label", default=None, help="name of the --base-url server in the results (default: external)")
    usual = {name: p.get_default(name) for name in _PAGELLM_FLAGS}
    p.set_defaults(func=run, pagellm_flag_defaults=usual, **{name: None for name in _PAGELLM_FLAGS})


def resolve_engine_flags(args: argparse.Namespace, servers: list[str]) -> None:
    """Refuse engine flags no server would take; give the others their usual values."""
    given = ", ".join("--" + n.replace("_", "-") for n in _PAGELLM_FLAGS if getattr(args, n) is not None)
    if given and args.base_url is not None:
        raise ValueError(f"{given}: engine flags of a server bench serve launches; a --base-url server keeps "
                         "its own settings: drop them")
    if given and "pagellm" not in servers:
        raise ValueError(f"{given}: engine flags of a launched pagellm server; `transformers serve` has no such "
                         "settings: drop them")
    for name, usual in args.pagellm_flag_defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, usual)


def _pagellm_command(model: str, port: int, args: argparse.Namespace) -> list[str]:
    cmd = [sys.executable, "-m", "pagellm.entrypoints.cli", "serve", model, "--port", str(port), "--dtype", args.dtype,
           "--kv-cache-memory", args.kv_cache_memory, "--block-size", str(args.block_size),
           "--max-num-seqs", str(args.max_num_seqs)]
    if args.max_num_batched_tokens is not None:
        cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    return cmd


def _transformers_cli() -> str:
    """transformers' own console script: the one installed beside this interpreter, else the one on PATH."""
    beside = Path(sys.executable).with_name("transformers")
    cli = str(beside) if beside.exists() else shutil.which("transformers")
    if cli is None:
        raise BenchError("--server transformers needs the `transformers` command; it was not found beside "
                         f"{sys.executable} nor on PATH")
    if importlib.util.find_spec("accelerate") is None:
        raise BenchError("--server transformers needs `accelerate` (transformers serve loads models with it): "
                         "pip install 'pagellm[bench]'")
    return cli


def _transformers_command(model: str, port: int, args: argparse.Namespace) -> list[str]:
    return [_transformers_cli(), "serve", model, "--continuous-batching", "--device", "cpu", "--dtype", args.dtype,
            "--host", "127.0.0.1", "--port", str(port)]


# name -> (launch command, accepts vLLM's ignore_eos extension)
SERVERS: dict[str, tuple[Callable[[str, int, argparse.Namespace], list[str]], bool]] = {
    "pagellm": (_pagellm_command, True),
    "transformers": (_transformers_command, False),
}


def _launch(server: str, model: str, args: argparse.Namespace) -> tuple[subprocess.Popen, str, Path]:
    """Start ``server`` on a free port, its output going to ``server-<name>.log`` in the output folder."""
    port = free_port()
    command = SERVERS[server][0](model, port, args)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    log_path = args.output_dir / f"server-{server}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
    except RuntimeError as e:
        raise BenchError(f"{e}; its output is in {log_path}") from None
    return proc, url, log_path


def _load_server(label: str, base_url: str, served: str, loads: list[tuple[float, Workload, list[str]]],
                 warm_up: tuple[Workload, str], args: argparse.Namespace, goodput: dict[str, float],
                 ignore_eos: bool, log_path: Path | None = None) -> dict[str, Any]:
    """Each (rate, workload, text prompts) of ``loads`` against one server; returns the summaries by rate."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    sampling: dict[str, Any] = {"temperature": args.temperature, **({"ignore_eos": True} if ignore_eos else {})}
    # One short request first, unmeasured: servers that warm up on their first request (transformers'
    # continuous batching does, for seconds) would otherwise charge it to the first rate.
    warm, warm_prompt = warm_up
    (trace,), _ = asyncio.run(run_load(base_url, served, warm, [warm_prompt], float("inf"), None, headers,
                                       sampling, args.seed))
    if not trace.ok:
        where = f" (its output is in {log_path})" if log_path else ""
        raise BenchError(f"the {label} server at {base_url} failed the warm-up request: {trace.error}{where}")
    results = {}
    for rate, workload, prompts in loads:
        traces, duration = asyncio.run(run_load(base_url, served, workload, prompts, rate, args.max_concurrency,
                                                headers, sampling, args.seed))
        summary = summarize(traces, duration, goodput)
        summary["workload_seed"] = workload.meta.get("seed")
        results[str(rate)] = summary
        print(f"[{label}] rate {rate}: {summary['completed']} ok, {summary['failed']} failed in "
              f"{duration:.1f} s; {summary['request_throughput']:.2f} req/s, "
              f"{summary['output_token_throughput']:.1f} out tok/s")
        for key in ("ttft", "tpot", "itl", "e2el"):
            st = summary[key]
            print(f"    {key.upper():5} mean {st['mean_ms']:8.1f} ms  median {st['median_ms']:8.1f} ms  "
                  f"p99 {st['p99_ms']:8.1f} ms")
        if goodput:
            print(f"    goodput {summary['goodput_requests_per_s']:.2f} req/s under {goodput}")
        for err in summary["errors"]:
            print(f"    error: {err}")
    if not any(s["completed"] for s in results.values()):
        raise BenchError(f"every request to the {label} server failed (nothing measured for it, nothing written "
                         "for it); "
                         f"first errors: {'; '.join(next(iter(results.values()))['errors'])}")
    return results


def _write_results(label: str, workload: Workload, model_name: str, goodput: dict[str, float],
                   results: dict[str, Any], out: Path, temperature: float) -> None:
    stem = f"serve-{label}-{workload.name}-{model_name}"
    payload = {"command": "serve", "label": label, "model": model_name, "workload": workload.name,
               "temperature": temperature, "goodput_slo_ms": goodput, "results": results}
    print(f"wrote {write_json(out / f'{stem}.json', payload)}")
    for rate, s in results.items():
        if not s["completed"]:  # no measurement: the JSON keeps its errors, the table no row of zeros
            continue
        append_markdown_row(
            out / "serve.md",
            ["date", "server", "workload", "model", "rate", "req/s", "out tok/s", "TTFT p50 ms", "TTFT p99 ms",
             "TPOT p50 ms", "ITL p50 ms", "E2E p50 ms"],
            [time.strftime("%Y-%m-%d"), label, workload.name, model_name, rate, s["request_throughput"],
             s["output_token_throughput"], s["ttft"]["median_ms"], s["ttft"]["p99_ms"], s["tpot"]["median_ms"],
             s["itl"]["median_ms"], s["e2el"]["median_ms"]],
        )
    rates = [float(r) for r in results]
    finite = [r if r != float("inf") else max([x for x in rates if x != float("inf")], default=1.0) * 2 for r in rates]
    line_plot(out / f"{stem}-latency.png",
              {f"{k} {q}": (finite, [results[r][k][f"{q}_ms"] for r in results])
               for k in ("ttft", "tpot") for q in ("median", "p99")},
              "request rate (req/s; inf plotted at 2x the largest)", "ms", f"latency by request rate ({label})")


def _compare(all_results: dict[str, dict[str, Any]]) -> None:
    """Print, per rate, each other server against the first (pagellm when launched)."""
    (base, base_results), *others = all_results.items()
    for label, results in others:
        for rate, s in results.items():
            b = base_results[rate]
            ratio = b["output_token_throughput"] / max(s["output_token_throughput"], 1e-9)
            print(f"rate {rate}: {base} {b['output_token_throughput']:.1f} out tok/s vs {label} "
                  f"{s['output_token_throughput']:.1f} ({ratio:.1f}x); TTFT median {b['ttft']['median_ms']:.0f} vs "
                  f"{s['ttft']['median_ms']:.0f} ms; TPOT median {b['tpot']['median_ms']:.0f} vs "
                  f"{s['tpot']['median_ms']:.0f} ms")


def run(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    servers = args.server or ["pagellm"]
    if args.workload == "parallel":
        raise ValueError("bench serve sends one completion per request: the parallel workload (n > 1) is "
                         "measured by `pagellm bench throughput --workload parallel`")
    if args.base_url is not None and args.server:
        raise ValueError("--server launches a server and --base-url loads a running one: give one of them")
    if args.base_url is None and args.label is not None:
        raise ValueError("--label names a --base-url server; launched servers are named by --server")
    if len(set(servers)) != len(servers):
        raise ValueError(f"--server given twice for the same server: {' '.join(servers)}")
    resolve_engine_flags(args, servers)
    if args.base_url is None and "transformers" in servers:
        _transformers_cli()  # missing tools are found now, not after the pagellm server's run
    goodput = parse_goodput(args.goodput)
    model, model_name, config = prepare(args)
    vocab = config.vocab_size
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    # Each rate gets its own requests (seed, seed + 1, ...), the same for every server: repeating the
    # previous rate's prompts would let a prefix cache answer them from memory.
    # (decode of one sequence of ids returns one str; transformers annotates str | list[str])
    loads: list[tuple[float, Workload, list[str]]] = []
    for k, rate in enumerate(args.request_rate):
        w = build_workload(args, vocab, seed=args.seed + k)
        loads.append((rate, w, [cast(str, tokenizer.decode(p)) for p in w.prompts]))
    workload = loads[0][1]
    # The warm-up prompt is the first prompt's last tokens reversed: it shares no prefix with the
    # workload, so a prefix cache gains nothing from it.
    warm_ids = workload.prompts[0][::-1][:16]
    warm_up = (Workload("warm-up", [warm_ids], [min(4, workload.output_lens[0])]),
               cast(str, tokenizer.decode(warm_ids)))
    all_results: dict[str, dict[str, Any]] = {}
    if args.base_url is not None:
        label = args.label or "external"
        served = args.served_model_name or model_name
        all_results[label] = _load_server(label, args.base_url, served, loads, warm_up, args, goodput,
                                          not args.no_ignore_eos)
        _write_results(label, workload, model_name, goodput, all_results[label], args.output_dir,
                       args.temperature)
    else:
        for server in servers:
            proc, base_url, log_path = _launch(server, str(model), args)
            try:
                ignore_eos = SERVERS[server][1] and not args.no_ignore_eos
                all_results[server] = _load_server(server, base_url, args.served_model_name or str(model), loads,
                                                   warm_up, args, goodput, ignore_eos, log_path)
            finally:
                proc.terminate()
                proc.wait(timeout=60)
            # Written at once: a later server failing does not lose this one's measurement.
            _write_results(server, workload, model_name, goodput, all_results[server], args.output_dir,
                           args.temperature)
    if len(all_results) > 1:
        _compare(all_results)
    return 0
