"""Greedy outputs of workload W1 on pagellm, as one digest: a refactoring that must not change what
the engine computes keeps it equal.

    python benchmarks/greedy_digest.py [--dtype float32] [--num-prompts 64] [--out tokens.json]

Prints the SHA-256 of every request's output token ids (in request order); ``--out`` also writes
the ids, to find the first request that differs between two runs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

from pagellm import LLM, SamplingParams
from pagellm.bench.workloads import bench_model_path, random_workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    model = bench_model_path("w1-llama", args.dtype)
    llm = LLM(str(model), dtype=args.dtype, kv_cache_memory="2GiB")
    workload = random_workload(args.num_prompts, (64, 512), (32, 256), llm.llm_engine.vocab_size, seed=0)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in workload.output_lens]
    outputs = llm.generate(workload.prompts, params, use_tqdm=False)
    ids = [out.outputs[0].token_ids for out in outputs]
    digest = hashlib.sha256(json.dumps(ids).encode()).hexdigest()
    if args.out is not None:
        args.out.write_text(json.dumps(ids))
    print(f"W1 greedy ({args.dtype}, {len(ids)} requests, {sum(map(len, ids))} tokens): sha256 {digest}")


if __name__ == "__main__":
    main()
