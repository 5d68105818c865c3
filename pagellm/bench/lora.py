"""`pagellm bench throughput --lora N`: the workload on N random rank-``--lora-rank`` adapters mixed
uniformly (request i runs adapter i mod N) against the base model, and one stream's decode speed with
one adapter against the base model; each the median of ``--lora-runs`` runs, base and adapters
alternating so that a shared machine's drift touches both alike."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from pagellm.bench import backends as be
from pagellm.bench.report import write_json
from pagellm.bench.workloads import Workload, random_workload
from pagellm.lora.request import LoRARequest

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def write_random_adapters(config: Any, folder: Path, count: int, rank: int, seed: int = 0) -> list[Path]:
    """``count`` PEFT adapters of ``config``'s model (every projection, random A and B) in ``folder``."""
    from safetensors.torch import save_file

    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, (config.num_key_value_heads or config.num_attention_heads) * head_dim
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    gen = torch.Generator().manual_seed(seed)
    paths = []
    for i in range(count):
        path = folder / f"adapter-{i}"
        path.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for layer in range(config.num_hidden_layers):
            for module, (fan_in, fan_out) in shapes.items():
                part = "self_attn" if module in ATTENTION else "mlp"
                prefix = f"base_model.model.model.layers.{layer}.{part}.{module}"
                tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.02
                tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.02
        save_file(tensors, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(ATTENTION + MLP),
            "bias": "none", "use_rslora": False}))
        paths.append(path)
    return paths


def run_lora(args: argparse.Namespace, model: Path, model_name: str, config: Any, workload: Workload,
             kwargs: dict[str, Any]) -> int:
    """Print and write the mixed-adapter and single-stream comparisons; returns the exit status."""
    n, rank = args.lora, args.lora_rank
    adapters = write_random_adapters(config, args.output_dir / "lora-adapters" / model_name, n, rank)
    loras = [LoRARequest(f"adapter-{i}", i + 1, str(p)) for i, p in enumerate(adapters)]
    lora_kwargs = {**kwargs, "enable_lora": True, "max_loras": n, "max_lora_rank": rank}
    mixed = [loras[i % n] for i in range(workload.num_requests)]
    stream = random_workload(1, (128, 128), (256, 256), config.vocab_size, args.seed, name="single-stream")
    times: dict[str, list[float]] = {"base": [], "lora": [], "base_decode": [], "lora_decode": []}
    for run in range(args.lora_runs):
        for key, kw, assigned in (("base", kwargs, None), ("lora", lora_kwargs, mixed)):
            res, llm = be.run_pagellm(model, workload, args.dtype, kw, label=f"{key}-{run + 1}", loras=assigned)
            times[key].append(res.elapsed_s)
            print(f"  {key} run {run + 1}: {res.elapsed_s:.2f} s", flush=True)
            del llm
        for key, kw, assigned in (("base_decode", kwargs, None), ("lora_decode", lora_kwargs, loras[:1])):
            res, llm = be.run_pagellm(model, stream, args.dtype, kw, label=f"{key}-{run + 1}", loras=assigned)
            times[key].append(res.detail["decode_tok_s"][0])
            print(f"  {key} run {run + 1}: {times[key][-1]:.1f} tok/s", flush=True)
            del llm
    med = {k: statistics.median(v) for k, v in times.items()}
    mixed_x, decode_share = med["lora"] / med["base"], med["lora_decode"] / med["base_decode"]
    print(f"\nLoRA: {n} adapters of rank {rank} mixed uniformly over {workload.name} "
          f"({workload.num_requests} requests), medians of {args.lora_runs} runs:")
    print(f"  base {med['base']:.2f} s, adapters {med['lora']:.2f} s: {mixed_x:.2f}x the base model's time "
          f"(target <= 1.3x)")
    print(f"  one stream: base {med['base_decode']:.1f} tok/s, one adapter {med['lora_decode']:.1f} tok/s: "
          f"{decode_share:.0%} of the base model's decode speed (target >= 85%)")
    payload = {"command": "throughput --lora", "model": model_name, "dtype": args.dtype, "adapters": n,
               "rank": rank, "runs": times, "medians": med, "mixed_time_vs_base": mixed_x,
               "single_stream_decode_vs_base": decode_share, "date": time.strftime("%Y-%m-%d")}
    print(f"wrote {write_json(args.output_dir / f'throughput-lora-{workload.name}-{model_name}.json', payload)}")
    return 0
