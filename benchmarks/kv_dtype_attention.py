"""Decode attention over one layer's pools per KV cache dtype: the native kernel at a long context.

Times ``native.paged_decode_attention`` (one query token per sequence over its own blocks, scattered
through the pool as a long-running server leaves them) for float32, bfloat16 and fp8 pools of the same
values, queries in the model's dtype, SmolLM2-135M's attention shape by default. Prints the median of
the repeats per dtype and the speed of each against bfloat16 pools.

    .venv/bin/python benchmarks/kv_dtype_attention.py --context 2048 --seqs 1 8
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagellm.kernels import native

POOLS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn,
         "fp8_e5m2": torch.float8_e5m2}


def time_decode(seqs: int, context: int, heads: int, kv_heads: int, head_dim: int, pool: torch.dtype,
                query: torch.dtype, repeats: int) -> float:
    """Median seconds of one decode attention call."""
    block_size = 16
    blocks = seqs * context // block_size
    g = torch.Generator().manual_seed(0)
    tables = torch.randperm(blocks, generator=g).view(seqs, -1).contiguous()
    lens = torch.full((seqs,), context, dtype=torch.int64)
    k = torch.randn(blocks, kv_heads, head_dim, block_size, generator=g).to(pool)
    v = torch.randn(blocks, kv_heads, block_size, head_dim, generator=g).to(pool)
    q = torch.randn(seqs, heads, head_dim, generator=g).to(query)
    scratch = native.scratch_for(heads, head_dim, block_size, tables.shape[1])
    for _ in range(3):
        native.paged_decode_attention(q, k, v, tables, lens, scratch, head_dim**-0.5)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        native.paged_decode_attention(q, k, v, tables, lens, scratch, head_dim**-0.5)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--seqs", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--query-dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if native.load() is None:
        raise SystemExit("the native kernels are not available (PAGELLM_NATIVE_KERNELS=0, or no C compiler)")
    torch.set_num_threads(args.threads)
    query = POOLS[args.query_dtype]
    print(f"decode attention, one layer: {args.heads} heads / {args.kv_heads} KV heads of {args.head_dim}, "
          f"context {args.context}, {args.query_dtype} queries, {args.threads} threads, median of {args.repeats}")
    print(f"{'seqs':>5} {'pools':>9} {'ms':>8} {'MB read':>8} {'vs bfloat16':>12}")
    for seqs in args.seqs:
        times = {name: time_decode(seqs, args.context, args.heads, args.kv_heads, args.head_dim, dtype, query,
                                   args.repeats) for name, dtype in POOLS.items()}
        for name, dtype in POOLS.items():
            megabytes = 2 * seqs * args.context * args.kv_heads * args.head_dim * dtype.itemsize / 1e6
            print(f"{seqs:>5} {name:>9} {times[name] * 1e3:>8.3f} {megabytes:>8.1f} "
                  f"{times['bfloat16'] / times[name]:>11.2f}x")


if __name__ == "__main__":
    main()
