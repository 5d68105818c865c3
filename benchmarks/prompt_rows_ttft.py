"""Prompt rows of a quantized model, short and long: the embedded SmolLM2 GGUF (or ``--model``) on the
offline API, one request at a time, greedy, one new token. Per repeat: a fresh 2,048-token prompt (the
whole prompt computed, in chunks of 512), the same prompt again (all cached but its last token's
block) and a fresh 24-token prompt; prints the median of each over ``--repeats``. Run it on two
checkouts to compare their prompt paths (``PYTHONPATH=other-checkout``).

    python benchmarks/prompt_rows_ttft.py [--repeats 3] [--label NAME]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from pagellm import LLM, SamplingParams
from pagellm.model.default_model import default_model_path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a GGUF file or model folder (default: the embedded SmolLM2)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--label", default="pagellm")
    args = p.parse_args()
    llm = LLM(str(args.model or default_model_path()), enable_prefix_caching=True, max_num_batched_tokens=512)
    params = SamplingParams(temperature=0, max_tokens=1)
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(1000, 40000) for _ in range(n)]

    def seconds(tokens: list[int]) -> float:
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": tokens}], params, use_tqdm=False)
        return time.perf_counter() - start

    fresh, cached, short = [], [], []
    for _ in range(args.repeats):
        long_prompt = prompt(2048)
        fresh.append(seconds(long_prompt))
        cached.append(seconds(long_prompt))
        short.append(seconds(prompt(24)))
    med = statistics.median
    print(f"{args.label}: 2,048-token prompt {med(fresh):.2f} s ({2048 / med(fresh):.0f} tok/s); the same, cached: "
          f"{med(cached) * 1e3:.0f} ms; 24-token prompt {med(short) * 1e3:.0f} ms (median of {args.repeats})")


if __name__ == "__main__":
    main()
