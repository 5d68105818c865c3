"""This machine's limits, and how close pagellm's decode steps come to them.

A decode step must at least read every weight once and every distinct attended K/V entry once (a
prefix shared by several sequences once), and do 2 FLOPs per weight per token plus the attention
FLOPs. Its roofline time is the larger of (bytes / memory bandwidth) and (FLOPs / matmul rate);
efficiency is roofline time over measured time, summed over the pure-decode steps of a run.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from pagellm.model.packed_linear import PackedLinear


@dataclass
class MachineLimits:
    matmul_tflops_bf16: float
    matmul_tflops_fp32: float
    copy_bandwidth_gbs: float  # bytes read + written per second by a large copy

    def as_dict(self) -> dict[str, float]:
        return asdict(self)

    def best(self, other: MachineLimits) -> MachineLimits:
        """The higher of two measurements of each limit (a busy moment only ever lowers one)."""
        return MachineLimits(max(self.matmul_tflops_bf16, other.matmul_tflops_bf16),
                             max(self.matmul_tflops_fp32, other.matmul_tflops_fp32),
                             max(self.copy_bandwidth_gbs, other.copy_bandwidth_gbs))


def _best_time(fn: Any, repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_machine(size: int = 2048, copy_bytes: int = 1 << 30, repeat: int = 5) -> MachineLimits:
    """Matmul rate (``torch.matmul`` at ``size``) in bf16 and fp32, and a large copy's bandwidth."""
    from pagellm.model.loader import cpu_has_bf16

    rates = {}
    for dtype in (torch.bfloat16, torch.float32):
        # Without native bfloat16 (no AVX512-BF16 or AMX) torch's bf16 matmul is a slow emulation, a
        # minute at full size: a small one measures the same (low) rate.
        n = size if dtype is not torch.bfloat16 or cpu_has_bf16() else 256
        a = torch.randn(n, n, dtype=dtype)
        b = torch.randn(n, n, dtype=dtype)
        rates[dtype] = 2 * n**3 / _best_time(lambda a=a, b=b: torch.matmul(a, b), repeat) / 1e12
    src = torch.empty(copy_bytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src).fill_(0)  # touched first: page faults are not bandwidth
    seconds = _best_time(lambda: dst.copy_(src), repeat)
    return MachineLimits(rates[torch.bfloat16], rates[torch.float32], 2 * copy_bytes / seconds / 1e9)


@dataclass
class ModelCost:
    weight_bytes: int  # read every decode step (layers + LM head)
    flops_per_token: int  # 2 per weight
    kv_bytes_per_token: int  # K and V of every layer
    attn_flops_per_context_token: int  # q.k and p.v over one cached token, every layer
    embed_row_bytes: int


def model_cost(llm: Any) -> ModelCost:
    engine = llm.llm_engine
    cfg = engine.model_config
    element = torch.tensor([], dtype=engine.dtype).element_size()
    model = engine.model
    embed = model.embed_tokens.weight
    weights = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("embed_tokens"))
    # Packed linears keep their weights in buffers, not parameters.
    weights += sum(m.in_features * m.out_features + (m.bias.numel() if m.bias is not None else 0)
                   for m in model.modules() if isinstance(m, PackedLinear))
    if model.tie_word_embeddings and not isinstance(model.lm_head, PackedLinear):
        weights += embed.numel()  # the tied LM head reads the whole table (counted once above if packed)
    layers = cfg.num_hidden_layers
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return ModelCost(
        weight_bytes=weights * element,
        flops_per_token=2 * weights,
        kv_bytes_per_token=2 * layers * kv_heads * head_dim * element,
        attn_flops_per_context_token=4 * layers * cfg.num_attention_heads * head_dim,
        embed_row_bytes=cfg.hidden_size * element,
    )


def decode_efficiency(llm: Any, steps: list[Any], limits: MachineLimits) -> dict[str, Any]:
    """Roofline vs measured time over the run's pure-decode steps (``StepRecord``s with no prefill tokens)."""
    cost = model_cost(llm)
    rate = limits.matmul_tflops_bf16 if llm.llm_engine.dtype == torch.bfloat16 else limits.matmul_tflops_fp32
    steps = [s for s in steps if s.num_prefill_tokens == 0 and s.num_decode_seqs]
    measured = roofline = 0.0
    batch_sizes = []
    for s in steps:
        # K/V shared by several sequences (a common prefix) is charged once: a lower bound on the bytes.
        bytes_moved = (cost.weight_bytes + s.num_decode_seqs * cost.embed_row_bytes
                       + s.distinct_context_tokens * cost.kv_bytes_per_token)
        flops = s.num_decode_seqs * cost.flops_per_token + s.context_tokens * cost.attn_flops_per_context_token
        roofline += max(bytes_moved / (limits.copy_bandwidth_gbs * 1e9), flops / (rate * 1e12))
        measured += s.seconds
        batch_sizes.append(s.num_decode_seqs)
    return {
        "decode_steps": len(steps),
        "decode_measured_s": measured,
        "decode_roofline_s": roofline,
        "decode_efficiency": roofline / measured if measured else 0.0,
        "mean_decode_batch": sum(batch_sizes) / len(batch_sizes) if batch_sizes else 0.0,
        "max_decode_batch": max(batch_sizes, default=0),
        "weight_bytes": cost.weight_bytes,
        "kv_bytes_per_token": cost.kv_bytes_per_token,
    }
