"""`pagellm bench memory`: KV memory paged vs contiguous reservation vs transformers' static cache."""

from __future__ import annotations

import argparse
import time
from typing import Any

from pagellm.bench import backends as be
from pagellm.bench.kv_strip import plot_kv_strip
from pagellm.bench.report import append_markdown_row, write_json
from pagellm.bench.roofline import model_cost
from pagellm.bench.throughput import (
    add_common_args,
    build_workload,
    engine_kwargs,
    longest_request,
    plot_kv_usage,
    prepare,
)
from pagellm.text import plural


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("memory", help="KV memory: paged vs contiguous reservation vs static cache")
    add_common_args(p)
    p.add_argument("--max-model-len", type=int, default=2048,
                   help="what a contiguous server reserves per request (default 2048)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    longest = longest_request(args)
    if args.max_model_len < longest:
        raise ValueError(f"--max-model-len {args.max_model_len} is shorter than the workload's longest request "
                         f"({longest} tokens): a contiguous server of that length could not take it; raise "
                         "--max-model-len")
    model, model_name, config = prepare(args)
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and args.max_model_len > limit:
        raise ValueError(f"--max-model-len {args.max_model_len} is more than {model_name}'s max_position_embeddings "
                         f"({limit}): no server of this model reserves that much")
    workload = build_workload(args, config.vocab_size)
    res, llm = be.run_pagellm(model, workload, args.dtype, engine_kwargs(args), kv_strip=True)
    engine = llm.llm_engine
    cost = model_cost(llm)
    per_token = cost.kv_bytes_per_token
    block_bytes = per_token * engine.block_size
    log = res.steps
    peak = max(log, key=lambda s: s.kv_blocks_in_use)  # the first step at the high: its stats were taken
    if peak.kv_fragmentation is None or peak.kv_sequences is None:
        raise RuntimeError("the step log has no KV statistics at its peak (internal error)")
    # Concurrency at the peak: the sequences that held blocks then.
    lengths = [len(p) + o for p, o in zip(workload.prompts, workload.output_lens)]
    peak_seqs = max(1, peak.kv_sequences)
    max_len = args.max_model_len
    paged_bytes = peak.kv_blocks_in_use * block_bytes
    contiguous_bytes = peak_seqs * max_len * per_token
    static_len = max(len(p) for p in workload.prompts) + max(workload.output_lens)
    static_bytes = workload.num_requests * workload.n * static_len * per_token
    budget = engine.kv_cache_manager.num_blocks * block_bytes
    mean_blocks = sum(-(-n // engine.block_size) for n in lengths) / len(lengths)
    capacity_paged = int(engine.kv_cache_manager.num_blocks // mean_blocks)
    capacity_contiguous = int(budget // (max_len * per_token))
    payload: dict[str, Any] = {
        "command": "memory", "model": model_name, "dtype": args.dtype, "workload": workload.name,
        "block_size": engine.block_size, "kv_bytes_per_token": per_token,
        "peak_blocks_in_use": peak.kv_blocks_in_use, "sequences_at_peak": peak_seqs, "paged_peak_bytes": paged_bytes,
        "contiguous_reservation_bytes": contiguous_bytes, "contiguous_max_model_len": max_len,
        "hf_static_cache_bytes": static_bytes, "hf_static_cache_len": static_len,
        "fragmentation_at_peak": peak.kv_fragmentation,
        "kv_budget_bytes": budget, "max_concurrent_paged": capacity_paged,
        "max_concurrent_contiguous": capacity_contiguous,
    }
    mib = 2**20
    print(f"workload {workload.name}: {plural(workload.num_requests, 'request')}, model {model_name} ({args.dtype}), "
          f"block_size {engine.block_size}")
    print(f"peak KV allocated (paged):          {paged_bytes / mib:10.1f} MiB "
          f"({plural(peak.kv_blocks_in_use, 'block')})")
    print(f"contiguous max_model_len={max_len} x {peak_seqs}: {contiguous_bytes / mib:10.1f} MiB "
          f"({contiguous_bytes / paged_bytes:.1f}x)")
    print(f"transformers static cache ({workload.num_requests * workload.n} x {static_len}): "
          f"{static_bytes / mib:10.1f} MiB ({static_bytes / paged_bytes:.1f}x)")
    print(f"internal fragmentation at peak: {peak.kv_fragmentation:.2%} of allocated slots")
    print(f"a {budget / mib:.0f} MiB KV budget holds {plural(capacity_paged, 'sequence')} paged vs "
          f"{capacity_contiguous} "
          f"contiguous ({capacity_paged / max(capacity_contiguous, 1):.1f}x)")
    out = args.output_dir
    stem = f"memory-{workload.name}-{model_name}"
    print(f"wrote {write_json(out / f'{stem}.json', payload)}")
    append_markdown_row(
        out / "memory.md",
        ["date", "workload", "model", "paged peak MiB", "contiguous MiB", "static cache MiB",
         "fragmentation at peak", "max seqs paged", "max seqs contiguous"],
        [time.strftime("%Y-%m-%d"), workload.name, model_name, paged_bytes / mib, contiguous_bytes / mib,
         static_bytes / mib, f"{peak.kv_fragmentation:.2%}", capacity_paged, capacity_contiguous],
    )
    plot_kv_usage(out / f"{stem}-kv-usage.png", log, engine.kv_cache_manager.num_blocks,
                  f"KV blocks in use, {workload.name} on {model_name}")
    if res.kv_strip is not None:  # its companion: which blocks, in which state
        plot_kv_strip(out / f"{stem}-kv-grid.png", res.kv_strip, f"KV blocks by state, {workload.name} on {model_name}")
    return 0
