"""Customer-service workload: 100 requests share a 1,000-token system prompt.

Each has its own ~50-token user message and generates 64 tokens. Prints the peak KV
blocks in use and the time to first token, with and without prefix caching.

    python benchmarks/prefix_sharing.py [--model PATH] [--requests 100] [--system-len 1000]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagellm import LLM, SamplingParams


def workload(n: int, system_len: int, user_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(4, vocab, (system_len,), generator=g).tolist()
    users = [torch.randint(4, vocab, (user_len + int(torch.randint(-5, 6, (1,), generator=g)),), generator=g).tolist()
             for _ in range(n)]
    return [system + u for u in users]


def run(model: str | None, prompts: list[list[int]], caching: bool, new_tokens: int, block_size: int) -> dict:
    longest = max(len(p) for p in prompts) + new_tokens
    blocks = len(prompts) * -(-longest // block_size) + 16  # room for every request unshared
    llm = LLM(model, max_model_len=longest, num_kv_blocks=blocks, block_size=block_size,
              enable_prefix_caching=caching, dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    ttfts = [o.metrics.time_to_first_token for o in outs]
    stats = llm.kv_cache_stats()
    return {
        "peak_blocks": stats.peak_in_use_blocks,
        "ttft_mean": statistics.mean(ttfts),
        "ttft_median": statistics.median(ttfts),
        "elapsed": elapsed,
        "hit_rate": stats.prefix_cache_hit_rate,
        "tokens": [o.outputs[0].token_ids for o in outs],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder (default: the embedded tiny Llama)")
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--system-len", type=int, default=1000)
    ap.add_argument("--user-len", type=int, default=50)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args()
    probe = LLM(args.model, max_model_len=64, num_kv_blocks=8)
    prompts = workload(args.requests, args.system_len, args.user_len, probe.llm_engine.vocab_size)
    del probe
    off = run(args.model, prompts, False, args.new_tokens, args.block_size)
    on = run(args.model, prompts, True, args.new_tokens, args.block_size)
    assert on["tokens"] == off["tokens"], "prefix caching changed the outputs"
    print(f"customer-service workload: {args.requests} requests, {args.system_len}-token shared system prompt, "
          f"~{args.user_len}-token messages, {args.new_tokens} new tokens, block_size {args.block_size}")
    print(f"{'':22}{'peak KV blocks':>16}{'TTFT mean (s)':>15}{'TTFT median (s)':>17}{'total (s)':>11}")
    for name, r in (("without prefix cache", off), ("with prefix cache", on)):
        print(f"{name:22}{r['peak_blocks']:>16}{r['ttft_mean']:>15.3f}{r['ttft_median']:>17.3f}{r['elapsed']:>11.2f}")
    print(f"peak blocks with sharing: {on['peak_blocks'] / off['peak_blocks']:.1%} of without "
          f"(saving {1 - on['peak_blocks'] / off['peak_blocks']:.1%}); prefix-cache hit rate {on['hit_rate']:.1%}; "
          f"TTFT {off['ttft_mean'] / on['ttft_mean']:.1f}x lower with the cache; outputs identical")


if __name__ == "__main__":
    main()
