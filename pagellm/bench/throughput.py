"""`pagellm bench throughput`: offline throughput of pagellm and its peers on the same requests."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import torch

from pagellm.bench import backends as be
from pagellm.bench import llama_cpp
from pagellm.bench.kv_strip import plot_kv_strip
from pagellm.bench.lora import run_lora
from pagellm.bench.rag import add_rag_args, check_rag_args, run_rag
from pagellm.bench.report import append_markdown_row, bar_plot, line_plot, ratio, warn_if_no_plots, write_json
from pagellm.bench.roofline import decode_efficiency, measure_machine
from pagellm.bench.workloads import (
    MODEL_PRESETS,
    Workload,
    bench_model_path,
    json_schema_workload,
    parallel_workload,
    random_workload,
    shared_prefix_workload,
)
from pagellm.config import EngineArgs
from pagellm.model.gguf_file import is_gguf_file
from pagellm.model.loader import check_model_folder, resolve_model_files
from pagellm.text import plural

DEFAULT_OUTPUT = Path("benchmarks/results")


def add_common_args(p: argparse.ArgumentParser, extra_workloads: tuple[str, ...] = ()) -> None:
    p.add_argument("--model", default=None, help="model folder (default: a random-weight --model-preset)")
    p.add_argument("--model-preset", default="w1-llama", choices=list(MODEL_PRESETS),
                   help="random-weight model built when no --model is given")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="weights and KV dtype")
    p.add_argument("--num-prompts", type=int, default=64, help="requests in the workload")
    p.add_argument("--prompt-len", type=int, nargs=2, default=(64, 512), metavar=("MIN", "MAX"),
                   help="prompt lengths in tokens, drawn uniformly")
    p.add_argument("--output-len", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"),
                   help="new tokens per request, drawn uniformly")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload's draws")
    p.add_argument("--workload", default="random", choices=("random", "shared-prefix", "parallel", *extra_workloads),
                   help="random prompts; prompts sharing a --prefix-len prefix; or --n samples per prompt"
                        + ("; json-schema: random prompts, every other one constrained to a JSON schema"
                           if "json-schema" in extra_workloads else "")
                        + ("; rag: questions about long documents on --model (default: the embedded model), "
                           "cold against a KV tier on disk warm from an earlier process, and the tier's cost on "
                           "W1 (--model-preset) when it never hits" if "rag" in extra_workloads else ""))
    p.add_argument("--prefix-len", type=int, default=1000, help="shared-prefix: tokens every prompt starts with")
    p.add_argument("--n", type=int, default=4, help="parallel: samples per prompt")
    p.add_argument("--block-size", type=int, default=16, help="pagellm: tokens per KV block (default 16)")
    p.add_argument("--kv-cache-memory", default="2GiB", help="pagellm: bytes for the KV cache (default 2GiB)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="pagellm: most sequences at once (default 256)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="pagellm: token budget of a step (default: the engine's, 2048)")
    p.add_argument("--output-dir", type=Path, default=DEFAULT_OUTPUT, help="where results, tables and plots go")


# Workloads draw with seed, seed + 1, ... (shared prefixes, one workload per serving rate): room is
# left below the top of what a torch generator takes.
WORKLOAD_SEED_RANGE = (-(2**63), 2**63 - 1)


def check_common_args(args: argparse.Namespace, gguf_ok: bool = False) -> None:
    """Refuse, before any work, flags no run could honour; each message names its flag. ``gguf_ok``:
    ``--model`` may be a GGUF file as well as a Hugging Face folder."""
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    for flag, (low, high) in (("--prompt-len", args.prompt_len), ("--output-len", args.output_len)):
        if not 1 <= low <= high:
            raise ValueError(f"{flag} MIN MAX needs 1 <= MIN <= MAX, got {low} {high}")
    if not WORKLOAD_SEED_RANGE[0] <= args.seed <= WORKLOAD_SEED_RANGE[1]:
        raise ValueError(f"--seed must be an integer in [-2**63, 2**63 - 1], got {args.seed}")
    if args.workload == "shared-prefix" and args.prefix_len < 1:
        raise ValueError(f"--prefix-len must be >= 1 for the shared-prefix workload, got {args.prefix_len}")
    if args.workload == "parallel" and args.n < 1:
        raise ValueError(f"--n must be >= 1, got {args.n}")
    # The engine's own checks of the engine flags (its step budget too, for this workload's longest
    # request), now rather than after the machine is measured.
    EngineArgs(**engine_kwargs(args)).step_token_budget(longest_request(args))
    if args.model:
        if gguf_ok:
            resolve_model_files(args.model)
        else:
            check_model_folder(args.model)


def check_output_dir(folder: Path) -> None:
    """The results go to ``folder``: one that could not be written is found before the run, not after
    it. Nothing is created here (a refused run leaves nothing behind)."""
    existing = folder.absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"--output-dir {str(folder)!r} cannot be created: {str(existing)!r} is a file")
    if not os.access(existing, os.W_OK):
        raise ValueError(f"--output-dir {str(folder)!r} cannot be written: {str(existing)!r} is not writable")


def longest_request(args: argparse.Namespace) -> int:
    """Tokens of the longest request the flags can draw (prompt, shared prefix and output)."""
    prefix = args.prefix_len if args.workload == "shared-prefix" else 0
    return prefix + args.prompt_len[1] + args.output_len[1]


def prepare(args: argparse.Namespace, gguf_ok: bool = False) -> tuple[Path, str, Any]:
    """Checked flags, then (model folder or, with ``gguf_ok``, GGUF file; model name; its transformers
    config); refuses workloads longer than the model's positions."""
    from transformers import AutoConfig

    check_common_args(args, gguf_ok)
    model, model_name = resolve_model(args)
    config = AutoConfig.from_pretrained(str(resolve_model_files(model).folder))
    limit = getattr(config, "max_position_embeddings", None)
    longest = longest_request(args)
    if limit is not None and longest > limit:
        parts = "--prefix-len + " if args.workload == "shared-prefix" else ""
        raise ValueError(f"the longest request is {longest} tokens ({parts}--prompt-len MAX + --output-len MAX), "
                         f"more than {model_name}'s max_position_embeddings ({limit}): lower them")
    check_output_dir(args.output_dir)  # last: every other refusal comes first
    warn_if_no_plots()
    return model, model_name, config


def build_workload(args: argparse.Namespace, vocab: int, seed: int | None = None) -> Workload:
    """The workload the flags describe, drawn with ``seed`` (default ``--seed``)."""
    prompt, output = tuple(args.prompt_len), tuple(args.output_len)
    seed = args.seed if seed is None else seed
    if args.workload == "shared-prefix":
        return shared_prefix_workload(args.num_prompts, args.prefix_len, prompt, output, vocab, seed)
    if args.workload == "parallel":
        return parallel_workload(args.num_prompts, args.n, prompt, output, vocab, seed)
    if args.workload == "json-schema":
        return json_schema_workload(args.num_prompts, prompt, output, vocab, seed)
    return random_workload(args.num_prompts, prompt, output, vocab, seed, name="random")


def resolve_model(args: argparse.Namespace) -> tuple[Path, str]:
    if args.model:
        path = Path(args.model)
        return path, path.stem if path.is_file() else path.name
    # A JSON schema needs a vocabulary that can spell JSON: the preset with a byte-level BPE tokenizer.
    bpe = args.workload == "json-schema"
    return bench_model_path(args.model_preset, args.dtype, bpe=bpe), args.model_preset + ("-bpe" if bpe else "")


def engine_kwargs(args: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    kw = {"block_size": args.block_size, "kv_cache_memory": args.kv_cache_memory, "max_num_seqs": args.max_num_seqs,
          **extra}
    if args.max_num_batched_tokens is not None:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    return kw


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("throughput", help="offline throughput against transformers (hf, hf-batched, hf-cb) and, "
                                          "on a GGUF file, llama.cpp")
    add_common_args(p, extra_workloads=("json-schema", "rag"))
    add_rag_args(p)
    p.add_argument("--backend", action="append", choices=be.BACKENDS, default=None,
                   help="repeatable; default: pagellm and " + ", ".join(be.HF_BACKENDS) + " on a folder, pagellm "
                        "and llama.cpp on a GGUF --model (llama.cpp: one request at a time, through "
                        f"llama-cpp-python, {llama_cpp.INSTALL})")
    p.add_argument("--threads", type=int, default=None,
                   help="threads of pagellm (torch) and llama.cpp alike (default: torch's own count)")
    p.add_argument("--hf-batch-sizes", type=int, nargs="+", default=list(be.HF_BATCH_SIZES),
                   help="hf-batched: the static batch sizes tried (the best one is reported)")
    p.add_argument("--lora", type=int, default=0, metavar="N",
                   help="pagellm only: the workload on N random LoRA adapters mixed uniformly vs the base model, and "
                        "one stream's decode speed with one adapter vs the base model (bench/lora.py)")
    p.add_argument("--lora-rank", type=int, default=16, help="--lora: the adapters' rank (default 16)")
    p.add_argument("--lora-runs", type=int, default=3, help="--lora: runs of each, their median reported (default 3)")
    p.add_argument("--kv-strip", action="store_true",
                   help="pagellm: also write its KV block grid over the run as a PNG strip (*-kv-grid.png, the "
                        "dashboard's grid over time; bench memory always writes it)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.workload == "rag":  # (--model is the documents' model; W1 runs on --model-preset)
        set_threads(args.threads)
        check_rag_args(args)
        check_common_args(argparse.Namespace(**{**vars(args), "model": None}))
        if args.model:
            resolve_model_files(args.model)
        check_output_dir(args.output_dir)
        w1 = random_workload(args.num_prompts, tuple(args.prompt_len), tuple(args.output_len),
                             MODEL_PRESETS[args.model_preset][1]["vocab_size"], args.seed, name="random")
        return run_rag(args, bench_model_path(args.model_preset, args.dtype), w1, engine_kwargs(args))
    gguf = bool(args.model) and is_gguf_file(args.model)
    backends = args.backend or (["pagellm", llama_cpp.NAME] if gguf else ["pagellm", *be.HF_BACKENDS])
    if len(set(backends)) != len(backends):
        raise ValueError(f"--backend given twice for the same backend: {' '.join(backends)}")
    if llama_cpp.NAME in backends:
        llama_cpp.check_gguf(args.model or f"the random-weight --model-preset {args.model_preset}")
    threads = set_threads(args.threads)
    if any(size < 1 for size in args.hf_batch_sizes):
        raise ValueError(f"--hf-batch-sizes must all be >= 1, got {' '.join(map(str, args.hf_batch_sizes))}")
    model, model_name, config = prepare(args, gguf_ok=True)
    workload = build_workload(args, config.vocab_size)
    if args.lora:
        if args.lora < 1 or args.lora_rank < 1 or args.lora_runs < 1:
            raise ValueError("--lora, --lora-rank and --lora-runs must be >= 1")
        return run_lora(args, model, model_name, config, workload, engine_kwargs(args))
    print(f"workload {workload.name}: {plural(workload.num_requests, 'request')} x n={workload.n}, "
          f"{plural(workload.prompt_tokens, 'prompt token')}, {plural(workload.output_tokens, 'output token')}; "
          f"model {model_name} ({args.dtype}, {plural(threads, 'thread')})")
    limits = measure_machine()
    print(f"machine: bf16 matmul {limits.matmul_tflops_bf16 * 1000:.0f} GFLOP/s, fp32 "
          f"{limits.matmul_tflops_fp32 * 1000:.0f} GFLOP/s, copy bandwidth {limits.copy_bandwidth_gbs:.1f} GB/s")
    results: dict[str, be.BackendResult] = {}
    roofline: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for name in backends:
        t0 = time.perf_counter()
        if name == "pagellm":
            res, llm = be.run_pagellm(model, workload, args.dtype, engine_kwargs(args), kv_strip=args.kv_strip)
            # Measured again right after the run: the limits are the best of both measurements.
            limits = limits.best(measure_machine())
            roofline = decode_efficiency(llm, res.steps, limits)
            if workload.name == "json-schema":
                extra.update(constrained_cost(res, model, workload, args))
            if workload.name == "shared-prefix":
                off, _ = be.run_pagellm(model, workload, args.dtype, engine_kwargs(args, enable_prefix_caching=False),
                                        label="pagellm-no-prefix-cache")
                extra["ttft_mean_s_prefix_cache"] = res.detail["ttft_mean_s"]
                extra["ttft_mean_s_no_prefix_cache"] = off.detail["ttft_mean_s"]
                extra["ttft_speedup_from_prefix_cache"] = off.detail["ttft_mean_s"] / res.detail["ttft_mean_s"]
                results["pagellm-no-prefix-cache"] = off
            del llm
        elif name == llama_cpp.NAME:
            res = llama_cpp.run_llama_cpp(model, workload, threads)
        elif gguf:
            res = be.BackendResult(name, 0.0, workload.num_requests, workload.prompt_tokens, 0,
                                   skipped="transformers reads a Hugging Face folder, not a GGUF file")
        elif name == "hf":
            res = be.run_hf(model, workload, args.dtype)
        elif name == "hf-batched":
            res = be.run_hf_batched(model, workload, args.dtype, tuple(args.hf_batch_sizes))
        else:
            res = be.run_hf_cb(model, workload, args.dtype)
        results[res.backend] = res
        took = time.perf_counter() - t0
        if res.skipped:
            print(f"  {name}: skipped ({res.skipped})")
        else:
            # elapsed_s times the workload alone; the rest is loading the model, a warm-up and checks.
            measured = "the best batch size's run" if name == "hf-batched" else "the workload"
            print(f"  {name}: {res.elapsed_s:.2f} s for {measured} (elapsed_s); {took:.1f} s in all with loading "
                  "and warm-up", flush=True)
    ours = results.get("pagellm")
    print(f"\n{'backend':26}{'req/s':>9}{'out tok/s':>12}{'total tok/s':>13}{'pagellm x':>11}")
    for name, r in results.items():
        if r.skipped:
            print(f"{name:26}{'skipped: ' + r.skipped}")
            continue
        x = ratio(ours.output_tokens_per_s, r.output_tokens_per_s) if ours else None
        print(f"{name:26}{r.requests_per_s:>9.2f}{r.output_tokens_per_s:>12.1f}{r.total_tokens_per_s:>13.1f}"
              f"{(f'{x:.2f}x' if x else '-'):>11}")
    if roofline:
        print(f"\ndecode: {roofline['decode_steps']} pure-decode steps, "
              f"mean batch {roofline['mean_decode_batch']:.1f}; "
              f"roofline {roofline['decode_roofline_s']:.2f} s vs measured {roofline['decode_measured_s']:.2f} s: "
              f"efficiency {roofline['decode_efficiency']:.0%} (limits: best of two measurements, bf16 matmul "
              f"{limits.matmul_tflops_bf16 * 1000:.0f} GFLOP/s, copy {limits.copy_bandwidth_gbs:.1f} GB/s)")
    if "constrained_decode_tok_s" in extra:
        print(f"json-schema: per-request decode tok/s {extra['constrained_decode_tok_s']:.1f} constrained vs "
              f"{extra['unconstrained_decode_tok_s']:.1f} unconstrained in the same run "
              f"({extra['constrained_vs_unconstrained']:.1%}); unconstrained ones "
              f"{extra['unconstrained_vs_baseline']:.1%} of a run with no constraint "
              f"({extra['baseline_decode_tok_s']:.1f})")
    if "ttft_mean_s_prefix_cache" in extra:
        print(f"shared prefix: TTFT {extra['ttft_mean_s_no_prefix_cache']:.3f} s without the prefix cache, "
              f"{extra['ttft_mean_s_prefix_cache']:.3f} s with it "
              f"({extra['ttft_speedup_from_prefix_cache']:.1f}x lower)")
    stem = f"throughput-{workload.name}-{model_name}"
    payload = {
        "command": "throughput", "model": model_name, "dtype": args.dtype,
        "workload": {"name": workload.name, "num_requests": workload.num_requests, "n": workload.n,
                     "prompt_tokens": workload.prompt_tokens, "output_tokens": workload.output_tokens,
                     **workload.meta},
        "machine_limits": limits.as_dict(), "results": {k: v.as_dict() for k, v in results.items()},
        "ratios_output_tokens_per_s": {k: ratio(ours.output_tokens_per_s, v.output_tokens_per_s)
                                       for k, v in results.items() if ours and not v.skipped and k != "pagellm"},
        "decode_roofline": roofline, **extra,
    }
    out = args.output_dir
    print(f"\nwrote {write_json(out / f'{stem}.json', payload)}")
    ran = [r for r in results.values() if not r.skipped]
    append_markdown_row(
        out / "throughput.md",
        ["date", "workload", "model", "dtype", *[f"{r.backend} out tok/s" for r in ran], "decode efficiency"],
        [time.strftime("%Y-%m-%d"), workload.name, model_name, args.dtype, *[r.output_tokens_per_s for r in ran],
         f"{roofline.get('decode_efficiency', 0):.0%}"],
    )
    bar_plot(out / f"{stem}.png", [r.backend for r in ran], [r.output_tokens_per_s for r in ran],
             "output tokens/s", f"{workload.name} on {model_name} ({args.dtype})")
    strip = results["pagellm"].kv_strip if "pagellm" in results else None
    if strip is not None:
        plot_kv_strip(out / f"{stem}-kv-grid.png", strip,
                      f"KV blocks by state, {workload.name} on {model_name} ({args.dtype})")
    return 0


def set_threads(threads: int | None) -> int:
    """The thread count of every backend: ``threads`` (set as torch's), or torch's own."""
    if threads is not None:
        if threads < 1:
            raise ValueError(f"--threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def constrained_cost(res: be.BackendResult, model: Path, workload: Workload,
                     args: argparse.Namespace) -> dict[str, Any]:
    """Mean per-request decode tok/s of the constrained and the unconstrained requests of ``res``, and of
    the same workload run again with no constraint at all (the unconstrained requests' baseline)."""
    base, _ = be.run_pagellm(model, workload, args.dtype, engine_kwargs(args), label="pagellm-unconstrained",
                             constrain=False)
    constrained = workload.meta["constrained"]
    mine = res.detail["decode_tok_s"]
    theirs = base.detail["decode_tok_s"]

    def mean(values: list[float]) -> float:
        return sum(values) / len(values) if values else float("nan")

    c = mean([v for v, k in zip(mine, constrained) if k])
    u = mean([v for v, k in zip(mine, constrained) if not k])
    b = mean([v for v, k in zip(theirs, constrained) if not k])
    return {"constrained_decode_tok_s": c, "unconstrained_decode_tok_s": u, "baseline_decode_tok_s": b,
            "constrained_vs_unconstrained": c / u, "unconstrained_vs_baseline": u / b}


def plot_kv_usage(path: Path, step_log: list, num_blocks: int, title: str) -> Path | None:
    times, usage = [], []
    t = 0.0
    for s in step_log:
        t += s.seconds
        times.append(t)
        usage.append(s.kv_blocks_in_use / num_blocks)
    return line_plot(path, {"KV blocks in use": (times, usage)}, "time (s)", "fraction of the pool", title)
