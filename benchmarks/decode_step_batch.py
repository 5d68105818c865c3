"""Decode-step time by batch size on a real model: N sequences with prompts of --prompt-len tokens decode
--new-tokens tokens together (greedy, past EOS), and the decode-only steps' median time is reported per
N, with its ratio to one sequence's step (the quantized kernels' batching: issue of a step of 24 against
a step of 1).

    python benchmarks/decode_step_batch.py [--model FILE] [--batch 1,8,24] [--runs 3]
"""

from __future__ import annotations

import argparse
import statistics

from pagellm import LLM, SamplingParams
from pagellm.bench.step_log import StepLog
from pagellm.model.default_model import embedded_gguf_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a GGUF file or model folder (default: the embedded SmolLM2)")
    parser.add_argument("--batch", default="1,8,24")
    parser.add_argument("--prompt-len", type=int, default=320)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    llm = LLM(args.model or str(embedded_gguf_path()), max_model_len=1024, kv_cache_memory="1GiB")
    vocab = llm.llm_engine.vocab_size
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True, detokenize=False)
    base = None
    for n in (int(b) for b in args.batch.split(",")):
        medians = []
        for run in range(args.runs):
            llm.reset_prefix_cache()
            prompts = [{"prompt_token_ids": [(97 * (i + 1) + 31 * j + run) % (vocab - 10) + 5
                                             for j in range(args.prompt_len)]} for i in range(n)]
            log = StepLog.install(llm.llm_engine)
            llm.generate(prompts, params, use_tqdm=False)
            log.uninstall()
            steps = [r.seconds for r in log.records if r.num_prefill_tokens == 0 and r.num_decode_seqs == n]
            medians.append(statistics.median(steps) * 1e3)
        ms = statistics.median(medians)
        base = base or ms
        print(f"batch {n:3d}: decode step {ms:7.2f} ms (runs {', '.join(f'{m:.2f}' for m in medians)}), "
              f"x{ms / base:.2f} of batch 1, {n / ms * 1e3:.0f} tok/s")


if __name__ == "__main__":
    main()
