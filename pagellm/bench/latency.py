"""`pagellm bench latency`: one request at a time (single stream), prefill and decode speed of pagellm and
llama.cpp on the same model file with the same thread count.

Per prompt length and run, each backend takes the same random prompt (token ids) and generates exactly
``--new-tokens`` tokens greedily, past any end-of-sequence token. Prefill tok/s is prompt tokens over the
time to the first token; decode tok/s is the tokens after the first over the time they took. Both
engines are loaded once and warmed up at every prompt length; the backends take turns, in the opposite
order every other run, so a slow stretch of a shared machine falls on both.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagellm.bench import BenchError, llama_cpp
from pagellm.bench.report import append_markdown_row, ratio, write_json
from pagellm.bench.throughput import DEFAULT_OUTPUT, check_output_dir, set_threads
from pagellm.bench.workloads import random_workload
from pagellm.config import QUANTIZATION_METHODS
from pagellm.model.loader import load_config, resolve_model_files
from pagellm.text import plural

BACKENDS = ("pagellm", llama_cpp.NAME)
DEFAULT_PROMPT_LENS = (128, 1024)
# Between two backends' turns: the threads of the one that just ran stop spinning before the other starts.
PAUSE_S = 0.2


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("latency", help="single stream: prefill and decode tok/s of pagellm and llama.cpp on the "
                                       "same GGUF file and thread count")
    p.add_argument("model", nargs="?", default=None,
                   help="a GGUF file (both backends), or a Hugging Face folder (pagellm alone); none: the embedded "
                        "default, SmolLM2-135M-Instruct's Q4_1 GGUF, as `pagellm serve` (`pagellm default-model`)")
    p.add_argument("--backend", action="append", choices=BACKENDS, default=None,
                   help="repeatable; default: both on a GGUF file, pagellm on a folder (llama.cpp: through "
                        f"llama-cpp-python, {llama_cpp.INSTALL})")
    p.add_argument("--prompt-len", type=int, nargs="+", default=list(DEFAULT_PROMPT_LENS),
                   help="prompt lengths in tokens, each measured")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens generated per request")
    p.add_argument("--runs", type=int, default=3, help="runs per backend and prompt length (median and spread)")
    p.add_argument("--threads", type=int, default=None,
                   help="threads of pagellm (torch) and llama.cpp alike (default: torch's own count)")
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                   help="pagellm's compute and KV dtype (auto: the engine's choice, float32 on a CPU without "
                        "native bfloat16)")
    p.add_argument("--kv-cache-memory", default="1GiB", help="pagellm: bytes for the KV cache")
    p.add_argument("--quantization", default=None, choices=QUANTIZATION_METHODS,
                   help="pagellm's weights, as `pagellm serve --quantization` (default: a GGUF file's quantized "
                        "blocks where the native kernels run; none: dequantized into --dtype)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts (run r draws with seed + r)")
    p.add_argument("--output-dir", type=Path, default=DEFAULT_OUTPUT, help="where the JSON and the table go")
    p.set_defaults(func=run)


@dataclass
class Sample:
    """One request's prefill and decode rates."""

    prefill_tok_s: float
    decode_tok_s: float


@dataclass
class Series:
    """One backend at one prompt length, over the runs."""

    samples: list[Sample] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key in ("prefill_tok_s", "decode_tok_s"):
            values = [getattr(s, key) for s in self.samples]
            out[key] = {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}
        return out


class PagellmStream:
    def __init__(self, model: Path, dtype: str, max_model_len: int, kv_cache_memory: str,
                 quantization: str | None = None) -> None:
        from pagellm import LLM

        self.llm = LLM(str(model), dtype=dtype, max_model_len=max_model_len, kv_cache_memory=kv_cache_memory,
                       quantization=quantization)

    @property
    def weights(self) -> str:
        """What the linear layers hold: the engine's dtype, or the quantized block types."""
        from pagellm.model.quant_linear import QuantLinear

        model = self.llm.llm_engine.model
        types = sorted({s.type_name for m in model.modules() if isinstance(m, QuantLinear) for s in m.segments})
        dtype = str(self.llm.llm_engine.dtype).removeprefix("torch.")
        return f"{dtype} ({'+'.join(types)} weights)" if types else dtype

    def generate(self, prompt: list[int], new_tokens: int) -> llama_cpp.Generation:
        from pagellm import SamplingParams

        self.llm.reset_prefix_cache()  # every prompt is computed in full
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, detokenize=False)
        out = self.llm.generate([prompt], params, use_tqdm=False)[0]
        m = out.metrics
        assert m is not None and m.first_token_time is not None and m.finished_time is not None
        return llama_cpp.Generation(out.outputs[0].token_ids, m.first_token_time - m.arrival_time,
                                    m.finished_time - m.first_token_time)


class LlamaCppStream:
    def __init__(self, model: Path, n_ctx: int, threads: int) -> None:
        self.llm = llama_cpp.load(model, n_ctx, threads)

    def generate(self, prompt: list[int], new_tokens: int) -> llama_cpp.Generation:
        return llama_cpp.generate(self.llm, prompt, new_tokens)

    def close(self) -> None:
        self.llm.close()  # now: left to interpreter exit, llama-cpp-python's finalizer fails noisily


def check_args(args: argparse.Namespace) -> None:
    """Refuse, before any work, flags no run could honour."""
    if args.runs < 1:
        raise ValueError(f"--runs must be >= 1, got {args.runs}")
    if args.new_tokens < 2:
        raise ValueError(f"--new-tokens must be >= 2 (decode is timed after the first token), got {args.new_tokens}")
    if any(n < 1 for n in args.prompt_len):
        raise ValueError(f"--prompt-len must all be >= 1, got {' '.join(map(str, args.prompt_len))}")
    if len(set(args.prompt_len)) != len(args.prompt_len):
        raise ValueError(f"--prompt-len given twice for the same length: {' '.join(map(str, args.prompt_len))}")
    if args.backend and len(set(args.backend)) != len(args.backend):
        raise ValueError(f"--backend given twice for the same backend: {' '.join(args.backend)}")


def run(args: argparse.Namespace) -> int:
    check_args(args)
    if args.model is None:
        from pagellm.model.default_model import default_model_path

        args.model = str(default_model_path())
        print(f"no model given: the embedded default, {args.model}")
    files = resolve_model_files(args.model)
    backends = args.backend or (list(BACKENDS) if files.gguf is not None else ["pagellm"])
    if llama_cpp.NAME in backends:
        llama_cpp.check_gguf(args.model)
    config = load_config(files.folder)
    longest = max(args.prompt_len) + args.new_tokens
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and longest > limit:
        raise ValueError(f"--prompt-len {max(args.prompt_len)} + --new-tokens {args.new_tokens} = {longest} tokens, "
                         f"more than the model's max_position_embeddings ({limit}): lower them")
    check_output_dir(args.output_dir)
    threads = set_threads(args.threads)
    busy_before = busy_machine_warning(threads)  # before this command's own work
    model = Path(args.model)
    model_name = model.stem if files.gguf is not None else model.name

    skipped: dict[str, str] = {}
    streams: dict[str, Any] = {}
    for name in backends:
        if name == llama_cpp.NAME:
            why = llama_cpp.unavailable()
            if why is not None:
                skipped[name] = why
                print(f"  {name}: skipped ({why})")
                continue
            streams[name] = LlamaCppStream(model, longest, threads)
        else:
            streams[name] = PagellmStream(model, args.dtype, longest, args.kv_cache_memory, args.quantization)
    if not streams:
        raise BenchError("no backend could run: " + "; ".join(f"{k}: {v}" for k, v in skipped.items()))
    dtype = streams["pagellm"].weights if "pagellm" in streams else None
    print(f"single stream on {model_name}: prompts of {', '.join(map(str, args.prompt_len))} tokens, "
          f"{plural(args.new_tokens, 'new token')}, {plural(args.runs, 'run')}, {plural(threads, 'thread')}; "
          f"pagellm in {dtype}")

    prompts = {n: [random_workload(1, (n, n), (1, 1), config.vocab_size, args.seed + r).prompts[0]
                   for r in range(args.runs)] for n in args.prompt_len}
    series = {(name, n): Series() for name in streams for n in args.prompt_len}
    llama = streams.get(llama_cpp.NAME)
    llama_settings = llama_cpp.settings(llama.llm) if llama is not None else None
    try:
        measure(streams, prompts, args.new_tokens, args.runs, series)
    finally:
        if llama is not None:
            llama.close()

    results = {str(n): {name: series[name, n].summary() for name in streams} for n in args.prompt_len}
    ratios = {str(n): {f"{key}_pagellm_over_llama_cpp": ratio(res["pagellm"][key]["median"],
                                                             res[llama_cpp.NAME][key]["median"])
                       for key in ("prefill_tok_s", "decode_tok_s")}
              for n, res in results.items() if "pagellm" in res and llama_cpp.NAME in res}
    print_table(results, ratios)
    payload = {
        "command": "latency", "model": model_name, "dtype": dtype, "threads": threads,
        "prompt_lens": args.prompt_len, "new_tokens": args.new_tokens, "runs": args.runs, "seed": args.seed,
        "backends": list(streams), "skipped": skipped, "busy_cores_before": busy_before,
        "llama_cpp": llama_settings,
        "results": results, "ratios": ratios,
    }
    out = args.output_dir
    print(f"\nwrote {write_json(out / f'latency-{model_name}.json', payload)}")
    columns = ["date", "model", "pagellm dtype", "threads", "prompt", "new"]
    for key in ("prefill", "decode"):
        columns += [f"pagellm {key} tok/s", f"llama.cpp {key} tok/s", f"{key} pagellm/llama.cpp"]
    for n, res in results.items():
        row: list[Any] = [time.strftime("%Y-%m-%d"), model_name, dtype or "-", threads, n, args.new_tokens]
        for key in ("prefill", "decode"):
            row += [spread(res.get(name, {}).get(f"{key}_tok_s")) for name in BACKENDS]
            x = ratios.get(n, {}).get(f"{key}_tok_s_pagellm_over_llama_cpp")
            row.append(f"{x:.2f}x" if x else "-")
        append_markdown_row(out / "latency.md", columns, row)
    return 0


def measure(streams: dict[str, Any], prompts: dict[int, list[list[int]]], new_tokens: int, runs: int,
            series: dict[tuple[str, int], Series]) -> None:
    """A warm-up at every prompt length, then ``runs`` rounds of every length on every backend, the
    backends' order reversed every other round."""
    for per_run in prompts.values():  # kernels, allocations: not timed
        for stream in streams.values():
            stream.generate(per_run[0], 4)
    order = list(streams)
    for r in range(runs):
        for n, per_run in prompts.items():
            for name in order if r % 2 == 0 else order[::-1]:
                time.sleep(PAUSE_S)
                g = streams[name].generate(per_run[r], new_tokens)
                if len(g.tokens) != new_tokens:
                    raise RuntimeError(f"{name} produced {plural(len(g.tokens), 'token')}, expected {new_tokens}")
                series[name, n].samples.append(Sample(n / g.ttft_s, g.decode_tok_s))


def busy_machine_warning(threads: int) -> float | None:
    """Cores other work keeps busy, measured over half a second before the runs (None where /proc/stat is not
    there); a warning where the threads would not each have a core: a thread waiting for a busy core
    stalls every thread at each barrier, and the rates fall many times over."""
    busy = busy_cores()
    cores = os.cpu_count() or 1
    if busy is not None and busy > max(0.3, cores - threads + 0.3):
        wanted = f"{plural(threads, 'thread')} {'is' if threads == 1 else 'are'} wanted"
        print(f"warning: other work keeps {busy:.1f} of {plural(cores, 'core')} busy and {wanted}: "
              "the rates will be low and noisy")
    return busy


def busy_cores(seconds: float = 0.5) -> float | None:
    def sample() -> tuple[int, int]:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(fields), fields[3] + fields[4]  # all jiffies; idle + iowait

    try:
        total0, idle0 = sample()
        time.sleep(seconds)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    total = total1 - total0
    return (1 - (idle1 - idle0) / total) * (os.cpu_count() or 1) if total > 0 else None


def spread(stats: dict[str, Any] | None) -> str:
    """``median (min–max)`` over the runs, or ``-`` for a backend that did not run."""
    if stats is None:
        return "-"

    def fmt(v: float) -> str:
        return f"{v:.3g}" if v < 100 else f"{v:.0f}"

    return f"{fmt(stats['median'])} ({fmt(stats['min'])}–{fmt(stats['max'])})"


def print_table(results: dict[str, dict[str, Any]], ratios: dict[str, dict[str, Any]]) -> None:
    print(f"\n{'prompt':>7} {'backend':10}{'prefill tok/s (min-max)':>26}{'decode tok/s (min-max)':>26}")
    for n, res in results.items():
        for name, stats in res.items():
            print(f"{n:>7} {name:10}{spread(stats['prefill_tok_s']):>26}{spread(stats['decode_tok_s']):>26}")
        if n in ratios:
            x = ratios[n]
            print(f"{n:>7} {'pagellm/llama.cpp':17}{x['prefill_tok_s_pagellm_over_llama_cpp']:>18.2f}x"
                  f"{x['decode_tok_s_pagellm_over_llama_cpp']:>25.2f}x")
