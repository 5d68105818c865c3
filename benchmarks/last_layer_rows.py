"""W1 with the last decoder layer on every row, and on the used rows only, alternating in one process.

In a step with prompt tokens the last layer stores every token's K/V but runs its attention, output
projection and MLP only on the rows that are sampled or scored (``OutputRows``). This runs W1 both
ways on the same engine, alternating (this machine is noisy over minutes), and checks that both give
the same tokens.

    python benchmarks/last_layer_rows.py [--model-preset w1-llama|qwen2-0.5b] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import pagellm.worker.model_runner as model_runner
from pagellm import LLM, SamplingParams
from pagellm.bench.step_log import StepLog
from pagellm.bench.workloads import MODEL_PRESETS, bench_model_path, random_workload


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-preset", default="w1-llama", choices=sorted(MODEL_PRESETS))
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    path = bench_model_path(args.model_preset, "bfloat16")
    llm = LLM(str(path), dtype="bfloat16", max_model_len=800)
    w = random_workload(64, (64, 512), (32, 256), llm.llm_engine.vocab_size)
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for o in w.output_lens]
    llm.generate(w.prompts[:2], [sp.clone(max_tokens=4) for sp in params[:2]], use_tqdm=False)  # warm-up
    used_rows = model_runner.choose_output_rows
    ways = {"every row": lambda *a: None, "used rows": used_rows}
    totals: dict[str, list[float]] = {k: [] for k in ways}
    prefills: dict[str, list[float]] = {k: [] for k in ways}
    outputs = {}
    try:
        for _ in range(args.repeats):
            for name, choose in ways.items():
                model_runner.choose_output_rows = choose
                llm.reset_prefix_cache()
                engine = llm.llm_engine
                log = StepLog.install(engine)
                t0 = time.perf_counter()
                outputs[name] = llm.generate(w.prompts, params, use_tqdm=False)
                totals[name].append(time.perf_counter() - t0)
                prefills[name].append(sum(s.seconds for s in log.records if s.num_prefill_tokens))
                log.uninstall()
                print(f"last layer on {name}: {totals[name][-1]:.3f} s ({w.output_tokens / totals[name][-1]:.1f} "
                      f"output tok/s), prefill steps {prefills[name][-1]:.3f} s", flush=True)
    finally:
        model_runner.choose_output_rows = used_rows
    # (W1 asks for no logprobs; the tests check that logprobs are the same bits both ways.)
    same = all(a.outputs[0].token_ids == b.outputs[0].token_ids
               for a, b in zip(outputs["every row"], outputs["used rows"]))
    print(f"same tokens both ways: {same}")
    for name in ways:
        print(f"median, {name}: {statistics.median(totals[name]):.3f} s, prefill steps "
              f"{statistics.median(prefills[name]):.3f} s")


if __name__ == "__main__":
    main()
