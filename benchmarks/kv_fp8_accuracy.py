"""How closely an fp8 KV cache follows the model's own-dtype cache on the embedded SmolLM2-135M-Instruct.

For each question, the float cache's greedy answer (``--max-tokens`` tokens) is scored again, prompt and
answer, through an engine per KV cache setting; at every answer position we compare the next token each
setting would pick with the float cache's pick, and the log-probability it gives the float cache's
token. Prints one table row per setting: the share of positions where the greedy choice agrees, and
the mean and largest |difference| of the log-probabilities.

    python benchmarks/kv_fp8_accuracy.py [--max-tokens 200] [--dtype float32]
"""

from __future__ import annotations

import argparse
import statistics

from pagellm import LLM, SamplingParams
from pagellm.model.default_model import embedded_gguf_path

QUESTIONS = [
    "Explain how a refrigerator works.",
    "Write a short story about a lighthouse keeper.",
    "What are the main causes of the French Revolution?",
    "Give three tips for writing clean Python code.",
    "Describe the water cycle to a ten-year-old.",
]
SETTINGS = {  # label -> engine arguments
    "fp8 (e4m3), scales computed (default)": dict(kv_cache_dtype="fp8"),
    "fp8 (e4m3), unscaled": dict(kv_cache_dtype="fp8", calculate_kv_scales=False),
    "fp8_e5m2, scales computed (default)": dict(kv_cache_dtype="fp8_e5m2"),
    "fp8_e5m2, unscaled": dict(kv_cache_dtype="fp8_e5m2", calculate_kv_scales=False),
}


def scored(llm: LLM, seq: list[int], start: int) -> list[dict[int, float]]:
    (out,) = llm.generate([{"prompt_token_ids": seq}], SamplingParams(max_tokens=1, prompt_logprobs=1),
                          use_tqdm=False)
    return [{t: lp.logprob for t, lp in d.items()} for d in out.prompt_logprobs[start:]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    path = str(embedded_gguf_path())
    common = dict(dtype=args.dtype, max_model_len=1024, kv_cache_memory="64MiB")
    base = LLM(path, **common)
    sequences = []
    for q in QUESTIONS:
        out = base.chat([{"role": "user", "content": q}], SamplingParams(temperature=0, max_tokens=args.max_tokens),
                        use_tqdm=False)[0]
        seq = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        sequences.append((seq, len(out.prompt_token_ids)))
    reference = [scored(base, seq, start) for seq, start in sequences]
    print(f"SmolLM2-135M-Instruct Q4_1, {args.dtype}, {len(QUESTIONS)} answers of up to {args.max_tokens} tokens")
    print("| KV cache | greedy choice agrees | mean abs. logprob diff | max abs. logprob diff |")
    print("|---|---:|---:|---:|")
    for label, extra in SETTINGS.items():
        llm = LLM(path, **common, **extra)
        agree = total = 0
        diffs: list[float] = []
        for (seq, start), want in zip(sequences, reference):
            got = scored(llm, seq, start)
            for pos, (w, g) in enumerate(zip(want, got)):
                token = seq[start + pos]
                agree += max(w, key=w.__getitem__) == max(g, key=g.__getitem__)
                total += 1
                if token in g and token in w:
                    diffs.append(abs(w[token] - g[token]))
        print(f"| {label} | {agree / total:.1%} | {statistics.mean(diffs):.3f} | {max(diffs):.2f} |", flush=True)


if __name__ == "__main__":
    main()
